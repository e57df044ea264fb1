"""Closing a group: one host class, rewards, the rollout batch, the children for the pool.

Pure functions over :class:`~hpcrl_common.messages.BenchResult` records.

Host classes: GFLOPS are only comparable between measurements from the same class of host.
Rule for a mixed group: the class with the most results is kept (ties: the class with more
successes, then the alphabetically first); results from other classes are excluded from the
rollout batch *and* from the pool, and counted. They are not re-benchmarked: the
benchmarkers are a shared work queue, so a re-run could land on the same minority host.

Rewards (``reward_mode``):

* ``raw`` (Experiment 1): success = GFLOPS; a failure keeps the benchmarker's penalty;
* ``group_normalized`` (Experiment 2): success = GFLOPS / max GFLOPS of the kept results
  x 100; penalties unchanged.

Rollout data: results without token data still become pool children; only samples with
rollout data go into the batch, and a group with none is not sent to the learner.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from hpcrl_common.messages import BenchResult, RolloutBatch, RolloutSample

RewardMode = Literal["raw", "group_normalized"]


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


def compute_rewards(results: Sequence[BenchResult], mode: RewardMode) -> dict[str, float]:
    best = max((r.gflops or 0.0 for r in results if r.status == "success"), default=0.0)
    rewards: dict[str, float] = {}
    for result in results:
        if result.status != "success":
            rewards[result.id] = float(result.reward)
        elif mode == "raw":
            rewards[result.id] = float(result.gflops or 0.0)
        else:
            rewards[result.id] = (result.gflops or 0.0) / best * 100.0 if best > 0 else 0.0
    return rewards


def close_group(
    group_id: str,
    results: Sequence[BenchResult],
    *,
    experiment: str,
    iteration: int,
    reward_mode: RewardMode,
) -> ClosedGroup:
    """Everything that follows from the results a group got (any order, no duplicates)."""
    ordered = sorted(results, key=lambda r: r.index)
    if not ordered:
        return ClosedGroup([], {}, [], "", None, 0)
    host_class = majority_class(ordered)
    kept = [r for r in ordered if r.host.host_class == host_class]
    excluded = [r for r in ordered if r.host.host_class != host_class]
    rewards = compute_rewards(kept, reward_mode)
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
    return ClosedGroup(kept, rewards, excluded, host_class, batch,
                       len(kept) - len(with_rollout))
