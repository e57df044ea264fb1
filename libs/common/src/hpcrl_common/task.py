"""A task is data: which kernel, its signature, sizes, checks, timing and compile flags.

Task files are shared by the benchmarker (harness and checks), the scheduler (prompts) and
the policy bootstrap (corpus). Adding a kernel is a new TOML file (plus, at most, a new
benchmarker harness template named by ``harness``), not a new code path.
"""

from __future__ import annotations

import ast
import tomllib
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hpcrl_common.messages import describe_errors

Sizes = dict[str, int]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SizeSet(_Section):
    reward: Sizes
    verify: list[Sizes] = []


class Verification(_Section):
    corners_and_centre: bool = True
    random_points: int = Field(100, ge=0)
    rel_tolerance: float = Field(1e-6, gt=0)


class TimingSpec(_Section):
    time_limit_s: float = Field(8.0, gt=0)
    warmup_runs: int = Field(1, ge=0)
    timed_runs: int = Field(3, ge=1)


class CompileSpec(_Section):
    compiler: str = "gcc"
    base_flags: list[str] = ["-march=native", "-fopenmp"]
    time_limit_s: float = Field(30.0, gt=0)
    opt_levels: dict[str, list[str]]


class TaskSpec(_Section):
    name: str
    description: str
    function: str
    signature: str
    harness: str
    reference: str
    flops: str
    penalize_generalization: bool = False
    sizes: SizeSet
    verification: Verification = Verification()
    timing: TimingSpec = TimingSpec()
    compile: CompileSpec
    # A seed program's file, beside the TOML (a task loaded by path); a built-in task's seed is
    # ``tasks/<name>.seed.c``. See ``seed_program``.
    seed: str | None = None

    @field_validator("flops")
    @classmethod
    def _safe_formula(cls, formula: str) -> str:
        _check_formula(ast.parse(formula, mode="eval"))
        return formula

    def flop_count(self, sizes: Sizes) -> float:
        return float(_evaluate(ast.parse(self.flops, mode="eval").body, sizes))

    def compile_flags(self, opt_level: str) -> list[str]:
        try:
            return [*self.compile.opt_levels[opt_level], *self.compile.base_flags]
        except KeyError:
            known = ", ".join(self.compile.opt_levels)
            raise ValueError(
                f"task {self.name!r} has no opt level {opt_level!r} ({known})"
            ) from None


class TaskError(ValueError):
    pass


def builtin_tasks() -> list[str]:
    return sorted(
        entry.name.removesuffix(".toml")
        for entry in resources.files("hpcrl_common.tasks").iterdir()
        if entry.name.endswith(".toml")
    )


def load_task(name_or_path: str | Path) -> TaskSpec:
    """A built-in task by name (``matmul``) or a task TOML by path.

    A task loaded by path may bring its own harness template (``harness = "axpy.c"``, its
    description ``axpy.py`` beside it) and seed program (``seed = "axpy.seed.c"``): both are
    read relative to the TOML's directory and held as absolute paths."""
    text = str(name_or_path)
    directory: Path | None = None
    if text.endswith(".toml") or "/" in text:
        try:
            source, where = Path(text).read_bytes(), text
        except OSError as exc:
            raise TaskError(f"cannot read task file {text}: {exc.strerror}") from None
        directory = Path(text).resolve().parent
    else:
        resource = resources.files("hpcrl_common.tasks") / f"{text}.toml"
        if not resource.is_file():
            raise TaskError(f"unknown task {text!r} (built in: {', '.join(builtin_tasks())})")
        source, where = resource.read_bytes(), f"built-in task {text}"
    try:
        task = TaskSpec.model_validate(tomllib.loads(source.decode()))
    except tomllib.TOMLDecodeError as exc:
        raise TaskError(f"{where} is not valid TOML: {exc}") from None
    except ValidationError as exc:
        raise TaskError(f"{where}: {describe_errors(exc)}") from None
    return _with_own_files(task, directory, where)


def _with_own_files(task: TaskSpec, directory: Path | None, where: str) -> TaskSpec:
    own_harness = is_template_path(task.harness)
    if directory is None:
        if own_harness or task.seed is not None:
            raise TaskError(f"{where}: a built-in task names a built-in harness and no seed file")
        return task
    update: dict[str, str] = {}
    if own_harness:
        update["harness"] = str(directory / task.harness)
    if task.seed is not None:
        update["seed"] = str(directory / task.seed)
    for key, path in update.items():
        if not Path(path).is_file():
            raise TaskError(f"{where}: {key} file {path} does not exist")
    return task.model_copy(update=update)


def is_template_path(harness: str) -> bool:
    """A task's own harness template (a ``.c`` file) rather than a built-in harness's name."""
    return harness.endswith(".c")


def seed_program(task: TaskSpec) -> str | None:
    """The task's seed program: its own file (``seed``), else the built-in one, else None."""
    if task.seed is not None:
        return Path(task.seed).read_text()
    return builtin_seed(task.name)


def builtin_seed(task_name: str) -> str | None:
    """The built-in seed program of a task (``tasks/<name>.seed.c``), or None."""
    resource = resources.files("hpcrl_common.tasks") / f"{task_name}.seed.c"
    return resource.read_text() if resource.is_file() else None


_ALLOWED_NODES = (
    ast.Expression,
    ast.BinOp,
    ast.Name,
    ast.Constant,
    ast.Load,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.Pow,
)


def _check_formula(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise ValueError(f"flops formula may only use + - * / ** on sizes, not {node!r}")


def _evaluate(node: ast.AST, sizes: Sizes) -> float:
    if isinstance(node, ast.Constant):
        return float(node.value)
    if isinstance(node, ast.Name):
        return float(sizes[node.id])
    assert isinstance(node, ast.BinOp)
    left, right = _evaluate(node.left, sizes), _evaluate(node.right, sizes)
    ops = {
        ast.Add: lambda: left + right,
        ast.Sub: lambda: left - right,
        ast.Mult: lambda: left * right,
        ast.Div: lambda: left / right,
        ast.Pow: lambda: left**right,
    }
    return ops[type(node.op)]()
