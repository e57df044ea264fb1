"""Builders of realistic messages for the scheduler's tests (no stand-in services here)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, get_args

import pytest

from hpcrl_common.messages import (
    BenchResult,
    BenchSpec,
    CandidateCommitment,
    CommitmentEntry,
    HostInfo,
    PackedArray,
    RolloutBatch,
    RolloutData,
    commitment_id,
    rollout_sha256,
    text_sha256,
)
from hpcrl_scheduler.selection import Program

if TYPE_CHECKING:
    from hpcrl_common.broker import Publish
    from hpcrl_common.topology import Topology
    from hpcrl_scheduler.scheduler import Scheduler

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


def completion_of(res: BenchResult) -> str:
    """The text a result's candidate had: its reported source in a C block (which the
    benchmarker's extraction gives back as that source)."""
    return f"```c\n{res.source or f'/* candidate {res.id} */'}\n```\n"


def commitment(
    results: Sequence[BenchResult], generator: str = "", texts: dict[int, str] | None = None
) -> CandidateCommitment:
    """What the generator committed to for these results' candidates: their rollouts and
    texts (``texts`` by index, else :func:`completion_of`; a result that reports the hash of
    the text it judged must be given that text)."""
    entries = []
    for r in {r.index: r for r in results if r.rollout is not None}.values():
        text = (texts or {}).get(r.index, completion_of(r))
        if r.completion_sha256 is not None and r.completion_sha256 != text_sha256(text):
            raise ValueError(f"{r.id} reports judging another text: pass it in texts")
        entries.append(
            CommitmentEntry(
                index=r.index,
                rollout_sha256=rollout_sha256(r.rollout),
                completion_sha256=text_sha256(text),
                completion=text,
            )
        )
    group_id = results[0].group_id
    return CandidateCommitment(
        id=commitment_id(group_id, entries), group_id=group_id, entries=entries, generator=generator
    )


def deliver(scheduler: Scheduler, res: BenchResult, publisher: str | None = None) -> None:
    """A result as it comes in a run: its candidate's commitment first (when it has token
    data and its group is open), then the result."""
    group = scheduler.store.group(res.group_id)
    if res.rollout is not None and group is not None and group.state != "closed":
        scheduler.handle_commitment(commitment([res]))
    scheduler.handle_result(res, publisher)


def committed(topology: Topology, results: Sequence[BenchResult]) -> list[Publish]:
    """The publishes of a generator's commitment to these results' candidates, then of the
    results (what a generator and a benchmarker send, in that order)."""
    from hpcrl_common.broker import Publish
    from hpcrl_common.topology import BENCH_RESULTS, CANDIDATE_COMMITMENTS

    return [
        Publish(topology.name(CANDIDATE_COMMITMENTS), commitment(results)),
        *(Publish(topology.name(BENCH_RESULTS), r) for r in results),
    ]
