"""The swift backend's driver: one GRPO step over our sequences on a Megatron worker group.

The driver is the learner process; the worker group is ms-swift's Ray ``WorkerGroup`` of
:class:`hpcrl_learner.backends.swift.worker.HpcrlMegatronWorker` (one Ray actor per GPU, Megatron
tensor/pipeline/data parallel among them). Per step it calls, in order:

1. ``compute_logps``: the current policy's log-probs of the exact sampled tokens, to mask
   tokens whose ratio to the sampler is out of bounds and to measure the sampler/trainer KL;
2. ``compute_ref_logps`` when beta > 0 (LoRA: the base with adapters off; full: ms-swift's
   frozen reference);
3. ``train_step``: forward/backward through ms-swift's GRPO loss and one optimizer update.

``save_version`` has the workers write a Hugging Face directory (safetensors + config, or a
peft adapter for LoRA) with ms-swift's Megatron->HF bridge; ``save_optimizer`` writes the
Megatron training state beside it for resume.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import structlog

from hpcrl_learner.backends import StepResult
from hpcrl_learner.backends.swift.convert import collate_step, mask_mismatched_tokens, scatter_rows
from hpcrl_learner.batches import TrainSequence
from hpcrl_learner.config import LearnerSettings

log = structlog.get_logger("hpcrl.learner.swift")

# ms-swift's names for the metrics the torch backend reports under ours.
_METRIC_NAMES = {
    "loss": "loss",
    "kl": "kl",
    "clip_fraction": "clip_ratio/region_mean",
    "grad_norm": "grad_norm",
    "learning_rate": "lr",
}


class TrainGroup(Protocol):
    """What the driver uses of ms-swift's ``WorkerGroup`` (plus our worker's methods)."""

    dp_size: int

    def compute_logps(self, dispatch: Any) -> list[dict[str, Any]]: ...

    def compute_ref_logps(self, dispatch: Any) -> list[dict[str, Any]]: ...

    def train_step(
        self, dispatch: Any, extra_metrics: dict[str, float] | None = None
    ) -> list[dict[str, Any]]: ...

    def execute(self, method: str, *args: Any, **kwargs: Any) -> Any: ...


def _dispatch(step_dispatch: dict[int, list[dict[str, Any]]]) -> Any:
    """ms-swift's worker group wants a ``DPDispatchedDict`` for per-rank arguments."""
    try:
        from swift.ray.megatron.worker_group import DPDispatchedDict
    except ImportError:  # a group that takes the plain dict (the CPU test group)
        return step_dispatch
    dispatch = DPDispatchedDict()
    dispatch.update(step_dispatch)
    return dispatch


def _first(results: Any) -> dict[str, Any]:
    if isinstance(results, list):
        for item in results:
            if item:
                return dict(item)
        return {}
    return dict(results or {})


class SwiftTrainer:
    """The service's backend interface (``accumulate``, ``step``, ``save_version``,
    ``save_optimizer``)."""

    def __init__(
        self,
        settings: LearnerSettings,
        group: TrainGroup,
        template: Any,
        *,
        vocab_size: int,
        padding_to: int | None = None,
    ) -> None:
        self.settings = settings
        self.group = group
        self.template = template
        self.vocab_size = vocab_size
        self.padding_to = padding_to
        self.format: Literal["full", "lora"] = "lora" if settings.lora.enabled else "full"

    def accumulate(self, sequences: Sequence[TrainSequence]) -> None:
        """Nothing early: Megatron's train_step takes the whole step at once."""

    def step(self, sequences: Sequence[TrainSequence]) -> StepResult:
        started = time.perf_counter()
        settings = self.settings
        batch = collate_step(
            sequences,
            self.template,
            dp_size=self.group.dp_size,
            micro_batch_size=settings.micro_batch_size,
            aggregation=settings.aggregation,
            padding_to=self.padding_to,
        )
        dispatch = _dispatch(batch.dispatch)
        rows = self.group.compute_logps(dispatch)
        trainer_logps = scatter_rows(batch, rows, "per_token_logps")
        stats = mask_mismatched_tokens(batch, trainer_logps, settings.max_log_ratio)
        if settings.beta > 0:
            ref_rows = self.group.compute_ref_logps(_dispatch(batch.dispatch))
            for grpo, ref in zip(
                batch.grpo_batches,
                scatter_rows(batch, ref_rows, "ref_per_token_logps"),
                strict=True,
            ):
                grpo.ref_per_token_logps = ref
        results = self.group.train_step(_dispatch(batch.dispatch), extra_metrics=None)
        reported = _first(results)
        elapsed = time.perf_counter() - started
        reported_figures = {
            ours: float(reported.get(theirs, math.nan)) for ours, theirs in _METRIC_NAMES.items()
        }
        if settings.beta == 0:
            # no reference: not measured (left out of the manifest)
            reported_figures["kl"] = math.nan
        result = StepResult(
            skipped=not reported.get("update_successful", True),
            **reported_figures,
            tokens=float(batch.tokens),
            sequences=float(batch.sequences),
            sampler_kl=stats["sampler_kl"],
            masked_fraction=stats["masked_fraction"],
            train_seconds=elapsed,
        )
        log.info(
            "swift step",
            iteration=reported.get("iteration"),
            **{k: round(v, 6) for k, v in result.metrics().items()},
        )
        return result

    def save_version(self, directory: Path) -> None:
        self.group.execute(
            "save_hf_version",
            str(directory),
            self.format == "lora",
            str(self.settings.model_path.resolve()),
        )

    def save_optimizer(self, directory: Path) -> None:
        self.group.execute("save_training_state", str(directory))
