"""Reward modes on hand-computed groups, and the invariants every mode must keep."""

from __future__ import annotations

from typing import get_args

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpcrl_common.rewards import MAX_ABS_REWARD, MAX_SUCCESS_SCALE, REWARD_RANGES
from hpcrl_scheduler.groups import (
    PARENT_RELATIVE_CEILING,
    PARENT_RELATIVE_FLOOR,
    Parent,
    RewardMode,
    close_group,
    compute_rewards,
    parent_relative_reward,
)
from hpcrl_scheduler.normalize import source_key

from .helpers import PENALTY, needs_contract, result

G = "exp.s0.t1.g0001"
PARENT_SOURCE = "void f(double *c) { /* parent */ c[0] = 1.0; }"
HOST = "x86-avx512"
MODES: tuple[RewardMode, ...] = get_args(RewardMode)


def parent(gflops: float | None = 20.0, host_class: str = HOST) -> Parent:
    return Parent(gflops=gflops, key=source_key(PARENT_SOURCE), host_class=host_class)


def mixed_group():
    return [
        result(G, 0, gflops=10.0, source="int a;"),
        result(G, 1, gflops=40.0, source="int b;"),
        result(G, 2, gflops=25.0, source="int c;"),
        result(G, 3, gflops=19.0, source="int d;"),
        result(G, 4, "compile_error"),
        result(G, 5, "verification_error"),
    ]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("raw", [10.0, 40.0, 25.0, 19.0, -40.0, -10.0]),
        ("group_normalized", [25.0, 100.0, 62.5, 47.5, -40.0, -10.0]),
        # parent at 20 GFLOPS: 100 x g / 20 - 100; 10 GFLOPS would be -50, clamped to -9
        ("parent_relative", [-9.0, 100.0, 25.0, -5.0, -40.0, -10.0]),
    ],
)
def test_each_mode_on_the_same_group(mode: RewardMode, expected: list[float]):
    rewards = compute_rewards(mixed_group(), mode, parent())
    assert [rewards[f"{G}/{i}"] for i in range(6)] == pytest.approx(expected)


def test_the_success_scale_weighs_speed_against_the_penalties_and_nothing_else():
    """At the paper's 100, kernels that succeed one time in four at 8x the speed lose to
    safe ones that always succeed; at 400 they win. Failures keep their penalty."""
    risky = [result(G, 0, gflops=40.0), *(result(G, i, "timeout") for i in (1, 2, 3))]
    safe = [result(G, i, gflops=5.0) for i in (4, 5, 6, 7)]
    group = risky + safe

    def mean_by_arm(scale: float) -> tuple[float, float]:
        rewards = compute_rewards(group, "group_normalized", success_scale=scale)
        return tuple(sum(rewards[r.id] for r in arm) / len(arm) for arm in (risky, safe))

    assert mean_by_arm(100.0) == pytest.approx((2.5, 12.5))  # (100 - 3 x 30) / 4, 100 / 8
    assert mean_by_arm(400.0) == pytest.approx((77.5, 50.0))
    paper = compute_rewards(group, "group_normalized")
    scaled = compute_rewards(group, "group_normalized", success_scale=400.0)
    for r in group:
        expected = 4 * paper[r.id] if r.status == "success" else paper[r.id]
        assert scaled[r.id] == pytest.approx(expected)
    assert max(scaled.values()) <= REWARD_RANGES["group_normalized"][1]
    # parent_relative keeps its own scale; it falls back to the scaled group_normalized
    assert compute_rewards(group, "parent_relative", None, 400.0) == scaled
    with pytest.raises(ValueError, match="success_scale"):
        compute_rewards(group, "group_normalized", success_scale=MAX_SUCCESS_SCALE * 2)
    with pytest.raises(ValueError, match="success_scale"):
        compute_rewards(group, "group_normalized", success_scale=0.0)


def test_a_copy_of_the_parent_earns_nothing_whatever_its_timing():
    reformatted = "void f(double*c){\n  c[0] = 1.0;  // the same program\n}"
    assert source_key(reformatted) == source_key(PARENT_SOURCE)
    results = [
        result(G, 0, gflops=23.0, source=reformatted),  # noise: +15 if not a copy
        result(G, 1, gflops=11.0, source=PARENT_SOURCE),  # noise: -45, clamped -9
        result(G, 2, "timeout", source=PARENT_SOURCE),  # a failed copy keeps its penalty
        result(G, 3, gflops=30.0, source="int other;"),
    ]
    rewards = compute_rewards(results, "parent_relative", parent())
    assert rewards == {f"{G}/0": 0.0, f"{G}/1": 0.0, f"{G}/2": -30.0, f"{G}/3": 50.0}


@pytest.mark.parametrize(
    "missing",
    [
        None,  # no parent known
        parent(gflops=None),  # repair: the parent failed
        parent(gflops=0.0),  # nothing to divide by
        parent(host_class="x86-avx2"),  # timed on another class of host: not comparable
    ],
)
def test_without_a_comparable_parent_gflops_it_is_group_normalized(missing: Parent | None):
    results = mixed_group()
    assert compute_rewards(results, "parent_relative", missing) == compute_rewards(
        results, "group_normalized"
    )


def test_the_parent_does_not_change_the_papers_modes():
    results = mixed_group()
    for mode in ("raw", "group_normalized"):
        assert compute_rewards(results, mode, parent()) == compute_rewards(results, mode)


gflops = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)
positive_gflops = st.floats(min_value=1e-3, max_value=1e4, allow_nan=False)


@given(child=gflops | st.floats(0.0, 1e6), base=positive_gflops)
def test_parent_relative_sign_floor_and_ceiling(child: float, base: float):
    reward = parent_relative_reward(child, base)
    assert reward >= PARENT_RELATIVE_FLOOR > max(PENALTY.values())
    assert reward <= PARENT_RELATIVE_CEILING < MAX_ABS_REWARD  # a near-zero parent stays sane
    assert (reward < 0) == (child < base)


outcomes = st.one_of(st.sampled_from(sorted(PENALTY)), gflops)


@given(
    outcomes=st.lists(outcomes, min_size=1, max_size=16),
    mode=st.sampled_from(MODES),
    base=st.none() | positive_gflops,
    copies=st.lists(st.booleans(), min_size=16, max_size=16),
    scale=st.floats(min_value=1e-3, max_value=MAX_SUCCESS_SCALE),
)
def test_any_correct_program_beats_any_wrong_one(outcomes, mode, base, copies, scale):
    results = [
        result(G, i, "success", o, source=PARENT_SOURCE if copies[i] else f"int v{i};")
        if isinstance(o, float)
        else result(G, i, o)
        for i, o in enumerate(outcomes)
    ]
    rewards = compute_rewards(results, mode, parent(base), scale)
    successes = [rewards[r.id] for r in results if r.status == "success"]
    failures = [rewards[r.id] for r in results if r.status != "success"]
    assert min(successes, default=0.0) > max(failures, default=-10.0)
    assert failures == [PENALTY[r.status] for r in results if r.status != "success"]


@needs_contract
def test_a_closed_group_carries_parent_relative_rewards_in_its_batch():
    results = [
        result(G, 1, gflops=30.0, source="int b;"),
        result(G, 0, gflops=21.0, source=PARENT_SOURCE),
        result(G, 2, "runtime_error"),
    ]
    closed = close_group(
        G, results, experiment="exp", iteration=1, reward_mode="parent_relative", parent=parent()
    )
    assert closed.batch is not None and closed.batch.reward_mode == "parent_relative"
    assert [s.reward for s in closed.batch.samples] == [0.0, 50.0, -20.0]
