"""hpcrl_evaluate.retime: kernels timed again side by side, interleaved in rounds, so that a
drift in the node's speed favours none of them (the timers here are functions of a simulated
node's speed; bench/learning.py's test drives the real benchmarker)."""

from __future__ import annotations

from typing import Any

from hpcrl_evaluate.retime import Entry, interleaved, retime


def child(arm: str, name: str, gflops: float = 10.0) -> Entry:
    return Entry(arm, f"/* {name} */", 4, gflops)


def test_a_round_alternates_the_arms_and_every_other_round_runs_backwards() -> None:
    trained = [child("trained", "t1"), child("trained", "t2"), child("trained", "t3")]
    control = [child("lr 0", "c1")]
    names = [[c.source for c in interleaved([trained, control], r)] for r in (0, 1)]
    assert names[0] == ["/* t1 */", "/* c1 */", "/* t2 */", "/* t3 */"]
    assert names[1] == names[0][::-1]


def test_retiming_side_by_side_undoes_a_drift_that_the_runs_own_timings_show() -> None:
    """The runs timed the control while the node was fast (its best reads 150) and the
    trained run while it was slow (100); timed again side by side on a node that speeds up
    by half between each timing, the trained arm's kernel, 20 % faster, comes out ahead."""
    true_speed = {"/* t */": 60.0, "/* c */": 50.0, "/* c2 */": 20.0}
    trained, control = (
        [child("trained", "t", 100.0)],
        [
            child("lr 0", "c", 150.0),
            child("lr 0", "c2", 60.0),
        ],
    )
    calls: list[str] = []

    def node_speed() -> float:
        return 1.0 + 0.5 * len(calls)

    def time_child(c: Any) -> float:
        value = true_speed[c.source] * node_speed()
        calls.append(c.source)
        return value

    def time_reference() -> float:
        value = 90.0 * node_speed()
        calls.append("openblas")
        return value

    retimed = retime([trained, control], time_child, time_reference, rounds=3)
    assert len(calls) == 3 * 4
    assert retimed.best["trained"] > retimed.best["lr 0"]
    assert retimed.medians[control[1]] < retimed.medians[control[0]]
    assert retimed.reference is not None and retimed.reference > 90.0


def test_a_kernel_that_fails_when_timed_again_has_no_median() -> None:
    trained, control = [child("trained", "t")], [child("lr 0", "c")]
    flaky = iter([12.0, None, 14.0])
    retimed = retime(
        [trained, control],
        lambda c: None if c.group == "lr 0" else next(flaky),
        lambda: None,
        rounds=3,
    )
    assert retimed.best == {"trained": 13.0, "lr 0": None}
    assert retimed.reference is None
