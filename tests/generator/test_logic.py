"""Pure parts of the generator: prompts, budgets, candidates, version bookkeeping, checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_common.config import ConfigError, load_config
from hpcrl_common.messages import ChatMessage, WeightUpdate, candidate_id, decode, encode
from hpcrl_generator.backends.transformers import sampled_logprobs
from hpcrl_generator.candidates import build_candidates
from hpcrl_generator.config import GeneratorConfig
from hpcrl_generator.prompt import (
    PromptError,
    completion_budget,
    render_prompt,
    require_chat_template,
)
from hpcrl_generator.sampling import Sample, trim_completion
from hpcrl_generator.weights import (
    CheckpointError,
    ModelSignature,
    Refused,
    Target,
    VersionTracker,
    validate,
)

from .conftest import commit_version
from .helpers import request

# --- completions ------------------------------------------------------------------------


def test_trim_keeps_the_first_stop_token_and_names_the_reason():
    assert trim_completion([5, 6, 2, 7, 2], {2}, 10) == (3, "stop")
    assert trim_completion([5, 6, 7], {2, 9}, 3) == (3, "length")
    assert trim_completion([5, 6, 7, 8], {2}, 3) == (3, "length")
    assert trim_completion([9], {2, 9}, 3) == (1, "stop")
    assert trim_completion([5], {2}, 3) == (1, None)


def test_completion_budget_is_capped_by_the_context_and_refuses_a_full_one():
    assert completion_budget(100, 50, 4096) == 50
    assert completion_budget(4000, 512, 4096) == 96
    assert completion_budget(4095, 512, 4096) == 1
    with pytest.raises(PromptError, match="no room"):
        completion_budget(4096, 512, 4096)


def test_sampled_logprobs_are_those_of_the_raw_distribution():
    logits = torch.tensor([[[0.0, math.log(3.0)], [2.0, 2.0]]])  # p = (1/4, 3/4), (1/2, 1/2)
    tokens = torch.tensor([[1, 0]])
    got = sampled_logprobs(logits, tokens)
    assert torch.allclose(got, torch.tensor([[math.log(0.75), math.log(0.5)]]))


def test_a_sample_must_have_one_logprob_per_token():
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        Sample([1, 2], [-0.5], "stop")


# --- prompts ----------------------------------------------------------------------------


def test_prompts_are_rendered_with_the_models_chat_template(tiny_models):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["v0"])
    ids = render_prompt(tokenizer, [ChatMessage(role="user", content="Use register blocking.")])
    assert all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == (
        "<|im_start|>user\nUse register blocking.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_tokenizer_without_a_chat_template_is_refused(tiny_models):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["v0"])
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        require_chat_template(tokenizer, "base-model")


# --- candidates -------------------------------------------------------------------------


def test_candidates_carry_rollout_data_with_stable_ids_and_packed_dtypes():
    req = request("grp-1", group_size=2)
    samples = [
        Sample([5, 6, 2], [-0.5, -1.25, -0.125], "stop", "abc"),
        Sample([7], [-2.0], "length", "d"),
    ]
    out = build_candidates(req, [1, 2, 3], samples, policy_version=4, generator="gen-a")
    assert [c.id for c in out] == [candidate_id("grp-1", 0), candidate_id("grp-1", 1)]
    first = decode(encode(out[0]))  # survives the wire
    assert first.bench == req.bench and first.completion == "abc" and first.generator == "gen-a"
    rollout = first.rollout
    assert rollout.prompt_token_ids.dtype == "<i4" and rollout.sampling_logprobs.dtype == "<f4"
    assert rollout.prompt_token_ids.numpy().tolist() == [1, 2, 3]
    assert rollout.completion_token_ids.numpy().tolist() == [5, 6, 2]
    assert rollout.sampling_logprobs.numpy().tolist() == [-0.5, -1.25, -0.125]
    assert rollout.policy_version == 4 and rollout.finish_reason == "stop"
    assert out[1].rollout.finish_reason == "length"


def test_a_group_needs_exactly_g_samples():
    with pytest.raises(ValueError, match="1 samples for a group of 2"):
        build_candidates(request("g", group_size=2), [1], [Sample([1], [-1.0], "stop")], 0, "x")


# --- versions ---------------------------------------------------------------------------


def _target(version: int) -> Target:
    return Target(version, Path(f"/v{version}"), "full", "sha256:" + "0" * 64)


def test_tracker_keeps_only_the_newest_unloaded_version():
    tracker = VersionTracker(loaded=1)
    assert not tracker.offer(_target(1))  # not newer than loaded
    assert tracker.offer(_target(3))
    assert not tracker.offer(_target(2))  # older than pending
    assert tracker.pending_version == 3
    assert tracker.take().version == 3 and tracker.take() is None
    tracker.loaded_ok(3)
    assert not tracker.offer(_target(3)) and tracker.offer(_target(4))
    tracker.take()
    tracker.refused(4)
    assert not tracker.offer(_target(4))  # a refused version is never retried
    assert tracker.loaded == 3


def test_validation_accepts_a_same_shape_version_and_refuses_bad_ones(tiny_models, tmp_path):
    store = CheckpointStore(tmp_path / "store")
    signature = ModelSignature.of(tiny_models["v0"])
    good = Target.from_info(commit_version(store, tiny_models["v1"], 1), store)
    validate(good, signature, verify_checksum=True)

    wrong_shape = Target.from_info(commit_version(store, tiny_models["wide"], 2), store)
    with pytest.raises(CheckpointError, match="hidden_size is 256"):
        validate(wrong_shape, signature, verify_checksum=True)

    tampered = Target.from_info(commit_version(store, tiny_models["v2"], 3), store)
    (tampered.path / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(CheckpointError, match="checksum"):
        validate(tampered, signature, verify_checksum=True)
    with pytest.raises(CheckpointError, match="unreadable safetensors"):
        validate(tampered, signature, verify_checksum=False)

    config = json.loads((good.path / "config.json").read_text())
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    tensors = load_file(good.path / "model.safetensors")
    tensors["model.extra.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, renamed / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing .*model\.norm\.weight"):
        signature.check(renamed)
    with pytest.raises(CheckpointError, match="not a directory"):
        validate(_target(9), signature, verify_checksum=False)


def test_lora_versions_need_an_adapter(tmp_path):
    target = Target(1, tmp_path, "lora", "sha256:" + "0" * 64)
    with pytest.raises(CheckpointError, match=r"adapter_config\.json"):
        validate(target, ModelSignature({}, {}), verify_checksum=False)


def test_an_announcement_is_resolved_only_through_this_replicas_store(tiny_models, tmp_path):
    store = CheckpointStore(tmp_path / "store")
    info = commit_version(store, tiny_models["v1"], 1)
    update = info.weight_update(store.root, run=f"exp/{store.run_id}")
    assert Target.from_update(update, store).path == store.path_of(info).resolve()
    # The URI is never followed: a directory outside the store changes nothing.
    elsewhere = WeightUpdate(**{**update.model_dump(), "uri": str(tiny_models["wide"])})
    assert Target.from_update(elsewhere, store).path == store.path_of(info).resolve()
    refusals = {
        "not_in_store": {"version": 2**30, "id": "v-forged"},
        "other_run": {"run": "exp/0123456789abcdef"},
        "mismatch": {"checksum": "sha256:" + "1" * 64},
    }
    for reason, change in refusals.items():
        forged = WeightUpdate(**{**update.model_dump(), **change})
        with pytest.raises(Refused) as caught:
            Target.from_update(forged, store)
        assert caught.value.reason == reason
    with pytest.raises(Refused, match="checkpoint_dir is not set"):
        Target.from_update(update, None)


# --- config -----------------------------------------------------------------------------


def test_config_defaults_env_overrides_and_a_missing_model(tmp_path):
    path = tmp_path / "exp.toml"
    path.write_text(
        '[generator]\nmodel_path = "/models/qwen"\nbackend = "transformers"\n'
        '[learner]\nmodel_path = "/models/qwen"\nlr = 1e-6\n'
    )
    config = load_config(GeneratorConfig, path, env={"HPCRL__GENERATOR__MAX_MODEL_LEN": "2048"})
    section = config.generator
    assert section.metrics_port == 9101 and section.backend == "transformers"
    assert section.max_model_len == 2048 and str(section.model_path) == "/models/qwen"
    with pytest.raises(ConfigError, match=r"generator\.model_path: Field required"):
        load_config(GeneratorConfig, None, env={"HPCRL__GENERATOR__BACKEND": "vllm"})
    with pytest.raises(ConfigError, match=r"generator\.backend"):
        load_config(GeneratorConfig, path, env={"HPCRL__GENERATOR__BACKEND": "tgi"})


def test_cpu_threads_ask_vllm_for_unpinned_threads_and_zero_keeps_its_binding():
    from hpcrl_generator.backends.vllm import cpu_thread_environment

    assert cpu_thread_environment(0) == {}
    assert cpu_thread_environment(1) == {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
    }
    with pytest.raises(ValueError, match="cpu_threads"):
        cpu_thread_environment(-1)
    from hpcrl_generator.config import GeneratorSection

    assert GeneratorSection(model_path="m").cpu_threads == 0
    with pytest.raises(ValueError, match="cpu_threads"):
        GeneratorSection(model_path="m", cpu_threads=-1)


def test_thread_settings_last_only_while_the_engine_starts_and_win_over_the_shells(
    monkeypatch,
):
    import os

    from hpcrl_generator.backends.vllm import _environment_while

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    with _environment_while({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
        assert os.environ["OMP_NUM_THREADS"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    assert os.environ["OMP_NUM_THREADS"] == "2"
