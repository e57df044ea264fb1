"""The fixed evaluation set, as data: which prompts, at which stage, with which parent.

Comparing whole SQD pools between runs cannot show learning, because the mix of prompts
drifts with what the policy wrote; these prompts never change. They cover every stage (1-6)
and every expansion mode but repair (a repair prompt needs an error, and the errors of a
fixed broken parent would say little about a policy), with hand-written parents the policy
was never taught, so a gain on them is not a gain on its own programs only. Prompts are built by
the scheduler's own function (``hpcrl_common.prompts.build_prompt``), so the policy is asked
exactly as during training. Pure: the only I/O is reading the parents shipped as package data.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from hpcrl_common.messages import ChatMessage
from hpcrl_common.prompts import PromptMode, build_prompt
from hpcrl_common.task import TaskSpec, seed_program

# Parent name -> .c file under hpcrl_evaluate/parents ("seed" is the task's own seed program).
PARENT_FILES: dict[str, str] = {
    "ikj": "ikj.c",
    "tiled": "tiled.c",
    "simd": "simd.c",
    "omp": "omp.c",
    "prefetch": "prefetch.c",
}
# Stage each fixed parent belongs to (and passes the benchmarker at). The SIMD parents use
# AVX2 + FMA, which every host the benchmarker accepts runs.
PARENT_STAGES: dict[str, int] = {
    "seed": 1,
    "ikj": 1,
    "tiled": 2,
    "simd": 3,
    "omp": 4,
    "prefetch": 5,
}


@dataclass(frozen=True)
class PromptSpec:
    """One prompt of the set: ask for a child of ``parent`` in ``mode`` at ``target_stage``."""

    mode: PromptMode
    target_stage: int
    parent: str | None  # a key of PARENT_STAGES; None for the seed prompt

    @property
    def name(self) -> str:
        if self.parent is None:
            return f"{self.mode}@{self.target_stage}"
        if self.mode == "deepen":
            return f"deepen {self.parent}@{PARENT_STAGES[self.parent]}->{self.target_stage}"
        return f"{self.mode} {self.parent}@{self.target_stage}"


# The sets. Order matters: a prompt's index names it in reports and derives its sampling seed.
# GEMM's, with a hand-written parent per stage:
SPECS: tuple[PromptSpec, ...] = (
    PromptSpec("seed", 1, None),
    PromptSpec("improve", 1, "seed"),
    PromptSpec("improve", 1, "ikj"),
    PromptSpec("deepen", 2, "ikj"),
    PromptSpec("improve", 2, "tiled"),
    PromptSpec("deepen", 3, "tiled"),
    PromptSpec("improve", 3, "simd"),
    PromptSpec("deepen", 4, "simd"),
    PromptSpec("improve", 4, "omp"),
    PromptSpec("deepen", 5, "omp"),
    PromptSpec("improve", 5, "prefetch"),
    PromptSpec("deepen", 6, "prefetch"),
)
# Any other task's (gemv, stencil, spmv, a task of one's own): the hand-written parents are
# GEMM kernels, so its set starts from its own seed program: write one, make it faster, add
# the next stage's technique.
SEED_SPECS: tuple[PromptSpec, ...] = (
    PromptSpec("seed", 1, None),
    PromptSpec("improve", 1, "seed"),
    PromptSpec("deepen", 2, "seed"),
)
SETS: dict[str, tuple[PromptSpec, ...]] = {"matmul": SPECS}


def specs_for(task_name: str) -> tuple[PromptSpec, ...]:
    """The fixed set of a task: GEMM's own, else the one every other task has."""
    return SETS.get(task_name, SEED_SPECS)


@dataclass(frozen=True)
class EvalPrompt:
    index: int
    spec: PromptSpec
    messages: tuple[ChatMessage, ...]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def stage(self) -> int:
        """The stage the benchmarker judges a completion at."""
        return self.spec.target_stage


def parent_source(name: str, task: TaskSpec | None = None) -> str:
    """Source of a fixed parent: the task's seed program (GEMM's when no task is given), or a
    file shipped with the package."""
    if name == "seed":
        if task is None:
            from hpcrl_common.task import load_task

            task = load_task("matmul")
        seed = seed_program(task)
        if seed is None:
            raise ValueError(f"task {task.name!r} has no seed program")
        return seed
    if name not in PARENT_FILES:
        raise ValueError(f"unknown parent {name!r} (known: seed, {', '.join(PARENT_FILES)})")
    return (resources.files("hpcrl_evaluate") / "parents" / PARENT_FILES[name]).read_text()


def build_set(
    task: TaskSpec, isa: str, specs: tuple[PromptSpec, ...] | None = None
) -> list[EvalPrompt]:
    """The chat messages of every prompt of the task's set (``specs_for``), for the hosts'
    ISA (``avx512`` or ``avx2``)."""
    prompts = []
    for index, spec in enumerate(specs or specs_for(task.name)):
        # The scheduler passes the seed program as the seed prompt's parent too (unused).
        parent = parent_source(spec.parent or "seed", task)
        messages = build_prompt(
            task,
            target_stage=spec.target_stage,
            mode=spec.mode,
            parent_source=parent,
            error=None,
            isa=isa,
        )
        prompts.append(EvalPrompt(index, spec, tuple(messages)))
    return prompts
