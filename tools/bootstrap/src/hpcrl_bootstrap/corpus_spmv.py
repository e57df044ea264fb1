"""CSR SpMV kernels (y = A x from rowptr, col, val) rendered from a :class:`MotifSpec`.

Forms: ``rows`` (a sum per row over rowptr[i] .. rowptr[i+1]), ``ranges`` (the row's val and
col through pointers and a length) and ``zeroed`` (y zeroed first, then accumulated in place;
scalar only). Unrolled accumulators, AVX2/AVX-512 gathers of x (``_mm256_i32gather_pd``,
``_mm512_i32gather_pd``) with a scalar remainder, row strips (the cache blocking a CSR
matrix allows without another format), OpenMP over rows or strips (dynamic or guided: the
row lengths vary widely) and a prefetch of val and col ahead.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl_bootstrap import motifs as mf
from hpcrl_bootstrap.corpus import _VECS, NO_BOUNDARY, NO_ZERO, OFF_BY_ONE, _Code
from hpcrl_bootstrap.motifs import DROPS_LAST, IGNORES_COL, MotifSpec

SIGNATURE = (
    "void spmv_optimized(const int *rowptr, const int *col, const double *val, "
    "const double *x, double *y, int M, int N)"
)


@dataclass(frozen=True)
class _Row:
    """How one row's entries are named: values, columns, first and end index."""

    val: str
    col: str
    first: str
    end: str


def render(spec: MotifSpec) -> str:
    code = _Code()
    code.open(SIGNATURE)
    if spec.form == "zeroed" and spec.mistake != NO_ZERO:
        if spec.omp:
            code.line("#pragma omp parallel for schedule(static)")
        code.open("for (int i = 0; i < M; i++)")
        code.line("y[i] = 0.0;")
        code.close()
    if spec.tile is not None:
        if spec.omp:
            code.line(mf.omp_pragma(spec, chunk=1))
        code.open(mf.tile_head(spec, "ib", "0", "BR", "M"))
        mf.clamp(code, "i_end", "ib", "BR", "M")
        code.open("for (int i = ib; i < i_end; i++)")
        _row(code, spec)
        code.close()
        code.close()
    else:
        if spec.omp:
            code.line(mf.omp_pragma(spec, chunk=64))
        code.open("for (int i = 0; i < M; i++)")
        _row(code, spec)
        code.close()
    code.close()
    defines = {"BR": spec.tile[0]} if spec.tile else {}
    return mf.head(spec, defines, hsum=bool(spec.simd)) + code.text()


def _at(k: str, offset: int) -> str:
    return k if offset == 0 else f"{k} + {offset}"


def _term(spec: MotifSpec, row: _Row, k: str) -> str:
    """val[k] * x[col[k]] (the ignores-col mistake: x at the entry's place in the row)."""
    if spec.mistake == IGNORES_COL:
        where = k if row.first == "0" else f"{k} - {row.first}"
        return f"{row.val}[{k}] * x[{where}]"
    return f"{row.val}[{k}] * x[{row.col}[{k}]]"


def _row(code: _Code, spec: MotifSpec) -> None:
    """One row's sum into y[i]."""
    if spec.form == "ranges":
        code.line("const double *vals = val + rowptr[i];")
        code.line("const int *cols = col + rowptr[i];")
        code.line("int len = rowptr[i + 1] - rowptr[i];")
        row = _Row("vals", "cols", "0", "len")
    elif spec.unroll == 1 and not spec.simd:
        row = _Row("val", "col", "rowptr[i]", "rowptr[i + 1]")
    else:
        code.line("int start = rowptr[i], end = rowptr[i + 1];")
        row = _Row("val", "col", "start", "end")
    if spec.mistake == DROPS_LAST:
        row = _Row(row.val, row.col, row.first, f"{row.end} - 1")
    if spec.simd:
        _vector_row(code, spec, row)
    elif spec.form == "zeroed":
        _in_place_row(code, spec, row)
    else:
        _scalar_row(code, spec, row)


def _k_loop(code: _Code, spec: MotifSpec, row: _Row, step: int) -> None:
    """Open the main k loop (``step`` entries at a time) and its prefetch."""
    if step == 1:
        code.open(f"for (int k = {row.first}; k < {row.end}; k++)")
    else:
        code.line(f"int k = {row.first};")
        code.open(f"for (; k + {step} <= {row.end}; k += {step})")
    if spec.prefetch:
        distance = spec.prefetch[1]
        code.line(mf.prefetch_line(spec, f"{row.val} + k + {distance}"))
        code.line(mf.prefetch_line(spec, f"{row.col} + k + {distance}"))


def _remainder(code: _Code, spec: MotifSpec, row: _Row, step: int, statement: str) -> None:
    """The entries the main loop left (``statement`` with {t} for the term)."""
    if step == 1 or spec.mistake == NO_BOUNDARY:
        return
    bound = f"k <= {row.end}" if spec.mistake == OFF_BY_ONE else f"k < {row.end}"
    code.open(f"for (; {bound}; k++)")
    code.line(statement.format(t=_term(spec, row, "k")))
    code.close()


def _scalar_row(code: _Code, spec: MotifSpec, row: _Row) -> None:
    u = spec.unroll
    first = "y[i]" if spec.mistake == NO_ZERO else "0.0"
    code.line("double " + ", ".join(f"s{t} = {first if t == 0 else '0.0'}" for t in range(u)) + ";")
    if u == 1 and spec.mistake == OFF_BY_ONE:
        code.open(f"for (int k = {row.first}; k <= {row.end}; k++)")
    else:
        _k_loop(code, spec, row, u)
    for t in range(u):
        code.line(f"s{t} += {_term(spec, row, _at('k', t))};")
    code.close()
    _remainder(code, spec, row, u, "s0 += {t};")
    code.line("y[i] = " + " + ".join(f"s{t}" for t in range(u)) + ";")


def _in_place_row(code: _Code, spec: MotifSpec, row: _Row) -> None:
    """y[i] += each term (y already zeroed)."""
    u = spec.unroll
    if u == 1 and spec.mistake == OFF_BY_ONE:
        code.open(f"for (int k = {row.first}; k <= {row.end}; k++)")
    else:
        _k_loop(code, spec, row, u)
    code.line("y[i] += " + " + ".join(_term(spec, row, _at("k", t)) for t in range(u)) + ";")
    code.close()
    _remainder(code, spec, row, u, "y[i] += {t};")


def _vector_row(code: _Code, spec: MotifSpec, row: _Row) -> None:
    """Gathers of x by col, ``unroll`` vectors per step; a scalar remainder."""
    vec, width = _VECS[spec.simd or ""], spec.width
    names = [f"c{t}" for t in range(spec.unroll)]
    code.line(f"{vec.type} " + ", ".join(f"{n} = {vec.zero}" for n in names) + ";")
    step = spec.unroll * width
    _k_loop(code, spec, row, step)
    for t in range(spec.unroll):
        k = _at("k", t * width)
        if spec.simd == "avx512":
            code.line(f"__m256i i{t} = _mm256_loadu_si256((const __m256i *)({row.col} + {k}));")
            gather = f"_mm512_i32gather_pd(i{t}, x, 8)"
        else:
            code.line(f"__m128i i{t} = _mm_loadu_si128((const __m128i *)({row.col} + {k}));")
            gather = f"_mm256_i32gather_pd(x, i{t}, 8)"
        code.line(f"c{t} = {vec.fma}({vec.load}({row.val} + {k}), {gather}, c{t});")
    code.close()
    total = mf.hsum(spec, mf.vector_sum(spec, names))
    code.line(f"double s = {'y[i] + ' if spec.mistake == NO_ZERO else ''}{total};")
    _remainder(code, spec, row, step, "s += {t};")
    code.line("y[i] = s;")
