"""The checks' lexer against gcc itself: over a fuzzed corpus of the constructs that decide
where comments and literals begin and end (raw strings and their prefixes, splices with and
without white space, CR and CRLF line ends, trigraph look-alikes, UCNs, unclosed quotes), every
marker identifier is code, comment or literal to ``hpcrl_common.csource`` exactly when it is to
``gcc -E`` with the task's flags.

How gcc says which: every marker ``M<k>`` is defined as a macro ``CODE<k>``. In gcc's output,
``CODE<k>`` means the marker was code (expanded), ``M<k>`` that it was inside a literal (kept,
not expanded), neither that it was inside a comment (dropped). Sources that gcc refuses (a
nonzero exit: they would never compile) are skipped.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcrl_common.csource import blank_comments_and_literals, lex, unreadable
from hpcrl_common.task import load_task

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

FLAGS = load_task("matmul").compile_flags("O3")
MARKER = "\x01"  # where a marker goes; numbered when the source is built

FRAGMENTS = [
    MARKER,
    MARKER,
    MARKER,
    " ",
    "\n",
    "\r",
    "\r\n",
    "\t",
    "\f",
    "\v",
    '"',
    "'",
    "\\",
    "/",
    "*",
    "//",
    "/*",
    "*/",
    ";",
    "(",
    ")",
    "x",
    "1",
    ".",
    "e+",
    "$",
    'R"',
    'u8R"',
    'LR"',
    'uR"',
    'UR"',
    'xR"',
    '1R"',
    'u8"',
    "L'",
    'R"(',
    ')"',
    'R"d(',
    ')d"',
    'R"(/*',
    '*/)"',
    ")d",
    "d",
    "R",
    "\\\n",
    "\\ \n",
    "\\\t\n",
    "\\\r\n",
    "\\\r",
    "\\  \r\n",
    "\\\f\n",
    "??/",
    "??/\n",
    "??'",
    "\\u00C0",
    "\\U0001F600",
    "\u00e9",
    "\\'",
    '\\"',
    "<:",
    ":>",
    "<%",
    "%>",
]

# Inside a raw string or a comment built whole: anything but what would end it early.
INNER = [f for f in FRAGMENTS if "R" not in f and "*/" not in f and ")" not in f]
fragment = st.sampled_from(FRAGMENTS)
inner = st.lists(st.sampled_from(INNER), max_size=8)
raw_string = st.tuples(
    st.sampled_from(["", "u8", "u", "U", "L"]),
    st.sampled_from(["", "d", "x", "ab", "'", '"', "/*", "//", "a)b", "_{}[]#<>%:;.?*+-/^"]),
    inner,
).map(lambda t: [f'{t[0]}R"{t[1]}(', *t[2], f'){t[1]}"'])
comment = inner.map(lambda t: ["/*", *t, "*/"])
sources = st.lists(st.one_of(fragment.map(lambda f: [f]), raw_string, comment), max_size=16).map(
    lambda items: [f for item in items for f in item]
)


def build(fragments: list[str]) -> tuple[str, list[int]]:
    """The source and the offset of each marker's name in it."""
    parts: list[str] = []
    offsets: list[int] = []
    length = 0
    for fragment in fragments:
        if fragment == MARKER:
            fragment = f" M{len(offsets)} "
            offsets.append(length + 1)
        parts.append(fragment)
        length += len(fragment)
    return "".join(parts), offsets


def gcc_kinds(source: str, count: int, tmp: Path) -> list[str] | None:
    defines = "".join(f"#define M{k} CODE{k}\n" for k in range(count))
    path = tmp / "kernel.c"
    path.write_text(defines + source + "\n", encoding="utf-8", newline="")
    done = subprocess.run(
        ["gcc", *FLAGS, "-E", "-P", "-w", str(path)],
        capture_output=True,
        text=True,
        errors="replace",
    )
    if done.returncode != 0:
        return None
    code = {int(k) for k in re.findall(r"\bCODE(\d+)\b", done.stdout)}
    kept = {int(k) for k in re.findall(r"\bM(\d+)\b", done.stdout)}
    return ["code" if k in code else "literal" if k in kept else "comment" for k in range(count)]


def lexer_kinds(source: str, offsets: list[int]) -> list[str]:
    lexed = lex(source)
    physical_starts, removed = [], 0
    for logical_offset, size in lexed.splices:
        physical_starts.append((logical_offset + removed, size))
        removed += size
    kinds = []
    for physical in offsets:
        logical = physical - sum(size for start, size in physical_starts if start < physical)
        token = next(t for t in lexed.tokens if t.start <= logical < t.end)
        kinds.append(
            "literal"
            if token.kind in ("string", "char", "raw")
            else "comment"
            if token.kind == "comment"
            else "code"
        )
    return kinds


def check_against_gcc(fragments: list[str], tmp: Path) -> None:
    source, offsets = build(fragments)
    expected = gcc_kinds(source, len(offsets), tmp)
    if expected is None:
        return
    assert lexer_kinds(source, offsets) == expected, (source, unreadable(source))
    blanked = blank_comments_and_literals(source)
    seen = {int(k) for k in re.findall(r"\bM(\d+)\b", blanked)}
    assert seen == {k for k, kind in enumerate(expected) if kind == "code"}, source


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(fragments=sources)
def test_the_lexer_reads_comments_and_literals_as_gcc_does(
    fragments: list[str], tmp_path: Path
) -> None:
    check_against_gcc(fragments, tmp_path)


# Hand-written cases: each construct the issue names, with markers where a lexer that gets it
# wrong would put code into a comment or a literal (or the reverse).
CASES = {
    "raw string holding a comment opener": ['R"x(/* "', MARKER, ')x"', MARKER, '"*/"'],
    "raw string holding a quote": ['u8R"(")', MARKER, '/*)"', MARKER, "/* */"],
    "raw string, quote delimiter": ['LR"\'(")', MARKER, "/*)'\"", MARKER],
    "raw string's end split by a splice is no end": [
        'R"q(',
        MARKER,
        ')q\\\n"',
        MARKER,
        ')q"',
        MARKER,
    ],
    "raw string over lines": ['uR"(', MARKER, "\n// ", MARKER, '\n)"', MARKER],
    "identifier before R: no raw string": ['xR"(', MARKER, ')"', MARKER],
    "pp-number before R: no raw string": ['1R"(', MARKER, ')"', MARKER],
    "splice with white space ends a line comment's line": ["// c\\ \t", "\n", MARKER],
    "splice with white space in a string": ['"a\\  ', "\n", MARKER, '"', MARKER],
    "CR ends a line comment": ["// c", "\r", MARKER],
    "CRLF splice": ["// c\\", "\r\n", MARKER, "\n", MARKER],
    "trigraph look-alike is no splice": ["// c ??/", "\n", MARKER],
    "UCN in an identifier": ["\\u00C0", MARKER, '"', MARKER, '"', MARKER],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hand_written_cases_read_as_gcc_reads_them(name: str, tmp_path: Path) -> None:
    source, offsets = build(CASES[name])
    assert gcc_kinds(source, len(offsets), tmp_path) is not None, "gcc refuses the case"
    check_against_gcc(CASES[name], tmp_path)
