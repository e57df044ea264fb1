"""The benchmarker's config section (`[benchmarker]` in the experiment TOML).

It is also what the pipeline reads (``pipeline.Benchmarker`` takes the section itself), so
the CLI, the tools and the service configure one declaration: every key is defined here once.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from hpcrl_benchmarker import cpuset
from hpcrl_common.config import ServiceConfig
from hpcrl_common.service import ServiceSection


class BenchmarkerSection(ServiceSection):
    metrics_port: int = Field(9102, ge=0, le=65535, description="0 picks a free port")
    allow_isa: list[str] = Field(
        default_factory=list,
        description="ISAs accepted besides avx512f (e.g. ['avx2'] on development hosts); "
        "every result records its host class",
    )
    concurrency: int = Field(
        2,
        ge=1,
        le=64,
        description="candidates checked and compiled at "
        "once by this replica (harness runs, verification and timing, "
        "are one at a time per node, or per CPU set with `cpus`)",
    )
    cpus: str = Field(
        "",
        description="CPUs this replica owns, as taskset writes them "
        "('0-3', '0,2'): its compiles, its kernels and the replica itself run "
        "only there, and its timings exclude only replicas whose sets overlap "
        "(one lock per CPU), so replicas on disjoint sets of one node time at "
        "once; '' = every CPU this process may use, timed alone on the node. "
        "A CPU outside the process's affinity is refused at start",
    )
    threads: int = Field(
        0,
        ge=0,
        description="OpenMP threads per kernel, also its "
        "OMP_THREAD_LIMIT (no team, nested ones included, gets more); "
        "0 = every CPU of `cpus` (of this process's affinity if unset)",
    )
    work_dir: Path = Field(
        Path("/tmp/hpcrl-bench"),
        description="scratch dirs (one per candidate, removed after) and "
        "the compiled harness cache; made private (mode 700), refused if "
        "another user owns it",
    )
    lock_path: Path = Field(
        Path("/tmp/hpcrl-benchmarker-timing.lock"),
        description="per-node lock file that makes harness runs "
        "exclusive (with `cpus`, also `<lock_path>.cpu<N>` per CPU): "
        "every replica on a node must use the same path (mode 600; "
        "refused if another user owns it)",
    )
    timing_lock_timeout_s: float = Field(
        300.0,
        gt=0,
        description="longest wait for the timing lock: the candidate is then "
        "retried and /healthz reports the stall",
    )
    max_timing_cv: float = Field(
        0.05,
        ge=0,
        description="a measurement whose timed runs vary more than this "
        "(coefficient of variation) is timed again, in a fresh sandboxed run of the verified "
        "kernel, and the steadiest attempt (lowest CV) is kept; one that stays above it is "
        "flagged `noisy` in its result",
    )
    timing_attempts: int = Field(
        3,
        ge=1,
        le=10,
        description="timing attempts per candidate at most, the first "
        "included (1 = never time again); each is a warm-up plus the task's timed runs, every "
        "run verified",
    )
    address_space_mb: int = Field(4096, ge=256, description="RLIMIT_AS of a kernel run")
    pin_threads: bool = Field(
        True,
        description="bind each OpenMP thread of a kernel to one "
        "CPU (OMP_PROC_BIND/OMP_PLACES) for steadier timings; false "
        "suits a shared, loaded node",
    )
    tasks: list[str] = Field(
        default_factory=list,
        description="task TOML paths accepted besides the built-in "
        "tasks (a message can never make the service read another path)",
    )
    include_source: bool = Field(
        True,
        description="put the extracted code into each result "
        "(the scheduler's pool needs it, and so does a winner's "
        "second measurement: with false, set the scheduler's "
        'confirm_without_source = "count")',
    )

    @field_validator("cpus")
    @classmethod
    def _cpu_list(cls, value: str) -> str:
        cpuset.parse(value)  # the syntax here; the affinity when the replica starts
        return value.strip()


class BenchmarkerConfig(ServiceConfig):
    benchmarker: BenchmarkerSection = BenchmarkerSection()
