"""What re-measuring each group's winner (``scheduler.confirm_winners``) costs the benchmarker.

Over the real RabbitMQ, in one process: the real scheduler service, one real benchmarker
replica (the service path: ``build_consumer``) and a stand-in generator that answers each
request with G candidates from the benchmarker's test kernels (fast, slow, wrong and
code-less ones, as a policy's samples are). Runs alternate confirmation on and off on fresh
namespaces (after one uncounted warm-up run) and report the benchmarker's handler time per
iteration (the sum of its ``hpcrl_broker_handler_seconds`` on code-to-bench), the
confirmations requested and their
outcomes (a disagreement between two honest measurements is a false suspect), and the
run's wall time.

    .venv/bin/python bench/confirm_cost.py [--rounds 2] [--iterations 3] [--group-size 8]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import uuid
from pathlib import Path

from prometheus_client import REGISTRY

from hpcrl_benchmarker.config import BenchmarkerConfig
from hpcrl_benchmarker.host import detect, has_avx512
from hpcrl_benchmarker.pipeline import Benchmarker
from hpcrl_benchmarker.service import build_consumer
from hpcrl_common.broker import Consumer, Publish
from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import Candidate, GenerateRequest, candidate_id
from hpcrl_common.topology import CODE_TO_BENCH, GENERATE_REQUESTS
from hpcrl_scheduler.config import SchedulerConfig
from hpcrl_scheduler.scheduler import Scheduler
from hpcrl_scheduler.service import SchedulerService
from hpcrl_scheduler.store import Store

KERNELS = Path(__file__).resolve().parent.parent / "tests" / "benchmarker" / "kernels"
# One group's samples, about as often correct as the demo's policy (0.6 at v0, 0.85 at the
# end): correct kernels of different speeds, a wrong one, one without code; at stages 1-2
# the SIMD and OpenMP kernels are stage violations.
MIX = ("naive.c", "avx2_prefetch.c", "naive.c", "ikj_omp.c", "wrong.c", "naive.c", "naive.c", None)
OUTCOMES = ("requested", "agreed", "disagreed", "inconclusive", "timed_out", "unconfirmed")


def sample(name: str | None) -> str:
    return "no code here" if name is None else f"```c\n{(KERNELS / name).read_text()}```\n"


def metric(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def one_run(
    url: str, confirm: bool, iterations: int, group_size: int, groups: int, root: Path
) -> dict[str, float]:
    settings = BrokerSettings(
        url=url, namespace=f"cost-{uuid.uuid4().hex[:8]}", declare_topology=True
    )
    bench_config = BenchmarkerConfig(
        broker=settings,
        benchmarker={
            "metrics_port": 0,
            "concurrency": 1,
            "work_dir": str(root / "work"),
            "lock_path": str(root / "timing.lock"),
            "allow_isa": [] if has_avx512() else ["avx2"],
        },
    )
    benchmarker = Benchmarker(bench_config.benchmarker, detect())
    bench = build_consumer(bench_config, benchmarker)
    config = SchedulerConfig(
        broker=settings,
        experiment={"name": "cost", "seed": 5},
        scheduler={
            "iterations": iterations,
            "group_size": group_size,
            "node_budget": groups,
            "max_staleness": 0,
            "metrics_port": 0,
            "tick_s": 0.1,
            "exit_when_done": True,
            "confirm_winners": confirm,
        },
    )
    scheduler = Scheduler(config, Store(root / f"{settings.namespace}.sqlite"))
    sched = Consumer(settings, "cost-scheduler", concurrency=2)
    SchedulerService(scheduler, sched)

    def generate(request: GenerateRequest, _delivery) -> list[Publish]:
        return [
            Publish(
                settings_topology.name(CODE_TO_BENCH),
                Candidate(
                    id=candidate_id(request.id, i),
                    group_id=request.id,
                    index=i,
                    completion=sample(MIX[i % len(MIX)]),
                    bench=request.bench,
                ),
            )
            for i in range(request.group_size)
        ]

    generator = Consumer(settings, "cost-generator")
    settings_topology = generator.topology
    generator.subscribe(GENERATE_REQUESTS, generate)
    queue = settings_topology.name(CODE_TO_BENCH)
    before = {o: metric("hpcrl_scheduler_confirmations_total", {"outcome": o}) for o in OUTCOMES}
    threads = [threading.Thread(target=c.run, daemon=True) for c in (bench, generator)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    sched.run()  # returns once every iteration is done (exit_when_done)
    wall = time.monotonic() - started
    for consumer in (bench, generator):
        consumer.stop()
    for thread in threads:
        thread.join(60)
    settings_topology.delete(bench_channel(url))
    handled = metric("hpcrl_broker_handler_seconds_sum", {"queue": queue})
    count = metric("hpcrl_broker_handler_seconds_count", {"queue": queue})
    out = {"bench_s": handled, "candidates": count, "wall_s": wall}
    for outcome in OUTCOMES:
        out[outcome] = (
            metric("hpcrl_scheduler_confirmations_total", {"outcome": outcome}) - before[outcome]
        )
    return out


def bench_channel(url: str):
    import pika

    return pika.BlockingConnection(pika.URLParameters(url)).channel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups", type=int, default=2, help="node budget per iteration")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hpcrl-confirm-cost-"))
    # Not counted: the first run builds the harness and warms the compile cache.
    one_run(args.url, False, 1, args.group_size, args.groups, root)
    totals: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for round_ in range(args.rounds):
        for confirm in (True, False) if round_ % 2 == 0 else (False, True):
            run = one_run(args.url, confirm, args.iterations, args.group_size, args.groups, root)
            totals[confirm].append(run)
            per_iteration = run["bench_s"] / args.iterations
            print(
                f"confirm={'on ' if confirm else 'off'} benchmarker {run['bench_s']:.1f} s "
                f"({per_iteration:.2f} s/iteration) over {run['candidates']:.0f} deliveries, "
                f"wall {run['wall_s']:.1f} s; confirmations: "
                + ", ".join(f"{o} {run[o]:.0f}" for o in OUTCOMES if run[o]),
                flush=True,
            )
    on = sum(r["bench_s"] for r in totals[True])
    off = sum(r["bench_s"] for r in totals[False])
    print(
        f"benchmarker time, on / off: {on:.1f} / {off:.1f} s = {on / off:.3f} "
        f"(+{100 * (on / off - 1):.1f} %)"
    )


if __name__ == "__main__":
    main()
