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
OUTSIDE = re.compile("|".join(re.escape(p) for p in ("../" + "shared/", "shared/" + "SPEC.md",
                                                     "shared/" + "DESIGN.md")))
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".sh", ".c", ".h", ".yaml", ".yml", ".json",
                 ".cfg", ".ini", ".example", ".sbatch", ".service", ""}


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
    headings = {doc: set(re.findall(r"^## (\d+)\.", (ROOT / doc).read_text(), flags=re.M))
                for doc in DOCS}
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
