"""A kernel's measured GFLOPS beside busy services, at normal priority and under SCHED_IDLE.

On the demo's node the generator and the learner compute on the cores the benchmarker times
on, so an OpenMP kernel's threads wait for a CPU and the kernel is judged slower than it is.
``<service>.cpu_priority = "idle"`` puts those services under Linux's SCHED_IDLE: a timed
kernel's threads then take the cores first. This judges the same kernels through the real
pipeline (sandbox, verification, timing) in rounds that alternate three conditions:

- ``alone``: nothing else busy;
- ``beside, normal``: two busy processes (one torch thread each: a learner's passes and a
  generator's decode, bursts of matrix products with short gaps) at normal priority;
- ``beside, idle``: the same two under SCHED_IDLE (``hpcrl_common.service.apply_cpu_priority``).

Prints each kernel's median GFLOPS per condition and its ratio to ``alone`` (1.0: timed as if
the node were idle), and what the busy processes got done per second in each condition (the
price the services pay).

    .venv/bin/python bench/timing_priority.py [--rounds 5] [--catalogue data/policy/catalogue-...]

Kernels: the catalogue's fastest OpenMP kernel and its fastest single-threaded one (the newest
``data/policy/catalogue-*.json``, written by ``make demo`` / ``hpcrl-bootstrap``); without a
catalogue, two of the test kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpcrl_benchmarker.config import BenchmarkerSection
from hpcrl_benchmarker.host import detect, has_avx512
from hpcrl_benchmarker.pipeline import Benchmarker
from hpcrl_benchmarker.steps import InternalError
from hpcrl_common.task import load_task

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "tests" / "benchmarker" / "kernels"
CONDITIONS = ("alone", "beside, normal", "beside, idle")


def busy(priority: str, counter: str) -> None:
    """One busy service: bursts of matrix products on one thread, a short gap between; counts
    its bursts into ``counter`` (a file) until killed."""
    import torch

    from hpcrl_common.service import apply_cpu_priority

    apply_cpu_priority(priority)
    torch.set_num_threads(1)
    a = torch.randn(384, 384)
    done = 0
    while True:
        for _ in range(20):
            a @ a
        done += 1
        if done % 10 == 0:
            Path(counter).write_text(str(done))
        time.sleep(0.002)


def catalogue_kernels(path: Path | None) -> list[tuple[str, int, str]]:
    """(name, stage, source): the fastest correct kernel with OpenMP and without."""
    if path is None:
        found = sorted((ROOT / "data" / "policy").glob("catalogue-*.json"), key=os.path.getmtime)
        path = found[-1] if found else None
    if path is None:
        omp = "avx512_omp.c" if has_avx512() else "ikj_omp.c"
        return [
            (f"tests' {omp}", 4, (KERNELS / omp).read_text()),
            ("tests' naive.c", 1, (KERNELS / "naive.c").read_text()),
        ]
    verdicts = json.loads(path.read_text())["verdicts"]
    best: dict[bool, tuple[float, int, str]] = {}
    for key, verdict in verdicts.items():
        if verdict.get("status") != "success":
            continue
        stage, source = key.split(":", 1)
        threaded = "openmp" in verdict.get("techniques", []) or "#pragma omp" in source
        gflops = float(verdict.get("gflops") or 0.0)
        if threaded not in best or gflops > best[threaded][0]:
            best[threaded] = (gflops, int(stage), source)
    return [
        (
            f"{'OpenMP' if threaded else 'one thread'}, stage {stage} ({gflops:.1f} at build)",
            stage,
            source,
        )
        for threaded, (gflops, stage, source) in sorted(best.items(), reverse=True)
    ]


def start_busy(priority: str, work: Path) -> tuple[list[subprocess.Popen], list[Path]]:
    counters = [work / f"busy-{priority}-{n}" for n in range(2)]
    procs = [
        subprocess.Popen([sys.executable, __file__, "--busy", priority, str(c)]) for c in counters
    ]
    time.sleep(3)  # past torch's import
    return procs, counters


def bursts(counters: list[Path]) -> int:
    return sum(int(c.read_text() or 0) if c.exists() else 0 for c in counters)


def judge(bench: Benchmarker, stage: int, source: str) -> float | None:
    try:
        verdict = bench.evaluate(
            f"```c\n{source}\n```", stage=stage, opt_level="O3", task=load_task("matmul")
        )
    except InternalError:
        return None
    return verdict.gflops if verdict.status == "success" else None


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--busy":
        busy(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the three conditions")
    parser.add_argument(
        "--catalogue",
        type=Path,
        default=None,
        help="catalogue JSON to take the kernels from (default: the newest)",
    )
    args = parser.parse_args()
    kernels = catalogue_kernels(args.catalogue)
    work = Path(tempfile.mkdtemp(prefix="hpcrl-timing-priority-"))
    bench = Benchmarker(
        BenchmarkerSection(work_dir=work / "bench", lock_path=work / "lock", pin_threads=False),
        detect(),
    )
    results = {(name, c): [] for name, _, _ in kernels for c in CONDITIONS}
    rates: dict[str, list[float]] = {c: [] for c in CONDITIONS[1:]}
    for round_ in range(args.rounds):
        for condition in CONDITIONS:
            procs, counters = [], []
            if condition != "alone":
                procs, counters = start_busy(condition.split(", ")[1], work)
            try:
                began, before = time.monotonic(), bursts(counters)
                for name, stage, source in kernels:
                    gflops = judge(bench, stage, source)
                    if gflops is not None:
                        results[(name, condition)].append(gflops)
                    shown = "failed" if gflops is None else f"{gflops:.2f}"
                    print(f"round {round_ + 1} {condition:15s} {name}: {shown}", flush=True)
                if procs:
                    rates[condition].append(
                        (bursts(counters) - before) / (time.monotonic() - began)
                    )
            finally:
                for proc in procs:
                    proc.kill()
                    proc.wait()
    host = detect()
    print(
        f"\n{host.cpu_model} ({'AVX-512' if has_avx512() else 'AVX2'}), {os.cpu_count()} CPUs, "
        f"{args.rounds} rounds; median GFLOPS (÷ alone)"
    )
    for name, _, _ in kernels:
        alone = results[(name, "alone")]
        base = statistics.median(alone) if alone else float("nan")
        cells = []
        for condition in CONDITIONS:
            got = results[(name, condition)]
            med = statistics.median(got) if got else float("nan")
            cells.append(f"{condition} {med:.2f} ({med / base:.2f})")
        print(f"  {name}: " + "; ".join(cells))
    for condition, rate in rates.items():
        if rate:
            print(f"  busy processes' work {condition}: {statistics.median(rate):.1f} bursts/s")


if __name__ == "__main__":
    main()
