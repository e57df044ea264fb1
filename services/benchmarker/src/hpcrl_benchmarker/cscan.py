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
        for m in re.finditer(r"^\s*(?:#|%:)\s*pragma\b([^\n]*)", code, re.MULTILINE)
    ]
    operators = re.finditer(r"_Pragma\s*\(\s*\"([^\"]*)\"", code)
    found += [" ".join(m.group(1).split()) for m in operators]
    return found


# gcc writes its line markers at the start of a line: split on "\n" only (str.splitlines would
# also split on form feeds and other characters a kernel could smuggle into a line). The
# pattern starts with a literal so that the search skips ahead quickly through large headers.
_LINE_MARKER = re.compile(r'\n#[ \t]*\d+[ \t]+"((?:\\.|[^"\\\n])*)"[^\n]*')


def main_file_lines(preprocessed: str, main_file: str) -> str:
    """The lines of a ``gcc -E`` output that came from ``main_file`` (not from headers)."""
    keep: list[str] = []
    current: str | None = None
    start = 0
    text = "\n" + preprocessed  # every line, the first included, now follows a newline
    for marker in _LINE_MARKER.finditer(text):
        if current is not None and current.endswith(main_file):
            keep.append(text[start:marker.start()])
        current, start = marker.group(1), marker.end()
    if current is not None and current.endswith(main_file):
        keep.append(text[start:])
    return "\n".join(chunk.strip("\n") for chunk in keep if chunk.strip("\n"))
