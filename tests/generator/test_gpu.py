"""The transformers backend on a CUDA GPU: sampling, log-probs and a hot reload there.

Skipped where no CUDA device is visible (CI, the 2-core machines); on a GPU node run
``pytest tests/generator/test_gpu.py``. (vLLM's GPU build is the cluster's usual backend; its
CPU build is what the rest of the suite tests.)
"""

from __future__ import annotations

import pytest
import torch

from hpcrl_common.messages import SamplingParams
from hpcrl_generator.backends.transformers import TransformersSampler
from hpcrl_generator.prompt import render_prompt

from .helpers import PROMPT

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible on this machine)"
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def test_gpu_sampling_logprobs_match_a_forward_pass(tiny_models):
    sampler = TransformersSampler(tiny_models["v0"], device="cuda", dtype="float32")
    assert next(sampler.model.parameters()).device.type == "cuda"
    ids = render_prompt(sampler.tokenizer, PROMPT)
    samples = sampler.generate(ids, 4, SamplingParams(temperature=0.8, max_tokens=10, seed=3))
    assert len(samples) == 4
    for sample in samples:
        tokens = torch.tensor([ids + sample.token_ids], device="cuda")
        with torch.no_grad():
            logits = sampler.model(tokens).logits[0, len(ids) - 1 : -1].float()
        expected = (
            torch.log_softmax(logits, dim=-1)
            .gather(-1, torch.tensor(sample.token_ids, device="cuda")[:, None])
            .squeeze(-1)
        )
        assert sample.logprobs == pytest.approx(expected.tolist(), abs=1e-4)


def test_gpu_greedy_agrees_with_cpu_and_a_reload_equals_a_fresh_load(tiny_models):
    gpu = TransformersSampler(tiny_models["v0"], device="cuda", dtype="float32")
    cpu = TransformersSampler(tiny_models["v0"], device="cpu", dtype="float32")
    ids = render_prompt(gpu.tokenizer, PROMPT)
    on_gpu, on_cpu = gpu.generate(ids, 1, GREEDY)[0], cpu.generate(ids, 1, GREEDY)[0]
    assert on_gpu.token_ids == on_cpu.token_ids
    assert on_gpu.logprobs == pytest.approx(on_cpu.logprobs, abs=1e-3)
    gpu.load_weights(tiny_models["v1"], 1)
    fresh = TransformersSampler(tiny_models["v1"], device="cuda", dtype="float32")
    after, expected = gpu.generate(ids, 1, GREEDY)[0], fresh.generate(ids, 1, GREEDY)[0]
    assert gpu.version == 1 and after.token_ids == expected.token_ids
    assert after.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
