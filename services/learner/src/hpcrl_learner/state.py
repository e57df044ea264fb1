"""The learner's own state for resume, kept beside the checkpoint store.

``<checkpoint_dir>/learner-state/v000007/`` holds ``state.json`` (version, groups trained,
the ids of the batches already trained on) and ``optimizer.pt`` for version 7. It is written
under a temporary name and renamed *before* version 7 is committed to the store's manifest.
The manifest commit is therefore the single atomic point for both: a crash before it leaves
a state directory for an uncommitted version, which is discarded on restart (its batches
were never acked and come back); a crash after it finds the state of the committed version.
Generators never look here: version directories hold only what they load.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_DIR = "learner-state"
STATE_FILE = "state.json"


@dataclass
class LearnerState:
    version: int = 0
    groups_trained: int = 0
    trained_ids: list[str] = field(default_factory=list)  # oldest first
    # Groups dropped as stale (acked untrained) up to this version: the scheduler's pacing
    # counts them as done, or each drop would narrow its window for good.
    groups_dropped: int = 0

    def advanced(
        self, version: int, batch_ids: list[str], memory: int, dropped: int = 0
    ) -> LearnerState:
        ids = [*self.trained_ids, *batch_ids]
        return LearnerState(
            version,
            self.groups_trained + len(batch_ids),
            ids[-memory:],
            self.groups_dropped + dropped,
        )


def _version_name(version: int) -> str:
    return f"v{version:06d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StateStore:
    def __init__(self, checkpoint_dir: Path) -> None:
        self.root = Path(checkpoint_dir) / STATE_DIR

    def path(self, version: int) -> Path:
        return self.root / _version_name(version)

    def write(self, state: LearnerState, write_extra: Callable[[Path], None]) -> Path:
        """Write ``state`` plus whatever ``write_extra(dir)`` adds, then rename it into place."""
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(
            tempfile.mkdtemp(prefix=f".staging-{_version_name(state.version)}-", dir=self.root)
        )
        write_extra(staging)
        with (staging / STATE_FILE).open("w") as handle:
            json.dump(asdict(state), handle)
            handle.flush()
            os.fsync(handle.fileno())
        for file in staging.iterdir():
            if file.is_file():
                with file.open("rb") as handle:
                    os.fsync(handle.fileno())
        final = self.path(state.version)
        if final.exists():  # an uncommitted leftover of an earlier attempt at this version
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync_dir(self.root)
        return final

    def load(self, version: int) -> tuple[LearnerState, Path] | None:
        directory = self.path(version)
        try:
            raw = json.loads((directory / STATE_FILE).read_text())
        except FileNotFoundError:
            return None
        state = LearnerState(**raw)
        if state.version != version:
            raise ValueError(f"{directory} holds state of version {state.version}")
        return state, directory

    def tidy(self, committed: int, keep: int) -> None:
        """Drop staging leftovers, states of uncommitted versions, and all but ``keep``."""
        if not self.root.exists():
            return
        for stale in self.root.glob(".staging-*"):
            shutil.rmtree(stale, ignore_errors=True)
        versions = sorted(int(p.name[1:]) for p in self.root.glob("v*") if p.name[1:].isdigit())
        for version in versions:
            if version > committed or version <= committed - keep:
                shutil.rmtree(self.path(version), ignore_errors=True)
