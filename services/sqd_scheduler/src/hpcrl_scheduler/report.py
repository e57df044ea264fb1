"""`status` and `export`: read-only views of a scheduler database."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from hpcrl_scheduler.selection import SEED_ID, Program, dedupe
from hpcrl_scheduler.store import Store


def _stage_summary(programs: list[Program]) -> dict[str, Any]:
    gflops = [p.gflops for p in programs if p.ok and p.gflops is not None]
    statuses = Counter(p.status for p in programs)
    return {
        "count": len(programs),
        "best_gflops": max(gflops) if gflops else None,
        "median_gflops": statistics.median(gflops) if gflops else None,
        "status_share": {k: round(v / len(programs), 4) for k, v in sorted(statuses.items())},
    }


def snapshot(store: Store) -> dict[str, Any]:
    """Everything `status` shows, as plain data (what `status --json` prints)."""
    t = int(store.get("iteration", -1))
    total = int(store.get("iterations", 0))
    iterations = []
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
                "pool": {
                    str(s): _stage_summary([p for p in pool if p.stage == s])
                    for s in sorted({p.stage for p in pool})
                },
            }
        )
    current_complete = bool(iterations) and iterations[-1]["complete"]
    best = _best_overall(store)
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
        "best": None
        if best is None
        else {
            "id": best.id,
            "stage": best.stage,
            "gflops": best.gflops,
            "iteration": best.iteration,
        },
    }


def _best_overall(store: Store) -> Program | None:
    ok = [p for p in store.all_programs() if p.ok and p.id != SEED_ID]
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
    if data["best"]:
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


def export(store: Store, out: Path) -> dict[str, Any]:
    """Write the best program of each stage and the overall best's lineage, with an index."""
    out.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {
        "experiment": store.get("experiment"),
        "best_per_stage": {},
        "lineage": [],
    }
    ok = [p for p in store.all_programs() if p.ok and p.id != SEED_ID and p.source]
    for stage in sorted({p.stage for p in ok}):
        best = max((p for p in ok if p.stage == stage), key=lambda p: (p.gflops or 0.0, p.id))
        name = _file_name(f"stage{stage}_best", best)
        (out / name).write_text(_header(best) + (best.source or ""))
        index["best_per_stage"][str(stage)] = _entry(best, name)
    overall = _best_overall(store)
    if overall is not None:
        for depth, program in enumerate(lineage(store, overall)):
            name = _file_name(f"lineage{depth:02d}", program)
            (out / name).write_text(_header(program) + (program.source or ""))
            index["lineage"].append(_entry(program, name))
    (out / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    lines = [
        "# hpcrl scheduler export",
        "",
        "| file | program | stage | iteration | mode | status | GFLOPS |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry in [*index["best_per_stage"].values(), *index["lineage"]]:
        lines.append(
            f"| {entry['file']} | {entry['id']} | {entry['stage']} | "
            f"{entry['iteration']} | {entry['mode']} | {entry['status']} | "
            f"{_num(entry['gflops'])} |"
        )
    (out / "index.md").write_text("\n".join(lines) + "\n")
    return index


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
    }
