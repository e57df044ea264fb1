"""The corpus generator: seeded, labelled by stage and technique, with its mistakes."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from hpcrl_benchmarker.checks import detect_techniques as benchmarker_techniques
from hpcrl_bootstrap import corpus as cp
from hpcrl_common.stages import CACHE_BLOCKING, OPENMP, POLICED, PREFETCH, SIMD, stage
from hpcrl_common.task import load_task

SIGNATURE = load_task("matmul").signature


def detect_techniques(source: str) -> set[str]:
    """The policed techniques the benchmarker sees in the code."""
    return benchmarker_techniques(source) & set(POLICED)


NEW_TECHNIQUE = {2: CACHE_BLOCKING, 3: SIMD, 4: OPENMP, 5: PREFETCH, 6: PREFETCH}


@pytest.fixture(scope="module")
def corpus() -> list[cp.Kernel]:
    return cp.generate_corpus(seed=0, size=600, mistake_rate=0.3)


def test_same_seed_same_corpus_other_seed_other_corpus() -> None:
    first = [k.source for k in cp.generate_corpus(seed=3, size=50)]
    assert first == [k.source for k in cp.generate_corpus(seed=3, size=50)]
    assert first != [k.source for k in cp.generate_corpus(seed=4, size=50)]


def test_every_kernel_defines_the_task_signature_once(corpus: list[cp.Kernel]) -> None:
    assert cp.SIGNATURE == SIGNATURE
    for kernel in corpus:
        if kernel.mistake != cp.COMPILE_ERROR:
            assert kernel.source.count(SIGNATURE + " {") == 1


def test_stages_and_isas_are_all_covered(corpus: list[cp.Kernel]) -> None:
    assert {k.stage for k in corpus} == set(range(1, 7))
    assert {k.isa for k in corpus} == {"avx2", "avx512"}
    sources = "".join(k.source for k in corpus)
    for needle in (
        "__m256d",
        "_mm256_fmadd_pd",
        "__m512d",
        "_mm512_fmadd_pd",
        "_mm_prefetch",
        "__builtin_prefetch",
        "#pragma omp parallel for",
        "collapse(2)",
    ):
        assert needle in sources, needle


def test_every_vector_update_is_one_fma(corpus: list[cp.Kernel]) -> None:
    """One form of the multiply-add is taught: with ``add(acc, mul(a, b))`` beside
    ``fmadd(a, b, acc)`` the policy crossed them into ``fmadd(acc, mul(a, b))``, two
    arguments, a quarter of its AVX2 compile errors (format 13)."""
    vector = [k for k in corpus if k.spec.simd]
    assert len({k.isa for k in vector}) == 2
    for kernel in vector:
        assert "fmadd_pd(" in kernel.source, kernel.source
        assert "_mul_pd(" not in kernel.source and "_add_pd(" not in kernel.source, kernel.source


def test_tiled_simd_kernels_deepen_from_plain_loop_nests_and_from_blocks() -> None:
    """The parents a run and the evaluation set give a stage-3 deepen are mostly plain tiled
    loop nests: the pairs teach those beside scalar register blocks (format 15)."""
    rng = random.Random("deepen-into-3")
    specs = [cp.sample_spec(rng, 3, isa) for isa in cp.ISAS for _ in range(200)]
    parents = [(spec, cp.downgrade(rng, spec, 2)) for spec in specs if spec.tile and spec.simd]
    families = Counter(parent.family for _, parent in parents)
    assert families["loops"] >= len(parents) // 4 and families["block"] >= len(parents) // 4
    for spec, parent in parents:
        assert parent.simd is None and parent.tile == spec.tile and parent.min_stage == 2
        source = cp.render_kernel(parent, 2, spec.simd).source
        assert "__m" not in source and "BM" in source, source


def test_correct_kernels_use_their_stage_and_nothing_it_forbids(corpus: list[cp.Kernel]) -> None:
    for kernel in (k for k in corpus if k.correct):
        detected = detect_techniques(kernel.source)
        assert stage(kernel.stage).violations(detected) == [], kernel.source
        # The label's techniques show in the code (the benchmarker may see more, e.g. SIMD in a
        # prefetch-only kernel that includes immintrin.h, never more than the stage allows).
        assert {t for t in kernel.techniques if t in POLICED} <= detected, kernel.source
        if kernel.stage in NEW_TECHNIQUE:
            assert NEW_TECHNIQUE[kernel.stage] in kernel.techniques
        if kernel.spec.simd:
            assert kernel.spec.simd == kernel.isa
            vector = "__m512d" if kernel.isa == "avx512" else "__m256d"
            assert vector in kernel.source


def test_mistakes_are_present_at_about_the_asked_rate(corpus: list[cp.Kernel]) -> None:
    kinds = Counter(k.mistake for k in corpus if k.mistake)
    assert set(kinds) == set(cp.MISTAKES)
    assert 0.22 < sum(kinds.values()) / len(corpus) < 0.38
    assert not any(k.mistake for k in cp.generate_corpus(seed=0, size=60, mistake_rate=0.0))


def test_stage_violations_really_violate_their_stage(corpus: list[cp.Kernel]) -> None:
    violating = [k for k in corpus if k.mistake == cp.STAGE_VIOLATION]
    assert violating
    for kernel in violating:
        assert stage(kernel.stage).violations(detect_techniques(kernel.source))


def test_mistakes_change_the_source_in_the_expected_way() -> None:
    rng = random.Random(0)
    spec = cp.sample_spec(rng, 2, "avx512")
    while spec.family != "block":
        spec = cp.sample_spec(rng, 2, "avx512")
    good = cp.render(spec)
    assert "k <= " not in good and "k <= " in cp.render(
        cp.with_mistake(rng, spec, 2, "avx512", cp.OFF_BY_ONE)
    )
    assert "= 0.0;" in good and "C[i] = 0.0" not in cp.render(
        cp.with_mistake(rng, spec, 2, "avx512", cp.NO_ZERO)
    )
    assert "_main" in good and "_main" not in cp.render(
        cp.with_mistake(rng, spec, 2, "avx512", cp.NO_BOUNDARY)
    )
    assert cp.render(cp.with_mistake(rng, spec, 2, "avx512", cp.WRONG_STRIDE)) != good
