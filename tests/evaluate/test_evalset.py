"""The fixed evaluation set: what it holds, and parents that really pass the benchmarker."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl_benchmarker.host import HostProfile, detect
from hpcrl_common.prompts import build_prompt
from hpcrl_common.task import builtin_seed, load_task
from hpcrl_evaluate.evalset import (
    PARENT_FILES,
    PARENT_STAGES,
    SEED_SPECS,
    SPECS,
    build_set,
    parent_source,
    specs_for,
)
from hpcrl_evaluate.run import prompt_seed

BIN = Path(sys.executable).parent
HOST_ISA = detect().prompt_isa


def test_the_set_covers_every_stage_with_improve_and_deepen() -> None:
    shape = [(s.mode, s.target_stage, s.parent) for s in SPECS]
    assert shape[:6] == [
        ("seed", 1, None),
        ("improve", 1, "seed"),
        ("improve", 1, "ikj"),
        ("deepen", 2, "ikj"),
        ("improve", 2, "tiled"),
        ("deepen", 3, "tiled"),
    ]
    # Every stage is asked for with a parent the policy did not write; stages 1-5 in both
    # modes, stage 6 (the same techniques as 5) by deepening.
    for stage in range(1, 7):
        modes = {s.mode for s in SPECS if s.target_stage == stage and s.parent != "seed"}
        assert "deepen" in modes or stage == 1, stage
        assert "improve" in modes or stage == 6, stage
    for spec in SPECS:
        if spec.mode == "deepen":
            assert spec.target_stage == PARENT_STAGES[spec.parent] + 1
        elif spec.parent is not None:
            assert spec.target_stage == PARENT_STAGES[spec.parent]
    assert len({s.name for s in SPECS}) == len(SPECS)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_prompts_are_the_schedulers(isa: str) -> None:
    task = load_task("matmul")
    prompts = build_set(task, isa)
    assert [p.index for p in prompts] == list(range(len(SPECS)))
    for prompt in prompts:
        parent = parent_source(prompt.spec.parent or "seed")
        expected = build_prompt(
            task,
            target_stage=prompt.stage,
            mode=prompt.spec.mode,
            parent_source=parent,
            error=None,
            isa=isa,
        )
        assert list(prompt.messages) == expected
        if prompt.spec.parent is not None:
            assert parent.strip() in prompt.messages[-1].content
    assert parent_source("seed") == builtin_seed("matmul")
    assert ("AVX-512" if isa == "avx512" else "AVX2") in prompts[0].messages[0].content


def test_the_prompts_isa_is_the_hosts() -> None:
    def host(flags: str) -> HostProfile:
        return HostProfile("h", "cpu", frozenset(flags.split()), 2, 4000.0, "gcc")

    assert host("fpu sse2 avx2 avx512f avx512bw").prompt_isa == "avx512"
    assert host("fpu sse2 avx2 avx512_bf16").prompt_isa == "avx2"
    with pytest.raises(ValueError):
        parent_source("nope")


def test_prompt_seeds_depend_on_seed_and_prompt_only() -> None:
    seeds = {prompt_seed(s, p) for s in range(3) for p in range(len(SPECS))}
    assert len(seeds) == 3 * len(SPECS)
    assert prompt_seed(0, 1) == prompt_seed(0, 1)
    assert all(0 <= s < 2**31 for s in seeds)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
@pytest.mark.parametrize("name", sorted(PARENT_FILES))
def test_fixed_parents_pass_the_benchmarker(name: str, tmp_path: Path) -> None:
    """Correct at every size the task verifies, within their stage, as `check` judges them."""
    path = tmp_path / f"{name}.c"
    path.write_text(parent_source(name))
    allow = [] if HOST_ISA == "avx512" else ["--allow-isa", "avx2"]
    out = subprocess.run(
        [
            str(BIN / "hpcrl-benchmarker"),
            "check",
            str(path),
            "--stage",
            str(PARENT_STAGES[name]),
            "--json",
            *allow,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    verdict = json.loads(out.stdout)
    assert verdict["status"] == "success", verdict["error"]
    assert verdict["generalizes"] is True
    assert verdict["gflops"] > 0
    expected = {
        "ikj": [],
        "tiled": ["cache_blocking"],
        "simd": ["register_blocking", "simd"],
        "omp": ["openmp", "register_blocking", "simd"],
        "prefetch": ["openmp", "prefetch", "register_blocking", "simd"],
    }[name]
    assert verdict["techniques"] == expected


@pytest.mark.parametrize("name", ["gemv", "stencil", "spmv"])
def test_every_task_has_a_fixed_set_from_its_seed(name: str) -> None:
    task = load_task(name)
    prompts = build_set(task, "avx2")
    assert [p.spec for p in prompts] == list(specs_for(name)) == list(SEED_SPECS)
    seed = builtin_seed(name)
    assert seed is not None and parent_source("seed", task) == seed
    for prompt in prompts:
        text = prompt.messages[-1].content
        assert task.signature in text or task.function in text
        if prompt.spec.parent is not None:
            assert seed.strip() in text
    # stage 1 prompts first: the target (>= 50 % correct) is read on them
    assert [p.stage for p in prompts] == [1, 1, 2]
