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
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from hpcrl_bootstrap.catalogue import PER_STAGE
from hpcrl_bootstrap.motifs import TASKS
from hpcrl_common.replay import REPLAY_FILE, replay_line

MARKER = "BOOTSTRAP_READY"
INFO_FILE = "bootstrap.json"
CORPUS_FILE = "corpus.json"  # the measured catalogue: source, stage, status, GFLOPS
# Bump when the corpus, prompts or training change in a way the settings do not show.
FORMAT_VERSION = 16  # 11 and 17 were catalogue changes tried and reverted

log = structlog.get_logger("hpcrl.learner.bootstrap")


@dataclass(frozen=True)
class BootstrapSettings:
    seed: int = 0
    task: str = "matmul"
    # Several tasks, one policy writing all of them (hpcrl-bootstrap --tasks); empty: `task`
    # alone. Hashed only when there are several, so a one-task build keeps its hash.
    tasks: tuple[str, ...] = ()
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

    def task_names(self) -> tuple[str, ...]:
        """The tasks the policy is taught, in the order given (one: ``task``)."""
        return self.tasks or (self.task,)

    def resolved(self) -> BootstrapSettings:
        """The host's ISA for auto; one task always as ``task``, several in the order of
        :data:`TASKS` with ``task`` their first (equal sets of tasks, equal settings)."""
        order = {name: n for n, name in enumerate(TASKS)}
        names = tuple(sorted(self.task_names(), key=lambda name: (order.get(name, 99), name)))
        settings = dataclasses.replace(self, task=names[0], tasks=names if len(names) > 1 else ())
        return settings if self.isa != "auto" else dataclasses.replace(settings, isa=host_isa())

    def as_dict(self) -> dict[str, Any]:
        """The resolved settings as hashed and recorded: ``tasks`` only when several, so a
        one-task build's hash (and every model cached under it) is what it always was."""
        fields = dataclasses.asdict(self.resolved())
        if not fields["tasks"]:
            del fields["tasks"]
        return fields

    def key(self) -> str:
        payload = json.dumps({"format": FORMAT_VERSION, **self.as_dict()}, sort_keys=True)
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
    """The model directory at ``out``, built first if it is missing or ``force`` (its replay
    file written if a build from before the file lacks it)."""
    out = Path(out)
    if is_ready(out) and not force:
        log.info("bootstrap model present", path=str(out))
        if not (out / REPLAY_FILE).is_file():
            _fill_replay(settings, out, progress)
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

    from hpcrl_bootstrap.examples import chat_texts
    from hpcrl_bootstrap.model import ModelShape, build_model
    from hpcrl_bootstrap.tokenizer import train_tokenizer
    from hpcrl_bootstrap.train import TrainSettings, encode_examples, save_model, train

    def report(stage: str, **fields: Any) -> None:
        if progress is not None:
            progress(stage, fields)

    hf_logging.disable_progress_bar()  # the bootstrap shows its own progress
    started = time.monotonic()
    settings = settings.resolved()
    taught, examples = _taught_examples(settings, cache_dir, report)
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
    write_replay(where, examples, encoded, too_long)
    (where / CORPUS_FILE).write_text(json.dumps(_export(taught), indent=1) + "\n")
    mean_tokens = sum(len(e.input_ids) for e in encoded) / max(len(encoded), 1)
    return {
        "settings": settings.as_dict(),
        "key": settings.key(),
        "parameters": params,
        "vocab_size": len(tokenizer),
        **_catalogue_info(taught),
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


def _taught_examples(
    settings: BootstrapSettings, cache_dir: Path, report: Callable[..., None]
) -> tuple[list[_Taught], list[Any]]:
    """Each task's catalogue (measured, or from the cache in ``cache_dir``) and the examples
    the policy is trained on, in training order."""
    from hpcrl_bootstrap.examples import split_examples

    counts = split_examples(settings.examples, settings.task_names())
    taught = [_teach(settings, name, count, cache_dir, report) for name, count in counts.items()]
    examples = [example for one in taught for example in one.examples]
    if len(taught) > 1:
        # Tasks mixed: the tokenizer is trained on the first examples.
        random.Random(f"hpcrl-mix/{settings.seed}").shuffle(examples)
    return taught, examples


def _fill_replay(
    settings: BootstrapSettings,
    out: Path,
    progress: Callable[[str, dict[str, Any]], None] | None,
) -> None:
    """Writes replay.jsonl into a policy built before the file existed: the same examples
    drawn again from the catalogue (cached beside it; measured again, with progress, where
    this host's class has no cache), encoded by the policy's own tokenizer."""
    from transformers import AutoTokenizer

    from hpcrl_bootstrap.train import encode_examples

    settings = settings.resolved()

    def report(stage: str, **fields: Any) -> None:
        if progress is not None:
            progress(stage, fields)

    _, examples = _taught_examples(settings, out.parent, report)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    encoded, too_long = encode_examples(examples, tokenizer, settings.max_positions)
    write_replay(out, examples, encoded, too_long)
    log.info("replay examples written", path=str(out), examples=len(encoded))


@dataclass
class _Taught:
    """One task's measured catalogue, its pairs and the examples drawn from them."""

    task: str
    measured: list[Any]  # catalogue.Measured
    cache: Path
    pairs: Any  # examples.Pairs
    examples: list[Any]  # examples.Example


def _teach(
    settings: BootstrapSettings,
    name: str,
    count: int,
    cache_dir: Path,
    report: Callable[..., None],
) -> _Taught:
    """Plan and measure ``name``'s catalogue, sort it into pairs, draw ``count`` examples.
    For GEMM alone every call and random stream is the one a GEMM-only build always made."""
    from hpcrl_bootstrap import catalogue
    from hpcrl_bootstrap.examples import make_examples, pairs_from
    from hpcrl_common.task import builtin_seed, load_task

    task = load_task(name)
    per_stage = dict(enumerate(settings.kernels_per_stage, start=1))
    plan = catalogue.plan(settings.seed, settings.isa, per_stage, task=name)
    kernels = plan.all()
    distinct = len({catalogue.verdict_key(k) for k in kernels})
    report("catalogue", task=name, kernels=distinct, isa=settings.isa)
    measured, cache = catalogue.measure(
        kernels,
        task,
        settings.opt_level,
        cache_dir,
        progress=lambda done, total: report("measure", done=done, total=total),
    )
    pairs = pairs_from(plan, {catalogue.verdict_key(m.kernel): m for m in measured})
    tables = (
        ("correct", pairs.correct),
        ("deepen", pairs.deepen),
        ("improve", pairs.improve),
        ("repair", pairs.repair),
    )
    report(
        "pairs",
        task=name,
        **{mode: sum(map(len, table.values())) for mode, table in tables},
        left_out=dict(pairs.left_out) or "none",
    )
    examples = make_examples(
        settings.seed,
        count,
        task,
        pairs,
        settings.isa,
        seed_source=builtin_seed(name),
        stream=None if name == "matmul" else name,
    )
    return _Taught(name, measured, cache, pairs, examples)


def write_replay(
    where: Path, examples: Sequence[Any], encoded: Sequence[Any], too_long: Sequence[int]
) -> None:
    """replay.jsonl: the examples the policy was trained on, as their token ids (the
    learner's supervised replay term reads it); ``encoded`` are the ``examples`` not in
    ``too_long``, in order."""
    left_out = set(too_long)
    kept = [example for index, example in enumerate(examples) if index not in left_out]
    staging = where / f".{REPLAY_FILE}.{os.getpid()}"
    with staging.open("w", encoding="utf-8") as out:
        for example, one in zip(kept, encoded, strict=True):
            ids = one.input_ids
            out.write(
                replay_line(
                    ids[: one.prompt_len],
                    ids[one.prompt_len :],
                    stage=example.target_stage,
                    mode=example.mode,
                )
            )
    os.replace(staging, where / REPLAY_FILE)


def _export(taught: list[_Taught]) -> list[dict[str, Any]]:
    """corpus.json: the catalogue's rows; with several tasks, each row names its task."""
    from hpcrl_bootstrap import catalogue

    if len(taught) == 1:
        return catalogue.export(taught[0].measured)
    return [{"task": t.task, **row} for t in taught for row in catalogue.export(t.measured)]


def _catalogue_info(taught: list[_Taught]) -> dict[str, Any]:
    """bootstrap.json's catalogue and pairs: as they always were for one task, per task for
    several (with the examples each task brought)."""
    from hpcrl_bootstrap import catalogue

    def summary(one: _Taught) -> dict[str, Any]:
        return {**catalogue.summary(one.measured), "cache": str(one.cache)}

    if len(taught) == 1:
        return {"catalogue": summary(taught[0]), "pairs_left_out": dict(taught[0].pairs.left_out)}
    return {
        "catalogue": {t.task: summary(t) for t in taught},
        "pairs_left_out": {t.task: dict(t.pairs.left_out) for t in taught},
        "examples_by_task": {t.task: len(t.examples) for t in taught},
    }
