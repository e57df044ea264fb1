"""5-point Jacobi stencil kernels (v from u, N rows of M points) from a :class:`MotifSpec`.

Forms: ``two_pass`` (copy the whole grid, then sweep the interior), ``edges`` (copy only the
boundary, then sweep) and ``fused`` (row by row: a boundary row copied, an interior row
swept between its two copied end points). The sweep takes one or two rows per pass (row
pointers shared between them), unrolled or vector columns, interior tiles, OpenMP over rows
or tiles, and a prefetch of the row below.
"""

from __future__ import annotations

from hpcrl_bootstrap import motifs as mf
from hpcrl_bootstrap.corpus import _VECS, NO_BOUNDARY, OFF_BY_ONE, WRONG_STRIDE, _Code
from hpcrl_bootstrap.motifs import SKIP_BOUNDARY_COPY, MotifSpec

SIGNATURE = "void stencil_optimized(const double *u, double *v, int N, int M)"


def render(spec: MotifSpec) -> str:
    code = _Code()
    code.open(SIGNATURE)
    if spec.simd:
        vec = _VECS[spec.simd]
        code.line(f"const {vec.type} quarter = {vec.set1}(0.25);")
    if spec.form == "fused":
        _fused(code, spec)
    else:
        if spec.mistake != SKIP_BOUNDARY_COPY:
            (_copy_all if spec.form == "two_pass" else _copy_edges)(code, spec)
        if spec.tile is not None:
            _tiled(code, spec)
        else:
            _sweep(code, spec, ("1", "N - 1"), (_first_column(spec), "M - 1"), bool(spec.omp))
    code.close()
    defines = {"TI": spec.tile[0], "TJ": spec.tile[1]} if spec.tile else {}
    return mf.head(spec, defines) + code.text()


def _ld(spec: MotifSpec) -> str:
    """The row length (the wrong-stride mistake takes the number of rows)."""
    return "N" if spec.mistake == WRONG_STRIDE else "M"


def _first_column(spec: MotifSpec) -> str:
    """The sweep's first column (the off-by-one mistake sweeps the left boundary too)."""
    return "0" if spec.mistake == OFF_BY_ONE else "1"


def _copy_all(code: _Code, spec: MotifSpec) -> None:
    if spec.omp:
        code.line(mf.omp_pragma(spec, chunk=16))
    code.open("for (int i = 0; i < N; i++)")
    code.open("for (int j = 0; j < M; j++)")
    code.line("v[(long)i * M + j] = u[(long)i * M + j];")
    code.close()
    code.close()


def _copy_edges(code: _Code, spec: MotifSpec) -> None:
    """The first and last rows, then the first and last points of the rows between."""
    code.open("for (int j = 0; j < M; j++)")
    code.line("v[j] = u[j];")
    code.line("v[(long)(N - 1) * M + j] = u[(long)(N - 1) * M + j];")
    code.close()
    code.open("for (int i = 1; i < N - 1; i++)")
    code.line("v[(long)i * M] = u[(long)i * M];")
    code.line("v[(long)i * M + M - 1] = u[(long)i * M + M - 1];")
    code.close()


def _tiled(code: _Code, spec: MotifSpec) -> None:
    """Interior tiles of TI rows and TJ columns (to threads, collapsed when static)."""
    if spec.omp:
        code.line(mf.omp_pragma(spec, chunk=1, collapse=spec.omp == "static"))
    code.open(mf.tile_head(spec, "ii", "1", "TI", "N - 1"))
    code.open(mf.tile_head(spec, "jj", _first_column(spec), "TJ", "M - 1"))
    mf.clamp(code, "i_end", "ii", "TI", "N - 1")
    mf.clamp(code, "j_end", "jj", "TJ", "M - 1")
    _sweep(code, spec, ("ii", "i_end"), ("jj", "j_end"), pragma=False)
    code.close()
    code.close()


def _sweep(
    code: _Code, spec: MotifSpec, irange: tuple[str, str], jrange: tuple[str, str], pragma: bool
) -> None:
    """Interior rows of irange, columns of jrange, ``spec.rows`` rows per pass."""
    (i0, i1), r = irange, spec.rows
    blocked = r > 1
    if blocked:
        code.line(f"int i_main = {i1} - ({i1} - {i0}) % {r};")
    if pragma:
        code.line(mf.omp_pragma(spec, chunk=16))
    step = "i++" if r == 1 else f"i += {r}"
    code.open(f"for (int i = {i0}; i < {'i_main' if blocked else i1}; {step})")
    _pointers(code, spec, r)
    _columns(code, spec, r, jrange)
    code.close()
    if blocked and spec.mistake != NO_BOUNDARY:  # the last row alone, plainly (short code)
        code.open(f"for (int i = i_main; i < {i1}; i++)")
        _pointers(code, spec, 1)
        code.open(f"for (int j = {jrange[0]}; j < {jrange[1]}; j++)")
        code.line(_point(0, 0))
        code.close()
        code.close()


def _pointers(code: _Code, spec: MotifSpec, rows: int) -> None:
    """r0 .. r{rows+1}: the input rows from i-1 down; o0 .. : the output rows from i."""
    ld = _ld(spec)
    ins = [f"*r0 = u + (long)(i - 1) * {ld}"] + [
        f"*r{n} = r{n - 1} + {ld}" for n in range(1, rows + 2)
    ]
    outs = [f"*o0 = v + (long)i * {ld}"] + [f"*o{n} = o{n - 1} + {ld}" for n in range(1, rows)]
    code.line("const double " + ", ".join(ins) + ";")
    code.line("double " + ", ".join(outs) + ";")


def _at(offset: int) -> str:
    """Column j + offset, written as people write it."""
    return "j" if offset == 0 else f"j + {offset}" if offset > 0 else f"j - {-offset}"


def _point(q: int, t: int) -> str:
    """Output row q, column j + t, scalar."""
    j, w, e = _at(t), _at(t - 1), _at(t + 1)
    return f"o{q}[{j}] = 0.25 * (r{q}[{j}] + r{q + 2}[{j}] + r{q + 1}[{w}] + r{q + 1}[{e}]);"


def _columns(code: _Code, spec: MotifSpec, rows: int, jrange: tuple[str, str]) -> None:
    """The j loop of ``rows`` output rows: unrolled or vector, then the remainder columns."""
    j0, j1 = jrange
    step = spec.unroll * spec.width
    bounded = spec.mistake != NO_BOUNDARY
    if step == 1:
        code.open(f"for (int j = {j0}; j < {j1}; j++)")
    else:
        code.line(f"int j = {j0};")
        code.open(f"for (; j + {step} <= {j1}; j += {step})")
    if spec.prefetch:
        code.line(mf.prefetch_line(spec, f"r{rows + 1} + j + {spec.prefetch[1]}"))
    for t in range(spec.unroll):
        for q in range(rows):
            _vector_point(code, spec, q, t) if spec.simd else code.line(_point(q, t))
    code.close()
    if step > 1 and bounded:
        code.open(f"for (; j < {j1}; j++)")
        for q in range(rows):
            code.line(_point(q, 0))
        code.close()


def _vector_point(code: _Code, spec: MotifSpec, q: int, t: int) -> None:
    vec = _VECS[spec.simd or ""]
    first = t * spec.width
    j, w, e = _at(first), _at(first - 1), _at(first + 1)
    ns = f"{vec.add}({vec.load}(r{q} + {j}), {vec.load}(r{q + 2} + {j}))"
    we = f"{vec.add}({vec.load}(r{q + 1} + {w}), {vec.load}(r{q + 1} + {e}))"
    code.line(f"{vec.type} ns{q}{t} = {ns};")
    code.line(f"{vec.type} we{q}{t} = {we};")
    code.line(f"{vec.store}(o{q} + {j}, {vec.mul}(quarter, {vec.add}(ns{q}{t}, we{q}{t})));")


def _fused(code: _Code, spec: MotifSpec) -> None:
    """Row by row: a boundary row copied; an interior row's end points copied, the rest swept."""
    copy = spec.mistake != SKIP_BOUNDARY_COPY
    if spec.omp:
        code.line(mf.omp_pragma(spec, chunk=16))
    code.open("for (int i = 0; i < N; i++)")
    code.open("if (i == 0 || i == N - 1)")
    if copy:
        code.open("for (int j = 0; j < M; j++)")
        code.line("v[(long)i * M + j] = u[(long)i * M + j];")
        code.close()
    code.line("continue;")
    code.close()
    _pointers(code, spec, 1)
    if copy:  # before the sweep: a sweep past its end (a mistake) must show
        code.line("o0[0] = r1[0];")
        code.line("o0[M - 1] = r1[M - 1];")
    _columns(code, spec, 1, (_first_column(spec), "M - 1"))
    code.close()
