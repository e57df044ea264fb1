"""GEMV kernels (y = A x, row-major A of M x N) rendered from a :class:`MotifSpec`.

Forms: ``dot`` (a dot product per row: several rows per pass share x's loads, unrolled
accumulators or vectors, column tiles that keep a piece of x in cache, rows shared out to
threads) and ``axpy`` (column by column, y += A[:, j] x[j]: slow, strided, stage 1 only).
"""

from __future__ import annotations

from hpcrl_bootstrap import motifs as mf
from hpcrl_bootstrap.corpus import (
    _VECS,
    NO_BOUNDARY,
    NO_ZERO,
    OFF_BY_ONE,
    WRONG_STRIDE,
    _Code,
    _plus,
)
from hpcrl_bootstrap.motifs import MotifSpec

SIGNATURE = "void gemv_optimized(const double *A, const double *x, double *y, int M, int N)"


def render(spec: MotifSpec) -> str:
    code = _Code()
    code.open(SIGNATURE)
    if spec.form == "axpy":
        _axpy(code, spec)
    elif spec.tile is not None:
        _tiled(code, spec)
    else:
        _rows(code, spec, ("0", "M"), ("0", "N"), spec.mistake == NO_ZERO, bool(spec.omp))
    code.close()
    defines = {"TI": spec.tile[0], "TJ": spec.tile[1]} if spec.tile else {}
    return mf.head(spec, defines, hsum=bool(spec.simd)) + code.text()


def _ld(spec: MotifSpec) -> str:
    """A's row length (the wrong-stride mistake takes the number of rows)."""
    return "M" if spec.mistake == WRONG_STRIDE else "N"


def _bound(spec: MotifSpec, var: str, limit: str) -> str:
    return f"{var} <= {limit}" if spec.mistake == OFF_BY_ONE else f"{var} < {limit}"


def _tiled(code: _Code, spec: MotifSpec) -> None:
    """Row tiles (to threads) of column tiles: y's rows zeroed, then summed tile by tile."""
    if spec.omp:
        code.line(mf.omp_pragma(spec, chunk=1))
    code.open(mf.tile_head(spec, "ii", "0", "TI", "M"))
    mf.clamp(code, "i_end", "ii", "TI", "M")
    if spec.mistake != NO_ZERO:
        code.open("for (int i = ii; i < i_end; i++)")
        code.line("y[i] = 0.0;")
        code.close()
    code.open(mf.tile_head(spec, "jj", "0", "TJ", "N"))
    mf.clamp(code, "j_end", "jj", "TJ", "N")
    _rows(code, spec, ("ii", "i_end"), ("jj", "j_end"), accumulate=True, pragma=False)
    code.close()
    code.close()


def _rows(
    code: _Code,
    spec: MotifSpec,
    irange: tuple[str, str],
    jrange: tuple[str, str],
    accumulate: bool,
    pragma: bool,
) -> None:
    """y[i] (+)= A[i, j0:j1] . x[j0:j1] for i in irange, ``spec.rows`` rows per pass."""
    (i0, i1), r = irange, spec.rows
    blocked = r > 1
    if blocked:
        span = i1 if i0 == "0" else f"({i1} - {i0})"
        code.line(f"int i_main = {i1} - {span} % {r};")
    if pragma:
        code.line(mf.omp_pragma(spec, chunk=16))
    step = "i++" if r == 1 else f"i += {r}"
    code.open(f"for (int i = {i0}; i < {'i_main' if blocked else i1}; {step})")
    _row_body(code, spec, r, jrange, accumulate)
    code.close()
    if blocked and spec.mistake != NO_BOUNDARY:  # the last rows one at a time, plainly
        j0, j1 = jrange
        code.open(f"for (int i = i_main; i < {i1}; i++)")
        code.line("double s = 0.0;")
        code.open(f"for (int j = {j0}; {_bound(spec, 'j', j1)}; j++)")
        code.line(f"s += A[(long)i * {_ld(spec)} + j] * x[j];")
        code.close()
        code.line(f"y[i] {'+=' if accumulate else '='} s;")
        code.close()


def _row_body(
    code: _Code, spec: MotifSpec, rows: int, jrange: tuple[str, str], accumulate: bool
) -> None:
    for q in range(rows):
        code.line(f"const double *a{q} = A + (long){_paren(_plus('i', q))} * {_ld(spec)};")
    sums = (_vector_sums if spec.simd else _scalar_sums)(code, spec, rows, jrange)
    op = "+=" if accumulate else "="
    for q in range(rows):
        code.line(f"y[{_plus('i', q)}] {op} {sums[q]};")


def _paren(expr: str) -> str:
    return f"({expr})" if " " in expr else expr


def _prefetch(code: _Code, spec: MotifSpec, rows: int) -> None:
    if spec.prefetch:
        for q in range(rows):
            code.line(mf.prefetch_line(spec, f"a{q} + j + {spec.prefetch[1]}"))


def _scalar_sums(code: _Code, spec: MotifSpec, rows: int, jrange: tuple[str, str]) -> list[str]:
    """Scalar accumulators over the row's columns; the expression of each row's sum."""
    (j0, j1), u = jrange, spec.unroll
    names = [[f"s{q}{t}" for t in range(u)] for q in range(rows)]
    code.line("double " + ", ".join(f"{n} = 0.0" for row in names for n in row) + ";")
    if u == 1:
        code.open(f"for (int j = {j0}; {_bound(spec, 'j', j1)}; j++)")
    else:
        code.line(f"int j = {j0};")
        code.open(f"for (; j + {u} <= {j1}; j += {u})")
    _prefetch(code, spec, rows)
    for q in range(rows):
        for t in range(u):
            code.line(f"s{q}{t} += a{q}[{_plus('j', t)}] * x[{_plus('j', t)}];")
    code.close()
    if u > 1 and spec.mistake != NO_BOUNDARY:
        code.open(f"for (; {_bound(spec, 'j', j1)}; j++)")
        for q in range(rows):
            code.line(f"s{q}0 += a{q}[j] * x[j];")
        code.close()
    return [" + ".join(row) for row in names]


def _vector_sums(code: _Code, spec: MotifSpec, rows: int, jrange: tuple[str, str]) -> list[str]:
    """Vector accumulators, reduced to a scalar per row, then the remainder columns."""
    (j0, j1), u, width = jrange, spec.unroll, spec.width
    vec = _VECS[spec.simd or ""]
    names = [[f"c{q}{t}" for t in range(u)] for q in range(rows)]
    code.line(f"{vec.type} " + ", ".join(f"{n} = {vec.zero}" for row in names for n in row) + ";")
    code.line(f"int j = {j0};")
    step = u * width
    code.open(f"for (; j + {step} <= {j1}; j += {step})")
    _prefetch(code, spec, rows)
    for t in range(u):
        code.line(f"{vec.type} x{t} = {vec.load}(x + {_plus('j', t * width)});")
    for q in range(rows):
        for t in range(u):
            load = f"{vec.load}(a{q} + {_plus('j', t * width)})"
            code.line(f"c{q}{t} = {vec.fma}({load}, x{t}, c{q}{t});")
    code.close()
    for q in range(rows):
        code.line(f"double s{q} = {mf.hsum(spec, mf.vector_sum(spec, names[q]))};")
    if spec.mistake != NO_BOUNDARY:
        code.open(f"for (; {_bound(spec, 'j', j1)}; j++)")
        for q in range(rows):
            code.line(f"s{q} += a{q}[j] * x[j];")
        code.close()
    return [f"s{q}" for q in range(rows)]


def _axpy(code: _Code, spec: MotifSpec) -> None:
    """Column by column: y zeroed, then y += A[:, j] * x[j] (rows unrolled by ``unroll``)."""
    u, ld = spec.unroll, _ld(spec)
    if spec.mistake != NO_ZERO:
        code.open("for (int i = 0; i < M; i++)")
        code.line("y[i] = 0.0;")
        code.close()
    code.open(f"for (int j = 0; {_bound(spec, 'j', 'N')}; j++)")
    code.line("double xj = x[j];")
    if u == 1:
        code.open("for (int i = 0; i < M; i++)")
    else:
        code.line("int i = 0;")
        code.open(f"for (; i + {u} <= M; i += {u})")
    for t in range(u):
        row = _paren(_plus("i", t))
        code.line(f"y[{_plus('i', t)}] += A[(long){row} * {ld} + j] * xj;")
    code.close()
    if u > 1 and spec.mistake != NO_BOUNDARY:
        code.open("for (; i < M; i++)")
        code.line(f"y[i] += A[(long)i * {ld} + j] * xj;")
        code.close()
    code.close()
