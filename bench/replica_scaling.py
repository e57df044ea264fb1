"""Candidates/s with 1 and 2 benchmarker replicas over the real RabbitMQ.

Starts `hpcrl-benchmarker serve` replicas as processes on a fresh namespace, publishes N
candidates, and measures the time until N results are on bench-results. By default timing is
exclusive per node (one lock file for both replicas), so on one node only the compiles
overlap; `--per-cpu` gives replica i the i-th CPU of this process's affinity
(`benchmarker.cpus`), so replicas time at once on their own CPUs. `bench/fleet.py` is the
fuller measurement (mixed kernels, latency percentiles, timing fidelity).

    .venv/bin/python bench/replica_scaling.py [--candidates 12] [--per-cpu] [--url amqp://...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pika

from hpcrl_benchmarker.host import has_avx512
from hpcrl_common.broker import Publish, Publisher
from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import BenchResult, BenchSpec, Candidate, decode
from hpcrl_common.topology import BENCH_RESULTS, CODE_TO_BENCH, Topology

KERNELS = Path(__file__).resolve().parent.parent / "tests" / "benchmarker" / "kernels"


def run(replicas: int, count: int, url: str, allow: list[str], per_cpu: bool = False) -> float:
    settings = BrokerSettings(url=url, namespace=f"bench-{uuid.uuid4().hex[:8]}")
    topology = Topology(settings.namespace, settings.delivery_limit)
    root = Path(tempfile.mkdtemp(prefix="hpcrl-scaling-"))
    cpus = sorted(os.sched_getaffinity(0))
    configs = []
    for i in range(replicas):
        config = root / f"bench-{i}.toml"
        own = f'cpus = "{cpus[i % len(cpus)]}"\n' if per_cpu else ""
        config.write_text(
            f'[broker]\nurl = "{url}"\nnamespace = "{settings.namespace}"\n'
            f"[benchmarker]\nmetrics_port = 0\nconcurrency = 2\n{own}"
            f'work_dir = "{root}/work-{i}"\nlock_path = "{root}/timing.lock"\n'
        )
        configs.append(config)
    with Publisher(settings, "scaling") as publisher:
        publisher.topology.declare(publisher._ensure_channel())
    extra = [arg for isa in allow for arg in ("--allow-isa", isa)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hpcrl_benchmarker.cli",
                "serve",
                "--config",
                str(config),
                *extra,
            ],
            stderr=subprocess.DEVNULL,
        )
        for config in configs
    ]
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    try:
        time.sleep(3)  # let the replicas connect
        codes = [(KERNELS / n).read_text() for n in ("naive.c", "ikj_omp.c", "avx2_prefetch.c")]
        started = time.monotonic()
        with Publisher(settings, "scaling") as publisher:
            for i in range(count):
                publisher.publish(
                    Publish(
                        topology.name(CODE_TO_BENCH),
                        Candidate(
                            id=f"s/{i}",
                            group_id="s",
                            index=i,
                            completion=codes[i % len(codes)],
                            bench=BenchSpec(task="matmul", stage=6),
                        ),
                    )
                )
        done = 0
        while done < count:
            method, _props, body = channel.basic_get(topology.name(BENCH_RESULTS), auto_ack=True)
            if method is None:
                time.sleep(0.05)
                continue
            decode(body, BenchResult)
            done += 1
        elapsed = time.monotonic() - started
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
        topology.delete(channel)
        connection.close()
    return count / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=int, default=12)
    parser.add_argument(
        "--per-cpu",
        action="store_true",
        help="give each replica a CPU of its own (benchmarker.cpus)",
    )
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    args = parser.parse_args()
    allow = [] if has_avx512() else ["avx2"]
    one = run(1, args.candidates, args.url, allow, args.per_cpu)
    print(f"1 replica:  {one:.2f} candidates/s")
    two = run(2, args.candidates, args.url, allow, args.per_cpu)
    print(f"2 replicas: {two:.2f} candidates/s")
    print(f"speed-up 2 vs 1: {two / one:.2f}")


if __name__ == "__main__":
    main()
