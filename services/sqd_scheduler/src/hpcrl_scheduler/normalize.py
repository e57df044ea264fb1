"""Normalised source: what decides that two programs are the same pool node.

Comments go, runs of whitespace shrink to nothing where they separate punctuation and to one
space between words, so reformatting or re-commenting a program does not make a new node.
String and character literals are kept verbatim (a comment marker inside one is not a
comment).
"""

from __future__ import annotations

import hashlib
import re

_TOKENS = re.compile(
    r"""
      (?P<string>"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')
    | (?P<line_comment>//[^\n]*)
    | (?P<block_comment>/\*.*?(?:\*/|\Z))
    | (?P<space>\s+)
    | (?P<other>[^"'/\s]+|/)
    """,
    re.VERBOSE | re.DOTALL,
)
_WORD = re.compile(r"\w")


def normalize_source(source: str) -> str:
    out: list[str] = []
    pending_space = False
    for match in _TOKENS.finditer(source):
        kind = match.lastgroup
        if kind in ("line_comment", "block_comment", "space"):
            # A preprocessor directive ends at its newline; keep that boundary.
            if kind == "space" and "\n" in match.group() and _in_directive(out):
                out.append("\n")
                pending_space = False
            else:
                pending_space = True
            continue
        text = match.group()
        if pending_space and out and _WORD.match(text[0]) and _WORD.match(out[-1][-1]):
            out.append(" ")
        pending_space = False
        out.append(text)
    return "".join(out).strip()


def _in_directive(out: list[str]) -> bool:
    line = "".join(out).rsplit("\n", 1)[-1]
    return line.startswith("#") and not line.endswith("\n")


def source_key(source: str) -> str:
    """A short stable id of the normalised source."""
    return hashlib.sha256(normalize_source(source).encode()).hexdigest()[:20]
