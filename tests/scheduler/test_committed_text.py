"""Issue 28, the last forgery: a benchmarker lies about the measurement of the text it was
given. On the real RabbitMQ, with the scheduler service in process, the generator's
``candidate-commitment/2`` (each candidate's text) and results published as a generator and
benchmarkers would; a confirming replica is played by the test, which extracts the kernel
from the confirmation it is sent with the benchmarker's own extraction and "measures" it
from a table of what each kernel runs at on the class:

* a fast foreign kernel's source reported, with an honest figure and the candidate's genuine
  tokens, for a slow committed candidate that becomes the group's winner: its second
  measurement compiles the committed text, whose source is not the one reported, so the
  winner is dropped, both results and the host are suspect, and its tokens are not trained
  (the next best is confirmed in its place);
* an honest winner is confirmed from its committed text and trained, and the pool keeps the
  confirmer's source for it;
* a restart of the scheduler between the commitment and the results, and between the
  confirmation's request and its answer, changes nothing;
* a ``candidate-commitment/1`` (hashes only, a generator of the release before) is read:
  its winners are dropped for want of a committed text, or, with
  ``require_committed_text = false`` during a rolling upgrade, measured again from the
  source they report;
* a database of the release before gains the text column on open.
"""

from __future__ import annotations

import sqlite3

import pytest
from prometheus_client import REGISTRY

from hpcrl_benchmarker.extract import extract
from hpcrl_common.broker import Publish, Publisher
from hpcrl_common.messages import (
    BenchResult,
    Candidate,
    CandidateCommitmentV1,
    CommitmentEntryV1,
    GenerateRequest,
    RolloutBatch,
    text_sha256,
)
from hpcrl_common.task import builtin_seed, load_task
from hpcrl_common.topology import (
    BENCH_RESULTS,
    CANDIDATE_COMMITMENTS,
    CODE_TO_BENCH,
    GENERATE_REQUESTS,
    ROLLOUT_BATCHES,
    Topology,
)
from hpcrl_scheduler.store import Store

from ..conftest import RunningConsumer
from ..support.waiting import wait_for
from .helpers import commitment, result
from .test_service_broker import take
from .test_trust import host, service

TASK = load_task("matmul")
SEED = builtin_seed("matmul")
assert SEED is not None
# A blocked kernel from elsewhere (what the forger reports as the slow candidate's source).
FOREIGN = f"/* blocked 64 x 64, from another run */\n{SEED}"
TEXTS = {i: f"Here is the kernel.\n```c\n/* candidate {i} */\n{SEED}\n```\nDone.\n" for i in (0, 1)}


def extracted(text: str) -> str:
    return extract(text, TASK.signature).code


# What each kernel runs at on the class (GFLOPS): candidate 1's committed kernel is slow.
SPEED = {extracted(TEXTS[0]): 1.0, extracted(TEXTS[1]): 0.6, FOREIGN: 2.0}


def measured(
    group_id: str,
    index: int,
    source: str,
    gflops: float,
    *,
    benchmarker: str,
    hostname: str,
    judged: str | None = None,
    with_rollout: bool = True,
) -> BenchResult:
    base = result(group_id, index, gflops=gflops, source=source, with_rollout=with_rollout)
    return BenchResult.model_validate(
        {
            **base.model_dump(),
            "host": host(384.0, hostname=hostname),
            "benchmarker": benchmarker,
            "completion_sha256": None if judged is None else text_sha256(judged),
        }
    )


def answer(check: Candidate, benchmarker: str, hostname: str) -> BenchResult:
    """A confirming replica's verdict on ``check``: the kernel its text yields, measured."""
    source = extracted(check.completion)
    return measured(
        check.group_id,
        0,
        source,
        SPEED[source],
        benchmarker=benchmarker,
        hostname=hostname,
        with_rollout=False,
    )


def group_of(request_id: str) -> tuple[BenchResult, BenchResult]:
    """Candidate 0 measured honestly; candidate 1 (slow) reported with the foreign kernel's
    source and what that kernel runs at, its genuine tokens and the hash of its genuine text:
    everything the forger can check is right, and 1.8 is within 3x of the committed kernel's
    0.6, so the two timings alone agree."""
    honest = measured(
        request_id,
        0,
        extracted(TEXTS[0]),
        1.0,
        benchmarker="benchmarker-b",
        hostname="node2",
        judged=TEXTS[0],
    )
    forged = measured(
        request_id, 1, FOREIGN, 1.8, benchmarker="evil", hostname="node1", judged=TEXTS[1]
    )
    return honest, forged


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def confirmations(outcome: str) -> float:
    return counter("hpcrl_scheduler_confirmations_total", outcome=outcome)


def publish_results(publisher: Publisher, topology: Topology, *results: BenchResult) -> None:
    publisher.publish(*(Publish(topology.name(BENCH_RESULTS), r) for r in results))


def publish_commitment(publisher: Publisher, topology: Topology, message) -> None:
    publisher.publish(Publish(topology.name(CANDIDATE_COMMITMENTS), message))


def check_refused(scheduler, detail, batch: RolloutBatch, honest: BenchResult) -> None:
    """The forged winner dropped and suspect; candidate 0 confirmed and trained alone."""
    assert [(s.candidate_id, s.reward) for s in batch.samples] == [(honest.id, 100.0)]
    assert list(detail["suspect_hosts"]) == ["node1/evil"]
    reason = detail["suspect_hosts"]["node1/evil"]["reason"]
    assert "1.8 GFLOPS claimed for a source that is not what the committed text yields" in (
        reason
    ), reason
    programs = {p.id: p for p in scheduler.store.all_programs() if p.id != "seed"}
    assert list(programs) == [honest.id]
    assert programs[honest.id].source == extracted(TEXTS[0])  # the confirmer's
    group = scheduler.store.group(honest.group_id)
    assert group is not None and group.excluded == 1 and group.close_reason == "complete"


pytestmark = pytest.mark.broker


def test_a_foreign_source_reported_for_a_slow_committed_candidate_is_refused(
    broker_settings, raw_channel, tmp_path
):
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    scheduler, consumer, svc = service(
        broker_settings, tmp_path, "foreign", reward_mode="group_normalized"
    )
    suspects = counter("hpcrl_scheduler_suspect_results_total")
    disagreed = confirmations("disagreed")
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        [request] = take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest)
        honest, forged = group_of(request.id)
        publish_commitment(publisher, topology, commitment([honest, forged], texts=TEXTS))
        publish_results(publisher, topology, honest, forged)
        [check] = take(raw_channel, topology.name(CODE_TO_BENCH), Candidate)
        # The generator's text of candidate 1, not the source its result reports.
        assert check.group_id == f"{request.id}.confirm1" and check.completion == TEXTS[1]
        assert check.generator.startswith("confirm|evil|") and check.rollout is None
        publish_results(publisher, topology, answer(check, "benchmarker-b", "node2"))
        [again] = take(raw_channel, topology.name(CODE_TO_BENCH), Candidate)
        assert again.group_id == f"{request.id}.confirm2" and again.completion == TEXTS[0]
        assert take(raw_channel, topology.name(ROLLOUT_BATCHES), RolloutBatch, timeout=0.5) == []
        publish_results(publisher, topology, answer(again, "benchmarker-a", "node1"))
        [batch] = take(raw_channel, topology.name(ROLLOUT_BATCHES), RolloutBatch)
        healthy, detail = svc.health()
    assert healthy
    check_refused(scheduler, detail, batch, honest)
    assert counter("hpcrl_scheduler_suspect_results_total") - suspects == 2
    assert confirmations("disagreed") - disagreed == 1


def test_an_honest_winner_is_confirmed_from_its_committed_text_and_trained(
    broker_settings, raw_channel, tmp_path
):
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    scheduler, consumer, svc = service(
        broker_settings, tmp_path, "honest", reward_mode="group_normalized"
    )
    agreed = confirmations("agreed")
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        [request] = take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest)
        honest, _ = group_of(request.id)
        slow = measured(
            request.id,
            1,
            extracted(TEXTS[1]),
            0.6,
            benchmarker="benchmarker-a",
            hostname="node1",
            judged=TEXTS[1],
        )
        publish_commitment(publisher, topology, commitment([honest, slow], texts=TEXTS))
        publish_results(publisher, topology, honest, slow)
        [check] = take(raw_channel, topology.name(CODE_TO_BENCH), Candidate)
        assert check.completion == TEXTS[0]  # the winner's committed text
        publish_results(publisher, topology, answer(check, "benchmarker-a", "node1"))
        [batch] = take(raw_channel, topology.name(ROLLOUT_BATCHES), RolloutBatch)
        _healthy, detail = svc.health()
    rewards = {s.candidate_id: s.reward for s in batch.samples}
    assert rewards[honest.id] == 100.0 and rewards[slow.id] == pytest.approx(60.0)
    assert not detail.get("suspect_hosts")
    assert confirmations("agreed") - agreed == 1
    winner = scheduler.store.program(honest.id)
    assert winner is not None and winner.source == extracted(TEXTS[0])


def test_a_restart_between_commitment_and_confirmation_changes_nothing(
    broker_settings, raw_channel, tmp_path
):
    """Stopped after the commitment is filed, and again after the confirmation is
    requested: the committed text survives in SQLite, and the answer is judged against it."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    name = "restart-text"
    scheduler, consumer, _svc = service(
        broker_settings, tmp_path, name, reward_mode="group_normalized"
    )
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        [request] = take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest)
        honest, forged = group_of(request.id)
        publish_commitment(publisher, topology, commitment([honest, forged], texts=TEXTS))
        wait_for(
            lambda: (
                scheduler.store.committed_text(
                    forged.id, rollout_sha256=None, completion_sha256=None
                )
                == TEXTS[1]
            ),
            10,
            "the commitment filed with its texts",
        )
    scheduler.store.close()

    scheduler, consumer, svc = service(
        broker_settings, tmp_path, name, reward_mode="group_normalized"
    )
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        publish_results(publisher, topology, honest, forged)
        [check] = take(raw_channel, topology.name(CODE_TO_BENCH), Candidate)
        assert check.completion == TEXTS[1]
        wait_for(lambda: not svc._pending and not scheduler.store.count_unsent(), 10, "sent")
    scheduler.store.close()

    scheduler, consumer, svc = service(
        broker_settings, tmp_path, name, reward_mode="group_normalized"
    )
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        publish_results(publisher, topology, answer(check, "benchmarker-b", "node2"))
        [again] = take(raw_channel, topology.name(CODE_TO_BENCH), Candidate)
        assert again.completion == TEXTS[0]
        publish_results(publisher, topology, answer(again, "benchmarker-a", "node1"))
        [batch] = take(raw_channel, topology.name(ROLLOUT_BATCHES), RolloutBatch)
        _healthy, detail = svc.health()
    check_refused(scheduler, detail, batch, honest)
    # The group closed: its texts are of no more use.
    assert (
        scheduler.store.committed_text(honest.id, rollout_sha256=None, completion_sha256=None)
        is None
    )


@pytest.mark.parametrize("require", [True, False], ids=["require", "rolling-upgrade"])
def test_a_commitment_of_major_1_has_no_text_to_confirm_from(
    broker_settings, raw_channel, tmp_path, require
):
    """A generator of the release before commits with hashes only: its results are still
    checked against them; its winners are dropped for want of a committed text, or (during
    a rolling upgrade) measured again from the source they report, as before."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    scheduler, consumer, _svc = service(
        broker_settings,
        tmp_path,
        f"v1-{require}",
        reward_mode="group_normalized",
        require_committed_text=require,
    )
    outcome = "no_text" if require else "reported_source"
    before = confirmations(outcome)
    filed = counter("hpcrl_scheduler_commitments_total", outcome="filed_without_text")
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        [request] = take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest)
        honest, forged = group_of(request.id)
        current = commitment([honest, forged], texts=TEXTS)
        old = CandidateCommitmentV1(
            id=current.id,
            group_id=current.group_id,
            entries=[
                CommitmentEntryV1(
                    index=e.index,
                    rollout_sha256=e.rollout_sha256,
                    completion_sha256=e.completion_sha256,
                )
                for e in current.entries
            ],
        )
        publish_commitment(publisher, topology, old)
        publish_results(publisher, topology, honest, forged)
        if require:
            wait_for(
                lambda: (
                    (g := scheduler.store.group(request.id)) is not None and g.state == "closed"
                ),
                20,
                "the group closed",
            )
            assert take(raw_channel, topology.name(CODE_TO_BENCH), Candidate, timeout=0.5) == []
        else:
            [check] = take(raw_channel, topology.name(CODE_TO_BENCH), Candidate)
            assert check.completion == f"```c\n{FOREIGN}\n```\n"  # what it reports
    assert counter("hpcrl_scheduler_commitments_total", outcome="filed_without_text") - filed == 1
    assert confirmations(outcome) - before == (2 if require else 1)
    if require:
        assert [p.id for p in scheduler.store.all_programs()] == ["seed"]


def test_a_database_of_the_release_before_gains_the_text_column(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript(
        """CREATE TABLE commitments (
            candidate_id TEXT NOT NULL, rollout_sha256 TEXT NOT NULL,
            completion_sha256 TEXT NOT NULL, group_id TEXT NOT NULL, received_at REAL NOT NULL,
            PRIMARY KEY (candidate_id, rollout_sha256, completion_sha256));
        INSERT INTO commitments VALUES ('g/0', 'r', 'c', 'g', 1.0);"""
    )
    db.close()
    store = Store(path)
    with store.tx():
        assert store.committed_text("g/0", rollout_sha256="r", completion_sha256="c") is None
        # The same candidate committed again with its text (a /2): the text is kept.
        assert store.add_commitment(
            "g/0", group_id="g", rollout_sha256="r", completion_sha256="c", completion="t", at=2.0
        )
        assert not store.add_commitment(
            "g/0", group_id="g", rollout_sha256="r", completion_sha256="c", completion="t", at=3.0
        )
    assert store.committed_text("g/0", rollout_sha256=None, completion_sha256=None) == "t"
    assert store.commitments_of("g/0") == [("r", "c")]
