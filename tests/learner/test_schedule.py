"""The learning-rate schedule: pure maths, and the torch trainer following it across a resume."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpcrl_learner.backends.swift.cluster import _lr_schedule
from hpcrl_learner.backends.torch import TorchTrainer
from hpcrl_learner.batches import TrainSequence
from hpcrl_learner.config import LearnerSettings
from hpcrl_learner.schedule import lr_factor
from hpcrl_learner.state import LearnerState, StateStore

from .conftest import BAD, GOOD, PROMPT


def test_warm_up_then_a_line_down_to_the_floor():
    factors = [lr_factor(s, warmup_steps=2, decay_steps=4, min_lr_ratio=0.2) for s in range(9)]
    assert factors == pytest.approx([1 / 3, 2 / 3, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2, 0.2])


def test_no_decay_steps_keeps_the_rate_constant_after_the_warm_up():
    assert [lr_factor(s, 1, 0, 0.1) for s in range(4)] == pytest.approx([0.5, 1, 1, 1])


@given(
    step=st.integers(0, 10_000),
    warmup=st.integers(0, 50),
    decay=st.integers(0, 500),
    floor=st.floats(0, 1),
)
def test_the_factor_never_leaves_floor_to_one_after_the_warm_up(step, warmup, decay, floor):
    factor = lr_factor(step, warmup, decay, floor)
    assert 0 < factor <= 1 if step < warmup else min(floor, 1.0) - 1e-12 <= factor <= 1.0
    later = lr_factor(step + 1, warmup, decay, floor)
    # From the last warm-up step to the first after it the factor still rises (to its peak).
    assert (later >= factor - 1e-12) if step < warmup else (later <= factor + 1e-12)


def test_the_trainer_decays_and_a_resumed_trainer_goes_on_where_it_stopped(tiny_model, tmp_path):
    settings = LearnerSettings(
        model_path=tiny_model, learning_rate=1e-3, decay_steps=3, min_lr_ratio=0.25
    )
    seqs = [
        TrainSequence(np.array(PROMPT), np.array(GOOD), np.full(5, -5.0, np.float32), 1.0),
        TrainSequence(np.array(PROMPT), np.array(BAD), np.full(4, -5.0, np.float32), -1.0),
    ]
    trainer = TorchTrainer(settings)
    rates = [trainer.step(seqs).learning_rate for _ in range(2)]
    assert rates == pytest.approx([1e-3, 0.75e-3])
    version = tmp_path / "v2"
    version.mkdir()
    trainer.save_version(version)
    store = StateStore(tmp_path)
    store.write(LearnerState(2, 2, ["a", "b"]), trainer.save_optimizer)
    _, state_dir = store.load(2)
    resumed = TorchTrainer(settings, resume_from=version, optimizer_dir=state_dir)
    assert [resumed.step(seqs).learning_rate for _ in range(3)] == pytest.approx(
        [0.5e-3, 0.25e-3, 0.25e-3]
    )


def test_megatron_gets_the_same_schedule(tmp_path):
    constant = _lr_schedule(LearnerSettings(model_path=tmp_path, learning_rate=1e-5))
    assert constant["lr_decay_style"] == "constant" and constant["min_lr"] == 1e-5
    decayed = _lr_schedule(
        LearnerSettings(
            model_path=tmp_path,
            learning_rate=1e-5,
            warmup_steps=2,
            decay_steps=10,
            min_lr_ratio=0.1,
        )
    )
    assert decayed == {
        "lr_decay_style": "linear",
        "min_lr": pytest.approx(1e-6),
        "lr_warmup_iters": 2,
        "lr_decay_iters": 12,
    }
