"""GRPO maths with hand-computed numbers for every branch."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hpcrl_learner.grpo import (
    LossSettings,
    LossStats,
    group_advantages,
    grpo_loss,
    token_logprobs,
    weight_negative_advantages,
)

# --- advantages -----------------------------------------------------------------------------


def test_advantages_by_hand():
    # mean 2, population std sqrt(2/3) = 0.81650
    a = group_advantages([1.0, 2.0, 3.0], eps=0.0)
    assert a.tolist() == pytest.approx([-1.2247449, 0.0, 1.2247449], abs=1e-6)


def test_eps_enters_the_denominator():
    # rewards 0, 2: mean 1, std 1; eps = 1 halves the advantages
    assert group_advantages([0.0, 2.0], eps=1.0).tolist() == pytest.approx([-0.5, 0.5])
    assert group_advantages([0.0, 2.0], eps=0.0).tolist() == pytest.approx([-1.0, 1.0])


def test_degenerate_groups_get_zero_advantage():
    assert group_advantages([-40.0, -40.0, -40.0]).tolist() == [0.0, 0.0, 0.0]
    assert group_advantages([7.5]).tolist() == [0.0]
    # all equal with eps = 0 must not divide 0 by 0
    assert group_advantages([3.0, 3.0], eps=0.0).tolist() == [0.0, 0.0]


def test_unscaled_advantages_are_centred_rewards():
    # Dr. GRPO: no division by the group's std, so a group of near-equal rewards stays small
    assert group_advantages([1.0, 2.0, 3.0], scale=False).tolist() == [-1.0, 0.0, 1.0]
    assert group_advantages([5.0, 5.0, 5.0], scale=False).tolist() == [0.0, 0.0, 0.0]
    close = group_advantages([1.0, 1.001], scale=False).tolist()
    assert close == pytest.approx([-0.0005, 0.0005])
    assert group_advantages([1.0, 1.001], eps=0.0).tolist() == pytest.approx([-1.0, 1.0])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_rewards_are_rejected(bad):
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, bad, 2.0])


def test_empty_group_and_bad_eps_are_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        group_advantages([])
    with pytest.raises(ValueError, match="eps"):
        group_advantages([1.0, 2.0], eps=-1.0)


# --- the clipped objective ------------------------------------------------------------------


def one_token(ratio: float, advantage: float, settings: LossSettings):
    """Loss and d loss / d logp for a single completion token with the given ratio."""
    logp = torch.tensor(
        [[math.log(ratio) + math.log(0.25)]], dtype=torch.float64, requires_grad=True
    )
    sampling = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    out = grpo_loss(logp, sampling, torch.tensor([advantage]), torch.ones(1, 1), settings)
    out.loss.backward()
    return float(out.loss.detach()), float(logp.grad[0, 0]), out.stats


@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "grad", "clipped"),
    [
        # A > 0, rho above 1 + delta: min(1.5, 1.2) = 1.2, clipped, no gradient
        (1.5, 1.0, -1.2, 0.0, 1),
        # A > 0, rho below 1 - delta: min(0.5, 0.8) = 0.5, unclipped: d(-rho A)/dlogp = -rho
        (0.5, 1.0, -0.5, -0.5, 0),
        # A < 0, rho above 1 + delta: min(-1.5, -1.2) = -1.5, unclipped, gradient rho |A|
        (1.5, -1.0, 1.5, 1.5, 0),
        # A < 0, rho below 1 - delta: min(-0.5, -0.8) = -0.8, clipped, no gradient
        (0.5, -1.0, 0.8, 0.0, 1),
        # inside the trust region: plain rho A
        (1.1, 2.0, -2.2, -2.2, 0),
    ],
)
def test_clipping_on_both_sides(ratio, advantage, loss, grad, clipped):
    got_loss, got_grad, stats = one_token(ratio, advantage, LossSettings(clip_eps=0.2))
    assert got_loss == pytest.approx(loss)
    assert got_grad == pytest.approx(grad)
    assert stats.clipped_tokens == clipped and stats.masked_tokens == 0


def test_clip_higher_raises_only_the_upper_bound():
    wider = LossSettings(clip_eps=0.2, clip_eps_high=0.28)
    # A > 0 at rho 1.25: inside [0.8, 1.28], so it still learns (clipped at 1.2 by default)
    loss, grad, stats = one_token(1.25, 1.0, wider)
    assert (loss, grad, stats.clipped_tokens) == (pytest.approx(-1.25), pytest.approx(-1.25), 0)
    assert one_token(1.25, 1.0, LossSettings(clip_eps=0.2))[2].clipped_tokens == 1
    # the lower bound is unchanged: A < 0 at rho 0.75 is clipped at 0.8
    loss, grad, stats = one_token(0.75, -1.0, wider)
    assert (loss, grad, stats.clipped_tokens) == (pytest.approx(0.8), 0.0, 1)
    with pytest.raises(ValueError, match="clip_eps_high"):
        LossSettings(clip_eps_high=1.5)


def test_beta_zero_needs_no_reference_and_beta_positive_adds_k3():
    logp = torch.tensor([[0.0 + math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    sampling = logp.detach().clone()
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 1)
    plain = grpo_loss(logp, sampling, adv, mask, LossSettings(beta=0.0))
    assert float(plain.loss.detach()) == pytest.approx(-1.0) and plain.stats.kl_sum == 0.0
    # ref prob twice the policy's: d = log 2, k3 = e^d - d - 1 = 2 - ln 2 - 1 = 0.306853
    ref = logp.detach() + math.log(2.0)
    with_kl = grpo_loss(logp, sampling, adv, mask, LossSettings(beta=0.1), ref_logp=ref)
    k3 = 2.0 - math.log(2.0) - 1.0
    assert with_kl.stats.kl_sum == pytest.approx(k3)
    assert float(with_kl.loss.detach()) == pytest.approx(-1.0 + 0.1 * k3)
    with_kl.loss.backward()
    # d/dlogp [-(rho A) + beta (e^(ref-logp) - (ref-logp) - 1)] = -1 + beta (1 - 2) = -1.1
    assert float(logp.grad[0, 0]) == pytest.approx(-1.1)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, sampling, adv, mask, LossSettings(beta=0.1))


def test_padding_is_masked_and_aggregation_is_a_choice():
    # sequence 0: two tokens at ratio 1 with A = 1; sequence 1: one token, A = -1, then padding
    logp = torch.zeros(2, 2, dtype=torch.float64) + math.log(0.5)
    sampling = logp.clone()
    sampling[1, 1] = 123.0  # garbage under the mask must not matter
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    token = grpo_loss(logp, sampling, adv, mask, LossSettings(aggregation="token"))
    # token mean: -(1 + 1 - 1) / 3
    assert float(token.loss.detach()) == pytest.approx(-1.0 / 3.0)
    sequence = grpo_loss(logp, sampling, adv, mask, LossSettings(aggregation="sequence"))
    # per-sequence means 1 and -1, averaged: 0
    assert float(sequence.loss.detach()) == pytest.approx(0.0)
    assert token.stats.tokens == 3 and token.stats.masked_tokens == 0


def test_normalizer_makes_micro_batches_add_up():
    torch.manual_seed(0)
    logp = torch.randn(4, 5, dtype=torch.float64) * 0.1 - 1.0
    sampling = logp + torch.randn(4, 5, dtype=torch.float64) * 0.1
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    adv = torch.tensor([1.0, -0.5, 0.3, -0.8])
    for aggregation, norm in (("token", float(mask.sum())), ("sequence", 4.0)):
        settings = LossSettings(aggregation=aggregation)
        whole = grpo_loss(logp, sampling, adv, mask, settings)
        halves = [
            grpo_loss(logp[s], sampling[s], adv[s], mask[s], settings, normalizer=norm)
            for s in (slice(0, 2), slice(2, 4))
        ]
        summed = float((halves[0].loss + halves[1].loss).detach())
        assert summed == pytest.approx(float(whole.loss.detach()))
        stats = LossStats().add(halves[0].stats).add(halves[1].stats)
        assert stats.tokens == whole.stats.tokens


def test_huge_sampler_mismatch_is_masked_not_exploded():
    # token 0 agrees with the sampler; token 1's log-ratio is 1000 (a broken or stale sample)
    logp = torch.tensor([[math.log(0.5), math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    sampling = torch.tensor([[math.log(0.5), math.log(0.5) - 1000.0]], dtype=torch.float64)
    out = grpo_loss(
        logp, sampling, torch.tensor([-1.0]), torch.ones(1, 2), LossSettings(max_log_ratio=2.0)
    )
    out.loss.backward()
    # only token 0 counts: -(1 * -1) / 2 tokens
    assert float(out.loss.detach()) == pytest.approx(0.5)
    assert logp.grad.tolist() == [[pytest.approx(0.5), 0.0]]
    assert out.stats.masked_tokens == 1 and out.stats.used_tokens == 1
    assert math.isfinite(out.stats.sampler_kl_sum) and out.stats.sampler_kl_sum > 1.0


def test_settings_are_validated():
    with pytest.raises(ValueError, match="clip_eps"):
        LossSettings(clip_eps=0.0)
    with pytest.raises(ValueError, match="beta"):
        LossSettings(beta=-0.1)
    with pytest.raises(ValueError, match="aggregation"):
        LossSettings(aggregation="mean")  # type: ignore[arg-type]


def test_gradient_step_moves_probability_towards_the_better_completion():
    """Toy policy: one softmax over 3 tokens; token 0 earned reward 1, token 1 reward 0."""
    logits = torch.zeros(3, requires_grad=True)
    optimizer = torch.optim.SGD([logits], lr=0.5)
    samples = torch.tensor([0, 1, 0, 1])
    rewards = [1.0, 0.0, 1.0, 0.0]
    adv = group_advantages(rewards).float()
    before = torch.log_softmax(logits.detach(), -1)
    for _ in range(3):
        logp = torch.log_softmax(logits, -1)[samples].unsqueeze(1)
        out = grpo_loss(logp, logp.detach(), adv, torch.ones(4, 1), LossSettings())
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    after = torch.log_softmax(logits.detach(), -1)
    assert after[0] > before[0] + 0.1
    assert after[1] < before[1] - 0.1


def test_token_logprobs_match_log_softmax():
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 7)
    targets = torch.randint(0, 7, (2, 3))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, targets, temperature=0.7), expected, atol=1e-6)


def test_rewards_too_large_to_normalise_are_refused_not_turned_into_nan():
    with pytest.raises(ValueError, match="too large to normalise"):
        group_advantages([1e308, 1e308, -1e308], eps=1e-4)


@given(
    st.lists(st.floats(-100, 1000, allow_nan=False), min_size=2, max_size=16),
    st.floats(0.01, 1.0),
)
def test_negative_weighting_keeps_the_order_and_the_positives(rewards, scale):
    plain = group_advantages(rewards).tolist()
    weighted = weight_negative_advantages(plain, scale)
    for before, after in zip(plain, weighted, strict=True):
        assert after == (before if before >= 0 else pytest.approx(before * scale))
    # every failure still ranks below every success: the order of the group is kept
    order = sorted(range(len(plain)), key=plain.__getitem__)
    assert all(weighted[i] <= weighted[j] for i, j in itertools.pairwise(order))


@pytest.mark.parametrize("scale", [0.0, -0.5, 1.5, math.nan])
def test_negative_weighting_refuses_scales_outside_0_1(scale):
    with pytest.raises(ValueError, match="scale"):
        weight_negative_advantages([1.0, -1.0], scale)
