"""Print the reference tables of the READMEs: every config key and every metric.

    .venv/bin/python deploy/reference.py settings [SECTION]  # markdown tables of the config
    .venv/bin/python deploy/reference.py metrics [GROUP]     # markdown tables of the metrics
    .venv/bin/python deploy/reference.py readme     # rewrite the tables in every README
    .venv/bin/python deploy/reference.py check      # exit 1 if a README's tables are stale

Both are read from the code (the pydantic config sections, the cross-section relations of
hpcrl_common.config and the prometheus_client registry); tests/test_readme.py runs `check`.
README.md has every table, between <!-- settings:begin --> and <!-- settings:end --> (and
metrics:begin/end); each service's README has its own section's table, with the relations
that name its keys, between <!-- settings:SERVICE:begin --> and <!-- settings:SERVICE:end -->,
and its own metrics between <!-- metrics:SERVICE:begin/end --> (SERVICE: benchmarker,
generator, learner, scheduler). Every block is printed by the same functions.

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

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCKS = ("settings", "metrics")
# Config section (and metric group) -> the README of the service that owns it.
SERVICE_READMES = {
    "benchmarker": ROOT / "services" / "benchmarker" / "README.md",
    "generator": ROOT / "services" / "generator" / "README.md",
    "learner": ROOT / "services" / "learner" / "README.md",
    "scheduler": ROOT / "services" / "sqd_scheduler" / "README.md",
}
RELATION_TEXT = {"equal": "=", "at_most": "≤", "implies": "true ⇒ true"}

# Metric groups: a metric belongs to the component its name starts with, else to "common".
METRIC_GROUPS = ("common", "benchmarker", "scheduler", "learner", "generator")
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

    return {
        "broker": BrokerSettings,
        "logging": LoggingSettings,
        "experiment": ExperimentSettings,
        "scheduler": SchedulerSection,
        "generator": GeneratorSection,
        "learner": LearnerSettings,
        "benchmarker": BenchmarkerSection,
    }


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
        return (
            "{" + ", ".join(f"{key} = {render_default(item)}" for key, item in value.items()) + "}"
        )
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    # An object's default text may carry a memory address or depend on the host.
    raise TypeError(f"no stable rendering for a default of type {type(value).__name__}")


def relation_rows(section: str | None = None) -> Iterator[tuple[str, str, str, str]]:
    """The cross-section relations; with ``section``, only those naming one of its keys."""
    for relation in RELATIONS:
        sections = {relation.left.split(".")[0], relation.right.split(".")[0]}
        if section is None or section in sections:
            yield (
                relation.left,
                RELATION_TEXT[relation.kind],
                relation.right,
                relation.why.replace("|", "\\|"),
            )


def metric_rows() -> dict[str, list[tuple[str, str, str, str]]]:
    """Every hpcrl metric in the registry, grouped by the component its name starts with."""
    for module in METRIC_MODULES:
        importlib.import_module(module)
    components = METRIC_GROUPS[1:]
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
    return dict(sorted(rows.items(), key=lambda item: METRIC_GROUPS.index(item[0])))


def tables(what: str, only: str | None = None) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_tables(what, only)
    return out.getvalue().strip()


def readme_blocks() -> dict[Path, list[tuple[str, str, str | None]]]:
    """Each README with its generated blocks: (marker name, what, section or None for all)."""
    blocks: dict[Path, list[tuple[str, str, str | None]]] = {
        README: [(what, what, None) for what in BLOCKS]
    }
    for service, readme in SERVICE_READMES.items():
        blocks[readme] = [(f"{what}:{service}", what, service) for what in BLOCKS]
    return blocks


def block_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"<!-- {name}:begin -->\n(.*?)\n?<!-- {name}:end -->", re.S)


def shown(readme: Path) -> str:
    return readme.relative_to(ROOT).as_posix()


def rewrite_readme(readme: Path, blocks: list[tuple[str, str, str | None]]) -> None:
    """Replace the text between <!-- X:begin --> and <!-- X:end --> with fresh tables."""
    text = readme.read_text()
    for name, what, only in blocks:
        block = f"<!-- {name}:begin -->\n{tables(what, only)}\n<!-- {name}:end -->"
        text = block_pattern(name).sub(lambda _, b=block: b, text)
    readme.write_text(text)


def check_readme(readme: Path, blocks: list[tuple[str, str, str | None]]) -> list[str]:
    """Why a README's generated blocks differ from what the code prints now (empty: none)."""
    text = readme.read_text()
    problems = []
    for name, what, only in blocks:
        found = block_pattern(name).findall(text)
        if len(found) != 1:
            problems.append(
                f"{shown(readme)}: {len(found)} <!-- {name}:begin/end --> blocks, expected 1"
            )
            continue
        fresh = tables(what, only)
        if found[0].strip() != fresh:
            diff = difflib.unified_diff(
                found[0].strip().splitlines(),
                fresh.splitlines(),
                f"{shown(readme)} ({name})",
                "code",
                lineterm="",
                n=0,
            )
            problems.append("\n".join(diff))
    return problems


def main() -> int:
    what = sys.argv[1] if len(sys.argv) > 1 else "settings"
    only = sys.argv[2] if len(sys.argv) > 2 else None
    if what == "readme":
        for readme, blocks in readme_blocks().items():
            rewrite_readme(readme, blocks)
        return 0
    if what == "check":
        stale = []
        for readme, blocks in readme_blocks().items():
            problems = check_readme(readme, blocks)
            for problem in problems:
                print(problem)
            if problems:
                stale.append(readme)
        for readme in stale:
            print(
                f"{shown(readme)}: its reference tables differ from the code: run "
                "`.venv/bin/python deploy/reference.py readme`"
            )
        return 1 if stale else 0
    groups = config_sections() if what == "settings" else METRIC_GROUPS
    if what not in BLOCKS or (only is not None and only not in groups):
        print(__doc__, file=sys.stderr)
        return 2
    print_tables(what, only)
    return 0


def print_tables(what: str, only: str | None = None) -> None:
    """The settings or metrics tables: all of them, or those of one section (``only``)."""
    if what == "settings":
        for section, model in config_sections().items():
            if only is not None and section != only:
                continue
            print(f"\n`[{section}]`\n\n| key | default | meaning |\n|---|---|---|")
            for key, default, meaning in setting_rows(section, model):
                print(f"| `{key}` | {default} | {meaning} |")
        relations = list(relation_rows(only))
        if not relations:
            return
        print(
            "\nKeys of different sections that must agree, checked by every service when it "
            "loads the config (a section absent from the file and the environment is not "
            "checked; a key absent from its section counts with its default):\n\n"
            "| key | must be | key | why |\n|---|---|---|---|"
        )
        for left, relation, right, why in relations:
            print(f"| `{left}` | {relation} | `{right}` | {why} |")
    elif what == "metrics":
        for owner, rows in metric_rows().items():
            if only is not None and owner != only:
                continue
            print(f"\n{owner}\n\n| metric | type | labels | meaning |\n|---|---|---|---|")
            for row in sorted(rows):
                print("| `{}` | {} | {} | {} |".format(*row))


if __name__ == "__main__":
    sys.exit(main())
