"""The checkpoint store: versioned policy weights on a shared filesystem, by reference.

Layout under ``root``::

    manifest.json        {"run_id": ..., "versions": [CheckpointInfo, ...]}  (replaced atomically)
    v000001/             a Hugging Face model directory (full) or a peft adapter (lora)
    .staging-v000002-*/  being written; never read by anyone

A version becomes visible only when complete: its directory is written under a staging
name, renamed into place, and only then added to the manifest. Version 0 is the base model,
which is not in the store. The learner writes; generators read (a generator that starts late
loads ``latest()``); weight-update messages point here.

The store's ``run_id`` (random, made with the first manifest) names this run of training;
announcements carry it, so a generator loads only versions of its own store's manifest and a
scheduler never takes a floor from another run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from hpcrl_common.messages import PACING_FIELDS, WeightUpdate

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class CheckpointInfo:
    version: int
    parent_version: int
    path: str  # relative to the store root
    format: Literal["full", "lora"]
    checksum: str
    base_model: str = ""
    created_at: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)

    def pacing(self) -> dict[str, int]:
        """The learner's pacing figures recorded with this version (weight-update/2 fields)."""
        return {key: int(self.metrics[key]) for key in PACING_FIELDS if key in self.metrics}

    def weight_update(self, root: Path, run: str = "") -> WeightUpdate:
        return WeightUpdate(
            id=f"v{self.version}",
            run=run,
            version=self.version,
            parent_version=self.parent_version,
            uri=str((root / self.path).resolve()),
            format=self.format,
            checksum=self.checksum,
            base_model=self.base_model,
            **self.pacing(),  # type: ignore[arg-type]
            metrics={k: v for k, v in self.metrics.items() if k not in PACING_FIELDS},
            created_at=self.created_at,
        )


def run_label(experiment: str, store_run_id: str | None) -> str:
    """What a weight update's ``run`` says: the experiment and its store's run id."""
    return f"{experiment}/{store_run_id or ''}"


def split_run(run: str) -> tuple[str, str]:
    """(experiment, store run id) of a weight update's ``run``; empty parts when absent."""
    experiment, _, store_run = run.rpartition("/")
    return experiment, store_run


def checksum_dir(path: Path) -> str:
    """sha256 over every file's relative path and contents, in sorted order."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    return "sha256:" + digest.hexdigest()


class CheckpointStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _manifest(self) -> dict:
        try:
            return json.loads((self.root / MANIFEST).read_text())
        except FileNotFoundError:
            return {"versions": []}

    def versions(self) -> list[CheckpointInfo]:
        return [CheckpointInfo(**entry) for entry in self._manifest()["versions"]]

    @property
    def run_id(self) -> str | None:
        """This store's run, once a version has been committed (None before)."""
        return self._manifest().get("run_id")

    def latest(self) -> CheckpointInfo | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def get(self, version: int) -> CheckpointInfo:
        for info in self.versions():
            if info.version == version:
                return info
        raise KeyError(f"version {version} is not in the checkpoint store {self.root}")

    def path_of(self, info: CheckpointInfo) -> Path:
        return self.root / info.path

    def staging_dir(self, version: int) -> Path:
        """A fresh directory to write version ``version`` into before :meth:`commit`."""
        self.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".staging-v{version:06d}-", dir=self.root))

    def commit(
        self,
        staging: Path,
        version: int,
        parent_version: int,
        format: Literal["full", "lora"],
        base_model: str = "",
        metrics: dict[str, float] | None = None,
    ) -> CheckpointInfo:
        """Publish a fully written staging directory as ``version`` (atomic for readers)."""
        existing = self.versions()
        if existing and version <= existing[-1].version:
            raise ValueError(f"version {version} is not after {existing[-1].version}")
        name = f"v{version:06d}"
        final = self.root / name
        if final.exists():  # left by a crash between rename and manifest update
            shutil.rmtree(final)
        info = CheckpointInfo(
            version=version,
            parent_version=parent_version,
            path=name,
            format=format,
            checksum=checksum_dir(staging),
            base_model=base_model,
            created_at=time.time(),
            metrics=dict(metrics or {}),
        )
        os.replace(staging, final)
        self._write_manifest([*existing, info], self.run_id or uuid.uuid4().hex)
        return info

    def verify(self, info: CheckpointInfo) -> bool:
        return checksum_dir(self.path_of(info)) == info.checksum

    def remove_stale_staging(self) -> None:
        for stale in self.root.glob(".staging-*"):
            shutil.rmtree(stale, ignore_errors=True)

    def _write_manifest(self, versions: list[CheckpointInfo], run_id: str) -> None:
        body = json.dumps({"run_id": run_id, "versions": [asdict(v) for v in versions]}, indent=1)
        fd, tmp = tempfile.mkstemp(prefix=".manifest-", dir=self.root)
        with os.fdopen(fd, "w") as handle:
            handle.write(body)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.root / MANIFEST)
