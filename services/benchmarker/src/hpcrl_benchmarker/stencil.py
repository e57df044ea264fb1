"""The stencil harness's description (``harness/stencil.c``): one Jacobi sweep of the 5-point
Laplacian over an N x M grid, row-major, the boundary copied.

Inputs from the seed as the template makes them (u from the seed, values in [-1, 1)), the
reference with numpy in this trusted process (there is no library routine for it: the sweep is
four shifted views added), the check points (the grid's corners and centre, 100 random
points) and the full check's denominators.

FLOPs: 4 per interior point (three additions and the product by 0.25), 4 (N - 2)(M - 2) a
sweep; the boundary's copies are no FLOPs. Bytes a call must move at least: u read once and
v written once, 16 N M (a cache line of v is usually read before it is written, which makes
24 N M on the bus; the figure counts what the task needs, as STREAM counts its triad).

Why the task's tolerance (``stencil.toml``, 1e-6) is right for this arithmetic: an interior
element is 0.25 (n + s + w + e), three additions of values in [-1, 1) and a product by a
power of two, which is exact. Whatever the order of the additions, with or without FMA, and
whether the 0.25 is applied before or after them, the result errs by at most
gamma_3 = 3u / (1 - 3u) (u = 2^-53) of the terms' size 0.25 (|n| + |s| + |w| + |e|); the
denominator is |v| floored at 1e-3 of that size, so a correct kernel errs by less than
3.4e-13 of it, six orders under 1e-6 (the seed's order against numpy's: 0 at 5 seeds). A
boundary element is a copy: exact, or wrong. What is wrong errs far above it: a neighbour
dropped or taken twice moves v by ~0.125 against |v| ~ 0.3; a neighbour one element off
(the wrong row stride) likewise; single-precision arithmetic (each input rounded to float)
errs by ~1e-7 of the terms' size, which passes where |v| is large and fails where the sum
cancels: 1.7 % of the interior of the reward size, by up to 5.7-6.8e-5 (5 seeds;
tests/benchmarker/kernels/stencil/float_precision.c).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcrl_benchmarker import protocol
from hpcrl_benchmarker.harnesses import BLOCK, Harness, Layout, random_values
from hpcrl_benchmarker.verify import Expected, Names, Points, floored_scale, sample_points
from hpcrl_common.task import Sizes

NAMES = Names(output="v", inputs="u", arrays="u or v", full_check="full-grid check", points="the")


def inputs(sizes: Sizes, seed: int) -> tuple[np.ndarray, ...]:
    """u from the seed, made by the template's own code (``Harness.inputs``)."""
    return STENCIL.inputs(sizes, seed)


def numpy_inputs(sizes: Sizes, seed: int) -> tuple[np.ndarray]:
    """u from the seed with numpy, bit for bit the template's."""
    n, m = sizes["N"], sizes["M"]
    return (random_values(seed, n * m).reshape(n, m),)


def reference_into(u: np.ndarray, v: np.ndarray) -> None:
    """One sweep: v = u on the boundary, 0.25 (n + s + w + e) inside (added in that order).

    The interior rows as one flat range, in blocks of ``BLOCK`` elements (in cache, and
    contiguous: 2.5x faster than a block of rows' 2-D views, and than whole-grid passes):
    their first and last columns get sweep values there and are put back from u after.
    Every interior element sees the same operations in the same order: the same bits."""
    n, m = u.shape
    if n <= 2 or m <= 2:
        v[...] = u
        return
    flat_u, flat_v = u.reshape(-1), v.reshape(-1)
    for start in range(m + 1, n * m - m - 1, BLOCK):
        stop = min(n * m - m - 1, start + BLOCK)
        out = flat_v[start:stop]
        np.add(flat_u[start - m : stop - m], flat_u[start + m : stop + m], out=out)
        out += flat_u[start - 1 : stop - 1]
        out += flat_u[start + 1 : stop + 1]
        out *= 0.25
    v[0], v[-1] = u[0], u[-1]
    v[:, 0], v[:, -1] = u[:, 0], u[:, -1]


def reference(u: np.ndarray) -> np.ndarray:
    v = np.empty_like(u)
    reference_into(u, v)
    return v


def term_sizes(u: np.ndarray, points: Points) -> np.ndarray:
    """The size of the terms summed into v at ``points``: 0.25 (|n| + |s| + |w| + |e|)
    inside, |u| on the boundary (a copy)."""
    i, j = points
    n, m = u.shape
    inside = (i > 0) & (i < n - 1) & (j > 0) & (j < m - 1)
    sizes = np.abs(u[i, j])
    a, b = i[inside], j[inside]
    sizes[inside] = 0.25 * (
        np.abs(u[a - 1, b]) + np.abs(u[a + 1, b]) + np.abs(u[a, b - 1]) + np.abs(u[a, b + 1])
    )
    return sizes


@dataclass(frozen=True)
class _Scales:
    """The full check's denominators where |ref| alone fails (a wrong kernel's elements, in
    practice): u made again from the seed, so that a job's whole grid is not kept."""

    job: protocol.Job
    full: np.ndarray

    def __call__(self, points: Points) -> np.ndarray:
        (u,) = inputs(self.job.sizes, self.job.seed)
        return floored_scale(self.full[points], term_sizes(u, points))


class Stencil(Harness):
    name = "stencil"
    dims = ("N", "M")
    names = NAMES
    routine = "numpy"
    timed_routine = False

    def output_shape(self, sizes: Sizes) -> tuple[int, ...]:
        return (sizes["N"], sizes["M"])

    def input_layout(self, sizes: Sizes) -> Layout:
        return ((np.float64, (sizes["N"], sizes["M"])),)

    def numpy_inputs(self, sizes: Sizes, seed: int) -> tuple[np.ndarray, ...]:
        return numpy_inputs(sizes, seed)

    def reference_into(self, inputs: tuple[np.ndarray, ...], out: np.ndarray) -> None:
        reference_into(inputs[0], out)

    def expect(
        self,
        job: protocol.Job,
        random_points: int,
        corners_and_centre: bool,
        rng: np.random.Generator,
    ) -> Expected:
        (u,) = inputs(job.sizes, job.seed)
        ref = reference(u)
        points = sample_points(ref.shape, random_points, corners_and_centre, rng)
        scale = floored_scale(ref[points], term_sizes(u, points))
        return Expected(points, ref[points], scale, NAMES, ref, _Scales(job, ref))

    def bytes_moved(self, sizes: Sizes) -> float:
        """u read once, v written once: 16 N M bytes."""
        return 16.0 * sizes["N"] * sizes["M"]


STENCIL = HARNESS = Stencil()
