"""The `learner` section of the experiment config."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from hpcrl_common.config import Section, ServiceConfig, related_default
from hpcrl_common.replay import REPLAY_FILE
from hpcrl_common.service import ServiceSection
from hpcrl_common.stages import FIRST_STAGE, LAST_STAGE

Aggregation = Literal["token", "sequence"]


class LossSettings(Section):
    """The loss's settings, defaults and bounds: the `learner` config section is one of these
    (``LearnerSettings`` extends it), and the trainer passes it to ``grpo.grpo_loss`` as
    is."""

    beta: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="KL coefficient against "
        "the base model (k3 estimator); 0 loads no reference model",
    )
    clip_eps: float = Field(0.2, gt=0, lt=1, description="delta of the clipped objective")
    # DAPO's clip-higher: rare tokens with a positive advantage can gain probability, so
    # entropy does not collapse.
    clip_eps_high: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="DAPO clip-higher: the ratio's upper clip is "
        "1 + clip_eps_high (unset: clip_eps)",
    )
    aggregation: Aggregation = Field(
        "token", description="loss mean over all completion tokens, or per sequence first"
    )
    max_log_ratio: float = Field(
        2.0, gt=0, description="tokens with |log(pi_theta / pi_sampling)| above are masked"
    )


class LoraSettings(Section):
    enabled: bool = Field(
        related_default("learner.lora.enabled"),
        description="train a LoRA adapter instead of all weights",
    )
    r: int = Field(16, ge=1, le=1024, description="LoRA rank")
    alpha: int = Field(32, ge=1, description="LoRA alpha (scale = alpha / r)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout")
    target_modules: list[str] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        description="module names that get adapters",
    )


class LearnerSettings(ServiceSection, LossSettings):
    """The learner's section; the loss's own settings (beta, clip_eps, clip_eps_high,
    aggregation, max_log_ratio) come from ``LossSettings``."""

    metrics_port: int = Field(9103, ge=0, le=65535, description="0 picks a free port")
    stop_grace_s: float = Field(
        90.0,
        ge=0,
        description="on SIGTERM/SIGINT, how long a step already running may take "
        "to finish and commit (one abandoned is trained again after the restart); keep it "
        "below the kill wait of what stops it (systemd's TimeoutStopSec, the lead of Slurm's "
        "--signal)",
    )
    backend: Literal["torch", "swift"] = Field(
        "torch",
        description="torch: one process, CPU or one GPU; swift: ms-swift Megatron "
        "workers on GPUs (own environment; refuses to start, naming what is missing)",
    )
    model_path: Path = Field(
        related_default("learner.model_path"), description="base model directory (version 0)"
    )
    checkpoint_dir: Path = Field(
        related_default("learner.checkpoint_dir"),
        description="checkpoint store on a filesystem shared with the generators",
    )
    groups_per_step: int = Field(
        related_default("learner.groups_per_step"),
        ge=1,
        le=4096,
        description="rollout batches (groups) per step; broker.prefetch is raised to at least this",
    )
    learning_rate: float = Field(
        5e-7, ge=0, description="AdamW learning rate (0: the no-update baseline)"
    )
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up steps")
    decay_steps: int = Field(
        0,
        ge=0,
        description="after the warm-up, decay the learning rate linearly to "
        "learning_rate x min_lr_ratio over this many updates, then hold it there; 0: constant",
    )
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="the decay's floor, as a share of learning_rate"
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping (global L2 norm)")
    scale_advantages: bool = Field(
        True, description="A = (R - mean) / (std + adv_eps); false: A = R - mean (Dr. GRPO)"
    )
    skip_zero_variance_groups: bool = Field(
        False,
        description="DAPO: do not train on a group whose rewards are all equal (no "
        "forward/backward, not in the loss's normaliser; still acked and counted as trained); "
        "with beta > 0 such groups then add no KL term either",
    )
    adv_eps: float = Field(1e-4, ge=0, description="epsilon of A = (R - mean) / (std + eps)")
    negative_advantage_scale: float = Field(
        1.0,
        gt=0,
        le=1,
        description="negative advantages are multiplied by this (1: plain GRPO); below 1 a "
        "failed attempt at a risky technique pushes the policy away from it less than a "
        "success pulls toward it",
    )
    skip_copied_lines: bool = Field(
        False,
        description="the policy-gradient term skips completion tokens on lines copied "
        "verbatim from the prompt (the parent's unchanged lines): the advantage goes to the "
        "edit; the KL term still covers them",
    )
    max_staleness: int = Field(
        related_default("learner.max_staleness"),
        ge=0,
        description="a group whose oldest sample is more versions behind than this on "
        "arrival is dropped (acked, counted)",
    )
    logprob_temperature: float = Field(
        1.0,
        gt=0,
        description="temperature the sampling log-probs were computed at (the "
        "trainer's log-probs use the same)",
    )
    micro_batch_size: int = Field(8, ge=1, description="sequences per forward/backward pass")
    micro_batch_tokens: int = Field(
        16384,
        ge=0,
        description="at most this many padded tokens (sequences x width, padded "
        "to a multiple of 64) per forward/backward pass, a longer sequence alone; 0: no limit",
    )
    train_on_arrival: bool = Field(
        True,
        description="run a group's forward and backward passes as it arrives (the "
        "update still waits for the step's last group); false: all at the step, which holds "
        "no gradient between groups",
    )
    max_sequence_tokens: int = Field(
        related_default("learner.max_sequence_tokens"),
        ge=2,
        description="longer prompt+completion sequences are refused (the batch is dead-lettered)",
    )
    max_abs_reward: float = Field(
        10_000.0,
        gt=0,
        description="a batch with a reward beyond +- this is refused "
        "(dead-lettered): group_normalized rewards lie in [-100, scheduler.success_scale "
        "(100)], parent_relative below 9,900, raw ones are GFLOPS",
    )
    require_judged_text: bool = Field(
        True,
        description="train a completion only if the batch carries the hash of the text "
        "the benchmarker judged (completion_sha256) and its token ids decode to it (the "
        "tokenizer of model_path); false: samples without the hash are trained (results of "
        "older benchmarkers, during a rolling upgrade). A hash that does not match "
        "dead-letters the batch either way",
    )
    replay_coef: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="weight of the supervised replay term: each step adds this x the mean "
        "negative log-likelihood of replay_per_step taught examples to the GRPO loss, so the "
        "policy keeps what it was taught (0: off)",
    )
    replay_path: Path | None = Field(
        None,
        description="JSONL of taught examples as token ids (prompt_ids, completion_ids, "
        "stage, mode); unset: <model_path>/replay.jsonl, which the bootstrap writes",
    )
    replay_per_step: int = Field(8, ge=1, le=4096, description="replay examples per step")
    replay_min_stage: int = Field(
        FIRST_STAGE,
        ge=FIRST_STAGE,
        le=LAST_STAGE,
        description="replay only examples whose target stage is at least this",
    )
    probe_examples: int = Field(
        6,
        ge=0,
        le=256,
        description="taught examples of the replay file, spread over stages and modes and "
        "held out of replay, scored after every update: hpcrl_learner_taught_nll, which "
        "rises as the policy forgets how to extend parents it did not write (GRPO's KL sees "
        "only its own samples); no replay file: not measured (0: off)",
    )
    lora: LoraSettings = LoraSettings()
    device: str = Field("auto", description="auto (cuda if available), cpu, cuda, cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="weights dtype; auto: bfloat16 for LoRA on GPU, float32 otherwise "
        "(a bf16 full fine-tune rounds away updates of lr 5e-7)",
    )
    autocast: Literal["auto", "bf16", "off"] = Field(
        "auto",
        description="bfloat16 autocast of the forward/backward passes (the weights, "
        "the output layer and the loss stay in the weights' dtype); auto: bf16 on CUDA and on "
        "CPUs with avx512_bf16 or amx_bf16, off elsewhere",
    )
    threads: int = Field(
        0,
        ge=0,
        description="CPU threads of the forward and backward passes (torch.set_num_threads); "
        "0: torch's default, one per core (a node shared with a generator or a benchmarker "
        "may do better with fewer)",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="recompute activations in "
        "backward: less memory for long sequences, more "
        "compute",
    )
    share_prompt_forward: bool = Field(
        True,
        description="run a group's shared prompt through the model once and its "
        "completions on its cached keys and values (the gradient flows back through them), "
        "not the prompt once per completion; off with gradient_checkpointing",
    )
    keep_state_versions: int = Field(
        2, ge=1, description="optimizer-state snapshots kept in <checkpoint_dir>/learner-state"
    )
    trained_ids_memory: int = Field(
        100_000, ge=1000, description="batch ids remembered to ack redeliveries untrained"
    )

    @model_validator(mode="after")
    def _betas(self) -> LearnerSettings:
        if not all(0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"adam_betas must be in [0, 1), got {self.adam_betas}")
        if self.replay_coef > 0 and self.backend != "torch":
            raise ValueError("replay_coef > 0 needs the torch backend (swift has no replay term)")
        if self.skip_copied_lines and self.backend != "torch":
            raise ValueError(
                "skip_copied_lines needs the torch backend (swift credits every token)"
            )
        return self

    def replay_file(self) -> Path:
        return self.replay_path or self.model_path / REPLAY_FILE


class LearnerConfig(ServiceConfig):
    learner: LearnerSettings = LearnerSettings()
