"""Sample the fixed set with each policy version, judge every completion, compare versions.

Every version answers prompt p with the same sampling seed (derived from the evaluation seed
and p), so sample i of prompt p is paired across versions: with equal weights the samples are
identical, and a gain is the weights' doing, not the dice's. Completions are judged in this
process by the benchmarker's own pipeline (the reward the learner is trained on), one at a
time, so a compile never competes with a timed run for the CPU.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcrl_common.checkpoints import CheckpointInfo, CheckpointStore
from hpcrl_common.messages import SamplingParams
from hpcrl_common.stages import TECHNIQUES
from hpcrl_common.task import TaskSpec
from hpcrl_evaluate import stats
from hpcrl_evaluate.evalset import EvalPrompt

if TYPE_CHECKING:
    from rich.progress import Progress

    from hpcrl_benchmarker.pipeline import Benchmarker
    from hpcrl_benchmarker.verdict import Verdict
    from hpcrl_generator.sampling import GroupJob, Sample, Sampler

SCHEMA = "hpcrl-evaluation/1"
ERROR_CHARS = 300  # enough to see why a sample failed; the full text is the benchmarker's


class VersionError(ValueError):
    """A version that cannot be evaluated (unknown, or no checkpoint store to find it in)."""


@dataclass(frozen=True)
class VersionRef:
    """A policy version and where its weights are (version 0: the base model directory)."""

    requested: str
    version: int
    path: Path
    format: str = "full"
    checksum: str | None = None


@dataclass(frozen=True)
class SamplingOptions:
    samples: int = 8
    seed: int = 0
    temperature: float = 0.8
    top_p: float = 1.0
    # The demo's scheduler.max_tokens: the policy's stage 3-6 kernels run to ~1,320 tokens.
    max_tokens: int = 1536


@dataclass(frozen=True)
class BackendOptions:
    backend: str = "vllm"
    dtype: str = "auto"
    max_model_len: int = 4096
    max_num_seqs: int = 64
    kv_cache_space_gib: int = 4
    device: str = "cpu"


@dataclass(frozen=True)
class SampleRecord:
    """One completion and its verdict."""

    prompt: int
    index: int
    status: str
    reward: float  # the benchmarker's raw reward: GFLOPS on success, the penalty otherwise
    gflops: float | None
    techniques: list[str]
    finish_reason: str | None
    tokens: int
    completion: str
    error: str = ""


# name -> (statistic, value of one sample, label). Means count every sample; "best" is a max.
METRICS: dict[str, tuple[stats.Statistic, Callable[[SampleRecord], float], str]] = {
    "share_correct": ("mean", lambda s: float(s.status == "success"), "share correct"),
    "mean_reward": ("mean", lambda s: s.reward, "mean reward (raw)"),
    "mean_gflops": (
        "mean",
        lambda s: s.gflops if s.status == "success" else 0.0,
        "mean GFLOPS (failures 0)",
    ),
    "best_gflops": ("max", lambda s: s.gflops if s.status == "success" else 0.0, "best GFLOPS"),
    **{
        f"technique_{t}": ("mean", lambda s, t=t: float(t in s.techniques), f"share using {t}")
        for t in TECHNIQUES
    },
}


def prompt_seed(seed: int, prompt_index: int) -> int:
    """Sampling seed of one prompt: a function of numbers only, so every version and every
    arm of a comparison draws the same randomness for it."""
    digest = hashlib.sha256(f"evaluate:{seed}:{prompt_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1


# --- versions --------------------------------------------------------------------------


def resolve_versions(
    requested: list[str], model: Path, checkpoints: Path | None
) -> list[VersionRef]:
    """``0``, ``latest`` or a number, each to the directory holding its weights."""
    store = CheckpointStore(checkpoints) if checkpoints is not None else None
    return [_resolve(text.strip(), model, store) for text in requested]


def _resolve(text: str, model: Path, store: CheckpointStore | None) -> VersionRef:
    if text == "0":
        return VersionRef(text, 0, model)
    if text != "latest" and not text.isdigit():
        raise VersionError(f"unknown version {text!r}: use 0, latest or a version number")
    if store is None:
        raise VersionError(f"version {text!r} needs --checkpoints (the learner's store)")
    info = store.latest() if text == "latest" else _get(store, int(text))
    if info is None:
        raise VersionError(
            f"the checkpoint store {store.root} has no versions yet "
            f"(no {store.root / 'manifest.json'} listing one)"
        )
    return VersionRef(text, info.version, store.path_of(info), info.format, info.checksum)


def _get(store: CheckpointStore, version: int) -> CheckpointInfo:
    try:
        return store.get(version)
    except KeyError:
        known = ", ".join(str(v.version) for v in store.versions()) or "none"
        raise VersionError(
            f"unknown version {version}: the checkpoint store {store.root} has {known}"
        ) from None


# --- sampling and judging --------------------------------------------------------------


def make_sampler(
    model: Path, options: BackendOptions, refs: list[VersionRef], seed: int
) -> Sampler:
    """The backend on the base model (version 0); other versions are loaded into it."""
    if options.backend == "transformers":
        from hpcrl_generator.backends.transformers import TransformersSampler

        return TransformersSampler(
            model, dtype=options.dtype, device=options.device, max_model_len=options.max_model_len
        )
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its warnings would drown the table
    from hpcrl_generator.backends.vllm import VLLMSampler

    return VLLMSampler(
        model,
        dtype=options.dtype,
        max_model_len=options.max_model_len,
        max_num_seqs=options.max_num_seqs,
        kv_cache_space_gib=options.kv_cache_space_gib,
        enable_lora=any(r.format == "lora" for r in refs),
        seed=seed,
    )


def load_version(sampler: Sampler, ref: VersionRef, model: Path) -> None:
    """Make ``ref`` the sampler's policy, validated as the generator does (a bad reload can
    kill a vLLM engine). The base model is reloaded from its own directory."""
    from hpcrl_generator.weights import ModelSignature, Target, validate

    if ref.version == sampler.version:
        return
    if ref.version == 0:
        sampler.load_weights(model, 0, "full")
        return
    fmt = "lora" if ref.format == "lora" else "full"
    target = Target(ref.version, ref.path.resolve(), fmt, ref.checksum or "")
    validate(target, ModelSignature.of(model), verify_checksum=ref.checksum is not None)
    sampler.load_weights(target.path, ref.version, target.format)


class Judge:
    """The benchmarker, remembering verdicts: a completion that two versions both wrote is
    measured once, so identical code never shows a gain made of timing noise."""

    def __init__(self, benchmarker: Benchmarker, task: TaskSpec, opt_level: str) -> None:
        self.benchmarker, self.task, self.opt_level = benchmarker, task, opt_level
        self._seen: dict[tuple[str, int], Verdict] = {}

    def __call__(self, completion: str, stage: int) -> Verdict:
        key = (completion, stage)
        if key not in self._seen:
            self._seen[key] = self.benchmarker.evaluate(
                completion, stage=stage, opt_level=self.opt_level, task=self.task
            )
        return self._seen[key]


def make_judge(task_name: str, opt_level: str) -> Judge:
    from hpcrl_benchmarker.config import BenchmarkerSection
    from hpcrl_benchmarker.pipeline import Benchmarker
    from hpcrl_common.task import load_task

    task = load_task(task_name)
    task.compile_flags(opt_level)  # an unknown level fails here, before any sampling
    # Unpinned: threads bound to cores that other processes use would time those processes.
    return Judge(Benchmarker(BenchmarkerSection(pin_threads=False)), task, opt_level)


def sampling_job(sampler: Sampler, prompt: EvalPrompt, options: SamplingOptions) -> GroupJob:
    from hpcrl_generator.prompt import completion_budget, render_prompt
    from hpcrl_generator.sampling import GroupJob

    ids = render_prompt(sampler.tokenizer, prompt.messages)
    budget = completion_budget(len(ids), options.max_tokens, sampler.max_model_len)
    params = SamplingParams(
        temperature=options.temperature,
        top_p=options.top_p,
        max_tokens=budget,
        seed=prompt_seed(options.seed, prompt.index),
    )
    return GroupJob(ids, options.samples, params)


def prompts_per_call(backend: BackendOptions, sampling: SamplingOptions) -> int:
    """As many prompts per engine call as the engine decodes sequences at once."""
    return max(1, backend.max_num_seqs // max(1, sampling.samples))


def evaluate_version(
    sampler: Sampler,
    judge: Judge,
    prompts: list[EvalPrompt],
    options: SamplingOptions,
    progress: Progress | None = None,
    label: str = "",
    per_call: int = 1,
) -> list[SampleRecord]:
    """Sample every prompt first, ``per_call`` prompts per engine call (decoded together),
    then judge every completion."""
    drawn = []
    step = max(1, per_call)
    with _task(progress, f"{label}: sampling", len(prompts)) as advance:
        for start in range(0, len(prompts), step):
            chunk = prompts[start : start + step]
            groups = sampler.generate_groups([sampling_job(sampler, p, options) for p in chunk])
            for prompt, samples in zip(chunk, groups, strict=True):
                drawn.append((prompt, samples))
                advance()
    records = []
    total = sum(len(samples) for _, samples in drawn)
    with _task(progress, f"{label}: benchmarking", total) as advance:
        for prompt, samples in drawn:
            for index, sample in enumerate(samples):
                records.append(_record(prompt, index, sample, judge(sample.text, prompt.stage)))
                advance()
    return records


def _record(prompt: EvalPrompt, index: int, sample: Sample, verdict: Verdict) -> SampleRecord:
    return SampleRecord(
        prompt=prompt.index,
        index=index,
        status=verdict.status,
        reward=float(verdict.reward),
        gflops=verdict.gflops,
        techniques=list(verdict.techniques),
        finish_reason=sample.finish_reason,
        tokens=len(sample.token_ids),
        completion=sample.text,
        error=verdict.error[:ERROR_CHARS],
    )


@contextmanager
def _task(progress: Progress | None, description: str, total: int) -> Iterator[Callable[[], None]]:
    if progress is None:
        yield lambda: None
        return
    task = progress.add_task(description, total=total)
    try:
        yield lambda: progress.advance(task)
    finally:
        progress.update(task, completed=total)


# --- summaries and comparisons ---------------------------------------------------------


def metric_values(records: list[SampleRecord], name: str) -> list[float]:
    return [float(METRICS[name][1](r)) for r in records]


def summarise(records: list[SampleRecord]) -> dict[str, float]:
    """Every metric over ``records`` (an empty list has none)."""
    if not records:
        return {}
    out = {}
    for name, (statistic, value, _) in METRICS.items():
        values = [float(value(r)) for r in records]
        out[name] = max(values) if statistic == "max" else sum(values) / len(values)
    return out


def speed_of_correct(records: list[SampleRecord]) -> dict[str, float | None]:
    """Mean GFLOPS of the correct samples alone (None when none is correct) and the best.

    Not a per-sample statistic, so it has no paired interval: a version that writes fewer but
    faster correct kernels shows here what mean GFLOPS (failures 0) folds into one figure.
    """
    speeds = [r.gflops for r in records if r.status == "success" and r.gflops is not None]
    return {
        "correct": len(speeds),
        "mean_gflops_correct": sum(speeds) / len(speeds) if speeds else None,
        "best_of_k": max(speeds) if speeds else None,
    }


def version_report(
    ref: VersionRef, records: list[SampleRecord], prompts: list[EvalPrompt]
) -> dict[str, Any]:
    return {
        "version": ref.version,
        "requested": ref.requested,
        "path": str(ref.path),
        "metrics": summarise(records),
        "statuses": dict(Counter(r.status for r in records)),
        "per_prompt": [
            {
                "prompt": p.index,
                "name": p.name,
                "stage": p.stage,
                "metrics": summarise(mine),
                "speed_of_correct": speed_of_correct(mine),
            }
            for p in prompts
            for mine in ([r for r in records if r.prompt == p.index],)
        ],
        "samples": [asdict(r) for r in records],
    }


def compare(
    before: list[SampleRecord],
    after: list[SampleRecord],
    *,
    seed: int,
    resamples: int = stats.RESAMPLES,
    level: float = stats.LEVEL,
) -> dict[str, Any]:
    """after - before for every metric, with paired bootstrap intervals (strata: prompts)."""
    _check_paired(before, after)
    strata = [r.prompt for r in before]
    levels = summarise(before), summarise(after)
    out = {}
    for name, (statistic, _, _) in METRICS.items():
        interval = stats.paired_gain(
            metric_values(before, name),
            metric_values(after, name),
            statistic=statistic,
            strata=strata,
            seed=seed,
            resamples=resamples,
            level=level,
        )
        out[name] = {"before": levels[0][name], "after": levels[1][name], **interval.to_json()}
    return out


def _check_paired(before: list[SampleRecord], after: list[SampleRecord]) -> None:
    keys = [(r.prompt, r.index) for r in before]
    if keys != [(r.prompt, r.index) for r in after]:
        raise ValueError("the two versions' samples are not paired by (prompt, sample index)")


def comparison_report(
    before: dict[str, Any],
    after: dict[str, Any],
    prompts: list[EvalPrompt],
    *,
    seed: int,
    resamples: int = stats.RESAMPLES,
    level: float = stats.LEVEL,
) -> dict[str, Any]:
    """The gains of version ``after`` over ``before`` (two entries of a report's versions)."""
    b, a = records_of(before), records_of(after)
    options = {"seed": seed, "resamples": resamples, "level": level}
    per_prompt = []
    for p in prompts:
        pb = [r for r in b if r.prompt == p.index]
        pa = [r for r in a if r.prompt == p.index]
        per_prompt.append(
            {"prompt": p.index, "name": p.name, "metrics": compare(pb, pa, **options)}
        )
    return {
        "before": before["version"],
        "after": after["version"],
        "resamples": resamples,
        "level": level,
        "seed": seed,
        "metrics": compare(b, a, **options),
        "per_prompt": per_prompt,
    }


def records_of(version: dict[str, Any]) -> list[SampleRecord]:
    """The sample records of one version entry of a report (e.g. read from its JSON)."""
    return [SampleRecord(**sample) for sample in version["samples"]]


# --- the whole evaluation --------------------------------------------------------------


@dataclass
class Evaluation:
    model: Path
    refs: list[VersionRef]
    prompts: list[EvalPrompt]
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    backend: BackendOptions = field(default_factory=BackendOptions)
    task: str = "matmul"
    opt_level: str = "O3"
    isa: str = "avx512"
    resamples: int = stats.RESAMPLES

    def run(self, progress: Progress | None = None) -> dict[str, Any]:
        judge = make_judge(self.task, self.opt_level)
        sampler = make_sampler(self.model, self.backend, self.refs, self.sampling.seed)
        try:
            versions = []
            for ref in self.refs:
                load_version(sampler, ref, self.model)
                records = evaluate_version(
                    sampler,
                    judge,
                    self.prompts,
                    self.sampling,
                    progress,
                    label=f"v{ref.version}",
                    per_call=prompts_per_call(self.backend, self.sampling),
                )
                versions.append(version_report(ref, records, self.prompts))
        finally:
            sampler.close()
        return self.report(versions, judge)

    def report(self, versions: list[dict[str, Any]], judge: Judge) -> dict[str, Any]:
        # Every later version against the first: whether a gain made early is kept.
        comparisons = [
            comparison_report(
                versions[0], later, self.prompts, seed=self.sampling.seed, resamples=self.resamples
            )
            for later in versions[1:]
        ]
        comparison = comparisons[-1] if comparisons else None
        return {
            "schema": SCHEMA,
            "model": str(self.model),
            "task": self.task,
            "opt_level": self.opt_level,
            "isa": self.isa,
            "host": judge.benchmarker.host.info().model_dump(),
            "sampling": asdict(self.sampling),
            "backend": asdict(self.backend),
            "prompts": [
                {
                    "index": p.index,
                    "name": p.name,
                    "mode": p.spec.mode,
                    "stage": p.stage,
                    "parent": p.spec.parent,
                    "seed": prompt_seed(self.sampling.seed, p.index),
                }
                for p in self.prompts
            ],
            "metric_labels": {name: label for name, (_, _, label) in METRICS.items()},
            "versions": versions,
            "comparison": comparison,
            "comparisons": comparisons,
        }
