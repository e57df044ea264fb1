"""GRPO maths: group advantages and the clipped token-level loss. Pure torch, no I/O.

Notation follows docs/SPEC.md section 7: for a group of G completions of one prompt with rewards R,
A_i = (R_i - mean R) / (std R + eps); per completion token the ratio
rho = exp(log pi_theta - log pi_sampling) enters min(rho A, clip(rho, 1 - delta, 1 + delta) A),
and beta > 0 adds a k3 estimate of KL(pi_theta || pi_ref). The loss is the negated objective.

Generation overlaps learning, so the sampling log-probs may come from an older policy or from
an engine whose numerics differ from the trainer's. A token whose |log rho| exceeds
``max_log_ratio`` gets importance weight 0 (masked): it contributes nothing, and since the
normaliser still counts it, it does not inflate the weight of the others. That bounds rho in
the loss by exp(max_log_ratio), so no single token can blow up a step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

# The loss's settings live in config: the `learner` section is one (read as it is).
from hpcrl_learner.config import LossSettings

# Only for the sampler/trainer KL statistic: exp() of a wild log-ratio must not overflow it.
_STAT_LOG_RATIO_LIMIT = 20.0


def group_advantages(
    rewards: Sequence[float] | torch.Tensor, eps: float = 1e-4, *, scale: bool = True
) -> torch.Tensor:
    """A_i = (R_i - mean R) / (std R + eps) for one group, in float64; with ``scale`` False,
    A_i = R_i - mean R (Dr. GRPO: a group whose rewards barely differ is not amplified).

    ``std`` is the population standard deviation (divide by G, not G - 1): it is defined for
    every G >= 1 and is what "std of the group" means when the group is all there is.
    Degenerate groups carry no preference between their members, so they get zero advantage:
    a group of one, and a group whose rewards are all equal (e.g. every sample failed to
    compile). Non-finite rewards are a bug upstream and are rejected, never averaged in.
    """
    if eps < 0 or not math.isfinite(eps):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    values = torch.as_tensor(rewards, dtype=torch.float64)
    if values.ndim != 1 or values.numel() == 0:
        raise ValueError(
            f"rewards must be a non-empty 1-D sequence, got shape {tuple(values.shape)}"
        )
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"rewards must be finite, got {values.tolist()}")
    if values.numel() == 1:
        return torch.zeros_like(values)
    centred = values - values.mean()
    std = values.std(correction=0)
    if float(std) == 0.0:
        return torch.zeros_like(values)
    if not scale:
        if not bool(torch.isfinite(centred).all()):
            raise ValueError(f"rewards too large to centre: {values.tolist()}")
        return centred
    denominator = std + eps
    if float(denominator) == 0.0:
        return torch.zeros_like(values)
    advantages = centred / denominator
    if not bool(torch.isfinite(advantages).all()):  # e.g. 1e308: the mean overflows
        raise ValueError(f"rewards too large to normalise: {values.tolist()}")
    return advantages


def weight_negative_advantages(advantages: Sequence[float], scale: float) -> list[float]:
    """Negative advantages times ``scale`` in (0, 1], positive ones as they are.

    Under the paper's rewards a failure costs -100 to -10 while successes share 0-100, so a
    group's failures dominate its spread: most of a step pushes away from what failed (often
    the SIMD attempts) rather than toward what was fast. Scaling the push keeps its sign,
    so every failure still ranks below every success."""
    if not 0 < scale <= 1 or not math.isfinite(scale):
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    return [a * scale if a < 0 else a for a in advantages]


@dataclass
class LossStats:
    """Sums over the tokens of one or more micro-batches; :meth:`means` turns them into rates."""

    loss: float = 0.0
    tokens: float = 0.0
    sequences: float = 0.0
    used_tokens: float = 0.0  # not masked by the importance-weight truncation
    clipped_tokens: float = 0.0
    masked_tokens: float = 0.0
    kl_sum: float = 0.0  # k3 KL(pi_theta || pi_ref), summed over completion tokens
    sampler_kl_sum: float = 0.0  # k3 KL(pi_sampling || pi_theta), summed over completion tokens
    ratio_sum: float = 0.0  # over used tokens
    kl_tokens: float = 0.0  # completion tokens whose KL to the reference was measured
    entropy_sum: float = 0.0  # policy entropy, summed over completion tokens
    entropy_tokens: float = 0.0  # completion tokens whose entropy was measured

    def add(self, other: LossStats) -> LossStats:
        for item in fields(self):
            setattr(self, item.name, getattr(self, item.name) + getattr(other, item.name))
        return self

    def means(self) -> dict[str, float]:
        tokens = max(self.tokens, 1.0)
        return {
            "loss": self.loss,
            "tokens": self.tokens,
            "sequences": self.sequences,
            "clip_fraction": self.clipped_tokens / max(self.used_tokens, 1.0),
            "masked_fraction": self.masked_tokens / tokens,
            # NaN where not measured (beta = 0: no reference is loaded)
            "kl": self.kl_sum / self.kl_tokens if self.kl_tokens else math.nan,
            "entropy": (
                self.entropy_sum / self.entropy_tokens if self.entropy_tokens else math.nan
            ),
            "sampler_kl": self.sampler_kl_sum / tokens,
            "ratio_mean": self.ratio_sum / max(self.used_tokens, 1.0),
        }


@dataclass
class LossOutput:
    loss: torch.Tensor
    stats: LossStats


def grpo_loss(
    logp: torch.Tensor,
    sampling_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    ref_logp: torch.Tensor | None = None,
    normalizer: float | None = None,
    credit: torch.Tensor | None = None,
) -> LossOutput:
    """The GRPO loss of a (micro-)batch of completions, shape [B, T] per token.

    ``logp``: trainer log-probs of the sampled tokens (with grad); ``sampling_logp``: the
    sampler's; ``advantages``: [B], one per completion; ``mask``: 1 on completion tokens.
    ``normalizer`` is the denominator of the whole optimizer step (tokens for "token"
    aggregation, sequences for "sequence"); pass it when a step is split into micro-batches so
    that their losses add up to the step's loss. By default the batch's own count is used.
    ``credit`` ([B, T], 0 or 1): the tokens whose clipped advantage term counts (credit.py);
    the KL term and the normaliser still count every completion token. None: all of them.
    """
    if logp.shape != sampling_logp.shape or logp.shape != mask.shape or logp.ndim != 2:
        raise ValueError(
            f"logp {tuple(logp.shape)}, sampling_logp {tuple(sampling_logp.shape)} and mask "
            f"{tuple(mask.shape)} must be the same [B, T] shape"
        )
    if advantages.shape != logp.shape[:1]:
        raise ValueError(
            f"advantages must be [B] = [{logp.shape[0]}], got {tuple(advantages.shape)}"
        )
    if settings.beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs the reference model's log-probs (ref_logp)")
        if ref_logp.shape != logp.shape:
            raise ValueError(f"ref_logp must be {tuple(logp.shape)}, got {tuple(ref_logp.shape)}")

    mask = mask.to(logp.dtype)
    sampling_logp = sampling_logp.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(1)
    log_ratio = logp - sampling_logp
    keep = (log_ratio.detach().abs() <= settings.max_log_ratio) & (mask > 0)
    used = keep.to(logp.dtype)
    # exp() only of kept tokens: a masked token's ratio may be astronomically large.
    ratio = torch.exp(torch.where(keep, log_ratio, torch.zeros_like(log_ratio)))
    upper = settings.clip_eps if settings.clip_eps_high is None else settings.clip_eps_high
    low, high = 1.0 - settings.clip_eps, 1.0 + upper
    objective = torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv) * used
    if credit is not None:
        if credit.shape != logp.shape:
            raise ValueError(f"credit must be {tuple(logp.shape)}, got {tuple(credit.shape)}")
        objective = objective * credit.to(logp.dtype)

    kl = None
    if settings.beta > 0:
        assert ref_logp is not None
        delta = ref_logp.to(logp.dtype) - logp
        kl = (torch.exp(delta) - delta - 1.0) * mask
        objective = objective - settings.beta * kl

    if settings.aggregation == "token":
        denominator = float(mask.sum()) if normalizer is None else float(normalizer)
        loss = -objective.sum() / max(denominator, 1.0)
    else:
        lengths = mask.sum(dim=1).clamp(min=1.0)
        per_sequence = objective.sum(dim=1) / lengths
        denominator = float(logp.shape[0]) if normalizer is None else float(normalizer)
        loss = -per_sequence.sum() / max(denominator, 1.0)

    with torch.no_grad():
        clipped = ((ratio > high) & (adv > 0)) | ((ratio < low) & (adv < 0))
        stat_log_ratio = log_ratio.detach().clamp(-_STAT_LOG_RATIO_LIMIT, _STAT_LOG_RATIO_LIMIT)
        sampler_kl = (torch.exp(stat_log_ratio) - 1.0 - stat_log_ratio) * mask
        stats = LossStats(
            loss=float(loss.detach()),
            tokens=float(mask.sum()),
            sequences=float((mask.sum(dim=1) > 0).sum()),
            used_tokens=float(used.sum()),
            clipped_tokens=float((clipped & keep).sum()),
            masked_tokens=float(((mask > 0) & ~keep).sum()),
            kl_sum=float(kl.sum()) if kl is not None else 0.0,
            kl_tokens=float(mask.sum()) if kl is not None else 0.0,
            sampler_kl_sum=float(sampler_kl.sum()),
            ratio_sum=float((ratio.detach() * used).sum()),
        )
    return LossOutput(loss=loss, stats=stats)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature)[target] per position, computed in float32.

    Gathering the target logit and subtracting logsumexp avoids materialising a full
    [B, T, vocab] log-softmax a second time (vocabularies are ~150k wide).
    """
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def token_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs`, and the entropy of each position's distribution (no grad).

    The entropy comes from the logits already at hand: H = logsumexp(z) - sum softmax(z) z.
    """
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    normaliser = torch.logsumexp(scaled, dim=-1)
    with torch.no_grad():
        z = scaled.detach()
        lse = normaliser.detach()
        entropy = lse - (torch.exp(z - lse.unsqueeze(-1)) * z).sum(dim=-1)
    return picked - normaliser, entropy
