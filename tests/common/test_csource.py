"""The one C lexer: pieces, splices, blanking (what the benchmarker's checks read)."""

from __future__ import annotations

import itertools
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcrl_common.csource import (
    Piece,
    blank_comments_and_literals,
    code_tokens,
    join_splices,
    pieces,
    unreadable,
)

# Sources built from the characters that matter to the lexer, in every combination.
sources = st.lists(
    st.sampled_from(
        ["a", "x1", " ", "\n", "\t", "/", "*", "//", "/*", "*/", '"', "'", "\\", "#", ";", "\f"]
    ),
    max_size=40,
).map("".join)


def test_pieces_tell_code_comments_and_literals_apart() -> None:
    src = 'int a; // c1\nchar *s = "/* no */"; /* c2\n */ char c = \'"\';'
    assert list(pieces(src)) == [
        Piece("code", "int a; "),
        Piece("comment", "// c1"),
        Piece("code", "\nchar *s = "),
        Piece("literal", '"/* no */"'),
        Piece("code", "; "),
        Piece("comment", "/* c2\n */"),
        Piece("code", " char c = "),
        Piece("literal", "'\"'"),
        Piece("code", ";"),
    ]


def test_an_unclosed_quote_is_code_unless_literals_may_stay_open() -> None:
    src = 'x = "abc\ny = 1; /* c */'
    assert [p.kind for p in pieces(src)] == ["code", "comment"]
    assert list(pieces(src, open_literals=True))[:3] == [
        Piece("code", "x = "),
        Piece("literal", '"abc'),
        Piece("code", "\ny = 1; "),
    ]
    # After an unclosed quote, the other kind of quote and comments still count.
    assert [p for p in pieces('"a \'b\' // c\n"\\"') if p.kind != "code"] == [
        Piece("literal", "'b'"),
        Piece("comment", "// c"),
    ]
    assert list(pieces("/* never closed\n int x;")) == [
        Piece("comment", "/* never closed\n int x;")
    ]


def test_an_escaped_quote_or_newline_stays_inside_the_literal() -> None:
    assert list(pieces('"a\\"b" c')) == [Piece("literal", '"a\\"b"'), Piece("code", " c")]
    assert list(pieces('"a\\\nb"')) == [Piece("literal", '"a\\\nb"')]


def test_blanking_keeps_lines_and_quotes() -> None:
    src = "a /* _mm512 */ b // omp\n\"#pragma omp\" 'x'"
    out = blank_comments_and_literals(src)
    assert out == "a              b       \n\"           \" ' '"
    assert len(out) == len(src)


def test_splices_join_lines_and_keep_the_length() -> None:
    assert join_splices("#define X 1 \\\n + 2\nint y;") == "#define X 1  + 2  \nint y;"
    # A comment continued by a splice swallows the next line, as in the compiler.
    assert blank_comments_and_literals("// c \\\nsystem();\nx") == " " * 16 + "\nx"


def test_a_lone_quote_at_a_line_end_comes_out_as_two() -> None:
    # The one place blanking is not length-preserving; callers rely on it as it is.
    assert blank_comments_and_literals("it'\nx") == "it''\nx"


@given(sources, st.booleans())
def test_pieces_are_lossless(src: str, open_literals: bool) -> None:
    parts = list(pieces(src, open_literals=open_literals))
    assert "".join(p.text for p in parts) == src
    assert all(p.text for p in parts)
    assert all(a.kind != "code" or b.kind != "code" for a, b in itertools.pairwise(parts))


@given(sources)
def test_blanked_text_has_no_comment_or_literal_content_left(src: str) -> None:
    out = blank_comments_and_literals(src)
    assert out.count("\n") == join_splices(src).count("\n")
    for piece in pieces(out, open_literals=True):
        assert piece.kind != "comment"
        if piece.kind == "literal":
            assert piece.text.strip(piece.text[0]).strip(" ") == ""


# The plain way to lex closed literals: retry at every position (quadratic on hostile text).
_REFERENCE = re.compile(
    r"""//[^\n]*|/\*.*?(?:\*/|\Z)|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'""", re.DOTALL
)


@settings(max_examples=1000)
@given(sources)
def test_closed_literals_are_lexed_as_by_retrying_every_position(src: str) -> None:
    found = [(p.kind, p.text) for p in pieces(src) if p.kind != "code"]
    expected = [
        ("comment" if m.group()[0] == "/" else "literal", m.group())
        for m in _REFERENCE.finditer(src)
    ]
    assert found == expected


@pytest.mark.parametrize(
    "unit",
    [
        '"',
        "'",
        "/*",
        "//",
        "\\\n",
        '"\\',
        "/",
        'R"',
        'u8R"x(',
        "a\\\n",
        "\\ \n",
        "\r",
        "<:",
        "#if <",
        "#if <a>",
        '#include "\\"\n',
        "\\u00C0",
    ],
)
def test_linear_time_on_hostile_text(unit: str) -> None:
    text = unit * (256 * 1024 // len(unit))
    started = time.monotonic()
    blank_comments_and_literals(text)
    for open_literals in (True, False):
        for _ in pieces(text, open_literals=open_literals):
            pass
    assert time.monotonic() - started < 5


# --- gcc's reading (issue 27; tests/common/test_csource_gcc.py checks it against gcc -E) ------


def test_raw_strings_are_read_whole_and_refused() -> None:
    src = 'R"x(/* " )x" _mm512_add_pd(a, b); LR"\'(")/*)\'" asm("");'
    out = blank_comments_and_literals(src)
    assert len(out) == len(src)
    assert "_mm512_add_pd(a, b);" in out and 'asm("");' in out
    assert "/*" not in out
    assert unreadable(src) == ['uses a raw string literal (R"..."): not allowed in a kernel']
    # Whatever comes before the R, a quote right after one is refused: gcc's reading of the
    # characters before it (identifier or not) cannot change the verdict.
    assert unreadable('xR"(a)" f();') and unreadable('\u00a2R"(a)"')
    assert not unreadable('char *s = "R"; int R = 1;')


def test_a_raw_string_ends_at_its_delimiter_in_the_physical_text() -> None:
    # gcc undoes splices inside a raw string: )q\<newline>" is no terminator.
    src = 'R"q(z)q\\\n" hidden )q" seen'
    assert "seen" in blank_comments_and_literals(src)
    assert "hidden" not in blank_comments_and_literals(src)
    multi = 'uR"(\n#pragma omp parallel\n)" x;\n'
    out = blank_comments_and_literals(multi)
    assert out.count("\n") == 3 and "pragma" not in out and "x;" in out


def test_splices_with_white_space_and_cr_line_ends_are_gcc_s() -> None:
    assert blank_comments_and_literals("// c\\ \t\nasm();\nx").strip() == "x"
    assert "asm" not in blank_comments_and_literals('"a\\  \nasm();" b')
    # A lone CR ends a line (a directive may follow it); CRLF too.
    out = blank_comments_and_literals('x;\r#pragma GCC optimize("O0")\r\nint y; // c\rz')
    assert out.splitlines() == ["x;", '#pragma GCC optimize("  ") ', "int y;     ", "z"]
    assert "\r" not in out
    # Form feed, vertical tab and NUL are white space before a directive, as in gcc.
    assert blank_comments_and_literals("\f\v#pragma omp parallel").startswith("  #pragma")
    # Trigraphs are off in gcc's gnu modes: ??/ is no splice.
    assert blank_comments_and_literals("// c ??/\nasm();").endswith("asm();")


def test_digraphs_read_as_the_characters_they_stand_for() -> None:
    out = blank_comments_and_literals('<:<:gnu::section(".x"):>:> int f(void) <% %> %:x')
    assert out.startswith("[ [ gnu::section(") and "] ] " in out and "{  }  # x" in out
    # Longest token first, as gcc lexes: <<: is << and :.
    assert blank_comments_and_literals("a<<:b") == "a<<:b"


def test_header_names_that_read_differently_as_tokens_are_refused() -> None:
    # gcc reads <x/*> as a header name here (also through a macro for __has_include), so the
    # /* opens no comment; a lexer that guesses gets the following lines wrong either way.
    for src in [
        "#if __has_include(<x/*>)\n#endif\nasm();\n/* */",
        "#define HI __has_include\n%:if HI(<x//y>)\n#endif",
        "#include <a'b>",
        '#include "a\\" /*',
        '#pragma GCC dependency "x\\"',
    ]:
        assert unreadable(src), src
    for src in [
        "#include <immintrin.h> // AVX-512\n#include <omp.h>",
        "#define MIN(a, b) ((a) < (b) ? (a) : (b)) // smaller > larger",
        "#pragma omp parallel for if (M > 64)",
        '#include "local.h"',
    ]:
        assert not unreadable(src), src


def test_code_tokens_are_gcc_s_tokens() -> None:
    assert list(code_tokens('_Pra\\\ngma /* c */ (L"omp \\"x\\"") 1.e+5x')) == [
        ("identifier", "_Pragma"),
        ("punctuator", "("),
        ("string", 'L"omp \\"x\\""'),
        ("punctuator", ")"),
        ("number", "1.e+5x"),
    ]
