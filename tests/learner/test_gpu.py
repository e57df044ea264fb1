"""The torch backend on a CUDA GPU: the route a cluster's learner takes.

Skipped where no CUDA device is visible (CI, the 2-core machines): run it on a GPU node with
``pytest tests/learner/test_gpu.py``. It checks that a step on the GPU learns, that it agrees
with the same step on the CPU, and that a version saved from the GPU loads on the CPU (the
generator's side) with the same weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hpcrl_learner.backends import StepResult
from hpcrl_learner.backends.torch import TorchTrainer
from hpcrl_learner.batches import prepare_group
from hpcrl_learner.config import LearnerSettings

from .conftest import BAD, GOOD, good_bad_batch, sequences_of

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible on this machine)"
)


def one_step(trainer: TorchTrainer, batch_id: str) -> StepResult:
    lp = trainer.logprobs(sequences_of([GOOD, BAD]))
    group = prepare_group(
        good_bad_batch(batch_id, {"good": lp[0], "bad": lp[1]}),
        0,
        adv_eps=1e-4,
        vocab_size=trainer.vocab_size,
        max_sequence_tokens=64,
    )
    return trainer.step(group.sequences)


@pytest.mark.parametrize("lora", [False, True], ids=["full-fp32", "lora-bf16"])
def test_a_gpu_step_learns(tiny_model, lora):
    settings = LearnerSettings(
        model_path=tiny_model,
        device="cuda",
        learning_rate=2e-2 if lora else 2e-3,
        lora={"enabled": lora, "r": 8, "alpha": 16},
    )
    trainer = TorchTrainer(settings, seed=1)
    assert trainer.device.type == "cuda"
    # auto dtype: bf16 base weights under LoRA on a GPU, float32 for a full fine-tune
    assert trainer.dtype == (torch.bfloat16 if lora else torch.float32)

    def favour() -> float:
        lp = trainer.logprobs(sequences_of([GOOD, BAD]))
        return float(lp[0].sum() - lp[1].sum())

    before = favour()
    for step in range(4):
        metrics = one_step(trainer, f"g{step}")
        assert np.isfinite(metrics.loss) and metrics.grad_norm > 0
    assert favour() > before + 1.0


def test_a_gpu_step_matches_the_cpu_step(tiny_model):
    trainers = {
        device: TorchTrainer(
            LearnerSettings(
                model_path=tiny_model, device=device, dtype="float32", learning_rate=2e-3
            ),
            seed=1,
        )
        for device in ("cpu", "cuda")
    }
    metrics = {device: one_step(t, "same") for device, t in trainers.items()}
    assert metrics["cuda"].loss == pytest.approx(metrics["cpu"].loss, rel=1e-3, abs=1e-5)
    assert metrics["cuda"].grad_norm == pytest.approx(metrics["cpu"].grad_norm, rel=1e-3)
    after = {device: t.logprobs(sequences_of([GOOD]))[0] for device, t in trainers.items()}
    np.testing.assert_allclose(after["cuda"], after["cpu"], rtol=1e-3, atol=1e-4)


def test_a_version_saved_from_the_gpu_loads_on_the_cpu(tiny_model, tmp_path):
    trainer = TorchTrainer(
        LearnerSettings(model_path=tiny_model, device="cuda", learning_rate=2e-3), seed=1
    )
    one_step(trainer, "saved")
    trainer.save_version(tmp_path / "v1")
    saved = {}
    for path in sorted((tmp_path / "v1").glob("*.safetensors")):
        saved.update(load_file(str(path), device="cpu"))
    live = {name: p.detach().float().cpu() for name, p in trainer.model.named_parameters()}
    assert saved, "no safetensors written"
    for name, tensor in saved.items():
        assert tensor.device.type == "cpu"
        if name in live:
            torch.testing.assert_close(tensor.float(), live[name])
    cpu = TorchTrainer(LearnerSettings(model_path=tmp_path / "v1", device="cpu"), seed=1)
    gpu_lp = trainer.logprobs(sequences_of([GOOD]))[0]
    np.testing.assert_allclose(cpu.logprobs(sequences_of([GOOD]))[0], gpu_lp, rtol=1e-3, atol=1e-4)
