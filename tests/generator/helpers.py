"""Small helpers shared by the generator tests."""

from __future__ import annotations

import time
from collections.abc import Callable

from hpcrl_common.messages import (
    BenchSpec,
    Candidate,
    ChatMessage,
    GenerateRequest,
    SamplingParams,
    decode,
)

PROMPT = [
    ChatMessage(role="system", content="You are an expert HPC programmer."),
    ChatMessage(role="user", content="Write a faster matrix multiplication kernel in C."),
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


def wait_for(predicate: Callable[[], object], timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what or 'condition'}")


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


def tokens(candidate: Candidate) -> list[int]:
    assert candidate.rollout is not None
    return candidate.rollout.completion_token_ids.numpy().tolist()
