"""The demo's figures: reward and best GFLOPS per iteration (the paper's Figs. 7-8, with
reference lines for OpenBLAS and the catalogue's best per stage, timed in the same run) and
the learner's optimisation health per step (entropy, KL to version 0, clip fraction).

Pure plotting: every figure is drawn from the report's own data and written to a PNG.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

STEP_METRICS = (
    ("entropy", "policy entropy (nats/token)"),
    ("kl", "KL to version 0"),
    ("clip_fraction", "clip fraction"),
    ("zero_variance_fraction", "groups with equal rewards"),
    ("replay_nll", "replay NLL (nats/token)"),
    ("taught_nll", "held-out taught NLL (nats/token)"),
)


def _recorded(version: dict[str, Any], key: str) -> bool:
    """The version has a number for ``key`` (NaN: not measured, e.g. no replay)."""
    value = version.get(key)
    return value is not None and value == value


def _integer_x(axis: Any) -> None:
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))


def reward_curve(rows: list[dict[str, Any]], out: Path) -> None:
    figure, axis = plt.subplots(figsize=(6, 4))
    its = [r["iteration"] for r in rows]
    axis.plot(its, [r["reward_mean"] for r in rows], marker="o", label="mean reward")
    axis.plot(its, [r["reward_max"] for r in rows], marker="s", label="max reward")
    axis.set(xlabel="iteration", ylabel="reward", title="Reward per iteration")
    _integer_x(axis)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)


def best_gflops(
    iterations: list[dict[str, Any]],
    corpus_best: dict[str, Any] | None,
    out: Path,
    *,
    reference_line: tuple[float, str] | None = None,
    title: str = "Best GFLOPS per iteration",
) -> None:
    """Best GFLOPS of each stage's pool per iteration; dashed: the catalogue's best of that
    stage, dotted black: OpenBLAS dgemm, both timed in this run. ``reference_line``: (GFLOPS,
    label) of another reference instead of dgemm (one task of a run of several: OpenBLAS
    dgemv, or the GFLOPS a memory-bound kernel reaches at the STREAM-triad roof)."""
    figure, axis = plt.subplots(figsize=(7, 4.5))
    stages = sorted({int(s) for it in iterations for s in it["pool"]})
    per_stage = (corpus_best or {}).get("per_stage", {})
    for stage in stages:
        (line,) = axis.plot(
            [it["iteration"] for it in iterations],
            [it["pool"].get(str(stage), {}).get("best_gflops") for it in iterations],
            marker="o",
            label=f"stage {stage}",
        )
        reference = per_stage.get(str(stage))
        if reference:
            axis.axhline(reference, color=line.get_color(), linestyle="--", linewidth=0.8)
    blas = (corpus_best or {}).get("openblas")
    if blas:
        axis.axhline(blas["gflops"], color="black", linestyle=":", label="OpenBLAS dgemm")
    if reference_line is not None:
        axis.axhline(reference_line[0], color="black", linestyle=":", label=reference_line[1])
    axis.set(
        xlabel="iteration",
        ylabel="best GFLOPS",
        title=f"{title} (dashed: catalogue's best of the stage)",
    )
    _integer_x(axis)
    if stages or blas or reference_line:
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)


def learner_health(versions: list[dict[str, Any]], out: Path) -> bool:
    """One panel per step metric the learner recorded; False (no file) without any."""
    shown = [
        (key, label) for key, label in STEP_METRICS if any(_recorded(v, key) for v in versions)
    ]
    if not shown:
        return False
    figure, axes = plt.subplots(len(shown), 1, figsize=(6, 2.2 * len(shown)), sharex=True)
    axes = [axes] if len(shown) == 1 else list(axes)
    for axis, (key, label) in zip(axes, shown, strict=True):
        points = [(v["version"], v[key]) for v in versions if _recorded(v, key)]
        axis.plot([p[0] for p in points], [p[1] for p in points], marker=".")
        axis.set_ylabel(label, fontsize="small")
        _integer_x(axis)
    axes[-1].set_xlabel("learner step (policy version)")
    axes[0].set_title("Learner per step")
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return True
