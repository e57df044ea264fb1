"""A seeded generator of matrix-multiply kernels: the policy bootstrap's training corpus.

Pure (no I/O): the same seed gives the same kernels. A kernel is rendered from a
:class:`KernelSpec` (loop order, register block, SIMD ISA, cache tiles, unrolling, OpenMP,
prefetch) and may carry one realistic mistake, so that the policy trained on the corpus writes
kernels whose rewards spread (GRPO learns nothing from a group of equal rewards).

Every kernel defines the task's ``void matmul_optimized(double *A, double *B, double *C,
int M, int N, int K)`` (row-major, C = A * B, C overwritten).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

from hpcrl_common.stages import (
    CACHE_BLOCKING,
    LAST_STAGE,
    OPENMP,
    PREFETCH,
    REGISTER_BLOCKING,
    SIMD,
    stage,
)

SIGNATURE = "void matmul_optimized(double *A, double *B, double *C, int M, int N, int K)"
ISAS: tuple[str, ...] = ("avx512", "avx2")
LANES = {None: 1, "avx2": 4, "avx512": 8}

# Mistakes. The first five make a kernel wrong somewhere (the last two only at sizes that are
# not multiples of a block, or not square, which the paper says generated code gets wrong).
NO_ZERO = "no_zero"  # accumulates into C instead of overwriting it
OFF_BY_ONE = "off_by_one"  # k <= K
COMPILE_ERROR = "compile_error"  # typo, undeclared name, missing include or brace
RACE = "race"  # OpenMP over a loop whose iterations write the same C elements
STAGE_VIOLATION = "stage_violation"  # uses a technique its stage forbids
NO_BOUNDARY = "no_boundary"  # blocked loops without remainder handling
WRONG_STRIDE = "wrong_stride"  # a leading dimension mixed up (right only when square)
MISTAKES: tuple[str, ...] = (
    NO_ZERO,
    OFF_BY_ONE,
    COMPILE_ERROR,
    RACE,
    STAGE_VIOLATION,
    NO_BOUNDARY,
    WRONG_STRIDE,
)

Family = Literal["loops", "block"]
Omp = Literal["static", "dynamic", "collapse"]


def first_stage_allowing(techniques: tuple[str, ...]) -> int:
    """The first stage at which every technique in ``techniques`` is allowed."""
    used = set(techniques)
    return next(s for s in range(1, LAST_STAGE + 1) if used <= set(stage(s).allowed))


@dataclass(frozen=True)
class KernelSpec:
    """Everything a kernel's source is rendered from."""

    family: Family = "loops"
    order: str = "ikj"  # loop order of the "loops" family
    block_rows: int = 1  # register block: rows
    block_vectors: int = 1  # register block: vectors (or scalars) per row
    simd: str | None = None  # None, "avx2", "avx512"
    tile: tuple[int, int, int] | None = None  # cache tile (BM, BN, BK)
    tile_order: str = "ikj"  # order of the tile loops
    unroll: int = 1
    omp: Omp | None = None
    prefetch: tuple[str, int] | None = None  # ("mm" | "builtin", distance in k)
    style: int = 0  # cosmetic variants (names, constants, comments)
    mistake: str | None = None
    mistake_variant: int = 0

    @property
    def width(self) -> int:
        return LANES[self.simd]

    @property
    def techniques(self) -> tuple[str, ...]:
        found = []
        if self.family == "block" and (self.block_rows * self.block_vectors > 1 or self.simd):
            found.append(REGISTER_BLOCKING)
        if self.tile is not None:
            found.append(CACHE_BLOCKING)
        if self.simd:
            found.append(SIMD)
        if self.omp or self.mistake == RACE:
            found.append(OPENMP)
        if self.prefetch:
            found.append(PREFETCH)
        return tuple(found)

    @property
    def min_stage(self) -> int:
        return first_stage_allowing(self.techniques)

    def without_mistake(self) -> KernelSpec:
        return replace(self, mistake=None, mistake_variant=0)


@dataclass(frozen=True)
class Kernel:
    """One corpus sample: source, the stage it is labelled with, its techniques, its mistake."""

    source: str
    stage: int
    techniques: tuple[str, ...]
    mistake: str | None
    isa: str
    spec: KernelSpec = field(repr=False)

    @property
    def correct(self) -> bool:
        return self.mistake is None


# --- spec sampling -------------------------------------------------------------------------

_TILES = (16, 32, 48, 64, 128)
# Blocks up to 8 accumulators (a kernel is ~800 tokens under Qwen2's pre-tokenization, which
# the tiny policy must write), and on AVX2 a 6x8 block of 12: with its 16 registers, 6x8 runs
# at ~1.7x the 4x8 block at 256^3 on 2 Zen 3 cores (44-48 against 26-29 GFLOPS, 2 threads;
# bench/records/2026-11-29-measurements.md), so it is listed four times: the catalogue holds
# only 6-8 kernels of each of stages 4-6, and at one in nine (or three in ten) seed 0 planned
# no OpenMP 6x8 at stage 4.
_VECTOR_BLOCKS = {
    "avx2": (
        (1, 1),
        (1, 2),
        (2, 1),
        (2, 2),
        (4, 1),
        (4, 2),
        (3, 2),
        (6, 2),
        (6, 2),
        (6, 2),
        (6, 2),
    ),
    "avx512": ((1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2), (3, 2)),
}
# Scalar blocks of at most 4 accumulators: scalar blocks measure slower than the ikj loop
# order at 256³ anyway, and a tiled 2x4 block with its remainder loops was the longest
# stage-2 answer (about twice the average), tokens the SFT budget buys more with elsewhere.
_SCALAR_BLOCKS = ((1, 2), (2, 1), (2, 2), (1, 4), (4, 1))


def sample_spec(rng: random.Random, target_stage: int, isa: str, styles: int = 6) -> KernelSpec:
    """A correct spec that uses what ``target_stage`` newly allows (and nothing it forbids);
    ``styles`` cosmetic variants (names, constants, comments) at most."""
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
    need_tile = target_stage == 2 or target_stage == 6
    want_simd = (
        target_stage == 3 or target_stage == 6 or (target_stage >= 4 and rng.random() < 0.75)
    )
    want_omp = target_stage == 4 or target_stage == 6 or (target_stage == 5 and rng.random() < 0.6)
    want_tile = need_tile or (target_stage >= 3 and rng.random() < 0.55)
    want_prefetch = target_stage >= 5
    style = rng.randrange(styles)
    if want_simd:
        block_rows, block_vectors = rng.choice(_VECTOR_BLOCKS[isa])
        spec = KernelSpec(
            family="block",
            block_rows=block_rows,
            block_vectors=block_vectors,
            simd=isa,
            style=style,
        )
    elif rng.random() < 0.5:
        block_rows, block_vectors = rng.choice(_SCALAR_BLOCKS)
        spec = KernelSpec(
            family="block", block_rows=block_rows, block_vectors=block_vectors, style=style
        )
    else:
        orders = ("ikj", "ijk", "jik") if want_omp else ("ikj", "ijk", "kij", "jik")
        spec = KernelSpec(
            family="loops", order=rng.choice(orders), unroll=rng.choice((1, 1, 2, 4)), style=style
        )
    if want_tile:
        bm, bn, bk = rng.choice(_TILES), rng.choice(_TILES), rng.choice(_TILES)
        if spec.family == "block":  # tiles hold whole register blocks, as people write them
            bm = max(bm // spec.block_rows, 1) * spec.block_rows
            bn = max(bn // (spec.block_vectors * spec.width), 1) * spec.block_vectors * spec.width
        spec = replace(spec, tile=(bm, bn, bk), tile_order=rng.choice(("ikj", "ijk")))
    if want_omp:
        choices: tuple[Omp, ...] = ("static", "dynamic")
        if spec.tile is not None and spec.tile_order == "ijk":
            choices = ("static", "dynamic", "collapse")
        spec = replace(spec, omp=rng.choice(choices))
    if want_prefetch:
        spec = replace(spec, prefetch=(rng.choice(("mm", "builtin")), rng.choice((2, 4, 8, 16))))
    return spec


# Share of the tiled parents of SIMD deepen pairs (stage 2 into 3) written as a plain tiled
# loop nest rather than the target's register block in scalars. With none up to format 14,
# every such parent was a block (c00, c01, ...), while the parents a run and the evaluation
# set give are mostly plain tiled loop nests: on the set's, 0-31 % of v0's answers were
# correct, most of the rest writing OpenMP and prefetch into a stage-3 kernel.
TILED_LOOPS_PARENTS = 0.5


def downgrade(rng: random.Random, spec: KernelSpec, to_stage: int) -> KernelSpec:
    """``spec`` without what ``to_stage`` does not allow (the parent of a deepen pair)."""
    if to_stage >= 5:  # stage 5 deepens into 6: the parent lacks one of 6's techniques
        drop = rng.choice(("omp", "tile"))
        if drop == "omp":
            return replace(spec, omp=None)
        return replace(spec, tile=None, omp="static" if spec.omp == "collapse" else spec.omp)
    if to_stage < 5:
        spec = replace(spec, prefetch=None)
    if to_stage < 4:
        spec = replace(spec, omp=None)
    if to_stage < 3 and spec.simd:
        if spec.tile is not None and rng.random() < TILED_LOOPS_PARENTS:
            return replace(
                spec, family="loops", order="ikj", block_rows=1, block_vectors=1, simd=None
            )
        block_vectors = spec.block_vectors if spec.block_rows * spec.block_vectors > 1 else 2
        spec = replace(spec, simd=None, block_vectors=block_vectors)
    if to_stage < 2:
        spec = replace(spec, tile=None)
    return spec


def applicable_mistakes(spec: KernelSpec, target_stage: int) -> list[str]:
    kinds = [NO_ZERO, OFF_BY_ONE, COMPILE_ERROR, WRONG_STRIDE]
    if spec.omp:
        kinds.append(RACE)
    if target_stage < 5:
        kinds.append(STAGE_VIOLATION)
    if spec.tile or spec.family == "block" or spec.unroll > 1:
        kinds.append(NO_BOUNDARY)
    return kinds


def with_mistake(
    rng: random.Random, spec: KernelSpec, target_stage: int, isa: str, kind: str | None = None
) -> KernelSpec:
    """``spec`` with one mistake (a random applicable one unless ``kind`` is given)."""
    kind = kind or rng.choice(applicable_mistakes(spec, target_stage))
    if kind == STAGE_VIOLATION:
        # Asked for this stage, the writer reached for a later stage's technique.
        higher = sample_spec(rng, rng.randint(max(target_stage + 1, 3), 5), isa)
        return replace(higher, mistake=STAGE_VIOLATION)
    if kind in (RACE, OFF_BY_ONE):
        spec = replace(spec, unroll=1)  # keeps the k loop in the form the mistake needs
    return replace(spec, mistake=kind, mistake_variant=rng.randrange(5))


def completion_text(source: str) -> str:
    """A kernel as the policy answers: one fenced C block, its closing fence ended by a newline.

    The newline keeps the two fences apart as tokens. The pre-tokenizer makes the closing
    "```\n" one token and the opening "```" (followed by "c") another; the prompts' blocks
    already close that way. An answer that closed on a bare "```" taught that token as an
    opener (followed by "c") and as the last token before the end of the turn. A policy built
    that way on a Zen 4 node opened every stage 4-6 answer with "```" and ended the turn
    there (99.7 % of the mass on the end of turn, all 80 samples a format violation).
    """
    return f"```c\n{source.rstrip()}\n```\n"


def render_kernel(spec: KernelSpec, label_stage: int, isa: str) -> Kernel:
    source = render(spec)
    return Kernel(
        source=source,
        stage=label_stage,
        techniques=spec.techniques,
        mistake=spec.mistake,
        isa=isa,
        spec=spec,
    )


def sample_kernel(
    rng: random.Random, target_stage: int, isa: str, mistake_rate: float = 0.0
) -> Kernel:
    spec = sample_spec(rng, target_stage, isa)
    if rng.random() < mistake_rate:
        spec = with_mistake(rng, spec, target_stage, isa)
    return render_kernel(spec, target_stage, isa)


def generate_corpus(seed: int, size: int, mistake_rate: float = 0.3) -> list[Kernel]:
    """``size`` kernels, stages and ISAs spread evenly, about ``mistake_rate`` with a mistake."""
    rng = random.Random(f"hpcrl-corpus/{seed}")
    return [
        sample_kernel(rng, 1 + n % LAST_STAGE, ISAS[(n // LAST_STAGE) % 2], mistake_rate)
        for n in range(size)
    ]


# --- rendering -----------------------------------------------------------------------------


class _Code:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.depth = 0

    def line(self, text: str = "") -> None:
        self.lines.append("    " * self.depth + text if text else "")

    def open(self, head: str) -> None:
        self.line(head + " {")
        self.depth += 1

    def close(self) -> None:
        self.depth -= 1
        self.line("}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _plus(base: str, offset: int | str) -> str:
    if offset in (0, "0"):
        return base
    return f"{base} + {offset}"


def _paren(expr: str) -> str:
    return f"({expr})" if " " in expr else expr


class _Index:
    """Row-major indexing of A, B, C; the wrong-stride mistake bends exactly one of them."""

    def __init__(self, spec: KernelSpec) -> None:
        self.a_ld, self.b_ld, self.c_ld = "K", "N", "N"
        self.transposed_b = False
        if spec.mistake == WRONG_STRIDE:
            variant = spec.mistake_variant % 4
            if variant == 0:
                self.a_ld = "N"
            elif variant == 1:
                self.b_ld = "K"
            elif variant == 2:
                self.c_ld = "K"
            else:
                self.transposed_b = True

    def a(self, i: str, k: str) -> str:
        return f"A[{_paren(i)} * {self.a_ld} + {k}]"

    def b(self, k: str, j: str) -> str:
        if self.transposed_b:
            return f"B[{_paren(j)} * K + {k}]"
        return f"B[{_paren(k)} * {self.b_ld} + {j}]"

    def c(self, i: str, j: str) -> str:
        return f"C[{_paren(i)} * {self.c_ld} + {j}]"


_TILE_NAMES = (("ii", "jj", "kk"), ("i0", "j0", "k0"), ("ib", "jb", "kb"))


@dataclass
class _Ctx:
    spec: KernelSpec
    index: _Index
    tile_names: tuple[str, str, str]
    defines: bool  # tile sizes as #define (else literals through const ints)

    @property
    def mistake(self) -> str | None:
        return self.spec.mistake


def render(spec: KernelSpec) -> str:
    """The C source of ``spec``: includes, constants, then ``matmul_optimized``."""
    # One naming for tiles: a 3M-parameter policy trained for minutes mixed names within one
    # kernel (ib here, ii there) when the corpus varied them, and most of its compile errors
    # were such mix-ups.
    ctx = _Ctx(spec=spec, index=_Index(spec), tile_names=_TILE_NAMES[0], defines=True)
    head: list[str] = []
    if spec.simd or (spec.prefetch and spec.prefetch[0] == "mm"):
        head.append("#include <immintrin.h>")
    if (spec.omp or spec.mistake == RACE) and spec.style % 3 != 1:
        head.append("#include <omp.h>")
    if spec.tile and ctx.defines:
        if head:
            head.append("")
        bm, bn, bk = spec.tile
        head += [f"#define BM {bm}", f"#define BN {bn}", f"#define BK {bk}"]
    code = _Code()
    if spec.style % 3 == 2:
        code.line(f"/* {describe(spec)} */")
    code.open(SIGNATURE)
    if _shaped(spec):
        # The block's shape is named where the block is written, not in the head: a policy
        # copies a parent's head, and on parents whose head lacked `#define MR`/`NV` it
        # wrote the c[MR][NV] loops with the names undefined (most of a Zen 5 run's compile
        # errors, bench/records/2026-12-05-measurements.md, sixth section).
        code.line(f"enum {{ MR = {spec.block_rows}, NV = {spec.block_vectors} }};")
    if spec.family == "loops":
        _loops(code, ctx)
    else:
        _block(code, ctx)
    code.close()
    body = code.text()
    source = ("\n".join(head) + "\n\n" if head else "") + body
    if spec.mistake == COMPILE_ERROR:
        source = _break_compilation(source, spec.mistake_variant)
    return source


def describe(spec: KernelSpec) -> str:
    parts = []
    if spec.family == "loops":
        parts.append(f"{spec.order} loop order")
        if spec.unroll > 1:
            parts.append(f"unrolled by {spec.unroll}")
    else:
        width = spec.block_vectors * spec.width
        parts.append(f"{spec.block_rows}x{width} register block")
        if spec.simd:
            parts.append("AVX-512" if spec.simd == "avx512" else "AVX2")
    if spec.tile:
        parts.append("{}x{}x{} cache tiles".format(*spec.tile))
    if spec.omp:
        parts.append("OpenMP")
    if spec.prefetch:
        parts.append(f"prefetch distance {spec.prefetch[1]}")
    return ", ".join(parts)


def _omp_pragma(spec: KernelSpec, collapse_ok: bool = False) -> str:
    assert spec.omp is not None
    if spec.omp == "collapse" and collapse_ok:
        return "#pragma omp parallel for collapse(2) schedule(static)"
    if spec.omp == "dynamic":
        return "#pragma omp parallel for schedule(dynamic)"
    return "#pragma omp parallel for" + (" schedule(static)" if spec.style % 2 else "")


def _zero_c(code: _Code, ctx: _Ctx) -> None:
    if ctx.mistake == NO_ZERO:
        return
    if ctx.spec.omp:
        # Static whatever the kernel's schedule: dynamic hands out 65,536 one-element chunks
        # at 256^2 and made a 6x8 AVX2 kernel 9x slower.
        code.line("#pragma omp parallel for")
    if ctx.spec.style % 2 or ctx.index.c_ld != "N":
        code.open("for (int i = 0; i < M; i++)")
        code.open("for (int j = 0; j < N; j++)")
        code.line(f"{ctx.index.c('i', 'j')} = 0.0;")
        code.close()
        code.close()
    else:
        code.open("for (long i = 0; i < (long)M * N; i++)")
        code.line("C[i] = 0.0;")
        code.close()


def _prefetch(code: _Code, ctx: _Ctx, k: str, j: str) -> None:
    if not ctx.spec.prefetch:
        return
    kind, distance = ctx.spec.prefetch
    address = f"&{ctx.index.b(f'{k} + {distance}', j)}"
    if kind == "mm":
        code.line(f"_mm_prefetch((const char *){address}, _MM_HINT_T0);")
    else:
        code.line(f"__builtin_prefetch({address}, 0, 3);")


def _k_bound(ctx: _Ctx, hi: str) -> str:
    return f"k <= {hi}" if ctx.mistake == OFF_BY_ONE else f"k < {hi}"


def _tile_consts(code: _Code, ctx: _Ctx) -> tuple[str, str, str]:
    assert ctx.spec.tile is not None
    if ctx.defines:
        return "BM", "BN", "BK"
    bm, bn, bk = ctx.spec.tile
    code.line(f"const int bm = {bm}, bn = {bn}, bk = {bk};")
    return "bm", "bn", "bk"


def _tile_loops(code: _Code, ctx: _Ctx) -> tuple[str, str, str, str, str, str]:
    """Open the three tile loops; return (i0, i1, j0, j1, k0, k1) of the current tile."""
    spec = ctx.spec
    bm, bn, bk = _tile_consts(code, ctx)
    ti, tj, tk = ctx.tile_names
    heads = {
        "i": f"for (int {ti} = 0; {ti} < M; {ti} += {bm})",
        "j": f"for (int {tj} = 0; {tj} < N; {tj} += {bn})",
        "k": f"for (int {tk} = 0; {tk} < K; {tk} += {bk})",
    }
    race_on_k = ctx.mistake == RACE
    for depth, name in enumerate(spec.tile_order):
        if race_on_k and name == "k":
            code.line("#pragma omp parallel for")
        elif spec.omp and not race_on_k and depth == 0:
            code.line(_omp_pragma(spec, collapse_ok=spec.tile_order[1] == "j"))
        code.open(heads[name])
    ends = []
    for var, size, dim in ((ti, bm, "M"), (tj, bn, "N"), (tk, bk, "K")):
        end = f"{var[0]}_end"
        if ctx.mistake == NO_BOUNDARY:
            code.line(f"int {end} = {var} + {size};")
        elif spec.style % 2:
            code.line(f"int {end} = {var} + {size} < {dim} ? {var} + {size} : {dim};")
        else:
            code.line(f"int {end} = {var} + {size};")
            code.line(f"if ({end} > {dim}) {end} = {dim};")
        ends.append(end)
    return ti, ends[0], tj, ends[1], tk, ends[2]


def _close_tiles(code: _Code) -> None:
    for _ in range(3):
        code.close()


# --- the "loops" family: plain loop nests, optionally tiled and unrolled --------------------


def _loops(code: _Code, ctx: _Ctx) -> None:
    spec = ctx.spec
    if spec.tile is not None:
        _zero_c(code, ctx)
        i0, i1, j0, j1, k0, k1 = _tile_loops(code, ctx)
        _axpy_nest(code, ctx, (i0, i1), (j0, j1), (k0, k1), outer_pragma=False)
        _close_tiles(code)
    elif spec.order in ("ijk", "jik"):
        _dot_nest(code, ctx)
    else:
        _zero_c(code, ctx)
        _axpy_nest(code, ctx, ("0", "M"), ("0", "N"), ("0", "K"), outer_pragma=True)


def _dot_nest(code: _Code, ctx: _Ctx) -> None:
    spec, index = ctx.spec, ctx.index
    outer, inner = ("i", "j") if spec.order == "ijk" else ("j", "i")
    limit = {"i": "M", "j": "N"}
    if spec.omp and ctx.mistake != RACE:
        code.line(_omp_pragma(spec))
    code.open(f"for (int {outer} = 0; {outer} < {limit[outer]}; {outer}++)")
    code.open(f"for (int {inner} = 0; {inner} < {limit[inner]}; {inner}++)")
    init = index.c("i", "j") if ctx.mistake == NO_ZERO else "0.0"
    code.line(f"double sum = {init};")
    if ctx.mistake == RACE:
        code.line("#pragma omp parallel for")
    u = spec.unroll
    if u > 1:
        if ctx.mistake == NO_BOUNDARY:
            code.line(f"for (int k = 0; k < K; k += {u}) {{")
        else:
            code.line("int k = 0;")
            code.line(f"for (; k + {u} <= K; k += {u}) {{")
        code.depth += 1
        terms = [f"{index.a('i', _plus('k', t))} * {index.b(_plus('k', t), 'j')}" for t in range(u)]
        _prefetch(code, ctx, "k", "j")
        code.line("sum += " + terms[0])
        for term in terms[1:]:
            code.line(f"     + {term}")
        code.lines[-1] += ";"
        code.close()
        if ctx.mistake != NO_BOUNDARY:
            code.open(f"for (; {_k_bound(ctx, 'K')}; k++)")
            code.line(f"sum += {index.a('i', 'k')} * {index.b('k', 'j')};")
            code.close()
    else:
        code.open(f"for (int k = 0; {_k_bound(ctx, 'K')}; k++)")
        _prefetch(code, ctx, "k", "j")
        code.line(f"sum += {index.a('i', 'k')} * {index.b('k', 'j')};")
        code.close()
    code.line(f"{index.c('i', 'j')} = sum;")
    code.close()
    code.close()


def _axpy_nest(
    code: _Code,
    ctx: _Ctx,
    irange: tuple[str, str],
    jrange: tuple[str, str],
    krange: tuple[str, str],
    outer_pragma: bool,
) -> None:
    """C[i, j0:j1] += A[i, k] * B[k, j0:j1] over the ranges (C already zeroed)."""
    spec, index = ctx.spec, ctx.index
    order = "kij" if spec.order == "kij" and outer_pragma else "ikj"
    i_head = f"for (int i = {irange[0]}; i < {irange[1]}; i++)"
    k_head = f"for (int k = {krange[0]}; {_k_bound(ctx, krange[1])}; k++)"
    for depth, head in enumerate((i_head, k_head) if order == "ikj" else (k_head, i_head)):
        is_k = head is k_head
        if ctx.mistake == RACE and is_k and outer_pragma:
            code.line("#pragma omp parallel for")
        elif outer_pragma and spec.omp and depth == 0 and ctx.mistake != RACE:
            code.line(_omp_pragma(spec))
        code.open(head)
    code.line(f"double a = {index.a('i', 'k')};")
    _prefetch(code, ctx, "k", jrange[0])
    u = spec.unroll
    j0, j1 = jrange
    if u > 1:
        if ctx.mistake == NO_BOUNDARY:
            code.open(f"for (int j = {j0}; j < {j1}; j += {u})")
        else:
            code.line(f"int j = {j0};")
            code.open(f"for (; j + {u} <= {j1}; j += {u})")
        for t in range(u):
            code.line(f"{index.c('i', _plus('j', t))} += a * {index.b('k', _plus('j', t))};")
        code.close()
        if ctx.mistake != NO_BOUNDARY:
            code.open(f"for (; j < {j1}; j++)")
            code.line(f"{index.c('i', 'j')} += a * {index.b('k', 'j')};")
            code.close()
    else:
        code.open(f"for (int j = {j0}; j < {j1}; j++)")
        code.line(f"{index.c('i', 'j')} += a * {index.b('k', 'j')};")
        code.close()
    code.close()
    code.close()


# --- the "block" family: a block_rows x (block_vectors * lanes) register block, scalar or SIMD


@dataclass(frozen=True)
class _Vec:
    type: str
    zero: str
    load: str
    store: str
    set1: str
    fma: str
    add: str
    mul: str


_VECS = {
    "avx2": _Vec(
        "__m256d",
        "_mm256_setzero_pd()",
        "_mm256_loadu_pd",
        "_mm256_storeu_pd",
        "_mm256_set1_pd",
        "_mm256_fmadd_pd",
        "_mm256_add_pd",
        "_mm256_mul_pd",
    ),
    "avx512": _Vec(
        "__m512d",
        "_mm512_setzero_pd()",
        "_mm512_loadu_pd",
        "_mm512_storeu_pd",
        "_mm512_set1_pd",
        "_mm512_fmadd_pd",
        "_mm512_add_pd",
        "_mm512_mul_pd",
    ),
}


def _block(code: _Code, ctx: _Ctx) -> None:
    spec = ctx.spec
    if spec.tile is not None:
        _zero_c(code, ctx)
        i0, i1, j0, j1, k0, k1 = _tile_loops(code, ctx)
        _register_block(
            code, ctx, (i0, i1), (j0, j1), (k0, k1), accumulate=True, outer_pragma=False
        )
        _close_tiles(code)
    else:
        _register_block(
            code,
            ctx,
            ("0", "M"),
            ("0", "N"),
            ("0", "K"),
            accumulate=ctx.mistake == NO_ZERO,
            outer_pragma=True,
        )


def _shaped(spec: KernelSpec) -> bool:
    """Whether the register block is written as loops over ``c[MR][NV]`` (a vector block of
    several rows) rather than one named accumulator per row and vector."""
    return spec.simd is not None and spec.family == "block" and spec.block_rows > 1


def _register_block(
    code: _Code,
    ctx: _Ctx,
    irange: tuple[str, str],
    jrange: tuple[str, str],
    krange: tuple[str, str],
    accumulate: bool,
    outer_pragma: bool,
) -> None:
    """Register-blocked C[irange, jrange] (+)= A[irange, krange] * B[krange, jrange]."""
    spec = ctx.spec
    vec = _VECS.get(spec.simd or "")
    shaped = _shaped(spec)
    block_rows: int | str = "MR" if shaped else spec.block_rows
    cols: int | str = f"NV * {spec.width}" if shaped else spec.block_vectors * spec.width
    i0, i1 = irange
    j0, j1 = jrange
    bounded = ctx.mistake != NO_BOUNDARY
    tiled = i0 != "0"
    if bounded and spec.block_rows > 1:
        i_main = _main_bound(code, "i_main" if tiled else "M_main", irange, str(block_rows))
    else:
        i_main = i1
    if bounded and spec.block_vectors * spec.width > 1:
        j_main = _main_bound(code, "j_main" if tiled else "N_main", jrange, _paren(str(cols)))
    else:
        j_main = j1
    pragma = outer_pragma and spec.omp and ctx.mistake != RACE
    if pragma:
        code.line(_omp_pragma(spec))
    step = "i++" if block_rows == 1 else f"i += {block_rows}"
    code.open(f"for (int i = {i0}; i < {i_main}; {step})")
    jstep = "j++" if cols == 1 else f"j += {cols}"
    code.open(f"for (int j = {j0}; j < {j_main}; {jstep})")
    if shaped:
        assert vec is not None
        _array_block(code, ctx, vec, krange, accumulate, race_pragma=not tiled)
    else:
        _named_block(code, ctx, vec, krange, accumulate, race_pragma=not tiled)
    code.close()
    if bounded and cols != 1:
        code.open(f"for (int j = {j_main}; j < {j1}; j++)")
        if block_rows != 1:
            code.open(f"for (int r = 0; r < {block_rows}; r++)")
        row = "i + r" if block_rows != 1 else "i"
        _scalar_dot(code, ctx, row, "j", krange, accumulate)
        if block_rows != 1:
            code.close()
        code.close()
    code.close()
    if bounded and block_rows != 1:
        if pragma:
            code.line(_omp_pragma(spec))
        code.open(f"for (int i = {i_main}; i < {i1}; i++)")
        if vec is not None:
            # The leftover rows as one-row vector blocks: as scalar dot products down B's
            # columns, they cost a 6x8 block at 256^3 (4 rows left) a third of its speed.
            _vector_row(code, ctx, vec, "i", (j0, j_main), krange, accumulate)
            code.open(f"for (int j = {j_main}; j < {j1}; j++)")
        else:
            code.open(f"for (int j = {j0}; j < {j1}; j++)")
        _scalar_dot(code, ctx, "i", "j", krange, accumulate)
        code.close()
        code.close()


def _main_bound(code: _Code, name: str, bounds: tuple[str, str], multiple: str) -> str:
    """Declares ``name``, the end of the part of [lo, hi) that whole blocks of ``multiple``
    cover (the leftover loop runs from there to hi), and returns it."""
    lo, hi = bounds
    tiled = lo != "0"
    span = f"({hi} - {lo})" if tiled else hi
    base = f"{lo} + " if tiled else ""
    code.line(f"int {name} = {base}{span} - {span} % {multiple};")
    return name


def _named_block(
    code: _Code,
    ctx: _Ctx,
    vec: _Vec | None,
    krange: tuple[str, str],
    accumulate: bool,
    race_pragma: bool,
) -> None:
    """The block at (i, j) with one named accumulator per row and vector (c00, c01, ...)."""
    spec, index = ctx.spec, ctx.index
    block_rows = spec.block_rows
    rows = [_plus("i", r) for r in range(block_rows)]
    offsets = [v * spec.width for v in range(spec.block_vectors)]
    names = [[f"c{r}{v}" for v in range(spec.block_vectors)] for r in range(block_rows)]
    for r in range(block_rows):
        decls = []
        for v in range(spec.block_vectors):
            cj = _plus("j", offsets[v])
            if vec is None:
                decls.append(f"{names[r][v]} = {index.c(rows[r], cj) if accumulate else '0.0'}")
            else:
                init = f"{vec.load}(&{index.c(rows[r], cj)})" if accumulate else vec.zero
                decls.append(f"{names[r][v]} = {init}")
        code.line(f"{vec.type if vec else 'double'} " + ", ".join(decls) + ";")
    if ctx.mistake == RACE and race_pragma:
        code.line("#pragma omp parallel for")
    code.open(f"for (int k = {krange[0]}; {_k_bound(ctx, krange[1])}; k++)")
    _prefetch(code, ctx, "k", "j")
    for v in range(spec.block_vectors):
        bref = index.b("k", _plus("j", offsets[v]))
        code.line(f"{vec.type} b{v} = {vec.load}(&{bref});" if vec else f"double b{v} = {bref};")
    for r in range(block_rows):
        aref = index.a(rows[r], "k")
        code.line(f"{vec.type} a{r} = {vec.set1}({aref});" if vec else f"double a{r} = {aref};")
        for v in range(spec.block_vectors):
            acc = names[r][v]
            if vec is None:
                code.line(f"{acc} += a{r} * b{v};")
            else:
                code.line(f"{acc} = {vec.fma}(a{r}, b{v}, {acc});")
    code.close()
    for r in range(block_rows):
        for v in range(spec.block_vectors):
            cref = index.c(rows[r], _plus("j", offsets[v]))
            code.line(
                f"{vec.store}(&{cref}, {names[r][v]});" if vec else f"{cref} = {names[r][v]};"
            )


def _array_block(
    code: _Code,
    ctx: _Ctx,
    vec: _Vec,
    krange: tuple[str, str],
    accumulate: bool,
    race_pragma: bool,
) -> None:
    """The block at (i, j) as loops over ``c[MR][NV]``, its shape named once (``enum { MR,
    NV }`` at the top of the function): gcc -O3 unrolls the loops, loads each B vector once
    and keeps every accumulator in a register, as with one named variable per accumulator,
    in far fewer tokens (a 6x8 AVX2 kernel named accumulator by accumulator ran to ~1,500),
    and a small policy copies two names instead of keeping a block's size consistent in a
    dozen literals (with the sizes as literals, its 6x8 kernels declared ``c[6][2]`` and
    looped over 4 rows)."""
    spec, index = ctx.spec, ctx.index
    cj = f"j + v * {spec.width}"
    code.line(f"{vec.type} c[MR][NV];")
    code.open("for (int r = 0; r < MR; r++)")
    code.open("for (int v = 0; v < NV; v++)")
    init = f"{vec.load}(&{index.c('i + r', cj)})" if accumulate else vec.zero
    code.line(f"c[r][v] = {init};")
    code.close()
    code.close()
    if ctx.mistake == RACE and race_pragma:
        code.line("#pragma omp parallel for")
    code.open(f"for (int k = {krange[0]}; {_k_bound(ctx, krange[1])}; k++)")
    _prefetch(code, ctx, "k", "j")
    code.open("for (int r = 0; r < MR; r++)")
    code.line(f"{vec.type} a = {vec.set1}({index.a('i + r', 'k')});")
    code.open("for (int v = 0; v < NV; v++)")
    code.line(_vector_update(vec, "c[r][v]", f"{vec.load}(&{index.b('k', cj)})"))
    code.close()
    code.close()
    code.close()
    code.open("for (int r = 0; r < MR; r++)")
    code.open("for (int v = 0; v < NV; v++)")
    code.line(f"{vec.store}(&{index.c('i + r', cj)}, c[r][v]);")
    code.close()
    code.close()


def _vector_update(vec: _Vec, acc: str, b: str) -> str:
    """Always one FMA: every ISA the system targets has it, and with a second form taught
    (``add(acc, mul(a, b))``, 15 % of the AVX2 kernels up to format 13) the policy crossed
    them, ``fmadd(acc, mul(a, b))`` with two arguments: a quarter of its AVX2 compile errors."""
    return f"{acc} = {vec.fma}(a, {b}, {acc});"


def _vector_row(
    code: _Code,
    ctx: _Ctx,
    vec: _Vec,
    row: str,
    jrange: tuple[str, str],
    krange: tuple[str, str],
    accumulate: bool,
) -> None:
    """Row ``row`` of C over ``jrange`` (whole blocks) as one row of the ``MR`` x ``NV`` block."""
    spec, index = ctx.spec, ctx.index
    cj = f"j + v * {spec.width}"
    code.open(f"for (int j = {jrange[0]}; j < {jrange[1]}; j += NV * {spec.width})")
    code.line(f"{vec.type} t[NV];")
    code.open("for (int v = 0; v < NV; v++)")
    code.line(f"t[v] = {vec.load}(&{index.c(row, cj)});" if accumulate else f"t[v] = {vec.zero};")
    code.close()
    code.open(f"for (int k = {krange[0]}; k < {krange[1]}; k++)")
    code.line(f"{vec.type} a = {vec.set1}({index.a(row, 'k')});")
    code.open("for (int v = 0; v < NV; v++)")
    code.line(_vector_update(vec, "t[v]", f"{vec.load}(&{index.b('k', cj)})"))
    code.close()
    code.close()
    code.open("for (int v = 0; v < NV; v++)")
    code.line(f"{vec.store}(&{index.c(row, cj)}, t[v]);")
    code.close()
    code.close()


def _scalar_dot(
    code: _Code, ctx: _Ctx, row: str, col: str, krange: tuple[str, str], accumulate: bool
) -> None:
    index = ctx.index
    code.line(f"double s = {index.c(row, col) if accumulate else '0.0'};")
    code.open(f"for (int k = {krange[0]}; k < {krange[1]}; k++)")
    code.line(f"s += {index.a(row, 'k')} * {index.b('k', col)};")
    code.close()
    code.line(f"{index.c(row, col)} = s;")


# --- compile errors ------------------------------------------------------------------------


def _break_compilation(source: str, variant: int) -> str:
    """One realistic way to make ``source`` fail to compile."""
    lines = source.splitlines()
    statements = [
        n
        for n, text in enumerate(lines)
        if text.rstrip().endswith(";") and not text.lstrip().startswith(("#", "for"))
    ]
    variant %= 5
    if variant == 0 and "#include <immintrin.h>" in source and "__m" in source:
        return source.replace("#include <immintrin.h>\n", "")  # vector types undeclared
    if variant == 1 and "_pd(" in source and "fmadd" in source:
        return source.replace("_fmadd_pd(", "_fmadd_ps(", 1)  # float intrinsic on doubles
    if variant == 2:
        text = re.sub(r"\[i \* K \+ k\]", "[i * K + kk]", source, count=1)
        if text != source and "int kk" not in source:
            return text  # undeclared variable
    if variant == 3:
        return source.rstrip()[:-1].rstrip() + "\n"  # missing closing brace
    target = statements[len(statements) // 2]
    lines[target] = lines[target].rstrip()[:-1]  # missing semicolon
    return "\n".join(lines) + "\n"


def iter_specs_for_tests(seed: int, count: int) -> Iterator[tuple[KernelSpec, int, str]]:
    """Correct specs over every stage and ISA, for tests and quality checks."""
    rng = random.Random(f"hpcrl-specs/{seed}")
    for n in range(count):
        number, isa = 1 + n % LAST_STAGE, ISAS[(n // LAST_STAGE) % 2]
        yield sample_spec(rng, number, isa), number, isa
