"""Decode speed of the generator's vLLM CPU engine with vLLM's own thread binding
(`generator.cpu_threads = 0`: a thread pinned to each core) against N unpinned threads, on an
idle node and beside a stand-in for the learner (one process busy on one core).

Each call is one iteration's worth of sampling as the demo asks for it: 8 prompts of the
fixed evaluation set (stages 1-4, hand-written parents) x 8 samples, temperature 0.8, up to
1,536 tokens, fixed seeds. Every configuration starts its own engine in its own process (the
engine reads its thread settings when it starts); configurations alternate, the order
reversed each round. Prints completion tokens/s per call, medians, and each setting's median
÷ the pinned baseline's, idle and loaded.

    .venv/bin/python bench/generator_threads.py [--model data/policy/bootstrap-<hash>]
        [--cpu-threads 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

GROUPS, GROUP_SIZE, MAX_TOKENS, TEMPERATURE = 8, 8, 1536, 0.8
SPIN = "while True: pass"


def demo_policy() -> Path | None:
    """The policy `make demo` uses on this host (its default build), if it is built."""
    from hpcrl_bootstrap.build import BootstrapSettings, default_dir, is_ready

    path = default_dir(Path("data"), BootstrapSettings())
    return path if is_ready(path) else None


def measure_child(model: Path, cpu_threads: int, calls: int) -> dict[str, list[float]]:
    """Start one engine; time ``calls`` calls idle, then as many beside a busy process."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from hpcrl_bootstrap.build import host_isa
    from hpcrl_common.messages import SamplingParams
    from hpcrl_common.task import load_task
    from hpcrl_evaluate.evalset import build_set
    from hpcrl_generator.backends.vllm import VLLMSampler
    from hpcrl_generator.prompt import render_prompt
    from hpcrl_generator.sampling import GroupJob

    sampler = VLLMSampler(
        model,
        dtype="float32",
        max_model_len=3072,
        max_num_seqs=GROUPS * GROUP_SIZE,
        kv_cache_space_gib=1,
        cpu_threads=cpu_threads,
    )
    prompts = build_set(load_task("matmul"), host_isa())[:GROUPS]
    jobs = [
        GroupJob(
            render_prompt(sampler.tokenizer, p.messages),
            GROUP_SIZE,
            SamplingParams(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=1000 + i),
        )
        for i, p in enumerate(prompts)
    ]
    sampler.generate_groups(jobs[:1])  # warm-up: first-call allocations
    rates: dict[str, list[float]] = {"idle": [], "loaded": []}
    for load in ("idle", "loaded"):
        spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if load == "loaded" else None
        try:
            for _ in range(calls):
                started = time.perf_counter()
                groups = sampler.generate_groups(jobs)
                elapsed = time.perf_counter() - started
                tokens = sum(len(s.token_ids) for g in groups for s in g)
                rates[load].append(tokens / elapsed)
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
    sampler.close()
    return rates


def run_child(model: Path, cpu_threads: int, calls: int) -> dict[str, list[float]]:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            "--model",
            str(model),
            "--calls",
            str(calls),
            "--cpu-threads",
            str(cpu_threads),
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="policy directory (default: the one `make demo` uses on this host)",
    )
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="unpinned threads to compare with vLLM's binding (default 1)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both settings")
    parser.add_argument("--calls", type=int, default=1, help="calls per load per engine")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = args.model or demo_policy()
    if model is None or not (model / "config.json").exists():
        parser.error("no policy: build one (hpcrl-bootstrap) or pass --model")
    if args.child:
        print(json.dumps(measure_child(model, args.cpu_threads, args.calls)))
        return

    settings = [0, args.cpu_threads]
    rates = {s: {"idle": [], "loaded": []} for s in settings}
    print(f"model {model}; {GROUPS} groups x {GROUP_SIZE}, up to {MAX_TOKENS} tokens a sample")
    for round_ in range(args.rounds):
        for setting in settings if round_ % 2 == 0 else settings[::-1]:
            got = run_child(model, setting, args.calls)
            for load, values in got.items():
                rates[setting][load].extend(values)
            shown = ", ".join(f"{load} {statistics.median(v):,.0f}" for load, v in got.items())
            print(f"round {round_ + 1}, cpu_threads {setting}: tokens/s {shown}", flush=True)
    for load in ("idle", "loaded"):
        base = statistics.median(rates[0][load])
        other = statistics.median(rates[args.cpu_threads][load])
        print(
            f"{load:6s}: pinned (cpu_threads 0) {base:,.0f} tokens/s, "
            f"cpu_threads {args.cpu_threads} {other:,.0f} tokens/s, ratio {other / base:.2f}"
        )


if __name__ == "__main__":
    main()
