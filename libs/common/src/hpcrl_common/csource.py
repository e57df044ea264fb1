"""Comments and literals of C source, told apart from code: one lexer for every service.

Pure functions on text, no I/O. The benchmarker blanks comments and literals before its checks
(a technique named in a comment or a string must not count); the scheduler drops comments and
keeps literals verbatim when it normalises a program into a pool key. Both read comments and
literals with the same rules, defined here once:

- ``//`` runs to the end of its line, ``/*`` to the next ``*/`` (or the end of the text);
- a string or character literal runs to its closing quote on the same line, a backslash
  escaping the next character (a backslash-newline included);
- ``open_literals``: whether an opening quote that is never closed on its line still starts a
  literal, running to the end of that line (the benchmarker reads it so), or is plain code
  (the scheduler does).

``pieces`` is lossless (the pieces joined are the source). Everything here takes linear time:
the benchmarker runs it on untrusted text of up to a megabyte.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Literal, NamedTuple

Kind = Literal["code", "comment", "literal"]

_COMMENT = r"//[^\n]*|/\*.*?(?:\*/|\Z)"
# A literal, its closing quote (group 1) optional: empty when the literal is unclosed.
_LITERAL = {quote: re.compile(rf"{quote}(?:\\.|[^{quote}\\\n])*({quote}?)", re.DOTALL)
            for quote in "\"'"}
_COMMENTS = re.compile(_COMMENT, re.DOTALL)
_OPEN = re.compile("|".join([_COMMENT, *(p.pattern for p in _LITERAL.values())]), re.DOTALL)
_START = re.compile(r"""//|/\*|["']""")
# A backslash-newline and the rest of the next line (up to its newline or next backslash).
_SPLICE = re.compile(r"\\\n([^\n\\]*)")
_NOT_NEWLINE = re.compile(r"[^\n]")


class Piece(NamedTuple):
    kind: Kind
    text: str


def pieces(source: str, *, open_literals: bool = False) -> Iterator[Piece]:
    """The source as consecutive code, comment and literal pieces (no empty ones)."""
    position = 0
    for start, end in _lexemes(source, open_literals):
        if start > position:
            yield Piece("code", source[position:start])
        yield Piece("comment" if source[start] == "/" else "literal", source[start:end])
        position = end
    if position < len(source):
        yield Piece("code", source[position:])


def _lexemes(source: str, open_literals: bool) -> Iterator[tuple[int, int]]:
    """(start, end) of each comment and literal, leftmost first.

    Without ``open_literals`` an unclosed quote is code and the scan goes on right after it.
    Every later quote of the same kind up to where that literal would have ended is then
    unclosed too (it is an escaped one, and the text after it is the same tail), so it is
    passed over without reading that tail again: linear time, where retrying each of them
    (``"\\"\\"\\"...``) would be quadratic.
    """
    unclosed_until = {'"': -1, "'": -1}
    position = 0
    while (found := _START.search(source, position)) is not None:
        start = found.start()
        quote = source[start]
        if quote == "/":
            end = _end(_COMMENTS.match(source, start))
            yield start, end
            position = end
            continue
        if start < unclosed_until[quote]:
            position = start + 1
            continue
        literal = _LITERAL[quote].match(source, start)
        end = _end(literal)
        if open_literals or (literal is not None and literal.group(1)):
            yield start, end
            position = end
            continue
        unclosed_until[quote] = end
        position = start + 1


def _end(match: re.Match[str] | None) -> int:
    assert match is not None  # a comment or a literal can begin wherever _START matched
    return match.end()


def join_splices(source: str) -> str:
    """Translation phase 2: each backslash-newline joins two lines. The length stays the same
    (the two characters become two spaces at the end of the joined line), so offsets past the
    joined line stay valid; the line count drops by one per splice."""
    return _SPLICE.sub(lambda m: m.group(1) + "  ", source)


def blank_comments_and_literals(source: str) -> str:
    """What a check may read: splices joined, every comment blanked (each character but a
    newline becomes a space, so lines and ``#`` directives keep their places), every literal
    reduced to its quotes around spaces. Unclosed literals are read as open (to the end of
    their line). A literal of one character, an opening quote right at the end of a line,
    comes out as two quotes."""
    return _OPEN.sub(_blank, join_splices(source))


def _blank(match: re.Match[str]) -> str:
    text = match.group(0)
    if text[0] == "/":
        return _NOT_NEWLINE.sub(" ", text)
    quote = text[0]
    return quote + " " * max(len(text) - 2, 0) + quote
