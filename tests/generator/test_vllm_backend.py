"""The vLLM backend for real (vLLM's CPU build, tiny local model): one engine per module."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: run deploy/local/install-vllm.sh")

from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_common.messages import SamplingParams, WeightUpdate
from hpcrl_common.topology import Topology
from hpcrl_generator.backends.hf import TransformersSampler
from hpcrl_generator.config import GeneratorSection
from hpcrl_generator.prompt import render_prompt
from hpcrl_generator.service import Generator

from .conftest import commit_version
from .helpers import PROMPT
from .loop import run_weight_loop
from .test_transformers_backend import teacher_forced_logprobs

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def engine(tiny_models):
    from hpcrl_generator.backends.vllm import VLLMSampler

    sampler = VLLMSampler(tiny_models["v0"], dtype="float32", max_model_len=256,
                          max_num_seqs=8, kv_cache_space_gib=1)
    yield sampler
    sampler.close()


@pytest.fixture(scope="module")
def reference(tiny_models):
    return {name: TransformersSampler(tiny_models[name]) for name in ("v0", "v1")}


def test_greedy_output_and_logprobs_match_transformers(engine, reference):
    ids = render_prompt(engine.tokenizer, PROMPT)
    assert ids == render_prompt(reference["v0"].tokenizer, PROMPT)
    got = engine.generate(ids, 3, GREEDY)
    want = reference["v0"].generate(ids, 1, GREEDY)[0]
    assert len(got) == 3 and all(s.token_ids == want.token_ids for s in got)
    assert got[0].logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert got[0].finish_reason == want.finish_reason


def test_sampled_logprobs_are_the_raw_distributions(engine, reference):
    ids = render_prompt(engine.tokenizer, PROMPT)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=5)
    samples = engine.generate(ids, 4, params)
    assert [s.token_ids for s in samples] == [s.token_ids for s in engine.generate(ids, 4, params)]
    assert len({tuple(s.token_ids) for s in samples}) > 1
    model = reference["v0"].model
    for sample in samples:
        assert sample.logprobs == pytest.approx(
            teacher_forced_logprobs(model, ids, sample.token_ids), abs=1e-3
        )


def test_hot_reload_equals_a_fresh_load_and_keeps_tied_embeddings_tied(
    engine, reference, tiny_models
):
    ids = render_prompt(engine.tokenizer, PROMPT)
    v0 = engine.generate(ids, 1, GREEDY)[0]
    engine.load_weights(tiny_models["v1"], 1)
    embed_sum, head_sum = engine.weight_fingerprint()[0]
    assert embed_sum == head_sum
    v1 = engine.generate(ids, 1, GREEDY)[0]
    fresh_v1 = reference["v1"].generate(ids, 1, GREEDY)[0]
    assert v1.token_ids == fresh_v1.token_ids and v1.token_ids != v0.token_ids
    assert v1.logprobs == pytest.approx(fresh_v1.logprobs, abs=1e-4)
    engine.load_weights(tiny_models["v0"], 0)  # back to the base: the same as at start
    again = engine.generate(ids, 1, GREEDY)[0]
    assert again.token_ids == v0.token_ids
    assert again.logprobs == pytest.approx(v0.logprobs, abs=1e-5)


def test_a_checkpoint_of_another_shape_is_refused_and_the_engine_lives(
    engine, tiny_models, tmp_path
):
    store = CheckpointStore(tmp_path)
    info = commit_version(store, tiny_models["wide"], 1)
    section = GeneratorSection(model_path=tiny_models["v0"], checkpoint_dir=tmp_path,
                               poll_manifest=False)
    generator = Generator(engine, section, Topology("t"), replica="r")
    update: WeightUpdate = info.weight_update(store.root)
    generator.on_weight_update(update, None)
    assert generator.tracker.loaded == 0 and engine.version == 0
    ids = render_prompt(engine.tokenizer, PROMPT)
    assert len(engine.generate(ids, 1, GREEDY)[0].token_ids) > 0


@pytest.mark.broker
def test_weight_loop_over_rabbitmq(engine, reference, tiny_models, broker_settings,
                                   raw_channel, tmp_path):
    ids = render_prompt(engine.tokenizer, PROMPT)
    want = reference["v1"].generate(ids, 1, GREEDY)[0].token_ids
    run_weight_loop(engine, tiny_models, broker_settings, raw_channel, tmp_path / "store", want)
