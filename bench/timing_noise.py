"""Measurements (each the task's warm-up + timed runs, mean -> GFLOPS, exactly the reward) of
the same kernels through the full pipeline; prints the coefficient of variation of the
GFLOPS, and with ``--load N`` the bias of the reward with N busy-looping processes beside the
benchmarker against an idle run in the same script.

What keeps the noise down (all in the pipeline, none of it special to this script): timing
under the timing lock; references computed before the run, on one OpenBLAS thread, so no
parent work or spinning BLAS thread shares the cores with a timed run; OpenMP threads bound
one per CPU (OMP_PROC_BIND=close with explicit OMP_PLACES); inputs generated and every buffer
touched by the harness outside the timed region; a warm-up run; a result pipe large enough
that the harness never waits for the parent; and re-timing: a measurement whose timed runs
disagree (cv above benchmarker.max_timing_cv) is timed again, the steadiest attempt kept.
`--no-pin` turns the binding off for an A/B comparison. The load average is printed because
other processes on the node dominate the figure when there are any.

With ``--load N`` every kernel is measured idle and loaded in alternation (the N busy loops are
started once and stopped with SIGSTOP for the idle measurements, so both see the same drift),
and each figure is given twice: the reward as reported (with re-timing) and the reward the
first timing attempt alone gives (without re-timing: what timing_attempts = 1 reports). Both
come from the same evaluations, so the comparison costs no extra runs.

    .venv/bin/python bench/timing_noise.py [--kernel avx2_prefetch.c ...] [--measurements 10]
                                           [--load N] [--no-pin] [--timed-runs N]
                                           [--max-timing-cv 0.05] [--timing-attempts 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from hpcrl_benchmarker.config import BenchmarkerSection
from hpcrl_benchmarker.host import detect
from hpcrl_benchmarker.pipeline import Benchmarker, Events
from hpcrl_common.task import TaskSpec, load_task

KERNELS = Path(__file__).resolve().parent.parent / "tests" / "benchmarker" / "kernels"


def kernel_path(name: str) -> Path:
    for candidate in (Path(name), KERNELS / name, KERNELS / f"{name}.c"):
        if candidate.is_file():
            return candidate
    raise SystemExit(
        f"no kernel {name!r}: give a C file or one of "
        f"{', '.join(sorted(p.stem for p in KERNELS.glob('*.c')))}"
    )


def cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.fmean(values) if len(values) > 1 else 0.0


class Sample:
    """What the measurements of one kernel under one condition gave."""

    def __init__(self) -> None:
        self.reward: list[float] = []  # with re-timing (the reported reward)
        self.first: list[float] = []  # the first attempt alone (without re-timing)
        self.inner: list[float] = []  # the kept attempt's cv
        self.inner_first: list[float] = []
        self.attempts: list[int] = []
        self.noisy = 0

    def add(self, gflops: float, flops: float, events: Events) -> None:
        first = events.timings[0]
        self.reward.append(gflops)
        self.first.append(flops / first.mean_s / 1e9)
        self.inner.append(min(t.cv for t in events.timings))  # the kept attempt's
        self.inner_first.append(first.cv)
        self.attempts.append(len(events.timings))


def measure(bench: Benchmarker, code: str, task: TaskSpec, opt_level: str, sample: Sample) -> None:
    events = Events()
    verdict = bench.evaluate(code, stage=6, opt_level=opt_level, task=task, events=events)
    assert verdict.gflops is not None and verdict.timing is not None, verdict.error
    sample.add(verdict.gflops, task.flop_count(task.sizes.reward), events)
    sample.noisy += verdict.timing.noisy


def busy_loops(count: int) -> list[subprocess.Popen]:
    # Each in a session of its own, like another job's process: where the kernel schedules
    # by session first (autogroup), loops in this one would count as one process together.
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(count)
    ]


def signal_all(procs: list[subprocess.Popen], sig: signal.Signals) -> None:
    for proc in procs:
        os.kill(proc.pid, sig)


def describe(label: str, sample: Sample) -> str:
    return (
        f"{label:7s} reward {statistics.median(sample.reward):8.3f} GFLOPS (cv over "
        f"{len(sample.reward)} measurements {cv(sample.reward):6.2%}, median cv of its runs "
        f"{statistics.median(sample.inner):6.2%}, attempts mean "
        f"{statistics.fmean(sample.attempts):.2f}, noisy {sample.noisy})   first attempt "
        f"only {statistics.median(sample.first):8.3f} GFLOPS (cv {cv(sample.first):6.2%}, "
        f"median cv of its runs {statistics.median(sample.inner_first):6.2%})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kernel",
        action="append",
        default=None,
        help="a C file, or the name of one in tests/benchmarker/kernels "
        "(.c optional; repeatable; default avx2_prefetch.c)",
    )
    parser.add_argument(
        "--measurements", type=int, default=10, help="per kernel (and per condition with --load)"
    )
    parser.add_argument("--opt-level", default="O3")
    parser.add_argument(
        "--load",
        type=int,
        default=0,
        metavar="N",
        help="also measure with N busy-looping processes beside the benchmarker",
    )
    parser.add_argument("--no-pin", action="store_true", help="do not bind OpenMP threads")
    parser.add_argument(
        "--timed-runs",
        type=int,
        default=None,
        help="override the task's timed runs per measurement (paper: 3)",
    )
    defaults = BenchmarkerSection()
    parser.add_argument("--max-timing-cv", type=float, default=defaults.max_timing_cv)
    parser.add_argument("--timing-attempts", type=int, default=defaults.timing_attempts)
    parser.add_argument("--threads", type=int, default=0, help="benchmarker.threads")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hpcrl-noise-"))
    settings = BenchmarkerSection(
        work_dir=root / "work",
        lock_path=root / "lock",
        pin_threads=not args.no_pin,
        threads=args.threads,
        max_timing_cv=args.max_timing_cv,
        timing_attempts=args.timing_attempts,
    )
    bench = Benchmarker(settings, detect())
    task = load_task("matmul")
    if args.timed_runs is not None:
        timing = task.timing.model_copy(update={"timed_runs": args.timed_runs})
        task = task.model_copy(update={"timing": timing})
    kernels = args.kernel or ["avx2_prefetch.c"]
    codes = {name: kernel_path(name).read_text() for name in kernels}
    samples: dict[tuple[str, str], Sample] = defaultdict(Sample)
    load_before = os.getloadavg()[0]
    loops = busy_loops(args.load)
    try:
        signal_all(loops, signal.SIGSTOP)
        for i in range(args.measurements):
            for name, code in codes.items():
                # Idle and loaded alternate (which goes first flips), so drift hits both.
                order = ["idle", "loaded"] if args.load else ["idle"]
                for condition in order if i % 2 == 0 else order[::-1]:
                    signal_all(loops, signal.SIGCONT if condition == "loaded" else signal.SIGSTOP)
                    measure(bench, code, task, args.opt_level, samples[name, condition])
                signal_all(loops, signal.SIGSTOP)
    finally:
        for proc in loops:
            proc.kill()
            proc.wait()
    print(
        f"{task.timing.timed_runs} timed runs per attempt, up to {args.timing_attempts} "
        f"attempts (max_timing_cv {args.max_timing_cv:g}), host {bench.host.host_class}, "
        f"pinned {not args.no_pin}, threads {args.threads or 'all'}, load average "
        f"{load_before:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    for name in codes:
        idle = samples[name, "idle"]
        print(f"kernel {name}")
        print("  " + describe("idle", idle))
        if args.load:
            loaded = samples[name, "loaded"]
            print("  " + describe(f"{args.load} busy", loaded))
            bias = statistics.median(loaded.reward) / statistics.median(idle.reward) - 1
            bias_first = statistics.median(loaded.first) / statistics.median(idle.first) - 1
            print(
                f"  bias of the reward under load {bias:+.1%} with re-timing, "
                f"{bias_first:+.1%} without (first attempt only)"
            )
    if len(codes) == 1 and not args.load:
        print(
            f"cv over {args.measurements} measurements: "
            f"{cv(samples[kernels[0], 'idle'].reward):.2%}"
        )


if __name__ == "__main__":
    main()
