"""The scheduler over the real RabbitMQ with the real benchmarker (a subprocess) and a scripted
generator (the only stand-in: it answers each request with canned completions).

One uninterrupted run serves the integration checks; a second run on the same seed is killed
with SIGKILL in the middle of iteration 1, restarted, and must end in the same state.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pika
import pytest

from hpcrl_benchmarker.host import has_avx512
from hpcrl_common.broker import Consumer, Publish
from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import (
    Candidate,
    CandidateCommitment,
    GenerateRequest,
    PackedArray,
    RolloutBatch,
    RolloutData,
    candidate_id,
    decode,
)
from hpcrl_common.topology import (
    CANDIDATE_COMMITMENTS,
    CODE_TO_BENCH,
    GENERATE_REQUESTS,
    ROLLOUT_BATCHES,
    Topology,
)

from ..conftest import RunningConsumer, list_queues
from .canned import EXPECTED, completion

pytestmark = [pytest.mark.broker, pytest.mark.slow]

BIN = Path(sys.executable).parent
G = 5
HAS_AVX512 = has_avx512()


def scripted_generator(topology: Topology, seen: list[GenerateRequest]):
    """Answer a request with G canned completions and fake (but well-formed) token data."""

    def handle(request: GenerateRequest, _delivery) -> list[Publish]:
        seen.append(request)
        outputs = []
        for index in range(request.group_size):
            text = completion(request.bench.stage, index)
            tokens = np.frombuffer(text.encode(), dtype=np.uint8).astype("<i4")
            rollout = RolloutData(
                prompt_token_ids=PackedArray.of([7, 8, 9, len(request.prompt)], "<i4"),
                completion_token_ids=PackedArray.of(tokens, "<i4"),
                sampling_logprobs=PackedArray.of(np.full(len(tokens), -0.25), "<f4"),
                policy_version=request.min_policy_version,
            )
            candidate = Candidate(
                id=candidate_id(request.id, index),
                group_id=request.id,
                index=index,
                completion=text,
                bench=request.bench,
                rollout=rollout,
                generator="scripted",
            )
            outputs.append(Publish(topology.name(CODE_TO_BENCH), candidate))
        # As the generator does: its commitment to the group's candidates goes first.
        commitment = CandidateCommitment.of([p.message for p in outputs], "scripted")  # type: ignore[misc]
        return [Publish(topology.name(CANDIDATE_COMMITMENTS), commitment), *outputs]

    return handle


@dataclass
class Run:
    db: Path
    config: Path
    requests: list[GenerateRequest]
    batches: dict[str, RolloutBatch]
    batch_copies: int
    log: str
    killed_at: dict | None = None


def write_config(
    path: Path, settings: BrokerSettings, db: Path, work: Path, confirm: bool = True
) -> None:
    path.write_text(f"""
[broker]
url = "{settings.url}"
namespace = "{settings.namespace}"
heartbeat_s = {settings.heartbeat_s}
delivery_limit = {settings.delivery_limit}
prefetch = {settings.prefetch}
reconnect_initial_s = {settings.reconnect_initial_s}
reconnect_max_s = {settings.reconnect_max_s}
[experiment]
name = "itest"
seed = 11
opt_level = "O3"
[scheduler]
iterations = 2
group_size = {G}
node_budget = 2
reward_mode = "group_normalized"
max_staleness = 0
isa = "{"avx512" if HAS_AVX512 else "avx2"}"
metrics_port = 0
tick_s = 0.2
db_path = "{db}"
confirm_winners = {str(confirm).lower()}
[benchmarker]
metrics_port = 0
concurrency = 1
work_dir = "{work}"
lock_path = "{work}/timing.lock"
# This node is shared with the broker, the scheduler and the test itself: let the kernel's
# thread move away from a busy core rather than wait on its own.
pin_threads = false
""")


def scheduler_cmd(*args: str) -> list[str]:
    return [str(BIN / "hpcrl-scheduler"), *args]


def read_db(db: Path, sql: str, params: tuple = ()) -> list[tuple]:
    if not db.exists():
        return []
    connection = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return connection.execute(sql, params).fetchall()
    except sqlite3.OperationalError:
        return []
    finally:
        connection.close()


def drain_batches(url: str, queue: str) -> tuple[dict[str, RolloutBatch], int]:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        found: dict[str, RolloutBatch] = {}
        copies = 0
        while True:
            method, _props, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                return found, copies
            batch = decode(body, RolloutBatch)
            found[batch.id] = batch
            copies += 1
    finally:
        connection.close()


def experiment(tmp: Path, rabbitmq: str, *, kill_mid_iteration: bool, confirm: bool = True) -> Run:
    settings = BrokerSettings(
        url=rabbitmq,
        namespace=f"test-{uuid.uuid4().hex[:10]}",
        heartbeat_s=5,
        delivery_limit=3,
        prefetch=8,
        reconnect_initial_s=0.2,
        reconnect_max_s=2.0,
    )
    topology = Topology(settings.namespace, settings.delivery_limit)
    tmp.mkdir(parents=True, exist_ok=True)
    db, config = tmp / "scheduler.sqlite", tmp / "experiment.toml"
    write_config(config, settings, db, tmp / "bench", confirm)
    env = {**os.environ, "HPCRL__LOGGING__FORMAT": "json"}
    bench_cmd = [str(BIN / "hpcrl-benchmarker"), "serve", "--config", str(config)]
    if not HAS_AVX512:
        bench_cmd += ["--allow-isa", "avx2"]
    logs = tmp / "logs.txt"
    seen: list[GenerateRequest] = []
    generator = Consumer(settings, "scripted-generator")
    generator.subscribe(GENERATE_REQUESTS, scripted_generator(topology, seen))
    killed_at = None
    with logs.open("w") as log_file:
        bench = subprocess.Popen(bench_cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        try:
            with RunningConsumer(generator):
                scheduler = subprocess.Popen(
                    scheduler_cmd("serve", "--config", str(config)),
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
                if kill_mid_iteration:
                    killed_at = kill_in_iteration_one(scheduler, db)
                    time.sleep(1.0)  # results keep arriving in the queue meanwhile
                    scheduler = subprocess.Popen(
                        scheduler_cmd("serve", "--config", str(config)),
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                        env=env,
                    )
                try:
                    code = scheduler.wait(timeout=150)
                except subprocess.TimeoutExpired:
                    scheduler.kill()
                    tail = logs.read_text()[-5000:]
                    raise AssertionError(f"scheduler did not finish:\n{tail}") from None
                assert code == 0, logs.read_text()[-5000:]
        finally:
            bench.send_signal(signal.SIGTERM)
            try:
                bench.wait(timeout=30)
            except subprocess.TimeoutExpired:
                bench.kill()
    batches, copies = drain_batches(rabbitmq, topology.name(ROLLOUT_BATCHES))
    cleanup(rabbitmq, settings)
    return Run(db, config, seen, batches, copies, logs.read_text(), killed_at)


def kill_in_iteration_one(scheduler: subprocess.Popen, db: Path) -> dict:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        rows = read_db(
            db,
            "SELECT COUNT(*), SUM(g.state = 'closed') FROM results r JOIN groups "
            "g ON g.id = r.group_id WHERE g.iteration = 1",
        )
        groups_open = read_db(
            db, "SELECT COUNT(*) FROM groups WHERE iteration = 1 AND state != 'closed'"
        )
        if rows and rows[0][0] and rows[0][0] >= 2 and groups_open and groups_open[0][0] > 0:
            scheduler.send_signal(signal.SIGKILL)
            scheduler.wait(timeout=10)
            return {"results_in_iteration_1": rows[0][0], "open_groups": groups_open[0][0]}
        if scheduler.poll() is not None:
            raise AssertionError("the scheduler finished before it could be killed")
        time.sleep(0.02)
    raise AssertionError("iteration 1 never got results")


def cleanup(url: str, settings: BrokerSettings) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        Topology(settings.namespace, settings.delivery_limit).delete(channel)
        for queue in list_queues(settings.namespace):
            channel.queue_delete(queue)
    finally:
        connection.close()


@pytest.fixture(scope="module")
def uninterrupted(rabbitmq: str, tmp_path_factory) -> Iterator[Run]:
    yield experiment(tmp_path_factory.mktemp("run"), rabbitmq, kill_mid_iteration=False)


def status_json(run: Run) -> dict:
    out = subprocess.run(
        scheduler_cmd("status", "--json", "--config", str(run.config)),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def test_two_iterations_complete_and_the_pool_moves_up_a_stage(uninterrupted: Run):
    run = uninterrupted
    status = status_json(run)
    assert status["done"] and status["iterations_done"] == 2
    groups = read_db(
        run.db,
        "SELECT iteration, mode, target_stage, parent_id, state, outcome "
        "FROM groups ORDER BY iteration, ordinal",
    )
    assert [(g[0], g[1], g[2]) for g in groups[:1]] == [(0, "seed", 1)]
    iteration1 = sorted((g[1], g[2]) for g in groups if g[0] == 1)
    # budget 2 over pool(0) = stage 1 {fast, slow, 3 failures}: deepen the fast kernel, and
    # one of improve (the slow one) or repair (the verification error), by the seeded tie.
    assert ("deepen", 2) in iteration1 and ("seed", 1) in iteration1 and len(iteration1) == 3
    assert all(g[4] == "closed" and g[5] == "sent" for g in groups)
    pool0 = read_db(run.db, "SELECT stage, status FROM programs WHERE iteration = 0")
    assert sorted(s for _, s in pool0) == sorted(EXPECTED)
    assert {stage for stage, _ in pool0} == {1}
    pool1 = read_db(run.db, "SELECT DISTINCT stage FROM programs WHERE iteration = 1")
    assert {row[0] for row in pool1} == {1, 2}
    assert set(status["pool"]) == {"1", "2"}
    assert status["pool"]["2"]["best_gflops"] > 0
    # the deepened request told the generator about stage 2 and showed the fast parent
    deepen = next(r for r in run.requests if r.mode == "deepen")
    assert deepen.bench.stage == 2 and "cache blocking" in deepen.prompt[1].content
    assert "double a = A[i * K + k];" in deepen.prompt[1].content


def test_rollout_batches_carry_group_normalized_rewards(uninterrupted: Run):
    run = uninterrupted
    assert len(run.batches) == 4
    results = {
        row[0]: row[1:] for row in read_db(run.db, "SELECT id, status, gflops, reward FROM results")
    }
    for batch in run.batches.values():
        assert batch.reward_mode == "group_normalized" and len(batch.samples) == G
        assert batch.host_class
        best = max(results[s.candidate_id][1] or 0.0 for s in batch.samples)
        # The winner was measured again (scheduler.confirm_winners): it counts at the lower
        # of its two measurements, and no success of the group above that.
        [(state,)] = read_db(
            run.db, "SELECT value FROM meta WHERE key = ?", (f"confirm/{batch.id}",)
        ) or [("{}",)]
        adjusted = json.loads(state).get("adjusted", {})
        best = min(best, *adjusted.values()) if adjusted else best
        for sample in batch.samples:
            status, gflops, stored = results[sample.candidate_id]
            assert sample.status == status
            assert sample.reward == pytest.approx(stored)
            if status == "success":
                assert sample.reward == pytest.approx(100.0 * min(gflops, best) / best)
            else:
                assert (
                    sample.reward
                    == {
                        "compile_error": -40.0,
                        "stage_violation": -100.0,
                        "verification_error": -10.0,
                    }[status]
                )
            assert len(sample.completion_token_ids) == len(sample.sampling_logprobs) > 0
        rewards = sorted(s.reward for s in batch.samples)
        assert rewards[-1] == 100.0 and 0 < rewards[-2] < 60  # the slow kernel scores lower


def test_export_writes_stage_bests_and_the_lineage(uninterrupted: Run, tmp_path):
    subprocess.run(
        scheduler_cmd("export", str(tmp_path / "out"), "--config", str(uninterrupted.config)),
        check=True,
        capture_output=True,
    )
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert set(index["best_per_stage"]) == {"1", "2"}
    assert index["lineage"][0]["id"] == "seed"
    lineage = index["lineage"]
    assert len(lineage) >= 2
    assert all(child["parent"] == parent["id"] for parent, child in itertools.pairwise(lineage))
    best = max(e["gflops"] for e in index["best_per_stage"].values())
    assert lineage[-1]["gflops"] == best
    best_file = tmp_path / "out" / index["best_per_stage"]["2"]["file"]
    assert "matmul_optimized" in best_file.read_text()


# A repair prompt quotes the verifier's message, which holds values computed from random
# inputs; everything else in a prompt must be identical between the two runs.
MEASURED = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")


def comparable(run: Run) -> dict:
    groups = [
        (*row[:5], MEASURED.sub("<n>", row[5]), *row[6:])
        for row in read_db(
            run.db,
            "SELECT id, iteration, parent_id, mode, target_stage, prompt, state, outcome "
            "FROM groups ORDER BY id",
        )
    ]
    programs = read_db(
        run.db,
        "SELECT id, iteration, stage, key, parent_id, mode, status FROM programs ORDER BY id",
    )
    batches = {
        gid: [
            (s.candidate_id, s.status, s.reward if s.status != "success" else s.reward == 100.0)
            for s in batch.samples
        ]
        for gid, batch in run.batches.items()
    }
    return {"groups": groups, "programs": programs, "batches": batches}


def test_kill_9_mid_iteration_then_restart_ends_like_the_uninterrupted_run(rabbitmq: str, tmp_path):
    # Two runs, each timing its own kernels: without winner confirmations, whose second
    # timing (the lower counts, and caps the group's others) can reorder kernels of close
    # speed between runs. What is compared is the restart's bookkeeping, not timing noise.
    uninterrupted = experiment(
        tmp_path / "whole", rabbitmq, kill_mid_iteration=False, confirm=False
    )
    restarted = experiment(tmp_path / "restart", rabbitmq, kill_mid_iteration=True, confirm=False)
    assert restarted.killed_at is not None and restarted.killed_at["open_groups"] > 0
    assert status_json(restarted)["done"]
    a, b = comparable(uninterrupted), comparable(restarted)
    assert a["groups"] == b["groups"]
    assert a["programs"] == b["programs"]
    assert a["batches"] == b["batches"]
    # every result was filed exactly once, none lost
    count = read_db(restarted.db, "SELECT COUNT(*), COUNT(DISTINCT id) FROM results")[0]
    assert count == (G * 4, G * 4)
