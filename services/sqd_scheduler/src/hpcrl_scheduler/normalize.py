"""Normalised source: what decides that two programs are the same pool node.

Comments go, runs of whitespace shrink to nothing where they separate punctuation and to one
space between words, so reformatting or re-commenting a program does not make a new node.
String and character literals are kept verbatim (a comment marker inside one is not a
comment). Comments and literals are read by ``hpcrl_common.csource`` (closed literals only);
the keys of stored pools depend on every rule here, so none may change.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator

from hpcrl_common.csource import pieces

# Inside code: whitespace, or a run of anything else. A quote that opens no literal matches
# neither and is dropped (stored keys were computed so).
_CODE_TOKENS = re.compile(r"""(?P<space>\s+)|(?P<other>[^"'/\s]+|/)""")
_WORD = re.compile(r"\w")


def normalize_source(source: str) -> str:
    out: list[str] = []
    pending_space = False
    for kind, text in _tokens(source):
        if kind in ("comment", "space"):
            # A preprocessor directive ends at its newline; keep that boundary.
            if kind == "space" and "\n" in text and _in_directive(out):
                out.append("\n")
                pending_space = False
            else:
                pending_space = True
            continue
        if pending_space and out and _WORD.match(text[0]) and _WORD.match(out[-1][-1]):
            out.append(" ")
        pending_space = False
        out.append(text)
    return "".join(out).strip()


def _tokens(source: str) -> Iterator[tuple[str, str]]:
    """(kind, text): comment, literal, space or other (a run of code between spaces)."""
    for piece in pieces(source):
        if piece.kind != "code":
            yield piece
            continue
        for match in _CODE_TOKENS.finditer(piece.text):
            yield match.lastgroup or "", match.group()


def _in_directive(out: list[str]) -> bool:
    line = "".join(out).rsplit("\n", 1)[-1]
    return line.startswith("#") and not line.endswith("\n")


def source_key(source: str) -> str:
    """A short stable id of the normalised source."""
    return hashlib.sha256(normalize_source(source).encode()).hexdigest()[:20]
