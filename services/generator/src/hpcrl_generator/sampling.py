"""The backend interface: what every sampler offers, and the plain data it returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from hpcrl_common.messages import SamplingParams

WeightFormat = Literal["full", "lora"]


@dataclass(frozen=True)
class Sample:
    """One completion: its tokens, each token's sampling log-prob, why it ended, its text."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    text: str = ""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.logprobs)} log-probs")


@dataclass(frozen=True)
class GroupJob:
    """One group to sample: ``n`` completions of one prompt with one request's settings."""

    prompt_token_ids: list[int]
    n: int
    sampling: SamplingParams


class Sampler(Protocol):
    """A policy that samples completions and takes new weights without a restart.

    Log-probs are those of the sampled tokens under the model's raw distribution (temperature
    1, no top-p), the quantity the learner's importance ratio divides by.
    """

    backend: str
    version: int
    max_model_len: int

    @property
    def tokenizer(self):  # a transformers tokenizer with a chat template
        ...

    def generate(
        self, prompt_token_ids: list[int], n: int, sampling: SamplingParams
    ) -> list[Sample]: ...

    def generate_groups(self, jobs: Sequence[GroupJob]) -> list[list[Sample]]:
        """Every job's samples, in order, from one policy version (one engine call where
        the backend batches, so several groups decode together)."""
        ...

    def load_weights(self, path: Path, version: int, format: WeightFormat = "full") -> None:
        """Make ``path`` (already validated) the policy; set ``version`` on success."""
        ...

    def close(self) -> None: ...


def is_greedy(sampling: SamplingParams) -> bool:
    return sampling.temperature == 0.0


def trim_completion(
    token_ids: list[int], stop_ids: set[int], max_tokens: int
) -> tuple[int, str | None]:
    """Length of a completion (up to and including its first stop token) and why it ended.

    The stop token stays in the completion, as vLLM returns it: the learner must see that
    the policy chose to stop.
    """
    for position, token in enumerate(token_ids):
        if token in stop_ids:
            return position + 1, "stop"
    if len(token_ids) >= max_tokens:
        return max_tokens, "length"
    return len(token_ids), None
