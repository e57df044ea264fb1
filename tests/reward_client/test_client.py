"""The reward path for outside trainers: contract (pure) and client over the real broker."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time

import pika
import pytest

from hpcrl_common.access import definitions, publisher_allowed, role_permissions
from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import (
    BenchSpec,
    Candidate,
    MessageError,
    RewardRequest,
    decode,
    encode,
)
from hpcrl_common.topology import BENCH_RESULTS, CODE_TO_BENCH, REWARD_REQUESTS, Topology
from hpcrl_reward_client import RewardClient, RewardRequestSpec, RewardTimeout
from hpcrl_reward_client.verl import compute_score_batch
from tests.benchmarker.conftest import kernel

# --- the contract (pure) --------------------------------------------------------------------


def test_a_reward_request_round_trips_and_a_plain_candidate_still_decodes():
    request = RewardRequest(
        id="b1/3",
        group_id="b1",
        index=3,
        completion="x",
        bench=BenchSpec(task="matmul", stage=2),
        client="alice.rank0",
    )
    assert decode(encode(request), RewardRequest) == request
    candidate = Candidate(
        id="g/0", group_id="g", index=0, completion="x", bench=BenchSpec(task="matmul", stage=6)
    )
    assert decode(encode(candidate), Candidate).rollout is None
    with pytest.raises(ValueError, match="client"):  # a name that is no queue-name piece
        RewardRequest(
            id="b/0",
            group_id="b",
            index=0,
            completion="",
            bench=request.bench,
            client="../bench-results",
        )
    with pytest.raises(MessageError, match="unexpected schema"):
        decode(encode(request), Candidate)  # never mistaken for the scheduler's traffic


def test_the_client_role_reaches_only_its_own_queue_and_the_requests_inbox():
    t = Topology("exp", 3)
    rules = role_permissions(t, "client", "hpcrl-client.alice")
    assert rules.configure == "^$"
    assert re.fullmatch(rules.write, "exp.reward-requests.in")
    for other in (
        "exp.code-to-bench.in",
        "exp.bench-results.in",
        "exp.reward-verdicts.in",
        "exp.reward-requests",
        "amq.default",
    ):
        assert not re.fullmatch(rules.write, other), other
    assert re.fullmatch(rules.read, "exp.reward-verdicts.hpcrl-client.alice")
    for other in (
        "exp.reward-verdicts.hpcrl-client.bob",
        "exp.reward-verdicts.hpcrl-client",
        "exp.reward-requests",
        "exp.bench-results",
        "exp.reward-verdicts.in",
    ):
        assert not re.fullmatch(rules.read, other), other
    bench = role_permissions(t, "benchmarker")
    assert re.fullmatch(bench.read, "exp.reward-requests")
    assert re.fullmatch(bench.write, "exp.reward-verdicts.in")
    assert not re.fullmatch(bench.write, "exp.reward-verdicts.hpcrl-client.alice")
    users = {"scheduler": "s", "generator": "g", "benchmarker": "b", "learner": "l"}
    assert publisher_allowed(REWARD_REQUESTS, "hpcrl-client.alice", users) is None
    assert publisher_allowed(REWARD_REQUESTS, "g", users) is not None
    assert publisher_allowed(CODE_TO_BENCH, "hpcrl-client.alice", users) is not None
    doc = definitions(t, "v", {"hpcrl-client.alice": ("client", "pw"), "b": ("benchmarker", "p")})
    assert {
        "source": "exp.reward-verdicts.in",
        "vhost": "v",
        "destination": "exp.reward-verdicts.hpcrl-client.alice",
        "destination_type": "queue",
        "routing_key": "exp.reward-verdicts.hpcrl-client.alice",
        "arguments": {},
    } in doc["bindings"]


# --- over the real broker, with a real replica ----------------------------------------------


def depth(settings: BrokerSettings, queue: str) -> int:
    connection = pika.BlockingConnection(pika.URLParameters(settings.url))
    try:
        return connection.channel().queue_declare(queue, passive=True).method.message_count
    finally:
        connection.close()


@pytest.mark.broker
def test_two_clients_get_their_own_verdicts_from_a_real_replica(
    broker_settings: BrokerSettings, replica: subprocess.Popen
):
    alice = RewardClient(broker_settings, "alice", timeout_s=180)
    bob = RewardClient(broker_settings, "bob", timeout_s=180, max_outstanding=1)
    try:
        ours = alice.score(
            [
                RewardRequestSpec(f"```c\n{kernel('naive.c')}```", "matmul", 6),
                RewardRequestSpec("no code here"),
                RewardRequestSpec(kernel("ikj_omp.c"), stage=1),
            ]
        )
        # Back-pressure: one outstanding at a time still gets both through.
        theirs = asyncio.run(
            bob.ascore([RewardRequestSpec("nothing"), RewardRequestSpec("nor here")])
        )
    finally:
        alice.close()
        bob.close()
    assert replica.poll() is None
    ok, bad, staged = ours
    assert ok.status == "success" and ok.gflops and ok.reward == ok.gflops
    assert ok.timing is not None and ok.benchmarker.startswith("benchmarker-")
    assert bad.status == "format_violation" and bad.reward == -100
    assert staged.status == "stage_violation" and "openmp" in staged.techniques
    assert [v.status for v in theirs] == ["format_violation"] * 2
    assert not {v.id for v in ours} & {v.id for v in theirs}
    assert alice.dropped == bob.dropped == 0  # neither saw the other's verdicts
    topology = Topology(broker_settings.namespace)
    assert depth(broker_settings, topology.name(BENCH_RESULTS)) == 0  # the scheduler's: untouched
    # verl's convention, through the same path
    carol = RewardClient(broker_settings, "carol", timeout_s=120)
    try:
        scores = compute_score_batch(
            ["hpcrl"], ["no code"], [None], [{"stage": 3}], reward_client=carol
        )
    finally:
        carol.close()
    assert scores == [{"score": -100.0, "status": "format_violation", "gflops": 0.0}]


@pytest.mark.broker
def test_a_request_nobody_answers_times_out(broker_settings: BrokerSettings):
    with RewardClient(
        broker_settings,
        "lonely",
        timeout_s=1.0,
        attempt_timeout_s=0.3,
        retries=1,
        max_outstanding=1,
    ) as client:
        with pytest.raises(ValueError):
            client.submit("x", stage=9)  # invalid: refused before it takes the only slot
        future = client.submit("x")
        with pytest.raises(RewardTimeout):
            future.result(timeout=10)
    # the first send and one retry under a new id, both waiting for a replica
    assert depth(broker_settings, Topology(broker_settings.namespace).name(REWARD_REQUESTS)) == 2


@pytest.mark.broker
def test_a_request_is_sent_at_once_not_at_the_io_threads_next_tick(
    broker_settings: BrokerSettings, monkeypatch: pytest.MonkeyPatch
):
    """The I/O thread waits for broker events up to a tick between its rounds; a submit wakes
    it (a quarter of a fast verdict's time went there on average: bench/reward_service.py)."""
    import hpcrl_reward_client.client as client_module

    monkeypatch.setattr(client_module, "_TICK_S", 30.0)
    queue = Topology(broker_settings.namespace).name(REWARD_REQUESTS)
    with RewardClient(broker_settings, "prompt", timeout_s=60) as client:
        assert client.connected.wait(10)
        time.sleep(0.5)  # the I/O thread is inside its 30 s wait now
        started = time.monotonic()
        client.submit("x")
        while depth(broker_settings, queue) < 1:
            assert time.monotonic() - started < 10, "the request waited for the tick"
            time.sleep(0.05)


@pytest.mark.broker
@pytest.mark.slow
def test_nothing_is_lost_when_a_replica_is_killed_mid_batch(
    broker_settings: BrokerSettings, tmp_path
):
    from tests.benchmarker.test_service import start_replica, write_config

    first = start_replica(write_config(tmp_path / "a.toml", broker_settings, tmp_path / "a"))
    second = None
    specs = [
        RewardRequestSpec(kernel("infinite.c")),
        RewardRequestSpec(kernel("naive.c")),
        RewardRequestSpec("no code"),
        RewardRequestSpec(kernel("infinite.c")),
    ]
    try:
        with RewardClient(broker_settings, "survivor", timeout_s=240) as client:
            futures = client.submit_many(specs)
            time.sleep(4)  # the first replica holds the batch, inside an 8 s run
            assert first.poll() is None
            first.kill()
            first.wait()
            second = start_replica(
                write_config(tmp_path / "b.toml", broker_settings, tmp_path / "b")
            )
            verdicts = [future.result() for future in futures]
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [v.status for v in verdicts] == ["timeout", "success", "format_violation", "timeout"]
    assert all(
        v.benchmarker.endswith(f"-{second.pid}") for v in verdicts if v.status == "timeout"
    )  # in the killed replica's hands when it died


@pytest.mark.broker
def test_a_verdict_for_a_queue_nobody_made_ends_in_the_dead_letters(
    broker_settings: BrokerSettings, replica: subprocess.Popen
):
    from hpcrl_common.broker import Publish, Publisher

    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    request = RewardRequest(
        id="ghostly/0",
        group_id="ghostly",
        index=0,
        completion="no code",
        bench=BenchSpec(task="matmul", stage=6),
        client="ghost",
    )
    with Publisher(broker_settings, "test-producer") as publisher:
        publisher.publish(Publish(topology.name(REWARD_REQUESTS), request))
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not depth(broker_settings, topology.dlq(REWARD_REQUESTS)):
        time.sleep(0.5)
    assert depth(broker_settings, topology.dlq(REWARD_REQUESTS)) == 1
    assert depth(broker_settings, topology.name(REWARD_REQUESTS)) == 0
    assert depth(broker_settings, topology.name(BENCH_RESULTS)) == 0
    assert replica.poll() is None
