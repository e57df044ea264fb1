"""How the re-measurement of group winners (``scheduler.confirm_winners``) ranked each group's
top in finished runs: read from their scheduler databases, nothing is run.

A group's winner counts at the lower of its two measurements and no other success of the
group above it (``hpcrl_scheduler.confirm``). Where the second measurement falls below the
runner-up's one measurement, the cap ties the two, and group-normalised rewards give both
100: the group's own timings ranked them, its rewards do not. Since a success measured once
above the confirmed winner is measured again in turn (while ``confirm_rounds`` last), a tie
is left only where rounds ran out. Per run, over its groups with a confirmed winner:

- the winner's lower measurement / its first one (median, lowest; share below 0.9);
- the share of groups whose top two successes tie once confirmation has been applied (the
  rewards the learner trained on) where their first measurements did not ("top tied");
- re-measurements per group (winners, runner-ups, after a disagreement): mean, most.

    .venv/bin/python bench/confirmation_ranks.py data/bench-learning/learning-lr0-s0 [...]
    .venv/bin/python bench/confirmation_ranks.py --all        # every run under data/
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hpcrl_scheduler import confirm
from hpcrl_scheduler.store import Store

ROOT = Path(__file__).resolve().parents[1]
TIE = 1e-9  # relative: equal GFLOPS after the cap


@dataclass(frozen=True)
class GroupRanks:
    first: float  # the winner's first measurement
    counted: float  # what it counts at (its lower measurement)
    top_tied: bool  # the two fastest successes count the same after confirmation
    first_tied: bool  # ... and did their first measurements already?
    rounds: int


def ranks_of(store: Store) -> list[GroupRanks]:
    """One row per group whose winner was confirmed."""
    found = []
    for key, value in store.items(confirm.STATE_PREFIX):
        state = confirm.ConfirmState.of(value)
        if not state.adjusted:
            continue
        group_id = key.removeprefix(confirm.STATE_PREFIX)
        results = store.results_of(group_id)
        first_of = {r.id: r.gflops for r in results}
        winner = state.confirmed[0]
        first = first_of.get(winner)
        if first is None:
            continue
        raw = sorted(
            (r.gflops for r in results if r.gflops is not None and r.id not in state.dropped),
            reverse=True,
        )
        counted = sorted(
            (r.gflops for r in state.apply(results) if r.gflops is not None), reverse=True
        )
        found.append(
            GroupRanks(
                first=first,
                counted=state.adjusted[winner],
                top_tied=len(counted) > 1 and math.isclose(counted[0], counted[1], rel_tol=TIE),
                first_tied=len(raw) > 1 and math.isclose(raw[0], raw[1], rel_tol=TIE),
                rounds=state.round,
            )
        )
    return found


def row(name: str, ranks: list[GroupRanks]) -> list[str]:
    ratios = [g.counted / g.first for g in ranks if g.first > 0]
    ties = sum(g.top_tied and not g.first_tied for g in ranks)
    rounds = [g.rounds for g in ranks]
    return [
        name,
        str(len(ranks)),
        f"{statistics.median(ratios):.2f}, {min(ratios):.2f}" if ratios else "-",
        f"{sum(r < 0.9 for r in ratios) / len(ratios):.0%}" if ratios else "-",
        f"{ties / len(ranks):.0%} ({ties})" if ranks else "-",
        f"{statistics.mean(rounds):.2f}, max {max(rounds)}" if rounds else "-",
    ]


def databases(paths: list[Path], every: bool) -> list[Path]:
    if every:
        paths = sorted(p.parent.parent for p in (ROOT / "data").glob("**/scheduler/*.sqlite"))
    found = []
    for path in paths:
        if path.is_file():
            found.append(path)
            continue
        hits = sorted(path.glob("scheduler/*.sqlite"))
        if not hits:
            raise SystemExit(f"{path}: no scheduler database (scheduler/*.sqlite) under it")
        found.extend(hits)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "runs", nargs="*", type=Path, help="a run's data dir or its scheduler database"
    )
    parser.add_argument("--all", action="store_true", help="every run under data/")
    args = parser.parse_args()
    if not args.runs and not args.all:
        parser.error("name runs (their data dirs) or give --all")
    table = Table(title="Winners re-measured: how each group's top was ranked")
    table.add_column("run", no_wrap=True)
    for column in ("groups", "lower/first: median, lowest", "cut > 10 %", "top tied", "rounds"):
        table.add_column(column, justify="right")
    for path in databases(args.runs, args.all):
        table.add_row(*row(path.stem, ranks_of(Store(path, read_only=True))))
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
