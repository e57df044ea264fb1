"""bench/build_seeds.py: version 0's share correct per prompt over build seeds, read from
reports shaped as ``hpcrl-evaluate --json`` writes them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.scripts import load_script

bench = load_script("bench/build_seeds.py", "bench_build_seeds")

PROMPTS = ["seed@1", "improve seed@1", "deepen tiled@2->3"]


def report(model: str, shares: list[float]) -> dict[str, Any]:
    per_prompt = [
        {"prompt": i, "name": name, "stage": 1, "metrics": {"share_correct": share}}
        for i, (name, share) in enumerate(zip(PROMPTS, shares, strict=True))
    ]
    overall = sum(shares) / len(shares)
    return {
        "model": model,
        "versions": [
            {"version": 0, "metrics": {"share_correct": overall}, "per_prompt": per_prompt}
        ],
    }


def test_a_prompt_row_has_every_build_its_range_and_how_many_reached_half() -> None:
    builds = [
        bench.read_build(0, report("data/policy/bootstrap-aaa", [1.0, 0.5, 0.69])),
        bench.read_build(1, report("data/policy/bootstrap-bbb", [0.75, 0.25, 0.19])),
    ]
    rows = {row["prompt"]: row for row in bench.prompt_rows(builds)}
    assert rows["deepen tiled@2->3"]["shares"] == [0.69, 0.19]
    assert rows["deepen tiled@2->3"]["mean"] == pytest.approx(0.44)
    assert (rows["deepen tiled@2->3"]["min"], rows["deepen tiled@2->3"]["max"]) == (0.19, 0.69)
    # 0.5 itself is at the target: "at least half the samples".
    assert rows["improve seed@1"]["at_target"] == 1
    assert rows["seed@1"]["at_target"] == 2
    assert builds[0].at_target == 3 and builds[1].at_target == 1
    assert builds[0].hash == "aaa"


def test_overall_spread_of_one_build_is_zero_and_of_two_the_sample_sd() -> None:
    one = [bench.read_build(0, report("m", [1.0, 0.0, 0.5]))]
    assert bench.overall(one) == {"mean": 0.5, "sd": 0.0, "min": 0.5, "max": 0.5}
    two = [*one, bench.read_build(1, report("m", [1.0, 1.0, 1.0]))]
    spread = bench.overall(two)
    assert spread["mean"] == pytest.approx(0.75)
    assert spread["sd"] == pytest.approx(0.25 * 2**0.5)  # |1.0 - 0.5| / sqrt(2)


def test_against_gives_the_difference_of_the_means_and_refuses_another_set(
    tmp_path: Path,
) -> None:
    for seed, shares in ((0, [1.0, 0.5, 0.25]), (1, [1.0, 0.5, 0.75])):
        (tmp_path / f"v0-seed{seed}.json").write_text(json.dumps(report("m", shares)))
    before = bench.load_runs(tmp_path)
    assert [b.seed for b in before] == [0, 1]
    after = [bench.read_build(0, report("m", [1.0, 0.25, 1.0]))]
    rows = {row["prompt"]: row for row in bench.against_rows(after, before)}
    assert rows["deepen tiled@2->3"]["before"] == pytest.approx(0.5)
    assert rows["deepen tiled@2->3"]["diff"] == pytest.approx(0.5)
    assert rows["improve seed@1"]["diff"] == pytest.approx(-0.25)
    other = report("m", [1.0, 1.0, 1.0])
    other["versions"][0]["per_prompt"][2]["name"] = "improve simd@3"
    with pytest.raises(ValueError, match="another prompt set"):
        bench.against_rows([bench.read_build(0, other)], before)


def test_the_report_prints_each_build_and_the_verdict(capsys: pytest.CaptureFixture) -> None:
    builds = [
        bench.read_build(0, report("data/policy/bootstrap-aaa", [1.0, 0.5, 0.69])),
        bench.read_build(2, report("data/policy/bootstrap-ccc", [0.75, 0.25, 0.19])),
    ]
    bench.print_report(builds, None)
    out = capsys.readouterr().out
    assert "build seed 2 (ccc): share correct 0.397, 1/3 prompts >= 0.5" in out
    assert "every prompt >= 0.5 in every build: no" in out


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--samples", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--against", str(tmp_path / "missing")])


def test_builds_are_judged_with_the_demos_own_sampling() -> None:
    options = bench.demo_sampling()
    given = dict(zip(options[::2], options[1::2], strict=True))
    # deploy/local/demo.toml: what the demo samples its groups and judges its versions with.
    assert given["--temperature"] == "0.8"
    assert given["--max-tokens"] == "1536"
    assert given["--max-model-len"] == "3072"
    assert given["--opt-level"] == "O3"
