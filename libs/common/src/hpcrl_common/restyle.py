"""Cosmetic rewrites of a parent program, so the policy reads programs it did not write.

The catalogue renders every kernel in one house style, and a small policy trained only on it
reads any other style as noise: with hand-written parents (the evaluation set's), half its
samples were garbled text. A prompt's parent therefore goes through :func:`restyle`, which
changes what a program looks like and never what it does: comments, identifier names,
indentation, brace placement, increment spelling, tile-size macro names. Answers are never
restyled: the policy writes the house style it memorises best.

Shared by the policy bootstrap (60 % of its prompts' parents) and the scheduler
(``scheduler.restyle_parents``): in RL the parents are the policy's own programs, whose
lines (a tile size's ``#define``, an ``#include``) a child can copy, so without restyling the
policy stops writing them for parents that lack them. Measured in RL (seeds 1 and 2, 2026-12-05)
it did not help: the policy left more tile macros undefined, so the scheduler's share is 0
by default.

Pure and seeded: the same source and random state give the same text.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from hpcrl_common.task import TaskSpec

# Local names the corpus uses, with names a person might have written instead. The signature's
# names (A, B, C, M, N, K) and the function name stay: the task fixes them.
_RENAMES: dict[str, tuple[str, ...]] = {
    "i": ("row", "r", "i0", "ix"),
    "j": ("col", "c_", "j0", "jx"),
    "k": ("p", "kk_", "k0", "kx"),
    "ii": ("i_blk", "bi", "it", "i_tile"),
    "jj": ("j_blk", "bj", "jt", "j_tile"),
    "kk": ("k_blk", "bk", "kt", "k_tile"),
    "i_end": ("i_stop", "ie", "i_max", "row_end"),
    "j_end": ("j_stop", "je", "j_max", "col_end"),
    "k_end": ("k_stop", "ke", "k_max", "depth_end"),
    "sum": ("acc", "s", "total", "dot"),
    "s": ("acc", "sum_", "t", "partial"),
    "a": ("aik", "a_val", "av", "scale"),
    "BM": ("TILE_I", "BLOCK_M", "TM", "MB"),
    "BN": ("TILE_J", "BLOCK_N", "TN", "NB"),
    "BK": ("TILE_K", "BLOCK_K", "TK", "KB"),
}
GEMM_HEADERS = (
    "// Matrix multiplication C = A * B (row-major doubles).",
    "/* C = A x B; A is M x K, B is K x N, C is M x N. */",
    "// A straightforward version; correct for any M, N, K.",
    "// Written for clarity first.",
    "/* dgemm-like kernel, row-major storage */",
)
# Headers that fit any task's kernel.
NEUTRAL_HEADERS = (
    "// Written for clarity first.",
    "/* A straightforward version. */",
    "// Reference-style implementation.",
)
_LINE_NOTES = ("// main loop", "// remainder", "// accumulate", "// tile", "// inner loop")
_IDENT = re.compile(r"\b[A-Za-z_]\w*\b")
_INCREMENT = re.compile(r"\b(\w+)\+\+\)")
_OPEN_BRACE = re.compile(r"^(\s*)(.*\S)\s*\{\s*$")


def restyle(
    source: str,
    rng: random.Random,
    keep: frozenset[str] = frozenset(),
    headers: Sequence[str] = GEMM_HEADERS,
) -> str:
    """``source`` with a random choice of cosmetic rewrites applied (possibly none).

    ``keep``: identifiers never renamed (a task's signature fixes its parameters' names).
    ``headers``: the comments one of which may open the text. Neither changes which random
    numbers are drawn, so the bootstrap's examples stay the same.
    """
    text = source
    if rng.random() < 0.7:
        text = _rename(text, rng, keep)
    if rng.random() < 0.3:
        text = _INCREMENT.sub(lambda m: f"++{m.group(1)})", text)
    if rng.random() < 0.3:
        text = _allman(text)
    if rng.random() < 0.4:
        text = _reindent(text, rng.choice((2, 3, 8)))
    if rng.random() < 0.3:
        text = _line_notes(text, rng)
    if rng.random() < 0.5:
        # Drawn as from GEMM's headers whatever ``headers`` holds: the same draws either way.
        index = rng.randrange(len(GEMM_HEADERS))
        if headers:
            text = headers[index % len(headers)] + "\n" + text
    return text


def restyle_for_task(source: str, task: TaskSpec, rng: random.Random) -> str:
    """:func:`restyle` for a parent of ``task``: the names its signature fixes kept, and a
    header that fits the task (GEMM's name the product)."""
    headers = GEMM_HEADERS if task.name == "matmul" else NEUTRAL_HEADERS
    return restyle(source, rng, keep=frozenset(_IDENT.findall(task.signature)), headers=headers)


def _rename(text: str, rng: random.Random, keep: frozenset[str]) -> str:
    present = set(_IDENT.findall(_code_only(text)))
    mapping = {
        old: rng.choice(new)
        for old, new in _RENAMES.items()
        if old in present and rng.random() < 0.8
    }
    mapping = {old: new for old, new in mapping.items() if old not in keep}
    taken = present - set(mapping)
    mapping = {old: new for old, new in mapping.items() if new not in taken}
    if len(set(mapping.values())) < len(mapping):  # two olds drew one new name: keep the olds
        return text
    return "\n".join(
        line
        if line.lstrip().startswith(("//", "/*", "#include"))
        else _IDENT.sub(lambda m: mapping.get(m.group(0), m.group(0)), line)
        for line in text.split("\n")
    )


def _code_only(text: str) -> str:
    return "\n".join(
        line for line in text.split("\n") if not line.lstrip().startswith(("//", "/*", "#include"))
    )


def _allman(text: str) -> str:
    """Opening braces on lines of their own."""
    out = []
    for line in text.split("\n"):
        match = _OPEN_BRACE.match(line)
        if match and not match.group(2).startswith(("//", "#", "}")) and match.group(2)[-1:] != "=":
            out += [f"{match.group(1)}{match.group(2)}", f"{match.group(1)}{{"]
        else:
            out.append(line)
    return "\n".join(out)


def _reindent(text: str, width: int) -> str:
    """Indentation of 4 spaces per level becomes ``width``."""
    out = []
    for line in text.split("\n"):
        stripped = line.lstrip(" ")
        levels, rest = divmod(len(line) - len(stripped), 4)
        out.append(" " * (levels * width + rest) + stripped)
    return "\n".join(out)


def _line_notes(text: str, rng: random.Random) -> str:
    """A few short comments above loops."""
    out = []
    for line in text.split("\n"):
        stripped = line.lstrip()
        if stripped.startswith("for ") and rng.random() < 0.3:
            out.append(line[: len(line) - len(stripped)] + rng.choice(_LINE_NOTES))
        out.append(line)
    return "\n".join(out)
