"""SQD selection: which pool nodes iteration t expands, in which mode, towards which stage.

Pure functions over :class:`Program` records (no I/O). The rule, per stage s of pool(t-1):

* successes that have a source, ranked by GFLOPS: the top ``deepen`` share (rounded up) are
  deepened (target stage s+1, the last stage deepens into itself), the next ``improve``
  share are improved (same stage), the rest are not expanded;
* failures that still have a source, most-progressed first (verification error, runtime
  error, timeout, compile error, stage / library violation: the repair ranks of
  ``hpcrl_common.rewards.FAILURES``), are repaired (same stage);
* a node budget B (``0`` = unbounded) bounds how many of those are expanded: B is split
  evenly across the stages that have candidates, and each stage's share by the mode ratios;
  a share that a stage or mode cannot use goes to the others (largest remainder, ties by a
  seeded hash), so the budget is used whenever there are candidates for it;
* the seed is always expanded, in addition to the budget.

An experiment of several tasks (``experiment.tasks``) keeps one pool per (task, stage):
:func:`select_tasks` splits B over the tasks by weight (see there) and runs :func:`select` on
each task's own pool and seed, so a node's parent, and hence its group, is of one task.

Ties in GFLOPS or failure rank are broken by a hash of (seed, iteration, program key), so a
run is reproducible for a given seed whatever order results arrived in.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from hpcrl_common.rewards import REPAIR_RANKS
from hpcrl_common.stages import FIRST_STAGE, LAST_STAGE
from hpcrl_scheduler.normalize import source_key

MODES_SELECTED = ("deepen", "improve", "repair")
SEED_ID = "seed"


@dataclass(frozen=True)
class Ratios:
    """The mode ratios; these defaults are also the ``scheduler.ratio_*`` config defaults."""

    deepen: float = 0.4
    improve: float = 0.3
    repair: float = 0.3

    def __post_init__(self) -> None:
        values = (self.deepen, self.improve, self.repair)
        if min(values) < 0 or sum(values) <= 0:
            raise ValueError(f"ratios must be >= 0 with a positive sum, got {values}")

    def of(self, mode: str) -> float:
        return float(getattr(self, mode))


@dataclass(frozen=True)
class Program:
    """One child in a pool (id = candidate id, or ``seed``)."""

    id: str
    stage: int
    status: str
    source: str | None
    gflops: float | None = None
    reward: float | None = None
    error: str = ""
    parent_id: str | None = None
    mode: str = "seed"
    iteration: int = -1
    host_class: str = ""
    techniques: tuple[str, ...] = ()
    key: str = field(default="")
    # The task (``experiment.task`` or a key of ``experiment.tasks``) whose pool it is in.
    task: str = ""

    def __post_init__(self) -> None:
        if not self.key and self.source is not None:
            object.__setattr__(self, "key", source_key(self.source))

    @property
    def ok(self) -> bool:
        return self.status == "success" and self.gflops is not None


@dataclass(frozen=True)
class Node:
    """One element of P: expand ``parent`` in ``mode`` towards ``target_stage``."""

    parent: Program
    mode: str
    target_stage: int

    @property
    def task(self) -> str:
        """A child is of its parent's task: a group never mixes tasks."""
        return self.parent.task


def dedupe(programs: Iterable[Program]) -> list[Program]:
    """One program per (task, stage, normalised source); the survivor does not depend on
    order.

    A success beats a failure; among equals the smallest id wins. Programs without a source
    (nothing could be extracted) are kept as they are: they are never the same node.
    """
    best: dict[tuple[str, int, str], Program] = {}
    loose: list[Program] = []
    for program in programs:
        if program.source is None:
            loose.append(program)
            continue
        slot = (program.task, program.stage, program.key)
        held = best.get(slot)
        if held is None or _preferred(program, held):
            best[slot] = program
    return sorted([*best.values(), *loose], key=lambda p: p.id)


def _preferred(a: Program, b: Program) -> bool:
    return (not a.ok, a.id) < (not b.ok, b.id)


def tie_key(seed: int, iteration: int, program: Program) -> str:
    return hashlib.sha256(f"{seed}:{iteration}:{program.key}:{program.id}".encode()).hexdigest()


def rank_successes(programs: Sequence[Program], seed: int, iteration: int) -> list[Program]:
    # Without its source (benchmarker.include_source = false) a program cannot be a parent.
    ok = [p for p in programs if p.ok and p.source]
    return sorted(ok, key=lambda p: (-(p.gflops or 0.0), tie_key(seed, iteration, p)))


def rank_failures(programs: Sequence[Program], seed: int, iteration: int) -> list[Program]:
    failed = [p for p in programs if not p.ok and p.source]
    return sorted(
        failed,
        key=lambda p: (REPAIR_RANKS.get(p.status, len(REPAIR_RANKS)), tie_key(seed, iteration, p)),
    )


def candidates_of_stage(
    programs: Sequence[Program], ratios: Ratios, seed: int, iteration: int
) -> dict[str, list[Program]]:
    """The unbounded expansion lists of one stage, each ordered best first."""
    ranked = rank_successes(programs, seed, iteration)
    n_deepen = min(len(ranked), math.ceil(ratios.deepen * len(ranked) - 1e-9))
    n_improve = min(len(ranked) - n_deepen, math.ceil(ratios.improve * len(ranked) - 1e-9))
    return {
        "deepen": ranked[:n_deepen],
        "improve": ranked[n_deepen : n_deepen + n_improve],
        "repair": rank_failures(programs, seed, iteration) if ratios.repair > 0 else [],
    }


def allocate(
    total: int, weights: Sequence[float], caps: Sequence[int], tie_order: Sequence[int]
) -> list[int]:
    """Split ``total`` units by ``weights`` without exceeding ``caps`` (water-filling).

    Each round gives every open bucket its weighted share (largest remainder, ties by
    ``tie_order``); buckets that hit their cap close and their surplus is shared again.
    """
    shares = [0] * len(weights)
    left = min(total, sum(caps))
    while left > 0:
        open_ = [i for i in range(len(weights)) if shares[i] < caps[i] and weights[i] > 0]
        if not open_:
            open_ = [i for i in range(len(weights)) if shares[i] < caps[i]]
            weights = [1.0] * len(weights)
        weight_sum = sum(weights[i] for i in open_)
        exact = {i: left * weights[i] / weight_sum for i in open_}
        given = {i: min(math.floor(exact[i]), caps[i] - shares[i]) for i in open_}
        spare = left - sum(given.values())
        by_remainder = sorted(
            open_, key=lambda i: (-(exact[i] - math.floor(exact[i])), tie_order[i])
        )
        for i in by_remainder:
            if spare == 0:
                break
            if shares[i] + given[i] < caps[i]:
                given[i] += 1
                spare -= 1
        for i in open_:
            shares[i] += given[i]
        handed = sum(given.values())
        if handed == 0:
            break
        left -= handed
    return shares


def select(
    pool: Sequence[Program],
    seed_program: Program,
    *,
    iteration: int,
    budget: int,
    ratios: Ratios,
    seed: int,
) -> list[Node]:
    """P for ``iteration`` from pool(iteration-1): the seed first, then per stage and mode."""
    nodes = [Node(seed_program, "seed", FIRST_STAGE)]
    by_stage: dict[int, list[Program]] = {}
    for program in dedupe(pool):
        by_stage.setdefault(program.stage, []).append(program)
    lists = {s: candidates_of_stage(by_stage[s], ratios, seed, iteration) for s in sorted(by_stage)}
    lists = {s: modes for s, modes in lists.items() if any(modes.values())}
    if not lists:
        return nodes
    stages = sorted(lists)
    sizes = {s: {m: len(lists[s][m]) for m in MODES_SELECTED} for s in stages}
    if budget <= 0:
        quota = sizes
    else:
        per_stage = allocate(
            budget,
            [1.0] * len(stages),
            [sum(sizes[s].values()) for s in stages],
            _tie_order(seed, iteration, [str(s) for s in stages]),
        )
        quota = {}
        for s, share in zip(stages, per_stage, strict=True):
            counts = allocate(
                share,
                [ratios.of(m) for m in MODES_SELECTED],
                [sizes[s][m] for m in MODES_SELECTED],
                _tie_order(seed, iteration, [f"{s}:{m}" for m in MODES_SELECTED]),
            )
            quota[s] = dict(zip(MODES_SELECTED, counts, strict=True))
    for s in stages:
        for mode in MODES_SELECTED:
            target = min(s + 1, LAST_STAGE) if mode == "deepen" else s
            for program in lists[s][mode][: quota[s][mode]]:
                nodes.append(Node(program, mode, target))
    return nodes


def split_budget(
    budget: int,
    weights: dict[str, float],
    capacities: dict[str, int],
    *,
    seed: int,
    iteration: int,
) -> dict[str, int]:
    """Each task's share of the node budget ``budget`` (> 0) of one iteration.

    The rule: B is split in proportion to the weights, by largest remainder (ties by a
    SHA-256 of (seed, iteration, task), so the split is deterministic and does not favour
    the task named first); no task gets more than it has candidates for (``capacities``: the
    nodes it would expand unbounded) and what it cannot use is shared again among the others
    by weight (water-filling). Seeds are outside B, so every task is expanded every iteration.
    """
    tasks = sorted(weights)
    shares = allocate(
        budget,
        [weights[task] for task in tasks],
        [capacities.get(task, 0) for task in tasks],
        _tie_order(seed, iteration, [f"task:{task}" for task in tasks]),
    )
    return dict(zip(tasks, shares, strict=True))


def select_tasks(
    pools: dict[str, Sequence[Program]],
    seeds: dict[str, Program],
    weights: dict[str, float],
    *,
    iteration: int,
    budget: int,
    ratios: Ratios,
    seed: int,
) -> list[Node]:
    """P of an experiment of several tasks: per task, :func:`select` on its own pool with its
    share of ``budget`` (:func:`split_budget`; 0 = unbounded for every task).

    Order (the order requests are admitted in): every task's seed, then the tasks' other
    nodes interleaved (one of each task in turn, tasks by name), so that pacing, which
    admits requests in order, holds no task back behind another. One task: :func:`select`.
    """
    tasks = sorted(weights)

    def per_task(task: str, share: int) -> list[Node]:
        return select(
            pools.get(task, ()),
            seeds[task],
            iteration=iteration,
            budget=share,
            ratios=ratios,
            seed=seed,
        )

    if len(tasks) == 1:
        return per_task(tasks[0], budget)

    unbounded = {task: per_task(task, 0) for task in tasks}
    if budget > 0:
        capacities = {task: len(nodes) - 1 for task, nodes in unbounded.items()}
        shares = split_budget(budget, weights, capacities, seed=seed, iteration=iteration)
        # A share of 0 would read as "unbounded" to select(): that task expands its seed only.
        chosen = {
            task: per_task(task, shares[task]) if shares[task] else unbounded[task][:1]
            for task in tasks
        }
    else:
        chosen = unbounded
    nodes = [chosen[task][0] for task in tasks]
    rest = {task: chosen[task][1:] for task in tasks}
    for position in range(max(len(r) for r in rest.values())):
        nodes.extend(rest[task][position] for task in tasks if position < len(rest[task]))
    return nodes


def _tie_order(seed: int, iteration: int, labels: Sequence[str]) -> list[int]:
    digests = [
        hashlib.sha256(f"{seed}:{iteration}:{label}".encode()).hexdigest() for label in labels
    ]
    order = sorted(range(len(labels)), key=lambda i: digests[i])
    rank = [0] * len(labels)
    for position, index in enumerate(order):
        rank[index] = position
    return rank
