"""Learner backends, one module per value of ``learner.backend``: ``torch`` (transformers + peft,
one process) and ``swift`` (ms-swift's Megatron workers, its own environment).

Each module is imported only when chosen: ``torch`` loads torch and transformers, ``swift``
needs the ms-swift environment.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Protocol

from hpcrl_learner.batches import TrainSequence
from hpcrl_learner.config import LearnerSettings


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did, whichever backend took it. Rates are over the step's
    completion tokens; NaN where a backend does not measure it (no reference when beta = 0,
    no fresh sample, no entropy from ms-swift)."""

    skipped: bool  # no update (a non-finite gradient): the model is unchanged
    loss: float
    tokens: float  # completion tokens
    sequences: float
    clip_fraction: float
    masked_fraction: float  # tokens whose log-ratio to the sampler exceeded max_log_ratio
    kl: float  # to the reference
    sampler_kl: float
    learning_rate: float
    grad_norm: float  # before clipping; -1 when skipped
    train_seconds: float  # the step's passes, those run as its groups arrived included
    early_seconds: float = 0.0  # of which run as the groups arrived (train_on_arrival)
    sampler_kl_fresh: float = math.nan  # on samples of the current weights only
    entropy: float = math.nan
    ratio_mean: float = math.nan
    replay_nll: float = math.nan  # per token, of the step's replay examples (NaN: no replay)
    taught_nll: float = math.nan  # per token, of the held-out probe after the step (NaN: off)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.train_seconds, 1e-9)

    def metrics(self) -> dict[str, float]:
        """Every figure as a float (logs, benches): ``skipped`` as 0/1."""
        return {
            **{k: float(v) for k, v in asdict(self).items()},
            "tokens_per_second": self.tokens_per_second,
        }


class Backend(Protocol):
    format: Literal["full", "lora"]
    vocab_size: int

    def accumulate(self, sequences: Sequence[TrainSequence]) -> None:
        """May compute part of the next step now (a group as it arrives); :meth:`step` is
        then given these sequences again with the rest and makes the same update."""

    def step(self, sequences: Sequence[TrainSequence]) -> StepResult: ...

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
