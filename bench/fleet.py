"""A stream of real kernels through benchmarker replicas that own CPU sets, over the real broker.

Each configuration gets a fresh namespace and fresh `hpcrl-benchmarker serve` processes:

  1x1   one replica, `cpus = "A"`                          (one core)
  2x1   two replicas, `cpus = "A"` and `cpus = "B"`         (one core each, timing at once)
  node  one replica owning the node (`cpus` unset: timings exclusive on the node),
        kernels on one thread like the others

A few warm-up candidates go first (each replica compiles its harness once); then M candidates
are published at once (or at `--rate` per second) from a fixed mix of test kernels: correct
(naive, avx2_prefetch, ikj_omp at -O3), slow (naive at -O0) and wrong (wrong, sparse_wrong).
For each configuration it prints candidates/s, end-to-end latency (publish -> result received),
the service time (the result's step durations) and the queue lag (latency - service: waiting
in the queue, for a replica, for the timing lock) as p50/p90/p99, and the load average.
Then the speed-up of 2x1 over 1x1 (measured in the same run; the target on a 2-core node is
>= 1.8) and what sharing the node costs in timing fidelity: GFLOPS and CV of the same correct
kernels in 2x1 (a neighbour timing on the other core) against node (exclusive timing).

    .venv/bin/python bench/fleet.py [--candidates 32] [--rounds 1] [--cpus A,B]
                                    [--configs 1x1,2x1,node] [--rate 0] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pika

from hpcrl_benchmarker.host import has_avx512
from hpcrl_common.broker import Publish, Publisher
from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import BenchResult, BenchSpec, Candidate, decode
from hpcrl_common.task import load_task
from hpcrl_common.topology import BENCH_RESULTS, CODE_TO_BENCH, Topology

KERNELS = Path(__file__).resolve().parent.parent / "tests" / "benchmarker" / "kernels"
# (label, file, opt level): correct, wrong, correct, slow, correct, wrong
MIX = [
    ("naive", "naive.c", "O3"),
    ("wrong", "wrong.c", "O3"),
    ("avx2_prefetch", "avx2_prefetch.c", "O3"),
    ("naive_O0", "naive.c", "O0"),
    ("ikj_omp", "ikj_omp.c", "O3"),
    ("sparse_wrong", "sparse_wrong.c", "O3"),
]
FLOPS = load_task("matmul").flop_count(load_task("matmul").sizes.reward)


@dataclass
class Outcome:
    name: str
    replicas: int
    rate: float = 0.0  # candidates/s
    latency: list[float] = field(default_factory=list)
    service: list[float] = field(default_factory=list)
    lag: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    gflops: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    cv: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    attempts: list[int] = field(default_factory=list)
    noisy: int = 0
    load: tuple[float, float] = (0.0, 0.0)


def percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)

    def at(q: float) -> float:  # nearest rank
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]

    return f"p50 {at(0.5):6.2f}  p90 {at(0.9):6.2f}  p99 {at(0.99):6.2f} s"


def write_config(
    path: Path, url: str, namespace: str, root: Path, cpus: str, concurrency: int
) -> None:
    threads = "threads = 1\n" if not cpus else ""  # a set's size is 1 already
    path.write_text(
        f'[broker]\nurl = "{url}"\nnamespace = "{namespace}"\nprefetch = {concurrency}\n'
        f'[logging]\nformat = "json"\n'
        f'[benchmarker]\nmetrics_port = 0\nconcurrency = {concurrency}\ncpus = "{cpus}"\n'
        f'{threads}work_dir = "{root}/work-{cpus or "node"}"\n'
        f'lock_path = "{root.parent}/timing.lock"\n'
    )


def candidates(group: str, count: int) -> list[Candidate]:
    codes = {name: (KERNELS / name).read_text() for _, name, _ in MIX}
    out = []
    for i in range(count):
        _label, name, opt = MIX[i % len(MIX)]
        out.append(
            Candidate(
                id=f"{group}/{i}",
                group_id=group,
                index=i,
                completion=codes[name],
                bench=BenchSpec(task="matmul", stage=6, opt_level=opt),
            )
        )
    return out


def wait_for_consumers(
    channel: pika.adapters.blocking_connection.BlockingChannel,
    queue: str,
    count: int,
    procs: list[subprocess.Popen],
    timeout_s: float = 90,
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise SystemExit(f"a replica exited with status {proc.returncode}")
        if channel.queue_declare(queue, passive=True).method.consumer_count >= count:
            return
        time.sleep(0.2)
    raise SystemExit(f"{count} replicas did not connect within {timeout_s:g} s")


def collect(
    channel: pika.adapters.blocking_connection.BlockingChannel,
    queue: str,
    expected: set[str],
    timeout_s: float,
) -> dict[str, tuple[float, BenchResult]]:
    got: dict[str, tuple[float, BenchResult]] = {}
    deadline = time.monotonic() + timeout_s
    for method, _props, body in channel.consume(queue, auto_ack=True, inactivity_timeout=0.02):
        if method is not None:
            result = decode(body, BenchResult)
            if result.id in expected:
                got[result.id] = (time.monotonic(), result)
        if len(got) == len(expected) or time.monotonic() > deadline:
            break
    channel.cancel()
    if len(got) < len(expected):
        raise SystemExit(f"only {len(got)} of {len(expected)} results within {timeout_s:g} s")
    return got


def run(
    name: str, sets: list[str], count: int, args: argparse.Namespace, allow: list[str], base: Path
) -> Outcome:
    settings = BrokerSettings(url=args.url, namespace=f"fleet-{uuid.uuid4().hex[:8]}")
    topology = Topology(settings.namespace, settings.delivery_limit)
    root = base / name
    root.mkdir(parents=True)
    with Publisher(settings, "fleet") as publisher:
        publisher.topology.declare(publisher._ensure_channel())
    procs = []
    for k, cpus in enumerate(sets):
        config = root / f"replica-{k}.toml"
        write_config(config, args.url, settings.namespace, root, cpus, args.concurrency)
        argv = [sys.executable, "-m", "hpcrl_benchmarker.cli", "serve", "--config", str(config)]
        for isa in allow:
            argv += ["--allow-isa", isa]
        with open(root / f"replica-{k}.log", "wb") as log:
            procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log))
    connection = pika.BlockingConnection(pika.URLParameters(args.url))
    channel = connection.channel()
    results_queue = topology.name(BENCH_RESULTS)
    outcome = Outcome(name, len(sets))
    try:
        wait_for_consumers(channel, topology.name(CODE_TO_BENCH), len(sets), procs)
        with Publisher(settings, "fleet") as publisher:
            warm = candidates("warm", 2 * len(sets))
            for cand in warm:
                publisher.publish(Publish(topology.name(CODE_TO_BENCH), cand))
            collect(channel, results_queue, {c.id for c in warm}, 300)
            load_before = os.getloadavg()[0]
            stream = candidates(f"s{name}", count)
            sent: dict[str, float] = {}
            started = time.monotonic()
            for i, cand in enumerate(stream):
                if args.rate > 0:
                    time.sleep(max(0.0, started + i / args.rate - time.monotonic()))
                sent[cand.id] = time.monotonic()
                publisher.publish(Publish(topology.name(CODE_TO_BENCH), cand))
        got = collect(channel, results_queue, set(sent), 60 + 20 * count)
        finished = max(at for at, _ in got.values())
        outcome.rate = count / (finished - started)
        outcome.load = (load_before, os.getloadavg()[0])
        labels = {c.id: MIX[c.index % len(MIX)][0] for c in stream}
        for cid, (at, result) in got.items():
            latency = at - sent[cid]
            service = sum(result.durations_s.values())
            outcome.latency.append(latency)
            outcome.service.append(service)
            outcome.lag.append(max(0.0, latency - service))
            outcome.statuses[result.status] += 1
            if result.gflops is not None and result.timing is not None:
                outcome.gflops[labels[cid]].append(result.gflops)
                outcome.cv[labels[cid]].append(result.timing.cv)
                outcome.attempts.append(result.timing.attempts)
                outcome.noisy += result.timing.noisy
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        topology.delete(channel)
        connection.close()
    return outcome


def report(outcome: Outcome) -> None:
    statuses = ", ".join(f"{k} {v}" for k, v in sorted(outcome.statuses.items()))
    attempts = statistics.fmean(outcome.attempts) if outcome.attempts else 0.0
    print(
        f"{outcome.name:5s} {outcome.replicas} replica(s): {outcome.rate:5.2f} candidates/s  "
        f"(load average {outcome.load[0]:.2f} -> {outcome.load[1]:.2f}; {statuses}; "
        f"timing attempts mean {attempts:.2f}, noisy {outcome.noisy})"
    )
    print(
        f"      latency {percentiles(outcome.latency)}   service "
        f"{percentiles(outcome.service)}   queue lag {percentiles(outcome.lag)}"
    )


def fidelity(shared: list[Outcome], exclusive: list[Outcome]) -> None:
    """Median GFLOPS and median CV per correct kernel: one replica per core against node."""

    def pooled(outcomes: list[Outcome], what: str) -> dict[str, list[float]]:
        pool: dict[str, list[float]] = defaultdict(list)
        for outcome in outcomes:
            for label, values in getattr(outcome, what).items():
                pool[label] += values
        return pool

    print("timing fidelity, one replica per core (2x1) vs exclusive node (node), medians:")
    g_shared, g_node = pooled(shared, "gflops"), pooled(exclusive, "gflops")
    c_shared, c_node = pooled(shared, "cv"), pooled(exclusive, "cv")
    for label in sorted(set(g_shared) & set(g_node)):
        a, b = statistics.median(g_shared[label]), statistics.median(g_node[label])
        print(
            f"  {label:14s} GFLOPS {a:7.3f} vs {b:7.3f} ({a / b - 1:+6.1%})   "
            f"cv {statistics.median(c_shared[label]):6.2%} vs "
            f"{statistics.median(c_node[label]):6.2%}   "
            f"(n {len(g_shared[label])} / {len(g_node[label])})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=int, default=32, help="per configuration")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the configurations (alternating) this many times",
    )
    parser.add_argument(
        "--cpus",
        default=None,
        help="two CPUs A,B for the replicas (default: the first two of this process's affinity)",
    )
    parser.add_argument("--configs", default="1x1,2x1,node")
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="publish at this many candidates/s (default 0: all at once)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="benchmarker.concurrency of each replica (prefetch too)",
    )
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    args = parser.parse_args()
    if not 1 <= args.candidates < 1024:
        parser.error("--candidates must be 1..1023")
    cpus = (
        args.cpus.split(",") if args.cpus else [str(c) for c in sorted(os.sched_getaffinity(0))[:2]]
    )
    if len(cpus) < 2:
        parser.error("needs two CPUs")
    a, b = cpus[:2]
    configs = {"1x1": [a], "2x1": [a, b], "node": [""]}
    names = args.configs.split(",")
    if unknown := set(names) - set(configs):
        parser.error(f"unknown configurations {sorted(unknown)} (known: {', '.join(configs)})")
    allow = [] if has_avx512() else ["avx2"]
    base = Path(tempfile.mkdtemp(prefix="hpcrl-fleet-"))
    print(
        f"{args.candidates} candidates per configuration, mix "
        f"{', '.join(lab for lab, _, _ in MIX)}; CPUs {a},{b}; "
        f"concurrency {args.concurrency}; {os.cpu_count()} CPUs on the node"
    )
    outcomes: dict[str, list[Outcome]] = defaultdict(list)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            outcome = run(
                f"{name}-{r}" if args.rounds > 1 else name,
                configs[name],
                args.candidates,
                args,
                allow,
                base / f"round{r}",
            )
            outcome.name = name
            outcomes[name].append(outcome)
            report(outcome)
    if outcomes["1x1"] and outcomes["2x1"]:
        ratios = [
            two.rate / one.rate for one, two in zip(outcomes["1x1"], outcomes["2x1"], strict=True)
        ]
        print(
            f"speed-up 2x1 vs 1x1: {', '.join(f'{x:.2f}' for x in ratios)}"
            f"{f' (median {statistics.median(ratios):.2f})' if len(ratios) > 1 else ''}"
            f"  target >= 1.8"
        )
    if outcomes["2x1"] and outcomes["node"]:
        fidelity(outcomes["2x1"], outcomes["node"])


if __name__ == "__main__":
    main()
