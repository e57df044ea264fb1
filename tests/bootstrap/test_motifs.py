"""The kernels of GEMV, the stencil and SpMV (motifs.py and corpus_<task>.py), several tasks in
one build (--tasks), and the GEMM-only build left exactly as it was. Pure: no benchmarker."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest

from hpcrl_benchmarker.checks import detect_techniques
from hpcrl_bootstrap import catalogue
from hpcrl_bootstrap.build import BootstrapSettings
from hpcrl_bootstrap.cli import build_parser, parse_tasks
from hpcrl_bootstrap.examples import make_examples, pairs_from, split_examples
from hpcrl_common.stages import POLICED, stage
from hpcrl_common.task import builtin_seed, load_task

NEW_TASKS = ("gemv", "stencil", "spmv")
NEW_TECHNIQUE = {2: "cache_blocking", 3: "simd", 4: "openmp", 5: "prefetch", 6: "prefetch"}
ISAS = ("avx512", "avx2")


@pytest.fixture(scope="module", params=[(t, i) for t in NEW_TASKS for i in ISAS], ids=str)
def plan(request: pytest.FixtureRequest) -> catalogue.Plan:
    task, isa = request.param
    return catalogue.plan(0, isa, task=task)


# --- GEMM alone: the hash, the catalogue and the examples of today ---------------------------

# Pinned so that no change to the other tasks moves GEMM's: a GEMM policy cached under
# data/policy/bootstrap-<hash>/ stays valid, and its rebuild would be the same model. The
# catalogue is that of build format 16 (vector blocks of several rows as loops over
# c[MR][NV] with the shape named at the top of the function body, leftover rows as vector
# code, a 6x8 AVX2 block, every vector update one FMA, half the tiled parents of stage-3
# deepen pairs plain loop nests, every deepen parent code of the stage it is labelled with;
# answers close their fence with a newline).
DEFAULT_KEYS = {"avx512": "1cf38cc47691", "avx2": "fff409bff184"}
MATMUL_PLAN = {"avx512": "4e3af10d99e7d849", "avx2": "4604d0dc423a1be7"}
MATMUL_EXAMPLES = {"avx512": "5e9ad31468812370", "avx2": "41989c4a3409544d"}


@pytest.mark.parametrize("isa", ISAS)
def test_the_default_settings_hash_is_unchanged(isa: str) -> None:
    assert BootstrapSettings(isa=isa).key() == DEFAULT_KEYS[isa]
    assert BootstrapSettings(isa=isa, tasks=("matmul",)).key() == DEFAULT_KEYS[isa]
    assert "tasks" not in BootstrapSettings(isa=isa).as_dict()


def test_several_tasks_are_hashed_in_one_order() -> None:
    both = BootstrapSettings(isa="avx512", tasks=("gemv", "matmul"))
    assert both.key() == BootstrapSettings(isa="avx512", tasks=("matmul", "gemv")).key()
    assert both.key() != DEFAULT_KEYS["avx512"]
    assert both.resolved().task_names() == ("matmul", "gemv")
    # One other task is that task alone, as a config's `task = "gemv"` always gave.
    alone = BootstrapSettings(isa="avx512", tasks=("gemv",))
    assert alone.key() == BootstrapSettings(isa="avx512", task="gemv").key()


def _digest(isa: str) -> tuple[str, str]:
    """The GEMM plan's sources, and 300 examples drawn from made-up verdicts."""
    plan = catalogue.plan(0, isa)
    verdicts = {}
    for k in plan.all():
        ok = k.mistake is None
        verdicts[catalogue.verdict_key(k)] = catalogue.Measured(
            k,
            "success" if ok else "compile_error",
            (len(k.source) % 97 + 1.0) if ok else None,
            "" if ok else "error: x",
            True if ok else None,
        )
    examples = make_examples(
        0,
        300,
        load_task("matmul"),
        pairs_from(plan, verdicts),
        isa,
        seed_source=builtin_seed("matmul"),
    )
    shown = hashlib.sha256()
    for e in examples:
        shown.update(json.dumps([m.model_dump() for m in e.prompt]).encode())
        shown.update(e.completion.encode())
    sources = hashlib.sha256("\n".join(k.source for k in plan.all()).encode())
    return sources.hexdigest()[:16], shown.hexdigest()[:16]


@pytest.mark.parametrize("isa", ISAS)
def test_the_gemm_catalogue_and_examples_are_unchanged(isa: str) -> None:
    assert _digest(isa) == (MATMUL_PLAN[isa], MATMUL_EXAMPLES[isa])


# --- the other tasks' kernels ----------------------------------------------------------------


def test_every_kernel_defines_its_task_signature_once(plan: catalogue.Plan) -> None:
    task = load_task(plan.targets[0].spec.task)
    for kernel in plan.all():
        if kernel.mistake != "compile_error":
            assert kernel.source.count(task.signature + " {") == 1, kernel.source


def test_every_stage_has_several_distinct_kernels(plan: catalogue.Plan) -> None:
    per_stage = Counter(k.stage for k in plan.targets)
    assert set(per_stage) == set(range(1, 7))
    assert min(per_stage.values()) >= 6 and per_stage[1] >= 12
    assert len({k.source for k in plan.targets}) == len(plan.targets)
    assert 1 not in {plan.targets[n].stage for n in plan.parents}
    assert set(plan.broken) == set(range(len(plan.targets)))


def test_kernels_use_their_stage_and_nothing_it_forbids(plan: catalogue.Plan) -> None:
    for kernel in plan.targets + list(plan.parents.values()):
        detected = detect_techniques(kernel.source) & set(POLICED)
        assert stage(kernel.stage).violations(detected) == [], kernel.source
        assert {t for t in kernel.techniques if t in POLICED} <= detected, kernel.source
        assert kernel.spec.min_stage <= kernel.stage
    for kernel in plan.targets:
        if kernel.stage in NEW_TECHNIQUE:
            assert NEW_TECHNIQUE[kernel.stage] in kernel.techniques, kernel.source
        if kernel.spec.simd:
            assert kernel.spec.simd == kernel.isa
            assert ("__m512d" if kernel.isa == "avx512" else "__m256d") in kernel.source


def test_a_deepen_parent_lacks_only_its_targets_technique(plan: catalogue.Plan) -> None:
    for index, parent in plan.parents.items():
        target = plan.targets[index]
        assert parent.stage == target.stage - 1 and parent.mistake is None
        assert parent.spec.form == target.spec.form
        assert set(parent.techniques) < set(target.techniques) or target.stage == 6


@pytest.mark.parametrize("task", ("matmul", *NEW_TASKS))
@pytest.mark.parametrize("isa", ISAS)
def test_every_deepen_parent_is_code_of_its_label_and_every_stage_has_its_pairs(
    task: str, isa: str
) -> None:
    """A parent labelled s-1 that is really code of a lower stage taught the policy to add two
    stages' techniques at once (format 15's OpenMP at stage 3, prefetch at stage 4)."""
    plan = catalogue.plan(0, isa, task=task)
    for index, parent in plan.parents.items():
        assert parent.spec.min_stage == parent.stage == plan.targets[index].stage - 1
        if parent.stage >= 3:  # its stage's technique is one the benchmarker sees
            detected = detect_techniques(parent.source) & set(POLICED)
            assert stage(parent.stage - 1).violations(detected), parent.source
    pairs = Counter(plan.targets[index].stage for index in plan.parents)
    assert pairs == {n: catalogue.PER_STAGE[n] for n in range(2, 7)}


def test_broken_twins_carry_one_mistake_each(plan: catalogue.Plan) -> None:
    kinds = Counter(k.mistake for k in plan.broken.values())
    assert None not in kinds and len(kinds) >= 5
    for index, broken in plan.broken.items():
        if broken.mistake == "stage_violation":
            detected = detect_techniques(broken.source) & set(POLICED)
            assert stage(broken.stage).violations(detected), broken.source
        else:
            assert broken.source != plan.targets[index].source


def test_both_isas_and_every_technique_are_written() -> None:
    sources = "".join(
        k.source
        for task in NEW_TASKS
        for isa in ISAS
        for k in catalogue.plan(0, isa, task=task).targets
    )
    for needle in (
        "_mm512_fmadd_pd",
        "_mm512_reduce_add_pd",
        "_mm512_i32gather_pd",
        "_mm256_i32gather_pd",
        "hsum256",
        "_mm_prefetch",
        "__builtin_prefetch",
        "schedule(dynamic",
        "schedule(guided)",
        "collapse(2)",
        "#define TI",
        "#define BR",
    ):
        assert needle in sources, needle


def test_the_same_seed_gives_the_same_plan_and_tasks_draw_apart() -> None:
    first = [k.source for k in catalogue.plan(3, "avx512", task="gemv").all()]
    assert first == [k.source for k in catalogue.plan(3, "avx512", task="gemv").all()]
    assert first != [k.source for k in catalogue.plan(4, "avx512", task="gemv").all()]


def test_a_task_without_kernels_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="no kernels of task 'axpy'"):
        catalogue.plan(0, "avx512", task="axpy")


# --- several tasks: examples shared, --tasks parsed -------------------------------------------


def test_examples_are_shared_evenly_between_tasks() -> None:
    assert split_examples(3000, ("matmul",)) == {"matmul": 3000}
    assert split_examples(3002, ("matmul", "gemv", "stencil", "spmv")) == {
        "matmul": 751,
        "gemv": 751,
        "stencil": 750,
        "spmv": 750,
    }


def test_tasks_are_parsed_into_one_order() -> None:
    assert parse_tasks("spmv, matmul,gemv") == ("matmul", "gemv", "spmv")
    args = build_parser().parse_args(["--tasks", "matmul,gemv,stencil,spmv"])
    assert args.tasks == ("matmul", "gemv", "stencil", "spmv")
    assert build_parser().parse_args([]).tasks is None  # the config's tasks (matmul)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "task names separated by commas"),
        ("matmul,,gemv", "task names separated by commas"),
        ("gemv,gemv", "'gemv' is named twice"),
        ("matmul,axpy", "no kernels of task 'axpy': choose from matmul, gemv, stencil, spmv"),
    ],
)
def test_tasks_errors_say_what_is_wrong(
    text: str, message: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["--tasks", text])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
