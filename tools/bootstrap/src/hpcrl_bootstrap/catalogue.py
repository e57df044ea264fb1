"""The measured catalogue: the kernels the bootstrap teaches, judged and timed on this host.

A speed formula cannot rank kernels (one ranked every scalar register block above the ikj
loop order, which is about twice as fast at 256³), so every kernel the policy is taught to
write, and every parent it is shown, goes through the benchmarker's own pipeline once
(extraction, technique checks, sandboxed compile, verification against OpenBLAS, timing).
Pairs are then made from measured speeds, and repair prompts show the error the benchmarker
really gave for the broken parent.

``plan`` is pure: which kernels (seeded). ``measure`` runs them and caches the verdicts in a
JSON file per host class, optimisation level and task (verdicts keyed per kernel), so a
rebuild on the same host times only kernels it has not judged before.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl_bootstrap import corpus as cp
from hpcrl_bootstrap import motifs
from hpcrl_bootstrap.corpus import Kernel
from hpcrl_common.stages import LAST_STAGE
from hpcrl_common.task import TaskSpec

# Distinct correct kernels per stage. Weighted to the stages a short run explores most; the
# policy memorises a small set well rather than a large one badly.
PER_STAGE: dict[int, int] = {1: 16, 2: 16, 3: 12, 4: 8, 5: 6, 6: 6}
SUCCESS = "success"


@dataclass(frozen=True)
class Measured:
    """One catalogue kernel and the benchmarker's verdict on it."""

    kernel: Kernel
    status: str
    gflops: float | None
    error: str
    generalizes: bool | None

    @property
    def ok(self) -> bool:
        """Correct at the reward size and at the odd sizes: fit to be taught."""
        return self.status == SUCCESS and self.generalizes is not False and bool(self.gflops)


@dataclass(frozen=True)
class Plan:
    """Correct kernels by stage, and for each its deepen parent and its broken twin."""

    targets: list[Kernel]
    parents: dict[int, Kernel]  # target index -> the target of stage s without s's technique
    broken: dict[int, Kernel]  # target index -> the target with one mistake (repair parent)

    def all(self) -> list[Kernel]:
        return [*self.targets, *self.parents.values(), *self.broken.values()]


def plan(
    seed: int, isa: str, per_stage: dict[int, int] | None = None, task: str = "matmul"
) -> Plan:
    """The catalogue's kernels of ``task``; the same arguments give the same kernels."""
    # GEMM's stream is the one it always had (its cached catalogues and models stay valid);
    # every other task draws from its own.
    stream = f"hpcrl-catalogue/{seed}/{isa}" + ("" if task == "matmul" else f"/{task}")
    rng = random.Random(stream)
    kernels = motifs.corpus_for(task)
    counts = per_stage or PER_STAGE
    targets: list[Kernel] = []
    seen: set[str] = set()
    for number in range(1, LAST_STAGE + 1):
        wanted, found = counts.get(number, 0), 0
        for _ in range(wanted * 40):  # bounded: a small stage may have fewer distinct kernels
            if found == wanted:
                break
            kernel = kernels.render_kernel(kernels.sample_spec(rng, number, isa), number, isa)
            if kernel.source not in seen:
                seen.add(kernel.source)
                targets.append(kernel)
                found += 1
    parents: dict[int, Kernel] = {}
    for index, kernel in enumerate(targets):
        parent = _parent_at_label(kernels, rng, kernel, isa)
        if parent is not None:
            parents[index] = parent
    _top_up_deepen_pairs(kernels, rng, isa, counts, targets, parents, seen)
    broken = {
        index: kernels.render_kernel(kernels.with_mistake(rng, k.spec, k.stage, isa), k.stage, isa)
        for index, k in enumerate(targets)
    }
    return Plan(targets, parents, broken)


def _parent_at_label(
    kernels: motifs.Corpus, rng: random.Random, target: Kernel, isa: str
) -> Kernel | None:
    """``target`` without its stage's technique, if that is code of the stage below.

    Up to format 15 every target had a parent, labelled one stage down whatever it was: an
    untiled SIMD target's parent was a stage-1 register block labelled stage 2, and a
    stage-5 target without OpenMP gave a stage-3 SIMD kernel labelled stage 4. The policy
    learned to add two stages' techniques at once (OpenMP asked for stage 3, prefetch at
    stage 4: 36 of 192 v0 answers on a Zen 4, format 15)."""
    if target.stage == 1:
        return None
    spec = kernels.downgrade(rng, target.spec, target.stage - 1)
    if spec.min_stage != target.stage - 1:
        return None
    return kernels.render_kernel(spec, target.stage - 1, isa)


def _top_up_deepen_pairs(
    kernels: motifs.Corpus,
    rng: random.Random,
    isa: str,
    counts: dict[int, int],
    targets: list[Kernel],
    parents: dict[int, Kernel],
    seen: set[str],
) -> None:
    """Draw more targets until every stage s >= 2 has ``counts[s]`` deepen pairs.

    The extra targets are those whose parent is of its label (a tiled stage-3 kernel, a
    stage-4 one with SIMD, a stage-5 one with OpenMP); they join the stage's other targets."""
    for number in range(2, LAST_STAGE + 1):
        missing = counts.get(number, 0) - sum(targets[i].stage == number for i in parents)
        for _ in range(max(missing, 0) * 40):  # bounded, as in ``plan``
            if missing <= 0:
                break
            kernel = kernels.render_kernel(kernels.sample_spec(rng, number, isa), number, isa)
            if kernel.source in seen:
                continue
            parent = _parent_at_label(kernels, rng, kernel, isa)
            if parent is None:
                continue
            seen.add(kernel.source)
            targets.append(kernel)
            parents[len(targets) - 1] = parent
            missing -= 1


def cache_key(host_class: str, opt_level: str, task: TaskSpec) -> str:
    """One cache file per host class, level and task. Verdicts inside are keyed per kernel,
    so a changed plan (other counts, another seed) times only the kernels it adds."""
    digest = hashlib.sha256()
    for part in (host_class, opt_level, task.model_dump_json()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


Progress = Callable[[int, int], None]


def verdict_key(kernel: Kernel) -> str:
    """Verdicts depend on the stage a kernel is judged at, not only on its source."""
    return f"{kernel.stage}:{kernel.source}"


def measure(
    kernels: Sequence[Kernel],
    task: TaskSpec,
    opt_level: str,
    cache_dir: Path,
    progress: Progress | None = None,
    workers: int = 1,
) -> tuple[list[Measured], Path]:
    """Every kernel judged by the benchmarker (cached per host class); and the cache file.

    One kernel at a time by default: the node's timing lock keeps timings apart, not a
    compile from a timing, and on 2 cores gcc beside a two-thread OpenMP kernel halved its
    speed; improve pairs are chosen by these speeds, so the policy was taught that OpenMP
    is slow (AVX2 node, the same 156 kernels: the best of stages 4, 5 and 6 at 19.4, 24.2 and
    20.0 GFLOPS with two workers, 26.3, 34.0 and 31.6 with one)."""
    from hpcrl_benchmarker.config import BenchmarkerSection
    from hpcrl_benchmarker.pipeline import Benchmarker

    # Not pinned: the build shares its cores with whatever else runs here.
    benchmarker = Benchmarker(BenchmarkerSection(pin_threads=False))
    key = cache_key(benchmarker.host.host_class, opt_level, task)
    path = Path(cache_dir) / f"catalogue-{key}.json"
    cached = _read_cache(path)
    unique = {verdict_key(k): k for k in kernels}
    todo = [k for name, k in unique.items() if name not in cached]
    done = len(unique) - len(todo)

    def judge(kernel: Kernel) -> tuple[str, dict[str, Any]]:
        verdict = benchmarker.evaluate(
            cp.completion_text(kernel.source), stage=kernel.stage, opt_level=opt_level, task=task
        )
        return verdict_key(kernel), {
            "status": verdict.status,
            "gflops": verdict.gflops,
            "error": verdict.error,
            "generalizes": verdict.generalizes,
            "techniques": verdict.techniques,
        }

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for name, verdict in pool.map(judge, todo):
            cached[name] = verdict
            done += 1
            if progress is not None:
                progress(done, len(unique))
    if todo:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(
            json.dumps(
                {
                    "host_class": benchmarker.host.host_class,
                    "opt_level": opt_level,
                    "verdicts": cached,
                }
            )
        )
        temporary.replace(path)
    return [_measured(k, cached[verdict_key(k)]) for k in kernels], path


def _read_cache(path: Path) -> dict[str, dict[str, Any]]:
    try:
        return dict(json.loads(path.read_text())["verdicts"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _measured(kernel: Kernel, verdict: dict[str, Any]) -> Measured:
    return Measured(
        kernel=kernel,
        status=str(verdict["status"]),
        gflops=verdict.get("gflops"),
        error=str(verdict.get("error") or ""),
        generalizes=verdict.get("generalizes"),
    )


def summary(measured: Sequence[Measured]) -> dict[str, Any]:
    """What bootstrap.json records: counts of distinct verdicts, the speed range per stage."""
    measured = list({verdict_key(m.kernel): m for m in measured}.values())
    ok = [m for m in measured if m.ok]
    stages: dict[str, Any] = {}
    for number in range(1, LAST_STAGE + 1):
        speeds = sorted(m.gflops or 0.0 for m in ok if m.kernel.stage == number)
        if speeds:
            stages[str(number)] = {
                "kernels": len(speeds),
                "min_gflops": round(speeds[0], 2),
                "max_gflops": round(speeds[-1], 2),
            }
    statuses: dict[str, int] = {}
    for m in measured:
        statuses[m.status] = statuses.get(m.status, 0) + 1
    return {"kernels": len(measured), "correct": len(ok), "statuses": statuses, "stages": stages}


def export(measured: Sequence[Measured]) -> list[dict[str, Any]]:
    """The catalogue's distinct verdicts as JSON rows (next to the model as corpus.json)."""
    measured = list({verdict_key(m.kernel): m for m in measured}.values())
    return [
        {
            "stage": m.kernel.stage,
            "techniques": list(m.kernel.techniques),
            "mistake": m.kernel.mistake,
            "status": m.status,
            "gflops": m.gflops,
            "generalizes": m.generalizes,
            "source": m.kernel.source,
        }
        for m in measured
    ]
