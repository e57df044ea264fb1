"""Start the Megatron worker group on Ray GPUs and build the swift backend around it.

NOT RUN in this repository's tests (no GPU was lent to the task that wrote it). It follows
ms-swift 4.6.0's own ``MegatronRayPipeline._spawn_train_group`` (resource pool, one Ray actor
per GPU, ``init_actor`` with the GRPO loss, ``build_dispatch_info``, ``setup``) with our worker
class and with no rollout engine: generation is our generator service's job.

The parallel layout is not part of ``[learner]`` yet; it is read from the environment:
``HPCRL_SWIFT_GPUS`` (default: all GPUs Ray sees), ``HPCRL_SWIFT_TP`` (tensor parallel, 1),
``HPCRL_SWIFT_PP`` (pipeline parallel, 1), ``HPCRL_SWIFT_ARGS`` (a JSON object of further
ms-swift Megatron arguments, applied last, e.g. ``{"recompute_granularity": "full"}``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from hpcrl_learner.backends.swift.driver import SwiftTrainer
from hpcrl_learner.config import LearnerSettings

GRPO_LOSS = "swift.ray.megatron.loss.grpo.GRPOLoss"
# Megatron's schedule needs a length; ours is open-ended (constant LR after warm-up).
OPEN_ENDED_ITERS = 10**9


def megatron_args(
    settings: LearnerSettings,
    *,
    tp: int = 1,
    pp: int = 1,
    resume_from: Path | None = None,
    state_dir: Path | None = None,
    output_dir: Path,
) -> dict[str, Any]:
    """Our settings as ms-swift ``MegatronRLHFArguments`` (see ``convert`` for the loss)."""
    lora = settings.lora
    beta1, beta2 = settings.adam_betas
    args: dict[str, Any] = {
        "rlhf_type": "grpo",
        "model": str(settings.model_path.resolve()),
        "tuner_type": "lora" if lora.enabled else "full",
        "loss_type": "dapo",
        "epsilon": settings.clip_eps,
        "epsilon_high": settings.clip_eps_high,  # None: ms-swift uses epsilon
        "beta": settings.beta,
        "delta": math.exp(settings.max_log_ratio),
        "temperature": settings.logprob_temperature,
        "micro_batch_size": settings.micro_batch_size,
        "lr": settings.learning_rate,
        **_lr_schedule(settings),
        "weight_decay": settings.weight_decay,
        "adam_beta1": beta1,
        "adam_beta2": beta2,
        "clip_grad": settings.max_grad_norm,
        "max_length": settings.max_sequence_tokens,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "output_dir": str(output_dir),
        "save_steps": OPEN_ENDED_ITERS,  # we save through save_hf_version / save_training_state
        "logging_steps": 1,  # train_step returns the metrics of the last logged step
        "train_iters": OPEN_ENDED_ITERS,
        "use_ray": True,
        "num_generations": 1,  # advantages come with the batches; ms-swift does not group
        "reward_funcs": [],
        "recompute_granularity": "full" if settings.gradient_checkpointing else None,
    }
    if lora.enabled:
        args.update(
            lora_rank=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
        )
    if settings.dtype in ("bfloat16", "float16"):
        args[{"bfloat16": "bf16", "float16": "fp16"}[settings.dtype]] = True
    if state_dir is not None and (state_dir / "latest_checkpointed_iteration.txt").exists():
        args["mcore_adapter" if lora.enabled else "mcore_model"] = str(state_dir)
        args["finetune"] = False
    elif resume_from is not None:
        # No Megatron state (e.g. it was lost): start from the committed weights.
        args["adapters" if lora.enabled else "model"] = str(resume_from)
    extra = os.environ.get("HPCRL_SWIFT_ARGS")
    if extra:
        args.update(json.loads(extra))
    return {k: v for k, v in args.items() if v is not None}


def _lr_schedule(settings: LearnerSettings) -> dict[str, Any]:
    """``hpcrl_learner.schedule`` in Megatron's terms (its decay counts the warm-up in)."""
    lr = settings.learning_rate
    if settings.decay_steps == 0:
        return {
            "lr_decay_style": "constant",
            "min_lr": lr,
            "lr_warmup_iters": settings.warmup_steps,
        }
    return {
        "lr_decay_style": "linear",
        "min_lr": lr * settings.min_lr_ratio,
        "lr_warmup_iters": settings.warmup_steps,
        "lr_decay_iters": settings.warmup_steps + settings.decay_steps,
    }


def start(
    settings: LearnerSettings,
    resume_from: Path | None,
    state_dir: Path | None,
) -> SwiftTrainer:  # pragma: no cover - needs GPUs
    import ray
    from swift.model import get_processor
    from swift.ray.megatron.resource_pool import ResourcePool, ResourcePoolManager
    from swift.ray.megatron.worker_group import WorkerGroup
    from swift.template import get_template

    from hpcrl_learner.backends.swift.worker import HpcrlMegatronWorker

    ray.init(ignore_reinit_error=True)
    gpus = int(os.environ.get("HPCRL_SWIFT_GPUS") or int(ray.cluster_resources().get("GPU", 0)))
    if gpus < 1:
        raise RuntimeError("the swift backend needs at least one GPU visible to Ray")
    tp = int(os.environ.get("HPCRL_SWIFT_TP", "1"))
    pp = int(os.environ.get("HPCRL_SWIFT_PP", "1"))
    output_dir = settings.checkpoint_dir / "swift-megatron"
    config = megatron_args(
        settings, tp=tp, pp=pp, resume_from=resume_from, state_dir=state_dir, output_dir=output_dir
    )
    per_node = int(os.environ.get("HPCRL_SWIFT_GPUS_PER_NODE", str(min(gpus, 8))))
    pool = ResourcePool([per_node] * max(1, gpus // per_node))
    manager = ResourcePoolManager({"train": pool})
    manager.create_all()
    worker_cls = ray.remote(num_gpus=0)(HpcrlMegatronWorker)
    group = WorkerGroup.from_pool("train", manager.get_pool("train"), worker_cls=worker_cls)
    group.broadcast("init_actor", config, loss_cls_path=GRPO_LOSS, rollout_config=None)
    group.build_dispatch_info(worker_cls=HpcrlMegatronWorker)
    padding_to = next((v for v in group.broadcast("get_padding_to") if v is not None), None)
    group.setup({"train_iters": OPEN_ENDED_ITERS})
    processor = get_processor(config["model"], download_model=False)
    template = get_template(processor, padding_free=bool(config.get("padding_free", False)))
    return SwiftTrainer(
        settings,
        group,
        template,
        vocab_size=model_vocab_size(config["model"]),
        padding_to=padding_to,
    )


def model_vocab_size(model_dir: str | Path) -> int:
    """The embedding rows of the base model (token ids at or above are refused)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config") or config
    return int(text["vocab_size"])
