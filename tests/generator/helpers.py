"""Small helpers shared by the generator tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from hpcrl_common.broker import Publish
from hpcrl_common.messages import (
    BenchSpec,
    Candidate,
    CandidateCommitment,
    ChatMessage,
    GenerateRequest,
    SamplingParams,
    decode,
)
from hpcrl_common.topology import CANDIDATE_COMMITMENTS
from hpcrl_generator.sampling import Sample

PROMPT = [
    ChatMessage(role="system", content="You are an expert HPC programmer."),
    ChatMessage(role="user", content="Write a faster matrix multiplication kernel in C."),
]

PARENT_PROGRAM = """#include <immintrin.h>

void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {
#pragma omp parallel for
  for (int i = 0; i < M; i++)
    for (int j = 0; j < N; j += 8) {
      __m512d sum = _mm512_setzero_pd();
      for (int k = 0; k < K; k++) {
        __m512d a = _mm512_set1_pd(A[i * K + k]);
        __m512d b = _mm512_loadu_pd(&B[k * N + j]);
        sum = _mm512_fmadd_pd(a, b, sum);
      }
      _mm512_storeu_pd(&C[i * N + j], sum);
    }
}
"""
# Shaped like the scheduler's prompts (instructions + a parent program): long enough to span
# several of vLLM's prefix-cache blocks (431 tokens with the tiny models' tokenizer).
LONG_PROMPT = [
    ChatMessage(role="system", content="You are an expert HPC programmer."),
    ChatMessage(
        role="user",
        content=(
            "Write a faster matrix multiplication kernel in C. Use register blocking.\n"
            "Improve the program below; keep its signature and its results.\n\n"
            f"```c\n{PARENT_PROGRAM}```\n"
            "It assumes N is a multiple of 8 and runs at 41.3 GFLOP/s for M = N = K = 1024.\n"
        ),
    ),
]


def request(
    rid: str,
    *,
    group_size: int = 2,
    temperature: float = 0.0,
    max_tokens: int = 12,
    floor: int = 0,
    seed: int | None = None,
    prompt: list[ChatMessage] | None = None,
) -> GenerateRequest:
    return GenerateRequest(
        id=rid,
        experiment="test",
        iteration=0,
        mode="seed",
        prompt=prompt or PROMPT,
        group_size=group_size,
        sampling=SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed),
        min_policy_version=floor,
        bench=BenchSpec(task="matmul", stage=1, opt_level="O3"),
    )


def take_candidates(channel, queue: str, into: dict[str, Candidate]) -> int:
    """Move every message of ``queue`` into ``into`` (by id); return how many arrived."""
    got = 0
    while True:
        method, _props, body = channel.basic_get(queue, auto_ack=True)
        if method is None:
            return got
        candidate = decode(body, Candidate)
        into[candidate.id] = candidate
        got += 1


def save_lora_adapter(base: Path, out: Path, seed: int) -> Path:
    """A random (non-zero) LoRA adapter on ``base``, saved as the learner saves a version."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(out)
    return out


def assert_same_samples(got: Sequence[Sample], want: Sequence[Sample], tol: float = 1e-4) -> None:
    """The same token ids, and log-probs within ``tol``."""
    got_ids, want_ids = [s.token_ids for s in got], [s.token_ids for s in want]
    assert got_ids == want_ids, f"token ids {got_ids} != {want_ids}"
    for mine, theirs in zip(got, want, strict=True):
        assert mine.logprobs == pytest.approx(theirs.logprobs, abs=tol), (
            f"log-probs {mine.logprobs} != {theirs.logprobs}"
        )


def tokens(candidate: Candidate) -> list[int]:
    assert candidate.rollout is not None
    return candidate.rollout.completion_token_ids.numpy().tolist()


def candidates(out: Sequence[Publish]) -> list[Candidate]:
    """The candidates a request's handler publishes, once checked that the group's
    commitment goes first (to candidate-commitments) and commits to each of them."""
    first, *rest = out
    assert first.routing_key.endswith(CANDIDATE_COMMITMENTS), first.routing_key
    found = [p.message for p in rest]
    assert all(isinstance(c, Candidate) for c in found), found
    expected = CandidateCommitment.of(found)  # type: ignore[arg-type]
    commitment = first.message
    assert isinstance(commitment, CandidateCommitment)
    assert (commitment.id, commitment.entries) == (expected.id, expected.entries)
    return found  # type: ignore[return-value]
