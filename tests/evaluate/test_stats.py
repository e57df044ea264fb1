"""The paired bootstrap: cases computable by hand, and properties any correct one has."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcrl_evaluate.stats import (
    Interval,
    contrast,
    gain_difference,
    paired_gain,
    resample_indices,
)

finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)
samples = st.lists(finite, min_size=1, max_size=30)


def test_identical_arms_give_exactly_zero() -> None:
    values = [3.0, -10.0, 7.5, 0.0]
    assert paired_gain(values, values) == Interval(0.0, 0.0, 0.0)


def test_a_constant_difference_has_a_degenerate_interval() -> None:
    before = [0.1, 0.2, 0.3, 5.0]
    interval = paired_gain(before, [v + 0.7 for v in before])
    assert interval.estimate == pytest.approx(0.7)
    assert interval.low == pytest.approx(0.7) and interval.high == pytest.approx(0.7)
    assert interval.contains(interval.estimate)


def test_two_pairs_by_hand() -> None:
    # Differences (0, 1): a resampled mean is 0, 0.5 or 1 with probability 1/4, 1/2, 1/4,
    # so the 2.5 % and 97.5 % quantiles of 2,000 draws are 0 and 1; the estimate is 0.5.
    interval = paired_gain([0.0, 0.0], [0.0, 1.0])
    assert interval == Interval(0.5, 0.0, 1.0)


def test_pairing_removes_shared_variation() -> None:
    # Unpaired, these arms overlap completely; paired, every difference is exactly +1.
    before = [0.0, 100.0, 200.0, 300.0]
    after = [1.0, 101.0, 201.0, 301.0]
    assert paired_gain(before, after) == pytest.approx(Interval(1.0, 1.0, 1.0))


def test_max_statistic() -> None:
    interval = paired_gain([1.0, 2.0], [1.0, 5.0], statistic="max")
    assert interval.estimate == 3.0
    # A resample holds pair 0 only (max gain 0), pair 1 only (3) or both (3).
    assert (interval.low, interval.high) == (0.0, 3.0)


def test_strata_resample_within_each_stratum() -> None:
    idx = resample_indices(6, 500, seed=1, strata=[0, 0, 0, 1, 1, 1])
    assert idx.shape == (500, 6)
    assert np.all(idx[:, :3] < 3) and np.all(idx[:, 3:] >= 3)
    # With one pair per stratum nothing can vary: every resample is the sample itself.
    interval = paired_gain([0.0, 0.0], [0.0, 1.0], strata=[0, 1])
    assert interval == Interval(0.5, 0.5, 0.5)


def test_gain_difference_is_the_difference_of_gains() -> None:
    treated = paired_gain([0.0, 1.0, 2.0], [2.0, 3.0, 4.0])
    both = gain_difference([0.0, 1.0, 2.0], [2.0, 3.0, 4.0], [5.0, 5.0, 5.0], [5.5, 5.5, 5.5])
    assert both.estimate == pytest.approx(treated.estimate - 0.5)
    assert both.low == pytest.approx(1.5) and both.high == pytest.approx(1.5)


def test_seeded_and_checked() -> None:
    a, b = [0.0, 1.0, 5.0, 2.0], [1.0, 1.0, 0.0, 4.0]
    assert paired_gain(a, b, seed=3) == paired_gain(a, b, seed=3)
    with pytest.raises(ValueError):
        paired_gain([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        paired_gain([], [])
    with pytest.raises(ValueError):
        paired_gain([float("nan")], [1.0])
    with pytest.raises(ValueError):
        contrast([[1.0], [2.0]], [1.0])
    with pytest.raises(ValueError):
        paired_gain([1.0, 2.0], [1.0, 2.0], strata=[0])


@settings(max_examples=40, deadline=None)
@given(samples, st.data())
def test_properties(before: list[float], data: st.DataObject) -> None:
    after = data.draw(st.lists(finite, min_size=len(before), max_size=len(before)))
    options = {"resamples": 200, "seed": 7}
    interval = paired_gain(before, after, **options)
    differences = np.subtract(after, before)
    assert interval.estimate == pytest.approx(differences.mean(), abs=1e-9)
    assert interval.low <= interval.high
    # A mean of resampled differences lies between the smallest and largest difference.
    assert differences.min() - 1e-9 <= interval.low
    assert interval.high <= differences.max() + 1e-9
    # Swapping the versions negates the interval (same resamples, same seed).
    swapped = paired_gain(after, before, **options)
    assert swapped.estimate == pytest.approx(-interval.estimate, abs=1e-9)
    assert swapped.low == pytest.approx(-interval.high, abs=1e-6)
    assert swapped.high == pytest.approx(-interval.low, abs=1e-6)
    # Adding a constant to the final version shifts everything by it.
    shifted = paired_gain(before, [v + 10.0 for v in after], **options)
    assert shifted.low == pytest.approx(interval.low + 10.0, abs=1e-6)
    assert shifted.high == pytest.approx(interval.high + 10.0, abs=1e-6)
