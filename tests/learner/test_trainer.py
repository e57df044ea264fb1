"""The torch backend on a real tiny Qwen2: learning, saving, resuming, batch preparation."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from hpcrl_learner.backends.torch import TorchTrainer
from hpcrl_learner.batches import BadBatch, TrainSequence, collate, micro_batches, prepare_group
from hpcrl_learner.config import LearnerSettings
from hpcrl_learner.grpo import LossStats, grpo_loss
from hpcrl_learner.state import LearnerState, StateStore

from .conftest import BAD, GOOD, PROMPT, good_bad_batch, rollout_batch, sequences_of


def total_logprob(trainer: TorchTrainer, ids) -> float:
    return float(trainer.logprobs(sequences_of([ids]))[0].sum())


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_rewards_move_log_probs_of_the_favoured_completion(tiny_model, lora):
    settings = LearnerSettings(
        model_path=tiny_model,
        learning_rate=2e-3 if not lora else 2e-2,
        lora={"enabled": lora, "r": 8, "alpha": 16},
    )
    trainer = TorchTrainer(settings, seed=1)
    good0, bad0 = total_logprob(trainer, GOOD), total_logprob(trainer, BAD)
    for step in range(4):
        lp = trainer.logprobs(sequences_of([GOOD, BAD]))
        batch = good_bad_batch(f"g{step}", {"good": lp[0], "bad": lp[1]})
        group = prepare_group(
            batch, 0, adv_eps=1e-4, vocab_size=trainer.vocab_size, max_sequence_tokens=64
        )
        metrics = trainer.step(group.sequences)
        assert np.isfinite(metrics.loss) and metrics.grad_norm > 0
        # on-policy sampling log-probs: the trainer agrees with the "sampler"
        assert metrics.sampler_kl < 1e-4 and metrics.masked_fraction == 0
    good1, bad1 = total_logprob(trainer, GOOD), total_logprob(trainer, BAD)
    assert good1 > good0 + 0.5, (good0, good1)
    assert bad1 < bad0 - 0.5, (bad0, bad1)


def test_sampler_kl_of_fresh_samples_is_measured_apart_from_stale_ones(tiny_model):
    trainer = TorchTrainer(LearnerSettings(model_path=tiny_model, learning_rate=0.0))
    own = trainer.logprobs(sequences_of([GOOD, BAD]))
    # Fresh: the trainer's own log-probs. Stale: another version's (shifted by 0.3 per token).
    fresh = [
        TrainSequence(np.array(PROMPT), np.array(ids), lp, adv)
        for ids, lp, adv in ((GOOD, own[0], 1.0), (BAD, own[1], -1.0))
    ]
    stale = [
        TrainSequence(np.array(PROMPT), np.array(ids), lp - 0.3, adv, fresh=False)
        for ids, lp, adv in ((GOOD, own[0], 1.0), (BAD, own[1], -1.0))
    ]
    metrics = trainer.step([stale[0], fresh[0], stale[1], fresh[1]])
    assert metrics.sampler_kl_fresh < 1e-6
    assert metrics.sampler_kl > 1e-2  # k3 of a 0.3 log-ratio is ~0.04, on half the tokens
    assert np.isnan(trainer.step(stale).sampler_kl_fresh)  # no fresh sample: no figure


def test_beta_controls_the_reference_model(tiny_model):
    no_ref = TorchTrainer(LearnerSettings(model_path=tiny_model, beta=0.0))
    assert no_ref.reference is None
    full_ref = TorchTrainer(LearnerSettings(model_path=tiny_model, beta=0.05, learning_rate=1e-2))
    assert full_ref.reference is not None
    seqs = [
        TrainSequence(
            np.array(PROMPT), np.array(GOOD), full_ref.logprobs(sequences_of([GOOD]))[0], 1.0
        ),
        TrainSequence(
            np.array(PROMPT), np.array(BAD), full_ref.logprobs(sequences_of([BAD]))[0], -1.0
        ),
    ]
    first = full_ref.step(seqs)
    assert first.kl == pytest.approx(0.0, abs=1e-6)  # policy == reference before any step
    second = full_ref.step(seqs)
    assert second.kl > 0  # and drifts from it after one


def test_saved_version_loads_alone_and_resume_restores_the_optimizer(tiny_model, tmp_path):
    settings = LearnerSettings(model_path=tiny_model, learning_rate=1e-3)
    trainer = TorchTrainer(settings)
    seqs = [
        TrainSequence(np.array(PROMPT), np.array(GOOD), np.full(5, -5.0, np.float32), 1.0),
        TrainSequence(np.array(PROMPT), np.array(BAD), np.full(4, -5.0, np.float32), -1.0),
    ]
    trainer.step(seqs)
    version = tmp_path / "v1"
    version.mkdir()
    trainer.save_version(version)
    assert (version / "model.safetensors").exists()
    assert (version / "tokenizer.json").exists()  # a generator can load it on its own
    state_store = StateStore(tmp_path)
    state_store.write(LearnerState(1, 1, ["a"]), trainer.save_optimizer)
    state, state_dir = state_store.load(1)
    reloaded = AutoModelForCausalLM.from_pretrained(str(version))
    for (name, a), b in zip(
        trainer.model.state_dict().items(), reloaded.state_dict().values(), strict=True
    ):
        assert torch.equal(a.cpu(), b), name
    resumed = TorchTrainer(settings, resume_from=version, optimizer_dir=state_dir)
    assert state.trained_ids == ["a"]
    moments = resumed.optimizer.state_dict()["state"]
    assert moments and int(moments[0]["step"]) == 1
    # the same next step from the original and the resumed trainer gives the same weights
    trainer.step(seqs)
    resumed.step(seqs)
    for a, b in zip(trainer.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_lora_version_is_an_adapter_of_the_base(tiny_model, tmp_path):
    trainer = TorchTrainer(LearnerSettings(model_path=tiny_model, lora={"enabled": True}))
    trainer.save_version(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model.resolve())
    assert (tmp_path / "adapter_model.safetensors").exists()
    assert trainer.format == "lora"


def test_collate_right_pads_to_a_multiple_of_64_and_lists_completion_targets():
    seqs = [
        TrainSequence(np.array([1, 2]), np.array([3]), np.array([-0.5], np.float32), 1.0),
        TrainSequence(np.array([4]), np.array([5, 6, 7]), np.array([-1, -2, -3], np.float32), -1.0),
    ]
    batch = collate(seqs)
    assert batch.input_ids.shape == (2, 64)
    assert batch.input_ids[:, :4].tolist() == [[1, 2, 3, 0], [4, 5, 6, 7]]
    assert not batch.input_ids[:, 4:].any()
    # the logits at position t predict token t + 1
    assert batch.rows.tolist() == [0, 1, 1, 1] and batch.cols.tolist() == [1, 0, 1, 2]
    assert batch.targets.tolist() == [3, 5, 6, 7] and batch.slots.tolist() == [0, 0, 1, 2]
    assert batch.completion_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert batch.sampling_logprobs.tolist() == [[-0.5, 0, 0], [-1, -2, -3]]
    assert batch.scatter(torch.tensor([1.0, 2, 3, 4])).tolist() == [[1, 0, 0], [2, 3, 4]]


def test_micro_batches_sort_by_length_within_a_token_budget():
    def seq(n: int) -> TrainSequence:
        return TrainSequence(np.arange(1, 2), np.arange(n), np.zeros(n, np.float32), 0.0)

    lengths = [100, 10, 300, 60, 200, 130]
    planned = micro_batches([seq(n - 1) for n in lengths], max_rows=3, max_tokens=512)
    # widths 64, 64 | 128, 192 (2 x 192 <= 512, 3 x 256 > 512) | 256 | 320
    assert [[s.length for s in mb] for mb in planned] == [[10, 60, 100], [130, 200], [300]]
    assert [len(mb) for mb in micro_batches([seq(9)] * 5, max_rows=2, max_tokens=0)] == [2, 2, 1]


@pytest.mark.parametrize("autocast", ["off", "bf16"])
def test_padding_and_batch_mates_do_not_change_log_probs(tiny_model, autocast):
    trainer = TorchTrainer(LearnerSettings(model_path=tiny_model, autocast=autocast))
    short = TrainSequence(np.array(PROMPT), np.array(BAD), np.zeros(4, np.float32), 0.0)
    long = TrainSequence(
        np.array([*PROMPT, 9, 9, 9] * 20), np.array(GOOD), np.zeros(5, np.float32), 0
    )
    alone = trainer.logprobs([short])[0]
    batch = collate([short, long])
    assert batch.input_ids.shape[1] == 192
    with torch.no_grad():
        together = trainer._forward_logprobs(trainer.model, batch)[0][0][:4]
    # bf16: the rows of a batch share matrix kernels whose blocking may differ with the width
    assert np.allclose(alone, together.cpu().numpy(), atol=1e-5 if autocast == "off" else 2e-2)


def test_bad_batches_are_refused():
    with pytest.raises(BadBatch, match="vocabulary"):
        prepare_group(
            rollout_batch("x", [[1, 300]], [1.0]),
            0,
            adv_eps=1e-4,
            vocab_size=256,
            max_sequence_tokens=64,
        )
    with pytest.raises(BadBatch, match="max_sequence_tokens"):
        prepare_group(
            rollout_batch("x", [[1] * 70], [1.0]),
            0,
            adv_eps=1e-4,
            vocab_size=256,
            max_sequence_tokens=64,
        )
    with pytest.raises(BadBatch, match="empty prompt"):
        prepare_group(
            rollout_batch("x", [[1]], [1.0], prompt=[]),
            0,
            adv_eps=1e-4,
            vocab_size=256,
            max_sequence_tokens=64,
        )
    group = prepare_group(
        rollout_batch("x", [[1], [2]], [3.0, 1.0], policy_version=[2, 5]),
        6,
        adv_eps=0.0,
        vocab_size=256,
        max_sequence_tokens=64,
    )
    assert group.staleness == 4 and group.advantages == [1.0, -1.0]


def test_negative_advantages_are_scaled_into_the_sequences():
    group = prepare_group(
        rollout_batch("x", [[1], [2], [3]], [100.0, 50.0, -40.0]),
        0,
        adv_eps=0.0,
        negative_advantage_scale=0.25,
        vocab_size=256,
        max_sequence_tokens=64,
    )
    plain = prepare_group(
        rollout_batch("x", [[1], [2], [3]], [100.0, 50.0, -40.0]),
        0,
        adv_eps=0.0,
        vocab_size=256,
        max_sequence_tokens=64,
    )
    assert group.advantages[:2] == plain.advantages[:2] and plain.advantages[0] > 0
    assert group.advantages[2] == pytest.approx(0.25 * plain.advantages[2])
    assert [s.advantage for s in group.sequences] == group.advantages


def test_lora_resume_restores_adapter_and_optimizer(tiny_model, tmp_path):
    settings = LearnerSettings(model_path=tiny_model, learning_rate=1e-2, lora={"enabled": True})
    trainer = TorchTrainer(settings)
    seqs = [
        TrainSequence(np.array(PROMPT), np.array(GOOD), np.full(5, -5.0, np.float32), 1.0),
        TrainSequence(np.array(PROMPT), np.array(BAD), np.full(4, -5.0, np.float32), -1.0),
    ]
    trainer.step(seqs)
    (tmp_path / "v1").mkdir()
    trainer.save_version(tmp_path / "v1")
    trainer.save_optimizer(tmp_path)
    resumed = TorchTrainer(settings, resume_from=tmp_path / "v1", optimizer_dir=tmp_path)
    assert len(resumed.params) == len(trainer.params)
    for a, b in zip(trainer.params, resumed.params, strict=True):
        assert torch.equal(a.detach(), b.detach())
    assert any(p.abs().sum() > 0 for p in resumed.params)  # lora_B moved off its zero init
    assert int(resumed.optimizer.state_dict()["state"][0]["step"]) == 1


def test_non_finite_gradient_skips_the_update(tiny_model):
    trainer = TorchTrainer(LearnerSettings(model_path=tiny_model, learning_rate=1e-2))
    with torch.no_grad():
        trainer.model.get_output_embeddings().weight[GOOD[0], 0] = float("nan")
    before = trainer.model.get_input_embeddings().weight.detach().clone()
    seqs = [
        TrainSequence(np.array(PROMPT), np.array(GOOD), np.full(5, -5.0, np.float32), 1.0),
        TrainSequence(np.array(PROMPT), np.array(BAD), np.full(4, -5.0, np.float32), -1.0),
    ]
    metrics = trainer.step(seqs)
    assert metrics.skipped and metrics.grad_norm == -1.0
    assert torch.equal(trainer.model.get_input_embeddings().weight, before)
    assert not trainer.optimizer.state_dict()["state"]  # AdamW moments untouched


def test_a_group_is_fresh_only_when_sampled_by_the_current_version():
    def sequences(sampled_by: int, current: int) -> list[TrainSequence]:
        batch = good_bad_batch("g", policy_version=sampled_by)
        return prepare_group(
            batch, current, adv_eps=1e-4, vocab_size=10_000, max_sequence_tokens=64
        ).sequences

    assert all(s.fresh for s in sequences(3, 3))
    assert not any(s.fresh for s in sequences(2, 3))


def demo_sized_step(vocab_size: int, seed: int = 0) -> list[list[TrainSequence]]:
    """Four groups of eight completions of 3 to 60 tokens (the demo's step), the last two
    groups sampled by an older version, with sampling log-probs off the trainer's."""
    rng = np.random.default_rng(seed)
    groups = []
    for group_index in range(4):
        group = []
        for _ in range(8):
            ids = rng.integers(3, vocab_size, size=int(rng.integers(3, 61)))
            group.append(
                TrainSequence(
                    np.array(PROMPT),
                    ids,
                    rng.normal(-3.0, 0.5, len(ids)).astype(np.float32),
                    float(rng.normal()),
                    fresh=group_index < 2,
                )
            )
        groups.append(group)
    return groups


def trained_params(trainer: TorchTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.params]


def assert_same_update(
    a: TorchTrainer,
    b: TorchTrainer,
    a_metrics: dict,
    b_metrics: dict,
) -> None:
    # AdamW's first update is about lr * sign(gradient): float rounding flips elements whose
    # gradient is ~0, so parameters agree to 1% of lr; the gradient's scale (which AdamW
    # hides) is checked through its norm.
    for x, y in zip(trained_params(a), trained_params(b), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=a.settings.learning_rate * 1e-2)
    for key in (
        "loss",
        "tokens",
        "sequences",
        "kl",
        "sampler_kl",
        "clip_fraction",
        "sampler_kl_fresh",
        "grad_norm",
        "entropy",
    ):
        assert getattr(b_metrics, key) == pytest.approx(
            getattr(a_metrics, key), rel=1e-4, nan_ok=True
        ), key


def stepped_at_once(tiny_model, data_seed: int, **changes):
    """Two identical trainers, a demo-sized step's groups (and all their sequences), and the
    first trainer's step over them all at once: the update the second must match."""
    # float32 (autocast off): the check is of the bookkeeping, to float rounding; bf16 is
    # compared with float32 in test_bf16_autocast_gives_the_float32_gradient.
    settings = LearnerSettings(
        model_path=tiny_model, learning_rate=1e-3, micro_batch_size=4, autocast="off", **changes
    )
    at_once, early = TorchTrainer(settings, seed=3), TorchTrainer(settings, seed=3)
    groups = demo_sized_step(at_once.vocab_size, seed=data_seed)
    every = [s for group in groups for s in group]
    return at_once, early, groups, every, at_once.step(every)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_groups_trained_as_they_arrive_make_the_same_update(tiny_model, aggregation):
    at_once, early, groups, every, expected = stepped_at_once(
        tiny_model, 0, beta=0.01, aggregation=aggregation, groups_per_step=4
    )
    for group in groups[:3]:
        early.accumulate(group)
    got = early.step(every)
    assert_same_update(at_once, early, expected, got)
    untrained = trained_params(TorchTrainer(early.settings, seed=3))
    assert any(not torch.equal(x, y) for x, y in zip(untrained, trained_params(early), strict=True))
    assert got.early_seconds > 0 and expected.early_seconds == 0


def test_a_gradient_accumulated_for_groups_handed_back_does_not_count_twice(tiny_model):
    at_once, early, groups, every, expected = stepped_at_once(tiny_model, 1)
    early.accumulate(groups[0])
    early.accumulate(groups[1])
    # The step was handed back; its groups come again, as new sequences.
    redelivered = [dataclasses.replace(s) for s in every]
    assert_same_update(at_once, early, expected, early.step(redelivered))


def test_a_failed_accumulation_forgets_the_partial_gradient(tiny_model):
    at_once, early, groups, every, expected = stepped_at_once(tiny_model, 2)
    early.accumulate(groups[0])
    # Two micro-batches (by length): the first's backward runs, the second has token ids
    # out of range.
    too_long = np.full(70, 10**6)
    broken = groups[1][:4] + [
        dataclasses.replace(s, completion_ids=too_long, sampling_logprobs=np.zeros(70, np.float32))
        for s in groups[1][4:]
    ]
    with pytest.raises(IndexError):
        early.accumulate(broken)
    early.accumulate(groups[2])
    assert_same_update(at_once, early, expected, early.step(every))


def unpadded_gradient(
    trainer: TorchTrainer, sequences: list[TrainSequence]
) -> tuple[torch.Tensor, float]:
    """The step's gradient (flattened) and loss, each sequence alone in float32, with no
    padding and the whole output layer (``model(...)``): the textbook computation."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    settings = trainer.loss_settings
    normalizer = float(sum(len(s.completion_ids) for s in sequences))
    loss_sum = 0.0
    for seq in sequences:
        ids = torch.from_numpy(np.concatenate([seq.prompt_ids, seq.completion_ids]))[None]
        p, c = len(seq.prompt_ids), len(seq.completion_ids)
        logits = model(input_ids=ids, use_cache=False).logits[:, p - 1 : p - 1 + c]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, p:, None]).squeeze(-1)
        ref = None
        if settings.beta > 0:
            with torch.no_grad():
                ref_logits = trainer.reference(input_ids=ids, use_cache=False).logits
                ref = (
                    torch.log_softmax(ref_logits[:, p - 1 : p - 1 + c].float(), -1)
                    .gather(-1, ids[:, p:, None])
                    .squeeze(-1)
                )
        out = grpo_loss(
            logp,
            torch.from_numpy(seq.sampling_logprobs)[None],
            torch.tensor([seq.advantage]),
            torch.ones(1, c),
            settings,
            ref_logp=ref,
            normalizer=normalizer,
        )
        out.loss.backward()
        loss_sum += float(out.loss.detach())
    grad = torch.cat([p.grad.flatten() for p in trainer.params])
    model.zero_grad(set_to_none=True)
    return grad, loss_sum


def trainer_gradient(
    trainer: TorchTrainer, sequences: list[TrainSequence]
) -> tuple[torch.Tensor, float]:
    trainer.optimizer.zero_grad(set_to_none=True)
    stats = LossStats()
    trainer._backward(
        sequences, float(sum(len(s.completion_ids) for s in sequences)), stats, LossStats()
    )
    grad = torch.cat([p.grad.flatten() for p in trainer.params])
    trainer.optimizer.zero_grad(set_to_none=True)
    return grad, stats.loss


def test_bf16_autocast_gives_the_float32_gradient(tiny_model):
    """Right padding to a multiple of 64, token-budget micro-batches, logits of completion
    tokens only, cached reference log-probs: float32 gives the textbook gradient to float
    rounding; bf16 autocast gives it to bf16 rounding.

    bf16 keeps 8 significant bits (relative rounding 2**-9 = 0.2 % per operation). Through
    the layers of the forward and backward passes these errors add up to a few tenths of a
    percent of the gradient's scale per element, random in sign: the gradient's direction
    (cosine >= 0.999) and norm (1 %) hold, while elements near zero may differ entirely, so
    no element-wise bound is meaningful. The loss and the per-token log-probs it comes from
    are compared to 1 %.
    """
    groups = demo_sized_step(vocab_size=384, seed=5)
    seqs = [s for group in groups for s in group]
    rows = {}
    for autocast in ("off", "bf16"):
        trainer = TorchTrainer(
            LearnerSettings(
                model_path=tiny_model,
                beta=0.05,
                micro_batch_size=5,
                micro_batch_tokens=256,
                autocast=autocast,
            ),
            seed=3,
        )
        rows[autocast] = trainer_gradient(trainer, seqs)
    want, want_loss = unpadded_gradient(trainer, seqs)  # the last trainer: same weights
    got, loss = rows["off"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))
    assert loss == pytest.approx(want_loss, rel=1e-4)
    got, loss = rows["bf16"]
    cosine = float(torch.nn.functional.cosine_similarity(got, want, dim=0))
    assert cosine >= 0.999, cosine
    assert float(got.norm()) == pytest.approx(float(want.norm()), rel=1e-2)
    assert loss == pytest.approx(want_loss, rel=1e-2)


def test_reference_log_probs_are_computed_once_per_sequence(tiny_model):
    trainer = TorchTrainer(LearnerSettings(model_path=tiny_model, beta=0.05, learning_rate=0.0))
    seqs = [s for group in demo_sized_step(trainer.vocab_size, seed=7)[:2] for s in group]
    calls = []
    forward = trainer.reference.forward
    trainer.reference.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    trainer.reference.get_decoder().register_forward_hook(lambda *a: calls.append(1))
    first = trainer.step(seqs)
    computed = len(calls)
    assert computed > 0
    # The same groups again, as new sequences (a step handed back, redelivered)
    second = trainer.step([dataclasses.replace(s) for s in seqs])
    assert len(calls) == computed
    assert second.kl == pytest.approx(first.kl, abs=1e-7)


def groups_with_long_prompts(vocab_size: int, seed: int = 0) -> list[TrainSequence]:
    """Three groups, each its own prompt of 700-760 tokens (the demo's prompts: far beyond
    one padding multiple), six completions of 5-150 tokens; one group sampled earlier."""
    rng = np.random.default_rng(seed)
    sequences = []
    for group_index in range(3):
        prompt = rng.integers(3, vocab_size, size=int(rng.integers(700, 761)))
        for _ in range(6):
            ids = rng.integers(3, vocab_size, size=int(rng.integers(5, 151)))
            sequences.append(
                TrainSequence(
                    prompt,
                    ids,
                    rng.normal(-3.0, 0.5, len(ids)).astype(np.float32),
                    float(rng.normal()),
                    fresh=group_index != 1,
                )
            )
    return sequences


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_shared_prompt_runs_once_and_gives_the_unshared_gradient(tiny_model, lora):
    seqs = groups_with_long_prompts(vocab_size=384)
    rows, fed = {}, {}
    for share in (False, True):
        # micro-batches of 4: each group's completions span two, whose gradients reach the
        # prompt through the same cached keys and values.
        settings = LearnerSettings(
            model_path=tiny_model,
            beta=0.05,
            micro_batch_size=4,
            autocast="off",
            share_prompt_forward=share,
            lora={"enabled": lora},
        )
        trainer = TorchTrainer(settings, seed=3)
        decoder = trainer.model.get_decoder()
        tokens: list[int] = []
        forward = decoder.forward
        decoder.forward = lambda *a, _f=forward, _fed=tokens, **k: (
            _fed.append(k["input_ids"].numel()) or _f(*a, **k)
        )
        rows[share] = trainer_gradient(trainer, seqs)
        fed[share] = sum(tokens)
    got, loss = rows[True]
    want, want_loss = rows[False]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    assert loss == pytest.approx(want_loss, rel=1e-4)
    # Policy and reference each ran every prompt once instead of once per completion (and
    # padding): less than half the tokens.
    assert fed[True] < 0.5 * fed[False], fed


def test_threads_sets_torchs_intra_op_threads_and_zero_leaves_the_default(tiny_model):
    before = torch.get_num_threads()
    try:
        TorchTrainer(LearnerSettings(model_path=tiny_model, threads=1))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(before)
        TorchTrainer(LearnerSettings(model_path=tiny_model))
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)
