"""From rollout-batch messages to padded training tensors. Pure: no I/O, no model.

The learner trains on the exact token ids the sampler produced (prompt ids and completion ids
travel in the message); it never re-tokenises text, so a chat template can never make the
trainer score a different sequence from the one that was sampled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hpcrl_common.messages import RolloutBatch
from hpcrl_common.rewards import MAX_ABS_REWARD
from hpcrl_learner.grpo import group_advantages, weight_negative_advantages


class BadBatch(ValueError):
    """A rollout batch that can never be trained on (dead-lettered with this reason)."""


@dataclass(frozen=True)
class TrainSequence:
    prompt_ids: np.ndarray  # int64
    completion_ids: np.ndarray  # int64
    sampling_logprobs: np.ndarray  # float32, one per completion token
    advantage: float
    fresh: bool = True  # sampled by the trainer's current version (no update since)
    # 1.0 per completion token the policy-gradient term credits (credit.py); None: all of them
    credit: np.ndarray | None = None

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

    @property
    def zero_variance(self) -> bool:
        """All rewards equal (or a group of one): every advantage is 0, no preference."""
        return len(set(self.rewards)) <= 1


def staleness(batch: RolloutBatch, current_version: int) -> int:
    """How many policy versions the oldest sample of the group is behind the learner."""
    return max(0, current_version - batch.min_policy_version)


def prepare_group(
    batch: RolloutBatch,
    current_version: int,
    *,
    adv_eps: float,
    scale_advantages: bool = True,
    negative_advantage_scale: float = 1.0,
    vocab_size: int,
    max_sequence_tokens: int,
    max_abs_reward: float = MAX_ABS_REWARD,
    credit: Callable[[np.ndarray, list[np.ndarray]], list[np.ndarray]] | None = None,
) -> PreparedGroup:
    """``credit``: given the prompt and the completions, each one's per-token credit
    (``credit.credit_mask``); None credits every token."""
    prompt = batch.prompt_token_ids.numpy().astype(np.int64)
    if len(prompt) == 0:
        raise BadBatch("empty prompt: the first completion token has nothing to condition on")
    rewards = [sample.reward for sample in batch.samples]
    bound = min(max_abs_reward, MAX_ABS_REWARD)
    if any(abs(reward) > bound for reward in rewards):
        raise BadBatch(f"rewards outside +-{bound:g} (learner.max_abs_reward): {rewards}")
    try:
        advantages = group_advantages(rewards, eps=adv_eps, scale=scale_advantages).tolist()
        advantages = weight_negative_advantages(advantages, negative_advantage_scale)
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
            raise BadBatch(
                f"{sample.candidate_id}: {len(prompt) + len(ids)} tokens > "
                f"max_sequence_tokens {max_sequence_tokens}"
            )
        for name, array in (("prompt", prompt), ("completion", ids)):
            if len(array) and (array.min() < 0 or array.max() >= vocab_size):
                raise BadBatch(
                    f"{sample.candidate_id}: {name} token id outside the "
                    f"vocabulary [0, {vocab_size})"
                )
        sequences.append(TrainSequence(prompt, ids, logprobs, float(advantage), fresh=lag == 0))
    if credit is not None:
        masks = credit(prompt, [seq.completion_ids for seq in sequences])
        sequences = [
            dataclasses.replace(seq, credit=np.asarray(mask, dtype=np.float32))
            for seq, mask in zip(sequences, masks, strict=True)
        ]
    return PreparedGroup(batch.id, sequences, rewards, advantages, lag)


PAD_MULTIPLE = 64


@dataclass
class Collated:
    """A right-padded micro-batch, no attention mask needed.

    Rows are prompt + completion, padded after the end to a multiple of ``PAD_MULTIPLE``
    tokens: causal attention never lets a real token see the padding after it, positions are
    the natural 0..L-1, and on CPU few distinct widths let oneDNN reuse its kernels. The
    completion's targets are listed flat (``rows``, ``cols``: the position whose logits
    predict each, ``targets``), so logits are computed for completion tokens only; per-token
    quantities come back as [B, C] with each completion left-aligned (``slots``: its column).
    """

    input_ids: torch.Tensor  # [B, L], L a multiple of PAD_MULTIPLE
    rows: torch.Tensor  # [N] row of each completion token
    cols: torch.Tensor  # [N] position whose logits predict it (its own position - 1)
    slots: torch.Tensor  # [N] its index within its completion (column in [B, C])
    targets: torch.Tensor  # [N] the completion tokens
    completion_mask: torch.Tensor  # [B, C] 1 on completion tokens (left-aligned)
    sampling_logprobs: torch.Tensor  # [B, C]
    advantages: torch.Tensor  # [B]
    credit: torch.Tensor  # [B, C] 1 on the completion tokens the policy gradient credits

    @property
    def width(self) -> int:
        return int(self.completion_mask.shape[1])

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[N] per completion token -> [B, C] (zeros off the completions), differentiable."""
        out = values.new_zeros(self.completion_mask.shape)
        return out.index_put((self.rows, self.slots), values)


def padded_width(length: int, multiple: int = PAD_MULTIPLE) -> int:
    return -(-length // multiple) * multiple


def collate(
    sequences: Sequence[TrainSequence], pad_id: int = 0, multiple: int = PAD_MULTIPLE
) -> Collated:
    if not sequences:
        raise ValueError("no sequences to collate")
    length = padded_width(max(s.length for s in sequences), multiple)
    width = max(len(s.completion_ids) for s in sequences)
    rows = len(sequences)
    input_ids = torch.full((rows, length), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((rows, width), dtype=torch.float32)
    sampling = torch.zeros((rows, width), dtype=torch.float32)
    credit = torch.zeros((rows, width), dtype=torch.float32)
    flat_rows, flat_cols, flat_slots = [], [], []
    for row, seq in enumerate(sequences):
        tokens = np.concatenate([seq.prompt_ids, seq.completion_ids])
        input_ids[row, : len(tokens)] = torch.from_numpy(tokens)
        count, start = len(seq.completion_ids), len(seq.prompt_ids)
        if count:
            completion_mask[row, :count] = 1.0
            sampling[row, :count] = torch.from_numpy(seq.sampling_logprobs)
            credit[row, :count] = _credit(seq)
            flat_rows.append(np.full(count, row))
            flat_cols.append(np.arange(start - 1, start - 1 + count))
            flat_slots.append(np.arange(count))

    rows_t, cols_t = _flat(flat_rows), _flat(flat_cols)
    return Collated(
        input_ids=input_ids,
        rows=rows_t,
        cols=cols_t,
        slots=_flat(flat_slots),
        targets=input_ids[rows_t, cols_t + 1],
        completion_mask=completion_mask,
        sampling_logprobs=sampling,
        advantages=torch.tensor([s.advantage for s in sequences], dtype=torch.float32),
        credit=credit,
    )


def micro_batches(
    sequences: Sequence[TrainSequence], max_rows: int, max_tokens: int, multiple: int = PAD_MULTIPLE
) -> list[list[TrainSequence]]:
    """Length-sorted micro-batches of at most ``max_rows`` sequences and ``max_tokens``
    padded tokens (rows x padded width; a longer sequence goes alone)."""
    ordered = sorted(sequences, key=lambda s: s.length)  # similar lengths pad less
    out: list[list[TrainSequence]] = []
    current: list[TrainSequence] = []
    for seq in ordered:
        grown = (len(current) + 1) * padded_width(seq.length, multiple)
        if current and (len(current) >= max_rows or (max_tokens and grown > max_tokens)):
            out.append(current)
            current = []
        current.append(seq)
    if current:
        out.append(current)
    return out


def by_prompt(sequences: Sequence[TrainSequence]) -> list[list[TrainSequence]]:
    """The sequences grouped by identical prompt, groups in order of first appearance (a
    GRPO group's completions all share one)."""
    groups: dict[bytes, list[TrainSequence]] = {}
    for seq in sequences:
        key = np.ascontiguousarray(seq.prompt_ids, dtype=np.int64).tobytes()
        groups.setdefault(key, []).append(seq)
    return list(groups.values())


def collate_completions(
    sequences: Sequence[TrainSequence], pad_id: int = 0, multiple: int = PAD_MULTIPLE
) -> Collated:
    """Like :func:`collate` for sequences that share one prompt, which the model has already
    run (its keys and values cached): rows are the completions alone, right-padded.

    Completion token t is predicted by the hidden state before it: the prompt's last one for
    t = 0, the row's position t - 1 after. With that state prepended to each row's hidden
    states, the position that predicts slot t is column t (``cols`` == ``slots``).
    """
    if not sequences:
        raise ValueError("no sequences to collate")
    if len({s.prompt_ids.tobytes() for s in sequences}) != 1:
        raise ValueError("collate_completions needs sequences that share their prompt")
    width = max(len(s.completion_ids) for s in sequences)
    rows = len(sequences)
    input_ids = torch.full((rows, padded_width(max(width, 1), multiple)), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((rows, width), dtype=torch.float32)
    sampling = torch.zeros((rows, width), dtype=torch.float32)
    credit = torch.zeros((rows, width), dtype=torch.float32)
    flat_rows, flat_slots = [], []
    for row, seq in enumerate(sequences):
        count = len(seq.completion_ids)
        if count:
            input_ids[row, :count] = torch.from_numpy(seq.completion_ids)
            completion_mask[row, :count] = 1.0
            sampling[row, :count] = torch.from_numpy(seq.sampling_logprobs)
            credit[row, :count] = _credit(seq)
            flat_rows.append(np.full(count, row))
            flat_slots.append(np.arange(count))
    rows_t = _flat(flat_rows)
    slots_t = _flat(flat_slots)
    return Collated(
        input_ids=input_ids,
        rows=rows_t,
        cols=slots_t,
        slots=slots_t,
        targets=input_ids[rows_t, slots_t],
        completion_mask=completion_mask,
        sampling_logprobs=sampling,
        advantages=torch.tensor([s.advantage for s in sequences], dtype=torch.float32),
        credit=credit,
    )


def _credit(seq: TrainSequence) -> torch.Tensor | float:
    if seq.credit is None:
        return 1.0
    if seq.credit.shape != seq.completion_ids.shape:
        raise ValueError("a sequence's credit must have one value per completion token")
    return torch.from_numpy(seq.credit)


def _flat(parts: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64)).long()
