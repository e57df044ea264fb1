"""Verdict latency and throughput through the reward client (hpcrl-reward-client), against
the same kernels judged in-process (`hpcrl-benchmarker check`'s path, `Benchmarker.evaluate`)
in the same run: the client's overhead per verdict.

For each configuration (`--replicas 1,2`) it starts that many `hpcrl-benchmarker serve`
replicas on a fresh namespace of the real RabbitMQ, each owning one CPU (`benchmarker.cpus`:
replica i gets the i-th of `--cpus`; with `--node`, no CPU sets: every replica on the whole
node, timing exclusively there), and a `RewardClient` in this process. The in-process
benchmarker has replica 0's settings and, like a replica with a CPU set, runs on that set (its
thread and numpy's BLAS threads; the client's I/O thread stays unpinned). After a warm-up
(every replica and the in-process benchmarker compile their harness once):

  fixed cost  `--empty` requests without code, one at a time: a verdict with nothing to
              compile or time (format_violation), submit to verdict.
  latency     `--rounds` rounds; in each, every kernel is judged once in-process and once
              through the client (submit, wait for the verdict), back to back, alternating
              which goes first, so that load from other processes falls on both alike. Per
              kernel: p50 and p95 of both, the overhead = (median client latency - median
              in-process time) / median in-process time, and the median of the rounds'
              differences; then the overhead over the sum of the kernels' medians, against
              the target (<= 10 %). The client latency is split into the replica's steps (the
              verdict's step durations) and the rest.
  throughput  `--burst` requests (the kernels in turn) submitted at once: verdicts/s from the
              first submit to the last verdict, and latency p50/p95 from submit to verdict
              (queueing included), against the in-process rate one at a time.

It prints the node's CPU model and ISA first (rewards are measured in AVX-512; on a node
without it the replicas and the in-process benchmarker allow AVX2). Kernels from
tests/benchmarker/kernels; every verdict is expected to be a success (the statuses are
printed). `--timing-attempts` defaults to 1 on both sides. A default run takes about 2 min on
a 2-core node.

    .venv/bin/python bench/reward_service.py [--rounds 7] [--burst 12] [--replicas 1,2]
        [--kernels naive.c,ikj_omp.c,avx2_prefetch.c] [--cpus A,B] [--node] [--empty 10]
        [--timing-attempts 1] [--url amqp://...]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pika
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hpcrl_benchmarker.config import BenchmarkerSection
from hpcrl_benchmarker.host import detect, has_avx512
from hpcrl_benchmarker.pipeline import Benchmarker
from hpcrl_common.config import BrokerSettings
from hpcrl_common.task import load_task
from hpcrl_common.topology import REWARD_REQUESTS, Topology
from hpcrl_reward_client import RewardClient, RewardRequestSpec

KERNELS = Path(__file__).resolve().parent.parent / "tests" / "benchmarker" / "kernels"
DEFAULT_KERNELS = "naive.c,ikj_omp.c,avx2_prefetch.c"
TARGET = 0.10


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank: the smallest value with at least a share q of them at or below it."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def overhead(client_s: Sequence[float], inproc_s: Sequence[float]) -> float:
    """(median client latency - median in-process time) / median in-process time."""
    inproc = statistics.median(inproc_s)
    return (statistics.median(client_s) - inproc) / inproc


def pooled_overhead(client: dict[str, list[float]], inproc: dict[str, list[float]]) -> float:
    """The same over the sum of the kernels' medians (each kernel weighs its verdict time)."""
    c = sum(statistics.median(client[k]) for k in client)
    i = sum(statistics.median(inproc[k]) for k in client)
    return (c - i) / i


def node() -> tuple[str, str]:
    """The CPU model and the ISA rewards are measured in here."""
    host = detect()
    return host.cpu_model, (
        "AVX-512"
        if "avx512f" in host.flags
        else "AVX2"
        if "avx2" in host.flags
        else "neither AVX-512 nor AVX2"
    )


@dataclass
class Outcome:
    replicas: int
    inproc: dict[str, list[float]] = field(default_factory=dict)
    client: dict[str, list[float]] = field(default_factory=dict)
    handler: list[float] = field(default_factory=list)  # the replica's step durations
    transport: list[float] = field(default_factory=list)  # client latency - handler
    empty: list[float] = field(default_factory=list)  # verdicts without a compile
    burst: list[float] = field(default_factory=list)  # submit -> verdict, all at once
    rate: float = 0.0  # burst verdicts/s
    statuses: Counter[str] = field(default_factory=Counter)
    load: tuple[float, float] = (0.0, 0.0)


def write_config(
    path: Path, url: str, namespace: str, root: Path, cpus: str, timing_attempts: int | None
) -> None:
    section = BenchmarkerSection()
    attempts = f"timing_attempts = {timing_attempts}\n" if timing_attempts else ""
    path.write_text(
        f'[broker]\nurl = "{url}"\nnamespace = "{namespace}"\n'
        f"prefetch = {section.concurrency}\n"  # no replica hoards a burst
        f'[logging]\nformat = "json"\n'
        f'[benchmarker]\nmetrics_port = 0\ncpus = "{cpus}"\n{attempts}'
        f'work_dir = "{root}/work-{cpus or "node"}-{path.stem}"\n'
        f'lock_path = "{root}/timing.lock"\n'
    )


def judge_like_a_replica(bench: Benchmarker) -> ThreadPoolExecutor:
    """The thread that judges in-process. A replica with a CPU set runs wholly there
    (``Benchmarker.confine``: checks, references, verification, the harness's parent, its
    numpy BLAS threads); so does this thread, and the threads this process had started
    before (numpy's BLAS pool) are moved there too. The main thread, and the client's I/O
    thread it starts, stay where they were: the client runs beside the trainer, not on
    the benchmarker's CPUs."""
    if not bench.cpus:
        return ThreadPoolExecutor(1, thread_name_prefix="in-process")
    main = threading.main_thread().native_id
    for entry in Path("/proc/self/task").iterdir():
        if int(entry.name) != main:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.sched_setaffinity(int(entry.name), bench.cpus)
    return ThreadPoolExecutor(
        1,
        thread_name_prefix="in-process",
        initializer=os.sched_setaffinity,
        initargs=(0, bench.cpus),
    )


def wait_for_consumers(
    url: str, queue: str, count: int, procs: list[subprocess.Popen], timeout_s: float = 90
) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in procs:
                if proc.poll() is not None:
                    raise SystemExit(f"a replica exited with status {proc.returncode}")
            try:
                consumers = (
                    connection.channel().queue_declare(queue, passive=True).method.consumer_count
                )
            except pika.exceptions.ChannelClosedByBroker:  # not declared yet
                consumers = 0
            if consumers >= count:
                return
            time.sleep(0.2)
        raise SystemExit(f"{count} replicas did not connect within {timeout_s:g} s")
    finally:
        connection.close()


def run(
    replicas: int,
    sets: list[str],
    codes: dict[str, str],
    args: argparse.Namespace,
    allow: list[str],
    root: Path,
    progress: Progress,
) -> Outcome:
    settings = BrokerSettings(url=args.url, namespace=f"reward-bench-{uuid.uuid4().hex[:8]}")
    topology = Topology(settings.namespace, settings.delivery_limit)
    root.mkdir(parents=True)
    procs = []
    for k in range(replicas):
        config = root / f"replica-{k}.toml"
        write_config(config, args.url, settings.namespace, root, sets[k], args.timing_attempts)
        argv = [sys.executable, "-m", "hpcrl_benchmarker.cli", "serve", "--config", str(config)]
        for isa in allow:
            argv += ["--allow-isa", isa]
        with open(root / f"replica-{k}.log", "wb") as log:
            procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log))
    section = BenchmarkerSection(
        work_dir=root / "in-process",
        lock_path=root / "timing.lock",
        cpus=sets[0],
        allow_isa=allow,
        **({"timing_attempts": args.timing_attempts} if args.timing_attempts else {}),
    )
    bench = Benchmarker(section, detect())
    judge = judge_like_a_replica(bench)
    task = load_task("matmul")
    outcome = Outcome(replicas)
    client = RewardClient(
        settings, "reward-bench", timeout_s=600, max_outstanding=max(64, args.burst)
    )
    step = progress.add_task(
        f"{replicas} replica(s)",
        total=(replicas + 1) * len(codes) + args.empty + 2 * args.rounds * len(codes) + args.burst,
    )

    def in_process(code: str) -> float:
        started = time.perf_counter()
        verdict = judge.submit(bench.evaluate, code, stage=6, opt_level="O3", task=task).result()
        elapsed = time.perf_counter() - started
        outcome.statuses[f"in-process {verdict.status}"] += 1
        progress.advance(step)
        return elapsed

    def through_client(code: str) -> float:
        started = time.perf_counter()
        verdict = client.submit(RewardRequestSpec(code, "matmul", 6, "O3")).result()
        elapsed = time.perf_counter() - started
        outcome.statuses[f"client {verdict.status}"] += 1
        handler = sum(verdict.durations_s.values())
        outcome.handler.append(handler)
        outcome.transport.append(elapsed - handler)
        progress.advance(step)
        return elapsed

    try:
        wait_for_consumers(args.url, topology.name(REWARD_REQUESTS), replicas, procs)
        # Warm-up: every replica and the in-process benchmarker compile their harness once.
        for code in codes.values():
            in_process(code)
            for future in client.submit_many(
                [RewardRequestSpec(code, "matmul", 6, "O3")] * replicas
            ):
                future.result()
                progress.advance(step)
        outcome.statuses.clear()
        outcome.handler.clear()
        outcome.transport.clear()
        outcome.load = (os.getloadavg()[0], 0.0)
        for name in codes:
            outcome.inproc[name], outcome.client[name] = [], []
        for _ in range(args.empty):  # the path's fixed cost: nothing to compile or time
            started = time.perf_counter()
            verdict = client.submit(RewardRequestSpec("no code here")).result()
            outcome.empty.append(time.perf_counter() - started)
            outcome.statuses[f"empty {verdict.status}"] += 1
            progress.advance(step)
        for r in range(args.rounds):
            for name, code in codes.items():
                if r % 2 == 0:
                    outcome.inproc[name].append(in_process(code))
                    outcome.client[name].append(through_client(code))
                else:
                    outcome.client[name].append(through_client(code))
                    outcome.inproc[name].append(in_process(code))
        # Throughput: everything at once.
        names = list(codes)
        specs = [
            RewardRequestSpec(codes[names[i % len(names)]], "matmul", 6, "O3")
            for i in range(args.burst)
        ]
        done: list[float] = []
        lock = threading.Lock()

        def finished(future: object) -> None:
            with lock:
                done.append(time.perf_counter())
            progress.advance(step)

        started = time.perf_counter()
        futures = client.submit_many(specs)
        for future in futures:
            future.add_done_callback(finished)
        for future in futures:
            outcome.statuses[f"burst {future.result().status}"] += 1
        with lock:
            outcome.burst = [at - started for at in done]
        outcome.rate = len(specs) / max(outcome.burst)
        outcome.load = (outcome.load[0], os.getloadavg()[0])
    finally:
        client.close()
        judge.shutdown()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        connection = pika.BlockingConnection(pika.URLParameters(args.url))
        try:
            channel = connection.channel()
            topology.delete(channel)
            channel.queue_delete(topology.reply_queue(client.client))
        finally:
            connection.close()
        progress.remove_task(step)
    return outcome


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:7.1f}"


def paired(client: Sequence[float], inproc: Sequence[float]) -> float:
    """Median of the rounds' differences (client - in-process, judged back to back)."""
    return statistics.median(c - i for c, i in zip(client, inproc, strict=True))


def report(outcome: Outcome, console: Console) -> float:
    console.print(
        f"[bold]{outcome.replicas} replica(s)[/bold] (load average "
        f"{outcome.load[0]:.2f} -> {outcome.load[1]:.2f}; "
        f"{', '.join(f'{k} {v}' for k, v in sorted(outcome.statuses.items()))})"
    )
    console.print(
        "  one at a time, ms      in-process p50    p95 |  client p50    p95 | "
        "overhead | paired diff"
    )
    for name in outcome.client:
        inproc, client = outcome.inproc[name], outcome.client[name]
        console.print(
            f"  {name:20s}     {ms(statistics.median(inproc))} "
            f"{ms(percentile(inproc, 0.95))} |     {ms(statistics.median(client))} "
            f"{ms(percentile(client, 0.95))} | {overhead(client, inproc):+7.1%}  | "
            f"{ms(paired(client, inproc))}"
        )
    every = [x for values in outcome.client.values() for x in values]
    every_in = [x for values in outcome.inproc.values() for x in values]
    pooled = pooled_overhead(outcome.client, outcome.inproc)
    console.print(
        f"  {'all kernels':20s}     {ms(statistics.median(every_in))} "
        f"{ms(percentile(every_in, 0.95))} |     {ms(statistics.median(every))} "
        f"{ms(percentile(every, 0.95))} | {pooled:+7.1%}  (over the sum of the "
        f"kernels' medians; target <= {TARGET:.0%}: "
        f"{'met' if pooled <= TARGET else 'missed'})"
    )
    steps = statistics.median(outcome.handler)
    console.print(
        f"  client latency = the replica's steps p50 {ms(steps)}"
        f" ms + the rest (the replica outside its steps, broker, client) p50 "
        f"{ms(statistics.median(outcome.transport))} ms, p95 "
        f"{ms(percentile(outcome.transport, 0.95))} ms"
    )
    if outcome.empty:
        console.print(
            f"  a verdict without a compile (format_violation), one at a time: p50 "
            f"{ms(statistics.median(outcome.empty))} ms, p95 "
            f"{ms(percentile(outcome.empty, 0.95))} ms"
        )
    inproc_rate = len(every_in) / sum(every_in)
    console.print(
        f"  burst of {len(outcome.burst)}: {outcome.rate:.2f} verdicts/s through the "
        f"client (in-process one at a time {inproc_rate:.2f}/s: "
        f"{outcome.rate / inproc_rate:.2f}x); latency submit -> verdict p50 "
        f"{statistics.median(outcome.burst):.2f} s, p95 "
        f"{percentile(outcome.burst, 0.95):.2f} s"
    )
    return pooled


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Needs RabbitMQ (--url) and the benchmarker's sandbox (bubblewrap, gcc, "
        "OpenBLAS), as `make install` sets up.",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=7,
        help="latency rounds: each kernel once in-process and once through the "
        "client per round (default 7)",
    )
    parser.add_argument(
        "--burst",
        type=int,
        default=12,
        help="requests submitted at once for the throughput (default 12)",
    )
    parser.add_argument(
        "--replicas", default="1,2", help="configurations, replicas per run (default 1,2)"
    )
    parser.add_argument(
        "--kernels",
        default=DEFAULT_KERNELS,
        help=f"correct kernels of tests/benchmarker/kernels (default {DEFAULT_KERNELS})",
    )
    parser.add_argument(
        "--cpus",
        default=None,
        help="the replicas' CPUs, one each, comma-separated (default: the first "
        "ones of this process's affinity); the in-process benchmarker gets the "
        "first",
    )
    parser.add_argument(
        "--node",
        action="store_true",
        help="no CPU sets: every replica (and the in-process benchmarker) on the "
        "whole node, timing exclusively there",
    )
    parser.add_argument(
        "--empty",
        type=int,
        default=10,
        help="verdicts without a compile (no code: format_violation) sent one at "
        "a time first: the path's fixed cost (default 10)",
    )
    parser.add_argument(
        "--timing-attempts",
        type=int,
        default=1,
        help="benchmarker.timing_attempts of the replicas and the in-process "
        "benchmarker alike (default 1: a noisy measurement is not timed again, "
        "which on a busy node adds a random second timing to either side; 0: "
        "the service's own setting)",
    )
    parser.add_argument(
        "--url",
        default="amqp://guest:guest@127.0.0.1:5672/%2F",
        help="the broker (default: the local test broker, guest)",
    )
    return parser


def main(argv: list[str] | None = None) -> dict[int, float]:
    """Runs every configuration; returns each one's pooled overhead (by replicas)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        counts = [int(x) for x in args.replicas.split(",")]
    except ValueError:
        parser.error("--replicas takes numbers, e.g. 1,2")
    if args.rounds < 1 or args.burst < 1 or min(counts) < 1:
        parser.error("--rounds, --burst and --replicas must be at least 1")
    if args.empty < 0 or args.timing_attempts < 0:
        parser.error("--empty and --timing-attempts cannot be negative")
    codes = {}
    for name in args.kernels.split(","):
        if not (KERNELS / name).is_file():
            parser.error(f"no kernel {name} in {KERNELS}")
        codes[name] = (KERNELS / name).read_text()
    affinity = [str(c) for c in sorted(os.sched_getaffinity(0))]
    cpus = args.cpus.split(",") if args.cpus else affinity
    if args.node:
        cpus = [""] * max(counts)
    elif len(cpus) < max(counts):
        parser.error(
            f"{max(counts)} replicas need {max(counts)} CPUs (have {','.join(cpus)}); or --node"
        )
    console = Console(highlight=False, soft_wrap=True)
    model, isa = node()
    allow = [] if has_avx512() else ["avx2"]
    console.print(
        f"node: {model}, {isa} ({len(affinity)} CPUs here, load average "
        f"{os.getloadavg()[0]:.2f}); kernels {', '.join(codes)}; "
        f"{'no CPU sets' if args.node else 'CPU sets ' + ','.join(cpus[: max(counts)])};"
        f" {args.rounds} rounds, burst {args.burst}, timing attempts "
        f"{args.timing_attempts or 'as the service'}"
    )
    base = Path(tempfile.mkdtemp(prefix="hpcrl-reward-bench-"))
    results = {}
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as progress:
        for replicas in counts:
            outcome = run(replicas, cpus, codes, args, allow, base / f"{replicas}", progress)
            results[replicas] = report(outcome, console)
    return results


if __name__ == "__main__":
    main()
