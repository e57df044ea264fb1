"""How good is the bootstrap corpus, and what does a bootstrapped model write?

    .venv/bin/python bench/corpus_quality.py --kernels 120
    .venv/bin/python bench/corpus_quality.py --kernels 0 --model DIR --samples 20

Part 1 compiles corpus kernels with gcc (-O1 -march=native -fopenmp) and checks them against a
naive reference at 64^3, 37x45x29 and 5x3x7: the outcome mix by mistake kind is the spread of
rewards the corpus teaches. Part 2 (with --model) samples kernels from a bootstrap model for
fresh scheduler prompts and reports how many compile, are correct and respect their stage.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hpcrl_learner.bootstrap import corpus as cp
from hpcrl_learner.bootstrap.check import check_kernel, host_has_avx512


def corpus_part(count: int, seed: int) -> None:
    kernels = cp.generate_corpus(seed=seed, size=count, mistake_rate=0.3)
    if not host_has_avx512():
        kernels = [k for k in kernels if k.spec.simd != "avx512"]
        print("(no avx512f on this host: AVX-512 kernels left out)")
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        verdicts = list(pool.map(lambda k: check_kernel(k.source, time_limit_s=10.0), kernels))
    table: dict[str, Counter[str]] = defaultdict(Counter)
    for kernel, verdict in zip(kernels, verdicts, strict=True):
        table[kernel.mistake or "none (correct)"][verdict.status] += 1
    statuses = sorted({s for row in table.values() for s in row})
    print(f"\ncorpus: {len(kernels)} kernels (seed {seed}), checked in "
          f"{time.monotonic() - started:.0f} s")
    print(f"{'mistake':<18}" + "".join(f"{s:>15}" for s in statuses))
    for mistake in sorted(table):
        print(f"{mistake:<18}" + "".join(f"{table[mistake][s]:>15}" for s in statuses))


def model_part(model: Path, samples: int, temperature: float) -> None:
    from hpcrl_learner.bootstrap.evaluate import evaluate

    started = time.monotonic()
    report = evaluate(model, samples=samples, temperature=temperature)
    print(f"\nmodel {model}: {samples} samples at temperature {temperature:g} "
          f"({time.monotonic() - started:.0f} s)")
    for name, count, total in report.rows():
        print(f"  {name:<22}{count:>4}/{total}  {count / max(total, 1):.0%}")
    print("  statuses: " + ", ".join(f"{k} {v}" for k, v in sorted(report.statuses().items())))
    by_mode: dict[str, Counter[str]] = defaultdict(Counter)
    for sample in report.samples:
        by_mode[sample.example.mode][sample.verdict.status] += 1
    for mode, counts in sorted(by_mode.items()):
        print(f"  {mode:<8} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", type=int, default=120, help="corpus kernels to check")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=None, help="bootstrap model directory")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args()
    if args.kernels:
        corpus_part(args.kernels, args.seed)
    if args.model is not None:
        model_part(args.model, args.samples, args.temperature)
    return 0


if __name__ == "__main__":
    sys.exit(main())
