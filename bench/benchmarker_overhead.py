"""Wall time per candidate through the service path vs the bare floor, in the same run.

Service path: a Candidate through the service's handler (extract, checks, sandboxed compile
with the preprocessed-source and symbol checks, one sandboxed harness run under the timing
lock (verification at every size, warm-up, timed runs, final verification), the OpenBLAS
references, BenchResult). Floor: the same gcc compile and link commands with the same flags,
and one direct harness run of the same jobs with the same OpenMP environment; no sandbox, no
checks, no reference. The two alternate (which goes first flips every repeat) so that load
from other processes falls on both alike. Prints the ratio (median service / median floor)
last.

    .venv/bin/python bench/benchmarker_overhead.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from hpcrl_benchmarker import gemm
from hpcrl_benchmarker.config import BenchmarkerSection
from hpcrl_benchmarker.host import detect
from hpcrl_benchmarker.pipeline import Benchmarker
from hpcrl_benchmarker.service import BenchHandler
from hpcrl_common.messages import BenchSpec, Candidate
from hpcrl_common.task import load_task

KERNELS = Path(__file__).resolve().parent.parent / "tests" / "benchmarker" / "kernels"


def floor(code: str, bench: Benchmarker, work: Path) -> float:
    task = load_task("matmul")
    flags = task.compile_flags("O3")
    harness = bench.harness_object(task)
    started = time.perf_counter()
    (work / "kernel.c").write_text(code)
    cc = task.compile.compiler
    subprocess.run([cc, *flags, "-c", "kernel.c", "-o", "kernel.o"], cwd=work, check=True)
    subprocess.run([cc, *flags, "kernel.o", str(harness), "-o", "run", "-lm"], cwd=work,
                   check=True)
    sizes = [task.sizes.reward, *task.sizes.verify]
    jobs = [gemm.Job("v", s, secrets.randbits(63)) for s in sizes]
    jobs += [gemm.Job("w", task.sizes.reward, secrets.randbits(63))
             for _ in range(task.timing.warmup_runs)]
    jobs += [gemm.Job("t", task.sizes.reward, secrets.randbits(63))
             for _ in range(task.timing.timed_runs)]
    jobs += [gemm.Job("v", task.sizes.reward, secrets.randbits(63))]
    nonce = secrets.randbits(64)
    env = {**os.environ, **bench.harness_env()}
    with open(work / "out.bin", "wb") as out:
        subprocess.run([str(work / "run"), str(out.fileno())], input=gemm.request(nonce, jobs),
                       check=True, pass_fds=(out.fileno(),), capture_output=True, env=env)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timing-attempts", type=int,
                        default=BenchmarkerSection().timing_attempts,
                        help="the service's timing attempts per candidate (default: the "
                        "service's; 1 leaves out re-timing noisy measurements, which the floor "
                        "never does, to see the pipeline's own cost)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hpcrl-overhead-"))
    settings = BenchmarkerSection(work_dir=root / "work", lock_path=root / "lock",
                                  timing_attempts=args.timing_attempts)
    bench = Benchmarker(settings, detect())
    handler = BenchHandler(bench, BenchmarkerSection(), "bench-results", "overhead")
    ratios = []
    for k, name in enumerate(("naive.c", "ikj_omp.c", "avx2_prefetch.c")):
        code = (KERNELS / name).read_text()
        service_s, floor_s = [], []
        for i in range(args.repeats + 1):  # the first round warms caches and is dropped
            work = root / f"floor-{name}-{i}"
            work.mkdir()
            if i % 2:
                floor_time = floor(code, bench, work)
            cand = Candidate(id=f"o{k}/{i}", group_id=f"o{k}", index=i, completion=code,
                             bench=BenchSpec(task="matmul", stage=6))
            started = time.perf_counter()
            [out] = handler(cand, None)  # type: ignore[arg-type]
            service_time = time.perf_counter() - started
            assert out.message.status == "success", out.message.error
            if not i % 2:
                floor_time = floor(code, bench, work)
            if i:
                service_s.append(service_time)
                floor_s.append(floor_time)
        s, f = statistics.median(service_s), statistics.median(floor_s)
        ratios.append(s / f)
        print(f"{name:18s} service {s * 1e3:8.1f} ms  floor {f * 1e3:8.1f} ms  "
              f"ratio {s / f:.3f}")
    print(f"overhead ratio (median over kernels): {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
