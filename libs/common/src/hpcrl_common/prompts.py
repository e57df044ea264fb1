"""Prompts of the SQD search: pure functions from (task, stage, mode, parent, error, ISA).

A contract shared by the scheduler (which asks the policy with them) and the policy bootstrap
(which trains the policy on exactly them), hence here and not in either.

The wording lives in a data file (``data/prompts.toml``, or another file with the same
keys); this module only fills it in. One short system message and one user message, because
a small local policy is trained on exactly these prompts. The generator renders them with
the model's chat template.
"""

from __future__ import annotations

import string
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Literal

from hpcrl_common.messages import ChatMessage
from hpcrl_common.stages import (
    CACHE_BLOCKING,
    FIRST_STAGE,
    OPENMP,
    PREFETCH,
    REGISTER_BLOCKING,
    SIMD,
    stage,
)
from hpcrl_common.task import Sizes, TaskSpec

PromptMode = Literal["seed", "deepen", "improve", "repair"]
Isa = Literal["avx512", "avx2"]
MODES: tuple[str, ...] = ("seed", "deepen", "improve", "repair")

ISA_NAMES: dict[str, str] = {"avx512": "AVX-512", "avx2": "AVX2"}
_SIMD_PHRASE: dict[str, str] = {
    "avx512": "AVX-512 SIMD intrinsics (immintrin.h, __m512d, _mm512_*)",
    "avx2": "AVX2 SIMD intrinsics (immintrin.h, __m256d, _mm256_*)",
}
# How a technique reads when it is allowed; forbidden ones use the blunter wording below,
# which also names what the regex checks catch (pragmas and vector types count as SIMD).
_ALLOWED_PHRASE: dict[str, str] = {
    REGISTER_BLOCKING: "register blocking",
    CACHE_BLOCKING: "cache blocking (loop tiling)",
    OPENMP: "OpenMP threads (#pragma omp)",
    PREFETCH: "software prefetch (_mm_prefetch, __builtin_prefetch)",
}
_FORBIDDEN_PHRASE: dict[str, str] = {
    SIMD: "SIMD (intrinsics, vector types, vectorisation pragmas)",
    OPENMP: "OpenMP",
    PREFETCH: "prefetch instructions",
}

# Long compiler logs drown a small model's context; the head names the first error (what
# to fix), the tail often holds the verifier's summary.
ERROR_HEAD_CHARS = 700
ERROR_TAIL_CHARS = 200
PARENT_MAX_CHARS = 12_000


@dataclass(frozen=True)
class Templates:
    system: str
    user: str
    modes: dict[str, str]

    @classmethod
    def parse(cls, text: str, where: str = "prompt templates") -> Templates:
        data = tomllib.loads(text)
        try:
            modes = {mode: str(data["modes"][mode]) for mode in MODES}
            return cls(system=str(data["system"]), user=str(data["user"]), modes=modes)
        except KeyError as exc:
            raise ValueError(f"{where} lacks key {exc.args[0]!r}") from None


@lru_cache(maxsize=8)
def load_templates(path: str | None = None) -> Templates:
    """The built-in templates, or a TOML file with keys system, user, modes.<mode>."""
    if path is None:
        text = (resources.files("hpcrl_common") / "data" / "prompts.toml").read_text()
        return Templates.parse(text, "built-in prompts.toml")
    return Templates.parse(Path(path).read_text(), path)


def technique_phrase(technique: str, isa: str) -> str:
    if technique == SIMD:
        return _SIMD_PHRASE[isa]
    return _ALLOWED_PHRASE[technique]


def format_sizes(sizes: Sizes) -> str:
    return ", ".join(f"{name}={value}" for name, value in sizes.items())


def truncate_error(error: str, head: int = ERROR_HEAD_CHARS, tail: int = ERROR_TAIL_CHARS) -> str:
    """Keep whole lines from the start and the end of a long error, saying what was cut."""
    text = error.strip()
    if len(text) <= head + tail:
        return text
    lines = text.splitlines()
    first: list[str] = []
    used = 0
    for line in lines:
        if used + len(line) + 1 > head and first:
            break
        first.append(line[:head])
        used += len(line) + 1
    last: list[str] = []
    used = 0
    for line in reversed(lines[len(first) :]):
        if used + len(line) + 1 > tail:
            break
        last.insert(0, line)
        used += len(line) + 1
    cut = len(lines) - len(first) - len(last)
    middle = [f"[... {cut} more lines ...]"] if cut else []
    return "\n".join([*first, *middle, *last])


def failure_text(status: str, error: str) -> str:
    """How a failed parent's verdict reads in a repair prompt (``compile error: ...``)."""
    label = status.replace("_", " ")
    return f"{label}: {error.strip()}" if error.strip() else label


def _code_block(source: str) -> str:
    text = source.strip()
    if len(text) > PARENT_MAX_CHARS:
        text = text[:PARENT_MAX_CHARS] + "\n/* ... truncated ... */"
    return f"```c\n{text}\n```"


def _new_techniques(target_stage: int, isa: str) -> str:
    previous = set(stage(target_stage - 1).allowed) if target_stage > FIRST_STAGE else set()
    new = [t for t in stage(target_stage).allowed if t not in previous]
    if not new:  # the last stage deepens into itself: anything allowed
        new = list(stage(target_stage).allowed)
    return ", ".join(technique_phrase(t, isa) for t in new)


def build_prompt(
    task: TaskSpec,
    *,
    target_stage: int,
    mode: PromptMode,
    parent_source: str | None,
    error: str | None,
    isa: str,
    templates: Templates | None = None,
) -> list[ChatMessage]:
    """The chat messages asking the policy for one child of ``parent_source``."""
    if isa not in ISA_NAMES:
        raise ValueError(f"isa must be one of {', '.join(ISA_NAMES)}, got {isa!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode != "seed" and not parent_source:
        raise ValueError(f"mode {mode!r} needs the parent program")
    templates = templates or load_templates()
    target = stage(target_stage)
    forbidden = [_FORBIDDEN_PHRASE[t] for t in target.forbidden]
    verify = task.sizes.verify[0] if task.sizes.verify else task.sizes.reward
    fields = {
        "isa_name": ISA_NAMES[isa],
        "description": task.description.strip(),
        "signature": task.signature.strip(),
        "function": task.function,
        "reward_sizes": format_sizes(task.sizes.reward),
        "verify_sizes": format_sizes(verify),
        "stage": str(target.number),
        "allowed": ", ".join(technique_phrase(t, isa) for t in target.allowed),
        "forbidden": ", ".join(forbidden) if forbidden else "nothing",
        "new_techniques": _new_techniques(target.number, isa),
        "parent": _code_block(parent_source) if parent_source else "",
        "error": truncate_error(error) if error else "(no error text was recorded)",
    }
    instruction = string.Template(templates.modes[mode]).substitute(fields)
    user = string.Template(templates.user).substitute(fields, instruction=instruction)
    system = string.Template(templates.system).substitute(fields)
    return [ChatMessage(role="system", content=system), ChatMessage(role="user", content=user)]
