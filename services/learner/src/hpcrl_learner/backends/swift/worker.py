"""Our Megatron worker: ms-swift's ``MegatronWorker`` plus what our learner needs of it.

Runs inside each Ray actor on a GPU. NOT RUN in this repository's tests (no GPU was lent to the
task that wrote it); it imports on a CPU, which the tests check. Additions:

* ``train_step`` sets ``num_microbatches`` from the step it is given: our steps are as large as
  the groups that arrived, not a fixed dataset batch (every rank gets the same count; the driver
  pads with filler rows);
* ``save_hf_version`` writes a Hugging Face directory (or a peft adapter for LoRA) with ms-swift's
  Megatron->HF bridge, instead of ``update_weights`` pushing weights to a colocated vLLM;
* ``save_training_state`` writes the Megatron checkpoint (weights + optimizer + scheduler) that
  a restart resumes from (passed back as ``mcore_model`` / ``mcore_adapter``).
"""

from __future__ import annotations

from typing import Any

from swift.ray.megatron.megatron_worker import MegatronWorker
from swift.ray.megatron.worker_group import dispatch_collect


class HpcrlMegatronWorker(MegatronWorker):
    @dispatch_collect(dispatch="dp", collect="all")
    def train_step(
        self, micro_batches: list[dict[str, Any]], extra_metrics: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        self._megatron.args.num_microbatches = len(micro_batches)
        return MegatronWorker.train_step(self, micro_batches, extra_metrics)

    @dispatch_collect(dispatch="broadcast", collect="first")
    def save_hf_version(self, directory: str, lora: bool, base_model: str) -> None:
        # Every rank takes part (the export gathers tensor-parallel shards); rank 0 writes.
        megatron = self._megatron
        megatron.bridge.save_weights(
            megatron.unwrapped_models,
            directory,
            peft_format=lora,
            args=megatron.args,
            processor=None if lora else megatron.template.processor,
        )

    @dispatch_collect(dispatch="broadcast", collect="first")
    def save_training_state(self, directory: str) -> None:
        from swift.megatron.utils.megatron_lm_utils import save_mcore_checkpoint

        megatron = self._megatron
        save_mcore_checkpoint(
            megatron.args,
            megatron.wrapped_models,
            megatron.optimizer,
            megatron.opt_param_scheduler,
            iteration=megatron.state.iteration,
            output_dir=directory,
            peft_format=megatron.args.tuner_type == "lora",
        )
