"""What the dashboards ask for and what the services export, with no I/O beyond imports.

The services' metrics are module-level prometheus_client collectors in the default REGISTRY,
so importing the modules that define them is enough to list every series name a service can
expose and the labels each carries.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from prometheus_client import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD_DIR = GRAFANA / "dashboards"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"


def _metric_modules() -> tuple[str, ...]:
    """Every module that defines a service's metrics: one list, kept in deploy/reference.py."""
    path = ROOT / "deploy" / "reference.py"
    spec = importlib.util.spec_from_file_location("hpcrl_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.METRIC_MODULES


METRIC_MODULES = _metric_modules()
# Series names that Prometheus itself adds to every target; the dashboards may use them.
PROMETHEUS_SERIES = {"up": frozenset()}
TARGET_LABELS = frozenset({"job", "instance"})
IDENTIFIER = re.compile(r"(?<![\w:$])[a-zA-Z_:][\w:]*")
SELECTOR = re.compile(r"(?<![\w:])([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*\"((?:[^\"\\]|\\.)*)\"")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
STRING = re.compile(r"\"(?:[^\"\\]|\\.)*\"")
GRAFANA_VARIABLE = re.compile(r"\$__rate_interval|\$__interval|\$__range")
# PromQL words that look like identifiers: functions, aggregations, keywords, durations.
_PROMQL_WORDS = """
sum min max avg count stddev stdvar topk bottomk quantile count_values group by without on
ignoring group_left group_right bool and or unless offset rate irate increase delta idelta
deriv histogram_quantile scalar vector abs ceil floor round clamp clamp_min clamp_max
label_replace label_join sort sort_desc time timestamp absent absent_over_time changes resets
avg_over_time max_over_time min_over_time sum_over_time count_over_time last_over_time
quantile_over_time stddev_over_time present_over_time exp ln log2 log10 sqrt predict_linear
holt_winters day_of_month day_of_week hour minute month year days_in_month
"""
PROMQL_WORDS = frozenset(_PROMQL_WORDS.split())


@dataclass(frozen=True)
class Series:
    family: str
    labels: frozenset[str]


def load_metric_modules() -> list[ModuleType]:
    return [importlib.import_module(name) for name in METRIC_MODULES]


def exported_series() -> dict[str, Series]:
    """Every series name the services can expose -> its family and label names."""
    load_metric_modules()
    names = REGISTRY._names_to_collectors  # the only place that keeps labelnames of unused vecs
    series: dict[str, Series] = {
        name: Series(name, labels) for name, labels in PROMETHEUS_SERIES.items()
    }
    for collector in set(names.values()):
        for family in collector.describe() if hasattr(collector, "describe") else []:
            if not family.name.startswith("hpcrl_"):
                continue
            labels = frozenset(getattr(collector, "_labelnames", ()))
            if family.type == "info":
                # Info labels are the keys of the dict passed to .info(), known once it is set.
                for sample in collector.collect()[0].samples:
                    labels |= set(sample.labels)
            for suffix, extra in _suffixes(family.type):
                series[family.name + suffix] = Series(family.name, labels | extra)
    return series


def _suffixes(kind: str) -> list[tuple[str, frozenset[str]]]:
    none: frozenset[str] = frozenset()
    return {
        "counter": [("_total", none), ("_created", none)],
        "gauge": [("", none)],
        "histogram": [
            ("_bucket", frozenset({"le"})),
            ("_sum", none),
            ("_count", none),
            ("_created", none),
        ],
        "summary": [
            ("", frozenset({"quantile"})),
            ("_sum", none),
            ("_count", none),
            ("_created", none),
        ],
        "info": [("_info", none)],
    }.get(kind, [("", none)])


@dataclass(frozen=True)
class DashboardQuery:
    dashboard: str
    panel: str
    expr: str
    legend: str
    datasource_uid: str | None


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARD_DIR.glob("*.json"))


def queries(path: Path) -> Iterator[DashboardQuery]:
    board = json.loads(path.read_text())
    for panel in board["panels"]:
        for target in panel.get("targets") or []:
            yield DashboardQuery(
                path.name,
                panel["title"],
                target["expr"],
                target.get("legendFormat", ""),
                (target.get("datasource") or {}).get("uid"),
            )


def panels(path: Path) -> list[dict]:
    return json.loads(path.read_text())["panels"]


def as_promql(expr: str) -> str:
    """The expression as Prometheus sees it once Grafana has filled in its variables."""
    return GRAFANA_VARIABLE.sub("1m", expr)


def metric_names(expr: str) -> set[str]:
    code = STRING.sub('""', as_promql(expr))
    code = GROUPING.sub("", code)
    code = re.sub(r"\{[^}]*\}", "", code)  # label matchers
    code = re.sub(r"\[[^\]]*\]", "", code)  # range selectors
    return {
        word
        for word in IDENTIFIER.findall(code)
        if word not in PROMQL_WORDS and not re.fullmatch(r"\d\w*", word)
    }


def problems(expr: str, legend: str, series: dict[str, Series], jobs: set[str]) -> list[str]:
    """What is wrong with one dashboard query: unknown metrics, labels no named metric carries,
    jobs that Prometheus does not scrape."""
    found: list[str] = []
    names = metric_names(expr)
    if not names:
        found.append("names no metric")
    for name in sorted(names - set(series)):
        found.append(f"unknown metric {name}")
    known = [series[name] for name in names if name in series]
    available = set(TARGET_LABELS).union(*(s.labels for s in known))
    for name, matchers in SELECTOR.findall(expr):
        if name not in series:
            continue
        for label, value in MATCHER.findall(matchers):
            if label not in series[name].labels | TARGET_LABELS:
                found.append(f"{name} has no label {label!r}")
            if label == "job" and value not in jobs:
                found.append(f"job {value!r} is not scraped by {PROMETHEUS_CONFIG.name}")
    for group in GROUPING.findall(expr):
        for label in (x.strip() for x in group.split(",")):
            if label and label not in available:
                found.append(f"groups by {label!r}, which none of {sorted(names)} carries")
    for label in LEGEND_LABEL.findall(legend):
        if label not in available:
            found.append(f"legend names {label!r}, which none of {sorted(names)} carries")
    return found


def load_builder() -> ModuleType:
    """deploy/grafana/build_dashboards.py, which is a script, not a package module."""
    spec = importlib.util.spec_from_file_location(
        "build_dashboards", GRAFANA / "build_dashboards.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module
