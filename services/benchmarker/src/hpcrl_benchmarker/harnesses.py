"""What the trusted parent knows of each harness: one small description per template.

A task names its harness (``harness = "gemv"``): the C template ``harness/<name>.c``, which
includes the part every task shares (``harness/harness.h``: the job protocol, fresh inputs
and a NaN-poisoned output per call, guard zones, the READY/go handshake, the seccomp
lock-down), and the Python description registered here (``gemm.py``, ``gemv.py``,
``stencil.py``, ``spmv.py``), which
says what is specific to the task: the sizes on a job's line, the output's shape, the inputs
(made from the seed exactly as the template makes them), the reference, and where and how
closely the output is checked. The pipeline, the runner and the checks know nothing else of
the task. A new kernel is a task TOML, a template of a few dozen lines and a description.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping

import numpy as np

from hpcrl_benchmarker.host import openblas_coretype
from hpcrl_benchmarker.protocol import Job
from hpcrl_benchmarker.verify import Expected, Names
from hpcrl_common.task import Sizes, TaskSpec

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# The second input's seed is the job's seed xor this (the templates use the same constant).
SECOND_SALT = 0x5DEECE66DA3B1F7F
CBLAS_ROW_MAJOR, CBLAS_NO_TRANS = 101, 111


def random_words(seed: int, count: int) -> np.ndarray:
    """The splitmix64 words mix(seed + k * golden), k = 1 .. count, as uint64: the harness's
    ``draw`` (the integers behind ``fill``'s values, and SpMV's structure). In place, one
    temporary."""
    with np.errstate(over="ignore"):
        z = np.arange(1, count + 1, dtype=np.uint64)
        z *= _GOLDEN
        z += np.uint64(seed)
        shifted = z >> np.uint64(30)
        z ^= shifted
        z *= np.uint64(0xBF58476D1CE4E5B9)
        np.right_shift(z, np.uint64(27), out=shifted)
        z ^= shifted
        z *= np.uint64(0x94D049BB133111EB)
        np.right_shift(z, np.uint64(31), out=shifted)
        z ^= shifted
    return z


def random_values(seed: int, count: int) -> np.ndarray:
    """splitmix64 values in [-1, 1), bit-identical to the harness's ``fill``. In place, one
    temporary: 9.5 ms for GEMV's 1 M values against 14.6 ms with a new array per step (the
    references of a candidate's ten jobs are computed while it compiles)."""
    z = random_words(seed, count)
    z >>= np.uint64(11)
    values = z.astype(np.float64)
    values *= 2.0**-52  # (z >> 11) * 2^-53 * 2, exactly
    values -= 1.0
    return values


_BLAS: ctypes.CDLL | None = None


def openblas() -> ctypes.CDLL:
    """OpenBLAS, loaded once with the kernels of the host's ISA, on one thread."""
    global _BLAS
    if _BLAS is None:
        name = ctypes.util.find_library("openblas") or "libopenblas.so.0"
        # Read once, when the library loads; an operator's own setting wins.
        core = openblas_coretype()
        if core is not None:
            os.environ.setdefault("OPENBLAS_CORETYPE", core)
        lib = ctypes.CDLL(name)
        lib.cblas_dgemm.restype = None
        lib.cblas_dgemv.restype = None
        # One thread: as fast at these sizes, and no OpenBLAS worker threads left spinning
        # on the cores a kernel is about to be timed on.
        if hasattr(lib, "openblas_set_num_threads"):
            lib.openblas_set_num_threads(1)
        _BLAS = lib
    return _BLAS


def pointer(array: np.ndarray) -> ctypes._Pointer[ctypes.c_double]:
    assert array.dtype == np.float64 and array.flags.c_contiguous
    return array.ctypes.data_as(ctypes.POINTER(ctypes.c_double))


class HarnessError(ValueError):
    """A task that its harness cannot run (unknown harness, sizes it does not take)."""


class Harness(ABC):
    """One harness template's description (see the module's docstring)."""

    name: str  # the task's `harness` and the template harness/<name>.c
    dims: tuple[str, ...]  # the sizes on a job's line, in the order the template reads them
    names: Names  # how messages name its arrays
    routine: str  # the reference routine, the task's `reference`
    # Whether that routine (an OpenBLAS call) is the task's performance reference, timed by
    # `check --reference`; a numpy reference (stencil, spmv) only verifies.
    timed_routine: bool = True

    def job(self, kind: str, sizes: Mapping[str, int], seed: int) -> Job:
        return Job(kind, dict(sizes), seed, self)

    @abstractmethod
    def output_shape(self, sizes: Sizes) -> tuple[int, ...]:
        """The shape of one call's output."""

    @abstractmethod
    def inputs(self, sizes: Sizes, seed: int) -> tuple[np.ndarray, ...]:
        """The inputs the template fills from ``seed``, bit for bit."""

    @abstractmethod
    def reference_into(self, inputs: tuple[np.ndarray, ...], out: np.ndarray) -> None:
        """The reference routine (OpenBLAS) on ``inputs``, written into ``out``."""

    @abstractmethod
    def expect(
        self, job: Job, random_points: int, corners_and_centre: bool, rng: np.random.Generator
    ) -> Expected:
        """What the job's output must hold: its check points and the whole reference."""

    def bytes_moved(self, sizes: Sizes) -> float | None:
        """Bytes a call must move at least (inputs read once, output written once), for
        the achieved bandwidth of a memory-bound task; None where it says little."""
        return None

    def check_task(self, task: TaskSpec) -> None:
        """Refuse a task this harness cannot run."""
        for sizes in (task.sizes.reward, *task.sizes.verify):
            if sorted(sizes) != sorted(self.dims):
                raise HarnessError(
                    f"task {task.name!r}: harness {self.name!r} takes sizes "
                    f"{', '.join(self.dims)}, not {', '.join(sizes) or 'none'}"
                )
        if task.reference != self.routine:
            raise HarnessError(
                f"task {task.name!r}: harness {self.name!r} verifies against "
                f"{self.routine}, not {task.reference}"
            )


# harness name -> the module whose HARNESS describes it
REGISTRY = {
    "gemm": "hpcrl_benchmarker.gemm",
    "gemv": "hpcrl_benchmarker.gemv",
    "stencil": "hpcrl_benchmarker.stencil",
    "spmv": "hpcrl_benchmarker.spmv",
}


def get(name: str) -> Harness:
    module = REGISTRY.get(name)
    if module is None:
        raise HarnessError(f"no harness {name!r} (known: {', '.join(sorted(REGISTRY))})")
    harness = importlib.import_module(module).HARNESS
    assert isinstance(harness, Harness) and harness.name == name
    return harness


def for_task(task: TaskSpec) -> Harness:
    """The task's harness, having checked that it can run the task."""
    harness = get(task.harness)
    harness.check_task(task)
    return harness
