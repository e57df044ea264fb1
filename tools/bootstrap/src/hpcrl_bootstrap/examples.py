"""Supervised examples (prompt -> kernel) whose prompts are exactly the scheduler's.

Pure and seeded, built from the measured catalogue (``catalogue``). Each example is what one
SQD expansion looks like: a target stage, a mode (seed, deepen, improve, repair), a parent
program (and, for repair, the error the benchmarker gave it), and as the answer one ```c
block holding a correct kernel of the target stage. Improve pairs go from a slower to a
measurably faster kernel; deepen pairs add the next stage's technique to the same kernel
unless that makes it much slower; repair pairs fix one mistake. Answers never carry a
mistake: mistakes belong in repair prompts' parents, not in what the policy learns to write.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hpcrl_bootstrap.catalogue import Measured, Plan, verdict_key
from hpcrl_bootstrap.chat import IM_END, format_chat
from hpcrl_bootstrap.corpus import Kernel, completion_text
from hpcrl_common.messages import ChatMessage
from hpcrl_common.prompts import build_prompt, failure_text
from hpcrl_common.restyle import restyle
from hpcrl_common.task import TaskSpec

PromptBuilder = Callable[..., list[ChatMessage]]
MODE_WEIGHTS: dict[str, float] = {"seed": 0.2, "deepen": 0.3, "improve": 0.3, "repair": 0.2}
# An improve answer must beat its parent by this much (timing noise is a few per cent).
IMPROVE_MARGIN = 1.10
# A deepen answer may be slower (the stage asks for the technique: tiles do little at 256³,
# and threads lose on a busy node), but not by half.
DEEPEN_FLOOR = 0.5
SEED_STAGE_ONE = 0.7  # share of seed prompts at stage 1, where the scheduler starts
# Target stages. A nine-iteration run reaches stage 6 by its fifth iteration and asks for
# every stage from then on, so every stage is taught; stages 1-2 a little more, as every
# run starts there and their answers are short (a stage-3+ answer is ~3x as many tokens).
STAGE_WEIGHTS: dict[int, float] = {1: 0.22, 2: 0.22, 3: 0.16, 4: 0.14, 5: 0.13, 6: 0.13}
# Share of prompts whose parent is shown restyled (restyle.py): the policy must read
# programs it did not write, in other people's styles, as well as its own.
RESTYLED_PARENTS = 0.6


@dataclass(frozen=True)
class Example:
    mode: str
    target_stage: int
    isa: str
    prompt: tuple[ChatMessage, ...]
    target: Kernel
    parent: Kernel | None = None
    error: str | None = None
    shown_parent: str | None = None  # the parent's text in the prompt (restyled or not)

    @property
    def completion(self) -> str:
        return completion_text(self.target.source)


@dataclass
class Pairs:
    """The catalogue's teachable pairs per mode, from measured verdicts."""

    correct: dict[int, list[Measured]]
    deepen: dict[int, list[tuple[Measured, Measured]]]  # by parent stage: (parent, target)
    improve: dict[int, list[tuple[Measured, Measured]]]  # by stage: (slower, faster)
    repair: dict[int, list[tuple[Measured, Measured]]]  # by stage: (broken, fixed)
    left_out: Counter[str]


def pairs_from(plan: Plan, verdicts: dict[str, Measured]) -> Pairs:
    """Sort the catalogue into pairs; count what is left out and why."""
    left_out: Counter[str] = Counter()
    correct: dict[int, list[Measured]] = {}
    for kernel in plan.targets:
        measured = verdicts[verdict_key(kernel)]
        if measured.ok:
            correct.setdefault(kernel.stage, []).append(measured)
        else:
            left_out[f"target_{measured.status}"] += 1
    deepen: dict[int, list[tuple[Measured, Measured]]] = {}
    repair: dict[int, list[tuple[Measured, Measured]]] = {}
    for index, kernel in enumerate(plan.targets):
        target = verdicts[verdict_key(kernel)]
        if not target.ok:
            continue
        parent = plan.parents.get(index)
        if parent is not None:
            low = verdicts[verdict_key(parent)]
            if not low.ok:
                left_out["deepen_parent_failed"] += 1
            elif (target.gflops or 0.0) < DEEPEN_FLOOR * (low.gflops or 0.0):
                left_out["deepen_slower"] += 1
            else:
                deepen.setdefault(parent.stage, []).append((low, target))
        bad = verdicts[verdict_key(plan.broken[index])]
        if bad.ok:
            left_out["repair_parent_not_broken"] += 1
        else:
            repair.setdefault(kernel.stage, []).append((bad, target))
    improve = {number: _faster_pairs(ms) for number, ms in correct.items()}
    return Pairs(correct, deepen, improve, repair, left_out)


def _faster_pairs(kernels: Sequence[Measured]) -> list[tuple[Measured, Measured]]:
    return [
        (slow, fast)
        for slow in kernels
        for fast in kernels
        if (fast.gflops or 0.0) >= IMPROVE_MARGIN * (slow.gflops or 0.0)
    ]


def make_examples(
    seed: int,
    count: int,
    task: TaskSpec,
    pairs: Pairs,
    isa: str,
    prompt_builder: PromptBuilder | None = None,
    seed_source: str | None = None,
    stream: str | None = None,
) -> list[Example]:
    """``count`` examples; the same arguments give the same examples. ``stream`` names
    another random stream (each task of a multi-task build draws from its own; GEMM's,
    None, is the one a GEMM-only build always drew from)."""
    build = prompt_builder or build_prompt
    rng = random.Random(f"hpcrl-examples/{seed}" + (f"/{stream}" if stream else ""))
    modes = [m for m in MODE_WEIGHTS if _available(pairs, m)]
    weights = [MODE_WEIGHTS[m] for m in modes]
    examples = []
    for _ in range(count):
        mode = rng.choices(modes, weights)[0]
        target_stage, parent, target, error = _pick(rng, mode, pairs)
        parent_source = parent.source if parent else None
        if mode == "seed" and seed_source is not None and rng.random() < 0.5:
            parent_source = seed_source
        elif parent_source is not None and rng.random() < RESTYLED_PARENTS:
            parent_source = restyle(parent_source, rng)
        prompt = build(
            task,
            target_stage=target_stage,
            mode=mode,
            parent_source=parent_source,
            error=error,
            isa=isa,
        )
        examples.append(
            Example(
                mode=mode,
                target_stage=target_stage,
                isa=isa,
                prompt=tuple(prompt),
                target=target,
                parent=parent,
                error=error,
                shown_parent=parent_source,
            )
        )
    return examples


def split_examples(total: int, tasks: Sequence[str]) -> dict[str, int]:
    """``total`` examples shared evenly between ``tasks``; the first ``total % len(tasks)``
    tasks (in the order given) take one more."""
    share, extra = divmod(total, len(tasks))
    return {name: share + (n < extra) for n, name in enumerate(tasks)}


def _available(pairs: Pairs, mode: str) -> bool:
    table = {
        "seed": pairs.correct,
        "deepen": pairs.deepen,
        "improve": pairs.improve,
        "repair": pairs.repair,
    }[mode]
    return any(table.values())


def _stage(rng: random.Random, table: dict[int, list], shift: int = 0) -> int:
    """A stage with something in ``table``, weighted by :data:`STAGE_WEIGHTS` of the target
    stage (``shift``: table keys are parent stages, one below their target)."""
    stages = [s for s, items in sorted(table.items()) if items]
    return rng.choices(stages, [STAGE_WEIGHTS.get(s + shift, 0.01) for s in stages])[0]


def _pick(
    rng: random.Random, mode: str, pairs: Pairs
) -> tuple[int, Kernel | None, Kernel, str | None]:
    """(target stage, parent, target, error) of one expansion."""
    if mode == "seed":
        first = rng.random() < SEED_STAGE_ONE and bool(pairs.correct.get(1))
        number = 1 if first else _stage(rng, pairs.correct)
        return number, None, rng.choice(pairs.correct[number]).kernel, None
    if mode == "deepen":
        low, high = rng.choice(pairs.deepen[_stage(rng, pairs.deepen, shift=1)])
        return high.kernel.stage, low.kernel, high.kernel, None
    if mode == "improve":
        slow, fast = rng.choice(pairs.improve[_stage(rng, pairs.improve)])
        return fast.kernel.stage, slow.kernel, fast.kernel, None
    bad, fixed = rng.choice(pairs.repair[_stage(rng, pairs.repair)])
    return fixed.kernel.stage, bad.kernel, fixed.kernel, failure_text(bad.status, bad.error)


def chat_texts(examples: Sequence[Example]) -> list[str]:
    """Whole conversations as the chat template renders them (for training the tokenizer)."""
    return [
        format_chat([m.model_dump() for m in ex.prompt]) + ex.completion + IM_END + "\n"
        for ex in examples
    ]
