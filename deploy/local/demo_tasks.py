"""The demo's view of an experiment of several tasks (``[experiment.tasks]``, issue 30).

A run of one task (``make demo``) takes only its OpenBLAS figure from here. A run of
several has, per task: its own
fixed evaluation set (``evaluation-<task>.json``), its best kernel against that task's
reference timed in the same run (OpenBLAS ``dgemm``/``dgemv`` for matmul/gemv; for the
memory-bound stencil and spmv, the share of the node's STREAM-triad bandwidth that the
kernel reaches, as ``hpcrl-benchmarker check --reference`` reports it) and its plots.
Pure functions, except :func:`time_reference` and :func:`reference_of`, which time on this
node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpcrl_common.config import ExperimentSettings
from hpcrl_common.task import load_task


def task_keys(experiment: ExperimentSettings) -> list[str]:
    """The experiment's tasks, as the config names them (name or path), in the scheduler's
    order (by that name)."""
    return sorted(experiment.task_weights())


def task_name(key: str) -> str:
    """The task's own name (its TOML's ``name``): file names and labels use it."""
    return load_task(key).name


def bootstrap_args(keys: list[str]) -> list[str]:
    """``hpcrl-bootstrap`` arguments naming the tasks: a run of several asks for a policy
    that writes all of them; a run of one passes nothing (the bootstrap's default task),
    so ``make demo`` finds the policy it cached before several tasks existed."""
    return ["--tasks", ",".join(keys)] if len(keys) > 1 else []


def evaluation_files(run_dir: Path, name: str) -> tuple[Path, Path]:
    """Where one task's fixed-set evaluation goes: its JSON and its plot."""
    return run_dir / f"evaluation-{name}.json", run_dir / f"evaluation-{name}.png"


def task_iterations(data: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """The snapshot's iterations with each one's pool (``by_task``), groups and rewards
    (``groups_by_task``) of ``key`` alone."""
    return [
        {
            **it,
            **it.get("groups_by_task", {}).get(key, {}),
            "pool": it.get("by_task", {}).get(key, {}),
        }
        for it in data["iterations"]
    ]


def time_reference(key: str, benchmarker: Any) -> dict:
    """The task's performance reference on this node, now, as the benchmarker times it:
    ``kind`` openblas (its routine's GFLOPS: dgemm for matmul, dgemv for gemv) or triad
    (STREAM's GB/s: stencil, spmv); ``kind`` none where the task has neither."""
    return reference_of(load_task(key), benchmarker)


def reference_of(task: Any, benchmarker: Any) -> dict:
    """:func:`time_reference` of a task already loaded (a path's, or the experiment's)."""
    try:
        references = benchmarker.reference(task)
    except Exception as exc:  # an unavailable reference is reported, not fatal to the report
        return {"kind": "none", "why": str(exc)[:300]}
    if references.triad is not None and references.openblas is None:
        return {"kind": "triad", "gbytes_per_s": references.triad.gbytes_per_s}
    if references.openblas is not None:
        routine = references.openblas.routine.removeprefix("cblas_")
        return {
            "kind": "openblas",
            "routine": routine,
            "gflops": references.openblas.gflops,
            "threads": references.openblas.threads,
            "core": references.openblas.core,
        }
    return {"kind": "none", "why": "the task has no timed reference"}


def kernel_gbytes_per_s(key: str, gflops: float, bytes_moved: float | None) -> float | None:
    """A kernel's bandwidth at the reward size from its GFLOPS: bytes a call moves over the
    call's time (FLOPs / FLOP rate)."""
    if bytes_moved is None or gflops <= 0:
        return None
    flops = load_task(key).flop_count(load_task(key).sizes.reward)
    return bytes_moved * gflops / flops


def task_row(
    key: str,
    best: dict[str, Any] | None,
    evaluation: dict[str, Any] | None,
    reference: dict[str, Any] | None,
    bytes_moved: float | None = None,
) -> dict[str, Any]:
    """One task's line of the summary: v0 -> final on its fixed set (share correct and mean
    GFLOPS, each gain with its 95 % CI) and its best kernel against its reference."""
    row: dict[str, Any] = {"task": key, "best": best, "reference": reference, "gains": None}
    comparison = (evaluation or {}).get("comparison")
    if comparison is not None:
        row["versions"] = (comparison["before"], comparison["after"])
        row["gains"] = {
            name: comparison["metrics"][name] for name in ("share_correct", "mean_gflops")
        }
    if best is None or reference is None:
        return row
    if reference["kind"] == "openblas" and reference.get("gflops"):
        row["share_of_reference"] = best["gflops"] / reference["gflops"]
    elif reference["kind"] == "triad":
        bandwidth = kernel_gbytes_per_s(key, best["gflops"], bytes_moved)
        row["gbytes_per_s"] = bandwidth
        if bandwidth is not None:
            row["share_of_reference"] = bandwidth / reference["gbytes_per_s"]
            # The GFLOPS a kernel moving those bytes at the roof would reach (for the plot).
            row["roof_gflops"] = best["gflops"] / row["share_of_reference"]
    return row


def reference_line(row: dict[str, Any]) -> tuple[float, str] | None:
    """(GFLOPS, label) of the task's reference on its best-GFLOPS plot, or None."""
    reference = row.get("reference") or {}
    if reference.get("kind") == "openblas" and reference.get("gflops"):
        return reference["gflops"], f"OpenBLAS {reference['routine']}"
    if reference.get("kind") == "triad" and row.get("roof_gflops"):
        return row["roof_gflops"], "STREAM-triad roof"
    return None


def _gain(g: dict[str, float]) -> str:
    return (
        f"{g['before']:.3g} -> {g['after']:.3g} ({g['gain']:+.3g}, "
        f"95 % CI [{g['low']:+.3g}, {g['high']:+.3g}])"
    )


def row_cells(row: dict[str, Any]) -> list[str]:
    """The summary table's cells of one task: task, share correct, mean GFLOPS, best
    kernel, reference (what it is and the best kernel's share of it)."""
    gains = row.get("gains")
    correct = _gain(gains["share_correct"]) if gains else "not evaluated"
    gflops = _gain(gains["mean_gflops"]) if gains else "-"
    best = row.get("best")
    best_text = "-" if best is None else f"{best['gflops']:.2f} GFLOPS (stage {best['stage']})"
    reference = row.get("reference") or {"kind": "none", "why": "not timed"}
    share = row.get("share_of_reference")
    if reference["kind"] == "openblas":
        ref_text = f"OpenBLAS {reference['routine']} {reference['gflops']:.2f} GFLOPS"
    elif reference["kind"] == "triad":
        ref_text = f"STREAM triad {reference['gbytes_per_s']:.1f} GB/s"
        if row.get("gbytes_per_s") is not None:
            ref_text += f"; kernel {row['gbytes_per_s']:.1f} GB/s"
    else:
        ref_text = f"none ({reference.get('why', '')})"
    if share is not None:
        ref_text += f" -> {share:.0%} of it"
    return [row["task"], correct, gflops, best_text, ref_text]


ROW_COLUMNS = (
    "task",
    "share correct v0 -> final",
    "mean GFLOPS v0 -> final",
    "best kernel",
    "reference (same run)",
)
