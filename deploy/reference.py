"""Print the reference tables of README.md: every config key and every metric.

    .venv/bin/python deploy/reference.py settings   # markdown tables of all config sections
    .venv/bin/python deploy/reference.py metrics    # markdown tables of all metrics
    .venv/bin/python deploy/reference.py readme     # rewrite both tables in README.md

Both are read from the code (the pydantic config sections and the prometheus_client
registry), and tests/test_readme.py checks that README.md names every one of them.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import REGISTRY
from pydantic import BaseModel

from hpcrl_common.config import BrokerSettings, ExperimentSettings, LoggingSettings

METRIC_MODULES = (
    "hpcrl_common.broker",
    "hpcrl_common.metrics",
    "hpcrl_benchmarker.service",
    "hpcrl_scheduler.metrics",
    "hpcrl_learner.metrics",
    "hpcrl_generator.metrics",
)


def config_sections() -> dict[str, type[BaseModel]]:
    from hpcrl_benchmarker.service import BenchmarkerSection
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
            default = f'`"{value}"`' if isinstance(value, str) else f"`{value}`"
        yield f"{prefix}.{name}", default, (info.description or "").replace("|", "\\|")


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


def rewrite_readme(readme: Path) -> None:
    """Replace the text between <!-- X:begin --> and <!-- X:end --> with fresh tables."""
    text = readme.read_text()
    for what in ("settings", "metrics"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_tables(what)
        block = f"<!-- {what}:begin -->\n{out.getvalue().strip()}\n<!-- {what}:end -->"
        text = re.sub(rf"<!-- {what}:begin -->.*?<!-- {what}:end -->", lambda _, b=block: b, text,
                      flags=re.S)
    readme.write_text(text)


def main() -> int:
    what = sys.argv[1] if len(sys.argv) > 1 else "settings"
    if what == "readme":
        rewrite_readme(Path(__file__).resolve().parents[1] / "README.md")
        return 0
    if what not in ("settings", "metrics"):
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
    elif what == "metrics":
        for owner, rows in metric_rows().items():
            print(f"\n{owner}\n\n| metric | type | labels | meaning |\n|---|---|---|---|")
            for row in sorted(rows):
                print("| `{}` | {} | {} | {} |".format(*row))


if __name__ == "__main__":
    sys.exit(main())
