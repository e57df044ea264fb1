"""What the benchmarker keeps on the node is its own: the work directory, the cached harness,
candidate scratch and the timing lock cannot be used by anyone else to change a verdict or to
stall the service."""

from __future__ import annotations

import fcntl
import os
import stat
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from hpcrl_benchmarker.config import BenchmarkerSection
from hpcrl_benchmarker.pipeline import Benchmarker
from hpcrl_benchmarker.steps import InternalError
from hpcrl_common.task import load_task

from .conftest import HOST, kernel

TASK = load_task("matmul")
NOBODY = 65534


def make(root: Path, **settings) -> Benchmarker:
    return Benchmarker(
        BenchmarkerSection(work_dir=root / "work", lock_path=root / "timing.lock", **settings), HOST
    )


def evaluate(bench: Benchmarker, name: str = "naive.c"):
    return bench.evaluate(kernel(name), stage=1, opt_level="O3", task=TASK)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_work_directory_is_private(tmp_path):
    shared = tmp_path / "work"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    make(tmp_path)
    assert mode(shared) == 0o700
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory owned by another user")
    foreign = tmp_path / "foreign"
    (foreign / "work").mkdir(parents=True)
    os.chown(foreign / "work", NOBODY, NOBODY)
    with pytest.raises(InternalError, match="belongs to uid 65534"):
        make(foreign)


def test_an_overwritten_harness_is_compiled_again_not_trusted(tmp_path):
    """Overwriting the cached harness object used to turn a correct kernel into a
    compile_error (-40)."""
    bench = make(tmp_path)
    assert evaluate(bench).status == "success"
    [harness] = (tmp_path / "work").glob("harness-*/*.o")
    harness.write_bytes(b"\x7fELF not a harness any more")
    verdict = evaluate(bench)
    assert verdict.status == "success", verdict.error
    assert harness.read_bytes()[:4] == b"\x7fELF" and b"not a harness" not in harness.read_bytes()


def test_candidate_scratch_is_not_world_writable(tmp_path):
    bench = Benchmarker(
        BenchmarkerSection(work_dir=tmp_path / "work", lock_path=tmp_path / "timing.lock"),
        HOST,
        keep_scratch=True,
    )
    assert evaluate(bench).status == "success"
    [scratch] = (tmp_path / "work").glob("cand-*")
    assert mode(scratch) & 0o077 == 0


def test_a_held_timing_lock_costs_a_retry_not_a_silent_stall(tmp_path):
    """Anyone who could open the lock file stalled the benchmarker forever with /healthz 200."""
    bench = make(tmp_path, timing_lock_timeout_s=1.5)
    timeouts = ("hpcrl_benchmarker_timing_lock_timeouts_total", {})
    before = REGISTRY.get_sample_value(*timeouts) or 0.0
    holder = os.open(tmp_path / "timing.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        started = time.monotonic()
        with pytest.raises(InternalError, match=r"still held after 1\.5 s"):
            evaluate(bench)
        assert time.monotonic() - started < 30
        healthy, detail = bench.health()  # the stall is reported until the lock moves
        assert not healthy and detail["timing_lock_wait_s"] >= 1.5
    finally:
        os.close(holder)
    assert REGISTRY.get_sample_value(*timeouts) == before + 1
    assert evaluate(bench).status == "success"  # the lock is free again: back to work
    assert bench.health()[0]


def test_a_lock_file_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to make a file owned by another user")
    lock = tmp_path / "timing.lock"
    lock.touch()
    os.chown(lock, NOBODY, NOBODY)
    with pytest.raises(InternalError, match="belongs to uid 65534"):
        evaluate(make(tmp_path))
