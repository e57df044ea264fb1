"""Kernels timed again side by side: a fair comparison on a node whose speed drifts.

A figure a run timed says as much about when it was timed as about the kernel: on a shared
node the speed drifts by more than the gains to judge (idle AMD EPYC Zen 5, 2 vCPUs, OpenBLAS
dgemm timed every 15 s: 93-96 GFLOPS, then 134-168 within a minute). So kernels to compare
(two runs' fastest, a run's best against OpenBLAS) are timed again together: in rounds, each
round every kernel once in an interleaved order that is reversed every other round, the
reference once at the start of each round; each kernel's figure is its median over the rounds.
Pure logic with the timers passed in; :func:`benchmarker_timers` gives the real ones.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any

ROUNDS = 3


@dataclass(frozen=True)
class Entry:
    """A correct kernel to time again; ``group`` is what it is compared as (an arm, a run)."""

    group: str
    source: str
    stage: int
    gflops: float  # as first timed


def interleaved(groups: Sequence[Sequence[Entry]], round_index: int) -> list[Entry]:
    """One round's order: the groups' first entries, then their second ones, and so on,
    reversed every other round, so that a drift in the node's speed favours no group and no
    rank."""
    order = [entry for tier in zip_longest(*groups) for entry in tier if entry is not None]
    return order if round_index % 2 == 0 else order[::-1]


@dataclass(frozen=True)
class Retimed:
    best: dict[str, float | None]  # per group: its fastest entry's median (None: none held)
    reference: float | None  # the reference's median over the rounds
    medians: dict[Entry, float | None]

    def fastest(self, group: str) -> Entry | None:
        """The group's entry with the highest median."""
        held = [(m, e) for e, m in self.medians.items() if e.group == group and m is not None]
        return max(held, key=lambda pair: pair[0])[1] if held else None


def retime(
    groups: Sequence[Sequence[Entry]],
    time_entry: Callable[[Entry], float | None],
    time_reference: Callable[[], float | None],
    rounds: int = ROUNDS,
) -> Retimed:
    """Every entry timed ``rounds`` times in :func:`interleaved` order, the reference once at
    the start of each round. A timing of None (an entry that failed this time, a reference
    that could not be timed) is left out of its median; an entry with no successful timing has
    none."""
    samples: dict[Entry, list[float]] = {entry: [] for group in groups for entry in group}
    references: list[float] = []
    for index in range(rounds):
        reference = time_reference()
        if reference is not None:
            references.append(reference)
        for entry in interleaved(groups, index):
            gflops = time_entry(entry)
            if gflops is not None:
                samples[entry].append(gflops)
    medians = {e: statistics.median(s) if s else None for e, s in samples.items()}
    best: dict[str, float | None] = {}
    for entry, median in medians.items():
        if median is not None and median > (best.get(entry.group) or 0.0):
            best[entry.group] = median
        best.setdefault(entry.group, None)
    return Retimed(best, statistics.median(references) if references else None, medians)


def benchmarker_timers(
    task: Any, opt_level: str, benchmarker: Any | None = None
) -> tuple[Callable[[Entry], float | None], Callable[[], float | None]]:
    """(time an entry, time the task's OpenBLAS routine) with the benchmarker's own pipeline
    (sandbox, checks, verification at every size, timing lock), as a run judges a kernel."""
    if benchmarker is None:
        from hpcrl_benchmarker.config import BenchmarkerSection
        from hpcrl_benchmarker.pipeline import Benchmarker

        benchmarker = Benchmarker(BenchmarkerSection(pin_threads=False))

    def time_entry(entry: Entry) -> float | None:
        verdict = benchmarker.evaluate(
            f"```c\n{entry.source}\n```", stage=entry.stage, opt_level=opt_level, task=task
        )
        return verdict.gflops if verdict.status == "success" else None

    def time_reference() -> float | None:
        openblas = benchmarker.reference(task).openblas
        return None if openblas is None else openblas.gflops

    return time_entry, time_reference
