"""Kernels of the tasks beyond GEMM (GEMV, the 5-point stencil, CSR SpMV) for the bootstrap.

Pure and seeded, like ``corpus`` (which renders the matrix-multiply kernels): a kernel is
rendered from a :class:`MotifSpec` by its task's module (``corpus_gemv``, ``corpus_stencil``,
``corpus_spmv``). The five techniques apply to every task: register blocking (unrolled
accumulators, several rows per pass; stage 1), cache blocking (tiles, row strips; stage 2),
AVX2/AVX-512 intrinsics (stage 3), OpenMP (stage 4), prefetch (stages 5 and 6). Every
kernel defines exactly its task's signature, handles any size (remainder loops, clamped
tiles) and overwrites its output. Mistakes exist only to make repair parents, each one the
benchmarker rejects (a row's last entry dropped, the boundary not copied, a stride mixed up).

:func:`corpus_for` gives the per-task functions the catalogue plans with: GEMM's from
``corpus`` itself (so its catalogue stays what it was), the others' from here.
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, Protocol

from hpcrl_bootstrap import corpus as cp
from hpcrl_bootstrap.corpus import (
    COMPILE_ERROR,
    NO_BOUNDARY,
    NO_ZERO,
    OFF_BY_ONE,
    STAGE_VIOLATION,
    WRONG_STRIDE,
    Kernel,
)
from hpcrl_common.stages import (
    CACHE_BLOCKING,
    OPENMP,
    PREFETCH,
    REGISTER_BLOCKING,
    SIMD,
)

# NO_BOUNDARY here leaves out the remainder (the last columns, rows, entries or the partial
# tile): a loop that ran past the end instead could read the harness's guard zones, whose
# zeros add nothing, and pass.
# Mistakes of these tasks besides corpus's (no race: on two cores a race shows only now and
# then, and a twin that passes teaches no repair).
SKIP_BOUNDARY_COPY = "skip_boundary_copy"  # stencil: the boundary points are never written
DROPS_LAST = "drops_last_entry"  # SpMV: k < end - 1, part of every row ignored
IGNORES_COL = "ignores_col"  # SpMV: x at the entry's position in the row, not at col[k]


@dataclass(frozen=True)
class MotifSpec:
    """Everything a GEMV, stencil or SpMV kernel's source is rendered from."""

    task: str
    form: str  # loop form (per task: see _TABLES)
    unroll: int = 1  # accumulators (scalar) or vectors (SIMD) per row in the inner loop
    rows: int = 1  # rows per pass of the outer loop (register blocking)
    tile: tuple[int, int] | None = None  # cache tile (rows, columns); SpMV: (row strip, 0)
    simd: str | None = None  # None, "avx2", "avx512"
    omp: str | None = None  # OpenMP schedule: "static", "dynamic", "guided"
    prefetch: tuple[str, int] | None = None  # ("mm" | "builtin", distance in elements)
    mistake: str | None = None
    mistake_variant: int = 0

    @property
    def width(self) -> int:
        return cp.LANES[self.simd]

    @property
    def techniques(self) -> tuple[str, ...]:
        found = []
        if self.unroll > 1 or self.rows > 1 or self.simd:
            found.append(REGISTER_BLOCKING)
        if self.tile is not None:
            found.append(CACHE_BLOCKING)
        if self.simd:
            found.append(SIMD)
        if self.omp:
            found.append(OPENMP)
        if self.prefetch:
            found.append(PREFETCH)
        return tuple(found)

    @property
    def min_stage(self) -> int:
        return cp.first_stage_allowing(self.techniques)


@dataclass(frozen=True)
class _Table:
    """What a task's kernels may be made of."""

    forms: tuple[str, ...]
    simd_forms: tuple[str, ...]  # forms with a vector rendering
    tile_forms: tuple[str, ...]
    omp_forms: tuple[str, ...]
    prefetch_forms: tuple[str, ...]
    row_forms: tuple[str, ...]  # forms that take several rows per pass
    unrolls: tuple[int, ...]
    vector_unrolls: tuple[int, ...]
    rows: tuple[int, ...]
    vector_rows: tuple[int, ...]
    tile_rows: tuple[int, ...]
    tile_cols: tuple[int, ...]
    schedules: tuple[str, ...]
    distances: tuple[int, ...]
    mistakes: tuple[str, ...]  # besides compile errors and stage violations


_TABLES: dict[str, _Table] = {
    # dot: a dot product per row; axpy: y += A[:, j] x[j], column by column (stage 1 only).
    "gemv": _Table(
        forms=("dot", "axpy"),
        simd_forms=("dot",),
        tile_forms=("dot",),
        omp_forms=("dot",),
        prefetch_forms=("dot",),
        row_forms=("dot",),
        unrolls=(1, 2, 4, 8),
        vector_unrolls=(1, 2, 4),
        rows=(1, 2, 4),
        vector_rows=(1, 2),
        tile_rows=(16, 32, 64, 128),
        tile_cols=(256, 512, 1024),
        schedules=("static", "dynamic", "guided"),
        distances=(64, 128, 256, 512),
        mistakes=(NO_ZERO, OFF_BY_ONE, WRONG_STRIDE),
    ),
    # two_pass: copy the grid, then sweep; edges: copy the boundary only, then sweep; fused:
    # row by row, the boundary points written where the row is.
    "stencil": _Table(
        forms=("two_pass", "edges", "fused"),
        simd_forms=("two_pass", "edges", "fused"),
        tile_forms=("two_pass", "edges"),
        omp_forms=("two_pass", "edges", "fused"),
        prefetch_forms=("two_pass", "edges", "fused"),
        row_forms=("two_pass", "edges"),
        unrolls=(1, 2, 4),
        vector_unrolls=(1, 2),
        rows=(1, 2),
        vector_rows=(1, 2),
        tile_rows=(8, 16, 32, 64),
        tile_cols=(64, 128, 256, 512),
        schedules=("static", "dynamic", "guided"),
        distances=(16, 32, 64, 128),
        mistakes=(SKIP_BOUNDARY_COPY, OFF_BY_ONE, WRONG_STRIDE),
    ),
    # rows: a sum per row over rowptr; ranges: the row's val/col through pointers and a
    # length; zeroed: y zeroed first, then accumulated in place (scalar only).
    "spmv": _Table(
        forms=("rows", "ranges", "zeroed"),
        simd_forms=("rows", "ranges"),
        tile_forms=("rows", "ranges", "zeroed"),
        omp_forms=("rows", "ranges", "zeroed"),
        prefetch_forms=("rows", "ranges", "zeroed"),
        row_forms=(),
        unrolls=(1, 2, 4, 8),
        vector_unrolls=(1, 2),
        rows=(1,),
        vector_rows=(1,),
        tile_rows=(32, 64, 128, 256, 512),
        tile_cols=(0,),
        schedules=("static", "dynamic", "guided"),
        distances=(32, 64, 128, 256),
        mistakes=(NO_ZERO, DROPS_LAST, IGNORES_COL, OFF_BY_ONE),
    ),
}
TASKS: tuple[str, ...] = ("matmul", *_TABLES)


def sample_spec(rng: random.Random, task: str, target_stage: int, isa: str) -> MotifSpec:
    """A correct spec that uses what ``target_stage`` newly allows (and nothing it forbids)."""
    if isa not in cp.ISAS:
        raise ValueError(f"isa must be one of {cp.ISAS}, got {isa!r}")
    table = _TABLES[task]
    want_simd = target_stage in (3, 6) or (target_stage >= 4 and rng.random() < 0.75)
    want_omp = target_stage in (4, 6) or (target_stage == 5 and rng.random() < 0.6)
    want_tile = target_stage in (2, 6) or (target_stage >= 3 and rng.random() < 0.4)
    forms = [
        f
        for f in table.forms
        if (f in table.simd_forms or not want_simd)
        and (f in table.tile_forms or not want_tile)
        and (f in table.omp_forms or not want_omp)
        and (f in table.prefetch_forms or target_stage < 5)
    ]
    form = rng.choice(forms)
    if want_simd:
        unroll, rows = rng.choice(table.vector_unrolls), rng.choice(table.vector_rows)
    else:
        unroll, rows = rng.choice(table.unrolls), rng.choice(table.rows)
    rows = rows if form in table.row_forms else 1
    simd = isa if want_simd else None
    spec = MotifSpec(task=task, form=form, unroll=unroll, rows=rows, simd=simd)
    if want_tile:
        tile_rows = max(rng.choice(table.tile_rows) // rows, 1) * rows  # whole row blocks
        spec = replace(spec, tile=(tile_rows, rng.choice(table.tile_cols)))
    if want_omp:
        spec = replace(spec, omp=rng.choice(table.schedules))
    if target_stage >= 5:
        spec = replace(spec, prefetch=(rng.choice(("mm", "builtin")), rng.choice(table.distances)))
    return spec


def downgrade(rng: random.Random, spec: MotifSpec, to_stage: int) -> MotifSpec:
    """``spec`` without what ``to_stage`` does not allow (the parent of a deepen pair)."""
    if to_stage >= 5:  # stage 5 deepens into 6: the parent lacks one of 6's techniques
        return replace(spec, omp=None) if rng.random() < 0.5 else replace(spec, tile=None)
    spec = replace(spec, prefetch=None)
    if to_stage < 4:
        spec = replace(spec, omp=None)
    if to_stage < 3:
        spec = replace(spec, simd=None)
    if to_stage < 2:
        spec = replace(spec, tile=None)
    return spec


def applicable_mistakes(spec: MotifSpec, target_stage: int) -> list[str]:
    kinds = [*_TABLES[spec.task].mistakes, COMPILE_ERROR]
    if target_stage < 5:
        kinds.append(STAGE_VIOLATION)
    if spec.unroll * spec.width > 1 or spec.rows > 1 or spec.tile:
        kinds.append(NO_BOUNDARY)
    return kinds


def with_mistake(
    rng: random.Random, spec: MotifSpec, target_stage: int, isa: str, kind: str | None = None
) -> MotifSpec:
    """``spec`` with one mistake (a random applicable one unless ``kind`` is given)."""
    kind = kind or rng.choice(applicable_mistakes(spec, target_stage))
    if kind == STAGE_VIOLATION:
        # Asked for this stage, the writer reached for a later stage's technique.
        higher = sample_spec(rng, spec.task, rng.randint(max(target_stage + 1, 3), 5), isa)
        return replace(higher, mistake=STAGE_VIOLATION)
    return replace(spec, mistake=kind, mistake_variant=rng.randrange(5))


def render(spec: MotifSpec) -> str:
    source = _renderer(spec.task).render(spec)
    if spec.mistake == COMPILE_ERROR:
        source = cp._break_compilation(source, spec.mistake_variant)
    return source


def render_kernel(spec: MotifSpec, label_stage: int, isa: str) -> Kernel:
    return Kernel(
        source=render(spec),
        stage=label_stage,
        techniques=spec.techniques,
        mistake=spec.mistake,
        isa=isa,
        spec=spec,  # type: ignore[arg-type]
    )


def _renderer(task: str) -> ModuleType:
    # Imported by name: each renderer imports this module's helpers.
    return importlib.import_module(f"hpcrl_bootstrap.corpus_{task}")


class Corpus(Protocol):
    """The four functions the catalogue plans a task's kernels with."""

    def sample_spec(self, rng: random.Random, number: int, isa: str) -> Any: ...
    def downgrade(self, rng: random.Random, spec: Any, to_stage: int) -> Any: ...
    def with_mistake(self, rng: random.Random, spec: Any, number: int, isa: str) -> Any: ...
    def render_kernel(self, spec: Any, label_stage: int, isa: str) -> Kernel: ...


class _Matmul:
    """GEMM's kernels exactly as ``corpus`` samples them for the catalogue (one style)."""

    def sample_spec(self, rng: random.Random, number: int, isa: str) -> cp.KernelSpec:
        return cp.sample_spec(rng, number, isa, styles=1)

    def downgrade(self, rng: random.Random, spec: Any, to_stage: int) -> Any:
        return cp.downgrade(rng, spec, to_stage)

    def with_mistake(self, rng: random.Random, spec: Any, number: int, isa: str) -> Any:
        return cp.with_mistake(rng, spec, number, isa)

    def render_kernel(self, spec: Any, label_stage: int, isa: str) -> Kernel:
        return cp.render_kernel(spec, label_stage, isa)


@dataclass(frozen=True)
class _Motif:
    task: str

    def sample_spec(self, rng: random.Random, number: int, isa: str) -> MotifSpec:
        return sample_spec(rng, self.task, number, isa)

    def downgrade(self, rng: random.Random, spec: Any, to_stage: int) -> Any:
        return downgrade(rng, spec, to_stage)

    def with_mistake(self, rng: random.Random, spec: Any, number: int, isa: str) -> Any:
        return with_mistake(rng, spec, number, isa)

    def render_kernel(self, spec: Any, label_stage: int, isa: str) -> Kernel:
        return render_kernel(spec, label_stage, isa)


def corpus_for(task: str) -> Corpus:
    """The kernels of ``task`` (one of :data:`TASKS`)."""
    if task == "matmul":
        return _Matmul()
    if task not in _TABLES:
        raise ValueError(
            f"the bootstrap has no kernels of task {task!r} (it writes: {', '.join(TASKS)})"
        )
    return _Motif(task)


# --- rendering helpers shared by corpus_gemv, corpus_stencil and corpus_spmv ----------------

# A horizontal sum of an AVX2 vector (AVX-512 has _mm512_reduce_add_pd).
_HSUM256 = """static inline double hsum256(__m256d v) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}"""


def head(spec: MotifSpec, defines: dict[str, int], hsum: bool = False) -> str:
    """Includes, tile constants and helpers before the kernel ("" if none)."""
    parts: list[str] = []
    if spec.simd or (spec.prefetch and spec.prefetch[0] == "mm"):
        parts.append("#include <immintrin.h>")
    if defines:
        parts.append("\n".join(f"#define {name} {value}" for name, value in defines.items()))
    if hsum and spec.simd == "avx2":
        parts.append(_HSUM256)
    return "\n\n".join(parts) + "\n\n" if parts else ""


def hsum(spec: MotifSpec, vector: str) -> str:
    return f"hsum256({vector})" if spec.simd == "avx2" else f"_mm512_reduce_add_pd({vector})"


def vector_sum(spec: MotifSpec, names: list[str]) -> str:
    """One vector expression adding ``names`` (pairwise)."""
    vec = cp._VECS[spec.simd or ""]
    while len(names) > 1:
        names = [
            f"{vec.add}({names[n]}, {names[n + 1]})" if n + 1 < len(names) else names[n]
            for n in range(0, len(names), 2)
        ]
    return names[0]


def omp_pragma(spec: MotifSpec, chunk: int, collapse: bool = False) -> str:
    schedule = {
        "static": "schedule(static)",
        "dynamic": f"schedule(dynamic, {chunk})",
        "guided": "schedule(guided)",
    }[spec.omp or "static"]
    return "#pragma omp parallel for " + ("collapse(2) " if collapse else "") + schedule


def prefetch_line(spec: MotifSpec, address: str) -> str:
    assert spec.prefetch is not None
    if spec.prefetch[0] == "mm":
        return f"_mm_prefetch((const char *)({address}), _MM_HINT_T0);"
    return f"__builtin_prefetch({address}, 0, 3);"


def clamp(code: cp._Code, name: str, start: str, size: str, limit: str) -> None:
    """``int name = min(start + size, limit)``: the end of a tile."""
    code.line(f"int {name} = {start} + {size} < {limit} ? {start} + {size} : {limit};")


def tile_head(spec: MotifSpec, var: str, first: str, size: str, limit: str) -> str:
    """The loop over tiles; the no_boundary mistake leaves out the last, partial tile."""
    if spec.mistake == NO_BOUNDARY:
        return f"for (int {var} = {first}; {var} + {size} <= {limit}; {var} += {size})"
    return f"for (int {var} = {first}; {var} < {limit}; {var} += {size})"
