"""The queue topology, declared in one place.

Work queues are durable quorum queues with a delivery limit: a message that has been
delivered and returned more than ``delivery_limit`` times is dead-lettered by the broker
itself (the backstop for a message that crashes its consumer). Each work queue has its own
dead-letter queue ``<queue>.dlq`` bound to the dead-letter exchange with the queue's name as
routing key; consumers also dead-letter explicitly, with the reason in a header.
``weight-updates`` is a fanout exchange: every subscriber gets its own queue.

Messages for a work queue are published to its own direct exchange ``<queue>.in``, never to
the default exchange: a broker user's write right can then be limited to the queues of its
role (see :mod:`hpcrl_common.access`). The topology is declared by each service at start
(``broker.declare_topology``) or once by an admin (``hpcrl-broker-admin``), after which the
services only :meth:`Topology.check` that it exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from hpcrl_common.messages import (
    BenchResult,
    Candidate,
    GenerateRequest,
    Message,
    RolloutBatch,
    WeightUpdate,
)

GENERATE_REQUESTS = "generate-requests"
CODE_TO_BENCH = "code-to-bench"
BENCH_RESULTS = "bench-results"
ROLLOUT_BATCHES = "rollout-batches"
WEIGHT_UPDATES = "weight-updates"
DEAD_LETTER_EXCHANGE = "dead-letter"

WORK_QUEUES: dict[str, type[Message]] = {
    GENERATE_REQUESTS: GenerateRequest,
    CODE_TO_BENCH: Candidate,
    BENCH_RESULTS: BenchResult,
    ROLLOUT_BATCHES: RolloutBatch,
}
FANOUT_EXCHANGES: dict[str, type[Message]] = {WEIGHT_UPDATES: WeightUpdate}

INBOX_SUFFIX = ".in"

REASON_HEADER = "x-hpcrl-reason"
SOURCE_QUEUE_HEADER = "x-hpcrl-source-queue"
CONSUMER_HEADER = "x-hpcrl-consumer"


@dataclass(frozen=True)
class Topology:
    """Names and declarations. ``namespace`` isolates experiments (and tests) on one vhost."""

    namespace: str = ""
    delivery_limit: int = 5

    def name(self, base: str) -> str:
        return f"{self.namespace}.{base}" if self.namespace else base

    def dlq(self, base: str) -> str:
        return self.name(f"{base}.dlq")

    @property
    def dead_letter_exchange(self) -> str:
        return self.name(DEAD_LETTER_EXCHANGE)

    def work_exchange(self, base: str) -> str:
        """The exchange that publishers of work queue ``base`` write to."""
        return inbox_of(self.name(base))

    def subscriber_queue(self, exchange_base: str, subscriber: str) -> str:
        return self.name(f"{exchange_base}.{subscriber}")

    def expected_schema(self, queue: str) -> type[Message]:
        for base, cls in {**WORK_QUEUES, **FANOUT_EXCHANGES}.items():
            if queue == self.name(base) or queue.startswith(self.name(base) + "."):
                return cls
        raise KeyError(f"no schema is registered for queue {queue!r}")

    def declare(self, channel: BlockingChannel) -> None:
        """Idempotently declare every exchange and queue the services use."""
        channel.exchange_declare(self.dead_letter_exchange, exchange_type="direct", durable=True)
        for base in WORK_QUEUES:
            self._declare_work_queue(channel, base)
        for base in FANOUT_EXCHANGES:
            channel.exchange_declare(self.name(base), exchange_type="fanout", durable=True)
            self._declare_dlq(channel, base)

    def missing(self, open_channel: Callable[[], BlockingChannel]) -> list[str]:
        """What ``declare`` makes and the broker lacks, by passive declares (no rights needed).

        A failed passive declare closes its channel, so each check gets a fresh one.
        """
        absent = []
        checks: list[tuple[str, Callable[[BlockingChannel], object]]] = [
            (f"exchange {self.dead_letter_exchange}",
             lambda ch: ch.exchange_declare(self.dead_letter_exchange, passive=True))]
        for base in WORK_QUEUES:
            queue, inbox = self.name(base), self.work_exchange(base)
            checks.append((f"queue {queue}", lambda ch, q=queue: ch.queue_declare(q, passive=True)))
            checks.append((f"exchange {inbox}",
                           lambda ch, e=inbox: ch.exchange_declare(e, passive=True)))
        for base in FANOUT_EXCHANGES:
            exchange = self.name(base)
            checks.append((f"exchange {exchange}",
                           lambda ch, e=exchange: ch.exchange_declare(e, passive=True)))
        channel = open_channel()
        for what, check in checks:
            try:
                check(channel)
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code != 404:
                    raise
                absent.append(what)
                channel = open_channel()
        if channel.is_open:
            channel.close()
        return absent

    def declare_subscriber(
        self, channel: BlockingChannel, exchange_base: str, subscriber: str, *, durable: bool
    ) -> str:
        """A queue of one subscriber to a fanout exchange.

        Durable subscribers (the scheduler) get every update even across their restarts;
        ephemeral ones (generator replicas) get an auto-deleted queue and read the
        checkpoint manifest on start instead.
        """
        queue = self.subscriber_queue(exchange_base, subscriber)
        arguments = self.dead_letter_arguments(exchange_base)
        if durable:
            channel.queue_declare(queue, durable=True, arguments=arguments)
        else:
            channel.queue_declare(queue, durable=False, auto_delete=True, arguments=arguments)
        channel.queue_bind(queue, self.name(exchange_base))
        return queue

    def _declare_work_queue(self, channel: BlockingChannel, base: str) -> None:
        self._declare_dlq(channel, base)
        channel.queue_declare(self.name(base), durable=True,
                              arguments=self.work_queue_arguments(base))
        channel.exchange_declare(self.work_exchange(base), exchange_type="direct", durable=True)
        channel.queue_bind(self.name(base), self.work_exchange(base), routing_key=self.name(base))

    def work_queue_arguments(self, base: str) -> dict[str, Any]:
        return {
            "x-queue-type": "quorum",
            "x-delivery-limit": self.delivery_limit,
            **self.dead_letter_arguments(base),
        }

    def _declare_dlq(self, channel: BlockingChannel, base: str) -> None:
        channel.queue_declare(self.dlq(base), durable=True)
        channel.queue_bind(self.dlq(base), self.dead_letter_exchange, routing_key=self.name(base))

    def dead_letter_arguments(self, base: str) -> dict[str, str]:
        return {
            "x-dead-letter-exchange": self.dead_letter_exchange,
            "x-dead-letter-routing-key": self.name(base),
        }

    def delete(self, channel: BlockingChannel) -> None:
        """Remove everything ``declare`` made (used by tests and `make clean-broker`)."""
        for base in [*WORK_QUEUES, *FANOUT_EXCHANGES]:
            if base in WORK_QUEUES:
                channel.queue_delete(self.name(base))
                channel.exchange_delete(self.work_exchange(base))
            else:
                channel.exchange_delete(self.name(base))
            channel.queue_delete(self.dlq(base))
        channel.exchange_delete(self.dead_letter_exchange)


def inbox_of(queue: str) -> str:
    """The exchange name of a full work-queue name (what :class:`Publish` routes through)."""
    return queue + INBOX_SUFFIX
