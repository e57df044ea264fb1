"""Deferred settles over the real RabbitMQ: how soon a settle made on another thread reaches
the broker, and how many messages a deferring consumer passes per second.

A :class:`hpcrl_common.broker.Consumer` whose handler returns ``DEFER`` and hands each
delivery to a worker thread that calls ``consumer.settle`` (as the learner settles a step's
groups, and the benchmarker hands a delivery back with ``consumer.fail``). On a scratch
namespace, two phases per round:

* settle latency: prefetch 1, the queue filled beforehand, the worker acks without outputs
  (the learner's settle). The figure is the time from the worker's ``settle`` call to the
  handler receiving the next message: the ack reaching the I/O thread, then the broker, and
  the next delivery (prefetch 1 holds it back until the ack);
* throughput: prefetch ``--prefetch``, ``--messages`` messages queued beforehand, the worker
  settles each with one output (a confirmed publish, then the ack). Messages/s from the first
  delivery to the last output received by a plain pika consumer of the output queue, and the
  time from each ``settle`` call to its output arriving there.

Each phase also runs a floor, same broker, same run: plain pika, acking (and publishing the
output with a confirm) inside the delivery callback, on the connection's own thread; the
ratios are the consumer's figure over the floor's.

``--against SRC`` compares two versions of the broker code in one run: each round runs this
script once with ``SRC`` (e.g. ``libs/common/src`` of another worktree) first on
``PYTHONPATH`` and once with this checkout's, alternating which goes first, and prints both
and their ratios (this checkout over ``SRC``).

    .venv/bin/python bench/broker_settle.py [--rounds 3] [--messages 1000] [--prefetch 8]
    .venv/bin/python bench/broker_settle.py --against /tmp/wt-before/libs/common/src
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pika

import hpcrl_common.broker as broker
from hpcrl_common.broker import DEFER, Consumer, Publish, Publisher
from hpcrl_common.config import BrokerSettings
from hpcrl_common.logs import configure_logging
from hpcrl_common.messages import (
    BenchSpec,
    Candidate,
    ChatMessage,
    GenerateRequest,
    candidate_id,
    decode,
)
from hpcrl_common.topology import CODE_TO_BENCH, GENERATE_REQUESTS, Topology

HERE_SRC = Path(__file__).resolve().parent.parent / "libs" / "common" / "src"
# The figures, in print order: (key, label, unit, lower is better).
FIGURES = (
    ("settle_p50_ms", "settle -> next delivery, p50", "ms", True),
    ("settle_p95_ms", "settle -> next delivery, p95", "ms", True),
    ("output_p50_ms", "settle -> output received, p50", "ms", True),
    ("output_p95_ms", "settle -> output received, p95", "ms", True),
    ("messages_per_s", "messages/s in -> out", "/s", False),
)


def request(index: int) -> GenerateRequest:
    return GenerateRequest(
        id=f"m{index:06d}",
        experiment="bench",
        iteration=0,
        mode="seed",
        prompt=[ChatMessage(role="user", content="write a kernel")],
        group_size=1,
        bench=BenchSpec(task="matmul", stage=1),
    )


def output(message: GenerateRequest) -> Candidate:
    return Candidate(
        id=candidate_id(message.id, 0),
        group_id=message.id,
        index=0,
        completion="code",
        bench=message.bench,
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Sink:
    """A plain pika consumer of the output queue on its own thread: arrival time per id."""

    def __init__(self, url: str, queue_name: str) -> None:
        self.arrived: dict[str, float] = {}
        self.connection = pika.BlockingConnection(pika.URLParameters(url))
        channel = self.connection.channel()
        channel.basic_consume(queue_name, self._on_message, auto_ack=True)
        self.channel = channel
        self.thread = threading.Thread(target=channel.start_consuming, daemon=True)
        self.thread.start()

    def _on_message(self, _channel: Any, _method: Any, props: Any, _body: bytes) -> None:
        self.arrived[props.message_id] = time.perf_counter()

    def wait(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.arrived) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.arrived)} of {count} outputs arrived")
            time.sleep(0.005)

    def close(self) -> None:
        self.connection.add_callback_threadsafe(self.channel.stop_consuming)
        self.thread.join(10)
        self.connection.close()


def fill(settings: BrokerSettings, topology: Topology, first: int, count: int) -> None:
    with Publisher(settings, "settle-bench-fill") as publisher:
        publisher.publish(
            *(Publish(topology.name(GENERATE_REQUESTS), request(first + i)) for i in range(count))
        )


def deferring_run(
    settings: BrokerSettings, topology: Topology, count: int, with_output: bool, url: str
) -> dict[str, Any]:
    """The consumer under test: handler DEFERs, one worker thread settles each delivery."""
    arrived: dict[str, float] = {}
    settled: dict[str, float] = {}
    handoff: queue.SimpleQueue = queue.SimpleQueue()
    consumer = Consumer(settings, "settle-bench")

    def handle(message: GenerateRequest, delivery: Any) -> Any:
        arrived[message.id] = time.perf_counter()
        handoff.put((message, delivery))
        return DEFER

    def worker() -> None:
        while (item := handoff.get()) is not None:
            message, delivery = item
            outputs = (
                [Publish(topology.name(CODE_TO_BENCH), output(message))] if with_output else []
            )
            settled[message.id] = time.perf_counter()
            consumer.settle(delivery, outputs)

    consumer.subscribe(GENERATE_REQUESTS, handle)
    sink = Sink(url, topology.name(CODE_TO_BENCH)) if with_output else None
    threads = [
        threading.Thread(target=consumer.run, daemon=True),
        threading.Thread(target=worker, daemon=True),
    ]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 60 + count * 0.2
        while len(settled) < count and time.monotonic() < deadline:
            time.sleep(0.005)
        if sink is not None:
            sink.wait(count, max(1.0, deadline - time.monotonic()))
        time.sleep(0.2)  # the last ack
    finally:
        consumer.stop()
        handoff.put(None)
        for thread in threads:
            thread.join(30)
        if sink is not None:
            sink.close()
    return {"arrived": arrived, "settled": settled, "outputs": {} if sink is None else sink.arrived}


def floor_run(
    url: str, topology: Topology, count: int, prefetch: int, with_output: bool
) -> dict[str, Any]:
    """Plain pika on one thread: ack (after a confirmed publish) inside the callback."""
    arrived: dict[str, float] = {}
    settled: dict[str, float] = {}
    sink = Sink(url, topology.name(CODE_TO_BENCH)) if with_output else None
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.confirm_delivery()
    channel.basic_qos(prefetch_count=prefetch)

    def on_message(ch: Any, method: Any, _props: Any, body: bytes) -> None:
        message = decode(body, GenerateRequest)
        arrived[message.id] = time.perf_counter()
        settled[message.id] = time.perf_counter()
        if with_output:
            broker.publish_on(ch, Publish(topology.name(CODE_TO_BENCH), output(message)), 1 << 20)
        ch.basic_ack(method.delivery_tag)
        if len(settled) >= count:
            ch.stop_consuming()

    channel.basic_consume(topology.name(GENERATE_REQUESTS), on_message)
    channel.start_consuming()
    if sink is not None:
        sink.wait(count, 60)
        sink.close()
    connection.close()
    return {"arrived": arrived, "settled": settled, "outputs": {} if sink is None else sink.arrived}


def latency_figures(run: dict[str, Any]) -> dict[str, float]:
    ids = sorted(run["arrived"])
    gaps = [(run["arrived"][b] - run["settled"][a]) * 1e3 for a, b in itertools.pairwise(ids)]
    return {"settle_p50_ms": statistics.median(gaps), "settle_p95_ms": percentile(gaps, 0.95)}


def throughput_figures(run: dict[str, Any]) -> dict[str, float]:
    outs = [(run["outputs"][candidate_id(i, 0)] - run["settled"][i]) * 1e3 for i in run["settled"]]
    span = max(run["outputs"].values()) - min(run["arrived"].values())
    return {
        "output_p50_ms": statistics.median(outs),
        "output_p95_ms": percentile(outs, 0.95),
        "messages_per_s": len(run["outputs"]) / span,
    }


def one_round(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    settings = BrokerSettings(
        url=args.url, namespace=f"settle-{uuid.uuid4().hex[:8]}", declare_topology=True, prefetch=1
    )
    topology = Topology(settings.namespace, settings.delivery_limit)
    out: dict[str, dict[str, float]] = {"consumer": {}, "floor": {}}
    try:
        n = args.latency_messages
        fill(settings, topology, 0, n)
        out["consumer"].update(
            latency_figures(deferring_run(settings, topology, n, False, args.url))
        )
        fill(settings, topology, n, n)
        out["floor"].update(latency_figures(floor_run(args.url, topology, n, 1, False)))
        wide = settings.model_copy(update={"prefetch": args.prefetch})
        fill(settings, topology, 2 * n, args.messages)
        out["consumer"].update(
            throughput_figures(deferring_run(wide, topology, args.messages, True, args.url))
        )
        fill(settings, topology, 2 * n + args.messages, args.messages)
        out["floor"].update(
            throughput_figures(floor_run(args.url, topology, args.messages, args.prefetch, True))
        )
    finally:
        connection = pika.BlockingConnection(pika.URLParameters(args.url))
        topology.delete(connection.channel())
        connection.close()
    return out


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "?"


def summary(rounds: list[dict[str, dict[str, float]]], side: str) -> dict[str, float]:
    return {key: statistics.median(r[side][key] for r in rounds) for key, *_ in FIGURES}


def print_own(rounds: list[dict[str, dict[str, float]]]) -> None:
    consumer, floor = summary(rounds, "consumer"), summary(rounds, "floor")
    print(f"medians over {len(rounds)} rounds ({broker.__file__}):")
    for key, label, unit, _ in FIGURES:
        ratio = consumer[key] / floor[key] if floor[key] else float("nan")
        print(
            f"  {label:32s} consumer {consumer[key]:9.2f} {unit:3s} floor "
            f"{floor[key]:9.2f} {unit:3s} consumer/floor {ratio:6.2f}"
        )


def child(src: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    command = [
        sys.executable,
        __file__,
        "--json",
        "--rounds",
        "1",
        "--url",
        args.url,
        "--messages",
        str(args.messages),
        "--prefetch",
        str(args.prefetch),
        "--latency-messages",
        str(args.latency_messages),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(args: argparse.Namespace) -> None:
    sides = {"against": Path(args.against).resolve(), "this": HERE_SRC}
    runs: dict[str, list[dict[str, Any]]] = {"against": [], "this": []}
    for index in range(args.rounds):
        for side in ("against", "this") if index % 2 == 0 else ("this", "against"):
            result = child(sides[side], args)
            runs[side].append(result)
            print(
                f"round {index + 1} {side:7s} ({result['module']}): "
                + ", ".join(
                    f"{key} {result['rounds'][0]['consumer'][key]:.2f}" for key, *_ in FIGURES
                ),
                flush=True,
            )
    medians = {side: summary([r["rounds"][0] for r in runs[side]], "consumer") for side in runs}
    floors = summary([r["rounds"][0] for side in runs for r in runs[side]], "floor")
    print(
        f"medians over {args.rounds} alternated rounds each; this = {sides['this']}, "
        f"against = {sides['against']}:"
    )
    for key, label, unit, lower in FIGURES:
        this, against = medians["this"][key], medians["against"][key]
        better = "better" if (this < against) == lower else "worse"
        print(
            f"  {label:32s} this {this:9.2f} {unit:3s} against {against:9.2f} {unit:3s} "
            f"this/against {this / against:6.3f} ({better}); floor {floors[key]:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--url",
        default="amqp://guest:guest@127.0.0.1:5672/%2F",
        help="the RabbitMQ to run on (a scratch namespace, deleted after)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds (with --against: rounds per side, alternated)"
    )
    parser.add_argument(
        "--messages",
        type=int,
        default=1000,
        help="messages through the throughput phase (and its floor)",
    )
    parser.add_argument(
        "--prefetch",
        type=int,
        default=8,
        help="prefetch of the throughput phase (broker.prefetch's default)",
    )
    parser.add_argument(
        "--latency-messages",
        type=int,
        default=200,
        help="messages through the settle-latency phase (prefetch 1)",
    )
    parser.add_argument(
        "--against",
        metavar="SRC",
        help="another libs/common/src to compare with, alternated in one run",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the rounds as one JSON line (what --against reads)",
    )
    args = parser.parse_args()
    if args.against:
        print(f"node: {cpu_model()}, {os.cpu_count()} CPUs", flush=True)
        compare(args)
        return
    configure_logging("settle-bench", "warning")
    rounds = [one_round(args) for _ in range(args.rounds)]
    if args.json:
        print(json.dumps({"module": broker.__file__, "rounds": rounds}))
        return
    print(f"node: {cpu_model()}, {os.cpu_count()} CPUs")
    print_own(rounds)


if __name__ == "__main__":
    main()
