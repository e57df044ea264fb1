"""Does the policy learn? The demo experiment with learning rate 0 versus the default, per seed.

Runs `deploy/local/demo.py` (the four real services over the real broker) once per
(learning rate, seed), each as its own experiment (own namespace, data dir and run dir),
then prints the best GFLOPS per iteration of every run, the learning gain (default LR minus
LR 0, final best GFLOPS, mean over seeds) with its spread, and the overall best kernel as a
fraction of OpenBLAS dgemm at 256³ timed in the same run. The last line is the gain.

    .venv/bin/python bench/learning.py                 # 3 seeds x 2 learning rates
    .venv/bin/python bench/learning.py --seeds 0 --iterations 2   # a quicker look
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from hpcrl_common.config import load_config
from hpcrl_learner.config import LearnerConfig

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "deploy/local/demo.py"
CONFIG = ROOT / "deploy/local/demo.toml"


def openblas_gflops(n: int = 256, runs: int = 3) -> float:
    """cblas_dgemm at n³, one warm-up then the mean of ``runs`` timed calls (all threads)."""
    path = ctypes.util.find_library("openblas") or "libopenblas.so.0"
    lib = ctypes.CDLL(path)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    c = np.zeros((n, n))
    p = ctypes.POINTER(ctypes.c_double)
    args = (101, 111, 111, n, n, n, ctypes.c_double(1.0), a.ctypes.data_as(p), n,
            b.ctypes.data_as(p), n, ctypes.c_double(0.0), c.ctypes.data_as(p), n)
    lib.cblas_dgemm(*args)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        lib.cblas_dgemm(*args)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.fmean(times) / 1e9


def run_experiment(name: str, seed: int, lr: float, iterations: int | None,
                   runs: Path) -> dict:
    env = {
        **os.environ,
        "HPCRL__EXPERIMENT__NAME": name,
        "HPCRL__EXPERIMENT__SEED": str(seed),
        "HPCRL__EXPERIMENT__DATA_DIR": str(ROOT / "data" / "bench-learning" / name),
        "HPCRL__BROKER__NAMESPACE": name,
        "HPCRL__LEARNER__LEARNING_RATE": repr(lr),
    }
    if iterations is not None:
        env["HPCRL__SCHEDULER__ITERATIONS"] = str(iterations)
    print(f"--- {name}: seed {seed}, learning rate {lr:g}", flush=True)
    done = subprocess.run([sys.executable, str(DEMO), "--fresh", "--runs", str(runs)], env=env,
                          cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed (exit {done.returncode})")
    return json.loads((runs / name / "metrics.json").read_text())


def best_per_iteration(metrics: dict) -> list[float]:
    """Best GFLOPS found so far after each iteration (0 while nothing succeeded)."""
    best, out = 0.0, []
    for it in metrics["scheduler"]["iterations"]:
        found = [s["best_gflops"] for s in it["pool"].values() if s["best_gflops"] is not None]
        best = max([best, *found])
        out.append(best)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=None,
                        help="override scheduler.iterations of the demo config")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench-learning")
    args = parser.parse_args()

    default_lr = load_config(LearnerConfig, CONFIG, env={}).learner.learning_rate
    results: dict[float, list[list[float]]] = {0.0: [], default_lr: []}
    for lr in results:
        for seed in args.seeds:
            name = f"learning-lr{lr:g}-s{seed}".replace(".", "p")
            metrics = run_experiment(name, seed, lr, args.iterations, args.runs)
            results[lr].append(best_per_iteration(metrics))
    blas = openblas_gflops()

    print("\nbest GFLOPS so far, per iteration")
    for lr, per_seed in results.items():
        for seed, curve in zip(args.seeds, per_seed, strict=True):
            print(f"  lr {lr:<8g} seed {seed}: " + "  ".join(f"{g:8.2f}" for g in curve))
    finals = {lr: [curve[-1] for curve in per_seed] for lr, per_seed in results.items()}
    gains = [t - b for t, b in zip(finals[default_lr], finals[0.0], strict=True)]
    overall = max(max(v) for v in finals.values())
    spread = statistics.stdev(gains) if len(gains) > 1 else 0.0
    print(f"\nfinal best GFLOPS, lr 0: mean {statistics.fmean(finals[0.0]):.2f}; "
          f"lr {default_lr:g}: mean {statistics.fmean(finals[default_lr]):.2f}")
    print(f"OpenBLAS dgemm 256^3 (same machine, same run): {blas:.2f} GFLOPS; best kernel "
          f"{overall:.2f} GFLOPS = {overall / blas:.1%} of it")
    print(f"learning gain (lr {default_lr:g} - lr 0, per seed): mean "
          f"{statistics.fmean(gains):+.2f} GFLOPS, std {spread:.2f} over {len(gains)} seeds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
