"""Learner backends, one module per value of ``learner.backend``: ``torch`` (transformers + peft,
one process) and ``swift`` (ms-swift's Megatron workers, its own environment).

Each module is imported only when chosen: ``torch`` loads torch and transformers, ``swift``
needs the ms-swift environment.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, Protocol

from hpcrl_learner.batches import TrainSequence
from hpcrl_learner.config import LearnerSettings


class Backend(Protocol):
    format: Literal["full", "lora"]
    vocab_size: int

    def accumulate(self, sequences: Sequence[TrainSequence]) -> None:
        """May compute part of the next step now (a group as it arrives); :meth:`step` is
        then given these sequences again with the rest and makes the same update."""

    def step(self, sequences: Sequence[TrainSequence]) -> dict[str, float]: ...

    def save_version(self, directory: Path) -> None: ...

    def save_optimizer(self, directory: Path) -> None: ...


# (settings, version directory to resume from, optimizer state directory, seed) -> backend
BackendFactory = Callable[[LearnerSettings, Path | None, Path | None, int], Backend]


def backend_for(settings: LearnerSettings) -> BackendFactory:
    if settings.backend == "torch":
        from hpcrl_learner.backends.torch import torch_backend

        return torch_backend
    from hpcrl_learner.backends.swift import swift_backend

    return swift_backend
