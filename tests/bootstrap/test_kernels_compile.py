"""The catalogue judged by the benchmarker's own pipeline: its kernels are correct and of
their stage, its broken twins really are broken, and the verdicts are cached per host."""

from __future__ import annotations

import json
import random
import re

import pytest

from hpcrl_bootstrap import catalogue
from hpcrl_bootstrap import corpus as cp
from hpcrl_common.task import load_task

pytestmark = pytest.mark.slow


def test_every_target_is_correct_of_its_stage_and_timed(small_plan, small_measured) -> None:
    verdicts = {catalogue.verdict_key(m.kernel): m for m in small_measured}
    targets = [verdicts[catalogue.verdict_key(k)] for k in small_plan.targets]
    failed = [(m.status, m.error[:200], m.kernel.source) for m in targets if not m.ok]
    # A kernel of stage s may coincide with another's stage-violating twin: judged apart.
    assert not failed, failed[:2]
    assert all(m.gflops and m.gflops > 0 for m in targets)
    assert {m.kernel.stage for m in targets} == set(range(1, 7))


def test_broken_twins_fail_with_the_benchmarkers_error(small_plan, small_measured) -> None:
    verdicts = {catalogue.verdict_key(m.kernel): m for m in small_measured}
    broken = [verdicts[catalogue.verdict_key(k)] for k in small_plan.broken.values()]
    failing = [m for m in broken if not m.ok]
    # A mistake that only shows at sizes the catalogue does not test could pass; almost none.
    assert len(failing) >= len(broken) - 1
    assert all(m.status != "success" or m.generalizes is False for m in failing)
    assert all(m.error for m in failing if m.status != "success")


def test_verdicts_are_cached_per_host_and_sources(small_plan, tmp_path) -> None:
    kernels = small_plan.targets[:3]
    task = load_task("matmul")
    _, path = catalogue.measure(kernels, task, "O3", tmp_path)
    data = json.loads(path.read_text())
    assert len(data["verdicts"]) == 3 and data["host_class"]
    # A cached verdict is used as it is: nothing runs again.
    name = catalogue.verdict_key(kernels[0])
    data["verdicts"][name]["gflops"] = 12345.0
    path.write_text(json.dumps(data))
    again, same = catalogue.measure(kernels, task, "O3", tmp_path)
    assert same == path and again[0].gflops == 12345.0
    other, elsewhere = catalogue.measure(kernels, task, "O1", tmp_path)
    assert elsewhere != path and other[0].gflops != 12345.0


def test_summary_and_export_count_distinct_verdicts(small_measured) -> None:
    summary = catalogue.summary(small_measured)
    distinct = {catalogue.verdict_key(m.kernel) for m in small_measured}
    assert summary["kernels"] == len(distinct) == len(catalogue.export(small_measured))
    assert sum(summary["statuses"].values()) == len(distinct)


def test_six_row_avx2_blocks_leave_no_row_to_scalar_code(tmp_path) -> None:
    """256 = 6 * 42 + 4: the leftover rows (and those of 255, 33 and 1, the verification
    sizes) run as one-row vector blocks, untiled and in tiles, and every result is right."""
    specs = [
        cp.KernelSpec(family="block", block_rows=6, block_vectors=2, simd="avx2", omp="static"),
        cp.KernelSpec(
            family="block", block_rows=6, block_vectors=2, simd="avx2", tile=(48, 32, 128)
        ),
        cp.KernelSpec(
            family="block",
            block_rows=6,
            block_vectors=2,
            simd="avx2",
            tile=(30, 48, 16),
            tile_order="ijk",
            omp="dynamic",
        ),
    ]
    kernels = [cp.render_kernel(spec, spec.min_stage, "avx2") for spec in specs]
    for kernel in kernels:
        leftover = kernel.source.split("i = i_main" if kernel.spec.tile else "i = M_main")[1]
        assert "_mm256_set1_pd" in leftover and "_mm256_storeu_pd" in leftover
        # The shape is named once, at the top of the function body (a policy copies its
        # parent's head, which may lack it); the loops and steps say MR and NV, never 6 or 2
        # (with literals, the policy wrote blocks whose declaration and loops disagreed).
        source = kernel.source
        head, body = source.split("enum { MR = 6, NV = 2 };")
        assert head.rstrip().endswith(") {") and "MR" not in head
        assert "c[MR][NV]" in body and "i += MR" in body and "j += NV * 4" in body
        assert not re.search(r"[<+%] [26]\b|\[[26]\]", body)
    measured, _ = catalogue.measure(kernels, load_task("matmul"), "O3", tmp_path)
    assert [(m.status, m.generalizes) for m in measured] == [("success", True)] * 3, [
        m.error[:200] for m in measured
    ]


def test_plain_tiled_parents_of_simd_kernels_are_correct_stage_2_code(tmp_path) -> None:
    """A tiled SIMD kernel's stage-2 parent may be a plain tiled loop nest (format 15): that
    parent is judged correct and of stage 2 by the benchmarker, for both ISAs."""
    parents = []
    for isa in ("avx2", "avx512"):
        rng = random.Random(f"plain-parents/{isa}")
        for _ in range(200):
            spec = cp.sample_spec(rng, 3, isa)
            parent = cp.downgrade(rng, spec, 2) if spec.tile else None
            if parent is not None and parent.family == "loops":
                parents.append(cp.render_kernel(parent, 2, isa))
                break
    assert len(parents) == 2
    measured, _ = catalogue.measure(parents, load_task("matmul"), "O3", tmp_path)
    assert [(m.status, m.generalizes) for m in measured] == [("success", True)] * 2, [
        m.error[:200] for m in measured
    ]
