"""Ten measurements (each the task's warm-up + 3 timed runs, mean -> GFLOPS) of one kernel
through the full pipeline; prints the coefficient of variation of the ten GFLOPS last.

    .venv/bin/python bench/timing_noise.py [--kernel avx2_prefetch.c] [--measurements 10]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from hpcrl_benchmarker.host import detect
from hpcrl_benchmarker.pipeline import Benchmarker, Settings
from hpcrl_common.task import load_task

KERNELS = Path(__file__).resolve().parent.parent / "tests" / "benchmarker" / "kernels"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="avx2_prefetch.c")
    parser.add_argument("--measurements", type=int, default=10)
    parser.add_argument("--opt-level", default="O3")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hpcrl-noise-"))
    bench = Benchmarker(Settings(work_dir=root / "work", lock_path=root / "lock"), detect())
    task = load_task("matmul")
    code = (KERNELS / args.kernel).read_text()
    values, inner = [], []
    for _ in range(args.measurements):
        verdict = bench.evaluate(code, stage=6, opt_level=args.opt_level, task=task)
        assert verdict.gflops is not None and verdict.timing is not None, verdict.error
        values.append(verdict.gflops)
        inner.append(verdict.timing.cv)
        print(f"{verdict.gflops:9.3f} GFLOPS  (cv of its 3 runs {verdict.timing.cv:.2%})")
    cv = statistics.pstdev(values) / statistics.fmean(values)
    print(f"kernel {args.kernel}, host {bench.host.host_class}, "
          f"median within-measurement cv {statistics.median(inner):.2%}")
    print(f"cv over {len(values)} measurements: {cv:.2%}")


if __name__ == "__main__":
    main()
