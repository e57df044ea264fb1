"""CLI, configuration and backend selection of the learner (no broker needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpcrl_common.config import BrokerSettings, ConfigError, load_config
from hpcrl_learner.backends.swift import SwiftUnavailable, missing_requirements
from hpcrl_learner.config import LearnerConfig, LearnerSettings
from hpcrl_learner.service import build, effective_broker


def test_help_lists_serve():
    out = subprocess.run(
        [sys.executable, "-m", "hpcrl_learner.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "serve" in out and "bootstrap" not in out
    serve = subprocess.run(
        [sys.executable, "-m", "hpcrl_learner.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--config" in serve


def test_config_keys_are_checked_and_env_overrides(tmp_path):
    path = tmp_path / "exp.toml"
    path.write_text("[learner]\ngroups_per_step = 8\nbeta = 0.01\n[learner.lora]\nenabled = true\n")
    config = load_config(LearnerConfig, path, env={"HPCRL__LEARNER__MAX_STALENESS": "2"})
    assert config.learner.groups_per_step == 8 and config.learner.beta == 0.01
    assert config.learner.lora.enabled and config.learner.max_staleness == 2
    assert config.learner.metrics_port == 9103
    path.write_text("[learner]\ngroup_per_step = 8\n")
    with pytest.raises(ConfigError, match=r"learner.group_per_step: unknown key"):
        load_config(LearnerConfig, path, env={})
    with pytest.raises(ConfigError, match="clip_eps"):
        load_config(LearnerConfig, None, env={"HPCRL__LEARNER__CLIP_EPS": "1.5"})


def test_prefetch_is_raised_to_cover_a_step():
    config = LearnerConfig(
        broker=BrokerSettings(prefetch=2), learner=LearnerSettings(groups_per_step=16)
    )
    assert effective_broker(config).broker.prefetch == 16
    roomy = LearnerConfig(broker=BrokerSettings(prefetch=32))
    assert effective_broker(roomy).broker.prefetch == 32


def test_swift_backend_refuses_with_the_reason(tiny_model, tmp_path):
    config = LearnerConfig(
        learner=LearnerSettings(backend="swift", model_path=tiny_model, checkpoint_dir=tmp_path)
    )
    with pytest.raises(SwiftUnavailable, match="cannot start on this host"):
        build(config)
    # this CPU-only development venv has neither ms-swift nor a GPU, and says so
    missing = missing_requirements()
    assert any("ms-swift" in item for item in missing) and "a CUDA GPU" in missing
