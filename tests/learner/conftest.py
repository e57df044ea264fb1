"""Fixtures of the learner suite: a tiny Qwen2 built locally, rollout batches made by hand."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from hpcrl_common.messages import PackedArray, RolloutBatch, RolloutSample, text_sha256
from hpcrl_learner.batches import TrainSequence
from tests.support.models import learner_model

PROMPT = [5, 6, 7, 8]
GOOD = [10, 11, 12, 13, 2]  # the completion the rewards favour
BAD = [20, 21, 22, 2]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return learner_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


@functools.cache
def _tokenizer():
    # The tokenizer every tiny model is written with (hpcrl_bootstrap.model).
    from hpcrl_bootstrap.model import tiny_tokenizer

    return tiny_tokenizer()


def judged_hash(ids: Sequence[int]) -> str:
    """What the benchmarker would have hashed: the text the sampler made of these ids."""
    return text_sha256(_tokenizer().decode(list(ids), skip_special_tokens=True))


def sequences_of(completions: Sequence[Sequence[int]]) -> list[TrainSequence]:
    """Training sequences of PROMPT + each completion, with zero log-probs and advantage."""
    return [
        TrainSequence(np.array(PROMPT), np.array(ids), np.zeros(len(ids), np.float32), 0.0)
        for ids in completions
    ]


def rollout_batch(
    batch_id: str,
    completions: Sequence[Sequence[int]],
    rewards: Sequence[float],
    *,
    logprobs: Sequence[Sequence[float]] | None = None,
    policy_version: int | Sequence[int] = 0,
    prompt: Sequence[int] = PROMPT,
) -> RolloutBatch:
    versions = (
        [policy_version] * len(completions)
        if isinstance(policy_version, int)
        else list(policy_version)
    )
    samples = []
    for index, (ids, reward) in enumerate(zip(completions, rewards, strict=True)):
        lp = logprobs[index] if logprobs is not None else [-1.0] * len(ids)
        samples.append(
            RolloutSample(
                candidate_id=f"{batch_id}/{index}",
                completion_token_ids=PackedArray.of(ids, "<i4"),
                sampling_logprobs=PackedArray.of(lp, "<f4"),
                policy_version=versions[index],
                reward=float(reward),
                status="success" if reward > 0 else "compile_error",
                completion_sha256=judged_hash(ids),
            )
        )
    return RolloutBatch(
        id=batch_id,
        experiment="test",
        iteration=0,
        prompt_token_ids=PackedArray.of(prompt, "<i4"),
        samples=samples,
        reward_mode="raw",
    )


def good_bad_batch(
    batch_id: str, logprobs: dict[str, np.ndarray] | None = None, policy_version: int = 0
) -> RolloutBatch:
    """A group of four: GOOD twice with reward 100, BAD twice with reward -40."""
    completions = [GOOD, BAD, GOOD, BAD]
    lps = None
    if logprobs is not None:
        lps = [logprobs["good"], logprobs["bad"], logprobs["good"], logprobs["bad"]]
    return rollout_batch(
        batch_id,
        completions,
        [100.0, -40.0, 100.0, -40.0],
        logprobs=lps,
        policy_version=policy_version,
    )
