"""Comments and literals of C source, told apart from code: one lexer for every service.

Pure functions on text, no I/O. The benchmarker blanks comments and literals before its checks
(a technique named in a comment or a string must not count); the scheduler drops comments and
keeps literals verbatim when it normalises a program into a pool key.

Two readings live here:

- ``tokens``, ``blank_comments_and_literals``, ``unreadable``: what gcc's preprocessor reads,
  for the benchmarker's checks, which must see the code gcc compiles and nothing less.
  It follows libcpp (gcc 12, the project's gnu17 mode) phase by phase: a line ends at LF, CRLF
  or a lone CR; a backslash followed by horizontal white space (space, tab, form feed,
  vertical tab, NUL) and a line end is a splice, inside comments, literals and tokens alike;
  trigraphs are off (gnu modes), so ``??/`` is no splice; ``//`` and ``/* */`` comments;
  string and character literals with their ``u8``/``u``/``U``/``L`` prefixes, a backslash
  escaping the next character, an unclosed one running to the end of its line (gcc makes it
  one token there too); GNU raw strings ``R"delim( ... )delim"`` with any prefix, whose
  terminator is found in the physical text (gcc undoes splices inside them), with gcc's
  delimiter rules (at most 16 characters of the basic set, no space, parentheses or
  backslash); identifiers with ``$``, UCNs and non-ASCII characters, and pp-numbers, read
  whole, so a prefix counts only at the start of a token, as in gcc; digraphs. What the
  checks cannot follow with certainty is reported by ``unreadable`` (a raw string at all; a
  header name that gcc would lex differently from ordinary tokens), so the caller refuses it.
  ``tests/common/test_csource_gcc.py`` checks this reading against ``gcc -E`` itself.
- ``pieces``: the scheduler's reading, kept as it was because stored pool keys depend on it
  (``//`` to the end of the line, ``/*`` to the next ``*/``, a literal to its closing quote on
  its line; ``open_literals`` decides whether an unclosed quote opens a literal).

Everything here takes linear time: the benchmarker runs it on untrusted text of up to a
megabyte.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Callable, Iterator
from typing import Literal, NamedTuple

Kind = Literal["code", "comment", "literal"]

# --- the scheduler's reading (pool keys: frozen) -------------------------------------------

_COMMENT = r"//[^\n]*|/\*.*?(?:\*/|\Z)"
# A literal, its closing quote (group 1) optional: empty when the literal is unclosed.
_LITERAL = {
    quote: re.compile(rf"{quote}(?:\\.|[^{quote}\\\n])*({quote}?)", re.DOTALL) for quote in "\"'"
}
_COMMENTS = re.compile(_COMMENT, re.DOTALL)
_START = re.compile(r"""//|/\*|["']""")


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


# --- gcc's reading (the benchmarker's checks) -------------------------------------------------

# Translation phase 2: a backslash, horizontal white space (libcpp's "nvspace"), a line end.
_GCC_SPLICE = re.compile(r"\\[ \t\f\v\0]*(?:\r\n|\r|\n)")
_UCN = r"\\u[0-9A-Fa-f]{4}|\\U[0-9A-Fa-f]{8}"
_ID_START = rf"[A-Za-z_$]|[^\x00-\x7f]|{_UCN}"
_ID_CONTINUE = rf"[A-Za-z0-9_$]|[^\x00-\x7f]|{_UCN}"
_PREFIX = r"(?:u8|u|U|L)?"
_PUNCTUATORS = (
    r"%:%:|\.\.\.|<<=|>>=|->|\+\+|--|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%&^|]=|##"
    r"|<:|:>|<%|%>|%:|[\s\S]"
)
_TOKEN = re.compile(
    "|".join(
        [
            r"(?P<space>[ \t\f\v\0]+)",
            r"(?P<newline>\r\n|\r|\n)",
            r"(?P<comment>//[^\r\n]*|/\*[\s\S]*?(?:\*/|\Z))",
            rf'(?P<raw>{_PREFIX}R")',
            rf'(?P<string>{_PREFIX}"(?:\\[^\r\n]|[^"\\\r\n])*"?)',
            rf"(?P<char>{_PREFIX}'(?:\\[^\r\n]|[^'\\\r\n])*'?)",
            rf"(?P<number>\.?[0-9](?:[eEpP][-+]|\.|{_ID_CONTINUE})*)",
            rf"(?P<identifier>(?:{_ID_START})(?:{_ID_CONTINUE})*)",
            rf"(?P<punctuator>{_PUNCTUATORS})",
        ]
    )
)
_RAW_DELIMITER = re.compile(r"""[A-Za-z0-9_{}\[\]#<>%:;.?*+\-/^&|~!=,"']{0,16}\(""")
_DIGRAPHS = {"<:": "[ ", ":>": "] ", "<%": "{ ", "%>": "} ", "%:": "# ", "%:%:": "##  "}
# Directives whose operands gcc may read as header names (<...> or "..." without escapes):
# #include and its kin, #if/#elif (__has_include, also through a macro), #pragma GCC dependency.
_HEADER_DIRECTIVES = frozenset({"include", "include_next", "import", "if", "elif", "pragma"})
_NOT_IN_HEADER = re.compile(r"/\*|//|[\"']")
_CODE_KINDS = frozenset({"space", "newline", "number", "identifier", "punctuator"})


class Token(NamedTuple):
    """One preprocessing token (or run of white space, or comment) of the logical text (the
    source with its splices removed): ``kind`` is the group of ``_TOKEN`` that read it
    (``raw`` for a whole raw string, prefix included)."""

    kind: str
    start: int
    end: int


class Lexed(NamedTuple):
    logical: str  # the source with every splice removed (translation phase 2)
    tokens: tuple[Token, ...]  # consecutive, covering ``logical``
    splices: tuple[tuple[int, int], ...]  # (logical offset, length) of each removed splice
    problems: tuple[str, ...]  # what the checks cannot follow with certainty


@functools.lru_cache(maxsize=16)
def lex(source: str) -> Lexed:
    """The source read as gcc's preprocessor reads it (see the module docstring)."""
    logical_parts: list[str] = []
    splices: list[tuple[int, int]] = []
    physical_starts: list[int] = []  # physical offset of each splice
    removed_before: list[int] = [0]  # characters removed by the splices before each one
    position = 0
    for match in _GCC_SPLICE.finditer(source):
        logical_parts.append(source[position : match.start()])
        logical_offset = match.start() - removed_before[-1]
        splices.append((logical_offset, match.end() - match.start()))
        physical_starts.append(match.start())
        removed_before.append(removed_before[-1] + match.end() - match.start())
        position = match.end()
    logical_parts.append(source[position:])
    logical = "".join(logical_parts)
    splice_logical = [offset for offset, _ in splices]

    def physical(offset: int) -> int:
        return offset + removed_before[bisect.bisect_right(splice_logical, offset)]

    def logical_of(offset: int) -> int:
        return offset - removed_before[bisect.bisect_left(physical_starts, offset)]

    tokens: list[Token] = []
    problems: list[str] = []
    position = 0
    while position < len(logical):
        for match in _TOKEN.finditer(logical, position):
            kind = match.lastgroup or "punctuator"
            if kind != "raw":
                tokens.append(Token(kind, match.start(), match.end()))
                position = match.end()
                continue
            end = _raw_end(source, physical(match.end() - 1) + 1)
            if end is None:  # an invalid delimiter (gcc: an error): R is code, " a string
                problems.append("has a raw string literal with an invalid delimiter")
                quote = match.end() - 1
                tokens.append(Token("identifier", match.start(), quote))
                position = quote
                string = _TOKEN.match(logical, quote)
                assert string is not None
                tokens.append(Token("string", quote, string.end()))
                position = string.end()
                break
            problems.append('uses a raw string literal (R"..."): not allowed in a kernel')
            tokens.append(Token("raw", match.start(), logical_of(end)))
            position = logical_of(end)
            break
        else:
            break
    problems += _header_problems(logical, tokens)
    for token in tokens:
        if (
            token.kind == "string"
            and logical[token.start - 1 : token.start] == "R"
            and (token.start < 1 or logical[token.start] == '"')
        ):
            problems.append('uses a raw string literal (R"..."): not allowed in a kernel')
            break
    return Lexed(logical, tuple(tokens), tuple(splices), tuple(dict.fromkeys(problems)))


def _raw_end(source: str, after_quote: int) -> int | None:
    """Physical end of a raw string whose opening quote ends at ``after_quote``; None when
    its delimiter is invalid. Unterminated, it runs to the end of the text (gcc: an error)."""
    delimiter = _RAW_DELIMITER.match(source, after_quote)
    if delimiter is None:
        return None
    closing = ")" + delimiter.group(0)[:-1] + '"'
    found = source.find(closing, delimiter.end())
    return len(source) if found < 0 else found + len(closing)


def _header_problems(logical: str, tokens: list[Token]) -> list[str]:
    """Directive lines where gcc may lex a header name (``<...>``, or ``"..."`` in which a
    backslash escapes nothing) that would read differently as ordinary tokens: refused rather
    than guessed, since which way gcc reads it can depend on macros (``__has_include``)."""
    problems = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        index += 1
        if token.kind != "punctuator" or logical[token.start : token.end] not in ("#", "%:"):
            continue
        name_index = index
        while name_index < len(tokens) and tokens[name_index].kind in ("space", "comment"):
            name_index += 1
        if name_index == len(tokens) or tokens[name_index].kind != "identifier":
            continue
        name = logical[tokens[name_index].start : tokens[name_index].end]
        if name not in _HEADER_DIRECTIVES:
            continue
        end_index = name_index
        while end_index < len(tokens) and tokens[end_index].kind != "newline":
            end_index += 1
        line_end = tokens[end_index].start if end_index < len(tokens) else len(logical)
        line = logical[token.start : line_end]
        opening = line.find("<")
        while opening >= 0:
            closing = line.find(">", opening)
            if closing < 0:
                break
            if _NOT_IN_HEADER.search(line, opening, closing):
                problems.append(
                    f"has a #{name} line with a header name that the checks cannot "
                    "read (a comment, a quote inside <...>)"
                )
                break
            opening = line.find("<", opening + 1)
        if any(
            t.kind == "string" and "\\" in logical[t.start : t.end]
            for t in tokens[name_index:end_index]
        ):
            problems.append(
                f"has a #{name} line with a backslash in a quoted name (a header "
                "name, where it escapes nothing)"
            )
        index = end_index
    return problems


def unreadable(source: str) -> list[str]:
    """Reasons the checks cannot read ``source`` as gcc will: raw strings, ambiguous header
    names. The benchmarker refuses such a kernel rather than guess."""
    return list(lex(source).problems)


def code_tokens(source: str) -> Iterator[tuple[str, str]]:
    """(kind, logical text) of every token that is not white space or a comment."""
    lexed = lex(source)
    for token in lexed.tokens:
        if token.kind not in ("space", "newline", "comment"):
            yield token.kind, lexed.logical[token.start : token.end]


def join_splices(source: str) -> str:
    """Translation phase 2: each splice (a backslash, horizontal white space, a line end)
    joins two lines, and a lone CR ends a line as LF does. The length stays the same (the
    splice's characters become spaces at the end of the joined line), so offsets before the
    first splice of a line stay valid; the line count drops by one per splice."""
    return _pad(lex(source), lambda kind, text: _line_ends(text))


def blank_comments_and_literals(source: str) -> str:
    """What a check may read: the code gcc reads, splices joined (``join_splices``), every
    comment blanked (each character but a newline becomes a space, so lines and ``#``
    directives keep their places), every literal reduced to its quotes around spaces (a raw
    string's newlines kept), digraphs spelled as the characters they stand for, form feeds,
    vertical tabs and NULs in code as spaces, a lone CR as LF. Unclosed literals run to the
    end of their line. A literal of one character, an opening quote right at the end of a
    line, comes out as two quotes."""
    return _pad(lex(source), _blank_token)


def _line_ends(text: str) -> str:
    """CRLF as space-LF, a lone CR as LF: the same lines, the same length."""
    return text.replace("\r\n", " \n").replace("\r", "\n") if "\r" in text else text


def _blank_token(kind: str, text: str) -> str:
    if kind == "space":
        return " " * len(text)
    if kind == "newline":
        return _line_ends(text)
    if kind == "comment":
        return _line_ends(_NOT_NEWLINE_OR_CR.sub(" ", text))
    if kind == "punctuator":
        return _DIGRAPHS.get(text, text)
    if kind in ("string", "char"):
        quote = "'" if kind == "char" else '"'
        prefix = text[: text.index(quote)]
        body = text[len(prefix) :]
        return prefix + quote + " " * max(len(body) - 2, 0) + quote
    if kind == "raw":
        prefix = text[: text.index('"')]
        body = _line_ends(_NOT_NEWLINE_OR_CR.sub(" ", text[len(prefix) + 1 : -1]))
        return prefix + '"' + body + '"'
    return text


_NOT_NEWLINE_OR_CR = re.compile(r"[^\n\r]")


def _pad(lexed: Lexed, render: Callable[[str, str], str]) -> str:
    """The tokens rendered, each splice's characters as spaces before the next line end."""
    rendered: list[str] = []
    owed: list[int] = []  # output offset of each splice, in the rendered text
    length = 0
    splices, splice_index = lexed.splices, 0
    for token in lexed.tokens:
        text = render(token.kind, lexed.logical[token.start : token.end])
        while splice_index < len(splices) and splices[splice_index][0] < token.end:
            offset = min(splices[splice_index][0] - token.start, len(text))
            owed.append(length + max(offset, 0))
            splice_index += 1
        rendered.append(text)
        length += len(text)
    owed += [length] * (len(splices) - splice_index)
    text = "".join(rendered)
    out: list[str] = []
    position = 0
    newline = -1
    for at, (_, size) in zip(owed, splices, strict=True):
        if newline < at:
            newline = text.find("\n", at)
            if newline < 0:
                newline = len(text)
        out.append(text[position:newline])
        out.append(" " * size)
        position = newline
    out.append(text[position:])
    return "".join(out)
