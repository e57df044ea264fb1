"""Wall time per candidate through the service path vs the bare floor, in the same run.

Service path: a Candidate through the service's handler (extract, checks, sandboxed compile
with the preprocessed-source and symbol checks, one sandboxed harness run under the timing
lock (verification at every size, warm-up, timed runs, final verification), the OpenBLAS
references, BenchResult). Floor: the same gcc compile and link commands with the same flags,
and one direct harness run of the same jobs with the same OpenMP environment; no sandbox, no
checks, no reference. The two alternate (which goes first flips every repeat) so that load
from other processes falls on both alike. Prints the ratio (median service / median floor)
last. ``--breakdown`` also times each step alone, sandboxed and bare (the run's sandbox set
up beforehand, as the service does during the compile), and a sandbox start.

    .venv/bin/python bench/benchmarker_overhead.py [--repeats 5] [--timing-attempts 1]
                                                   [--breakdown] [--task matmul|gemv|stencil|spmv]
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hpcrl_benchmarker import harnesses, protocol, sandbox
from hpcrl_benchmarker.config import BenchmarkerSection
from hpcrl_benchmarker.host import detect
from hpcrl_benchmarker.pipeline import Benchmarker, Events
from hpcrl_benchmarker.service import BenchHandler
from hpcrl_common.messages import BenchSpec, Candidate
from hpcrl_common.task import TaskSpec, load_task

KERNELS = Path(__file__).resolve().parent.parent / "tests" / "benchmarker" / "kernels"
# The kernels timed per task: a plain loop, an OpenMP one, a third of each task's own.
TASK_KERNELS = {
    "matmul": ("naive.c", "ikj_omp.c", "avx2_prefetch.c"),
    "gemv": ("gemv/naive.c", "gemv/omp.c", "gemv/slow.c"),
    "stencil": ("stencil/naive.c", "stencil/omp.c", "stencil/slow.c"),
    "spmv": ("spmv/naive.c", "spmv/omp.c", "spmv/slow.c"),
}


def floor_compile(code: str, bench: Benchmarker, work: Path, task: TaskSpec) -> None:
    flags = task.compile_flags("O3")
    (work / "kernel.c").write_text(code)
    cc = task.compile.compiler
    subprocess.run([cc, *flags, "-c", "kernel.c", "-o", "kernel.o"], cwd=work, check=True)
    subprocess.run(
        [cc, *flags, "kernel.o", str(bench.harness_object(task)), "-o", "run", "-lm"],
        cwd=work,
        check=True,
    )


def run_jobs(task: TaskSpec) -> list[protocol.Job]:
    """The jobs of one service run: verification at every size, then one timing attempt."""
    harness = harnesses.for_task(task)
    sizes = [task.sizes.reward, *task.sizes.verify]
    jobs = [harness.job("v", s, secrets.randbits(63)) for s in sizes]
    jobs += [
        harness.job("w", task.sizes.reward, secrets.randbits(63))
        for _ in range(task.timing.warmup_runs)
    ]
    jobs += [
        harness.job("t", task.sizes.reward, secrets.randbits(63))
        for _ in range(task.timing.timed_runs)
    ]
    jobs += [harness.job("v", task.sizes.reward, secrets.randbits(63))]
    return jobs


def floor_run(bench: Benchmarker, work: Path, task: TaskSpec) -> None:
    nonce = secrets.randbits(64)
    env = {**os.environ, **bench.harness_env()}
    with open(work / "out.bin", "wb") as out:
        subprocess.run(
            [str(work / "run"), str(out.fileno())],
            input=protocol.request(nonce, run_jobs(task)),
            check=True,
            pass_fds=(out.fileno(),),
            capture_output=True,
            env=env,
        )


def floor(code: str, bench: Benchmarker, work: Path, task: TaskSpec) -> float:
    started = time.perf_counter()
    floor_compile(code, bench, work, task)
    floor_run(bench, work, task)
    return time.perf_counter() - started


def breakdown(
    code: str, bench: Benchmarker, root: Path, repeats: int, task: TaskSpec
) -> dict[str, float]:
    """Median ms of each step alone, sandboxed (the service's own call) and bare, and of a
    sandbox start (``/bin/true``) against a plain process start."""
    flags = task.compile_flags("O3")
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "compile bare",
            "compile sandboxed",
            "run bare",
            "run sandboxed",
            "start bare",
            "start sandboxed",
        )
    }

    def timed(name: str, fn: Callable[..., object], *args: object, **kwargs: object) -> None:
        started = time.perf_counter()
        fn(*args, **kwargs)
        times[name].append(time.perf_counter() - started)

    root.mkdir()
    empty = sandbox.Spec(root, sandbox.Limits(wall_s=10, cpu_s=10, address_space_mb=4096))
    for i in range(repeats):
        bare, boxed = root / f"bare-{i}", root / f"boxed-{i}"
        bare.mkdir()
        boxed.mkdir()
        timed("compile bare", floor_compile, code, bench, bare, task)
        timed("compile sandboxed", bench.compile, boxed, code, task, flags, Events())
        timed("run bare", floor_run, bench, bare, task)
        jobs = run_jobs(task)
        # As in the service: the sandbox is set up beforehand (during the compile there).
        harness = bench.start_run(boxed, task, two_phases=True)
        time.sleep(0.05)
        with harness, bench.exclusive_timing():
            timed(
                "run sandboxed",
                bench.run,
                boxed,
                task,
                jobs,
                Events(),
                verify_runs=len(task.sizes.verify) + 1,
                harness=harness,
            )
        timed("start bare", subprocess.run, ["/bin/true"], check=True)
        timed("start sandboxed", sandbox.run, ["/bin/true"], empty)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--timing-attempts",
        type=int,
        default=BenchmarkerSection().timing_attempts,
        help="the service's timing attempts per candidate (default: the "
        "service's; 1 leaves out re-timing noisy measurements, which the floor "
        "never does, to see the pipeline's own cost)",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time each step alone, sandboxed and bare, and a sandbox "
        "start: where the difference comes from",
    )
    parser.add_argument(
        "--task",
        default="matmul",
        choices=sorted(TASK_KERNELS),
        help="the task whose harness is measured (default matmul)",
    )
    args = parser.parse_args()
    task = load_task(args.task)
    root = Path(tempfile.mkdtemp(prefix="hpcrl-overhead-"))
    settings = BenchmarkerSection(
        work_dir=root / "work", lock_path=root / "lock", timing_attempts=args.timing_attempts
    )
    bench = Benchmarker(settings, detect())
    handler = BenchHandler(bench, BenchmarkerSection(), "bench-results", "overhead")
    ratios = []
    for k, name in enumerate(TASK_KERNELS[args.task]):
        code = (KERNELS / name).read_text()
        service_s, floor_s = [], []
        for i in range(args.repeats + 1):  # the first round warms caches and is dropped
            work = root / f"floor-{name.replace('/', '-')}-{i}"
            work.mkdir()
            if i % 2:
                floor_time = floor(code, bench, work, task)
            cand = Candidate(
                id=f"o{k}/{i}",
                group_id=f"o{k}",
                index=i,
                completion=code,
                bench=BenchSpec(task=task.name, stage=6),
            )
            started = time.perf_counter()
            [out] = handler(cand, None)  # type: ignore[arg-type]
            service_time = time.perf_counter() - started
            assert out.message.status == "success", out.message.error
            if not i % 2:
                floor_time = floor(code, bench, work, task)
            if i:
                service_s.append(service_time)
                floor_s.append(floor_time)
        s, f = statistics.median(service_s), statistics.median(floor_s)
        ratios.append(s / f)
        print(f"{name:18s} service {s * 1e3:8.1f} ms  floor {f * 1e3:8.1f} ms  ratio {s / f:.3f}")
        if args.breakdown:
            parts = breakdown(
                code, bench, root / f"breakdown-{name.replace('/', '-')}", args.repeats, task
            )
            print("    " + "  ".join(f"{part} {ms:.1f} ms" for part, ms in parts.items()))
    print(f"overhead ratio (median over kernels): {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
