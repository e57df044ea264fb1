"""Wall time per candidate through the service path vs the bare floor, in the same run.

Service path: a Candidate through the service's handler (extract, checks, sandboxed compile
with symbol checks, sandboxed verify at every size, locked timing, OpenBLAS reference,
BenchResult). Floor: the same gcc compile + link and one direct harness run of the same jobs,
no sandbox, no checks, no reference. Prints the ratio (median service / median floor) last.

    .venv/bin/python bench/benchmarker_overhead.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from hpcrl_benchmarker import gemm
from hpcrl_benchmarker.host import detect
from hpcrl_benchmarker.pipeline import Benchmarker, Settings
from hpcrl_benchmarker.service import BenchHandler, BenchmarkerSection
from hpcrl_common.messages import BenchSpec, Candidate
from hpcrl_common.task import load_task

KERNELS = Path(__file__).resolve().parent.parent / "tests" / "benchmarker" / "kernels"


def floor(code: str, bench: Benchmarker, work: Path) -> float:
    task = load_task("matmul")
    flags = task.compile_flags("O3")
    harness = bench.harness_object(task)
    started = time.perf_counter()
    (work / "kernel.c").write_text(code)
    subprocess.run(["gcc", *flags, "-c", "kernel.c", "-o", "kernel.o"], cwd=work, check=True)
    subprocess.run(["gcc", *flags, "kernel.o", str(harness), "-o", "run", "-lm"], cwd=work,
                   check=True)
    sizes = [task.sizes.reward, *task.sizes.verify]
    jobs = [gemm.Job("v", s, secrets.randbits(63)) for s in sizes]
    jobs += [gemm.Job("w", task.sizes.reward, secrets.randbits(63))]
    jobs += [gemm.Job("t", task.sizes.reward, secrets.randbits(63)) for _ in range(3)]
    jobs += [gemm.Job("v", task.sizes.reward, secrets.randbits(63))]
    nonce = secrets.randbits(64)
    with open(work / "out.bin", "wb") as out:
        subprocess.run([str(work / "run"), str(out.fileno())], input=gemm.request(nonce, jobs),
                       check=True, pass_fds=(out.fileno(),), capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hpcrl-overhead-"))
    bench = Benchmarker(Settings(work_dir=root / "work", lock_path=root / "lock"), detect())
    handler = BenchHandler(bench, BenchmarkerSection(), "bench-results", "overhead")
    ratios = []
    for name in ("naive.c", "ikj_omp.c", "avx2_prefetch.c"):
        code = (KERNELS / name).read_text()
        service_s, floor_s = [], []
        for i in range(args.repeats):
            cand = Candidate(id=f"o/{i}", group_id="o", index=i, completion=code,
                             bench=BenchSpec(task="matmul", stage=6))
            started = time.perf_counter()
            [out] = handler(cand, None)  # type: ignore[arg-type]
            service_s.append(time.perf_counter() - started)
            assert out.message.status == "success", out.message.error
            work = root / f"floor-{name}-{i}"
            work.mkdir()
            floor_s.append(floor(code, bench, work))
        s, f = statistics.median(service_s), statistics.median(floor_s)
        ratios.append(s / f)
        print(f"{name:18s} service {s * 1e3:8.1f} ms  floor {f * 1e3:8.1f} ms  "
              f"ratio {s / f:.3f}")
    print(f"overhead ratio (median over kernels): {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
