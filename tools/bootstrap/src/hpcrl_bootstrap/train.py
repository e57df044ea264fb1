"""Supervised fine-tuning of a small Qwen2 model on (prompt -> kernel) pairs, on CPU.

The loss covers the completion tokens only (the kernel block and the end-of-turn token), as
the prompt is given at sampling time. Batches group examples of similar length, so padding
costs little.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from hpcrl_bootstrap.examples import Example
from hpcrl_bootstrap.tokenizer import render_chat

IGNORE = -100


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 300
    batch_size: int = 8
    learning_rate: float = 2e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    max_tokens: int = 2048  # longer examples are left out
    bf16: bool = False  # autocast matmuls to bfloat16 (fast where the CPU has avx512_bf16)
    seed: int = 0


@dataclass(frozen=True)
class Encoded:
    input_ids: list[int]
    prompt_len: int


@dataclass
class StepInfo:
    step: int
    steps: int
    loss: float
    tokens: int
    lr: float
    seconds: float


@dataclass(frozen=True)
class TrainSummary:
    steps: int
    examples_seen: int
    tokens_seen: int
    first_loss: float
    final_loss: float
    seconds: float
    threads: int


def encode_examples(
    examples: Sequence[Example], tokenizer: PreTrainedTokenizerFast, max_tokens: int
) -> tuple[list[Encoded], list[int]]:
    """Prompt (chat template with the generation prompt) + completion + end of turn; and the
    indices of the examples longer than ``max_tokens``, left out (the caller reports them)."""
    prompts = [render_chat(tokenizer, [m.model_dump() for m in ex.prompt]) for ex in examples]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer([ex.completion for ex in examples], add_special_tokens=False)[
        "input_ids"
    ]
    eos = tokenizer.eos_token_id
    encoded, too_long = [], []
    for index, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        ids = [*p, *c, eos]
        if len(ids) <= max_tokens:
            encoded.append(Encoded(ids, len(p)))
        else:
            too_long.append(index)
    return encoded, too_long


def batches(
    encoded: Sequence[Encoded], batch_size: int, seed: int, steps: int
) -> list[list[Encoded]]:
    """``steps`` batches; examples of similar length together, batch order shuffled."""
    rng = random.Random(f"hpcrl-batches/{seed}")
    out: list[list[Encoded]] = []
    while len(out) < steps:
        order = list(encoded)
        rng.shuffle(order)
        chunk = batch_size * 32
        epoch = []
        for start in range(0, len(order), chunk):
            part = sorted(order[start : start + chunk], key=lambda e: len(e.input_ids))
            epoch += [part[n : n + batch_size] for n in range(0, len(part), batch_size)]
        rng.shuffle(epoch)
        out += [b for b in epoch if len(b) == batch_size] or epoch
    return out[:steps]


def collate(batch: Sequence[Encoded], pad_id: int, multiple: int = 64) -> dict[str, torch.Tensor]:
    """Right-padded to a multiple of ``multiple`` tokens.

    Few distinct shapes matter on CPU: oneDNN prepares kernels per shape, and measured steps
    with a fresh width each time ran 5-20 times slower than with repeated widths. Causal
    attention never lets a real token see the padding after it, so no attention mask is needed
    (and without one, attention takes its fused causal path).
    """
    longest = max(len(e.input_ids) for e in batch)
    width = -(-longest // multiple) * multiple
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, e in enumerate(batch):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, e.prompt_len : n] = ids[row, e.prompt_len : n]
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def lr_at(step: int, settings: TrainSettings) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    peak = settings.learning_rate
    if step < settings.warmup_steps:
        return peak * (step + 1) / settings.warmup_steps
    span = max(settings.steps - settings.warmup_steps, 1)
    progress = min((step - settings.warmup_steps) / span, 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def completion_loss(model: Qwen2ForCausalLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the completion tokens (44 % of the build's tokens). The output
    layer and the log-softmax run on their positions only, not on the prompt's, whose logits
    the loss would ignore: ~2 % of a step at the build's lengths on two threads (attention is
    ~46 % there), 1.3x the tokens/s at bench/learner_step.py's shorter ones on one."""
    hidden = model.get_decoder()(input_ids=batch["input_ids"]).last_hidden_state
    targets = batch["labels"][:, 1:]
    taught = targets != IGNORE
    logits = model.get_output_embeddings()(hidden[:, :-1][taught])
    return torch.nn.functional.cross_entropy(logits.float(), targets[taught])


def train(
    model: Qwen2ForCausalLM,
    encoded: Sequence[Encoded],
    settings: TrainSettings,
    pad_id: int,
    on_step: Callable[[StepInfo], None] | None = None,
) -> TrainSummary:
    torch.manual_seed(settings.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": settings.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=settings.learning_rate,
        betas=(0.9, 0.95),
    )
    model.train()
    started = time.monotonic()
    first = last = float("nan")
    tokens = seen = 0
    plan = batches(encoded, settings.batch_size, settings.seed, settings.steps)
    for step, chosen in enumerate(plan):
        lr = lr_at(step, settings)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = collate(chosen, pad_id)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
            loss = completion_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        last = float(loss.detach())
        first = last if step == 0 else first
        tokens += int(batch["attention_mask"].sum())
        seen += len(chosen)
        if on_step is not None:
            on_step(StepInfo(step + 1, len(plan), last, tokens, lr, time.monotonic() - started))
    model.eval()
    return TrainSummary(
        steps=len(plan),
        examples_seen=seen,
        tokens_seen=tokens,
        first_loss=first,
        final_loss=last,
        seconds=round(time.monotonic() - started, 1),
        threads=torch.get_num_threads(),
    )


def save_model(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path, temperature: float = 0.8
) -> None:
    """An ordinary Hugging Face model directory (config, safetensors, tokenizer, generation)."""
    model.generation_config.do_sample = True
    model.generation_config.temperature = temperature
    model.generation_config.top_p = 0.95
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.max_new_tokens = 1024
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _widen_compatibility(out, tokenizer)


def _widen_compatibility(out: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    """Let transformers 4.x (which a vLLM build may pin) read what 5.x wrote.

    Only additive keys and class names both major versions know; 5.x reads the result as well
    (the tests load it back).
    """
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    config.setdefault("torch_dtype", config.get("dtype", "float32"))
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tok_path = out / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text())
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok.pop("backend", None)
    extra = tok.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        tok["additional_special_tokens"] = extra
    tok["chat_template"] = tokenizer.chat_template
    tok_path.write_text(json.dumps(tok, indent=2, sort_keys=True) + "\n")
