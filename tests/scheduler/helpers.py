"""Builders of realistic messages for the scheduler's tests (no stand-in services here)."""

from __future__ import annotations

from typing import get_args

import pytest

from hpcrl_common.messages import (
    BenchResult,
    BenchSpec,
    HostInfo,
    PackedArray,
    RolloutBatch,
    RolloutData,
)
from hpcrl_scheduler.selection import Program

PENALTY = {
    "format_violation": -100.0,
    "library_violation": -100.0,
    "stage_violation": -100.0,
    "compile_error": -40.0,
    "timeout": -30.0,
    "runtime_error": -20.0,
    "verification_error": -10.0,
}

# A batch can carry parent_relative rewards only once the wire contract (libs/common
# messages.py, RolloutBatch.reward_mode) accepts the mode; until then those tests skip.
needs_contract = pytest.mark.skipif(
    "parent_relative" not in get_args(RolloutBatch.model_fields["reward_mode"].annotation),
    reason="hpcrl_common.messages.RolloutBatch.reward_mode lacks 'parent_relative'",
)


def host(host_class: str = "x86-avx512") -> HostInfo:
    return HostInfo(
        hostname="node1",
        cpu_model="Test CPU",
        isa=["avx512f"],
        cores=4,
        compiler="gcc 12",
        host_class=host_class,
        peak_gflops=1e6,
    )


def rollout(index: int, n_tokens: int = 3, version: int = 0) -> RolloutData:
    return RolloutData(
        prompt_token_ids=PackedArray.of([1, 2, 3], "<i4"),
        completion_token_ids=PackedArray.of([10 + index] * n_tokens, "<i4"),
        sampling_logprobs=PackedArray.of([-0.5] * n_tokens, "<f4"),
        policy_version=version,
    )


def result(
    group_id: str,
    index: int,
    status: str = "success",
    gflops: float | None = None,
    *,
    stage: int = 1,
    source: str | None = "void f(){}",
    host_class: str = "x86-avx512",
    with_rollout: bool = True,
    error: str = "",
) -> BenchResult:
    if status == "success" and gflops is None:
        gflops = 1.0
    return BenchResult(
        id=f"{group_id}/{index}",
        group_id=group_id,
        index=index,
        status=status,
        reward=gflops if status == "success" else PENALTY[status],  # type: ignore[arg-type]
        gflops=gflops if status == "success" else None,
        source=source,
        bench=BenchSpec(task="matmul", stage=stage),
        host=host(host_class),
        rollout=rollout(index) if with_rollout else None,
        error=error,
    )


def program(
    pid: str,
    stage: int = 1,
    status: str = "success",
    gflops: float | None = None,
    source: str | None = None,
) -> Program:
    if status == "success" and gflops is None:
        gflops = 1.0
    default = f"/* {pid} */ int v_{pid.replace('/', '_')};"
    return Program(
        id=pid,
        stage=stage,
        status=status,
        source=source if source is not None else default,
        gflops=gflops if status == "success" else None,
    )
