"""Supervised examples (prompt -> kernel) whose prompts are exactly the scheduler's.

Pure and seeded. Each example is what one SQD expansion looks like: a target stage, a mode
(seed, deepen, improve, repair), a parent program from the corpus (and, for repair, the error
it got), and as the answer one ```c block holding a kernel of the target stage. Deepen pairs
are the same kernel with the new technique added; repair pairs are the same kernel without
its mistake; some answers carry mistakes on purpose (see ``corpus``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from hpcrl_common.messages import ChatMessage
from hpcrl_common.stages import LAST_STAGE
from hpcrl_common.task import TaskSpec
from hpcrl_learner.bootstrap import corpus as cp
from hpcrl_learner.bootstrap.chat import IM_END, format_chat
from hpcrl_learner.bootstrap.corpus import Kernel, KernelSpec

PromptBuilder = Callable[..., list[ChatMessage]]
MODE_WEIGHTS: dict[str, float] = {"seed": 0.15, "deepen": 0.35, "improve": 0.25, "repair": 0.25}
ISA_WEIGHTS: dict[str, float] = {"avx512": 0.6, "avx2": 0.4}


@dataclass(frozen=True)
class Example:
    mode: str
    target_stage: int
    isa: str
    prompt: tuple[ChatMessage, ...]
    target: Kernel
    parent: Kernel | None = None
    error: str | None = None

    @property
    def completion(self) -> str:
        return completion_text(self.target.source)


def completion_text(source: str) -> str:
    return f"```c\n{source.rstrip()}\n```"


def scheduler_prompt_builder() -> PromptBuilder:
    """The scheduler's own ``build_prompt`` (the ``bootstrap`` extra installs it)."""
    try:
        from hpcrl_scheduler.prompts import build_prompt
    except ImportError as exc:
        raise RuntimeError(
            "the policy bootstrap needs the scheduler's prompts: install the learner with its "
            "'bootstrap' extra (pip install './services/learner[bootstrap]')"
        ) from exc
    return build_prompt


def make_examples(
    seed: int,
    count: int,
    task: TaskSpec,
    mistake_rate: float = 0.25,
    prompt_builder: PromptBuilder | None = None,
    seed_source: str | None = None,
) -> list[Example]:
    """``count`` examples; the same arguments give the same examples."""
    build = prompt_builder or scheduler_prompt_builder()
    rng = random.Random(f"hpcrl-examples/{seed}")
    modes, mode_weights = zip(*MODE_WEIGHTS.items(), strict=True)
    isas, isa_weights = zip(*ISA_WEIGHTS.items(), strict=True)
    examples = []
    for _ in range(count):
        mode = rng.choices(modes, mode_weights)[0]
        isa = rng.choices(isas, isa_weights)[0]
        target_stage, parent_spec, target_spec, parent_stage = _pair(rng, mode, isa)
        rate = mistake_rate / 2 if mode == "repair" else mistake_rate
        if rng.random() < rate:
            target_spec = cp.with_mistake(rng, target_spec, target_stage, isa)
        target = cp.render_kernel(target_spec, target_stage, isa)
        parent = None if parent_spec is None else cp.render_kernel(parent_spec, parent_stage, isa)
        error = error_text(rng, parent, task) if mode == "repair" and parent else None
        parent_source = parent.source if parent else None
        if mode == "seed" and seed_source is not None and rng.random() < 0.5:
            parent_source = seed_source
        prompt = build(task, target_stage=target_stage, mode=mode, parent_source=parent_source,
                       error=error, isa=isa)
        examples.append(Example(mode=mode, target_stage=target_stage, isa=isa,
                                prompt=tuple(prompt), target=target, parent=parent, error=error))
    return examples


def _pair(rng: random.Random, mode: str, isa: str
          ) -> tuple[int, KernelSpec | None, KernelSpec, int]:
    """(target stage, parent spec, target spec, parent stage) for one expansion."""
    if mode == "seed":
        number = 1 if rng.random() < 0.7 else rng.randint(1, LAST_STAGE)
        return number, None, cp.sample_spec(rng, number, isa), number
    if mode == "deepen":
        parent_stage = rng.randint(1, LAST_STAGE)
        number = min(parent_stage + 1, LAST_STAGE)
        target = cp.sample_spec(rng, number, isa)
        return number, downgrade(rng, target, parent_stage), target, parent_stage
    number = rng.randint(1, LAST_STAGE)
    target = cp.sample_spec(rng, number, isa)
    if mode == "improve":
        other = cp.sample_spec(rng, number, isa)
        if other.score() > target.score():
            other, target = target, other
        return number, other, target, number
    broken = cp.with_mistake(rng, target, number, isa)
    return number, broken, target, number


def downgrade(rng: random.Random, spec: KernelSpec, to_stage: int) -> KernelSpec:
    """``spec`` without what ``to_stage`` does not allow (the parent of a deepen pair)."""
    if to_stage >= 5:  # stage 5 deepens into 6: the parent lacks one of 6's techniques
        drop = rng.choice(("omp", "tile"))
        if drop == "omp":
            return replace(spec, omp=None)
        return replace(spec, tile=None, omp="static" if spec.omp == "collapse" else spec.omp)
    if to_stage < 5:
        spec = replace(spec, prefetch=None)
    if to_stage < 4:
        spec = replace(spec, omp=None)
    if to_stage < 3 and spec.simd:
        rn = spec.rn if spec.rm * spec.rn > 1 else 2
        spec = replace(spec, simd=None, rn=rn, fma=True)
    if to_stage < 2:
        spec = replace(spec, tile=None)
    return spec


def error_text(rng: random.Random, parent: Kernel, task: TaskSpec) -> str:
    """An error like the benchmarker's for the parent's mistake."""
    kind = parent.mistake
    reward = task.sizes.reward
    odd = task.sizes.verify[0] if task.sizes.verify else reward
    if kind == cp.COMPILE_ERROR:
        return "compile error:\n" + _compiler_message(parent.source)
    if kind == cp.STAGE_VIOLATION:
        used = [t for t in parent.techniques if t in ("simd", "openmp", "prefetch")]
        return (f"stage violation: stage {parent.stage} does not allow "
                f"{', '.join(used) or 'these techniques'}")
    sizes = odd if kind in (cp.NO_BOUNDARY, cp.WRONG_STRIDE) else reward
    where = ", ".join(f"{k}={v}" for k, v in sizes.items())
    if kind == cp.NO_BOUNDARY and rng.random() < 0.4:
        return f"runtime error at {where}: killed by signal 11 (SIGSEGV)"
    i, j = rng.randrange(sizes.get("M", 64)), rng.randrange(sizes.get("N", 64))
    got, want = rng.uniform(-40, 40), rng.uniform(-40, 40)
    rel = abs(got - want) / max(abs(want), 1e-9)
    return (f"verification error at {where}: C[{i}][{j}] = {got:.6g}, expected {want:.6g} "
            f"(relative error {rel:.2e} > {task.verification.rel_tolerance:g})")


def _compiler_message(source: str) -> str:
    lines = source.splitlines()

    def first(needle: str) -> int:
        return next((n + 1 for n, text in enumerate(lines) if needle in text), len(lines))

    if "__m" in source and "#include <immintrin.h>" not in source:
        n = first("__m")
        name = "__m512d" if "__m512d" in source else "__m256d"
        return (f"kernel.c:{n}:{lines[n - 1].find('__m') + 1}: error: unknown type name "
                f"'{name}'")
    if "_fmadd_ps(" in source:
        n = first("_fmadd_ps(")
        fn = "_mm512_fmadd_ps" if "_mm512_fmadd_ps" in source else "_mm256_fmadd_ps"
        return f"kernel.c:{n}:17: error: incompatible type for argument 1 of '{fn}'"
    if "+ kk]" in source and "int kk" not in source:
        n = first("+ kk]")
        return f"kernel.c:{n}:30: error: 'kk' undeclared (first use in this function)"
    if source.count("{") > source.count("}"):
        return (f"kernel.c:{len(lines)}:1: error: expected declaration or statement at end of "
                "input")
    for n, text in enumerate(lines):
        stripped = text.strip()
        if stripped and not stripped.endswith((";", "{", "}", "*/")) and not stripped.startswith(
                ("#", "for", "if", "/*", "const", "int", "double", "__m", "void", "+")):
            nxt = lines[n + 1].strip() if n + 1 < len(lines) else "}"
            return (f"kernel.c:{n + 1}:{len(text) + 1}: error: expected ';' before "
                    f"'{nxt.split()[0] if nxt else '}'}'")
    return "kernel.c: error: expected ';' before '}' token"


def chat_texts(examples: Sequence[Example]) -> list[str]:
    """Whole conversations as the chat template renders them (for training the tokenizer)."""
    return [format_chat([m.model_dump() for m in ex.prompt]) + ex.completion + IM_END + "\n"
            for ex in examples]
