"""Find the kernel in an LLM completion: fenced blocks, prose, several blocks, helpers.

The result is the C translation unit to compile: the code block (or, without fences, the
stretch of text) that defines the task's function with the task's signature, with its
includes and helper functions kept.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from hpcrl_common.csource import blank_comments_and_literals

_OPENING_FENCE = re.compile(r"[ \t]*(```+|~~~+)[ \t]*([\w+#.-]*)")
_CLOSING_FENCE = re.compile(r"[ \t]*(```+|~~~+)[ \t]*")
_C_LANGS = {"", "c", "h", "c99", "c11", "c17", "cpp", "c++", "cc", "cxx", "objective-c"}
_QUALIFIERS = re.compile(r"\b(const|volatile|restrict|__restrict__|__restrict)\b")


class ExtractError(ValueError):
    pass


@dataclass(frozen=True)
class Signature:
    return_type: str
    name: str
    params: tuple[str, ...]  # parameter types, normalised, names dropped

    @classmethod
    def parse(cls, text: str) -> Signature:
        match = re.fullmatch(r"\s*(.+?)\s*\b(\w+)\s*\((.*)\)\s*;?\s*", text, re.DOTALL)
        if not match:
            raise ValueError(f"not a C function signature: {text!r}")
        return cls(
            _norm_type(match.group(1)),
            match.group(2),
            tuple(_param_type(p) for p in _split_params(match.group(3))),
        )

    def describe(self) -> str:
        return f"{self.return_type} {self.name}({', '.join(self.params)})"


def _norm_type(text: str) -> str:
    text = _QUALIFIERS.sub(" ", text)
    text = re.sub(r"\b(static|inline|extern|__inline__|__inline)\b", " ", text)
    text = re.sub(r"__attribute__\s*\(\(.*?\)\)", " ", text)
    text = re.sub(r"\s*\*\s*", "*", text)
    return " ".join(text.split())


def _split_params(text: str) -> list[str]:
    text = text.strip()
    if text in ("", "void"):
        return []
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        depth += (char in "([" and 1) or 0
        depth -= (char in ")]" and 1) or 0
        current += char
    parts.append(current)
    return parts


def _param_type(param: str) -> str:
    param = _QUALIFIERS.sub(" ", param)
    param = re.sub(r"\[\s*\w*\s*\]", "*", param)  # double A[] is double *A
    param = re.sub(r"\s*\*\s*", " * ", param).strip()
    words = param.split()
    if (
        len(words) >= 2
        and re.fullmatch(r"[A-Za-z_]\w*", words[-1])
        and words[-1]
        not in ("int", "double", "float", "long", "char", "short", "unsigned", "signed")
    ):
        words = words[:-1]  # drop the parameter name
    return _norm_type(" ".join(words))


@dataclass(frozen=True)
class Extracted:
    code: str
    block_index: int | None  # which fenced block; None when the completion had no fences


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block: an opening fence line, then everything up to
    the next line that is the same fence alone. An opening fence that is never closed opens
    no block. Linear time: the completion is untrusted and may be a megabyte of fences."""
    lines = text.split("\n")
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line) + 1)
    closers: dict[str, list[int]] = {}
    for number, line in enumerate(lines):
        if match := _CLOSING_FENCE.fullmatch(line):
            closers.setdefault(match.group(1), []).append(number)
    blocks, number = [], 0
    while number < len(lines):
        opening = _OPENING_FENCE.match(lines[number])
        if opening is None:
            number += 1
            continue
        candidates = closers.get(opening.group(1), [])
        after = bisect.bisect_right(candidates, number)
        if after == len(candidates):
            number += 1
            continue
        closing = candidates[after]
        body = text[offsets[number + 1] : offsets[closing]]
        blocks.append((opening.group(2).lower(), body))
        number = closing + 1
    return blocks


def _definitions(code: str, name: str) -> list[tuple[int, str, str]]:
    """(offset, return type text, parameter text) of each definition of ``name``."""
    clean = blank_comments_and_literals(code)
    found = []
    pattern = re.compile(
        r"(^|[;}\n])([ \t\w*]*?)\b" + re.escape(name) + r"\s*\(([^()]*)\)\s*\{", re.MULTILINE
    )
    for match in pattern.finditer(clean):
        found.append((match.start(2), match.group(2), match.group(3)))
    return found


def _matches(signature: Signature, return_text: str, params_text: str) -> bool:
    if _norm_type(return_text) != signature.return_type:
        return False
    return tuple(_param_type(p) for p in _split_params(params_text)) == signature.params


def extract(completion: str, signature_text: str) -> Extracted:
    """The code unit defining the function; ExtractError (format violation) otherwise."""
    signature = Signature.parse(signature_text)
    blocks = _fenced_blocks(completion)
    if blocks:
        candidates = [(i, body) for i, (lang, body) in enumerate(blocks) if lang in _C_LANGS]
    else:
        candidates = [(None, completion)]
    wrong = []
    chosen: tuple[int | None, str, int] | None = None
    for index, body in candidates:
        for offset, ret, params in _definitions(body, signature.name):
            if _matches(signature, ret, params):
                chosen = (index, body, offset)  # the last matching definition wins
            else:
                wrong.append(f"{_norm_type(ret)} {signature.name}({params.strip()})")
    if chosen is None:
        if wrong:
            raise ExtractError(
                f"{signature.name} is defined as `{wrong[0]}`, but the task requires "
                f"`{signature_text}`"
            )
        raise ExtractError(
            f"no definition of `{signature_text}` found in the completion"
            + (" (no fenced C code block defines it)" if blocks else "")
        )
    index, body, offset = chosen
    if index is None:
        body = _code_span(body, offset)
    return Extracted(code=body.strip("\n") + "\n", block_index=index)


def _code_span(text: str, offset: int) -> str:
    """Without fences: the code around the function, up to the nearest prose line on either
    side (helpers before and after the kernel are kept, sentences are dropped)."""
    clean = blank_comments_and_literals(text)
    depth, end, seen = 0, len(text), False
    for i in range(offset, len(clean)):
        if clean[i] == "{":
            depth += 1
            seen = True
        elif clean[i] == "}":
            depth -= 1
            if seen and depth == 0:
                end = i + 1
                break
    start = offset
    for line, code in reversed(_lines_with_code(text[:offset], clean[:offset])):
        if _looks_like_prose(line) and code.strip():
            break
        start -= len(line)
    for line, code in _lines_with_code(text[end:], clean[end:]):
        if _looks_like_prose(line) and code.strip():
            break
        end += len(line)
    return text[start:end]


def _lines_with_code(text: str, clean: str) -> list[tuple[str, str]]:
    """Each line of ``text`` beside the same line with comments and literals blanked: a line
    wholly inside a block comment is part of the code, however much it reads like prose."""
    lines, pairs, at = text.splitlines(keepends=True), [], 0
    for line in lines:
        pairs.append((line, clean[at : at + len(line)]))
        at += len(line)
    return pairs


def _looks_like_prose(line: str) -> bool:
    stripped = line.strip()
    if not stripped or stripped.startswith(("#", "//", "/*", "*")):
        return False
    if not re.search(r"[;{}()\[\]=#*<>&|+]", stripped):
        return len(stripped.split()) >= 2 or stripped.endswith((":", "."))
    return bool(
        re.match(r"[A-Z][a-z]+\b", stripped)
        and stripped.endswith((".", ":", "!", "?"))
        and ";" not in stripped
        and "{" not in stripped
    )
