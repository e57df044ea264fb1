"""Paired bootstrap confidence intervals of gains (pure numpy, seeded).

Two versions of the policy answer the same prompts with the same sampling seeds, so sample i
of prompt p under version 0 and under the final version form a pair: resampling pairs (not
each version on its own) keeps the shared randomness out of the interval. Resampling is
stratified by prompt, because the evaluation set is fixed: only the samples are random, not
the mix of prompts.

One routine covers every comparison: a linear *contrast* of a statistic over several aligned
arms, e.g. ``final - v0`` (weights -1, +1) or the difference in differences of two training
arms, ``(T_final - T_v0) - (B_final - B_v0)`` (weights -1, +1, +1, -1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

Statistic = Literal["mean", "max"]
RESAMPLES = 2000
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap confidence interval [low, high]."""

    estimate: float
    low: float
    high: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def to_json(self) -> dict[str, float]:
        return {"gain": self.estimate, "low": self.low, "high": self.high}


def _aligned(arms: Sequence[ArrayLike]) -> np.ndarray:
    data = np.asarray([np.asarray(arm, dtype=float) for arm in arms])
    if data.ndim != 2 or data.shape[1] == 0:
        raise ValueError("every arm must be a non-empty 1-d sequence, all of one length")
    if not np.all(np.isfinite(data)):
        raise ValueError("arms must be finite")
    return data


def _strata_members(strata: ArrayLike | None, n: int) -> list[np.ndarray]:
    if strata is None:
        return [np.arange(n)]
    labels = np.asarray(strata)
    if labels.shape != (n,):
        raise ValueError(f"strata must have one label per pair ({n}), got {labels.shape}")
    return [np.flatnonzero(labels == label) for label in np.unique(labels)]


def resample_indices(
    n: int, resamples: int, seed: int, strata: ArrayLike | None = None
) -> np.ndarray:
    """(resamples, n) pair indices drawn with replacement, within each stratum."""
    rng = np.random.default_rng(seed)
    columns = [
        members[rng.integers(0, len(members), size=(resamples, len(members)))]
        for members in _strata_members(strata, n)
    ]
    return np.concatenate(columns, axis=1)


def _apply(statistic: Statistic, values: np.ndarray) -> np.ndarray:
    if statistic == "mean":
        return values.mean(axis=-1)
    if statistic == "max":
        return values.max(axis=-1)
    raise ValueError(f"statistic must be 'mean' or 'max', got {statistic!r}")


def contrast(
    arms: Sequence[ArrayLike],
    weights: Sequence[float],
    *,
    statistic: Statistic = "mean",
    strata: ArrayLike | None = None,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> Interval:
    """sum_j weights[j] * statistic(arms[j]), with a percentile bootstrap interval.

    ``arms`` are aligned: element i of every arm belongs to the same pair (same prompt, same
    sample index, same seed); resampling draws whole pairs.
    """
    data = _aligned(arms)
    w = np.asarray(weights, dtype=float)
    if w.shape != (data.shape[0],):
        raise ValueError(f"{data.shape[0]} arms but {w.shape} weights")
    if resamples < 1 or not 0.0 < level < 1.0:
        raise ValueError("resamples must be >= 1 and level in (0, 1)")
    estimate = float(w @ _apply(statistic, data))
    idx = resample_indices(data.shape[1], resamples, seed, strata)
    # data[:, idx] is (arms, resamples, n): every arm sees the same resampled pairs.
    draws = w @ _apply(statistic, data[:, idx])
    tail = (1.0 - level) / 2.0
    low, high = (float(q) for q in np.quantile(draws, [tail, 1.0 - tail]))
    # A resampled mean can come back a rounding error away from the same value computed in
    # another order; an interval must not exclude its own estimate for that reason alone.
    if _near(low, estimate):
        low = min(low, estimate)
    if _near(high, estimate):
        high = max(high, estimate)
    return Interval(estimate, low, high)


def _near(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def paired_gain(before: ArrayLike, after: ArrayLike, **options) -> Interval:
    """statistic(after) - statistic(before) over paired samples, with its interval."""
    return contrast([before, after], [-1.0, 1.0], **options)


def gain_difference(
    treated_before: ArrayLike,
    treated_after: ArrayLike,
    control_before: ArrayLike,
    control_after: ArrayLike,
    **options,
) -> Interval:
    """(treated gain) - (control gain), all four arms paired sample by sample."""
    return contrast(
        [treated_before, treated_after, control_before, control_after],
        [-1.0, 1.0, 1.0, -1.0],
        **options,
    )
