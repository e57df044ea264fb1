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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from hpcrl_bootstrap.catalogue import PER_STAGE

MARKER = "BOOTSTRAP_READY"
INFO_FILE = "bootstrap.json"
CORPUS_FILE = "corpus.json"  # the measured catalogue: source, stage, status, GFLOPS
# Bump when the corpus, prompts or training change in a way the settings do not show.
FORMAT_VERSION = 7

log = structlog.get_logger("hpcrl.learner.bootstrap")


@dataclass(frozen=True)
class BootstrapSettings:
    seed: int = 0
    task: str = "matmul"
    isa: str = "auto"  # the ISA the corpus and prompts target; auto: this host's best
    opt_level: str = "O3"  # gcc level the catalogue is timed at (the demo's)
    kernels_per_stage: tuple[int, ...] = tuple(PER_STAGE.values())  # catalogue, stages 1..6
    examples: int = 3_000
    vocab_size: int = 4096
    hidden_size: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 688
    # Room for the longest taught pair: a stage 5-6 prompt (its parent inside) plus the
    # target reach ~3,000 tokens, and at 2,048 half of the stage-5 examples were left out.
    max_positions: int = 3072
    steps: int = 700
    batch_size: int = 8
    learning_rate: float = 2e-3
    warmup_steps: int = 20
    precision: str = "auto"  # auto (bf16 autocast where the CPU has it), bf16, fp32

    def resolved(self) -> BootstrapSettings:
        return self if self.isa != "auto" else dataclasses.replace(self, isa=host_isa())

    def key(self) -> str:
        payload = json.dumps(
            {"format": FORMAT_VERSION, **dataclasses.asdict(self.resolved())}, sort_keys=True
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_dir(data_dir: Path, settings: BootstrapSettings) -> Path:
    return Path(data_dir) / "policy" / f"bootstrap-{settings.key()}"


def is_ready(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def host_isa() -> str:
    """What prompts name and kernels use on this host (the benchmarker's view of it)."""
    from hpcrl_benchmarker.host import detect

    return detect().prompt_isa


def cpu_has_bf16() -> bool:
    """Where bfloat16 autocast pays: the CPU multiplies bf16 natively."""
    from hpcrl_benchmarker.host import cpu_flags

    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


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
        info = _build(settings, staging, out.parent, progress)
        (staging / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        (staging / MARKER).write_text(
            json.dumps({"key": settings.key(), "built_at": time.time()}) + "\n"
        )
        if out.exists():
            if is_ready(out) and not force:  # another builder finished first: keep theirs
                return out
            shutil.rmtree(out)
        os.rename(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("bootstrap model built", path=str(out))
    return out


def _build(
    settings: BootstrapSettings,
    where: Path,
    cache_dir: Path,
    progress: Callable[[str, dict[str, Any]], None] | None,
) -> dict[str, Any]:
    # Imported here: the cached path (a model already built) needs neither torch nor the corpus.
    import torch
    from transformers.utils import logging as hf_logging

    from hpcrl_bootstrap import catalogue
    from hpcrl_bootstrap.examples import chat_texts, make_examples, pairs_from
    from hpcrl_bootstrap.model import ModelShape, build_model
    from hpcrl_bootstrap.tokenizer import train_tokenizer
    from hpcrl_bootstrap.train import TrainSettings, encode_examples, save_model, train
    from hpcrl_common.task import builtin_seed, load_task

    def report(stage: str, **fields: Any) -> None:
        if progress is not None:
            progress(stage, fields)

    hf_logging.disable_progress_bar()  # the bootstrap shows its own progress
    started = time.monotonic()
    settings = settings.resolved()
    task = load_task(settings.task)
    plan = catalogue.plan(
        settings.seed, settings.isa, dict(enumerate(settings.kernels_per_stage, start=1))
    )
    kernels = plan.all()
    report("catalogue", kernels=len({catalogue.verdict_key(k) for k in kernels}), isa=settings.isa)
    measured, cache = catalogue.measure(
        kernels,
        task,
        settings.opt_level,
        cache_dir,
        progress=lambda done, total: report("measure", done=done, total=total),
    )
    verdicts = {catalogue.verdict_key(m.kernel): m for m in measured}
    pairs = pairs_from(plan, verdicts)
    report(
        "pairs",
        **{
            mode: sum(map(len, table.values()))
            for mode, table in (
                ("correct", pairs.correct),
                ("deepen", pairs.deepen),
                ("improve", pairs.improve),
                ("repair", pairs.repair),
            )
        },
        left_out=dict(pairs.left_out) or "none",
    )
    examples = make_examples(
        settings.seed,
        settings.examples,
        task,
        pairs,
        settings.isa,
        seed_source=builtin_seed(settings.task),
    )
    report("tokenizer", vocab_size=settings.vocab_size)
    tokenizer = train_tokenizer(chat_texts(examples[:6000]), vocab_size=settings.vocab_size)
    tokenizer.model_max_length = settings.max_positions
    shape = ModelShape(
        hidden_size=settings.hidden_size,
        layers=settings.layers,
        heads=settings.heads,
        kv_heads=settings.kv_heads,
        intermediate_size=settings.intermediate_size,
        max_positions=settings.max_positions,
    )
    bf16 = settings.precision == "bf16" or (settings.precision == "auto" and cpu_has_bf16())
    train_settings = TrainSettings(
        steps=settings.steps,
        batch_size=settings.batch_size,
        learning_rate=settings.learning_rate,
        warmup_steps=settings.warmup_steps,
        max_tokens=settings.max_positions,
        bf16=bf16,
        seed=settings.seed,
    )
    encoded, too_long = encode_examples(examples, tokenizer, train_settings.max_tokens)
    # Per mode and stage: long examples are the higher stages' (a parent in the prompt, a
    # long kernel after it), so a total alone hides a stage that is barely taught.
    too_long_by_kind = dict(
        sorted(Counter(f"{examples[i].mode}@{examples[i].target_stage}" for i in too_long).items())
    )
    if too_long:
        report(
            "examples",
            kept=len(encoded),
            left_out_longer_than_max_positions=len(too_long),
            by_mode_and_stage=too_long_by_kind,
        )
    model = build_model(shape, tokenizer, settings.seed)
    params = sum(p.numel() for p in model.parameters())
    report("train", steps=settings.steps, parameters=params, examples=len(encoded), bf16=bf16)
    summary = train(
        model,
        encoded,
        train_settings,
        tokenizer.pad_token_id,
        on_step=lambda info: report("step", info=info),
    )
    where.mkdir(parents=True)
    save_model(model, tokenizer, where)
    (where / CORPUS_FILE).write_text(json.dumps(catalogue.export(measured), indent=1) + "\n")
    mean_tokens = sum(len(e.input_ids) for e in encoded) / max(len(encoded), 1)
    return {
        "settings": dataclasses.asdict(settings),
        "key": settings.key(),
        "parameters": params,
        "vocab_size": len(tokenizer),
        "catalogue": {**catalogue.summary(measured), "cache": str(cache)},
        "pairs_left_out": dict(pairs.left_out),
        "examples_by_mode": dict(sorted(Counter(e.mode for e in examples).items())),
        "examples_kept": len(encoded),
        "examples_left_out_too_long": len(too_long),
        "examples_left_out_too_long_by_mode_and_stage": too_long_by_kind,
        "mean_tokens_per_example": round(mean_tokens, 1),
        "bf16_autocast": bf16,
        "training": dataclasses.asdict(summary),
        "build_seconds": round(time.monotonic() - started, 1),
        "torch_threads": torch.get_num_threads(),
    }
