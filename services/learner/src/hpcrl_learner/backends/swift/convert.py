"""Our training sequences -> the micro-batches ms-swift's Megatron worker consumes.

The worker (``swift.ray.megatron.megatron_worker.MegatronWorker``) takes driver-collated
micro-batches: ``model_inputs`` dicts (``input_ids``, ``labels``, ``attention_mask`` ...) each
carrying a ``GRPOBatch`` (``completion_mask``, ``old_per_token_logps``, ``advantages``,
``num_items_in_batch`` ...) in the full-sequence frame: position t holds the log-prob of token
t + 1. We build the per-sample ``encoded`` dicts from the exact sampled token ids (never from
messages: ms-swift's templates rebuild prompts, which could change the tokens) and collate them
with ms-swift's own ``collate_to_grpo_micro_batch``, so the frame is ms-swift's by construction.

How our GRPO maps onto ms-swift's loss (``MegatronGRPOTrainer.loss_func``):

* ratio: ms-swift takes exp(log pi_theta - old_per_token_logps); we set ``old`` to the
  *sampler's* log-probs, as the torch backend does, and leave ms-swift's separate rollout
  importance sampling off;
* truncated importance weight: a token whose |log pi_theta - log pi_sampling| (measured by
  ``compute_logps`` just before the step) exceeds ``max_log_ratio`` is removed from the
  completion mask but still counted in ``num_items_in_batch``, exactly the torch backend's
  rule; ms-swift's ``delta`` = exp(max_log_ratio) also caps the ratio in the loss itself;
* aggregation: always ms-swift's ``dapo`` loss (token sum / ``num_items_in_batch``, which we
  set to the whole step's completion tokens). ``sequence`` aggregation scales each sample's
  advantage by N / (S * L_i), which turns that token mean into the per-sequence mean (exact
  for the clipped term, because the clipped objective is linear in a positive rescaling of A;
  the beta * KL term stays token-weighted);
* padding: every data-parallel rank must get the same number of micro-batches, so the step is
  padded with filler rows (a copy of a real sequence with an empty completion mask): zero loss,
  zero gradient, not counted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from hpcrl_learner.batches import TrainSequence

IGNORE_INDEX = -100  # ms-swift's (and transformers') "no loss here" label


def encode_sequence(seq: TrainSequence, *, filler: bool = False) -> dict[str, Any]:
    """The per-sample ``encoded`` dict ms-swift's ``template.encode`` would have produced,
    made from the exact token ids; a filler has no completion labels (no loss)."""
    prompt = seq.prompt_ids.tolist()
    completion = seq.completion_ids.tolist()
    labels = [IGNORE_INDEX] * len(prompt) + (
        [IGNORE_INDEX] * len(completion) if filler else completion
    )
    return {
        "input_ids": prompt + completion,
        "labels": labels,
        "length": len(prompt) + len(completion),
    }


def layout(count: int, dp_size: int, micro_batch_size: int) -> tuple[int, int]:
    """(micro-batches per rank, filler rows) for ``count`` sequences."""
    if count < 1 or dp_size < 1 or micro_batch_size < 1:
        raise ValueError(
            f"need count, dp_size, micro_batch_size >= 1, got {count}, {dp_size}, "
            f"{micro_batch_size}"
        )
    per_rank = math.ceil(count / (dp_size * micro_batch_size))
    return per_rank, per_rank * dp_size * micro_batch_size - count


def advantage_weights(
    sequences: Sequence[TrainSequence], aggregation: Literal["token", "sequence"]
) -> list[float]:
    """Per-sample factors on A that make ms-swift's token-mean loss our aggregation."""
    if aggregation == "token":
        return [1.0] * len(sequences)
    lengths = [len(s.completion_ids) for s in sequences]
    tokens = float(sum(lengths))
    with_tokens = sum(1 for n in lengths if n)
    return [tokens / (with_tokens * n) if n else 0.0 for n in lengths]


@dataclass
class StepBatch:
    """One optimizer step, collated for the workers."""

    dispatch: dict[int, list[dict[str, Any]]]  # dp rank -> its micro-batches (model_inputs)
    grpo_batches: list[Any]  # the GRPOBatch of every micro-batch, rank-major (same objects)
    real: list[torch.Tensor]  # per micro-batch: [B] bool, False on filler rows
    tokens: int  # completion tokens of the real sequences (the loss normaliser)
    sequences: int
    micro_batches_per_rank: int
    stats: dict[str, float] = field(default_factory=dict)


def collate_step(
    sequences: Sequence[TrainSequence],
    template: Any,
    *,
    dp_size: int,
    micro_batch_size: int,
    aggregation: Literal["token", "sequence"] = "token",
    padding_to: int | None = None,
) -> StepBatch:
    """Collate a step with ms-swift's own collate; fill old log-probs (the sampler's),
    per-token advantages (ours, from ``grpo.group_advantages``) and ``num_items_in_batch``."""
    from swift.rl_core.advantage import expand_advantage_to_per_token
    from swift.rl_core.data import OnPolicySample
    from swift.rlhf_trainers.utils import collate_to_grpo_micro_batch

    with_tokens = [s for s in sequences if len(s.completion_ids)]
    if not with_tokens:
        raise ValueError("a step needs at least one sequence with completion tokens")
    per_rank, fillers = layout(len(with_tokens), dp_size, micro_batch_size)
    weights = advantage_weights(with_tokens, aggregation)
    shortest = min(with_tokens, key=lambda s: s.length)
    rows: list[tuple[TrainSequence, float, bool]] = [
        (s, s.advantage * w, True) for s, w in zip(with_tokens, weights, strict=True)
    ] + [(shortest, 0.0, False)] * fillers
    # Similar lengths in one micro-batch pad less; then deal micro-batches round-robin over
    # the ranks so that every rank gets a similar share of tokens.
    order = sorted(range(len(rows)), key=lambda i: rows[i][0].length)
    chunks = [order[i : i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]
    dispatch: dict[int, list[dict[str, Any]]] = {rank: [] for rank in range(dp_size)}
    grpo_batches: list[Any] = []
    real_masks: list[torch.Tensor] = []
    cpu = torch.device("cpu")
    for index, chunk in enumerate(chunks):
        samples = []
        for i in chunk:
            seq, _, real = rows[i]
            samples.append(
                OnPolicySample(
                    messages=[],
                    encoded=encode_sequence(seq, filler=not real),
                    response_token_ids=[seq.completion_ids.tolist()] if real else [],
                    finish_reason="stop",
                )
            )
        model_inputs, batch = collate_to_grpo_micro_batch(
            samples, template, device=cpu, padding_to=padding_to
        )
        mask = batch.completion_mask
        old = torch.zeros(mask.shape, dtype=torch.float32)
        for row, i in enumerate(chunk):
            seq, _, real = rows[i]
            if real:
                positions = mask[row].nonzero(as_tuple=True)[0]
                if len(positions) != len(seq.sampling_logprobs):
                    raise ValueError(
                        f"collated {len(positions)} completion positions for "
                        f"{len(seq.sampling_logprobs)} sampled tokens"
                    )
                old[row, positions] = torch.from_numpy(seq.sampling_logprobs)
        batch.old_per_token_logps = old
        base = torch.tensor([rows[i][1] for i in chunk], dtype=torch.float32)
        # ms-swift broadcasts A over the whole row; zero it off the completion (the loss masks
        # it anyway) so that nothing outside the sampled tokens can carry a training signal.
        batch.advantages = expand_advantage_to_per_token(base, mask) * mask.to(torch.float32)
        model_inputs["grpo_batch"] = batch
        dispatch[index % dp_size].append(model_inputs)
        grpo_batches.append(batch)
        real_masks.append(torch.tensor([rows[i][2] for i in chunk]))
    # Rank-major, the order in which the worker group's dp_flat collect returns rows.
    ordered = [mi["grpo_batch"] for rank in range(dp_size) for mi in dispatch[rank]]
    reals = {id(b): r for b, r in zip(grpo_batches, real_masks, strict=True)}
    tokens = int(sum(len(s.completion_ids) for s in with_tokens))
    for batch in ordered:
        batch.num_items_in_batch = torch.tensor(float(tokens))
    return StepBatch(
        dispatch=dispatch,
        grpo_batches=ordered,
        real=[reals[id(b)] for b in ordered],
        tokens=tokens,
        sequences=len(with_tokens),
        micro_batches_per_rank=per_rank,
    )


def scatter_rows(
    step: StepBatch, rows: Sequence[dict[str, torch.Tensor]], key: str
) -> list[torch.Tensor]:
    """Split the worker group's flat per-sample rows (rank-major) back per micro-batch."""
    out, position = [], 0
    for batch in step.grpo_batches:
        count = int(batch.completion_mask.shape[0])
        chunk = rows[position : position + count]
        position += count
        out.append(torch.stack([r[key].float() for r in chunk], dim=0))
    if position != len(rows):
        raise ValueError(f"got {len(rows)} log-prob rows for {position} collated samples")
    return out


def mask_mismatched_tokens(
    step: StepBatch, trainer_logps: Sequence[torch.Tensor], max_log_ratio: float
) -> dict[str, float]:
    """Drop tokens with |log pi_theta - log pi_sampling| > max_log_ratio from the completion
    masks (they stay counted in ``num_items_in_batch``); return the sampler/trainer k3 KL and
    the masked fraction over the real completion tokens, as the torch backend reports them."""
    kl_sum, masked = 0.0, 0.0
    for batch, logp, real in zip(step.grpo_batches, trainer_logps, step.real, strict=True):
        mask = batch.completion_mask.bool() & real.unsqueeze(1)
        width = min(logp.shape[1], mask.shape[1])
        logp = torch.nn.functional.pad(logp[:, :width], (0, mask.shape[1] - width))
        log_ratio = logp - batch.old_per_token_logps
        keep = mask & (log_ratio.abs() <= max_log_ratio)
        stat = log_ratio.clamp(-20.0, 20.0)
        kl_sum += float(((torch.exp(stat) - 1.0 - stat) * mask).sum())
        masked += float((mask & ~keep).sum())
        batch.completion_mask = keep
    tokens = max(float(step.tokens), 1.0)
    step.stats = {"sampler_kl": kl_sum / tokens, "masked_fraction": masked / tokens}
    return step.stats
