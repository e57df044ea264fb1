"""Verdicts of a correct kernel while vLLM samples beside the benchmarker (the demo's node).

A vLLM engine (the CPU build, the bootstrapped policy, the demo's generator settings) samples
without pause in a child process while this script judges the same correct kernel again and
again through the full pipeline. Alternate evaluations charge the sandbox's start to the
kernel's and the compile's time limits (as the benchmarker did before) or start those limits
at the harness's first mark and the compile script's first output (as it does now). Prints
the verdicts of each, and the sandbox start times (to the first mark) over the whole run.
Every verdict but `success` is a false one: the kernel is correct and takes ~0.2 s alone.
"handed back" is no verdict: the benchmarker gave the candidate back (a sandbox starved of
CPU, or one that never started). For each run that timed out it prints what its threads had
of the CPUs (time on one, and run-queue wait), which tells a node that kept them waiting
from one that stalled them unseen.

    .venv/bin/python bench/busy_node_verdicts.py [--seconds 100] [--kernel naive.c]
                                                 [--policy data/policy/bootstrap-...]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpcrl_benchmarker import build, runner, sandbox
from hpcrl_benchmarker.config import BenchmarkerSection
from hpcrl_benchmarker.host import detect
from hpcrl_benchmarker.pipeline import Benchmarker
from hpcrl_benchmarker.steps import InternalError
from hpcrl_common.messages import SamplingParams
from hpcrl_common.task import load_task

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "tests" / "benchmarker" / "kernels"
VARIANTS = {"start charged (before)": None, "from the first mark (now)": runner.START_LIMIT_S}


def sample_forever(policy: str, ready: str) -> None:
    """The load: the demo's vLLM settings, one group of 8 samples after another."""
    from hpcrl_generator.backends.vllm import VLLMSampler

    sampler = VLLMSampler(
        policy, dtype="float32", max_model_len=2048, max_num_seqs=8, kv_cache_space_gib=1
    )
    prompt = sampler.tokenizer.encode("Write a fast C matrix multiplication kernel.")
    Path(ready).touch()
    seed = 0
    while True:
        sampler.generate(prompt, 8, SamplingParams(temperature=0.8, max_tokens=512, seed=seed))
        seed += 1


def newest_policy() -> Path:
    found = sorted((ROOT / "data" / "policy").glob("bootstrap-*"), key=os.path.getmtime)
    if not found:
        raise SystemExit(
            "no bootstrapped policy under data/policy: run `make demo` once, or give --policy"
        )
    return found[-1]


def start_load(policy: Path, work: Path) -> subprocess.Popen:
    ready = work / "ready"
    load = subprocess.Popen(
        [sys.executable, __file__, "--sample", str(policy), str(ready)],
        stdout=subprocess.DEVNULL,
        stderr=(work / "vllm.log").open("wb"),
    )
    deadline = time.monotonic() + 300
    while not ready.exists():
        if load.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the vLLM load did not start: see {work / 'vllm.log'}")
        time.sleep(0.5)
    time.sleep(3)  # past the first batch
    return load


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--sample":
        sample_forever(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=100.0, help="how long to judge")
    parser.add_argument(
        "--kernel", default="naive.c", help="a correct kernel in tests/benchmarker/kernels"
    )
    parser.add_argument(
        "--policy",
        type=Path,
        default=None,
        help="the model vLLM samples from (default: the newest bootstrap)",
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hpcrl-busy-node-"))
    code = (KERNELS / args.kernel).read_text()
    bench = Benchmarker(
        BenchmarkerSection(work_dir=work / "bench", lock_path=work / "lock", pin_threads=False),
        detect(),
    )
    task = load_task("matmul")
    starts: list[float] = []
    timeouts: list[tuple[float, sandbox.Schedule]] = []  # (wall past the start, schedule)
    original_run = sandbox.Pending.run

    def run(*a: object, **k: object) -> sandbox.Outcome:
        outcome = original_run(*a, **k)  # type: ignore[arg-type]
        if outcome.start_s is not None:
            starts.append(outcome.start_s)
        if outcome.schedule is not None:
            timeouts.append((outcome.wall_s - (outcome.start_s or 0.0), outcome.schedule))
        return outcome

    sandbox.Pending.run = run  # type: ignore[method-assign]
    load = start_load(args.policy or newest_policy(), work)
    verdicts: dict[str, collections.Counter] = {name: collections.Counter() for name in VARIANTS}
    try:
        began, i = time.monotonic(), 0
        while time.monotonic() - began < args.seconds:
            name = list(VARIANTS)[i % 2]
            runner.START_LIMIT_S = build.START_LIMIT_S = VARIANTS[name]
            try:
                status = bench.evaluate(
                    f"```c\n{code}\n```", stage=1, opt_level="O3", task=task
                ).status
            except InternalError:
                status = "handed back"
            verdicts[name][status] += 1
            print(f"{time.monotonic() - began:6.1f} s  {name:28s} {status}", flush=True)
            while timeouts:
                wall, got = timeouts.pop(0)
                print(
                    f"         a sandbox timed out: {wall:.1f} s, its {got.threads} threads "
                    f"on a CPU {got.cpu_s:.2f} s, waiting for one {got.waiting_s:.2f} s",
                    flush=True,
                )
            i += 1
    finally:
        load.kill()
        load.wait()
    for name, counts in verdicts.items():
        # Handed back is no verdict: the candidate goes back to the queue (starved of CPU,
        # or a sandbox that never started).
        false = sum(n for status, n in counts.items() if status not in ("success", "handed back"))
        print(
            f"{name:28s} {sum(counts.values())} evaluated, {false} false verdicts: {dict(counts)}"
        )
    if starts:
        starts.sort()
        print(
            f"sandbox starts (to the first mark or output): {len(starts)}, median "
            f"{statistics.median(starts) * 1e3:.0f} ms, max {starts[-1]:.2f} s, "
            f"{sum(s > 1 for s in starts)} over 1 s"
        )


if __name__ == "__main__":
    main()
