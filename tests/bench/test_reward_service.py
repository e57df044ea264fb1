"""bench/reward_service.py: its arithmetic on known numbers, its arguments, and a small run
end to end (one replica over the real broker, one kernel)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tests.support.scripts import load_script

bench = load_script("bench/reward_service.py", "bench_reward_service")


def test_overhead_is_the_client_latency_beyond_the_in_process_time():
    assert bench.overhead([1.1, 1.2, 5.0], [1.0, 0.9, 1.0]) == pytest.approx(0.2)
    # Over the sum of medians a slow kernel weighs more than a fast one.
    client = {"fast": [0.2, 0.2], "slow": [2.2, 2.2]}
    inproc = {"fast": [0.1, 0.1], "slow": [2.0, 2.0]}
    assert bench.pooled_overhead(client, inproc) == pytest.approx(0.3 / 2.1)
    assert bench.paired([1.0, 2.0, 3.0], [0.5, 2.5, 2.0]) == pytest.approx(0.5)
    values = [float(x) for x in range(1, 21)]
    assert bench.percentile(values, 0.5) == 10.0 and bench.percentile(values, 0.95) == 19.0
    assert bench.percentile([3.0], 0.95) == 3.0


def test_the_arguments_are_checked_before_anything_starts(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    help_text = capsys.readouterr().out
    for word in ("--replicas", "--node", "in-process", "10 %", "format_violation"):
        assert word in help_text
    too_many = str(len(os.sched_getaffinity(0)) + 1)
    for argv, message in (
        (["--replicas", too_many], "CPUs"),
        (["--kernels", "nothing.c"], "no kernel"),
        (["--rounds", "0"], "at least 1"),
    ):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert message in capsys.readouterr().err


@pytest.mark.broker
def test_a_small_run_reports_every_figure(
    rabbitmq: str, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = bench.main(
        [
            "--replicas",
            "1",
            "--rounds",
            "2",
            "--burst",
            "2",
            "--empty",
            "2",
            "--kernels",
            "naive.c",
            "--url",
            rabbitmq,
        ]
    )
    out = capsys.readouterr().out
    assert set(result) == {1} and result[1] > -1
    assert "AVX" in out.splitlines()[0]
    for figure in (
        "naive.c",
        "all kernels",
        "target <= 10%",
        "the replica's steps",
        "without a compile",
        "verdicts/s through the client",
    ):
        assert figure in out, out
    assert "client success 2" in out and "in-process success 2" in out
    assert "burst success 2" in out and "empty format_violation 2" in out
