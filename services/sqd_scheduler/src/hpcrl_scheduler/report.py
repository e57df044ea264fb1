"""`status` and `export`: read-only views of a scheduler database.

A run of several tasks (``experiment.tasks``) is also shown per task: ``by_task`` in the
snapshot (each task's pool and best program) and in each iteration (its pool; its groups and
their rewards in ``groups_by_task``), and in the export each task's best per
stage and lineage under ``<task>/``; the keys and files of a run of one task are as before.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from hpcrl_scheduler.selection import Program, dedupe
from hpcrl_scheduler.store import GroupRow, Store


def _stage_summary(programs: list[Program]) -> dict[str, Any]:
    gflops = [p.gflops for p in programs if p.ok and p.gflops is not None]
    statuses = Counter(p.status for p in programs)
    return {
        "count": len(programs),
        "best_gflops": max(gflops) if gflops else None,
        "median_gflops": statistics.median(gflops) if gflops else None,
        "status_share": {k: round(v / len(programs), 4) for k, v in sorted(statuses.items())},
    }


def _pool_summary(pool: list[Program]) -> dict[str, Any]:
    return {
        str(s): _stage_summary([p for p in pool if p.stage == s])
        for s in sorted({p.stage for p in pool})
    }


def _group_summary(groups: list[GroupRow], rewards: list[float]) -> dict[str, Any]:
    """One task's groups of an iteration: how many, and their rewards' mean and max."""
    return {
        "groups": len(groups),
        "reward_mean": statistics.fmean(rewards) if rewards else None,
        "reward_max": max(rewards) if rewards else None,
    }


def _best_entry(best: Program | None) -> dict[str, Any] | None:
    if best is None:
        return None
    return {"id": best.id, "stage": best.stage, "gflops": best.gflops, "iteration": best.iteration}


def tasks_of(store: Store) -> list[str]:
    """The run's tasks: meta ``task`` is a name (one task) or a list (several)."""
    task = store.get("task")
    return list(task) if isinstance(task, list) else [] if task is None else [str(task)]


def snapshot(store: Store) -> dict[str, Any]:
    """Everything `status` shows, as plain data (what `status --json` prints)."""
    t = int(store.get("iteration", -1))
    total = int(store.get("iterations", 0))
    iterations = []
    tasks = tasks_of(store)
    for i in range(t + 1):
        groups = store.groups_of_iteration(i)
        pool = dedupe(store.pool(i))
        rewards = store.rewards_of_iteration(i)
        states = Counter(g.state for g in groups)
        iterations.append(
            {
                "iteration": i,
                "groups": len(groups),
                "pending": states.get("pending", 0),
                "in_flight": states.get("published", 0),
                "closed": states.get("closed", 0),
                "complete": bool(groups) and states.get("closed", 0) == len(groups),
                "batches_sent": sum(g.outcome == "sent" for g in groups),
                "reward_mean": statistics.fmean(rewards) if rewards else None,
                "reward_max": max(rewards) if rewards else None,
                "pool": _pool_summary(pool),
            }
        )
        if len(tasks) > 1:  # the pools of each task apart (a run of one: "pool" is its own)
            iterations[-1]["by_task"] = {
                task: _pool_summary([p for p in pool if p.task == task]) for task in tasks
            }
            iterations[-1]["groups_by_task"] = {
                task: _group_summary(
                    [g for g in groups if g.task == task], store.rewards_of_iteration(i, task)
                )
                for task in tasks
            }
    current_complete = bool(iterations) and iterations[-1]["complete"]
    best = _best_overall(store)
    current = dedupe(store.pool(t)) if t >= 0 else []
    # Stages of different tasks are different pools: their GFLOPS never mix.
    by_task = {
        task: {
            "pool": _pool_summary([p for p in current if p.task == task]),
            "best": _best_entry(_best_overall(store, task)),
        }
        for task in tasks
    }
    return {
        "experiment": store.get("experiment"),
        "seed": store.get("seed"),
        "task": store.get("task"),
        "reward_mode": store.get("reward_mode"),
        "iteration": t,
        "iterations_total": total,
        "iterations_done": sum(1 for it in iterations if it["complete"]),
        "done": t >= total - 1 and t >= 0 and current_complete,
        "policy_version": int(store.get("policy_version", 0)),
        "groups_trained": int(store.get("groups_trained", 0)),
        "in_flight": store.count_groups_in_flight(),
        "pending": store.count_pending_groups(),
        "outbox_unsent": store.count_unsent(),
        "pool": iterations[-1]["pool"] if iterations else {},
        "iterations": iterations,
        "best": _best_entry(best),
        "tasks": tasks,
        "by_task": by_task,
    }


def _children_ok(store: Store, task: str | None = None) -> list[Program]:
    """The successes filed by groups (seeds, iteration -1, left out), of ``task`` if given."""
    return [
        p
        for p in store.all_programs()
        if p.ok and p.iteration >= 0 and (task is None or p.task == task)
    ]


def fastest_children(store: Store, count: int, task: str | None = None) -> list[Program]:
    """The ``count`` fastest correct children with distinct sources, fastest first (a
    source filed twice counts once, at its faster figure)."""
    ranked = sorted(_children_ok(store, task), key=lambda p: (p.gflops or 0.0, p.id), reverse=True)
    seen: set[str | None] = set()
    fastest = []
    for program in ranked:
        if program.source is None or program.source in seen:
            continue
        seen.add(program.source)
        fastest.append(program)
        if len(fastest) == count:
            break
    return fastest


def _best_overall(store: Store, task: str | None = None) -> Program | None:
    ok = _children_ok(store, task)
    return max(ok, key=lambda p: (p.gflops or 0.0, p.id), default=None)


def render(data: dict[str, Any]) -> None:
    """Human view of a snapshot with rich."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    state = "done" if data["done"] else "running"
    console.print(
        f"[bold]{data['experiment']}[/] (seed {data['seed']}, task {data['task']}, "
        f"{data['reward_mode']}): iteration {data['iteration']} of "
        f"{data['iterations_total']} ({state}); policy v{data['policy_version']}; "
        f"{data['in_flight']} groups in flight, {data['pending']} pending, "
        f"{data['outbox_unsent']} messages unsent"
    )
    pool = Table(title=f"pool of iteration {data['iteration']}")
    for column in ("stage", "programs", "best GFLOPS", "median GFLOPS", "statuses"):
        pool.add_column(column)
    for stage, row in data["pool"].items():
        shares = ", ".join(f"{k} {v:.0%}" for k, v in row["status_share"].items())
        pool.add_row(
            stage, str(row["count"]), _num(row["best_gflops"]), _num(row["median_gflops"]), shares
        )
    console.print(pool)
    its = Table(title="iterations")
    for column in ("t", "groups", "in flight", "closed", "batches", "reward mean", "reward max"):
        its.add_column(column)
    for it in data["iterations"]:
        its.add_row(
            str(it["iteration"]),
            str(it["groups"]),
            str(it["in_flight"]),
            str(it["closed"]),
            str(it["batches_sent"]),
            _num(it["reward_mean"]),
            _num(it["reward_max"]),
        )
    console.print(its)
    if len(data.get("tasks", [])) > 1:
        for task, row in data["by_task"].items():
            best = row["best"]
            shown = "-" if best is None else f"{best['id']} stage {best['stage']} "
            shown += "" if best is None else f"{best['gflops']:.2f} GFLOPS"
            console.print(f"task {task}: best {shown}")
    elif data["best"]:
        best = data["best"]
        console.print(f"best: {best['id']} stage {best['stage']} {best['gflops']:.2f} GFLOPS")


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def lineage(store: Store, program: Program) -> list[Program]:
    """The program, its parent, ... up to the seed (oldest first)."""
    chain = [program]
    seen = {program.id}
    while chain[-1].parent_id and chain[-1].parent_id not in seen:
        parent = store.program(chain[-1].parent_id)
        if parent is None:
            break
        seen.add(parent.id)
        chain.append(parent)
    return list(reversed(chain))


def _file_name(prefix: str, program: Program) -> str:
    return f"{prefix}_{program.id.replace('/', '_')}.c"


def _header(program: Program) -> str:
    gflops = "-" if program.gflops is None else f"{program.gflops:.3f}"
    return (
        f"/* hpcrl program {program.id}: stage {program.stage}, iteration "
        f"{program.iteration}, mode {program.mode}, status {program.status}, GFLOPS "
        f"{gflops}, parent {program.parent_id} */\n"
    )


def _export_best(store: Store, out: Path, task: str | None, prefix: str) -> dict[str, Any]:
    """Write one pool's best program per stage and its best's lineage (files ``prefix``...)."""
    part: dict[str, Any] = {"best_per_stage": {}, "lineage": []}
    ok = [p for p in _children_ok(store, task) if p.source]
    for stage in sorted({p.stage for p in ok}):
        best = max((p for p in ok if p.stage == stage), key=lambda p: (p.gflops or 0.0, p.id))
        name = prefix + _file_name(f"stage{stage}_best", best)
        (out / name).write_text(_header(best) + (best.source or ""))
        part["best_per_stage"][str(stage)] = _entry(best, name)
    overall = _best_overall(store, task)
    if overall is not None:
        for depth, program in enumerate(lineage(store, overall)):
            name = prefix + _file_name(f"lineage{depth:02d}", program)
            (out / name).write_text(_header(program) + (program.source or ""))
            part["lineage"].append(_entry(program, name))
    return part


def export(store: Store, out: Path) -> dict[str, Any]:
    """Write the best program of each stage and the overall best's lineage, with an index.

    A run of several tasks has them per task only (``by_task``, files under ``<task>/``):
    a stage's best across tasks would compare GFLOPS of different kernels."""
    out.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {"experiment": store.get("experiment")}
    tasks = tasks_of(store)
    parts: list[tuple[str | None, dict[str, Any]]]
    if len(tasks) > 1:
        index.update(best_per_stage={}, lineage=[], by_task={})
        for task in tasks:
            folder = _task_folder(task)
            (out / folder).mkdir(exist_ok=True)
            index["by_task"][task] = _export_best(store, out, task, f"{folder}/")
        parts = list(index["by_task"].items())
    else:
        index.update(_export_best(store, out, None, ""))
        parts = [(None, index)]
    (out / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    several = len(tasks) > 1
    lines = [
        "# hpcrl scheduler export",
        "",
        ("| task " if several else "") + "| file | program | stage | iteration | mode | status "
        "| GFLOPS |",
        ("|---" if several else "") + "|---|---|---|---|---|---|---|",
    ]
    for task, part in parts:
        for entry in [*part["best_per_stage"].values(), *part["lineage"]]:
            lines.append(
                (f"| {task} " if several else "")
                + f"| {entry['file']} | {entry['id']} | {entry['stage']} | "
                f"{entry['iteration']} | {entry['mode']} | {entry['status']} | "
                f"{_num(entry['gflops'])} |"
            )
    (out / "index.md").write_text("\n".join(lines) + "\n")
    return index


def _task_folder(task: str) -> str:
    """A task's export folder: its name (a path's file name without .toml)."""
    return Path(task).name.removesuffix(".toml").replace("/", "_") or "task"


def _entry(program: Program, name: str) -> dict[str, Any]:
    return {
        "file": name,
        "id": program.id,
        "stage": program.stage,
        "iteration": program.iteration,
        "mode": program.mode,
        "status": program.status,
        "gflops": program.gflops,
        "parent": program.parent_id,
        "task": program.task,
    }
