"""README.md stays true: its reference tables are what the code prints, defaults included."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "deploy" / "reference.py"
SECTIONS = ("broker", "logging", "experiment", "scheduler", "generator", "learner", "benchmarker")


def _reference(*args: str) -> subprocess.CompletedProcess[str]:
    # A fresh interpreter: the metrics table is read from the prometheus registry, which
    # other tests in this process may have added metrics to.
    return subprocess.run([sys.executable, str(REFERENCE), *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=120)


def test_readme_tables_are_what_the_code_prints():
    check = _reference("check")
    assert check.returncode == 0, (
        "README.md's settings/metrics tables differ from the code; run "
        "`.venv/bin/python deploy/reference.py readme` and commit the result:\n"
        + check.stdout + check.stderr
    )


def test_reference_output_is_stable_and_complete():
    first, second = _reference("settings"), _reference("settings")
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    assert " at 0x" not in first.stdout
    rows = re.findall(r"^\| `(\w+)\.", first.stdout, flags=re.M)
    assert set(rows) == set(SECTIONS) and len(rows) > 50
    metrics = _reference("metrics")
    assert metrics.returncode == 0, metrics.stderr
    assert len(re.findall(r"^\| `hpcrl_", metrics.stdout, flags=re.M)) > 30


def test_no_reference_table_outside_the_generated_blocks():
    # A hand-written row elsewhere would not be regenerated, and would drift.
    readme = (ROOT / "README.md").read_text()
    outside = re.sub(r"<!-- (settings|metrics):begin -->.*?<!-- \1:end -->", "", readme,
                     flags=re.S)
    key_row = re.compile(rf"^\| `({'|'.join(SECTIONS)})\.\w|^\| `hpcrl_\w+`", re.M)
    stray = [line for line in outside.splitlines() if key_row.match(line)]
    assert not stray, f"reference rows outside the generated blocks of README.md: {stray}"


def test_readme_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    first = readme.index("```bash")
    block = readme[first: readme.index("```", first + 7)]
    assert "make demo" in block and "make test" in block
