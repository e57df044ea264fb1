"""The service shell on the real RabbitMQ, in process: results in, batches out, and the
weight-updates subscription driving the version floor and pacing. Messages are published
straight onto the queues (no stand-in services)."""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY

from hpcrl_common.broker import Consumer, Publish, Publisher
from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_common.messages import GenerateRequest, RolloutBatch, WeightUpdate, decode
from hpcrl_common.topology import (
    GENERATE_REQUESTS,
    ROLLOUT_BATCHES,
    WEIGHT_UPDATES,
    Topology,
)
from hpcrl_scheduler.config import SchedulerConfig, SchedulerSection
from hpcrl_scheduler.scheduler import Scheduler
from hpcrl_scheduler.service import SchedulerService
from hpcrl_scheduler.store import Store

from ..conftest import RunningConsumer
from .helpers import committed, result

pytestmark = pytest.mark.broker


def take(channel, queue: str, cls, timeout: float = 20.0, expect: int = 1) -> list:
    found: list = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(found) < expect:
        method, _props, body = channel.basic_get(queue, auto_ack=True)
        if method is None:
            time.sleep(0.05)
            continue
        found.append(decode(body, cls))
    return found


def test_results_batches_version_floor_and_pacing(broker_settings, raw_channel, tmp_path):
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    config = SchedulerConfig(
        broker=broker_settings,
        experiment={"name": "svc", "seed": 3},
        scheduler=SchedulerSection(
            iterations=2,
            group_size=2,
            node_budget=3,
            max_staleness=1,
            confirm_winners=False,
            initial_groups_per_step=1,
            metrics_port=0,
            tick_s=0.1,
            reward_mode="raw",
            exit_when_done=False,
            checkpoint_dir=tmp_path / "store",
        ),
    )
    store = CheckpointStore(tmp_path / "store")  # the learner's: versions come only from it
    scheduler = Scheduler(config, Store(tmp_path / "svc.sqlite"))
    consumer = Consumer(broker_settings, "scheduler-test", concurrency=2)
    service = SchedulerService(scheduler, consumer)
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        [request] = take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest)
        assert request.iteration == 0 and request.min_policy_version == 0
        first = result(request.id, 0, gflops=4.5, source="int fast;")
        second = result(request.id, 1, "compile_error", source="int broken")
        publisher.publish(*committed(topology, (first, first, second)))
        [batch] = take(raw_channel, topology.name(ROLLOUT_BATCHES), RolloutBatch)
        assert [s.reward for s in batch.samples] == [4.5, -40.0]
        assert batch.reward_mode == "raw"
        # Iteration 1 is planned, but 1 batch is outstanding and nothing trained: held.
        assert (
            take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest, timeout=1.5) == []
        )
        assert (
            REGISTRY.get_sample_value("hpcrl_scheduler_requests_held", {"reason": "staleness"}) >= 2
        )
        staging = store.staging_dir(1)
        (staging / "adapter.bin").write_bytes(b"v1")
        info = store.commit(
            staging, 1, 0, "lora", metrics={"groups_trained": 1.0, "groups_per_step": 2.0}
        )
        update = info.weight_update(store.root, run=f"svc/{store.run_id}")
        assert isinstance(update, WeightUpdate) and update.groups_trained == 1
        publisher.publish(
            Publish(topology.name(WEIGHT_UPDATES), update, exchange=topology.name(WEIGHT_UPDATES))
        )
        released = take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest, expect=2)
        assert [r.iteration for r in released] == [1, 1]
        assert all(r.min_policy_version == 1 for r in released)
        assert service.health()[1]["iteration"] == 1
        # A row is marked sent on the pump tick after the broker's confirm, which can come
        # after the message is already in our hands.
        deadline = time.monotonic() + 30
        while scheduler.store.count_unsent() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert scheduler.store.count_results(request.id) == 2
    assert scheduler.store.count_unsent() == 0


def test_results_without_source_do_not_wedge_the_scheduler(broker_settings, raw_channel, tmp_path):
    """benchmarker.include_source = false: successes arrive without their code. Selecting one
    as a parent made every tick raise while /healthz said 200; now the run goes on (from the
    seed) and stays healthy."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    config = SchedulerConfig(
        broker=broker_settings,
        experiment={"name": "nosrc", "seed": 1},
        scheduler=SchedulerSection(
            iterations=3,
            group_size=2,
            node_budget=2,
            max_staleness=0,
            confirm_winners=False,
            metrics_port=0,
            tick_s=0.1,
            exit_when_done=False,
        ),
    )
    scheduler = Scheduler(config, Store(tmp_path / "nosrc.sqlite"))
    consumer = Consumer(broker_settings, "scheduler-nosrc", concurrency=2)
    consumer.periodic_failure_grace_s = 1.0
    service = SchedulerService(scheduler, consumer)
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        for iteration in range(3):
            requests = take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest)
            assert [r.iteration for r in requests] == [iteration]
            answers = [result(requests[0].id, i, gflops=5.0 + i, source=None) for i in range(2)]
            publisher.publish(*committed(topology, answers))
        deadline = time.monotonic() + 20
        while not scheduler.done() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert scheduler.done()
        time.sleep(1.5)  # longer than the grace: a failing tick would show by now
        healthy, detail = consumer.healthy()
        assert healthy and "failing_periodic_tasks" not in detail, detail
        assert service.health()[1]["iteration"] == 2
