"""The exit statuses of the compile script and the C harness: exitcodes.py is their only
definition, and the shell, the C and the Python that reads them agree on it."""

from __future__ import annotations

import re
import subprocess
from importlib import resources
from pathlib import Path

import pytest

from hpcrl_benchmarker import build, gemm, runner, sandbox
from hpcrl_benchmarker.exitcodes import HARNESS_REFUSALS, CompileExit, HarnessExit
from hpcrl_benchmarker.pipeline import Benchmarker
from hpcrl_benchmarker.steps import InternalError
from hpcrl_common.task import TaskSpec

HARNESS = resources.files("hpcrl_benchmarker.harness")
# The part of the harness every task's template includes: the protocol and its exits.
SHARED_H = (HARNESS / "harness.h").read_text()
TEMPLATES = sorted(entry.name for entry in HARNESS.iterdir() if entry.name.endswith(".c"))


def test_the_compile_script_exits_only_with_the_named_statuses() -> None:
    text = build.script(
        "gcc", ["-O3", "-march=native"], Path("/x/gemm.o"), build.Outputs.of(Path("/x"))
    )
    assert {int(n) for n in re.findall(r"\bexit (\d+)", text)} == set(CompileExit)


def test_the_harness_names_every_status_and_spells_none_as_a_number() -> None:
    used = set(re.findall(r"\bHARNESS_EXIT_(\w+)\b", SHARED_H))
    assert used == {status.name for status in HarnessExit}
    guarded = set(re.findall(r"defined\(HARNESS_EXIT_(\w+)\)", SHARED_H))
    assert guarded == used  # it refuses to compile without any one of them
    assert not re.search(r"#\s*define\s+HARNESS_EXIT_", SHARED_H)  # no second definition
    numeric = re.findall(r"\b(?:return|_?exit\s*\()\s*\(?\s*(\d+)", SHARED_H)
    assert set(numeric) <= {"0"}, numeric
    assert {"gemm.c", "gemv.c"} <= set(TEMPLATES)
    for name in TEMPLATES:  # a template exits only through the shared part
        text = (HARNESS / name).read_text()
        assert '#include "harness.h"' in text, name
        assert not re.search(r"\bHARNESS_EXIT_|\b(?:return|_?exit\s*\()\s*\(?\s*\d", text), name


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_harness_does_not_compile_without_the_definitions(tmp_path: Path, name: str) -> None:
    (tmp_path / "harness.h").write_text(SHARED_H)
    source = tmp_path / name
    source.write_text((HARNESS / name).read_text())
    done = subprocess.run(
        ["gcc", "-fopenmp", "-c", str(source), "-o", str(tmp_path / "g.o")],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "harness_defines" in done.stderr


KERNEL = """void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
    for (int i = 0; i < M * N; i++) C[i] = 0;
}
"""


@pytest.mark.parametrize(("argv", "stdin"), [([], b""), (["3"], b"not a nonce\n")])
def test_the_compiled_harness_exits_with_the_python_value(
    bench: Benchmarker, task: TaskSpec, tmp_path: Path, argv: list[str], stdin: bytes
) -> None:
    kernel = tmp_path / "kernel.c"
    kernel.write_text(KERNEL)
    binary = tmp_path / "run"
    subprocess.run(
        ["gcc", "-fopenmp", str(kernel), str(bench.harness_object(task)), "-o", str(binary), "-lm"],
        check=True,
        capture_output=True,
    )
    done = subprocess.run([str(binary), *argv], input=stdin, capture_output=True)
    assert done.returncode == HarnessExit.BAD_INPUT


def _ended(returncode: int) -> sandbox.Outcome:
    return sandbox.Outcome(returncode, b"", b"harness: why", False, 0.1)


def test_python_reads_the_statuses_as_named() -> None:
    talk = runner.Conversation([gemm.Job("v", {"M": 2, "N": 2, "K": 2}, 1)], 0, None)
    failure = runner.run_failure(_ended(HarnessExit.OUT_OF_MEMORY), talk, 8)
    assert failure is not None and failure.status == "runtime_error"
    assert failure.error.startswith("out of memory")
    for refusal in HARNESS_REFUSALS:
        with pytest.raises(InternalError, match=f"rc {int(refusal)}"):
            runner.run_failure(_ended(refusal), talk, 8)
    failure = runner.run_failure(_ended(HarnessExit.WRITE_FAILED), talk, 8)
    assert failure is not None and "exited early with status 95" in failure.error


@pytest.mark.parametrize(
    ("cpu_s", "waiting_s", "judged"),
    [
        (7.9, 0.1, "timeout"),  # it spun through the limit: the kernel's timeout
        (0.0, 0.01, "timeout"),  # it slept: no wait for a CPU either
        (3.8, 4.1, "timeout"),  # it had half the CPU on a busy node and still did not finish
        (0.05, 7.9, "starved"),  # as beside vLLM: it never had a CPU; the candidate goes back
    ],
)
def test_a_timeout_spent_waiting_for_a_cpu_is_handed_back(
    cpu_s: float, waiting_s: float, judged: str
) -> None:
    talk = runner.Conversation([gemm.Job("v", {"M": 2, "N": 2, "K": 2}, 1)], 0, None)
    outcome = sandbox.Outcome(
        -9, b"", b"", True, 8.1, start_s=0.05, schedule=sandbox.Schedule(cpu_s, waiting_s, 4)
    )
    if judged == "starved":
        with pytest.raises(InternalError, match="starved of CPU"):
            runner.run_failure(outcome, talk, 8)
        return
    failure = runner.run_failure(outcome, talk, 8)
    assert failure is not None and failure.status == "timeout", failure
    assert f"{cpu_s:.2f} s on a CPU" in failure.error


def test_a_compile_timeout_spent_waiting_for_a_cpu_is_handed_back(
    tmp_path: Path, task: TaskSpec
) -> None:
    limit = task.compile.time_limit_s
    starved = sandbox.Outcome(
        -9,
        b"",
        b"",
        True,
        limit + 0.1,
        start_s=0.01,
        schedule=sandbox.Schedule(0.2, 0.9 * limit, 3),
    )
    with pytest.raises(InternalError, match="compile was starved of CPU"):
        build.result(starved, tmp_path, task)
    spun = sandbox.Outcome(
        -9,
        b"",
        b"",
        True,
        limit + 0.1,
        start_s=0.01,
        schedule=sandbox.Schedule(0.9 * limit, 0.2, 3),
    )
    assert "did not finish within" in build.result(spun, tmp_path, task).error


@pytest.mark.parametrize("status", sorted(int(s) for s in HARNESS_REFUSALS))
def test_a_kernel_that_exits_with_a_refusal_status_is_judged_not_handed_back(
    judge, status: int
) -> None:
    """The harness's refusals to start are the benchmarker's fault and go back to the queue;
    a kernel that exit()s with one of those statuses from inside a call must not pass for
    one, or it would never be judged (and never penalised)."""
    code = "#include <stdlib.h>\n" + KERNEL.replace(
        "for (int i", f"if (M > 0) exit({status});\n    for (int i"
    )
    verdict = judge(code, stage=1)
    assert verdict.status == "runtime_error"
    assert f"exited early with status {status}" in verdict.error
