"""The checkpoint store: atomic visibility, ordered versions, checksums."""

from __future__ import annotations

import pytest

from hpcrl_common.checkpoints import CheckpointStore, checksum_dir
from hpcrl_common.messages import WeightUpdate, decode, encode


def write_version(store: CheckpointStore, version: int, payload: bytes):
    staging = store.staging_dir(version)
    (staging / "model.safetensors").write_bytes(payload)
    (staging / "config.json").write_text("{}")
    assert store.latest() is None or store.latest().version < version  # not visible yet
    return store.commit(
        staging, version, version - 1, "full", base_model="tiny", metrics={"loss": 0.25}
    )


def test_versions_become_visible_only_when_committed(tmp_path):
    store = CheckpointStore(tmp_path)
    assert store.latest() is None
    first = write_version(store, 1, b"one")
    second = write_version(store, 2, b"two")
    assert [v.version for v in store.versions()] == [1, 2]
    assert store.latest() == second and store.get(1) == first
    assert store.verify(first) and store.verify(second)
    assert first.checksum != second.checksum
    assert not list(tmp_path.glob(".staging-*"))


def test_tampering_is_detected_and_versions_must_increase(tmp_path):
    store = CheckpointStore(tmp_path)
    info = write_version(store, 1, b"weights")
    (store.path_of(info) / "model.safetensors").write_bytes(b"evil")
    assert not store.verify(info)
    staging = store.staging_dir(1)
    with pytest.raises(ValueError, match="not after"):
        store.commit(staging, 1, 0, "full")


def test_checksum_covers_names_and_contents(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"1")
    before = checksum_dir(tmp_path / "a")
    (tmp_path / "a" / "x").rename(tmp_path / "a" / "y")
    assert checksum_dir(tmp_path / "a") != before


def test_weight_update_message_points_at_the_version(tmp_path):
    store = CheckpointStore(tmp_path)
    info = write_version(store, 1, b"w")
    update = info.weight_update(tmp_path)
    assert decode(encode(update), WeightUpdate) == update
    assert update.uri == str(store.path_of(info).resolve()) and update.checksum == info.checksum
