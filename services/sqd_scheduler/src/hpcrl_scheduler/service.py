"""The scheduler service: a thin shell around hpcrl_common.broker.Consumer.

* ``bench-results`` → :meth:`Scheduler.handle_result` (stored before the ack);
* ``candidate-commitments`` → :meth:`Scheduler.handle_commitment` (what the generator sent,
  which a result's rollout must match: :mod:`hpcrl_scheduler.commitments`);
* ``weight-updates`` (durable subscriber queue ``weight-updates.scheduler``) → policy version
  and the learner's progress, for the version floor and pacing;
* a timer runs :meth:`Scheduler.step`, publishes the outbox (marking rows sent once the
  broker confirmed them) and refreshes the gauges; once all T iterations are complete and
  the outbox is empty it stops the consumer, so ``serve`` exits 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import structlog

from hpcrl_common.access import SCHEDULER_SUBSCRIBER
from hpcrl_common.broker import Consumer, Delivery, Publish
from hpcrl_common.messages import (
    BenchResult,
    CandidateCommitment,
    CandidateCommitmentV1,
    Message,
    WeightUpdate,
)
from hpcrl_common.topology import (
    BENCH_RESULTS,
    CANDIDATE_COMMITMENTS,
    CONSUMER_HEADER,
    SOURCE_QUEUE_HEADER,
    WEIGHT_UPDATES,
)
from hpcrl_scheduler.scheduler import Scheduler
from hpcrl_scheduler.store import DEAD_LETTER_SUFFIX

log = structlog.get_logger("hpcrl.scheduler")
METRICS_REFRESH_S = 2.0


class SchedulerService:
    def __init__(
        self, scheduler: Scheduler, consumer: Consumer, on_tick: Callable[[], None] | None = None
    ) -> None:
        self.scheduler = scheduler
        self.consumer = consumer
        self.on_tick = on_tick
        self.finished = False
        self._pending: dict[int, Future] = {}
        self._refreshed_at = -METRICS_REFRESH_S
        consumer.subscribe(BENCH_RESULTS, self._on_result)
        consumer.subscribe(CANDIDATE_COMMITMENTS, self._on_commitment)
        consumer.subscribe_fanout(
            WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER, self._on_weight_update, durable=True
        )
        consumer.every(scheduler.section.tick_s, self.tick)

    def _on_result(self, message: Message, delivery: Delivery) -> list[Publish]:
        assert isinstance(message, BenchResult)
        self.scheduler.handle_result(message, publisher=delivery.user_id)
        return []

    def _on_commitment(self, message: Message, _delivery: Delivery) -> list[Publish]:
        # Either major: /1 (hashes only) during a rolling upgrade of the generators.
        assert isinstance(message, CandidateCommitment | CandidateCommitmentV1)
        self.scheduler.handle_commitment(message)
        return []

    def _on_weight_update(self, message: Message, _delivery: Delivery) -> list[Publish]:
        assert isinstance(message, WeightUpdate)
        # Refused: Reject (dead-lettered), not ours: Ignore; neither marks the id handled.
        self.scheduler.handle_weight_update(message)
        return []

    def tick(self) -> list[Publish]:
        self.scheduler.step()
        self.pump()
        now = time.monotonic()
        # The gauges are recomputed from the store (restart-proof); with thousands of
        # programs that costs ~0.1 s, so not on every tick.
        if now - self._refreshed_at >= METRICS_REFRESH_S:
            self.scheduler.refresh_metrics()
            self._refreshed_at = now
        if self.on_tick is not None:
            self.on_tick()
        if self.scheduler.done() and not self._pending and self.scheduler.store.count_unsent() == 0:
            if not self.finished:
                self.scheduler.refresh_metrics()
                log.info("all iterations complete", iterations=self.scheduler.section.iterations)
            self.finished = True
            if self.scheduler.section.exit_when_done:
                self.consumer.stop()
        return []

    def pump(self) -> None:
        """Publish unsent outbox rows; mark each sent once the broker confirmed it."""
        store, topology = self.scheduler.store, self.consumer.topology
        for seq, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[seq]
            if future.exception() is None:
                with store.tx():
                    store.mark_sent(seq)
            else:
                log.warning("publish failed; will retry", seq=seq, error=repr(future.exception()))
        for seq, queue, message in store.unsent():
            if seq in self._pending:
                continue
            if queue.endswith(DEAD_LETTER_SUFFIX):  # a held result refused: its dead letter
                base = queue.removesuffix(DEAD_LETTER_SUFFIX)
                item = Publish(
                    topology.name(base),
                    message,
                    exchange=topology.dead_letter_inbox(base),
                    headers=(
                        *store.outbox_headers(seq).items(),
                        (SOURCE_QUEUE_HEADER, topology.name(base)),
                        (CONSUMER_HEADER, self.consumer.client),
                    ),
                )
            else:
                item = Publish(topology.name(queue), message)
            self._pending[seq] = self.consumer.publish(item)

    def health(self) -> tuple[bool, dict[str, Any]]:
        detail: dict[str, Any] = {
            "iteration": self.scheduler.iteration(),
            "finished": self.finished,
            "unconfirmed": len(self._pending),
        }
        suspects = self.scheduler.suspect_hosts()
        if suspects:  # the operator's to judge: a host whose winners did not reproduce
            detail["suspect_hosts"] = suspects
        stuck = self.scheduler.pacing_stuck()
        if stuck is not None:  # no request admitted for too long: no progress is made
            detail["pacing_holds_every_request"] = stuck
        return stuck is None, detail
