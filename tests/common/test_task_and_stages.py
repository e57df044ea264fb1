"""Task files are data; the stage table is docs/SPEC.md Table I."""

from __future__ import annotations

from importlib import resources

import pytest

from hpcrl_common.stages import OPENMP, PREFETCH, SIMD, STAGES, stage
from hpcrl_common.task import TaskError, builtin_seed, builtin_tasks, load_task


def test_builtin_matmul_task():
    task = load_task("matmul")
    assert "matmul" in builtin_tasks()
    assert task.signature.startswith("void matmul_optimized(double *A")
    assert task.flop_count({"M": 256, "N": 256, "K": 256}) == 2 * 256**3
    assert task.compile_flags("O3") == ["-O3", "-march=native", "-fopenmp"]
    assert any(s["M"] % 8 for s in task.sizes.verify)  # a size that is not a multiple of 8
    assert task.timing.time_limit_s == 8 and task.verification.random_points == 100


def test_builtin_gemv_task():
    task = load_task("gemv")
    assert "gemv" in builtin_tasks() and builtin_seed("gemv") is not None
    assert task.signature.startswith("void gemv_optimized(const double *A")
    assert task.flop_count(task.sizes.reward) == 2 * 1023 * 1021
    assert all(s["M"] % 8 or s["N"] % 8 for s in [task.sizes.reward, *task.sizes.verify])
    assert task.harness == "gemv" and task.reference == "cblas_dgemv"


def test_bad_tasks_are_clear(tmp_path):
    with pytest.raises(TaskError, match="unknown task 'no_such_kernel'"):
        load_task("no_such_kernel")
    text, source = tmp_path / "t.toml", tmp_path / "ok.toml"
    source.write_text(
        (resources.files("hpcrl_common.tasks") / "matmul.toml")
        .read_text()
        .replace('flops = "2*M*N*K"', "flops = \"__import__('os')\"")
    )
    with pytest.raises(TaskError, match="flops"):
        load_task(source)
    text.write_text("name = 1")
    with pytest.raises(TaskError, match="name: Input should be a valid string"):
        load_task(text)


def test_stage_table():
    assert stage(1).forbidden == (SIMD, OPENMP, PREFETCH)
    assert stage(3).forbidden == (OPENMP, PREFETCH)
    assert stage(4).forbidden == (PREFETCH,)
    assert stage(5).forbidden == () and stage(6).forbidden == ()
    assert stage(2).violations({SIMD, "cache_blocking"}) == [SIMD]
    assert sorted(STAGES) == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match=r"stage must be 1\.\.6"):
        stage(7)
