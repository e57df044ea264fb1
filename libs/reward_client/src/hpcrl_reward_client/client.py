"""A client of the benchmarker fleet's reward path (``reward-requests`` → its own queue).

One I/O thread owns the broker connection (pika's is not thread-safe); callers on any
thread :meth:`RewardClient.submit` completions and get a :class:`concurrent.futures.Future`
of the verdict, or :meth:`RewardClient.score` a batch and wait for all of it, or ``await``
:meth:`RewardClient.ascore`. What it guarantees:

* a verdict is matched to its request by id (``<batch>/<index>``, the batch a fresh uuid);
* at most ``max_outstanding`` requests are unanswered at a time: :meth:`submit` blocks for a
  free slot (back-pressure when the fleet is saturated);
* each request has a deadline (``timeout_s``): its future then raises :class:`RewardTimeout`;
* a request unanswered after ``attempt_timeout_s`` is sent again under a new id, up to
  ``retries`` times (a replica that gave it back too often, e.g. while stopping, has
  dead-lettered it); the first verdict of any of its ids answers it, later ones are dropped;
* requests are persistent and confirmed by the broker; after a lost connection those not
  yet confirmed are sent again, and the verdicts wait in the client's durable queue.

Verdicts reach ``reward-verdicts.<client>`` only: where the fleet authenticates publishers
``<client>`` is the broker user (leave ``client`` empty), else the ``client`` given here. One
``RewardClient`` per client name at a time: two consuming one queue would take each other's
verdicts (and drop them as unknown).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pika.exceptions
import structlog
from prometheus_client import Counter, Histogram

from hpcrl_common.broker import (
    RECOVERABLE,
    Publish,
    TopologyMissing,
    connection_parameters,
    open_connection,
    prepare_channel,
    publish_on,
)
from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import (
    BenchResult,
    BenchSpec,
    MessageError,
    RewardRequest,
    candidate_id,
    decode,
)
from hpcrl_common.topology import REWARD_REQUESTS, Topology

log = structlog.get_logger("hpcrl.reward_client")
Verdict = BenchResult

REQUESTS = Counter(
    "hpcrl_reward_client_requests_total", "Reward requests sent (retries included)", ["client"]
)
VERDICTS = Counter(
    "hpcrl_reward_client_verdicts_total", "Verdicts received, by status", ["client", "status"]
)
TIMEOUTS = Counter(
    "hpcrl_reward_client_timeouts_total",
    "Requests that got no verdict by their deadline",
    ["client"],
)
LATENCY = Histogram(
    "hpcrl_reward_client_latency_seconds",
    "From submit to verdict",
    ["client"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
)

_TICK_S = 0.05
MAX_BATCH = 1024  # a request's index is below 1024 (candidate ids)


class RewardTimeout(TimeoutError):
    """No verdict came by the request's deadline."""


class RewardClientClosed(RuntimeError):
    """The client was closed before the verdict came."""


@dataclass(frozen=True)
class RewardRequestSpec:
    """One completion to judge: the task, stage and optimisation level it was written for."""

    completion: str
    task: str = "matmul"
    stage: int = 6
    opt_level: str = "O3"


@dataclass
class _Pending:
    spec: RewardRequestSpec
    future: Future
    submitted: float
    deadline: float
    message: RewardRequest
    ids: list[str] = field(default_factory=list)
    next_retry: float = float("inf")
    retries_left: int = 0
    confirmed: bool = False
    queued: bool = True  # in _to_send: not to be queued again after a reconnect


class RewardClient:
    """Submit completions to the benchmarker fleet; get verdicts back, correlated by id."""

    def __init__(
        self,
        settings: BrokerSettings,
        client: str = "",
        *,
        max_outstanding: int = 64,
        timeout_s: float = 600.0,
        attempt_timeout_s: float | None = None,
        retries: int = 2,
        connection_name: str = "hpcrl-reward-client",
    ) -> None:
        if max_outstanding < 1:
            raise ValueError("max_outstanding must be at least 1")
        self.settings = settings
        self.topology = Topology(settings.namespace, settings.delivery_limit)
        self._params = connection_parameters(settings, connection_name)
        user = self._params[0].credentials.username
        self.client = client or user
        RewardRequest(
            id="x/0",
            group_id="x",
            index=0,
            completion="",  # validates the name
            bench=BenchSpec(task="t", stage=1),
            client=self.client,
        )
        self.reply_queue = self.topology.reply_queue(self.client)
        self.timeout_s = timeout_s
        self.attempt_timeout_s = attempt_timeout_s
        self.retries = retries
        self._user = user
        self._slots = threading.BoundedSemaphore(max_outstanding)
        self._pending: dict[str, _Pending] = {}  # every id of a request → the request
        self._lock = threading.Lock()
        self._to_send: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        self._connection: Any = None  # the I/O thread's, while it has one (for _wake)
        self._stop = threading.Event()
        self.connected = threading.Event()
        self.dropped = 0  # verdicts for ids this client does not wait for
        self._thread = threading.Thread(target=self._run, name="reward-client-io", daemon=True)
        self._thread.start()

    # --- the caller's side -----------------------------------------------------------------

    def submit(
        self,
        completion: str | RewardRequestSpec,
        task: str = "matmul",
        stage: int = 6,
        opt_level: str = "O3",
        *,
        batch: str | None = None,
        index: int = 0,
        timeout_s: float | None = None,
    ) -> Future:
        """Send one completion; its future gives the :data:`Verdict` (a BenchResult).

        Blocks while ``max_outstanding`` requests are unanswered (back-pressure); raises
        :class:`RewardTimeout` if no slot frees within the request's timeout.
        """
        spec = (
            completion
            if isinstance(completion, RewardRequestSpec)
            else RewardRequestSpec(completion, task, stage, opt_level)
        )
        if self._stop.is_set():
            raise RewardClientClosed("the reward client is closed")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        submitted = time.monotonic()
        group = batch or uuid.uuid4().hex
        message = RewardRequest(  # an invalid request raises here, before it takes a slot
            id=candidate_id(group, index),
            group_id=group,
            index=index,
            completion=spec.completion,
            client=self.client,
            bench=BenchSpec(task=spec.task, stage=spec.stage, opt_level=spec.opt_level),
        )  # type: ignore[arg-type]
        if not self._slots.acquire(timeout=timeout):
            raise RewardTimeout(
                f"no free slot in {timeout:.1f}s: {self.client} has "
                f"{len(self._outstanding())} requests unanswered"
            )
        future: Future = Future()
        pending = _Pending(
            spec,
            future,
            submitted,
            submitted + timeout,
            message,
            ids=[message.id],
            retries_left=self.retries,
        )
        with self._lock:
            self._pending[message.id] = pending
        self._to_send.put(pending)
        self._wake()
        return future

    def submit_many(
        self, specs: Iterable[RewardRequestSpec], *, timeout_s: float | None = None
    ) -> list[Future]:
        """A batch: one batch id, indexes 0, 1, ... (a new batch every 1024)."""
        futures = []
        batch = uuid.uuid4().hex
        for position, spec in enumerate(specs):
            if position and position % MAX_BATCH == 0:
                batch = uuid.uuid4().hex
            futures.append(
                self.submit(spec, batch=batch, index=position % MAX_BATCH, timeout_s=timeout_s)
            )
        return futures

    def score(
        self, specs: Sequence[RewardRequestSpec], *, timeout_s: float | None = None
    ) -> list[Verdict]:
        """Judge a batch and wait for every verdict, in order (raises the first failure)."""
        futures = self.submit_many(specs, timeout_s=timeout_s)
        return [future.result() for future in futures]

    async def asubmit(
        self,
        completion: str | RewardRequestSpec,
        task: str = "matmul",
        stage: int = 6,
        opt_level: str = "O3",
        *,
        timeout_s: float | None = None,
    ) -> Verdict:
        """The asyncio form of :meth:`submit`; waits for a slot without blocking the loop."""
        future = await asyncio.to_thread(
            self.submit, completion, task, stage, opt_level, timeout_s=timeout_s
        )
        return await asyncio.wrap_future(future)

    async def ascore(
        self, specs: Sequence[RewardRequestSpec], *, timeout_s: float | None = None
    ) -> list[Verdict]:
        futures = await asyncio.to_thread(self.submit_many, specs, timeout_s=timeout_s)
        return list(await asyncio.gather(*map(asyncio.wrap_future, futures)))

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout=10)
        for pending in self._outstanding():
            self._settle(pending, exception=RewardClientClosed("closed before the verdict"))

    def __enter__(self) -> RewardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        """Make the I/O thread send now rather than at its next tick (up to ``_TICK_S``
        later: a quarter of a fast verdict's time on average). Only a wake-up: the queue
        carries the request, so one queued while the connection is down waits for the next
        one all the same."""
        connection = self._connection
        if connection is not None:
            with contextlib.suppress(Exception):  # closed or closing: the queue keeps it
                connection.add_callback_threadsafe(_nothing)

    def _outstanding(self) -> list[_Pending]:
        with self._lock:
            return list({id(p): p for p in self._pending.values()}.values())

    # --- the I/O thread ----------------------------------------------------------------------

    def _run(self) -> None:
        delay = self.settings.reconnect_initial_s
        while not self._stop.is_set():
            try:
                self._session()
                delay = self.settings.reconnect_initial_s
            except (
                *RECOVERABLE,
                pika.exceptions.NackError,
                pika.exceptions.UnroutableError,
                TopologyMissing,
            ) as exc:
                self.connected.clear()
                log.warning(
                    "reward client lost the broker; reconnecting", error=repr(exc), delay_s=delay
                )
                self._stop.wait(delay)
                delay = min(delay * 2, self.settings.reconnect_max_s)
            except Exception:  # a bug must not leave callers waiting forever unnoticed
                log.exception("reward client I/O failed")
                self._stop.wait(delay)

    def _session(self) -> None:
        connection = open_connection(self._params)
        try:
            channel = prepare_channel(connection, self.settings, self.topology)
            if self.settings.declare_topology:
                self.topology.reply_queue_spec(self.client).declare(channel)
            else:  # made by the admin with the client's user (hpcrl-broker-admin)
                channel.queue_declare(self.reply_queue, passive=True)
            channel.basic_qos(prefetch_count=max(self.settings.prefetch, 16))
            channel.basic_consume(self.reply_queue, self._on_verdict)
            self._connection = connection
            self.connected.set()
            for pending in self._outstanding():  # not confirmed before the connection was lost
                if not pending.confirmed and not pending.queued:
                    pending.queued = True
                    self._to_send.put(pending)
            while not self._stop.is_set():
                connection.process_data_events(time_limit=_TICK_S)
                self._send_queued(channel)
                self._expire_and_retry(channel)
        finally:
            self._connection = None
            self.connected.clear()
            if connection.is_open:
                with contextlib.suppress(Exception):
                    connection.close()

    def _send_queued(self, channel: Any) -> None:
        while True:
            try:
                pending = self._to_send.get_nowait()
            except queue.Empty:
                return
            pending.queued = False
            if pending.future.done():
                continue
            self._send(channel, pending, pending.message)

    def _send(self, channel: Any, pending: _Pending, message: RewardRequest) -> None:
        publish_on(
            channel,
            Publish(self.topology.name(REWARD_REQUESTS), message),
            self.settings.max_message_bytes,
            self._user,
        )
        pending.confirmed = True
        REQUESTS.labels(self.client).inc()
        if self.attempt_timeout_s is not None:
            pending.next_retry = time.monotonic() + self.attempt_timeout_s

    def _expire_and_retry(self, channel: Any) -> None:
        now = time.monotonic()
        for pending in self._outstanding():
            if now >= pending.deadline:
                TIMEOUTS.labels(self.client).inc()
                self._settle(
                    pending,
                    exception=RewardTimeout(
                        f"no verdict for {pending.ids[0]} in "
                        f"{pending.deadline - pending.submitted:.1f}s"
                    ),
                )
            elif pending.confirmed and now >= pending.next_retry:
                if pending.retries_left <= 0:
                    pending.next_retry = float("inf")
                    continue
                pending.retries_left -= 1
                group = uuid.uuid4().hex
                retry = pending.message.model_copy(
                    update={"id": candidate_id(group, pending.message.index), "group_id": group}
                )
                with self._lock:
                    pending.ids.append(retry.id)
                    self._pending[retry.id] = pending
                log.info(
                    "reward request unanswered; sent again", first=pending.ids[0], retry=retry.id
                )
                self._send(channel, pending, retry)

    def _on_verdict(self, channel: Any, method: Any, _props: Any, body: bytes) -> None:
        try:
            verdict = decode(body, BenchResult, max_bytes=self.settings.max_message_bytes)
        except MessageError as exc:
            log.warning("undecodable verdict dropped", reason=exc.reason)
            channel.basic_ack(method.delivery_tag)
            return
        with self._lock:
            pending = self._pending.get(verdict.id)
        if pending is None:
            self.dropped += 1
        else:
            VERDICTS.labels(self.client, verdict.status).inc()
            LATENCY.labels(self.client).observe(time.monotonic() - pending.submitted)
            self._settle(pending, result=verdict)
        channel.basic_ack(method.delivery_tag)

    def _settle(
        self,
        pending: _Pending,
        *,
        result: Verdict | None = None,
        exception: BaseException | None = None,
    ) -> None:
        with self._lock:  # claim it: a verdict and a deadline may race (close, I/O thread)
            if pending.ids[0] not in self._pending:
                return
            for request_id in pending.ids:
                self._pending.pop(request_id, None)
        self._slots.release()
        if exception is not None:  # outside the lock: a done-callback may submit again
            pending.future.set_exception(exception)
        else:
            pending.future.set_result(result)


def _nothing() -> None:
    """A wake-up's callback: its arrival makes ``process_data_events`` return."""
