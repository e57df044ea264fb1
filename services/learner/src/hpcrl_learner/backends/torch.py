"""The `torch` backend: transformers + peft + our GRPO loss, one process, CPU or one GPU."""

from __future__ import annotations

import functools
import hashlib
import math
import shutil
import time
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import structlog
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from hpcrl_learner.backends import StepResult
from hpcrl_learner.batches import (
    Collated,
    TrainSequence,
    by_prompt,
    collate,
    collate_completions,
    micro_batches,
)
from hpcrl_learner.config import LearnerSettings
from hpcrl_learner.grpo import LossSettings, LossStats, grpo_loss, token_logprobs_and_entropy
from hpcrl_learner.replay import ReplayExample, load_replay, pick, read_examples, split_probe
from hpcrl_learner.schedule import lr_factor

log = structlog.get_logger("hpcrl.learner.trainer")

OPTIMIZER_FILE = "optimizer.pt"
# Files a generator needs beside the weights to load a version directory on its own.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Reference log-probs kept per sequence (by its tokens), so a step that is taken again (a
# failed or skipped step, a redelivered group) does not recompute them: ~4 KB a sequence.
REFERENCE_CACHE_SEQUENCES = 4096


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, lora: bool) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    # bf16 base weights are fine under LoRA (the adapters stay float32), but a full
    # fine-tune in bf16 rounds away updates as small as lr 5e-7: full training is float32.
    return torch.bfloat16 if device.type == "cuda" and lora else torch.float32


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def resolve_autocast(name: str, device: torch.device) -> torch.dtype | None:
    """The dtype the forward/backward passes autocast to, or None (no autocast)."""
    if name == "off":
        return None
    if name == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    if device.type == "cpu":
        # Where the CPU multiplies bf16 natively; emulated bf16 is slower than float32.
        return torch.bfloat16 if cpu_flags() & {"avx512_bf16", "amx_bf16"} else None
    return None


def sequence_key(seq: TrainSequence) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(len(seq.prompt_ids).to_bytes(8, "little"))
    digest.update(np.ascontiguousarray(seq.prompt_ids, dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(seq.completion_ids, dtype=np.int64).tobytes())
    return digest.digest()


@dataclass
class _Prompt:
    """A prompt the model has run: its keys and values per layer, [1, heads, P, head_dim]
    each, and its last hidden state [1, 1, H] (it predicts the first completion token)."""

    keys_values: list[tuple[torch.Tensor, torch.Tensor]]
    last: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [t for pair in self.keys_values for t in pair] + [self.last]

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> _Prompt:
        """The inverse of :meth:`tensors`."""
        *flat, last = tensors
        return cls(list(zip(flat[0::2], flat[1::2], strict=True)), last)


@dataclass
class _Accumulated:
    """The part of the next step that :meth:`TorchTrainer.accumulate` already computed."""

    normalizer: float  # the provisional denominator its gradient was divided by
    # Held, so that no id among ``ids`` is reused while counted.
    sequences: list[TrainSequence] = field(default_factory=list)
    stats: LossStats = field(default_factory=LossStats)
    fresh_stats: LossStats = field(default_factory=LossStats)
    seconds: float = 0.0

    @property
    def ids(self) -> set[int]:
        return {id(s) for s in self.sequences}


class TorchTrainer:
    """Holds the policy (and optionally the reference), the optimizer and the LR schedule."""

    def __init__(
        self,
        settings: LearnerSettings,
        *,
        resume_from: Path | None = None,
        optimizer_dir: Path | None = None,
        seed: int = 0,
    ) -> None:
        torch.manual_seed(seed)
        if settings.threads:
            torch.set_num_threads(settings.threads)
        self.settings = settings
        self.base_model = settings.model_path.resolve()
        self.lora = settings.lora.enabled
        self.format: Literal["full", "lora"] = "lora" if self.lora else "full"
        self.device = resolve_device(settings.device)
        self.dtype = resolve_dtype(settings.dtype, self.device, self.lora)
        self.autocast = resolve_autocast(settings.autocast, self.device)
        self._reference_cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.loss_settings: LossSettings = settings  # the loss reads its own fields
        self.model = self._load_policy(resume_from)
        self.reference = self._load_reference()
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.probe, self.replay = self._load_taught(settings)
        self._early: _Accumulated | None = None
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=settings.learning_rate,
            betas=settings.adam_betas,
            weight_decay=settings.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            functools.partial(
                lr_factor,
                warmup_steps=settings.warmup_steps,
                decay_steps=settings.decay_steps,
                min_lr_ratio=settings.min_lr_ratio,
            ),
        )
        if optimizer_dir is not None and (optimizer_dir / OPTIMIZER_FILE).exists():
            saved = torch.load(
                optimizer_dir / OPTIMIZER_FILE, map_location=self.device, weights_only=True
            )
            self.optimizer.load_state_dict(saved["optimizer"])
            self.scheduler.load_state_dict(saved["scheduler"])
        log.info(
            "policy loaded",
            base=str(self.base_model),
            resume_from=str(resume_from),
            format=self.format,
            device=str(self.device),
            dtype=str(self.dtype),
            autocast=str(self.autocast) if self.autocast else "off",
            threads=torch.get_num_threads(),
            trainable=sum(p.numel() for p in self.params),
            reference=self.reference is not None or (self.lora and settings.beta > 0),
            replay_examples=len(self.replay),
            probe_examples=len(self.probe),
        )
        if self.probe:
            log.info("taught-set likelihood at start", taught_nll=self.taught_nll())

    # --- loading ------------------------------------------------------------------------

    def _load_taught(
        self, settings: LearnerSettings
    ) -> tuple[list[ReplayExample], list[ReplayExample]]:
        """(probe, replay) from the replay file; a probe without a file is switched off,
        replay without one is an error."""
        wanted = settings.probe_examples > 0
        if not wanted and settings.replay_coef == 0:
            return [], []
        path = settings.replay_file()
        if settings.replay_coef == 0 and not path.is_file():
            log.warning("no replay file: taught_nll is not measured", path=str(path))
            return [], []
        examples = read_examples(path, vocab_size=self.vocab_size)
        probe, rest = split_probe(
            examples, settings.probe_examples, max_tokens=settings.max_sequence_tokens
        )
        if settings.replay_coef == 0:
            return probe, []
        replay = load_replay(
            path,
            vocab_size=self.vocab_size,
            min_stage=settings.replay_min_stage,
            max_tokens=settings.max_sequence_tokens,
            examples=rest,
        )
        return probe, replay

    def _from_pretrained(self, path: Path) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype).to(self.device)

    def _load_policy(self, resume_from: Path | None) -> torch.nn.Module:
        if not self.lora:
            model = self._from_pretrained(resume_from or self.base_model)
        else:
            from peft import LoraConfig, PeftModel, get_peft_model

            base = self._from_pretrained(self.base_model)
            if resume_from is not None:
                model = PeftModel.from_pretrained(base, str(resume_from), is_trainable=True)
            else:
                lora = self.settings.lora
                model = get_peft_model(
                    base,
                    LoraConfig(
                        r=lora.r,
                        lora_alpha=lora.alpha,
                        lora_dropout=lora.dropout,
                        target_modules=lora.target_modules,
                        task_type="CAUSAL_LM",
                    ),
                )
        model.config.use_cache = False
        if self.settings.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            if self.lora:
                model.enable_input_require_grads()
        return model

    def _load_reference(self) -> torch.nn.Module | None:
        # beta = 0: no reference model at all. LoRA: the base with adapters switched off is
        # the reference, so it costs no memory. Full fine-tune: a frozen copy of the base.
        if self.settings.beta == 0 or self.lora:
            return None
        reference = self._from_pretrained(self.base_model).eval()
        reference.requires_grad_(False)
        return reference

    # --- the step -----------------------------------------------------------------------

    def _autocast(self) -> AbstractContextManager:
        if self.autocast is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _forward_logprobs(
        self, model: torch.nn.Module, batch: Collated
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the completion tokens and the policy's entropy there, both [B, C].

        The decoder runs under autocast; the output layer and the log-softmax run outside it
        (in the weights' dtype), on the completion positions only.
        """
        with self._autocast():
            hidden = model.get_decoder()(
                input_ids=batch.input_ids.to(self.device), use_cache=False
            ).last_hidden_state
        return self._head_logprobs(model, hidden, batch)

    def _head_logprobs(
        self, model: torch.nn.Module, hidden: torch.Tensor, batch: Collated
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.device
        picked = hidden[batch.rows.to(device), batch.cols.to(device)]
        head = model.get_output_embeddings()
        logits = head(picked.to(head.weight.dtype))
        logp, entropy = token_logprobs_and_entropy(
            logits, batch.targets.to(device), self.settings.logprob_temperature
        )
        return batch.scatter(logp), batch.scatter(entropy)

    def _forward_prompt(self, model: torch.nn.Module, prompt_ids: np.ndarray) -> _Prompt:
        """The shared prompt run once: its keys and values per layer and its last state."""
        prompt = torch.from_numpy(np.ascontiguousarray(prompt_ids))[None].to(self.device)
        with self._autocast():
            out = model.get_decoder()(input_ids=prompt, use_cache=True)
        keys_values = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        return _Prompt(keys_values, out.last_hidden_state[:, -1:])

    def _forward_completions(
        self, model: torch.nn.Module, prompt: _Prompt, batch: Collated
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_forward_logprobs` of completions (``collate_completions``) whose prompt
        ran already: each row attends to the prompt's cached keys and values."""
        rows = int(batch.input_ids.shape[0])
        cache = DynamicCache(
            ddp_cache_data=[
                (keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1))
                for keys, values in prompt.keys_values
            ]
        )
        with self._autocast():
            hidden = model.get_decoder()(
                input_ids=batch.input_ids.to(self.device), past_key_values=cache, use_cache=True
            ).last_hidden_state
        last = prompt.last.to(hidden.dtype).expand(rows, -1, -1)
        return self._head_logprobs(model, torch.cat([last, hidden], dim=1), batch)

    def _shares_prompts(self, sequences: Sequence[TrainSequence]) -> bool:
        return (
            self.settings.share_prompt_forward
            and not self.settings.gradient_checkpointing
            and len(sequences) > 1
        )

    def _reference_logprobs(
        self, sequences: Sequence[TrainSequence], batch: Collated, shared: bool = False
    ) -> torch.Tensor | None:
        """The reference's log-probs, [B, C]: computed once per sequence, then cached.
        ``shared``: ``batch`` is ``collate_completions`` of sequences sharing a prompt."""
        if self.settings.beta == 0:
            return None
        keys = [sequence_key(s) for s in sequences]
        cache = self._reference_cache
        if not all(key in cache for key in keys):
            context: AbstractContextManager = nullcontext()
            model = self.reference
            if model is None:  # LoRA: the base model is the reference
                model = self.model
                context = self.model.disable_adapter()  # type: ignore[operator]
            with torch.no_grad(), context:
                if shared:
                    prompt = self._forward_prompt(model, sequences[0].prompt_ids)
                    logp = self._forward_completions(model, prompt, batch)[0]
                else:
                    logp = self._forward_logprobs(model, batch)[0]
            logp_rows = logp.float().cpu().numpy()
            for row, (key, seq) in enumerate(zip(keys, sequences, strict=True)):
                cache[key] = logp_rows[row, : len(seq.completion_ids)].copy()
            while len(cache) > REFERENCE_CACHE_SEQUENCES:
                cache.popitem(last=False)
        out = torch.zeros(batch.completion_mask.shape, dtype=torch.float32)
        for row, key in enumerate(keys):
            cache.move_to_end(key)
            values = cache[key]
            out[row, : len(values)] = torch.from_numpy(values)
        return out.to(self.device)

    def _denominator(self, sequences: Sequence[TrainSequence]) -> float:
        """What the step's loss is divided by: its tokens ("token") or its sequences."""
        if self.loss_settings.aggregation == "token":
            return float(sum(len(s.completion_ids) for s in sequences))
        return float(sum(1 for s in sequences if len(s.completion_ids)))

    def _backward(
        self,
        sequences: Sequence[TrainSequence],
        normalizer: float,
        stats: LossStats,
        fresh_stats: LossStats,
    ) -> None:
        """Adds the gradient of ``sequences``' share of a loss divided by ``normalizer``."""
        self.model.train()
        with_tokens = [s for s in sequences if len(s.completion_ids)]
        # Fresh samples (from the current weights) in micro-batches of their own, so their
        # sampler KL is measured apart: on them it checks the sampler against the trainer,
        # free of the drift that older samples carry by design.
        for fresh in (True, False):
            part = [s for s in with_tokens if s.fresh == fresh]
            apart: list[TrainSequence] = []
            for group in by_prompt(part):
                if self._shares_prompts(group):
                    self._backward_sharing(group, normalizer, stats, fresh_stats if fresh else None)
                else:
                    apart.extend(group)
            for micro in micro_batches(
                apart, self.settings.micro_batch_size, self.settings.micro_batch_tokens
            ):
                batch = collate(micro)
                ref = self._reference_logprobs(micro, batch)
                logp, entropy = self._forward_logprobs(self.model, batch)
                self._loss_backward(
                    batch, logp, entropy, ref, normalizer, stats, fresh_stats if fresh else None
                )

    def _backward_sharing(
        self,
        group: Sequence[TrainSequence],
        normalizer: float,
        stats: LossStats,
        fresh_stats: LossStats | None,
    ) -> None:
        """:meth:`_backward` of sequences sharing a prompt: the prompt runs once. Its keys,
        values and last state enter each micro-batch as detached leaves that collect their
        gradients; one backward pass through the prompt then takes those gradients to the
        weights, so the result is the unshared one's, up to float rounding."""
        prompt = self._forward_prompt(self.model, group[0].prompt_ids)
        outputs = prompt.tensors()
        leaves = [t.detach().requires_grad_() for t in outputs]
        detached = _Prompt.of(leaves)
        for micro in micro_batches(
            group, self.settings.micro_batch_size, self.settings.micro_batch_tokens
        ):
            batch = collate_completions(micro)
            ref = self._reference_logprobs(micro, batch, shared=True)
            logp, entropy = self._forward_completions(self.model, detached, batch)
            self._loss_backward(batch, logp, entropy, ref, normalizer, stats, fresh_stats)
        pairs = [
            (out, leaf.grad)
            for out, leaf in zip(outputs, leaves, strict=True)
            if leaf.grad is not None
        ]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])

    def _loss_backward(
        self,
        batch: Collated,
        logp: torch.Tensor,
        entropy: torch.Tensor,
        ref: torch.Tensor | None,
        normalizer: float,
        stats: LossStats,
        fresh_stats: LossStats | None,
    ) -> None:
        mask = batch.completion_mask.to(self.device)
        out = grpo_loss(
            logp,
            batch.sampling_logprobs.to(self.device),
            batch.advantages.to(self.device),
            mask,
            self.loss_settings,
            ref_logp=ref,
            normalizer=normalizer,
            credit=batch.credit.to(self.device),
        )
        out.loss.backward()
        out.stats.entropy_sum = float((entropy * mask).sum())
        out.stats.entropy_tokens = out.stats.tokens
        stats.add(out.stats)
        if fresh_stats is not None:
            fresh_stats.add(out.stats)

    def accumulate(self, sequences: Sequence[TrainSequence]) -> None:
        """Runs the forward and backward passes of part of the next step now.

        The learner passes each group as it arrives, so the step's compute overlaps the
        generation of its last groups; :meth:`step` then computes only what was not passed
        here. The update is the one :meth:`step` alone would make, up to float rounding.
        """
        started = time.perf_counter()
        if self._early is None:
            self.optimizer.zero_grad(set_to_none=True)
            # The step's true denominator is known only at the step; one near it keeps the
            # summed gradients in range (float16), and the step rescales them exactly.
            provisional = max(self._denominator(sequences) * self.settings.groups_per_step, 1.0)
            self._early = _Accumulated(normalizer=provisional)
        early = self._early
        try:
            self._backward(sequences, early.normalizer, early.stats, early.fresh_stats)
        except BaseException:
            self.discard()
            raise
        early.sequences.extend(sequences)
        early.seconds += time.perf_counter() - started

    @property
    def accumulated(self) -> int:
        """Sequences of the next step already computed by :meth:`accumulate`."""
        return 0 if self._early is None else len(self._early.sequences)

    def discard(self) -> None:
        """Forgets what :meth:`accumulate` computed; the next step computes everything."""
        self._early = None
        self.optimizer.zero_grad(set_to_none=True)

    def _take_early(self, sequences: Sequence[TrainSequence]) -> _Accumulated | None:
        """What was accumulated for exactly this step, or None (and then nothing is kept)."""
        early, self._early = self._early, None
        if early is None:
            return None
        if not early.ids <= {id(s) for s in sequences}:
            # Groups accumulated, then handed back without a step: their gradient must not
            # count again when they are redelivered as new sequences.
            log.warning(
                "accumulated gradient of sequences not in this step; recomputing",
                accumulated=len(early.sequences),
            )
            return None  # the step zeroes the gradient
        return early

    def step(self, sequences: Sequence[TrainSequence]) -> StepResult:
        """One optimizer step over all ``sequences`` (micro-batched).

        Sequences already passed to :meth:`accumulate` are not computed again.
        """
        started = time.perf_counter()
        try:
            return self._step(sequences, started)
        except BaseException:
            self.discard()
            raise

    def _step(self, sequences: Sequence[TrainSequence], started: float) -> StepResult:
        normalizer = self._denominator(sequences)
        early = self._take_early(sequences)
        stats, fresh_stats = LossStats(), LossStats()
        early_seconds = 0.0
        if early is None:
            self.optimizer.zero_grad(set_to_none=True)
            rest = list(sequences)
        else:
            rescale = early.normalizer / max(normalizer, 1.0)
            for param in self.params:
                if param.grad is not None:
                    param.grad.mul_(rescale)
            early.stats.loss *= rescale
            early.fresh_stats.loss *= rescale
            stats.add(early.stats)
            fresh_stats.add(early.fresh_stats)
            early_seconds = early.seconds
            done = early.ids
            rest = [s for s in sequences if id(s) not in done]
        lr = float(self.scheduler.get_last_lr()[0])
        self._backward(rest, normalizer, stats, fresh_stats)
        replay_nll = self._replay_backward() if self.replay else math.nan
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.settings.max_grad_norm))
        skipped = not math.isfinite(grad_norm)
        if skipped:
            # A non-finite gradient would poison AdamW's moments for good: drop this step.
            log.warning("non-finite gradient norm; update skipped", grad_norm=grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.scheduler.step()  # the schedule counts updates, not attempts
        self.optimizer.zero_grad(set_to_none=True)
        taught_nll = self.taught_nll() if self.probe else math.nan
        elapsed = time.perf_counter() - started + early_seconds
        return StepResult(
            skipped=skipped,
            **stats.means(),
            sampler_kl_fresh=(
                fresh_stats.means()["sampler_kl"] if fresh_stats.tokens else math.nan
            ),
            grad_norm=grad_norm if not skipped else -1.0,
            learning_rate=lr,
            train_seconds=elapsed,
            early_seconds=early_seconds,
            replay_nll=replay_nll,
            taught_nll=taught_nll,
        )

    def _replay_backward(self) -> float:
        """Adds the gradient of replay_coef x the mean negative log-likelihood (per completion
        token) of this update's replay examples; returns that mean."""
        self.model.train()
        chosen = pick(self.replay, self.settings.replay_per_step, self.scheduler.last_epoch)
        sequences = self._teaching_sequences(chosen)
        tokens = sum(len(s.completion_ids) for s in sequences)
        total = 0.0
        for micro in micro_batches(
            sequences, self.settings.micro_batch_size, self.settings.micro_batch_tokens
        ):
            batch = collate(micro)
            logp, _ = self._forward_logprobs(self.model, batch)
            nll = -(logp * batch.completion_mask.to(self.device)).sum()
            (nll * (self.settings.replay_coef / tokens)).backward()
            total += float(nll.detach())
        return total / tokens

    def _teaching_sequences(self, examples: Sequence[ReplayExample]) -> list[TrainSequence]:
        return [
            TrainSequence(
                e.prompt_ids,
                e.completion_ids,
                np.zeros(len(e.completion_ids), dtype=np.float32),
                0.0,
            )
            for e in examples
        ]

    @torch.no_grad()
    def taught_nll(self) -> float:
        """The policy's negative log-likelihood per completion token of the probe: taught
        examples held out of replay. GRPO's own KL sees only prompts the policy samples; this
        sees it forget how to extend parents it did not write."""
        self.model.eval()
        sequences = self._teaching_sequences(self.probe)
        total = 0.0
        for micro in micro_batches(
            sequences, self.settings.micro_batch_size, self.settings.micro_batch_tokens
        ):
            batch = collate(micro)
            logp, _ = self._forward_logprobs(self.model, batch)
            total -= float((logp.float() * batch.completion_mask.to(self.device)).sum())
        return total / sum(len(s.completion_ids) for s in sequences)

    @torch.no_grad()
    def logprobs(self, sequences: Sequence[TrainSequence]) -> list[np.ndarray]:
        """The trainer's log-probs of each sequence's completion tokens (evaluation)."""
        self.model.eval()
        result = []
        for seq in sequences:
            batch = collate([seq])
            logp = self._forward_logprobs(self.model, batch)[0][0]
            result.append(logp[batch.completion_mask[0] > 0].float().cpu().numpy())
        return result

    # --- saving -------------------------------------------------------------------------

    def save_version(self, directory: Path) -> None:
        """A directory a generator can load by itself: HF model (or adapter) + tokenizer."""
        self.model.save_pretrained(str(directory))
        if self.lora:
            return
        for name in TOKENIZER_FILES:
            source = self.base_model / name
            if source.is_file() and not (directory / name).exists():
                shutil.copy2(source, directory / name)

    def save_optimizer(self, directory: Path) -> None:
        torch.save(
            {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
            directory / OPTIMIZER_FILE,
        )


def torch_backend(
    settings: LearnerSettings, resume_from: Path | None, optimizer_dir: Path | None, seed: int
) -> TorchTrainer:
    return TorchTrainer(settings, resume_from=resume_from, optimizer_dir=optimizer_dir, seed=seed)
