"""Tiny local models for the generator suites (built here, nothing downloaded)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hpcrl_common.checkpoints import CheckpointInfo, CheckpointStore


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """v0: a tiny Qwen2 with tied embeddings; v1: the same with every matrix perturbed."""
    from tests.support.models import chat_model, perturbed_copy

    root = tmp_path_factory.mktemp("tiny-models")
    v0 = chat_model(root / "v0")
    v1 = perturbed_copy(v0, root / "v1", seed=1)
    v2 = perturbed_copy(v0, root / "v2", seed=2)
    other = chat_model(root / "wide", hidden_size=256, heads=4)
    return {"v0": v0, "v1": v1, "v2": v2, "wide": other}


def commit_version(store: CheckpointStore, source: Path, version: int) -> CheckpointInfo:
    """Do what the learner does: write a version under a staging name, then commit it."""
    staging = store.staging_dir(version)
    for file in source.iterdir():
        shutil.copy2(file, staging / file.name)
    return store.commit(staging, version, version - 1, "full", base_model="tiny")
