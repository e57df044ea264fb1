"""The documents a clone carries: docs/SPEC.md and docs/DESIGN.md exist, what cites them
cites sections they have, and nothing points outside the repository."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("docs/SPEC.md", "docs/DESIGN.md")
# Built from pieces, so that this file does not match itself.
OUTSIDE = re.compile(
    "|".join(
        re.escape(p) for p in ("../" + "shared/", "shared/" + "SPEC.md", "shared/" + "DESIGN.md")
    )
)
TEXT_SUFFIXES = {
    ".py",
    ".md",
    ".toml",
    ".txt",
    ".sh",
    ".c",
    ".h",
    ".yaml",
    ".yml",
    ".json",
    ".cfg",
    ".ini",
    ".example",
    ".sbatch",
    ".service",
    "",
}


def tracked_text_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    paths = [ROOT / name for name in out.stdout.decode().split("\0") if name]
    return [p for p in paths if p.suffix in TEXT_SUFFIXES and p.is_file()]


def test_the_docs_exist():
    for doc in DOCS:
        assert (ROOT / doc).stat().st_size > 1000, doc


def test_no_tracked_file_points_outside_the_repository():
    offenders = []
    for path in tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "cite docs/SPEC.md or docs/DESIGN.md instead:\n" + "\n".join(offenders)


def test_cited_sections_exist():
    headings = {
        doc: set(re.findall(r"^## (\d+)\.", (ROOT / doc).read_text(), flags=re.M)) for doc in DOCS
    }
    cite = re.compile(r"(docs/(?:SPEC|DESIGN)\.md)\)?,? section (\d+)")
    missing = []
    for path in tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for doc, number in cite.findall(text):
            if number not in headings[doc]:
                missing.append(f"{path.relative_to(ROOT)}: {doc} section {number}")
    assert not missing, "no such section:\n" + "\n".join(missing)


SERVICE_PACKAGES = {
    "generator": "services/generator/src/hpcrl_generator",
    "benchmarker": "services/benchmarker/src/hpcrl_benchmarker",
    "sqd_scheduler": "services/sqd_scheduler/src/hpcrl_scheduler",
    "learner": "services/learner/src/hpcrl_learner",
}


def test_the_reading_path_names_files_and_functions_that_exist():
    """README's "Reading the code" table: each module it names is a file of that service,
    each `Name` or `module.name` a definition there (or a subcommand of its command line)."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("### Reading the code", 1)[1].split("\n\n")[2]
    rows = [
        line
        for line in table.splitlines()
        if line.startswith("| ") and " → " in line and not line.startswith("| service |")
    ]
    assert {row.split(" | ")[0][2:] for row in rows} == set(SERVICE_PACKAGES)
    for row in rows:
        service = row.split(" | ")[0][2:]
        path = ROOT / SERVICE_PACKAGES[service]
        sources = "\n".join(p.read_text() for p in path.rglob("*.py"))
        for name in re.findall(r"`([^`]+)`", row):
            if name.endswith(".py"):
                assert (path / name.removeprefix(path.name + "/")).is_file(), (service, name)
            elif name.isidentifier() or "." in name:
                last = re.escape(name.split(".")[-1])
                # a definition, or a subcommand of the service's command line
                assert re.search(rf"(def|class) {last}\b|add_parser\(\s*\"{last}\"", sources), (
                    service,
                    name,
                )
