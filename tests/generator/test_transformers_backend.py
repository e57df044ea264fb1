"""The transformers backend on a real tiny model: log-probs, sampling, reloads."""

from __future__ import annotations

import pytest
import torch

from hpcrl_common.messages import SamplingParams
from hpcrl_generator.backends.transformers import TransformersSampler
from hpcrl_generator.prompt import render_prompt

from .helpers import LONG_PROMPT, PROMPT, assert_same_samples

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=5)


@pytest.fixture(scope="module")
def sampler(tiny_models):
    return TransformersSampler(tiny_models["v0"])


def prompt_ids(sampler) -> list[int]:
    return render_prompt(sampler.tokenizer, PROMPT)


def teacher_forced_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()


def test_sampling_logprobs_match_a_forward_pass_of_the_same_tokens(sampler):
    ids = prompt_ids(sampler)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=10, seed=7)
    samples = sampler.generate(ids, 3, params)
    assert len(samples) == 3
    for sample in samples:
        assert 1 <= len(sample.token_ids) <= 10
        # Raw distribution (temperature 1, no top-p), as the learner's ratio needs.
        expected = teacher_forced_logprobs(sampler.model, ids, sample.token_ids)
        assert sample.logprobs == pytest.approx(expected, abs=1e-4)
        assert sample.finish_reason in ("stop", "length")
        if sample.finish_reason == "stop":
            assert sample.token_ids[-1] in sampler.stop_ids


def test_a_seed_makes_sampling_repeatable_and_greedy_fills_the_group(sampler):
    ids = prompt_ids(sampler)
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=11)
    first = [s.token_ids for s in sampler.generate(ids, 4, params)]
    again = [s.token_ids for s in sampler.generate(ids, 4, params)]
    assert first == again
    assert len({tuple(t) for t in first}) > 1  # four samples, not one repeated
    greedy = sampler.generate(ids, 3, GREEDY)
    assert len(greedy) == 3 and greedy[0].token_ids == greedy[1].token_ids == greedy[2].token_ids


def test_a_reload_equals_a_fresh_load_of_the_same_weights(tiny_models):
    live = TransformersSampler(tiny_models["v0"])
    ids = prompt_ids(live)
    before = live.generate(ids, 1, GREEDY)[0]
    live.load_weights(tiny_models["v1"], 1)
    after = live.generate(ids, 1, GREEDY)[0]
    fresh = TransformersSampler(tiny_models["v1"]).generate(ids, 1, GREEDY)[0]
    assert live.version == 1
    assert after.token_ids == fresh.token_ids
    assert after.logprobs == pytest.approx(fresh.logprobs, abs=1e-5)
    assert after.token_ids != before.token_ids


def test_a_reload_then_a_long_prompt_equals_a_fresh_load(tiny_models):
    # The vLLM suite's prefix-cache case, on this backend: a prompt seen under v0 again
    # after the reload must be computed from v1 alone.
    live = TransformersSampler(tiny_models["v0"])
    ids = render_prompt(live.tokenizer, LONG_PROMPT)
    before = live.generate(ids, 1, GREEDY)
    live.load_weights(tiny_models["v1"], 1)
    fresh = TransformersSampler(tiny_models["v1"])
    after = live.generate(ids, 1, GREEDY)
    assert_same_samples(after, fresh.generate(ids, 1, GREEDY))
    assert_same_samples(live.generate(ids, 3, SAMPLED), fresh.generate(ids, 3, SAMPLED))
    assert after[0].token_ids != before[0].token_ids


def test_a_lora_version_matches_the_merged_model(tiny_models, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_models["v0"], dtype=torch.float32)
    peft_model = get_peft_model(
        base,
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "down_proj"],
            init_lora_weights=False,
        ),
    )
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = peft_model.merge_and_unload()

    live = TransformersSampler(tiny_models["v0"])
    ids = prompt_ids(live)
    live.load_weights(tmp_path / "adapter", 1, "lora")
    got = live.generate(ids, 1, GREEDY)[0]
    assert got.logprobs == pytest.approx(
        teacher_forced_logprobs(merged, ids, got.token_ids), abs=1e-4
    )
    plain = TransformersSampler(tiny_models["v0"]).generate(ids, 1, GREEDY)[0]
    assert got.token_ids != plain.token_ids or got.logprobs != pytest.approx(plain.logprobs)
