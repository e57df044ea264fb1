"""The one-shot CLI contract: `check FILE --json` prints exactly one JSON object, exits 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ALLOW_ISA, KERNELS

CLI = [sys.executable, "-m", "hpcrl_benchmarker.cli"]
ISA = [arg for isa in ALLOW_ISA for arg in ("--allow-isa", isa)]


@pytest.mark.parametrize(
    ("file", "args", "status"),
    [
        ("naive.c", ["--stage", "1", "--opt-level", "O0"], "success"),
        ("ikj_omp.c", ["--stage", "2"], "stage_violation"),
        ("segfault.c", [], "runtime_error"),
    ],
)
def test_check_json(file: str, args: list[str], status: str, tmp_path: Path) -> None:
    out = subprocess.run(
        [*CLI, "check", str(KERNELS / file), "--json", *args, *ISA, "--work-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    verdict = json.loads(out.stdout)  # exactly one object: json.loads rejects trailing data
    assert verdict["status"] == status
    assert {"reward", "gflops", "techniques", "generalizes", "error", "host"} <= set(verdict)
    assert (verdict["gflops"] is None) == (status != "success")


def test_check_by_task_path_and_bad_opt_level(tmp_path: Path) -> None:
    from importlib import resources

    text = (resources.files("hpcrl_common.tasks") / "matmul.toml").read_text()
    path = tmp_path / "small.toml"
    path.write_text(
        text.replace(
            "reward = { M = 256, N = 256, K = 256 }", "reward = { M = 64, N = 48, K = 32 }"
        )
    )
    out = subprocess.run(
        [
            *CLI,
            "check",
            str(KERNELS / "naive.c"),
            "--task",
            str(path),
            "--json",
            *ISA,
            "--work-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    verdict = json.loads(out.stdout)
    assert verdict["status"] == "success"
    assert verdict["gflops"] * verdict["timing"]["mean_s"] * 1e9 == pytest.approx(2 * 64 * 48 * 32)
    out = subprocess.run(
        [*CLI, "check", str(KERNELS / "naive.c"), "--opt-level", "O9", *ISA],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "O9" in out.stderr
    missing = tmp_path / "missing.c"
    out = subprocess.run(
        [*CLI, "check", str(missing), *ISA], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "cannot read" in out.stderr and str(missing) in out.stderr
    assert "Traceback" not in out.stderr


def test_help_lists_commands() -> None:
    out = subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=60)
    assert "check" in out.stdout and "serve" in out.stdout
