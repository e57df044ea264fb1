"""Samples of one request → its candidates on code-to-bench (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from hpcrl_common.messages import (
    Candidate,
    GenerateRequest,
    PackedArray,
    RolloutData,
    candidate_id,
)
from hpcrl_generator.sampling import Sample


def build_candidates(
    request: GenerateRequest,
    prompt_token_ids: Sequence[int],
    samples: Sequence[Sample],
    policy_version: int,
    generator: str,
) -> list[Candidate]:
    if len(samples) != request.group_size:
        raise ValueError(f"{len(samples)} samples for a group of {request.group_size}")
    prompt = PackedArray.of(prompt_token_ids, "<i4")
    return [
        Candidate(
            id=candidate_id(request.group_id, index),
            group_id=request.group_id,
            index=index,
            completion=sample.text,
            bench=request.bench,
            rollout=RolloutData(
                prompt_token_ids=prompt,
                completion_token_ids=PackedArray.of(sample.token_ids, "<i4"),
                sampling_logprobs=PackedArray.of(sample.logprobs, "<f4"),
                policy_version=policy_version,
                finish_reason=sample.finish_reason,
            ),
            generator=generator,
        )
        for index, sample in enumerate(samples)
    ]
