"""Build the bootstrap policy once and cache it under the data directory.

The directory is named after a hash of every setting that changes the result
(``<data_dir>/policy/bootstrap-<hash>/``). It is built in a sibling temporary directory, the
marker file ``BOOTSTRAP_READY`` is written last, and only then is the directory renamed into
place, so a reader never sees a half-built model and two builders never mix their files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from hpcrl_learner.bootstrap.check import host_has_avx512

MARKER = "BOOTSTRAP_READY"
INFO_FILE = "bootstrap.json"
# Bump when the corpus, prompts or training change in a way the settings do not show.
FORMAT_VERSION = 3

log = structlog.get_logger("hpcrl.learner.bootstrap")


@dataclass(frozen=True)
class BootstrapSettings:
    seed: int = 0
    task: str = "matmul"
    examples: int = 3_000
    mistake_rate: float = 0.25
    vocab_size: int = 4096
    hidden_size: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 688
    max_positions: int = 2048
    steps: int = 300
    batch_size: int = 8
    learning_rate: float = 2e-3
    warmup_steps: int = 20
    precision: str = "auto"  # auto (bf16 autocast where the CPU has it), bf16, fp32

    def key(self) -> str:
        payload = json.dumps({"format": FORMAT_VERSION, **dataclasses.asdict(self)},
                             sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_dir(data_dir: Path, settings: BootstrapSettings) -> Path:
    return Path(data_dir) / "policy" / f"bootstrap-{settings.key()}"


def is_ready(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def ensure_model(
    settings: BootstrapSettings,
    out: Path,
    force: bool = False,
    progress: Callable[[str, dict[str, Any]], None] | None = None,
) -> Path:
    """The model directory at ``out``, built first if it is missing or ``force``."""
    out = Path(out)
    if is_ready(out) and not force:
        log.info("bootstrap model present", path=str(out))
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.building-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        info = _build(settings, staging, progress)
        (staging / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        (staging / MARKER).write_text(json.dumps({"key": settings.key(),
                                                  "built_at": time.time()}) + "\n")
        if out.exists():
            if is_ready(out) and not force:  # another builder finished first: keep theirs
                return out
            shutil.rmtree(out)
        os.rename(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("bootstrap model built", path=str(out))
    return out


def _build(settings: BootstrapSettings, where: Path,
           progress: Callable[[str, dict[str, Any]], None] | None) -> dict[str, Any]:
    # Imported here: the cached path (a model already built) needs neither torch nor the corpus.
    import torch
    from transformers.utils import logging as hf_logging

    from hpcrl_common.task import load_task
    from hpcrl_learner.bootstrap.examples import chat_texts, make_examples
    from hpcrl_learner.bootstrap.tokenizer import train_tokenizer
    from hpcrl_learner.bootstrap.train import (
        ModelShape,
        TrainSettings,
        build_model,
        encode_examples,
        save_model,
        train,
    )

    def report(stage: str, **fields: Any) -> None:
        if progress is not None:
            progress(stage, fields)

    hf_logging.disable_progress_bar()  # the bootstrap shows its own progress
    started = time.monotonic()
    task = load_task(settings.task)
    report("corpus", examples=settings.examples)
    examples = make_examples(settings.seed, settings.examples, task,
                             mistake_rate=settings.mistake_rate, seed_source=_seed_source())
    report("tokenizer", vocab_size=settings.vocab_size)
    tokenizer = train_tokenizer(chat_texts(examples[:6000]), vocab_size=settings.vocab_size)
    shape = ModelShape(hidden_size=settings.hidden_size, layers=settings.layers,
                       heads=settings.heads, kv_heads=settings.kv_heads,
                       intermediate_size=settings.intermediate_size,
                       max_positions=settings.max_positions)
    bf16 = settings.precision == "bf16" or (settings.precision == "auto" and cpu_has_bf16())
    train_settings = TrainSettings(steps=settings.steps, batch_size=settings.batch_size,
                                   learning_rate=settings.learning_rate,
                                   warmup_steps=settings.warmup_steps,
                                   max_tokens=settings.max_positions, bf16=bf16,
                                   seed=settings.seed)
    encoded = encode_examples(examples, tokenizer, train_settings.max_tokens)
    model = build_model(shape, tokenizer, settings.seed)
    params = sum(p.numel() for p in model.parameters())
    report("train", steps=settings.steps, parameters=params, examples=len(encoded), bf16=bf16)
    summary = train(model, encoded, train_settings, tokenizer.pad_token_id,
                    on_step=lambda info: report("step", info=info))
    where.mkdir(parents=True)
    save_model(model, tokenizer, where)
    mean_tokens = sum(len(e.input_ids) for e in encoded) / max(len(encoded), 1)
    return {
        "settings": dataclasses.asdict(settings),
        "key": settings.key(),
        "parameters": params,
        "vocab_size": len(tokenizer),
        "examples_kept": len(encoded),
        "mean_tokens_per_example": round(mean_tokens, 1),
        "bf16_autocast": bf16,
        "training": dataclasses.asdict(summary),
        "build_seconds": round(time.monotonic() - started, 1),
        "torch_threads": torch.get_num_threads(),
        "host_avx512": host_has_avx512(),
    }


def _seed_source() -> str | None:
    try:
        from importlib import resources

        seed = resources.files("hpcrl_scheduler") / "data" / "seeds" / "matmul.c"
        return seed.read_text() if seed.is_file() else None
    except (ImportError, OSError):
        return None

