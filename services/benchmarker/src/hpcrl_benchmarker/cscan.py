"""Lexical helpers on C source: pragmas, attributes, the main file's preprocessor output.

Everything here is pure and works on text. The checks that use it read code with comments and
literals blanked (``hpcrl_common.csource.blank_comments_and_literals``), so a technique
mentioned in a comment or a string does not count; newlines are kept, so line numbers and
``#`` directives survive.
"""

from __future__ import annotations

import re


def pragma_text(code: str) -> list[str]:
    """Every ``#pragma`` line and ``_Pragma("...")`` operand, whitespace-normalised.

    Needs the unstripped source for _Pragma (its operand is a string literal).
    """
    found = [
        " ".join(m.group(1).split())
        for m in re.finditer(r"^[ \t]*(?:#|%:)[ \t]*pragma\b([^\n]*)", code, re.MULTILINE)
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
            keep.append(text[start : marker.start()])
        current, start = marker.group(1), marker.end()
    if current is not None and current.endswith(main_file):
        keep.append(text[start:])
    return "\n".join(chunk.strip("\n") for chunk in keep if chunk.strip("\n"))


_ATTRIBUTE_OPEN = re.compile(r"\b__attribute(?:__)?\s*\(\s*\(|\[\s*\[")
_ATTRIBUTE_ITEM = re.compile(r"^\s*(?:(\w+)\s*::\s*)?(\w+)\s*(?:\((.*)\))?\s*$", re.DOTALL)
_CLOSE = {"(": ")", "[": "]"}


def attributes(code: str) -> list[tuple[str, str, str]]:
    """Every GNU attribute (``__attribute__((...))`` and ``[[...]]``) in ``code`` (comments
    and strings already blanked) as (namespace, name, argument text); names lose their
    ``__`` wrapping, so ``__section__`` reads as ``section``. A list that cannot be read
    (unbalanced) yields one item with the name ``?``: callers treat it as suspect."""
    found: list[tuple[str, str, str]] = []
    parsed_to = 0  # attributes nested in one already read are not read again (linear time)
    for match in _ATTRIBUTE_OPEN.finditer(code):
        if match.start() < parsed_to:
            continue
        inner = _balanced(code, match.end(), match.group(0)[-1])
        if inner is None:
            found.append(("", "?", ""))
            break  # it runs to the end of the code: everything after it is inside it
        parsed_to = match.end() + len(inner)
        for item in _top_level_split(inner):
            if not item.strip():
                continue
            parsed = _ATTRIBUTE_ITEM.match(item)
            if parsed is None:
                found.append(("", "?", item))
                continue
            namespace, name, args = parsed.groups()
            found.append((_bare(namespace or ""), _bare(name), args or ""))
    return found


def _bare(name: str) -> str:
    return name[2:-2] if len(name) > 4 and name.startswith("__") and name.endswith("__") else name


def _balanced(code: str, start: int, opener: str) -> str | None:
    """The text from ``start`` to where the bracket opened just before it (and the one
    around it) closes; None when it never does."""
    depth, closer = 0, _CLOSE[opener]
    for index in range(start, len(code)):
        char = code[index]
        if char in "([":
            depth += 1
        elif char in ")]":
            if depth == 0:
                return code[start:index] if char == closer else None
            depth -= 1
    return None


def _top_level_split(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    items.append(text[start:])
    return items
