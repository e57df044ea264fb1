"""Why a sample did not compile, read from gcc's first error: the causes a policy drifts into.

Experiment 2's losses of share correct were compile errors of a few kinds, each a line the
policy's own parents always carry and a hand-written parent does not: a tile size used and
never ``#define``d, intrinsics without ``<immintrin.h>``, a loop variable never declared.
Counting them per version shows such a drift where share correct only shows a loss.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

UNDEFINED_MACRO = "undefined macro"
UNDECLARED_VARIABLE = "undeclared variable"
NO_INTRINSICS_HEADER = "SIMD without <immintrin.h>"
INTRINSIC_ARGUMENTS = "intrinsic's arguments"
SYNTAX = "syntax"
OTHER = "other"
CAUSES = (
    UNDEFINED_MACRO,
    UNDECLARED_VARIABLE,
    NO_INTRINSICS_HEADER,
    INTRINSIC_ARGUMENTS,
    SYNTAX,
    OTHER,
)

_FIRST_ERROR = re.compile(r"\berror: (.*)")
_UNDECLARED = re.compile(r"'(\w+)' undeclared")
# What gcc says of an intrinsic or vector type without its header.
_INTRINSIC = re.compile(r"(unknown type name|implicit declaration of function) '(_mm|__m)")
# An intrinsic called with too few or too many arguments (a fused multiply-add given two).
_INTRINSIC_CALL = re.compile(r"too (few|many) arguments to function '_mm")


def compile_error_cause(error: str) -> str:
    """One of :data:`CAUSES` for a compile error's text (the benchmarker's, gcc's messages)."""
    match = _FIRST_ERROR.search(error)
    if match is None:
        return OTHER
    message = match.group(1)
    if _INTRINSIC.match(message):
        return NO_INTRINSICS_HEADER
    if _INTRINSIC_CALL.match(message):
        return INTRINSIC_ARGUMENTS
    undeclared = _UNDECLARED.match(message)
    if undeclared is not None:
        name = undeclared.group(1)
        if name.startswith(("_mm", "__m")):
            return NO_INTRINSICS_HEADER
        # Tile sizes and block shapes are named in capitals (BM, TILE_I, MR) by convention.
        return UNDEFINED_MACRO if name.isupper() else UNDECLARED_VARIABLE
    if message.startswith("expected"):
        return SYNTAX
    return OTHER


def compile_error_causes(samples: Iterable[tuple[str, str]]) -> Counter[str]:
    """Cause -> count over (status, error) pairs; samples of another status are not counted."""
    return Counter(
        compile_error_cause(error) for status, error in samples if status == "compile_error"
    )
