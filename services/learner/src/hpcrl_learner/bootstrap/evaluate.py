"""Measure what a bootstrap model writes: sample completions for scheduler prompts, then
compile and check them (``check``) and look for stage violations."""

from __future__ import annotations

import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from hpcrl_common.stages import stage
from hpcrl_common.task import load_task
from hpcrl_learner.bootstrap.check import (
    Verdict,
    check_kernel,
    detect_techniques,
    extract_code,
    host_has_avx512,
)
from hpcrl_learner.bootstrap.examples import Example, make_examples


@dataclass
class Sample:
    example: Example
    completion: str
    verdict: Verdict
    violations: list[str] = field(default_factory=list)


@dataclass
class EvalReport:
    samples: list[Sample]
    temperature: float

    def count(self, what: str) -> int:
        tests = {
            "code_block": lambda s: s.verdict.status != "format_error",
            "compiles": lambda s: s.verdict.compiles,
            "correct": lambda s: s.verdict.status == "correct",
            "stage_ok": lambda s: s.verdict.status != "format_error" and not s.violations,
            "correct_and_stage_ok": lambda s: s.verdict.status == "correct" and not s.violations,
        }
        return sum(1 for s in self.samples if tests[what](s))

    def rows(self) -> list[tuple[str, int, int]]:
        n = len(self.samples)
        names = ("code_block", "compiles", "correct", "stage_ok", "correct_and_stage_ok")
        return [(name, self.count(name), n) for name in names]

    def statuses(self) -> Counter[str]:
        return Counter(s.verdict.status for s in self.samples)


def sample_completions(model_dir: Path, examples: list[Example], temperature: float,
                       max_new_tokens: int = 768, seed: int = 0, batch_size: int = 10
                       ) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    torch.manual_seed(seed)
    texts = [str(tokenizer.apply_chat_template([m.model_dump() for m in ex.prompt],
                                               tokenize=False, add_generation_prompt=True))
             for ex in examples]
    out: list[str] = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                          add_special_tokens=False)
        with torch.no_grad():
            generated = model.generate(
                **batch, do_sample=temperature > 0, temperature=temperature or None, top_p=1.0,
                max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
            )
        width = batch["input_ids"].shape[1]
        out += tokenizer.batch_decode(generated[:, width:], skip_special_tokens=True)
    return out


def evaluate(model_dir: Path, samples: int = 20, temperature: float = 0.8, seed: int = 1234,
             task_name: str = "matmul", isa: str | None = None) -> EvalReport:
    """``samples`` completions for fresh scheduler prompts (modes and stages mixed)."""
    isa = isa or ("avx512" if host_has_avx512() else "avx2")
    task = load_task(task_name)
    pool = make_examples(seed, samples * 4, task)
    chosen = [ex for ex in pool if ex.isa == isa][:samples]
    random.Random(seed).shuffle(chosen)
    completions = sample_completions(Path(model_dir), chosen, temperature, seed=seed)

    def judge(pair: tuple[Example, str]) -> Sample:
        example, completion = pair
        code = extract_code(completion)
        if code is None:
            return Sample(example, completion, Verdict("format_error", "no code block"))
        violations = stage(example.target_stage).violations(detect_techniques(code))
        return Sample(example, completion, check_kernel(code, time_limit_s=10.0), violations)

    with ThreadPoolExecutor(max_workers=2) as pool_exec:
        judged = list(pool_exec.map(judge, zip(chosen, completions, strict=True)))
    return EvalReport(judged, temperature)
