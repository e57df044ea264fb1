"""The torch backend on a real tiny Qwen2: learning, saving, resuming, batch preparation."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from hpcrl_learner.backends.torch import TorchTrainer
from hpcrl_learner.batches import BadBatch, TrainSequence, collate, prepare_group
from hpcrl_learner.config import LearnerSettings
from hpcrl_learner.state import LearnerState, StateStore

from .conftest import BAD, GOOD, PROMPT, good_bad_batch, rollout_batch, sequences_of


def total_logprob(trainer: TorchTrainer, ids) -> float:
    return float(trainer.logprobs(sequences_of([ids]))[0].sum())


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_rewards_move_log_probs_of_the_favoured_completion(tiny_model, lora):
    settings = LearnerSettings(model_path=tiny_model, learning_rate=2e-3 if not lora else 2e-2,
                               lora={"enabled": lora, "r": 8, "alpha": 16})
    trainer = TorchTrainer(settings, seed=1)
    good0, bad0 = total_logprob(trainer, GOOD), total_logprob(trainer, BAD)
    for step in range(4):
        lp = trainer.logprobs(sequences_of([GOOD, BAD]))
        batch = good_bad_batch(f"g{step}", {"good": lp[0], "bad": lp[1]})
        group = prepare_group(batch, 0, adv_eps=1e-4, vocab_size=trainer.vocab_size,
                              max_sequence_tokens=64)
        metrics = trainer.step(group.sequences)
        assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        # on-policy sampling log-probs: the trainer agrees with the "sampler"
        assert metrics["sampler_kl"] < 1e-4 and metrics["masked_fraction"] == 0
    good1, bad1 = total_logprob(trainer, GOOD), total_logprob(trainer, BAD)
    assert good1 > good0 + 0.5, (good0, good1)
    assert bad1 < bad0 - 0.5, (bad0, bad1)


def test_sampler_kl_of_fresh_samples_is_measured_apart_from_stale_ones(tiny_model):
    trainer = TorchTrainer(LearnerSettings(model_path=tiny_model, learning_rate=0.0))
    own = trainer.logprobs(sequences_of([GOOD, BAD]))
    # Fresh: the trainer's own log-probs. Stale: another version's (shifted by 0.3 per token).
    fresh = [TrainSequence(np.array(PROMPT), np.array(ids), lp, adv)
             for ids, lp, adv in ((GOOD, own[0], 1.0), (BAD, own[1], -1.0))]
    stale = [TrainSequence(np.array(PROMPT), np.array(ids), lp - 0.3, adv, fresh=False)
             for ids, lp, adv in ((GOOD, own[0], 1.0), (BAD, own[1], -1.0))]
    metrics = trainer.step([stale[0], fresh[0], stale[1], fresh[1]])
    assert metrics["sampler_kl_fresh"] < 1e-6
    assert metrics["sampler_kl"] > 1e-2  # k3 of a 0.3 log-ratio is ~0.04, on half the tokens
    assert np.isnan(trainer.step(stale)["sampler_kl_fresh"])  # no fresh sample: no figure


def test_beta_controls_the_reference_model(tiny_model):
    no_ref = TorchTrainer(LearnerSettings(model_path=tiny_model, beta=0.0))
    assert no_ref.reference is None
    full_ref = TorchTrainer(LearnerSettings(model_path=tiny_model, beta=0.05, learning_rate=1e-2))
    assert full_ref.reference is not None
    seqs = [TrainSequence(np.array(PROMPT), np.array(GOOD),
                          full_ref.logprobs(sequences_of([GOOD]))[0], 1.0),
            TrainSequence(np.array(PROMPT), np.array(BAD),
                          full_ref.logprobs(sequences_of([BAD]))[0], -1.0)]
    first = full_ref.step(seqs)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any step
    second = full_ref.step(seqs)
    assert second["kl"] > 0  # and drifts from it after one


def test_saved_version_loads_alone_and_resume_restores_the_optimizer(tiny_model, tmp_path):
    settings = LearnerSettings(model_path=tiny_model, learning_rate=1e-3)
    trainer = TorchTrainer(settings)
    seqs = [TrainSequence(np.array(PROMPT), np.array(GOOD), np.full(5, -5.0, np.float32), 1.0),
            TrainSequence(np.array(PROMPT), np.array(BAD), np.full(4, -5.0, np.float32), -1.0)]
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
    for (name, a), b in zip(trainer.model.state_dict().items(),
                            reloaded.state_dict().values(), strict=True):
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


def test_collate_right_aligns_completions():
    seqs = [TrainSequence(np.array([1, 2]), np.array([3]), np.array([-0.5], np.float32), 1.0),
            TrainSequence(np.array([4]), np.array([5, 6, 7]), np.array([-1, -2, -3], np.float32),
                          -1.0)]
    batch = collate(seqs)
    assert batch.input_ids.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert batch.attention_mask.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 0, 1, 2], [0, 1, 2, 3]]
    assert batch.targets.tolist() == [[1, 2, 3], [5, 6, 7]]
    assert batch.completion_mask.tolist() == [[0, 0, 1], [1, 1, 1]]
    assert batch.sampling_logprobs.tolist() == [[0, 0, -0.5], [-1, -2, -3]]


def test_left_padding_does_not_change_log_probs(tiny_model):
    trainer = TorchTrainer(LearnerSettings(model_path=tiny_model))
    short = TrainSequence(np.array(PROMPT), np.array(BAD), np.zeros(4, np.float32), 0.0)
    long = TrainSequence(np.array([*PROMPT, 9, 9, 9]), np.array(GOOD), np.zeros(5, np.float32), 0)
    alone = trainer.logprobs([short])[0]
    batch = collate([short, long])
    with torch.no_grad():
        together = trainer._forward_logprobs(trainer.model, batch)[0][-4:]
    assert np.allclose(alone, together.cpu().numpy(), atol=1e-5)


def test_bad_batches_are_refused():
    with pytest.raises(BadBatch, match="vocabulary"):
        prepare_group(rollout_batch("x", [[1, 300]], [1.0]), 0, adv_eps=1e-4, vocab_size=256,
                      max_sequence_tokens=64)
    with pytest.raises(BadBatch, match="max_sequence_tokens"):
        prepare_group(rollout_batch("x", [[1] * 70], [1.0]), 0, adv_eps=1e-4, vocab_size=256,
                      max_sequence_tokens=64)
    with pytest.raises(BadBatch, match="empty prompt"):
        prepare_group(rollout_batch("x", [[1]], [1.0], prompt=[]), 0, adv_eps=1e-4,
                      vocab_size=256, max_sequence_tokens=64)
    group = prepare_group(rollout_batch("x", [[1], [2]], [3.0, 1.0], policy_version=[2, 5]), 6,
                          adv_eps=0.0, vocab_size=256, max_sequence_tokens=64)
    assert group.staleness == 4 and group.advantages == [1.0, -1.0]


def test_lora_resume_restores_adapter_and_optimizer(tiny_model, tmp_path):
    settings = LearnerSettings(model_path=tiny_model, learning_rate=1e-2, lora={"enabled": True})
    trainer = TorchTrainer(settings)
    seqs = [TrainSequence(np.array(PROMPT), np.array(GOOD), np.full(5, -5.0, np.float32), 1.0),
            TrainSequence(np.array(PROMPT), np.array(BAD), np.full(4, -5.0, np.float32), -1.0)]
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
    seqs = [TrainSequence(np.array(PROMPT), np.array(GOOD), np.full(5, -5.0, np.float32), 1.0),
            TrainSequence(np.array(PROMPT), np.array(BAD), np.full(4, -5.0, np.float32), -1.0)]
    metrics = trainer.step(seqs)
    assert metrics["skipped"] == 1.0 and metrics["grad_norm"] == -1.0
    assert torch.equal(trainer.model.get_input_embeddings().weight, before)
    assert not trainer.optimizer.state_dict()["state"]  # AdamW moments untouched


def test_a_group_is_fresh_only_when_sampled_by_the_current_version():
    def sequences(sampled_by: int, current: int) -> list[TrainSequence]:
        batch = good_bad_batch("g", policy_version=sampled_by)
        return prepare_group(batch, current, adv_eps=1e-4, vocab_size=10_000,
                             max_sequence_tokens=64).sequences

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
            group.append(TrainSequence(
                np.array(PROMPT), ids, rng.normal(-3.0, 0.5, len(ids)).astype(np.float32),
                float(rng.normal()), fresh=group_index < 2))
        groups.append(group)
    return groups


def trained_params(trainer: TorchTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.params]


def assert_same_update(a: TorchTrainer, b: TorchTrainer, a_metrics: dict, b_metrics: dict,
                       ) -> None:
    # AdamW's first update is about lr * sign(gradient): float rounding flips elements whose
    # gradient is ~0, so parameters agree to 1% of lr; the gradient's scale (which AdamW
    # hides) is checked through its norm.
    for x, y in zip(trained_params(a), trained_params(b), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=a.settings.learning_rate * 1e-2)
    for key in ("loss", "tokens", "sequences", "kl", "sampler_kl", "clip_fraction",
                "sampler_kl_fresh", "grad_norm"):
        assert b_metrics[key] == pytest.approx(a_metrics[key], rel=1e-4), key


def stepped_at_once(tiny_model, data_seed: int, **changes):
    """Two identical trainers, a demo-sized step's groups (and all their sequences), and the
    first trainer's step over them all at once: the update the second must match."""
    settings = LearnerSettings(model_path=tiny_model, learning_rate=1e-3, micro_batch_size=4,
                               **changes)
    at_once, early = TorchTrainer(settings, seed=3), TorchTrainer(settings, seed=3)
    groups = demo_sized_step(at_once.vocab_size, seed=data_seed)
    every = [s for group in groups for s in group]
    return at_once, early, groups, every, at_once.step(every)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_groups_trained_as_they_arrive_make_the_same_update(tiny_model, aggregation):
    at_once, early, groups, every, expected = stepped_at_once(
        tiny_model, 0, beta=0.01, aggregation=aggregation, groups_per_step=4)
    for group in groups[:3]:
        early.accumulate(group)
    got = early.step(every)
    assert_same_update(at_once, early, expected, got)
    untrained = trained_params(TorchTrainer(early.settings, seed=3))
    assert any(not torch.equal(x, y) for x, y in zip(untrained, trained_params(early), strict=True))
    assert got["early_seconds"] > 0 and expected["early_seconds"] == 0


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
    broken = groups[1][:4] + [dataclasses.replace(s, completion_ids=too_long,
                                                  sampling_logprobs=np.zeros(70, np.float32))
                              for s in groups[1][4:]]
    with pytest.raises(IndexError):
        early.accumulate(broken)
    early.accumulate(groups[2])
    assert_same_update(at_once, early, expected, early.step(every))
