"""What a bootstrap model writes, judged by the benchmarker's own pipeline.

Scheduler prompts for the buckets the first SQD iterations ask most (seed and improve, at
stages 1 and 2), parents drawn from the model's measured catalogue (``corpus.json``); each
completion goes through extraction, technique checks, the sandboxed compile, verification
and timing exactly as a reward would.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl_bootstrap.build import CORPUS_FILE, host_isa
from hpcrl_common.messages import ChatMessage
from hpcrl_common.prompts import build_prompt
from hpcrl_common.task import builtin_seed, load_task

BUCKETS: tuple[tuple[str, int], ...] = (("seed", 1), ("seed", 2), ("improve", 1), ("improve", 2))


@dataclass(frozen=True)
class Prompt:
    mode: str
    stage: int
    messages: tuple[ChatMessage, ...]
    parent_gflops: float | None = None


@dataclass
class Judged:
    prompt: Prompt
    completion: str
    status: str
    gflops: float | None
    techniques: list[str] = field(default_factory=list)

    @property
    def correct(self) -> bool:
        return self.status == "success"


@dataclass
class EvalReport:
    samples: list[Judged]
    temperature: float

    def rows(self) -> list[dict[str, Any]]:
        """Per (mode, stage): samples, share correct, GFLOPS range, share beating the parent."""
        out = []
        for mode, number in sorted({(s.prompt.mode, s.prompt.stage) for s in self.samples}):
            chosen = [s for s in self.samples if (s.prompt.mode, s.prompt.stage) == (mode, number)]
            speeds = sorted(s.gflops or 0.0 for s in chosen if s.correct)
            faster = [
                s
                for s in chosen
                if s.correct
                and s.prompt.parent_gflops
                and (s.gflops or 0.0) > s.prompt.parent_gflops
            ]
            out.append(
                {
                    "mode": mode,
                    "stage": number,
                    "samples": len(chosen),
                    "correct": len(speeds),
                    "share_correct": len(speeds) / len(chosen),
                    "min_gflops": speeds[0] if speeds else None,
                    "max_gflops": speeds[-1] if speeds else None,
                    "faster_than_parent": len(faster) if mode == "improve" else None,
                }
            )
        return out

    def statuses(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.samples:
            counts[s.status] = counts.get(s.status, 0) + 1
        return dict(sorted(counts.items()))


def eval_prompts(
    corpus: Sequence[dict[str, Any]],
    per_bucket: int,
    isa: str,
    seed: int,
    task_name: str = "matmul",
) -> list[Prompt]:
    """``per_bucket`` prompts for each of :data:`BUCKETS` (pure, seeded)."""
    task = load_task(task_name)
    rng = random.Random(f"hpcrl-bootstrap-eval/{seed}")
    seed_program = builtin_seed(task_name)
    prompts = []
    for mode, number in BUCKETS:
        parents = sorted(
            (
                row
                for row in corpus
                if row["stage"] == number
                and row["status"] == "success"
                and row["gflops"]
                and row.get("task", task_name) == task_name  # several tasks: each row names its
            ),
            key=lambda row: row["gflops"],
        )[:-1]  # the fastest has nothing to beat
        for n in range(per_bucket):
            parent = rng.choice(parents) if mode == "improve" and parents else None
            source = parent["source"] if parent else (seed_program if n % 2 else None)
            messages = build_prompt(
                task, target_stage=number, mode=mode, parent_source=source, error=None, isa=isa
            )
            prompts.append(
                Prompt(mode, number, tuple(messages), parent["gflops"] if parent else None)
            )
    return prompts


def sample_completions(
    model_dir: Path,
    prompts: Sequence[Prompt],
    temperature: float,
    max_new_tokens: int = 1024,
    seed: int = 0,
    batch_size: int = 8,
) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(seed)
    texts = [
        str(
            tokenizer.apply_chat_template(
                [m.model_dump() for m in p.messages], tokenize=False, add_generation_prompt=True
            )
        )
        for p in prompts
    ]
    out: list[str] = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(
            texts[start : start + batch_size],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        with torch.no_grad():
            generated = model.generate(
                **batch,
                do_sample=temperature > 0,
                temperature=temperature or None,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )
        width = batch["input_ids"].shape[1]
        out += tokenizer.batch_decode(generated[:, width:], skip_special_tokens=True)
    return out


def evaluate(
    model_dir: Path,
    per_bucket: int = 8,
    temperature: float = 0.8,
    seed: int = 1234,
    task_name: str = "matmul",
    opt_level: str = "O3",
    progress: Callable[[int, int], None] | None = None,
) -> EvalReport:
    from hpcrl_benchmarker.config import BenchmarkerSection
    from hpcrl_benchmarker.pipeline import Benchmarker

    corpus = json.loads((Path(model_dir) / CORPUS_FILE).read_text())
    prompts = eval_prompts(corpus, per_bucket, host_isa(), seed, task_name)
    completions = sample_completions(Path(model_dir), prompts, temperature, seed=seed)
    task = load_task(task_name)
    benchmarker = Benchmarker(BenchmarkerSection(pin_threads=False))
    judged = []
    for done, (prompt, completion) in enumerate(zip(prompts, completions, strict=True), 1):
        verdict = benchmarker.evaluate(
            completion, stage=prompt.stage, opt_level=opt_level, task=task
        )
        judged.append(
            Judged(prompt, completion, verdict.status, verdict.gflops, list(verdict.techniques))
        )
        if progress is not None:
            progress(done, len(prompts))
    return EvalReport(judged, temperature)
