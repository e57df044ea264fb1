"""Checking one call's output against the reference, the same way for every task.

A harness description (``harnesses.Harness``) computes, before the run, what each job's
output must hold (``Expected``): the reference at the task's check points (the paper's
corners, centre and random positions) and, for the stricter full check, the whole reference
and the denominators of the relative error. ``check_expected`` then reads each output as it
arrives. Relative error |out - ref| / scale, where the scale is |ref| floored at 1e-3 of the
size of the terms that were summed into the element (cancellation can make |ref| tiny; a
correct kernel that sums in another order must never fail there).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

Points = tuple[np.ndarray, ...]  # index arrays, one per dimension of the output


@dataclass(frozen=True)
class Names:
    """How the messages name a task's arrays."""

    output: str  # "C"
    inputs: str  # "A or B"
    arrays: str  # "A, B or C"
    full_check: str  # "full-matrix check"
    points: str  # whose check points: "the paper's"


@dataclass(frozen=True)
class Expected:
    """What one job's output must hold, computed before the run (the inputs and the points
    depend only on the seed and the trusted process's own generator)."""

    points: Points
    values: np.ndarray  # the reference at the points: the paper's check points
    scale: np.ndarray  # the denominator of the relative error at each point
    names: Names
    full: np.ndarray | None = None  # the whole reference
    # The full check's denominators at these elements (with ``full``).
    scales: Callable[[Points], np.ndarray] | None = None
    # The last check_expected: (output, tolerance, message); an output is checked as it
    # arrives, and its frame's verdict, asked for later, is this one.
    checked: list[tuple[np.ndarray, float, str]] = field(
        default_factory=list, compare=False, repr=False
    )
    # tolerance x |full|, computed with the reference (``with_bound``), for that tolerance
    # only: the full check of a right output is then one pass, in cached blocks.
    bound: np.ndarray | None = field(default=None, compare=False, repr=False)
    bound_tolerance: float | None = None


# Elements per block of the full check's passes: its temporaries stay in the L2 cache.
BLOCK = 16384


def with_bound(expected: Expected, tolerance: float) -> Expected:
    """``expected`` with tolerance x |full| computed now (in the background, before the run)
    rather than in the run's check of each output: the same bits as ``_check`` computes."""
    full = expected.full
    if full is None:
        return expected
    bound = np.empty_like(full)
    flat, out = full.reshape(-1), bound.reshape(-1)
    for start in range(0, flat.size, BLOCK):
        part = out[start : start + BLOCK]
        np.abs(flat[start : start + BLOCK], out=part)
        part *= tolerance
    return dataclasses.replace(expected, bound=bound, bound_tolerance=tolerance, checked=[])


def _all_within(out: np.ndarray, full: np.ndarray, bound: np.ndarray) -> bool:
    """Whether |out - full| <= bound everywhere (NaN is not), in blocks that stay in cache:
    the result of the whole-array expression, without its three 8 MB temporaries."""
    o, f, b = out.reshape(-1), full.reshape(-1), bound.reshape(-1)
    n = min(o.size, BLOCK)
    difference, fine = np.empty(n), np.empty(n, dtype=bool)
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, o.size, BLOCK):
            stop = min(o.size, start + BLOCK)
            d, ok = difference[: stop - start], fine[: stop - start]
            np.subtract(o[start:stop], f[start:stop], out=d)
            np.abs(d, out=d)
            np.less_equal(d, b[start:stop], out=ok)
            if not ok.all():
                return False
    return True


def floored_scale(ref: np.ndarray, terms: np.ndarray) -> np.ndarray:
    """The denominator: |ref|, floored at 1e-3 of ``terms`` (sum of |each term|)."""
    return np.maximum(np.maximum(np.abs(ref), 1e-3 * terms), 1e-300)


def sample_points(
    shape: tuple[int, ...], random_points: int, corners_and_centre: bool, rng: np.random.Generator
) -> Points:
    """The task's check points: every corner and the centre (a vector's ends and middle),
    then ``random_points`` positions drawn in the trusted process."""
    fixed: list[tuple[int, ...]] = []
    if corners_and_centre:
        corners = itertools.product(*[(0, n - 1) for n in shape])
        fixed = [*corners, tuple(n // 2 for n in shape)]
    drawn = [rng.integers(0, n, size=random_points) for n in shape]
    return tuple(
        np.concatenate(
            [
                np.fromiter((p[d] for p in fixed), dtype=np.intp, count=len(fixed)),
                drawn[d].astype(np.intp),
            ]
        )
        for d in range(len(shape))
    )


def element(name: str, index: tuple[int, ...]) -> str:
    return name + "".join(f"[{i}]" for i in index)


def _mismatch(got: float, want: float, error: float, tolerance: float, where: str) -> str:
    return (
        f"{where} = {got!r} but the reference gives {want!r} (relative error "
        f"{error:.3g} > {tolerance:g})"
    )


def check_expected(out: np.ndarray, expected: Expected, tolerance: float) -> str:
    """'' if the output is right, else why not.

    First the task's points (the paper's check: 4 corners, centre, 100 random positions),
    then, stricter than the paper, every element against the whole reference. NaN (the
    output starts as NaN: an element never written) fails.
    """
    for seen, at, message in expected.checked:
        if seen is out and at == tolerance:
            return message
    message = _check(out, expected, tolerance)
    expected.checked[:] = [(out, tolerance, message)]
    return message


def _check(out: np.ndarray, expected: Expected, tolerance: float) -> str:
    names = expected.names
    got = out[expected.points]
    with np.errstate(invalid="ignore", over="ignore"):
        error = np.abs(got - expected.values) / expected.scale
    bad = ~(error <= tolerance)  # NaN fails too
    if bad.any():
        p = int(np.argmax(bad))
        index = tuple(int(axis[p]) for axis in expected.points)
        return _mismatch(
            float(got[p]),
            float(expected.values[p]),
            float(error[p]),
            tolerance,
            element(names.output, index),
        )
    full = expected.full
    if full is None:
        return _unwritten(out, names)
    bound = expected.bound if expected.bound_tolerance == tolerance else None
    if bound is not None and _all_within(out, full, bound):
        return ""
    with np.errstate(invalid="ignore", over="ignore"):
        difference = np.abs(out - full)
        # |ref| alone as the denominator is stricter, and enough everywhere but where |ref|
        # is tiny (~1e-8 of GEMM's elements at the reward size) or the output is wrong: the
        # term sizes are needed only there.
        fine = difference <= (tolerance * np.abs(full) if bound is None else bound)
    if fine.all():
        return ""
    if unwritten := _unwritten(out, names):
        return unwritten
    assert expected.scales is not None
    where = np.nonzero(~fine)
    with np.errstate(invalid="ignore", over="ignore"):
        error = difference[where] / expected.scales(where)
    wrong = int(np.count_nonzero(error > tolerance))
    if not wrong:
        return ""
    p = int(np.argmax(error))
    index = tuple(int(axis[p]) for axis in where)
    return (
        _mismatch(
            float(out[index]),
            float(full[index]),
            float(error[p]),
            tolerance,
            element(names.output, index),
        )
        + f"; {wrong} of {out.size} elements are wrong ({names.full_check}; "
        f"{names.points} {len(expected.values)} check points passed)"
    )


def _unwritten(out: np.ndarray, names: Names) -> str:
    unwritten = int(out.size - np.count_nonzero(np.isfinite(out)))
    if unwritten:
        return (
            f"{unwritten} of {out.size} elements of {names.output} were not written "
            "(still NaN) or not finite"
        )
    return ""
