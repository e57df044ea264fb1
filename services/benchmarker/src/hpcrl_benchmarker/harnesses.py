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
import hashlib
import importlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import structlog

from hpcrl_benchmarker.exitcodes import harness_defines
from hpcrl_benchmarker.host import openblas_coretype
from hpcrl_benchmarker.protocol import Job
from hpcrl_benchmarker.verify import Expected, Names
from hpcrl_common.task import Sizes, TaskSpec, is_template_path

GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: word k is mix(seed + k * GOLDEN)
_GOLDEN = np.uint64(GOLDEN)
_MASK64 = (1 << 64) - 1
# The second input's seed is the job's seed xor this (the templates use the same constant).
SECOND_SALT = 0x5DEECE66DA3B1F7F
CBLAS_ROW_MAJOR, CBLAS_NO_TRANS = 101, 111
# Set to 1: the parent makes every input with numpy (the ``numpy_inputs`` of each task), not
# with the template's own code (``native_inputs``); the tests compare the two.
NUMPY_INPUTS_ENV = "HPCRL_NUMPY_INPUTS"

log = structlog.get_logger("hpcrl.benchmarker")


# Elements per block of the generators below: their arrays (a block's words, one temporary,
# its share of the output) stay in the L2 cache, where whole-array passes over 8 MB went to
# memory once per operation (13 of them): 2-3x faster on a shared 2-core node.
BLOCK = 16384


def random_words(seed: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
    """The splitmix64 words mix(seed + k * golden), k = 1 .. count, as uint64: the harness's
    ``draw`` (the integers behind ``fill``'s values, and SpMV's structure). Made in blocks
    of ``BLOCK`` (in cache), into ``out`` if given."""
    words = np.empty(count, dtype=np.uint64) if out is None else out
    assert words.dtype == np.uint64 and words.shape == (count,)
    step = np.arange(1, min(count, BLOCK) + 1, dtype=np.uint64)
    tmp = np.empty_like(step)
    with np.errstate(over="ignore"):
        step *= _GOLDEN
        for start in range(0, count, BLOCK):
            stop = min(count, start + BLOCK)
            mix_block(seed + start * GOLDEN, step[: stop - start], words[start:stop], tmp)
    return words


def mix_block(base: int, step: np.ndarray, z: np.ndarray, tmp: np.ndarray) -> None:
    """z = mix(base + step), where step holds k * golden (k = 1, 2, ...), mod 2^64."""
    t = tmp[: len(z)]
    np.add(step, np.uint64(base & _MASK64), out=z)
    np.right_shift(z, np.uint64(30), out=t)
    z ^= t
    z *= np.uint64(0xBF58476D1CE4E5B9)
    np.right_shift(z, np.uint64(27), out=t)
    z ^= t
    z *= np.uint64(0x94D049BB133111EB)
    np.right_shift(z, np.uint64(31), out=t)
    z ^= t


def random_values(seed: int, count: int) -> np.ndarray:
    """splitmix64 values in [-1, 1), bit-identical to the harness's ``fill``: (z >> 11) 2^-52
    - 1, exactly. In blocks of ``BLOCK`` words (in cache): ~12 ms for GEMV's 1 M values
    on this loaded 2-core node, against 27-30 ms with whole-array passes (and 40+ ms with a
    new array per step)."""
    values = np.empty(count, dtype=np.float64)
    n = min(count, BLOCK)
    step = np.arange(1, n + 1, dtype=np.uint64)
    z, tmp = np.empty_like(step), np.empty_like(step)
    with np.errstate(over="ignore"):
        step *= _GOLDEN
        for start in range(0, count, BLOCK):
            stop = min(count, start + BLOCK)
            w = z[: stop - start]
            mix_block(seed + start * GOLDEN, step[: stop - start], w, tmp)
            w >>= np.uint64(11)
            v = values[start:stop]
            v[...] = w
            v *= 2.0**-52
            v -= 1.0
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


# (dtype, shape) of each input, in the template's order.
Layout = tuple[tuple[type[np.generic], tuple[int, ...]], ...]

_NATIVE: dict[str, ctypes.CDLL | None] = {}
_NATIVE_LOCK = threading.Lock()


def native_library(name: str) -> ctypes.CDLL | None:
    """The template ``harness/<name>.c`` with ``harness.h``, compiled once per process with
    -DHARNESS_INPUTS_ONLY as a shared library of its own ``fill_inputs`` (no kernel, no main:
    trusted code only), or None where it cannot be built (no compiler; ``NUMPY_INPUTS_ENV``):
    the inputs are then numpy's, the same bits, slower."""
    with _NATIVE_LOCK:
        if name not in _NATIVE:
            _NATIVE[name] = None if os.environ.get(NUMPY_INPUTS_ENV) == "1" else _build(name)
        return _NATIVE[name]


def _build(name: str, march: str = "native") -> ctypes.CDLL | None:
    """The template's library for this CPU (``march``: another target, for the tests of a
    template's code paths that this CPU would not take)."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    try:
        template = Template.of(name)
    except HarnessError:
        return None
    if compiler is None:
        return None
    # A private directory (0700), removed as soon as the library is mapped.
    with tempfile.TemporaryDirectory(prefix="hpcrl-inputs-") as directory:
        template.write(Path(directory))
        stem = template.stem
        library = Path(directory) / f"lib{stem}-inputs.so"
        command = [
            compiler,
            "-O2",
            f"-march={march}",
            "-fopenmp-simd",  # the templates' `omp simd` loops, without OpenMP's runtime
            "-shared",
            "-fPIC",
            "-fvisibility=hidden",
            "-DHARNESS_INPUTS_ONLY",
            *harness_defines(),
            f"{stem}.c",
            "-o",
            str(library),
        ]
        try:
            subprocess.run(command, cwd=directory, check=True, capture_output=True, timeout=120)
            lib = ctypes.CDLL(str(library))
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning(
                "inputs made with numpy: the template's fill did not build",
                harness=name,
                error=str(exc)[:500],
            )
            return None
    lib.hpcrl_inputs.restype = ctypes.c_int
    lib.hpcrl_dims.restype = ctypes.c_int
    lib.hpcrl_max_dim.restype = ctypes.c_long
    lib.hpcrl_input_bytes.restype = ctypes.c_size_t
    lib.hpcrl_input_bytes.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.hpcrl_output_count.restype = ctypes.c_size_t
    lib.hpcrl_output_count.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.hpcrl_fill_inputs.restype = None
    lib.hpcrl_fill_inputs.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_int),
        ctypes.c_uint64,
    ]
    if hasattr(lib, "hpcrl_reference"):
        lib.hpcrl_reference.restype = None
        lib.hpcrl_reference.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_double),
        ]
    return lib


def native_inputs(
    name: str, dims: Sequence[int], layout: Layout, seed: int
) -> tuple[np.ndarray, ...] | None:
    """The inputs of one job made by the template's own ``fill_inputs`` (``native_library``)
    into arrays of ``layout``, or None where there is no library or the sizes are not ones
    the harness takes (it would refuse the job line). A layout whose byte sizes are not the
    template's is a bug: refused. ctypes lets go of the GIL during the fill."""
    lib = native_library(name)
    if lib is None or len(dims) != lib.hpcrl_dims() or len(layout) != lib.hpcrl_inputs():
        return None
    if not all(isinstance(d, int) and 1 <= d <= lib.hpcrl_max_dim() for d in dims):
        return None
    sizes = (ctypes.c_int * len(dims))(*dims)
    arrays = tuple(np.empty(shape, dtype=dtype) for dtype, shape in layout)
    for i, array in enumerate(arrays):
        if array.nbytes != lib.hpcrl_input_bytes(i, sizes):
            raise HarnessError(f"harness {name!r}: input {i} has another size in its template")
    pointers = (ctypes.c_void_p * len(arrays))(*(a.ctypes.data for a in arrays))
    lib.hpcrl_fill_inputs(pointers, sizes, ctypes.c_uint64(seed & _MASK64))
    return arrays


def native_reference(
    name: str, dims: Sequence[int], inputs: Sequence[np.ndarray], out: np.ndarray
) -> bool:
    """The template's own reference (``HARNESS_REFERENCE``) on ``inputs``, written into
    ``out``; False where the template has none or its library did not build (the
    description's numpy reference is then used). The inputs must be what ``fill_inputs``
    makes for ``dims`` (the reference trusts their structure, as the kernel's call does).
    ctypes lets go of the GIL during the call."""
    lib = native_library(name)
    if lib is None or not hasattr(lib, "hpcrl_reference") or len(dims) != lib.hpcrl_dims():
        return False
    if len(inputs) != lib.hpcrl_inputs():
        raise HarnessError(f"harness {name!r}: {lib.hpcrl_inputs()} inputs, not {len(inputs)}")
    sizes = (ctypes.c_int * len(dims))(*dims)
    for i, array in enumerate(inputs):
        if not array.flags.c_contiguous or array.nbytes != lib.hpcrl_input_bytes(i, sizes):
            raise HarnessError(f"harness {name!r}: input {i} is not its template's")
    if (
        out.dtype != np.float64
        or not out.flags.c_contiguous
        or out.size != lib.hpcrl_output_count(sizes)
    ):
        raise HarnessError(f"harness {name!r}: the reference writes its output's doubles")
    pointers = (ctypes.c_void_p * len(inputs))(*(a.ctypes.data for a in inputs))
    lib.hpcrl_reference(pointers, sizes, pointer(out))
    return True


class HarnessError(ValueError):
    """A task that its harness cannot run (unknown harness, sizes it does not take)."""


class Harness(ABC):
    """One harness template's description (see the module's docstring)."""

    # The task's `harness`: a built-in template harness/<name>.c, or a task's own template's
    # path (set when its description is loaded).
    name: str
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

    def inputs(self, sizes: Sizes, seed: int) -> tuple[np.ndarray, ...]:
        """The inputs the template fills from ``seed``, bit for bit: made by the template's
        own code where it builds (``native_inputs``), else by ``numpy_inputs``."""
        layout = self.input_layout(sizes)
        if layout is not None:
            made = native_inputs(self.name, [sizes[d] for d in self.dims], layout, seed)
            if made is not None:
                return made
        return self.numpy_inputs(sizes, seed)

    def input_layout(self, sizes: Sizes) -> Layout | None:
        """(dtype, shape) of each input, in the template's order; None: numpy makes them."""
        return None

    @abstractmethod
    def numpy_inputs(self, sizes: Sizes, seed: int) -> tuple[np.ndarray, ...]:
        """The same inputs made with numpy (the template's arithmetic written again)."""

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
        lib = native_library(self.name)
        largest = max(
            n for sizes in (task.sizes.reward, *task.sizes.verify) for n in sizes.values()
        )
        if lib is not None and largest > lib.hpcrl_max_dim():
            raise HarnessError(
                f"task {task.name!r}: size {largest} is above its harness's MAX_DIM "
                f"({lib.hpcrl_max_dim()}; a template defines MAX_DIM before harness.h)"
            )
        if task.reference != self.routine:
            raise HarnessError(
                f"task {task.name!r}: harness {self.name!r} verifies against "
                f"{self.routine}, not {task.reference}"
            )


@dataclass(frozen=True)
class Template:
    """A harness's C source: the template and the headers it includes (``harness.h``, the
    package's), for a built-in harness's name or a task's own template path."""

    stem: str  # the file name without .c: what the compiled files are called
    text: bytes
    headers: dict[str, bytes]

    @classmethod
    def of(cls, name: str) -> Template:
        package = resources.files("hpcrl_benchmarker.harness")
        headers = {e.name: e.read_bytes() for e in package.iterdir() if e.name.endswith(".h")}
        if is_template_path(name):
            path = Path(name)
            if not path.is_file():
                raise HarnessError(f"no harness template {name}")
            return cls(path.stem, path.read_bytes(), headers)
        template = package / f"{name}.c"
        if not template.is_file():
            raise HarnessError(f"no harness template {name!r}")
        return cls(name, template.read_bytes(), headers)

    def write(self, directory: Path) -> Path:
        """The template and its headers written into ``directory``; the template's path."""
        for header, body in self.headers.items():
            (directory / header).write_bytes(body)
        source = directory / f"{self.stem}.c"
        source.write_bytes(self.text)
        return source


# harness name -> the module whose HARNESS describes it
REGISTRY = {
    "gemm": "hpcrl_benchmarker.gemm",
    "gemv": "hpcrl_benchmarker.gemv",
    "stencil": "hpcrl_benchmarker.stencil",
    "spmv": "hpcrl_benchmarker.spmv",
}


_OWN: dict[str, Harness] = {}
_OWN_LOCK = threading.Lock()


def get(name: str) -> Harness:
    """A built-in harness by name, or a task's own by its template's path (``load_task``
    makes it absolute), described by the Python file beside it (``axpy.c``: ``axpy.py``,
    which defines ``HARNESS``)."""
    if is_template_path(name):
        return _own(name)
    module = REGISTRY.get(name)
    if module is None:
        raise HarnessError(f"no harness {name!r} (known: {', '.join(sorted(REGISTRY))})")
    harness = importlib.import_module(module).HARNESS
    assert isinstance(harness, Harness) and harness.name == name
    return harness


def _own(template: str) -> Harness:
    """The description of a task's own template, loaded once per process. It is the task
    author's code, run in this trusted process like the built-in descriptions."""
    with _OWN_LOCK:
        if template in _OWN:
            return _OWN[template]
        path = Path(template).with_suffix(".py")
        module_name = "hpcrl_task_harness_" + hashlib.sha256(template.encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None or not path.is_file():
            raise HarnessError(f"harness {template}: no description {path} beside it")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        harness = getattr(module, "HARNESS", None)
        if not isinstance(harness, Harness):
            raise HarnessError(f"{path} defines no HARNESS (a hpcrl_benchmarker Harness)")
        harness.name = template  # how jobs, the reference and the build find it again
        _OWN[template] = harness
        return harness


def for_task(task: TaskSpec) -> Harness:
    """The task's harness, having checked that it can run the task."""
    harness = get(task.harness)
    harness.check_task(task)
    return harness
