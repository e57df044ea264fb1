"""Scheduler throughput without the broker: how fast results are filed and groups closed
(SQLite WAL, one transaction per result, each checked against the generator's commitment,
which carries each candidate's text: --text-bytes, ~6 KB as a completion of ~1,500 tokens),
and how long planning an iteration takes for a large pool. Prints its figures; the
scheduler must not be the bottleneck next to benchmarking (~1 s per candidate per core).

    .venv/bin/python bench/scheduler_throughput.py [--groups 200] [--group-size 16]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from hpcrl_common.logs import configure_logging
from hpcrl_common.messages import (
    BenchResult,
    BenchSpec,
    CandidateCommitment,
    CommitmentEntry,
    HostInfo,
    PackedArray,
    RolloutData,
    commitment_id,
    decode,
    encode,
    rollout_sha256,
    text_sha256,
)
from hpcrl_scheduler.config import SchedulerConfig, SchedulerSection
from hpcrl_scheduler.scheduler import Scheduler
from hpcrl_scheduler.store import Store

HOST = HostInfo(
    hostname="bench",
    cpu_model="cpu",
    isa=["avx512f"],
    cores=8,
    compiler="gcc",
    host_class="bench-class",
    peak_gflops=1000.0,
)
STATUSES = ("success", "compile_error", "verification_error", "success", "stage_violation")
PENALTY = {"compile_error": -40.0, "verification_error": -10.0, "stage_violation": -100.0}


def result(group_id: str, index: int, stage: int) -> BenchResult:
    status = STATUSES[index % len(STATUSES)]
    gflops = 1.0 + (hash((group_id, index)) % 1000) / 10 if status == "success" else None
    tokens = 300
    return BenchResult(
        id=f"{group_id}/{index}",
        group_id=group_id,
        index=index,
        status=status,  # type: ignore[arg-type]
        reward=gflops if gflops is not None else PENALTY[status],
        gflops=gflops,
        source=f'void matmul_optimized(){{ const char *id = "{group_id}/{index}"; }}',
        bench=BenchSpec(task="matmul", stage=stage),
        host=HOST,
        error="x.c:1: error",
        rollout=RolloutData(
            prompt_token_ids=PackedArray.of(range(400), "<i4"),
            completion_token_ids=PackedArray.of(range(tokens), "<i4"),
            sampling_logprobs=PackedArray.of([-0.1] * tokens, "<f4"),
            policy_version=0,
        ),
    )


def completion(res: BenchResult, size: int) -> str:
    """A completion of about ``size`` characters around the result's source."""
    text = f"Here is the kernel.\n```c\n{res.source}\n```\n"
    return text + "x" * max(0, size - len(text))


def commitment_to(results: list[BenchResult], text_bytes: int) -> CandidateCommitment:
    entries = []
    for r in results:
        text = completion(r, text_bytes)
        entries.append(
            CommitmentEntry(
                index=r.index,
                rollout_sha256=rollout_sha256(r.rollout),  # type: ignore[arg-type]
                completion_sha256=text_sha256(text),
                completion=text,
            )
        )
    group_id = results[0].group_id
    return CandidateCommitment(
        id=commitment_id(group_id, entries), group_id=group_id, entries=entries
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=200, help="node budget per iteration")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument(
        "--text-bytes", type=int, default=6000, help="each committed completion's size"
    )
    args = parser.parse_args()
    configure_logging("bench", "warning")
    with tempfile.TemporaryDirectory() as tmp:
        config = SchedulerConfig(
            experiment={"name": "bench", "seed": 1},
            scheduler=SchedulerSection(
                iterations=args.iterations,
                group_size=args.group_size,
                node_budget=args.groups,
                max_staleness=0,
                max_groups_in_flight=0,
                metrics_port=0,
                confirm_winners=False,
            ),
        )
        scheduler = Scheduler(config, Store(Path(tmp) / "bench.sqlite"))
        filed = 0
        file_seconds = 0.0
        wire_seconds = 0.0
        commitments = 0
        for _ in range(args.iterations):
            started = time.perf_counter()
            scheduler.step()  # plans the iteration from the previous pool and admits it
            plan_s = time.perf_counter() - started
            groups = scheduler.store.groups_in_flight()
            started = time.perf_counter()
            wire_before = wire_seconds
            for group in groups:
                # As in a run: the generator's commitment to the group first (one message,
                # filed in one transaction), then each result checked against it.
                results = [result(group.id, i, group.target_stage) for i in range(group.group_size)]
                commitment = commitment_to(results, args.text_bytes)
                # Its wire round trip (what the consumer does; the texts hashed on decode)
                # is timed apart: filing starts from the decoded message, as before.
                began = time.perf_counter()
                commitment = decode(encode(commitment), CandidateCommitment)
                wire_seconds += time.perf_counter() - began
                commitments += 1
                scheduler.handle_commitment(commitment)
                for each in results:
                    scheduler.handle_result(each)
                    filed += 1
            elapsed = time.perf_counter() - started - (wire_seconds - wire_before)
            file_seconds += elapsed
            pool = len(scheduler.store.pool(scheduler.iteration()))
            print(
                f"iteration {scheduler.iteration()}: planned+admitted {len(groups)} groups in "
                f"{plan_s * 1000:.1f} ms; filed {len(groups) * args.group_size} results in "
                f"{elapsed:.2f} s ({len(groups) * args.group_size / elapsed:.0f}/s); "
                f"pool {pool}"
            )
        started = time.perf_counter()
        scheduler.refresh_metrics()
        refresh_ms = (time.perf_counter() - started) * 1000
        print(
            f"total: {filed} results in {file_seconds:.2f} s = {filed / file_seconds:.0f} "
            f"results/s (each stored, joined, and its group closed into a rollout batch); "
            f"metrics refresh {refresh_ms:.1f} ms; a commitment's encode + decode "
            f"{wire_seconds / max(1, commitments) * 1000:.2f} ms ({args.group_size} x "
            f"{args.text_bytes} B texts)"
        )


if __name__ == "__main__":
    main()
