"""bench/confirmation_ranks.py: a run's groups, as the scheduler filed them, read back."""

from __future__ import annotations

from pathlib import Path

from hpcrl_scheduler import confirm
from hpcrl_scheduler.store import Store
from tests.scheduler.helpers import result
from tests.support.scripts import load_script

bench = load_script("bench/confirmation_ranks.py", "bench_confirmation_ranks")


def filed(store: Store, group: str, gflops: list[float | None], state: confirm.ConfirmState):
    with store.tx():
        for index, value in enumerate(gflops):
            status = "success" if value is not None else "compile_error"
            store.add_result(result(group, index, status, value), received_at=0.0, late=False)
        store.set(confirm.STATE_PREFIX + group, state.to_json())


def test_a_winner_capped_below_the_runner_up_ties_the_top_and_one_measured_again_does_not(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "run.sqlite")
    # Capped: 10 confirmed at 6, the runner-up's 8 (measured once) counts at 6 too.
    tied = "r.s0.t0.g0000"
    filed(
        store,
        tied,
        [10.0, 8.0, None],
        confirm.ConfirmState(round=1, confirmed=[f"{tied}/0"], adjusted={f"{tied}/0": 6.0}),
    )
    # The runner-up measured again (7): ranked by the two lower measurements.
    ranked = "r.s0.t0.g0001"
    filed(
        store,
        ranked,
        [10.0, 8.0],
        confirm.ConfirmState(
            round=2,
            confirmed=[f"{ranked}/0", f"{ranked}/1"],
            adjusted={f"{ranked}/0": 6.0, f"{ranked}/1": 7.0},
        ),
    )
    # Unconfirmed (still open): left out.
    store.set(confirm.STATE_PREFIX + "r.s0.t0.g0002", confirm.ConfirmState(round=1).to_json())
    ranks = bench.ranks_of(Store(tmp_path / "run.sqlite", read_only=True))
    assert [(g.first, g.counted, g.top_tied, g.rounds) for g in ranks] == [
        (10.0, 6.0, True, 1),
        (10.0, 6.0, False, 2),
    ]
    row = bench.row("r", ranks)
    assert row[1:] == ["2", "0.60, 0.60", "100%", "50% (1)", "1.50, max 2"]
