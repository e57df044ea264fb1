"""The broker layer against the real RabbitMQ: delivery, dead-lettering, heartbeats, reconnects."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import msgpack
import pika
import pytest
from prometheus_client import REGISTRY

from hpcrl_common.broker import DEFER, Consumer, Publish, Publisher, Reject, consuming
from hpcrl_common.messages import BenchSpec, Candidate, GenerateRequest, encode
from hpcrl_common.topology import (
    BENCH_RESULTS,
    CODE_TO_BENCH,
    GENERATE_REQUESTS,
    REASON_HEADER,
    ROLLOUT_BATCHES,
    WEIGHT_UPDATES,
    Topology,
)

from ..conftest import RunningConsumer, close_connections
from ..support.waiting import wait_for
from .strategies import (
    bench_results,
    candidates,
    generate_requests,
    rollout_batches,
    sample_candidate,
    sample_request,
    sample_weight_update,
)

pytestmark = pytest.mark.broker


def drain(channel, queue: str) -> list[tuple[pika.BasicProperties, bytes]]:
    messages = []
    while True:
        method, props, body = channel.basic_get(queue, auto_ack=True)
        if method is None:
            return messages
        messages.append((props, body))


def echo_candidate(topology: Topology):
    """Handler: a generation request becomes one candidate (deterministic id)."""

    def handle(request: GenerateRequest, _delivery) -> list[Publish]:
        out = Candidate(
            id=f"{request.id}/0",
            group_id=request.id,
            index=0,
            completion=f"code for {request.id}",
            bench=request.bench,
        )
        return [Publish(topology.name(CODE_TO_BENCH), out)]

    return handle


def test_every_schema_round_trips_through_the_broker(broker_settings):
    from hypothesis import HealthCheck, given, settings

    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    received: dict[str, list] = {
        q: [] for q in (GENERATE_REQUESTS, CODE_TO_BENCH, BENCH_RESULTS, ROLLOUT_BATCHES)
    }
    consumer = Consumer(broker_settings, "roundtrip")
    for queue in received:
        consumer.subscribe(queue, lambda m, _d, q=queue: received[q].append(m) or [])
    updates: list = []
    consumer.subscribe_fanout(
        WEIGHT_UPDATES, "roundtrip", lambda m, _d: updates.append(m) or [], durable=False
    )
    sent: dict[str, list] = {q: [] for q in received}
    with RunningConsumer(consumer), Publisher(broker_settings, "roundtrip-pub") as publisher:

        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
        @given(generate_requests, candidates(), bench_results(), rollout_batches)
        def send(request, candidate, result, batch):
            for queue, message in zip(sent, (request, candidate, result, batch), strict=True):
                publisher.publish(Publish(topology.name(queue), message))
                sent[queue].append(message)

        send()
        update = sample_weight_update()
        publisher.publish(
            Publish("", update, exchange=topology.name(WEIGHT_UPDATES), mandatory=False)
        )
        # Messages with equal ids are one message to an idempotent consumer: count ids.
        total = sum(len({m.id for m in v}) for v in sent.values())
        wait_for(
            lambda: sum(len(v) for v in received.values()) == total and updates, what="all messages"
        )
    for queue in sent:
        first_sent: dict = {}
        for message in sent[queue]:
            first_sent.setdefault(message.id, message)  # later copies are duplicates
        assert {m.id: m for m in received[queue]} == first_sent
    assert updates == [update]


def test_malformed_bodies_are_dead_lettered_with_reasons(broker_settings, raw_channel):
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    handled: list = []
    consumer = Consumer(broker_settings, "malformed")
    consumer.subscribe(CODE_TO_BENCH, lambda m, _d: handled.append(m.id) or [])
    good = sample_candidate()
    raw = msgpack.unpackb(encode(good))
    bodies = {
        b"\xc1not msgpack": "not valid msgpack",
        msgpack.packb(["a", "list"]): "must be a msgpack map",
        msgpack.packb({**raw, "schema": "candidate/9"}): "unsupported major version",
        msgpack.packb({k: v for k, v in raw.items() if k != "completion"}): "completion: Field",
        msgpack.packb({**raw, "index": "zero"}): "index: Input should be a valid integer",
        encode(sample_request()): "unexpected schema 'generate-request/1'",
        b"\x92" * (broker_settings.max_message_bytes + 1): "oversized message",
    }
    with RunningConsumer(consumer):
        queue = topology.name(CODE_TO_BENCH)
        for body in bodies:
            raw_channel.basic_publish("", queue, body)
        raw_channel.basic_publish("", queue, encode(good))
        wait_for(lambda: handled == [good.id], what="the valid message")
        dlq = topology.dlq(CODE_TO_BENCH)
        dead: list = []
        wait_for(
            lambda: dead.extend(drain(raw_channel, dlq)) or len(dead) >= len(bodies),
            what="dead letters",
        )
    reasons = [props.headers[REASON_HEADER] for props, _ in dead]
    for (body, expected), (_props, dead_body), reason in zip(
        bodies.items(), dead, reasons, strict=True
    ):
        assert expected in reason, (expected, reason)
        assert dead_body == body  # the original bytes are kept for inspection
    assert consumer.connections == 1  # malformed input never broke the connection


def test_failing_handler_is_dead_lettered_after_the_limit(broker_settings, raw_channel):
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    attempts: Counter = Counter()

    def always_fails(message, delivery):
        attempts[message.id] += 1
        raise RuntimeError(f"boom on try {delivery.attempt}")

    consumer = Consumer(broker_settings, "failing")
    consumer.subscribe(CODE_TO_BENCH, always_fails)
    with RunningConsumer(consumer), Publisher(broker_settings, "failing-pub") as publisher:
        publisher.publish(Publish(topology.name(CODE_TO_BENCH), sample_candidate()))
        dead: list = []
        wait_for(
            lambda: dead.extend(drain(raw_channel, topology.dlq(CODE_TO_BENCH))) or dead,
            what="dead letter",
        )
    assert attempts == {"g1/0": broker_settings.delivery_limit}
    reason = dead[0][0].headers[REASON_HEADER]
    assert f"failed {broker_settings.delivery_limit} times" in reason and "boom on try" in reason


def test_rejected_message_goes_straight_to_the_dlq(broker_settings, raw_channel):
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    calls: list = []

    def reject(message, _delivery):
        calls.append(message.id)
        raise Reject("stage 9 does not exist")

    consumer = Consumer(broker_settings, "reject")
    consumer.subscribe(CODE_TO_BENCH, reject)
    with RunningConsumer(consumer), Publisher(broker_settings, "reject-pub") as publisher:
        publisher.publish(Publish(topology.name(CODE_TO_BENCH), sample_candidate()))
        dead: list = []
        wait_for(lambda: dead.extend(drain(raw_channel, topology.dlq(CODE_TO_BENCH))) or dead)
    assert calls == ["g1/0"]
    assert "stage 9 does not exist" in dead[0][0].headers[REASON_HEADER]


def test_broker_delivery_limit_is_the_backstop(broker_settings, raw_channel):
    """A message that is returned again and again (e.g. it kills its consumer) is
    dead-lettered by the quorum queue itself."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    Publisher(broker_settings, "backstop-pub").publish(
        Publish(topology.name(CODE_TO_BENCH), sample_candidate())
    )
    queue = topology.name(CODE_TO_BENCH)
    returns = 0
    for _ in range(broker_settings.delivery_limit + 2):
        method, _props, _body = raw_channel.basic_get(queue)
        if method is None:
            break
        raw_channel.basic_nack(method.delivery_tag, requeue=True)
        returns += 1
    assert returns == broker_settings.delivery_limit + 1
    wait_for(
        lambda: (
            raw_channel.queue_declare(
                topology.dlq(CODE_TO_BENCH), passive=True
            ).method.message_count
            == 1
        ),
        what="broker dead-lettering",
    )


def test_long_handler_keeps_its_connection(broker_settings):
    settings = broker_settings.model_copy(update={"heartbeat_s": 1})
    topology = Topology(settings.namespace, settings.delivery_limit)
    done: list = []

    def slow(message, _delivery):
        time.sleep(5)  # five heartbeat intervals
        done.append(message.id)
        return echo_candidate(topology)(message, _delivery)

    consumer = Consumer(settings, "slow")
    consumer.subscribe(GENERATE_REQUESTS, slow)
    outputs: list = []
    sink = Consumer(settings, "slow-sink")
    sink.subscribe(CODE_TO_BENCH, lambda m, _d: outputs.append(m.id) or [])
    with RunningConsumer(consumer), RunningConsumer(sink), Publisher(settings, "p") as publisher:
        publisher.publish(Publish(topology.name(GENERATE_REQUESTS), sample_request("slow-1")))
        wait_for(lambda: outputs == ["slow-1/0"], timeout=30, what="the slow handler's output")
    assert done == ["slow-1"]
    assert consumer.connections == 1, "the connection dropped during the long handler"


def test_reconnects_and_loses_nothing(broker_settings):
    """Forced connection closes mid-stream: every request yields its candidate; redeliveries
    of already-completed messages are not handled again."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    calls: Counter = Counter()
    handle = echo_candidate(topology)

    def counted(message, delivery):
        calls[message.id] += 1
        time.sleep(0.05)
        return handle(message, delivery)

    consumer = Consumer(broker_settings, "reconnecting", concurrency=2)
    consumer.subscribe(GENERATE_REQUESTS, counted)
    outputs: Counter = Counter()
    sink = Consumer(broker_settings, "reconnect-sink")
    sink.subscribe(CODE_TO_BENCH, lambda m, _d: outputs.update([m.group_id]) or [])
    ids = [f"req-{i}" for i in range(60)]
    with (
        RunningConsumer(consumer),
        RunningConsumer(sink),
        Publisher(broker_settings, "reconnect-pub") as publisher,
    ):
        for request_id in ids:
            publisher.publish(Publish(topology.name(GENERATE_REQUESTS), sample_request(request_id)))
        closes = 0
        for threshold in (10, 30):
            wait_for(lambda t=threshold: sum(calls.values()) >= t, what=f"{threshold} handled")
            closes += close_connections("reconnecting")
        wait_for(lambda: set(outputs) == set(ids), timeout=60, what="every output")
        wait_for(lambda: consumer.connections == 3, what="the second reconnect")
    assert closes == 2
    # Effectively once: each request's output exists; extra handling is bounded by what was
    # unacked at the moment of a close (at most prefetch per close).
    assert sum(calls.values()) <= len(ids) + 2 * broker_settings.prefetch
    assert max(outputs.values()) <= 2


def test_deferred_settlement_survives_a_reconnect(broker_settings):
    """A handler that settles later (as the learner does after a checkpoint) still acks
    after a reconnect, and the message is not handed to it twice."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    held: list = []
    calls: Counter = Counter()

    def hold(message, delivery):
        calls[message.id] += 1
        held.append(delivery)
        return DEFER

    consumer = Consumer(broker_settings, "deferring")
    consumer.subscribe(GENERATE_REQUESTS, hold)
    outputs: list = []
    sink = Consumer(broker_settings, "deferring-sink")
    sink.subscribe(CODE_TO_BENCH, lambda m, _d: outputs.append(m.id) or [])
    with RunningConsumer(consumer), RunningConsumer(sink), Publisher(broker_settings, "p") as pub:
        pub.publish(Publish(topology.name(GENERATE_REQUESTS), sample_request("held-1")))
        wait_for(lambda: len(held) == 1, what="the held delivery")
        assert close_connections("deferring") == 1
        wait_for(
            lambda: consumer.connections == 2 and held[0].generation == 2,
            timeout=30,
            what="redelivery adopted by the held delivery",
        )
        request = GenerateRequest(
            id="held-1",
            experiment="exp",
            iteration=0,
            mode="seed",
            prompt=sample_request().prompt,
            group_size=1,
            bench=BenchSpec(task="matmul", stage=1),
        )
        consumer.settle(held[0], echo_candidate(topology)(request, held[0]))
        wait_for(lambda: outputs == ["held-1/0"], what="the settled output")
        wait_for(lambda: not consumer._inflight, what="ack")
    assert calls == {"held-1": 1}


def test_a_settle_from_another_thread_wakes_the_loop(broker_settings, monkeypatch):
    """A worker thread's settle reaches the broker at once, not at the loop's next tick: with
    a 5 s tick and prefetch 1, three messages settled one after another take well under one
    tick (each would wait for a tick if the settle sat in the queue until then)."""
    monkeypatch.setattr(consuming, "_LOOP_TICK_S", 5.0)
    settings = broker_settings.model_copy(update={"prefetch": 1})
    topology = Topology(settings.namespace, settings.delivery_limit)
    arrived: list[float] = []
    consumer = Consumer(settings, "waking")

    def hand_off(_message, delivery):
        arrived.append(time.monotonic())
        threading.Thread(target=consumer.settle, args=(delivery,)).start()
        return DEFER

    consumer.subscribe(GENERATE_REQUESTS, hand_off)
    with Publisher(settings, "p") as publisher:
        publisher.publish(
            *(Publish(topology.name(GENERATE_REQUESTS), sample_request(f"w{i}")) for i in range(3))
        )
    with RunningConsumer(consumer):
        wait_for(
            lambda: len(arrived) == 3 and not consumer._inflight, timeout=30, what="three settles"
        )
    assert arrived[-1] - arrived[0] < 2.5, arrived


def test_publish_from_another_thread_is_confirmed(broker_settings):
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    consumer = Consumer(broker_settings, "publisher-thread")
    consumer.subscribe(CODE_TO_BENCH, lambda m, _d: [])
    got: list = []
    sink = Consumer(broker_settings, "publisher-thread-sink")
    sink.subscribe(GENERATE_REQUESTS, lambda m, _d: got.append(m.id) or [])
    with RunningConsumer(consumer), RunningConsumer(sink):
        futures = []
        thread = threading.Thread(
            target=lambda: futures.extend(
                consumer.publish(Publish(topology.name(GENERATE_REQUESTS), sample_request(f"t{i}")))
                for i in range(5)
            )
        )
        thread.start()
        thread.join()
        for future in futures:
            future.result(timeout=10)
        wait_for(lambda: len(got) == 5)
    assert sorted(got) == [f"t{i}" for i in range(5)]


# --- any body, any headers: settled, and the consumer keeps serving ------------------------

# superscript one, Arabic-Indic one, full-width one, then ASCII spellings that are not "1"
ODD_VERSIONS = [
    "\u00b9",
    "\u0661",
    "\uff11",
    "01",
    "1 ",
    "+1",
    "-0",
    "1_0",
    "",
    "99999999999999999999",
]


def test_odd_schema_versions_are_dead_lettered_not_fatal(broker_settings, raw_channel):
    """`str.isdigit()` accepts a superscript one and `int()` then raises outside MessageError;
    "01" and the full-width one used to pass as version 1."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    handled: list = []
    consumer = Consumer(broker_settings, "odd-versions")
    consumer.subscribe(CODE_TO_BENCH, lambda m, _d: handled.append(m.id) or [])
    good = sample_candidate()
    raw = msgpack.unpackb(encode(good))
    queue = topology.name(CODE_TO_BENCH)
    with RunningConsumer(consumer):
        for version in ODD_VERSIONS:
            body = msgpack.packb({**raw, "schema": f"candidate/{version}"})
            raw_channel.basic_publish("", queue, body)
        raw_channel.basic_publish("", queue, encode(good))
        wait_for(lambda: handled == [good.id], what="the valid message")
        dead: list = []
        wait_for(
            lambda: (
                dead.extend(drain(raw_channel, topology.dlq(CODE_TO_BENCH)))
                or len(dead) >= len(ODD_VERSIONS)
            ),
            what="dead letters",
        )
    assert all("unsupported major version" in props.headers[REASON_HEADER] for props, _ in dead)
    assert consumer.connections == 1


def _header_values():
    from hypothesis import strategies as st

    # pika cannot publish a float header (other clients can; the consumer reads it as "not a
    # count" like any other non-integer).
    scalars = (
        st.text(max_size=20)
        | st.integers(-(2**63), 2**63 - 1)
        | st.booleans()
        | st.binary(max_size=20)
        | st.none()
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(st.text(min_size=1, max_size=8), inner, max_size=3)
        ),
        max_leaves=6,
    )


def _bodies():
    """Garbage, msgpack of anything, and valid candidates with one field replaced."""
    from hypothesis import strategies as st

    raw = msgpack.unpackb(encode(sample_candidate()))
    anything = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text(max_size=30)
        | st.binary(max_size=30),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=10,
    )
    mutated = st.tuples(st.sampled_from([*raw, "extra"]), anything).map(
        lambda kv: msgpack.packb({**raw, kv[0]: kv[1]})
    )
    schemas = st.text(max_size=12).map(lambda v: msgpack.packb({**raw, "schema": f"candidate/{v}"}))
    return st.binary(max_size=200) | anything.map(msgpack.packb) | mutated | schemas


def test_any_body_and_headers_are_settled_and_the_consumer_keeps_serving(
    broker_settings, raw_channel
):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    queue = topology.name(CODE_TO_BENCH)
    handled: list = []
    consumer = Consumer(broker_settings, "anything")
    consumer.subscribe(CODE_TO_BENCH, lambda m, d: handled.append((m.id, d.attempt)) or [])
    sent = 0

    def duplicates() -> int:
        """Valid candidates the storm sent more than once (one id): settled, not handled
        again (the consumer deduplicates by message id)."""
        value = REGISTRY.get_sample_value(
            "hpcrl_broker_consumed_total", {"queue": queue, "outcome": "duplicate"}
        )
        return int(value or 0)

    headers = st.dictionaries(st.text(min_size=1, max_size=16), _header_values(), max_size=4)
    delivery_counts = st.none() | _header_values()
    with RunningConsumer(consumer):

        @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
        @given(_bodies(), headers, delivery_counts)
        def send(body, extra, count):
            nonlocal sent
            if count is not None:
                extra = {**extra, "x-delivery-count": count}
            raw_channel.basic_publish("", queue, body, pika.BasicProperties(headers=extra))
            sent += 1

        send()
        good = sample_candidate("after-the-storm")
        raw_channel.basic_publish(
            "", queue, encode(good), pika.BasicProperties(headers={"x-delivery-count": "abc"})
        )
        sent += 1
        dead: list = []

        def all_settled() -> bool:
            dead.extend(drain(raw_channel, topology.dlq(CODE_TO_BENCH)))
            return len(dead) + len(handled) + duplicates() >= sent

        def state() -> str:
            depth = raw_channel.queue_declare(queue, passive=True).method.message_count
            return (
                f"sent {sent}, handled {len(handled)}, duplicates {duplicates()}, "
                f"dead-lettered {len(dead)}, still queued "
                f"{depth}, connections {consumer.connections}, health {consumer.healthy()}"
            )

        wait_for(all_settled, timeout=60, what="every message settled", detail=state)
        assert good.id in [message_id for message_id, _ in handled]
        assert all(props.headers.get(REASON_HEADER) for props, _ in dead)
        assert consumer.connections == 1 and consumer.healthy()[0]
    assert raw_channel.queue_declare(queue, passive=True).method.message_count == 0


def test_a_periodic_task_that_keeps_failing_makes_the_consumer_unhealthy(broker_settings):
    """A service whose tick raises makes no progress: /healthz must say so, with the error."""
    consumer = Consumer(broker_settings, "stuck-tick")
    consumer.periodic_failure_grace_s = 2.0
    calls: list[float] = []
    broken = threading.Event()
    broken.set()

    def tick() -> list[Publish]:
        calls.append(time.monotonic())
        if broken.is_set():
            raise RuntimeError("selected a program without source")
        return []

    consumer.every(0.05, tick)
    with RunningConsumer(consumer):
        wait_for(lambda: len(calls) >= 2, what="the tick to run")
        assert consumer.healthy()[0]  # inside the grace period a failure may be passing
        wait_for(lambda: not consumer.healthy()[0], timeout=10, what="unhealthy")
        detail = consumer.healthy()[1]["failing_periodic_tasks"]["tick"]
        assert "program without source" in detail["error"] and detail["failing_for_s"] >= 2.0
        broken.clear()
        wait_for(lambda: consumer.healthy()[0], timeout=5, what="healthy again")


# --- a stop: running work finishes and settles, the rest goes back, the wait is bounded ----


def test_a_stop_lets_running_work_settle_and_hands_back_the_rest(broker_settings):
    """SIGTERM mid-handler: the running message's output is sent and it is acked; the
    messages prefetched behind it are not started and go to the next consumer."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    entered = threading.Event()
    calls: Counter = Counter()

    def slow(message, delivery):
        calls[message.id] += 1
        entered.set()
        time.sleep(1.5)
        return echo_candidate(topology)(message, delivery)

    first = Consumer(broker_settings, "stopping-first", stop_grace_s=20)
    first.subscribe(GENERATE_REQUESTS, slow)
    outputs: list = []
    sink = Consumer(broker_settings, "stopping-sink")
    sink.subscribe(CODE_TO_BENCH, lambda m, _d: outputs.append(m.id) or [])
    ids = [f"stop-{i}" for i in range(4)]
    with RunningConsumer(sink), Publisher(broker_settings, "stopping-pub") as publisher:
        thread = threading.Thread(target=first.run, daemon=True)
        thread.start()
        assert first.connected.wait(15)
        for request_id in ids:
            publisher.publish(Publish(topology.name(GENERATE_REQUESTS), sample_request(request_id)))
        assert entered.wait(15)
        started = time.monotonic()
        first.stop()
        thread.join(20)
        stop_s = time.monotonic() - started
        assert not thread.is_alive() and first.running == 0
        assert 0.5 < stop_s < 5, stop_s  # it waited for the running handler, not the queue
        (handled,) = calls
        wait_for(lambda: outputs == [f"{handled}/0"], what="the running handler's output")
        # The rest were never started here; the next consumer gets them all, and not the
        # one that was settled.
        second = Consumer(broker_settings, "stopping-second")
        second.subscribe(GENERATE_REQUESTS, echo_candidate(topology))
        with RunningConsumer(second):
            wait_for(
                lambda: sorted(outputs) == sorted(f"{i}/0" for i in ids),
                what="the handed-back messages",
            )
    assert calls == {handled: 1}
    assert len(outputs) == len(ids)


def test_a_stop_does_not_wait_past_its_grace(broker_settings):
    """A handler stuck past the grace is left behind: the loop returns, the connection
    closes, and its message goes to another consumer."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    release = threading.Event()
    entered = threading.Event()

    def stuck(_message, _delivery):
        entered.set()
        release.wait(60)
        return []

    first = Consumer(broker_settings, "grace-first", stop_grace_s=1.0)
    first.subscribe(GENERATE_REQUESTS, stuck)
    outputs: list = []
    sink = Consumer(broker_settings, "grace-sink")
    sink.subscribe(CODE_TO_BENCH, lambda m, _d: outputs.append(m.id) or [])
    second = Consumer(broker_settings, "grace-second")
    second.subscribe(GENERATE_REQUESTS, echo_candidate(topology))
    try:
        with RunningConsumer(sink), Publisher(broker_settings, "grace-pub") as publisher:
            thread = threading.Thread(target=first.run, daemon=True)
            thread.start()
            assert first.connected.wait(15)
            publisher.publish(Publish(topology.name(GENERATE_REQUESTS), sample_request("g-1")))
            assert entered.wait(15)
            started = time.monotonic()
            first.stop()
            thread.join(10)
            stop_s = time.monotonic() - started
            assert not thread.is_alive(), "run() waited past the grace"
            assert 1.0 <= stop_s < 3.0, stop_s
            assert first.running == 1  # left behind, still executing
            with RunningConsumer(second):
                wait_for(lambda: outputs == ["g-1/0"], what="the message at another consumer")
    finally:
        release.set()


STUCK_SERVICE = """
import subprocess, sys, threading
from hpcrl_common.broker import Consumer
from hpcrl_common.config import BrokerSettings
from hpcrl_common.logs import configure_logging
from hpcrl_common.service import ServiceSection, run_consumer
from hpcrl_common.topology import GENERATE_REQUESTS

def stuck_in_the_handler(_message, _delivery):
    child = subprocess.Popen(["sleep", "600"])  # as vLLM's engine process would be
    print("handling", child.pid, flush=True)
    threading.Event().wait(600)

configure_logging("stuck")
settings = BrokerSettings.model_validate_json(sys.argv[1])
consumer = Consumer(settings, "stuck-service")
consumer.subscribe(GENERATE_REQUESTS, stuck_in_the_handler)
run_consumer(consumer, "stuck", ServiceSection(stop_grace_s=1.0))
"""


def test_a_service_exits_on_sigterm_with_work_stuck_and_says_where(broker_settings, tmp_path):
    """The interpreter would join a stuck worker thread forever: `run_consumer` exits after
    the grace, with every thread's stack in its log; SIGUSR1 dumps them on demand."""
    import signal
    import subprocess
    import sys

    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_SERVICE)
    stderr = (tmp_path / "stderr").open("w+")
    proc = subprocess.Popen(
        [sys.executable, str(script), broker_settings.model_dump_json()],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    try:
        with Publisher(broker_settings, "stuck-pub") as publisher:
            publisher.publish(Publish(topology.name(GENERATE_REQUESTS), sample_request("s-1")))
        word, child = proc.stdout.readline().split()
        assert word == "handling"
        proc.send_signal(signal.SIGUSR1)
        wait_for(
            lambda: "stuck_in_the_handler" in (tmp_path / "stderr").read_text(),
            what="the SIGUSR1 stack dump",
        )
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=15)
        stop_s = time.monotonic() - started
    finally:
        proc.kill()
    log = (tmp_path / "stderr").read_text()
    assert code == 0, log[-3000:]
    assert 1.0 <= stop_s < 6.0, stop_s
    assert "exiting with work still running" in log
    assert log.count("stuck_in_the_handler") >= 2, log[-3000:]  # SIGUSR1 dump, exit dump

    def child_gone() -> bool:  # ended (a zombie until its new parent reaps it) or reaped
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        return state in ("Z", "X")

    wait_for(child_gone, timeout=10, what="the service's child to end with it")


SIGNAL_STORM = """
import signal, sys, threading, time
from hpcrl_common.broker.consuming import StopFlag

flag = StopFlag()
threading.Thread(target=flag.wait, args=(60,), daemon=True).start()
signal.signal(signal.SIGALRM, lambda *_: flag.set())
signal.setitimer(signal.ITIMER_REAL, 2e-4, 2e-4)  # a signal every 0.2 ms
end = time.monotonic() + 1.5
while time.monotonic() < end:
    flag.set()  # what the first SIGTERM's handler runs while the next one arrives
signal.setitimer(signal.ITIMER_REAL, 0)
print("stopped", flag.is_set())
"""


def test_a_stop_raised_by_a_signal_during_a_stop_neither_hangs_nor_crashes():
    """CI caught a benchmarker deaf to SIGTERM: a second signal ran the handler inside the
    first one's ``threading.Event.set``, which waited on the lock its own thread held. The
    same storm against ``threading.Event`` hangs or dies within the 1.5 s."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", SIGNAL_STORM], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "stopped True"


def test_the_stop_flag_wakes_a_waiter_and_times_out_without_one():
    flag = consuming.StopFlag()
    started = time.monotonic()
    assert flag.wait(0.2) is False
    assert 0.2 <= time.monotonic() - started < 1.0
    threading.Timer(0.1, flag.set).start()
    started = time.monotonic()
    assert flag.wait(10) is True
    assert time.monotonic() - started < 1.0
