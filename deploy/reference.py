"""Print the reference tables of README.md: every config key and every metric.

    .venv/bin/python deploy/reference.py settings   # markdown tables of all config sections
    .venv/bin/python deploy/reference.py metrics    # markdown tables of all metrics
    .venv/bin/python deploy/reference.py readme     # rewrite both tables in README.md
    .venv/bin/python deploy/reference.py check      # exit 1 if README.md's tables are stale

Both are read from the code (the pydantic config sections, the cross-section relations of
hpcrl_common.config and the prometheus_client registry); tests/test_readme.py runs `check`.
The output depends only on the code: sections and metric groups in a fixed order, keys in
their declaration order, metrics sorted, defaults rendered from plain values (a default that
would depend on the host must be a constant such as 0 or "" whose meaning says what it
resolves to at run time).
"""

from __future__ import annotations

import contextlib
import difflib
import enum
import importlib
import inspect
import io
import re
import sys
from collections.abc import Iterator
from pathlib import Path, PurePath
from typing import Any

from prometheus_client import REGISTRY
from pydantic import BaseModel

from hpcrl_common.config import RELATIONS, BrokerSettings, ExperimentSettings, LoggingSettings

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = ("settings", "metrics")
RELATION_TEXT = {"equal": "=", "at_most": "≤", "implies": "true ⇒ true"}

METRIC_MODULES = (
    "hpcrl_common.broker",
    "hpcrl_common.metrics",
    "hpcrl_benchmarker.metrics",
    "hpcrl_scheduler.metrics",
    "hpcrl_learner.metrics",
    "hpcrl_generator.metrics",
)


def config_sections() -> dict[str, type[BaseModel]]:
    from hpcrl_benchmarker.config import BenchmarkerSection
    from hpcrl_generator.config import GeneratorSection
    from hpcrl_learner.config import LearnerSettings
    from hpcrl_scheduler.config import SchedulerSection

    return {"broker": BrokerSettings, "logging": LoggingSettings, "experiment": ExperimentSettings,
            "scheduler": SchedulerSection, "generator": GeneratorSection,
            "learner": LearnerSettings, "benchmarker": BenchmarkerSection}


def setting_rows(prefix: str, model: type[BaseModel]) -> Iterator[tuple[str, str, str]]:
    for name, info in model.model_fields.items():
        if inspect.isclass(info.annotation) and issubclass(info.annotation, BaseModel):
            yield from setting_rows(f"{prefix}.{name}", info.annotation)
            continue
        if info.is_required():
            default = "required"
        else:
            value = info.default if info.default_factory is None else info.default_factory()
            default = "unset" if value is None else f"`{render_default(value)}`"
        yield f"{prefix}.{name}", default, (info.description or "").replace("|", "\\|")


def render_default(value: Any) -> str:
    """A default as it reads in the TOML's terms; refuses values whose text is not stable."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, PurePath):
        return value.as_posix()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(render_default(item) for item in value) + "]"
    if isinstance(value, dict):  # an inline TOML table
        return "{" + ", ".join(f"{key} = {render_default(item)}"
                               for key, item in value.items()) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    # An object's default text may carry a memory address or depend on the host.
    raise TypeError(f"no stable rendering for a default of type {type(value).__name__}")


def relation_rows() -> Iterator[tuple[str, str, str, str]]:
    for relation in RELATIONS:
        yield (relation.left, RELATION_TEXT[relation.kind], relation.right,
               relation.why.replace("|", "\\|"))


def metric_rows() -> dict[str, list[tuple[str, str, str, str]]]:
    """Every hpcrl metric in the registry, grouped by the component its name starts with."""
    for module in METRIC_MODULES:
        importlib.import_module(module)
    components = ("benchmarker", "scheduler", "learner", "generator")
    rows: dict[str, list[tuple[str, str, str, str]]] = {}
    seen: set[int] = set()
    for collector in list(REGISTRY._names_to_collectors.values()):
        base = getattr(collector, "_name", "")
        if id(collector) in seen or not base.startswith("hpcrl_"):
            continue
        seen.add(id(collector))
        owner = next((c for c in components if base.startswith(f"hpcrl_{c}_")), "common")
        kind = type(collector).__name__.lower()
        name = base + {"counter": "_total", "info": "_info"}.get(kind, "")
        labels = ", ".join(f"`{label}`" for label in collector._labelnames)
        doc = collector._documentation.replace("|", "\\|")
        rows.setdefault(owner, []).append((name, kind, labels, doc))
    return dict(sorted(rows.items(), key=lambda item: ("common", *components).index(item[0])))


def tables(what: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_tables(what)
    return out.getvalue().strip()


def block_pattern(what: str) -> re.Pattern[str]:
    return re.compile(rf"<!-- {what}:begin -->\n(.*?)\n?<!-- {what}:end -->", re.S)


def rewrite_readme(readme: Path) -> None:
    """Replace the text between <!-- X:begin --> and <!-- X:end --> with fresh tables."""
    text = readme.read_text()
    for what in BLOCKS:
        block = f"<!-- {what}:begin -->\n{tables(what)}\n<!-- {what}:end -->"
        text = block_pattern(what).sub(lambda _, b=block: b, text)
    readme.write_text(text)


def check_readme(readme: Path) -> list[str]:
    """Why README.md's generated blocks differ from what the code prints now (empty: none)."""
    text = readme.read_text()
    problems = []
    for what in BLOCKS:
        found = block_pattern(what).findall(text)
        if len(found) != 1:
            problems.append(f"{readme.name}: {len(found)} <!-- {what}:begin/end --> blocks, "
                            "expected 1")
            continue
        fresh = tables(what)
        if found[0].strip() != fresh:
            diff = difflib.unified_diff(found[0].strip().splitlines(), fresh.splitlines(),
                                        f"{readme.name} ({what})", "code", lineterm="", n=0)
            problems.append("\n".join(diff))
    return problems


def main() -> int:
    what = sys.argv[1] if len(sys.argv) > 1 else "settings"
    if what == "readme":
        rewrite_readme(README)
        return 0
    if what == "check":
        problems = check_readme(README)
        for problem in problems:
            print(problem)
        if problems:
            print("README.md's reference tables differ from the code: run "
                  "`.venv/bin/python deploy/reference.py readme`")
        return 1 if problems else 0
    if what not in BLOCKS:
        print(__doc__, file=sys.stderr)
        return 2
    print_tables(what)
    return 0


def print_tables(what: str) -> None:
    if what == "settings":
        for section, model in config_sections().items():
            print(f"\n`[{section}]`\n\n| key | default | meaning |\n|---|---|---|")
            for key, default, meaning in setting_rows(section, model):
                print(f"| `{key}` | {default} | {meaning} |")
        print("\nKeys of different sections that must agree, checked by every service when it "
              "loads the config (a section absent from the file and the environment is not "
              "checked; a key absent from its section counts with its default):\n\n"
              "| key | must be | key | why |\n|---|---|---|---|")
        for left, relation, right, why in relation_rows():
            print(f"| `{left}` | {relation} | `{right}` | {why} |")
    elif what == "metrics":
        for owner, rows in metric_rows().items():
            print(f"\n{owner}\n\n| metric | type | labels | meaning |\n|---|---|---|---|")
            for row in sorted(rows):
                print("| `{}` | {} | {} | {} |".format(*row))


if __name__ == "__main__":
    sys.exit(main())
