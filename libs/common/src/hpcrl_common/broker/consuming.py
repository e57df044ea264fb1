"""Consuming: :class:`Consumer` takes deliveries, runs handlers on worker threads, settles
(publishes the outputs, then acks), dead-letters, runs periodic tasks and reconnects.

All channel operations happen on the thread that calls :meth:`Consumer.run` (the I/O
thread); other threads hand it actions (a settle, a publish) through a queue and wake its
loop at once with pika's ``add_callback_threadsafe``. The queue, not the wake-up, carries
the action, so one handed over while the connection is down runs on the next connection;
an ack or nack of a delivery from a lost channel is dropped there (its tag meant something
only on that channel), and the broker's redelivery is deduplicated by message id.
"""

from __future__ import annotations

import contextlib
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import pika
import pika.exceptions
import structlog
from pika.adapters.blocking_connection import BlockingChannel

from hpcrl_common.access import publisher_allowed
from hpcrl_common.broker.connection import (
    RECOVERABLE,
    TlsRefused,
    _Backoff,
    broker_address,
    connection_parameters,
    open_connection,
)
from hpcrl_common.broker.delivery import (
    DEFER,
    Delivery,
    Handler,
    Ignore,
    Reject,
    _as_text,
    delivery_count,
)
from hpcrl_common.broker.metrics import (
    CONNECTED,
    CONSUMED,
    HANDLER_SECONDS,
    PERIODIC_FAILURES,
    RECONNECTS,
)
from hpcrl_common.broker.publishing import (
    _REFUSED_PAUSE_S,
    ChannelRefused,
    Publish,
    TopologyMissing,
    declare_keeping_classic,
    prepare_channel,
    publish_on,
)
from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import Message, MessageError, decode
from hpcrl_common.metrics import BusyTime
from hpcrl_common.topology import (
    CONSUMER_HEADER,
    PUBLISHER_HEADER,
    REASON_HEADER,
    SOURCE_QUEUE_HEADER,
    Topology,
)

log = structlog.get_logger("hpcrl.broker")

_COMPLETED_MEMORY = 50_000
# The loop wakes at least this often (timers, a stop, the health clock) and at once for an
# action handed over from another thread.
_LOOP_TICK_S = 0.05


class StopFlag:
    """A stop request that a signal handler may raise at any moment.

    ``threading.Event.set`` takes a lock: a second SIGTERM arriving while the first one's
    handler held it re-entered ``set`` on the same (main) thread and deadlocked the service,
    which then ignored every later signal. Raising this flag is one assignment; a waiter
    polls it, so it never holds anything a handler could need.
    """

    _POLL_S = 0.05

    def __init__(self) -> None:
        self._raised = False

    def set(self) -> None:
        self._raised = True

    def is_set(self) -> bool:
        return self._raised

    def wait(self, timeout: float) -> bool:
        """Sleep until the flag is raised or ``timeout`` seconds passed; True if raised."""
        deadline = time.monotonic() + timeout
        while not self._raised and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, self._POLL_S))
        return self._raised


@dataclass
class _Subscription:
    queue: str
    dead_letter_key: str
    expected: type[Message]
    handler: Handler
    base: str  # the un-namespaced queue or exchange name: who may publish into it
    fanout: tuple[str, str, bool] | None = None  # (exchange base, subscriber, durable)


@dataclass
class _Timer:
    every_s: float
    fn: Callable[[], Sequence[Publish]]
    due: float = 0.0
    running: bool = False
    failing_since: float | None = None  # monotonic time of the first of consecutive failures
    last_error: str = ""

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", "?")


class Consumer:
    """Consumes one or more queues, runs handlers off the I/O thread, reconnects forever."""

    # A periodic task that keeps raising this long makes the service unhealthy: one failure
    # may be a passing fault, a run of them means the service makes no progress.
    periodic_failure_grace_s = 10.0

    def __init__(
        self,
        settings: BrokerSettings,
        client: str,
        *,
        concurrency: int = 1,
        topology: Topology | None = None,
        stop_grace_s: float = 30.0,
    ) -> None:
        self.settings = settings
        self.client = client
        # How long a stop waits for handlers already running to finish and settle.
        self.stop_grace_s = stop_grace_s
        self.topology = topology or Topology(settings.namespace, settings.delivery_limit)
        self._params = connection_parameters(settings, client)
        self._executor = ThreadPoolExecutor(concurrency, thread_name_prefix=f"{client}-work")
        self._subscriptions: list[_Subscription] = []
        self._timers: list[_Timer] = []
        self._actions: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = StopFlag()
        self._generation = 0
        self._connection: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._inflight: dict[tuple[str, str], Delivery] = {}
        self._failures: dict[tuple[str, str], int] = {}
        self._completed: OrderedDict[tuple[str, str], list[Publish] | None] = OrderedDict()
        self._unsent: list[tuple[list[Publish], Future | None]] = []
        self._last_tick = time.monotonic()
        self._running = 0  # handlers and periodic tasks executing now
        self._running_lock = threading.Lock()
        self.connections = 0
        self.connected = threading.Event()
        # Handlers and periodic tasks, overlapping ones once: hpcrl_service_busy_seconds_total.
        self.busy = BusyTime(client)

    # --- set-up ------------------------------------------------------------------------

    def subscribe(self, queue_base: str, handler: Handler) -> str:
        """Consume the work queue ``queue_base`` (a name from topology, un-namespaced)."""
        name = self.topology.name(queue_base)
        expected = self.topology.expected_schema(name)
        self._subscriptions.append(_Subscription(name, name, expected, handler, queue_base))
        return name

    def subscribe_fanout(
        self, exchange_base: str, subscriber: str, handler: Handler, *, durable: bool
    ) -> str:
        """Receive every message of a fanout exchange in this subscriber's own queue."""
        name = self.topology.subscriber_queue(exchange_base, subscriber)
        self._subscriptions.append(
            _Subscription(
                name,
                self.topology.name(exchange_base),
                self.topology.expected_schema(name),
                handler,
                exchange_base,
                fanout=(exchange_base, subscriber, durable),
            )
        )
        return name

    def every(self, seconds: float, fn: Callable[[], Sequence[Publish]]) -> None:
        """Run ``fn`` on a worker thread every ``seconds``; publish what it returns."""
        self._timers.append(_Timer(seconds, fn))

    # --- thread-safe API ----------------------------------------------------------------

    def publish(self, *items: Publish) -> Future:
        """Publish from any thread; the future resolves once the broker confirmed all."""
        done: Future = Future()
        self._submit(partial(self._publish_request, list(items), done))
        return done

    def settle(self, delivery: Delivery, outputs: Sequence[Publish] = ()) -> None:
        """Finish a deferred delivery: publish ``outputs``, then ack it (any thread)."""
        self._submit(partial(self._finish, delivery, list(outputs)))

    def fail(self, delivery: Delivery, error: Exception) -> None:
        """Hand a deferred delivery back as failed (any thread): it is tried again, and
        dead-lettered with ``error`` once it has failed ``delivery_limit`` times."""
        sub = next(s for s in self._subscriptions if s.queue == delivery.queue)
        self._submit(partial(self._finish_failed, sub, delivery, error))

    def stop(self) -> None:
        """Stop taking work; :meth:`run` returns once the handlers already running have
        settled, or after ``stop_grace_s`` (see :meth:`_wind_down`)."""
        self._stop.set()

    @property
    def running(self) -> int:
        """Handlers and periodic tasks executing now (after :meth:`run` returned: the ones a
        stop left behind, whose messages the broker hands to another consumer)."""
        with self._running_lock:
            return self._running

    @contextlib.contextmanager
    def _executing(self) -> Iterator[None]:
        with self._running_lock:
            self._running += 1
        try:
            with self.busy.working():
                yield
        finally:
            with self._running_lock:
                self._running -= 1

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called (e.g. on SIGTERM): work now ending may have been
        cut short by the same signal."""
        return self._stop.is_set()

    def healthy(self) -> tuple[bool, dict[str, Any]]:
        now = time.monotonic()
        loop_age = now - self._last_tick
        stuck = {
            timer.name: {
                "failing_for_s": round(now - timer.failing_since, 1),
                "error": timer.last_error,
            }
            for timer in self._timers
            if timer.failing_since is not None
            and now - timer.failing_since >= self.periodic_failure_grace_s
        }
        ok = self.connected.is_set() and loop_age < 30 and not stuck
        detail: dict[str, Any] = {
            "connected": self.connected.is_set(),
            "loop_age_s": round(loop_age, 3),
            "inflight": len(self._inflight),
        }
        if stuck:
            detail["failing_periodic_tasks"] = stuck
        return ok, detail

    # --- the loop -----------------------------------------------------------------------

    def run(self) -> None:
        """Serve until :meth:`stop`; survives broker restarts and dropped connections."""
        backoff = _Backoff(self.settings)
        try:
            while not self._stop.is_set():
                try:
                    self._serve(backoff)
                except TopologyMissing as exc:
                    self._lost_connection()
                    delay = backoff.next()
                    log.error(
                        "waiting for the topology",
                        client=self.client,
                        error=str(exc),
                        delay_s=round(delay, 2),
                    )
                    self._stop.wait(delay)
                except RECOVERABLE as exc:
                    self._lost_connection()
                    delay = backoff.next()
                    if isinstance(exc, ChannelRefused):
                        delay = max(delay, _REFUSED_PAUSE_S)
                    report = log.error if isinstance(exc, TlsRefused) else log.warning
                    report(
                        "broker connection lost, reconnecting",
                        client=self.client,
                        error=str(exc) or repr(exc),
                        delay_s=round(delay, 2),
                    )
                    self._stop.wait(delay)
        finally:
            self._close()
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _serve(self, backoff: _Backoff) -> None:
        self._connection = open_connection(self._params)
        channel = self._channel = prepare_channel(self._connection, self.settings, self.topology)
        channel.basic_qos(prefetch_count=self.settings.prefetch)
        self._generation += 1
        for sub in self._subscriptions:
            if sub.fanout is not None:
                self._declare_subscriber(self._connection, *sub.fanout)
            channel.basic_consume(sub.queue, partial(self._on_message, sub))
        self.connections += 1
        if self.connections > 1:
            RECONNECTS.labels(self.client).inc()
        self.connected.set()
        CONNECTED.labels(self.client).set(1)
        backoff.reset()
        log.info(
            "consuming",
            client=self.client,
            queues=[s.queue for s in self._subscriptions],
            broker=broker_address(self._connection),
        )
        self._flush_unsent()
        while not self._stop.is_set():
            self._connection.process_data_events(time_limit=_LOOP_TICK_S)
            self._drain_actions()
            self._start_due_timers()
            self._last_tick = time.monotonic()
        self._wind_down(channel)

    def _wind_down(self, channel: BlockingChannel) -> None:
        """A stop: take no more deliveries, let the handlers already running finish and
        settle for up to ``stop_grace_s``. Whatever is still unsettled then goes back to the
        queue when the connection closes; nothing waits on work whose result cannot be sent."""
        for tag in list(channel.consumer_tags):
            channel.basic_cancel(tag)  # pika nacks (requeues) what it had not dispatched
        deadline = time.monotonic() + self.stop_grace_s
        while self.running and time.monotonic() < deadline:
            self._connection.process_data_events(time_limit=_LOOP_TICK_S)
            self._drain_actions()
            self._last_tick = time.monotonic()
        self._drain_actions()
        if self.running:
            log.warning(
                "stop grace over with work still running; its messages go back to the queue",
                client=self.client,
                running=self.running,
                grace_s=self.stop_grace_s,
            )

    def _declare_subscriber(
        self, connection: pika.BlockingConnection, base: str, subscriber: str, durable: bool
    ) -> None:
        if durable and not self.settings.declare_topology:
            # Made (and bound) by the admin with the topology: a role user may neither
            # declare it nor bind the exchange (hpcrl_common.access), only check it is there.
            channel = connection.channel()
            channel.queue_declare(self.topology.subscriber_queue(base, subscriber), passive=True)
            channel.close()
            return
        declare = partial(
            self.topology.declare_subscriber,
            exchange_base=base,
            subscriber=subscriber,
            durable=durable,
        )
        queues = [self.topology.durable_subscriber_queue(base, subscriber)] if durable else []
        # On a channel of its own: a refused declare must not close the consuming channel.
        declare_keeping_classic(connection, declare, queues).close()

    def _lost_connection(self) -> None:
        self.connected.clear()
        CONNECTED.labels(self.client).set(0)
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            with contextlib.suppress(Exception):  # already broken; we only want it gone
                connection.close()

    def _close(self) -> None:
        self._lost_connection()

    def _submit(self, action: Callable[[], None]) -> None:
        """Hand ``action`` to the I/O thread from any other thread, and wake its loop now
        rather than at its next tick (pika's threaded-consumer way)."""
        self._actions.put(action)
        connection = self._connection
        if connection is None:
            return  # the next connection's loop drains the queue
        # Only a wake-up: a closed or closing connection refuses it, and the action waits in
        # the queue for the loop all the same.
        with contextlib.suppress(Exception):
            connection.add_callback_threadsafe(_wake)

    def _drain_actions(self) -> None:
        while True:
            try:
                action = self._actions.get_nowait()
            except queue.Empty:
                return
            action()

    # --- receiving ----------------------------------------------------------------------

    def _on_message(
        self, sub: _Subscription, _channel: Any, method: Any, props: Any, body: bytes
    ) -> None:
        headers = props.headers if isinstance(props.headers, dict) else {}
        delivery = Delivery(
            queue=sub.queue,
            tag=method.delivery_tag,
            generation=self._generation,
            attempt=delivery_count(headers) + 1,
            body=body,
            headers=dict(headers),
            message_id=props.message_id if isinstance(props.message_id, str) else "",
            user_id=props.user_id if isinstance(props.user_id, str) else None,
        )
        # Decide outside pika's callback: dispatch may publish (dead letters, replays).
        self._actions.put(partial(self._dispatch, sub, delivery))

    def _dispatch(self, sub: _Subscription, delivery: Delivery) -> None:
        if self.settings.authenticate_publishers:
            refused = publisher_allowed(sub.base, delivery.user_id, self.settings.role_users)
            if refused is not None:
                self._dead_letter(sub, delivery, refused)
                return
        try:
            message = decode(delivery.body, sub.expected, max_bytes=self.settings.max_message_bytes)
        except MessageError as exc:
            self._dead_letter(sub, delivery, exc.reason)
            return
        except Exception as exc:  # a decoder bug must not kill the consumer: settle the message
            log.exception("decoding raised", queue=sub.queue)
            self._dead_letter(sub, delivery, f"undecodable message: {exc!r}")
            return
        delivery.message_id = message.id
        delivery.key = key = (sub.queue, message.id)
        delivery.attempt = max(delivery.attempt, self._failures.get(key, 0) + 1)
        if key in self._completed:
            self._replay_completed(delivery)
            return
        held = self._inflight.get(key)
        if held is not None:
            self._adopt_redelivery(held, delivery)
            return
        self._inflight[key] = delivery
        self._executor.submit(self._handle, sub, message, delivery)

    def _replay_completed(self, delivery: Delivery) -> None:
        outputs = self._completed[delivery.key]
        if outputs:
            self._publish_all(outputs)
            self._completed[delivery.key] = None
        self._ack(delivery)
        CONSUMED.labels(delivery.queue, "duplicate").inc()

    def _adopt_redelivery(self, held: Delivery, delivery: Delivery) -> None:
        if held.generation == delivery.generation:
            held.extra_tags.append(delivery.tag)  # a second copy: settle both together
            CONSUMED.labels(delivery.queue, "duplicate").inc()
        else:
            held.tag, held.generation, held.extra_tags = delivery.tag, delivery.generation, []

    def _handle(self, sub: _Subscription, message: Message, delivery: Delivery) -> None:
        if self._stop.is_set():
            return  # not started before the stop: the broker requeues it at the close
        started = time.monotonic()
        try:
            with self._executing():
                result = sub.handler(message, delivery)
        except Reject as exc:
            self._submit(partial(self._finish_rejected, sub, delivery, str(exc)))
            return
        except Ignore as exc:
            log.info(
                "message ignored",
                queue=sub.queue,
                message_id=delivery.message_id,
                reason=str(exc)[:500],
            )
            self._submit(partial(self._finish_ignored, delivery))
            return
        except Exception as exc:
            log.exception(
                "handler failed",
                queue=sub.queue,
                message_id=delivery.message_id,
                attempt=delivery.attempt,
            )
            self._submit(partial(self._finish_failed, sub, delivery, exc))
            return
        finally:
            HANDLER_SECONDS.labels(sub.queue).observe(time.monotonic() - started)
        if result is DEFER:
            return
        self._submit(partial(self._finish, delivery, list(result)))  # type: ignore[arg-type]

    # --- settling (I/O thread only) ----------------------------------------------------

    def _finish(self, delivery: Delivery, outputs: list[Publish]) -> None:
        self._inflight.pop(delivery.key, None)
        self._failures.pop(delivery.key, None)
        self._remember(delivery.key, outputs or None)
        try:
            self._publish_all(outputs)
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
            log.error("outputs refused by broker; will retry the message", error=repr(exc))
            self._completed.pop(delivery.key, None)
            self._nack(delivery)
            if isinstance(exc, pika.exceptions.NackError):
                raise ChannelRefused(f"the broker nacked outputs: {exc!r}") from None
            return
        self._completed[delivery.key] = None
        self._ack(delivery)
        CONSUMED.labels(delivery.queue, "acked").inc()

    def _finish_failed(self, sub: _Subscription, delivery: Delivery, exc: Exception) -> None:
        self._inflight.pop(delivery.key, None)
        if delivery.attempt >= self.settings.delivery_limit:
            self._failures.pop(delivery.key, None)
            reason = f"handler failed {delivery.attempt} times; last error: {exc!r}"
            self._dead_letter(sub, delivery, reason)
            return
        self._failures[delivery.key] = delivery.attempt
        self._nack(delivery)
        CONSUMED.labels(delivery.queue, "retried").inc()

    def _finish_ignored(self, delivery: Delivery) -> None:
        self._inflight.pop(delivery.key, None)
        self._failures.pop(delivery.key, None)
        self._ack(delivery)
        CONSUMED.labels(delivery.queue, "ignored").inc()

    def _finish_rejected(self, sub: _Subscription, delivery: Delivery, reason: str) -> None:
        self._inflight.pop(delivery.key, None)
        self._dead_letter(sub, delivery, f"rejected by handler: {reason}")

    def _dead_letter(self, sub: _Subscription, delivery: Delivery, reason: str) -> None:
        log.warning(
            "dead-lettering message",
            queue=sub.queue,
            reason=reason[:500],
            message_id=delivery.message_id,
        )
        ours = {
            REASON_HEADER: reason[:4000],
            SOURCE_QUEUE_HEADER: sub.queue,
            CONSUMER_HEADER: self.client,
        }
        if delivery.user_id is not None:
            # Who published it (checked by the broker then); the dead letter's own user_id
            # is the consumer's. An operator replaying it checks both (deploy/README.md).
            ours[PUBLISHER_HEADER] = delivery.user_id
        try:
            self._publish_dead_letter(sub, delivery, {**delivery.headers, **ours})
        except (
            TypeError,
            ValueError,
            OverflowError,
            struct.error,
            pika.exceptions.UnsupportedAMQPFieldException,
        ):
            # Headers pika decoded but cannot encode again: keep them as text instead.
            self._publish_dead_letter(sub, delivery, {**_as_text(delivery.headers), **ours})
        self._ack(delivery)
        CONSUMED.labels(delivery.queue, "dead_lettered").inc()

    def _publish_dead_letter(
        self, sub: _Subscription, delivery: Delivery, headers: dict[str, Any]
    ) -> None:
        properties = pika.BasicProperties(
            delivery_mode=pika.DeliveryMode.Persistent,
            headers=headers,
            message_id=delivery.message_id or None,
            user_id=self._params[0].credentials.username,
        )
        # The dead-letter queue's own inbox: the shared dead-letter exchange is the broker's.
        self._require_channel().basic_publish(
            self.topology.dead_letter_inbox(sub.base),
            sub.dead_letter_key,
            delivery.body,
            properties=properties,
            mandatory=True,
        )

    def _ack(self, delivery: Delivery) -> None:
        if delivery.generation != self._generation:
            return  # its channel is gone; the broker redelivers and we dedupe by id
        channel = self._require_channel()
        for tag in (delivery.tag, *delivery.extra_tags):
            channel.basic_ack(tag)

    def _nack(self, delivery: Delivery) -> None:
        if delivery.generation != self._generation:
            return
        channel = self._require_channel()
        for tag in (delivery.tag, *delivery.extra_tags):
            channel.basic_nack(tag, requeue=True)

    def _remember(self, key: tuple[str, str], outputs: list[Publish] | None) -> None:
        self._completed[key] = outputs
        self._completed.move_to_end(key)
        while len(self._completed) > _COMPLETED_MEMORY:
            self._completed.popitem(last=False)

    # --- publishing (I/O thread only) --------------------------------------------------

    def _require_channel(self) -> BlockingChannel:
        if self._channel is None or not self._channel.is_open:
            raise pika.exceptions.ChannelWrongStateError("no open channel")
        return self._channel

    def _publish_all(self, outputs: Sequence[Publish]) -> None:
        channel = self._require_channel()
        for item in outputs:
            publish_on(
                channel, item, self.settings.max_message_bytes, self._params[0].credentials.username
            )

    def _publish_request(self, items: list[Publish], done: Future | None) -> None:
        try:
            self._publish_all(items)
        except RECOVERABLE:
            self._unsent.append((items, done))
            raise
        except pika.exceptions.NackError as exc:
            self._unsent.append((items, done))
            raise ChannelRefused(f"the broker nacked a publish: {exc!r}") from None
        except Exception as exc:
            if done is not None:
                done.set_exception(exc)
            else:
                log.error("publish failed", error=repr(exc))
            return
        if done is not None:
            done.set_result(None)

    def _flush_unsent(self) -> None:
        unsent, self._unsent = self._unsent, []
        for index, (items, done) in enumerate(unsent):
            try:
                self._publish_request(items, done)
            except RECOVERABLE:
                self._unsent.extend(unsent[index + 1 :])
                raise

    # --- timers -------------------------------------------------------------------------

    def _start_due_timers(self) -> None:
        now = time.monotonic()
        for timer in self._timers:
            if not timer.running and now >= timer.due:
                timer.running = True
                self._executor.submit(self._run_timer, timer)

    def _run_timer(self, timer: _Timer) -> None:
        try:
            with self._executing():
                outputs = list(timer.fn())
        except Exception as exc:
            log.exception("periodic task failed", task=timer.name)
            PERIODIC_FAILURES.labels(self.client, timer.name).inc()
            if timer.failing_since is None:
                timer.failing_since = time.monotonic()
            timer.last_error = repr(exc)[:500]
            outputs = []
        else:
            timer.failing_since, timer.last_error = None, ""
        if outputs:
            self._submit(partial(self._publish_request, outputs, None))
        timer.due = time.monotonic() + timer.every_s
        timer.running = False


def _wake() -> None:
    """Nothing: its arrival makes ``process_data_events`` return, and the loop drains the
    actions outside pika's callbacks, as it does after a tick."""
