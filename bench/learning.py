"""Does the policy learn? The demo experiment with learning rate 0 versus the default, per seed.

Runs `deploy/local/demo.py` (the four real services over the real broker) once per
(learning rate, seed), each as its own experiment (own namespace, data dir and run dir),
then prints, per iteration of every run, the best GFLOPS so far, the mean raw reward and the
share of programs that were correct; the overall best kernel as a fraction of OpenBLAS dgemm
at 256³ timed in the same run; and the learning gains (default LR minus LR 0, mean over seeds,
with their spread): in the share correct and the mean reward over the later half of the
iterations (less noisy: every sample counts), and in the final best GFLOPS (the last line).

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


def success_share_per_iteration(metrics: dict) -> list[float]:
    """Fraction of each iteration's (deduplicated) programs that were correct and timed."""
    out = []
    for it in metrics["scheduler"]["iterations"]:
        stages = it["pool"].values()
        total = sum(s["count"] for s in stages)
        ok = sum(s["count"] * s["status_share"].get("success", 0.0) for s in stages)
        out.append(ok / total if total else 0.0)
    return out


def reward_mean_per_iteration(metrics: dict) -> list[float]:
    return [it["reward_mean"] if it["reward_mean"] is not None else float("nan")
            for it in metrics["scheduler"]["iterations"]]


def _gain(label: str, unit: str, lr: float, treated: list[float], base: list[float]) -> str:
    gains = [t - b for t, b in zip(treated, base, strict=True)]
    spread = statistics.stdev(gains) if len(gains) > 1 else 0.0
    return (f"{label} (lr {lr:g} - lr 0, per seed): mean {statistics.fmean(gains):+.3g}{unit}, "
            f"std {spread:.3g} over {len(gains)} seeds")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=None,
                        help="override scheduler.iterations of the demo config")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="the learning rate compared with 0 (default: the demo's)")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench-learning")
    args = parser.parse_args()

    default_lr = load_config(LearnerConfig, CONFIG, env={}).learner.learning_rate
    lrs = (0.0, args.learning_rate or default_lr)
    runs: dict[float, list[dict]] = {lr: [] for lr in lrs}
    for lr in lrs:
        for seed in args.seeds:
            name = f"learning-lr{lr:g}-s{seed}".replace(".", "p")
            runs[lr].append(run_experiment(name, seed, lr, args.iterations, args.runs))
    blas = openblas_gflops()

    curves = {"best GFLOPS so far": best_per_iteration,
              "mean reward (what the learner got: penalties, GFLOPS normalised per group)":
                  reward_mean_per_iteration,
              "share of programs correct": success_share_per_iteration}
    for title, curve_of in curves.items():
        print(f"\n{title}, per iteration")
        for lr in lrs:
            for seed, metrics in zip(args.seeds, runs[lr], strict=True):
                print(f"  lr {lr:<8g} seed {seed}: "
                      + "  ".join(f"{v:8.2f}" for v in curve_of(metrics)))

    def last(curve_of, lr: float) -> list[float]:
        return [curve_of(m)[-1] for m in runs[lr]]

    def later_half(curve_of, lr: float) -> list[float]:
        out = []
        for metrics in runs[lr]:
            values = curve_of(metrics)
            tail = values[len(values) // 2:]
            out.append(statistics.fmean(tail))
        return out

    base, treated = lrs
    finals = {lr: last(best_per_iteration, lr) for lr in lrs}
    overall = max(max(v) for v in finals.values())
    print(f"\nfinal best GFLOPS, lr 0: mean {statistics.fmean(finals[base]):.2f}; "
          f"lr {treated:g}: mean {statistics.fmean(finals[treated]):.2f}")
    print(f"OpenBLAS dgemm 256^3 (same machine, same run): {blas:.2f} GFLOPS; best kernel "
          f"{overall:.2f} GFLOPS = {overall / blas:.1%} of it")
    print(_gain("gain in the share of programs correct, later half of the iterations", "",
                treated, later_half(success_share_per_iteration, treated),
                later_half(success_share_per_iteration, base)))
    print(_gain("gain in mean reward, later half of the iterations", "", treated,
                later_half(reward_mean_per_iteration, treated),
                later_half(reward_mean_per_iteration, base)))
    print(_gain("learning gain in final best GFLOPS", " GFLOPS", treated, finals[treated],
                finals[base]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
