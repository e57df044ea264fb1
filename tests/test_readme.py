"""The READMEs stay true: their reference tables are what the code prints, defaults included.

README.md has every settings and metrics table; each service's README has its own section's
(between <!-- settings:SERVICE:begin/end --> and <!-- metrics:SERVICE:begin/end -->).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "deploy" / "reference.py"
SECTIONS = ("broker", "logging", "experiment", "scheduler", "generator", "learner", "benchmarker")
# README (relative to the root) -> the config section whose tables it carries (None: all).
READMES = {
    "README.md": None,
    "services/benchmarker/README.md": "benchmarker",
    "services/generator/README.md": "generator",
    "services/learner/README.md": "learner",
    "services/sqd_scheduler/README.md": "scheduler",
}
REGENERATE = "`.venv/bin/python deploy/reference.py readme`"


def _reference(*args: str) -> subprocess.CompletedProcess[str]:
    # A fresh interpreter: the metrics table is read from the prometheus registry, which
    # other tests in this process may have added metrics to.
    return subprocess.run(
        [sys.executable, str(REFERENCE), *args],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def check() -> subprocess.CompletedProcess[str]:
    return _reference("check")


@pytest.fixture(scope="module")
def settings() -> subprocess.CompletedProcess[str]:
    return _reference("settings")


@pytest.mark.parametrize("readme", READMES)
def test_readme_tables_are_what_the_code_prints(check, readme):
    assert check.returncode in (0, 1), check.stdout + check.stderr
    stale = re.search(rf"^{re.escape(readme)}: ", check.stdout, flags=re.M)
    assert stale is None, (
        f"{readme}'s settings/metrics tables differ from the code; run {REGENERATE} and "
        "commit the result:\n" + check.stdout + check.stderr
    )


def test_check_passes(check):
    assert check.returncode == 0, (
        f"reference tables differ from the code; run {REGENERATE}:\n" + check.stdout + check.stderr
    )


def test_reference_output_is_stable_and_complete(settings):
    second = _reference("settings")
    assert settings.returncode == 0, settings.stderr
    assert settings.stdout == second.stdout
    assert " at 0x" not in settings.stdout
    rows = re.findall(r"^\| `(\w+)\.", settings.stdout, flags=re.M)
    assert set(rows) == set(SECTIONS) and len(rows) > 50
    metrics = _reference("metrics")
    assert metrics.returncode == 0, metrics.stderr
    assert len(re.findall(r"^\| `hpcrl_", metrics.stdout, flags=re.M)) > 30


@pytest.mark.parametrize("readme", READMES)
def test_no_reference_table_outside_the_generated_blocks(settings, readme):
    # A hand-written row elsewhere would not be regenerated, and would drift.
    text = (ROOT / readme).read_text()
    outside = re.sub(
        r"<!-- ((?:settings|metrics)(?::\w+)?):begin -->.*?<!-- \1:end -->", "", text, flags=re.S
    )
    patterns = [rf"^\| `({'|'.join(SECTIONS)})\.\w", r"^\| `hpcrl_\w+`"]
    section = READMES[readme]
    if section is not None:
        # A service's README may name its keys without the section, as its old tables did.
        keys = re.findall(rf"^\| `{section}\.([\w.]+)` \|", settings.stdout, flags=re.M)
        assert keys, f"no keys of [{section}] in the settings output"
        patterns.append(rf"^\| `({'|'.join(map(re.escape, keys))})`")
    key_row = re.compile("|".join(patterns), re.M)
    stray = [line for line in outside.splitlines() if key_row.match(line)]
    assert not stray, f"reference rows outside the generated blocks of {readme}: {stray}"


def test_readme_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    first = readme.index("```bash")
    block = readme[first : readme.index("```", first + 7)]
    assert "make demo" in block and "make test" in block
