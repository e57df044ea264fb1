"""hpcrl-evaluate end to end on a tiny random model: the transformers backend, the real
benchmarker, a real checkpoint store. A random model writes garbage, which is fine: what is
checked is the report, the pairing of samples and the handling of versions."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_evaluate import cli
from hpcrl_evaluate.cli import main
from hpcrl_evaluate.evalset import parent_source
from hpcrl_evaluate.run import METRICS, SampleRecord, compare, make_judge, summarise

BIN = Path(sys.executable).parent
STATUSES = {
    "success",
    "format_violation",
    "library_violation",
    "stage_violation",
    "compile_error",
    "timeout",
    "runtime_error",
    "verification_error",
}
PENALTIES = {
    "format_violation": -100.0,
    "library_violation": -100.0,
    "stage_violation": -100.0,
    "compile_error": -40.0,
    "timeout": -30.0,
    "runtime_error": -20.0,
    "verification_error": -10.0,
}

COMMON = (
    "--backend",
    "transformers",
    "--samples",
    "2",
    "--prompts",
    "0,3",
    "--max-tokens",
    "24",
    "--seed",
    "5",
    "--resamples",
    "200",
)


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A base model and a store with v1 = the same weights, v2 = perturbed weights."""
    from tests.support.models import chat_model, perturbed_copy

    root = tmp_path_factory.mktemp("evaluate")
    model = chat_model(root / "model")
    store = CheckpointStore(root / "checkpoints")
    for version in (1, 2):
        staging = store.staging_dir(version)
        shutil.rmtree(staging)
        if version == 1:
            shutil.copytree(model, staging)
        else:
            perturbed_copy(model, staging, scale=0.3)
        store.commit(staging, version, version - 1, "full", metrics={"sampler_kl": 0.0})
    return model, store.root


def run_cli(
    model: Path, checkpoints: Path, out: Path, versions: str, *extra: str
) -> tuple[dict, str]:
    done = subprocess.run(
        [
            str(BIN / "hpcrl-evaluate"),
            "--model",
            str(model),
            "--checkpoints",
            str(checkpoints),
            "--versions",
            versions,
            *COMMON,
            "--json",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def completions(version: dict) -> list[str]:
    return [sample["completion"] for sample in version["samples"]]


@pytest.mark.slow
def test_identical_versions_show_no_gain_and_seeds_repeat(policy, tmp_path: Path) -> None:
    model, checkpoints = policy
    report, stdout = run_cli(
        model, checkpoints, tmp_path / "a.json", "0,latest", "--plot", str(tmp_path / "a.png")
    )
    assert [v["version"] for v in report["versions"]] == [0, 2]
    assert [p["name"] for p in report["prompts"]] == ["seed@1", "deepen ikj@1->2"]
    for version in report["versions"]:
        samples = version["samples"]
        assert [(s["prompt"], s["index"]) for s in samples] == [(0, 0), (0, 1), (3, 0), (3, 1)]
        for sample in samples:  # judged by the benchmarker: a real status and its reward
            assert sample["status"] in STATUSES
            if sample["status"] != "success":
                assert sample["reward"] == PENALTIES[sample["status"]] and sample["error"]
        assert set(version["metrics"]) == set(METRICS)
        assert len(version["per_prompt"]) == 2
    assert completions(report["versions"][0]) != completions(report["versions"][1])
    assert set(report["comparison"]["metrics"]) == set(METRICS)
    assert "gain" in stdout and "share correct" in stdout and "failures" in stdout
    assert (tmp_path / "a.png").stat().st_size > 0

    # Version 1 holds the base weights: same seeds, same samples, so nothing gains. In this
    # process (torch is already imported here): the seeds must repeat across processes too.
    # A version between the first and the last is compared with the first too.
    assert (
        main(
            [
                "--model",
                str(model),
                "--checkpoints",
                str(checkpoints),
                "--versions",
                "0,1,latest",
                *COMMON,
                "--json",
                str(tmp_path / "b.json"),
            ]
        )
        == 0
    )
    same = json.loads((tmp_path / "b.json").read_text())
    assert completions(same["versions"][0]) == completions(report["versions"][0])
    assert completions(same["versions"][1]) == completions(same["versions"][0])
    middle, last = same["comparisons"]
    assert (middle["after"], last["after"]) == (1, 2) and last == same["comparison"]
    assert last["metrics"] == report["comparison"]["metrics"]
    for name, gain in middle["metrics"].items():
        assert gain["gain"] == 0.0, name
        assert gain["low"] <= 0.0 <= gain["high"], name
    for entry in middle["per_prompt"]:
        assert all(g["gain"] == 0.0 for g in entry["metrics"].values())


def test_bad_arguments_exit_2(policy, tmp_path: Path, capsys) -> None:
    model, checkpoints = policy
    cases = [
        (["--model", str(tmp_path / "missing")], "not a model directory"),
        (
            ["--model", str(model), "--checkpoints", str(checkpoints), "--versions", "0,7"],
            "unknown version 7",
        ),
        (["--model", str(model), "--versions", "0,latest"], "needs --checkpoints"),
        (["--model", str(model), "--versions", "0,newest"], "unknown version 'newest'"),
        (["--model", str(model), "--prompts", "12"], "--prompts"),
        (["--model", str(model), "--opt-level", "O9"], "no opt level"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2, argv
        assert message in capsys.readouterr().err, argv


def test_isa_chooses_the_prompts_fleet(
    policy, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    model, _ = policy
    parser = cli.build_parser()
    for isa, vector in (("avx2", "__m256d"), ("avx512", "__m512d")):
        if isa == "avx512" and cli.host_isa() != "avx512":
            continue  # an AVX2 host cannot run AVX-512 kernels: refused below
        evaluation = cli.setup(parser.parse_args(["--model", str(model), "--isa", isa]), parser)
        assert evaluation.isa == isa
        assert vector in "".join(m.content for p in evaluation.prompts for m in p.messages)
    auto = cli.setup(parser.parse_args(["--model", str(model)]), parser)
    assert auto.isa == cli.host_isa()
    # Which ISA this host has cannot be chosen here: the host is said to be AVX2-only.
    monkeypatch.setattr(cli, "host_isa", lambda: "avx2")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(model), "--isa", "avx512"])
    assert exit_info.value.code == 2
    assert "no AVX-512F" in capsys.readouterr().err


def _record(
    prompt: int, index: int, status: str, gflops: float | None, techniques: tuple[str, ...] = ()
) -> SampleRecord:
    reward = gflops if status == "success" else PENALTIES[status]
    return SampleRecord(
        prompt=prompt,
        index=index,
        status=status,
        reward=reward,
        gflops=gflops,
        techniques=list(techniques),
        finish_reason="stop",
        tokens=10,
        completion="",
    )


def test_metrics_by_hand() -> None:
    before = [
        _record(0, 0, "success", 2.0),
        _record(0, 1, "compile_error", None),
        _record(1, 0, "format_violation", None),
        _record(1, 1, "success", 4.0, ("simd",)),
    ]
    after = [
        _record(0, 0, "success", 6.0),
        _record(0, 1, "success", 2.0),
        _record(1, 0, "verification_error", None),
        _record(1, 1, "success", 4.0),
    ]
    m = summarise(before)
    assert m["share_correct"] == 0.5
    assert m["mean_reward"] == (2.0 - 40.0 - 100.0 + 4.0) / 4
    assert m["mean_gflops"] == 6.0 / 4  # failures count as 0
    assert m["best_gflops"] == 4.0
    assert m["technique_simd"] == 0.25 and m["technique_openmp"] == 0.0
    gains = compare(before, after, seed=0, resamples=200)
    assert gains["share_correct"]["gain"] == pytest.approx(0.25)
    assert gains["mean_gflops"]["gain"] == pytest.approx((12.0 - 6.0) / 4)
    assert gains["best_gflops"]["gain"] == 2.0
    assert gains["mean_reward"]["before"] == m["mean_reward"]
    with pytest.raises(ValueError):
        compare(before, after[::-1], seed=0)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_judge_measures_a_good_completion_once() -> None:
    judge = make_judge("matmul", "O3")
    completion = f"Here it is.\n```c\n{parent_source('ikj')}```\n"
    verdict = judge(completion, 1)
    assert verdict.status == "success" and verdict.gflops > 0
    assert verdict.reward == verdict.gflops
    assert judge(completion, 1) is verdict  # measured once: identical code, identical figure
    assert judge(completion, 2) is not verdict
