"""`hpcrl-benchmarker serve`: a thin shell around the pipeline on hpcrl_common's Consumer.

Consumes ``code-to-bench``, publishes one ``bench-results`` message per candidate (id =
candidate id; the group id, index, bench spec and rollout data are copied through). The
Consumer acks only after the result is confirmed, so a replica killed mid-candidate leaves it
unacked and another replica benchmarks it; redeliveries to the same replica are answered from
its memory of completed ids.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

import structlog

from hpcrl_benchmarker import harnesses
from hpcrl_benchmarker.config import BenchmarkerConfig, BenchmarkerSection
from hpcrl_benchmarker.harnesses import HarnessError
from hpcrl_benchmarker.metrics import (
    CLIENT_LATENCY,
    CLIENT_REQUESTS,
    CLIENT_VERDICTS,
    GFLOPS,
    HOST,
    INFLIGHT,
    NOISY,
    RESULTS,
    SANDBOX_KILLS,
    STEP_SECONDS,
)
from hpcrl_benchmarker.pipeline import Benchmarker, Events
from hpcrl_benchmarker.steps import InternalError
from hpcrl_benchmarker.verdict import Verdict
from hpcrl_common import confirmation
from hpcrl_common.broker import DEFER, Consumer, Delivery, Publish, Reject
from hpcrl_common.messages import BenchResult, Candidate, Message, RewardRequest, text_sha256
from hpcrl_common.task import TaskError, TaskSpec, builtin_tasks, load_task
from hpcrl_common.topology import BENCH_RESULTS, CODE_TO_BENCH, REWARD_REQUESTS, Topology

log = structlog.get_logger("hpcrl.benchmarker")


class HandedBack(RuntimeError):
    """A confirmation given back to the queue for another replica (not a failure)."""


class TaskCatalogue:
    """Tasks a candidate may name: built-ins by name, extra ones only if configured (a
    message must never make the service read an arbitrary path)."""

    def __init__(self, extra_paths: list[str]) -> None:
        self._allowed = set(builtin_tasks()) | set(extra_paths)
        self._cache: dict[str, TaskSpec] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> TaskSpec:
        if name not in self._allowed:
            raise Reject(
                f"unknown task {name!r} (this replica accepts: {', '.join(sorted(self._allowed))})"
            )
        with self._lock:
            if name not in self._cache:
                try:
                    task = load_task(name)
                    harnesses.for_task(task)  # a harness that can run it
                    self._cache[name] = task
                except (TaskError, HarnessError, OSError) as exc:
                    raise Reject(f"task {name!r} cannot be loaded: {exc}") from None
            return self._cache[name]


class BenchHandler:
    def __init__(
        self,
        benchmarker: Benchmarker,
        section: BenchmarkerSection,
        results_queue: str,
        name: str,
        stopping: Callable[[], bool] = lambda: False,
        hand_back: Callable[[Delivery, Exception], None] | None = None,
    ) -> None:
        self.benchmarker = benchmarker
        self.hand_back = hand_back
        self.section = section
        self.results_queue = results_queue
        self.name = name
        self.tasks = TaskCatalogue(section.tasks)
        self.stopping = stopping

    def __call__(self, message: Message, delivery: Delivery) -> list[Publish] | object:
        assert isinstance(message, Candidate)
        if self.hand_back is not None and confirmation.prefer_another(
            message.generator, self.name, self.benchmarker.host.host_class, delivery.attempt
        ):
            # A scheduler's re-measurement of a winner this replica (or another class of
            # host) measured: once back to the queue, for another replica of the class.
            log.info("confirmation handed back for another replica", candidate=message.id)
            self.hand_back(delivery, HandedBack(f"{message.id}: for another replica"))
            return DEFER
        task = self.tasks.get(message.bench.task)
        if message.bench.opt_level not in task.compile.opt_levels:
            raise Reject(f"task {task.name!r} has no opt level {message.bench.opt_level!r}")
        events = Events()
        INFLIGHT.inc()
        try:
            verdict = self.benchmarker.evaluate(
                message.completion,
                stage=message.bench.stage,
                opt_level=message.bench.opt_level,
                task=task,
                events=events,
            )
        except InternalError:
            log.exception("benchmarker failure", candidate=message.id)
            raise  # not the candidate's fault: retried (the Consumer bounds the tries)
        finally:
            INFLIGHT.dec()
        for reason in events.sandbox_kills:
            SANDBOX_KILLS.labels(reason).inc()
        if verdict.status != "success" and self._shutting_down(verdict):
            # Slurm and systemd signal every process of the replica, the sandboxed kernel
            # included: a failure that ends during shutdown may be ours, not the kernel's.
            raise InternalError(f"shutting down: {verdict.status} not trusted; handed back")
        self._observe(message, verdict, task.name)
        return [
            Publish(
                self.results_queue,
                result_message(message, verdict, self.name, self.section.include_source),
            )
        ]

    def _shutting_down(self, verdict: Verdict) -> bool:
        """True when the service is stopping. A kernel killed by a stop signal may have got
        it together with the service, whose handler then runs a moment later on the main
        thread (within one loop tick): wait that moment before trusting the verdict."""
        if self.stopping() or not killed_by_stop_signal(verdict):
            return self.stopping()
        deadline = time.monotonic() + STOP_SIGNAL_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.01)
            if self.stopping():
                return True
        return False

    @staticmethod
    def _observe(message: Candidate, verdict: Verdict, task: str) -> None:
        # A scheduler's confirmation re-measures a verdict already counted: its time counts
        # (steps), not a second verdict (hpcrl_scheduler_confirmations_total counts it).
        again = confirmation.parse(message.generator) is not None
        if not again:
            RESULTS.labels(task=task, status=verdict.status).inc()
        if verdict.timing is not None and verdict.timing.noisy:
            NOISY.inc()
        if verdict.gflops is not None and not again:
            GFLOPS.labels(
                task=task, stage=str(message.bench.stage), opt_level=message.bench.opt_level
            ).observe(verdict.gflops)
        for step, seconds in verdict.durations_s.items():
            STEP_SECONDS.labels(step).observe(seconds)
        timing = verdict.timing
        log.info(
            "benchmarked",
            candidate=message.id,
            status=verdict.status,
            gflops=verdict.gflops,
            techniques=verdict.techniques,
            cv=None if timing is None else round(timing.cv, 4),
            attempts=None if timing is None else timing.attempts,
        )


class RewardHandler:
    """Outside trainers' requests (``reward-requests``, hpcrl-reward-client): judged as
    candidates are, each verdict sent to the requesting client's own queue only, never to
    the scheduler's. The client is the request's publisher as the broker verified it (its
    ``user_id``) where publishers are authenticated, so no client can direct verdicts to
    another's queue; else the request's ``client`` field (or the user)."""

    def __init__(self, inner: BenchHandler, topology: Topology, authenticated: bool) -> None:
        self.inner = inner
        self.topology = topology
        self.authenticated = authenticated
        self._labels: set[str] = set()  # client labels in use, at most MAX_CLIENT_LABELS
        self._labels_lock = threading.Lock()

    def label(self, client: str) -> str:
        """The client's metric label; a fleet without authentication hears any name, so
        past MAX_CLIENT_LABELS distinct clients the rest share "other"."""
        with self._labels_lock:
            if client in self._labels or len(self._labels) < MAX_CLIENT_LABELS:
                self._labels.add(client)
                return client
        return "other"

    def client_of(self, message: RewardRequest, delivery: Delivery) -> str:
        if self.authenticated:
            return delivery.user_id or ""
        return message.client or delivery.user_id or ""

    def __call__(self, message: Message, delivery: Delivery) -> list[Publish] | object:
        assert isinstance(message, RewardRequest)
        client = self.client_of(message, delivery)
        if not client:
            raise Reject("a reward request must name its client (no authenticated user)")
        label = self.label(client)
        if delivery.attempt <= 1:
            CLIENT_REQUESTS.labels(label).inc()
        candidate = Candidate(
            id=message.id,
            group_id=message.group_id,
            index=message.index,
            completion=message.completion,
            bench=message.bench,
        )
        outputs = self.inner(candidate, delivery)
        if outputs is DEFER:
            return DEFER
        for item in outputs:  # type: ignore[union-attr]
            CLIENT_VERDICTS.labels(label, item.message.status).inc()  # type: ignore[attr-defined]
            CLIENT_LATENCY.labels(label).observe(max(0.0, time.time() - message.created_at))
        return [
            Publish(
                self.topology.reply_queue(client),
                item.message,
                exchange=self.topology.reward_verdicts_exchange,
            )
            for item in outputs
        ]  # type: ignore[union-attr]


MAX_CLIENT_LABELS = 100
STOP_SIGNAL_WAIT_S = 0.5
_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")


def killed_by_stop_signal(verdict: Verdict) -> bool:
    return verdict.status == "runtime_error" and any(
        f"killed by {name} " in verdict.error for name in _STOP_SIGNALS
    )


def result_message(
    candidate: Candidate, verdict: Verdict, benchmarker: str, include_source: bool = True
) -> BenchResult:
    return BenchResult(
        id=candidate.id,
        group_id=candidate.group_id,
        index=candidate.index,
        status=verdict.status,  # type: ignore[arg-type]
        reward=verdict.reward,
        gflops=verdict.gflops,
        timing=verdict.timing,
        techniques=verdict.techniques,
        generalizes=verdict.generalizes,
        error=verdict.error,
        source=verdict.source if include_source else None,
        bench=candidate.bench,
        compile_flags=verdict.compile_flags,
        host=verdict.host,
        benchmarker=benchmarker,
        durations_s=verdict.durations_s,
        rollout=candidate.rollout,
        completion_sha256=text_sha256(candidate.completion),  # what was judged
    )


def replica_name() -> str:
    return f"benchmarker-{socket.gethostname()}-{os.getpid()}"


def build_consumer(config: BenchmarkerConfig, benchmarker: Benchmarker) -> Consumer:
    section = config.benchmarker
    name = replica_name()
    consumer = Consumer(config.broker, name, concurrency=section.concurrency)
    handler = BenchHandler(
        benchmarker,
        section,
        consumer.topology.name(BENCH_RESULTS),
        name,
        stopping=lambda: consumer.stopping,
        hand_back=consumer.fail,
    )
    consumer.subscribe(CODE_TO_BENCH, handler)
    consumer.subscribe(
        REWARD_REQUESTS,
        RewardHandler(handler, consumer.topology, config.broker.authenticate_publishers),
    )
    HOST.info(
        {
            "host_class": benchmarker.host.host_class,
            "cpu_model": benchmarker.host.cpu_model,
            "isa": ",".join(benchmarker.host.isa),
            "compiler": benchmarker.host.compiler,
            "cores": str(benchmarker.host.cores),
            "peak_gflops": f"{benchmarker.host.peak_gflops:.1f}",
        }
    )
    return consumer
