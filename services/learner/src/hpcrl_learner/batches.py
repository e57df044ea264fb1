"""From rollout-batch messages to padded training tensors. Pure: no I/O, no model.

The learner trains on the exact token ids the sampler produced (prompt ids and completion ids
travel in the message); it never re-tokenises text, so a chat template can never make the
trainer score a different sequence from the one that was sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hpcrl_common.messages import RolloutBatch
from hpcrl_common.rewards import MAX_ABS_REWARD
from hpcrl_learner.grpo import group_advantages


class BadBatch(ValueError):
    """A rollout batch that can never be trained on (dead-lettered with this reason)."""


@dataclass(frozen=True)
class TrainSequence:
    prompt_ids: np.ndarray  # int64
    completion_ids: np.ndarray  # int64
    sampling_logprobs: np.ndarray  # float32, one per completion token
    advantage: float
    fresh: bool = True  # sampled by the trainer's current version (no update since)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass(frozen=True)
class PreparedGroup:
    batch_id: str
    sequences: list[TrainSequence]
    rewards: list[float]
    advantages: list[float]
    staleness: int


def staleness(batch: RolloutBatch, current_version: int) -> int:
    """How many policy versions the oldest sample of the group is behind the learner."""
    return max(0, current_version - batch.min_policy_version)


def prepare_group(
    batch: RolloutBatch,
    current_version: int,
    *,
    adv_eps: float,
    vocab_size: int,
    max_sequence_tokens: int,
) -> PreparedGroup:
    prompt = batch.prompt_token_ids.numpy().astype(np.int64)
    if len(prompt) == 0:
        raise BadBatch("empty prompt: the first completion token has nothing to condition on")
    rewards = [sample.reward for sample in batch.samples]
    if any(abs(reward) > MAX_ABS_REWARD for reward in rewards):
        raise BadBatch(f"rewards outside +-{MAX_ABS_REWARD:g}: {rewards}")
    try:
        advantages = group_advantages(rewards, eps=adv_eps).tolist()
    except ValueError as exc:
        raise BadBatch(str(exc)) from None
    lag = staleness(batch, current_version)
    sequences = []
    for sample, advantage in zip(batch.samples, advantages, strict=True):
        ids = sample.completion_token_ids.numpy().astype(np.int64)
        logprobs = sample.sampling_logprobs.numpy().astype(np.float32)
        if not np.isfinite(logprobs).all():
            raise BadBatch(f"{sample.candidate_id}: non-finite sampling log-probs")
        if len(prompt) + len(ids) > max_sequence_tokens:
            raise BadBatch(f"{sample.candidate_id}: {len(prompt) + len(ids)} tokens > "
                           f"max_sequence_tokens {max_sequence_tokens}")
        for name, array in (("prompt", prompt), ("completion", ids)):
            if len(array) and (array.min() < 0 or array.max() >= vocab_size):
                raise BadBatch(f"{sample.candidate_id}: {name} token id outside the "
                               f"vocabulary [0, {vocab_size})")
        sequences.append(TrainSequence(prompt, ids, logprobs, float(advantage), fresh=lag == 0))
    return PreparedGroup(batch.id, sequences, rewards, advantages, lag)


@dataclass
class Collated:
    """A left-padded micro-batch. Completions are right-aligned at the end of every row, so
    the logits of the last ``width + 1`` positions are all the loss needs."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    position_ids: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, C] the last C tokens of every row
    completion_mask: torch.Tensor  # [B, C] 1 where the target is a completion token
    sampling_logprobs: torch.Tensor  # [B, C]
    advantages: torch.Tensor  # [B]

    @property
    def width(self) -> int:
        return int(self.targets.shape[1])


def collate(sequences: Sequence[TrainSequence], pad_id: int = 0) -> Collated:
    if not sequences:
        raise ValueError("no sequences to collate")
    length = max(s.length for s in sequences)
    width = max(len(s.completion_ids) for s in sequences)
    rows = len(sequences)
    input_ids = torch.full((rows, length), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, length), dtype=torch.long)
    completion_mask = torch.zeros((rows, width), dtype=torch.float32)
    sampling = torch.zeros((rows, width), dtype=torch.float32)
    for row, seq in enumerate(sequences):
        tokens = np.concatenate([seq.prompt_ids, seq.completion_ids])
        input_ids[row, length - len(tokens):] = torch.from_numpy(tokens)
        attention[row, length - len(tokens):] = 1
        count = len(seq.completion_ids)
        if count:
            completion_mask[row, width - count:] = 1.0
            sampling[row, width - count:] = torch.from_numpy(seq.sampling_logprobs)
    # Positions count real tokens only, so left padding does not shift the rotary phases.
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    return Collated(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=position_ids,
        targets=input_ids[:, length - width:] if width else input_ids[:, :0],
        completion_mask=completion_mask,
        sampling_logprobs=sampling,
        advantages=torch.tensor([s.advantage for s in sequences], dtype=torch.float32),
    )
