"""Ten measurements (each the task's warm-up + timed runs, mean -> GFLOPS, exactly the reward)
of one kernel through the full pipeline; prints the coefficient of variation of the ten GFLOPS
last.

What keeps the noise down (all in the pipeline, none of it special to this script): timing
under the node's exclusive lock; references computed before the run, on one OpenBLAS thread,
so no parent work or spinning BLAS thread shares the cores with a timed run; OpenMP threads
bound one per CPU (OMP_PROC_BIND=close with explicit OMP_PLACES); inputs generated and every
buffer touched by the harness outside the timed region; a warm-up run; a result pipe large
enough that the harness never waits for the parent. `--no-pin` turns the binding off for an
A/B comparison. The load average is printed because other processes on the node dominate
the figure when there are any.

    .venv/bin/python bench/timing_noise.py [--kernel avx2_prefetch.c] [--measurements 10]
                                           [--no-pin] [--timed-runs N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from hpcrl_benchmarker.config import BenchmarkerSection
from hpcrl_benchmarker.host import detect
from hpcrl_benchmarker.pipeline import Benchmarker
from hpcrl_common.task import load_task

KERNELS = Path(__file__).resolve().parent.parent / "tests" / "benchmarker" / "kernels"


def kernel_path(name: str) -> Path:
    for candidate in (Path(name), KERNELS / name, KERNELS / f"{name}.c"):
        if candidate.is_file():
            return candidate
    raise SystemExit(f"no kernel {name!r}: give a C file or one of "
                     f"{', '.join(sorted(p.stem for p in KERNELS.glob('*.c')))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="avx2_prefetch.c",
                        help="a C file, or the name of one in tests/benchmarker/kernels "
                             "(.c optional; default %(default)s)")
    parser.add_argument("--measurements", type=int, default=10)
    parser.add_argument("--opt-level", default="O3")
    parser.add_argument("--no-pin", action="store_true", help="do not bind OpenMP threads")
    parser.add_argument("--timed-runs", type=int, default=None,
                        help="override the task's timed runs per measurement (paper: 3)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hpcrl-noise-"))
    settings = BenchmarkerSection(work_dir=root / "work", lock_path=root / "lock",
                                  pin_threads=not args.no_pin)
    bench = Benchmarker(settings, detect())
    task = load_task("matmul")
    if args.timed_runs is not None:
        timing = task.timing.model_copy(update={"timed_runs": args.timed_runs})
        task = task.model_copy(update={"timing": timing})
    code = kernel_path(args.kernel).read_text()
    load_before = os.getloadavg()[0]
    values, inner, best = [], [], []
    for _ in range(args.measurements):
        verdict = bench.evaluate(code, stage=6, opt_level=args.opt_level, task=task)
        assert verdict.gflops is not None and verdict.timing is not None, verdict.error
        values.append(verdict.gflops)
        inner.append(verdict.timing.cv)
        best.append(task.flop_count(task.sizes.reward) / verdict.timing.min_s / 1e9)
        print(f"{verdict.gflops:9.3f} GFLOPS  (cv of its {len(verdict.timing.runs_s)} runs "
              f"{verdict.timing.cv:.2%})")
    cv = statistics.pstdev(values) / statistics.fmean(values)
    cv_best = statistics.pstdev(best) / statistics.fmean(best)
    print(f"kernel {args.kernel}, {task.timing.timed_runs} timed runs per measurement, host "
          f"{bench.host.host_class}, pinned {not args.no_pin}, "
          f"load average {load_before:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"median within-measurement cv {statistics.median(inner):.2%}; cv of the best run "
          f"of each measurement (not the reward) {cv_best:.2%}")
    print(f"cv over {len(values)} measurements: {cv:.2%}")


if __name__ == "__main__":
    main()
