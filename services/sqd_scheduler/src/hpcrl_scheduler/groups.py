"""Closing a group: one host class, rewards, the rollout batch, the children for the pool.

Pure functions over :class:`~hpcrl_common.messages.BenchResult` records.

Host classes: GFLOPS are only comparable between measurements from the same class of host.
Rule for a mixed group: the class with the most results is kept (ties: the class with more
successes, then the alphabetically first); results from other classes are excluded from the
rollout batch *and* from the pool, and counted. They are not re-benchmarked: the
benchmarkers are a shared work queue, so a re-run could land on the same minority host.

Rewards (``reward_mode``); a failure always keeps the benchmarker's penalty:

* ``raw`` (Experiment 1): success = GFLOPS;
* ``group_normalized`` (Experiment 2): success = GFLOPS / max GFLOPS of the kept results
  x ``success_scale`` (the paper's 100). GRPO's advantages are unchanged by scaling every
  reward at once, so the scale sets one thing: how much a group's fastest kernel outweighs
  the penalties of the failures beside it. At 100 a risky technique (OpenMP) that fails
  often loses to a safe slow one even where its successes are several times faster;
  a larger scale makes speed worth the risk in expectation (measured at 500 on the demo, it
  did not keep the fast kernels: README, Measurements). Any success still beats any failure;
* ``parent_relative`` (beyond the paper): success = 100 x GFLOPS / parent GFLOPS - 100, so
  a verbatim copy of the parent earns ~0 instead of a full reward, a 2x faster child +100.
  Successes are clamped to >= -9, above the mildest penalty (verification error, -10), so a
  correct program still beats any wrong one. A child whose normalised source equals the
  parent's gets exactly 0 whatever its timing noise. It applies when the parent is a success
  with GFLOPS measured on the group's host class (deepen, improve); other groups (seed,
  repair, a parent timed on another class of host) fall back to ``group_normalized``.

Rollout data: results without token data still become pool children; only samples with
rollout data go into the batch, and a group with none is not sent to the learner.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from hpcrl_common.messages import BenchResult, RolloutBatch, RolloutSample
from hpcrl_common.rewards import MAX_SUCCESS_SCALE
from hpcrl_scheduler.normalize import source_key

RewardMode = Literal["raw", "group_normalized", "parent_relative"]
# The paper's group_normalized: the group's fastest kernel earns 100.
PAPER_SUCCESS_SCALE = 100.0

# docs/SPEC.md section 4: the mildest failure penalty is verification_error, -10. A slow but correct
# child must still out-score every wrong one, so parent-relative successes stop just above.
PARENT_RELATIVE_FLOOR = -9.0
# A child 100x its parent is already a discovery; beyond it the ratio of a near-zero parent
# would dwarf every other reward in the step (and leave the wire format's bound).
PARENT_RELATIVE_CEILING = 9_900.0


@dataclass(frozen=True)
class Parent:
    """What ``parent_relative`` needs of the program a group expands (read from the pool)."""

    gflops: float | None  # None unless the parent was a success
    key: str  # normalize.source_key of its source
    host_class: str


@dataclass(frozen=True)
class ClosedGroup:
    kept: list[BenchResult]
    rewards: dict[str, float]  # candidate id -> reward, for the kept results
    excluded: list[BenchResult]  # other host classes
    host_class: str
    batch: RolloutBatch | None
    skipped_no_rollout: int  # kept results that had no rollout data

    @property
    def reward_mean(self) -> float | None:
        return sum(self.rewards.values()) / len(self.rewards) if self.rewards else None

    @property
    def reward_max(self) -> float | None:
        return max(self.rewards.values()) if self.rewards else None


def majority_class(results: Sequence[BenchResult]) -> str:
    counts = Counter(r.host.host_class for r in results)
    successes = Counter(r.host.host_class for r in results if r.status == "success")
    return min(counts, key=lambda c: (-counts[c], -successes[c], c))


def compute_rewards(
    results: Sequence[BenchResult],
    mode: RewardMode,
    parent: Parent | None = None,
    success_scale: float = PAPER_SUCCESS_SCALE,
) -> dict[str, float]:
    """Reward of each result; ``parent`` matters only in ``parent_relative`` mode,
    ``success_scale`` only where successes are group-normalised."""
    if not 0 < success_scale <= MAX_SUCCESS_SCALE:
        raise ValueError(f"success_scale {success_scale!r} outside (0, {MAX_SUCCESS_SCALE:g}]")
    score = _success_score(results, mode, parent, success_scale)
    return {r.id: score(r) if r.status == "success" else float(r.reward) for r in results}


def parent_relative_reward(gflops: float, parent_gflops: float) -> float:
    # The ratio first: equal speeds give exactly 0 and a slower child is always below 0.
    relative = 100.0 * (gflops / parent_gflops - 1.0)
    return min(PARENT_RELATIVE_CEILING, max(PARENT_RELATIVE_FLOOR, relative))


def _success_score(
    results: Sequence[BenchResult], mode: RewardMode, parent: Parent | None, scale: float
) -> Callable[[BenchResult], float]:
    if mode == "raw":
        return lambda r: float(r.gflops or 0.0)
    if mode == "parent_relative" and parent is not None and _comparable(results, parent):
        return lambda r: _relative_to(r, parent)
    best = max((r.gflops or 0.0 for r in results if r.status == "success"), default=0.0)
    return lambda r: (r.gflops or 0.0) / best * scale if best > 0 else 0.0


def _comparable(results: Sequence[BenchResult], parent: Parent) -> bool:
    # GFLOPS from another class of host are not comparable (see the module docstring).
    return (
        parent.gflops is not None
        and parent.gflops > 0
        and all(r.host.host_class == parent.host_class for r in results)
    )


def _relative_to(result: BenchResult, parent: Parent) -> float:
    # A copy would otherwise be paid its timing noise, which GRPO would learn to chase.
    if result.source is not None and source_key(result.source) == parent.key:
        return 0.0
    return parent_relative_reward(result.gflops or 0.0, parent.gflops or 1.0)


def close_group(
    group_id: str,
    results: Sequence[BenchResult],
    *,
    experiment: str,
    iteration: int,
    reward_mode: RewardMode,
    parent: Parent | None = None,
    success_scale: float = PAPER_SUCCESS_SCALE,
) -> ClosedGroup:
    """Everything that follows from the results a group got (any order, no duplicates)."""
    ordered = sorted(results, key=lambda r: r.index)
    if not ordered:
        return ClosedGroup([], {}, [], "", None, 0)
    host_class = majority_class(ordered)
    kept = [r for r in ordered if r.host.host_class == host_class]
    excluded = [r for r in ordered if r.host.host_class != host_class]
    rewards = compute_rewards(kept, reward_mode, parent, success_scale)
    with_rollout = [r for r in kept if r.rollout is not None]
    batch = None
    if with_rollout:
        samples = [
            RolloutSample(
                candidate_id=r.id,
                completion_token_ids=r.rollout.completion_token_ids,  # type: ignore[union-attr]
                sampling_logprobs=r.rollout.sampling_logprobs,  # type: ignore[union-attr]
                policy_version=r.rollout.policy_version,  # type: ignore[union-attr]
                reward=rewards[r.id],
                status=r.status,
                # The benchmarker's hash of the text it judged: the learner checks the
                # generator's token ids against it.
                completion_sha256=r.completion_sha256,
            )
            for r in with_rollout
        ]
        batch = RolloutBatch(
            id=group_id,
            experiment=experiment,
            iteration=iteration,
            prompt_token_ids=with_rollout[0].rollout.prompt_token_ids,  # type: ignore[union-attr]
            samples=samples,
            reward_mode=reward_mode,
            host_class=host_class,
        )
    return ClosedGroup(kept, rewards, excluded, host_class, batch, len(kept) - len(with_rollout))
