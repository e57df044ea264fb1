"""Restyling any text a policy may have written: it never fails and keeps what it must."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from hpcrl_common.restyle import restyle_for_task
from hpcrl_common.task import load_task

MATMUL = load_task("matmul")
# Pieces of C a parent is made of, hostile ones among them: an unterminated comment, a
# string, a pragma naming loop variables, the names restyle renames and those it must not.
PIECES = st.sampled_from(
    [
        MATMUL.signature + " {",
        "}",
        "#define BM 64",
        "#include <immintrin.h>",
        "#pragma omp parallel for private(i, j)",
        "for (int i = 0; i < M; i++) {",
        "    double sum = 0.0; double s = sum; int row = i;",
        '    const char *note = "i j k sum";',
        "/* unterminated",
        "    C[i * N + j] += A[i * K + k] * B[k * N + j];",
        "    __m256d acc = _mm256_setzero_pd();",
        "",
        "\t  \t",
    ]
)


@settings(max_examples=300, deadline=None)
@given(lines=st.lists(st.one_of(PIECES, st.text(max_size=40)), max_size=30), seed=st.integers())
def test_any_parent_restyles_without_failing_and_keeps_the_signature(lines, seed) -> None:
    source = "\n".join(lines)
    text = restyle_for_task(source, MATMUL, random.Random(seed))
    assert isinstance(text, str)
    assert text.count(MATMUL.signature) >= source.count(MATMUL.signature)
    assert restyle_for_task(source, MATMUL, random.Random(seed)) == text
