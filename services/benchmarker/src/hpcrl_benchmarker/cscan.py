"""Lexical helpers on C source: blank out comments and literals, read preprocessor output.

Everything here is pure and works on text; the checks that use it must not be fooled by a
technique mentioned in a comment or a string, so those are replaced by spaces (newlines kept,
so line numbers and ``#`` directives survive).
"""

from __future__ import annotations

import re

_TOKEN = re.compile(
    r"""//[^\n]*|/\*.*?(\*/|\Z)|"(\\.|[^"\\\n])*"?|'(\\.|[^'\\\n])*'?""", re.DOTALL
)


def strip_comments_and_strings(source: str) -> str:
    """Comments become spaces; string and char literals keep their quotes, lose contents."""
    # Line splices join lines (translation phase 2); keep the length by moving the newline.
    source = re.sub(r"\\\n([^\n\\]*)", lambda m: m.group(1) + "  ", source)

    def blank(match: re.Match[str]) -> str:
        text = match.group(0)
        if text.startswith(("//", "/*")):
            return re.sub(r"[^\n]", " ", text)  # same length: offsets stay valid
        quote = text[0]
        return quote + " " * max(len(text) - 2, 0) + quote

    return _TOKEN.sub(blank, source)


def pragma_text(code: str) -> list[str]:
    """Every ``#pragma`` line and ``_Pragma("...")`` operand, whitespace-normalised.

    Needs the unstripped source for _Pragma (its operand is a string literal).
    """
    found = [
        " ".join(m.group(1).split())
        for m in re.finditer(r"^\s*#\s*pragma\b([^\n]*)", code, re.MULTILINE)
    ]
    operators = re.finditer(r"_Pragma\s*\(\s*\"([^\"]*)\"", code)
    found += [" ".join(m.group(1).split()) for m in operators]
    return found


_LINE_MARKER = re.compile(r'^#\s*(\d+)\s+"((?:\\.|[^"\\])*)"')


def main_file_lines(preprocessed: str, main_file: str) -> str:
    """The lines of a ``gcc -E`` output that came from ``main_file`` (not from headers)."""
    keep: list[str] = []
    current = None
    for line in preprocessed.splitlines():
        marker = _LINE_MARKER.match(line)
        if marker:
            current = marker.group(2)
            continue
        if current is not None and current.endswith(main_file):
            keep.append(line)
    return "\n".join(keep)
