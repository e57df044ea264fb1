"""Issue 28: versions only from the store, pacing figures typed and in range. On the real
RabbitMQ, with the scheduler service in process and announcements published straight onto
the ``weight-updates`` fanout:

* a version is taken only when the learner's checkpoint store holds it (run, checksum,
  format, parent), and at most ``max_version_jump`` above the floor; a refused announcement
  is dead-lettered with the reason and does not mark its id handled, so the genuine
  announcement of the same version, once committed, is taken;
* the pacing figures (weight-update/2 fields; weight-update/1 is still read) are refused
  when negative, shrinking, beyond the batches sent or unlike the manifest's;
* pacing that holds every request past ``pacing_hold_deadline_s`` makes the service
  unhealthy, the reason in its detail.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest
from prometheus_client import REGISTRY

from hpcrl_common.broker import Consumer, Publish, Publisher
from hpcrl_common.checkpoints import CheckpointInfo, CheckpointStore
from hpcrl_common.messages import (
    GenerateRequest,
    RolloutBatch,
    WeightUpdate,
    WeightUpdateV1,
    encode,
)
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
from ..support.waiting import wait_for
from .helpers import committed, result
from .test_service_broker import take
from .test_trust import dead_letters

pytestmark = pytest.mark.broker


def commit(store: CheckpointStore, version: int, **pacing: int) -> CheckpointInfo:
    staging = store.staging_dir(version)
    (staging / "weights.bin").write_bytes(f"weights of v{version}".encode())
    return store.commit(
        staging,
        version,
        version - 1,
        "full",
        metrics={"loss": 0.5, **{k: float(v) for k, v in pacing.items()}},
    )


def announce(publisher: Publisher, topology: Topology, update) -> None:
    publisher.publish(
        Publish(topology.name(WEIGHT_UPDATES), update, exchange=topology.name(WEIGHT_UPDATES))
    )


def service(broker_settings, tmp_path: Path, name: str, **section):
    config = SchedulerConfig(
        broker=broker_settings,
        experiment={"name": name, "seed": 1},
        scheduler=SchedulerSection(
            **{
                "iterations": 2,
                "group_size": 2,
                "node_budget": 2,
                "max_staleness": 0,
                "confirm_winners": False,
                "metrics_port": 0,
                "tick_s": 0.1,
                "reward_mode": "raw",
                "exit_when_done": False,
                "checkpoint_dir": tmp_path / "store",
                **section,
            }
        ),
    )
    scheduler = Scheduler(config, Store(tmp_path / f"{name}.sqlite"))
    consumer = Consumer(broker_settings, f"scheduler-{name}", concurrency=2)
    return scheduler, consumer, SchedulerService(scheduler, consumer)


def test_versions_are_taken_only_from_the_store(broker_settings, raw_channel, tmp_path):
    """The issue's forgeries: version 2,147,483,647 of the pinned run moved the floor; "v2"
    announced before the learner committed v2 poisoned the id "v2", so the genuine v2 was
    acked as a duplicate and never taken."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    store = CheckpointStore(tmp_path / "store")
    scheduler, consumer, _service = service(broker_settings, tmp_path, "floor", max_version_jump=4)
    floor = lambda: int(scheduler.store.get("policy_version", 0))  # noqa: E731
    run = lambda: f"floor/{store.run_id}"  # noqa: E731
    dlq = topology.dlq(WEIGHT_UPDATES)
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        v1 = commit(store, 1)
        announce(publisher, topology, v1.weight_update(store.root, run=run()))
        wait_for(lambda: floor() == 1, what="the floor at v1")

        forged = v1.weight_update(store.root, run=run()).model_copy(
            update={"id": "v2147483647", "version": 2**31 - 1, "parent_version": 1}
        )
        early = v1.weight_update(store.root, run=run()).model_copy(
            update={"id": "v2", "version": 2, "parent_version": 1}
        )
        for update in (forged, early):
            announce(publisher, topology, update)
        reasons = dead_letters(raw_channel, dlq, expect=2)
        assert len(reasons) == 2, reasons
        assert all("not_in_store" in r for r in reasons), reasons
        assert floor() == 1

        v2 = commit(store, 2)  # now genuine, under the id the early one used
        announce(publisher, topology, v2.weight_update(store.root, run=run()))
        wait_for(lambda: floor() == 2, what="the genuine v2 (not taken as a duplicate)")

        # The store holds it, but the announcement says another checksum (a replay with
        # the entry changed), or jumps more than max_version_jump ahead.
        for version in range(3, 8):
            info = commit(store, version)
        lying = (
            commit(store, 8)
            .weight_update(store.root, run=run())
            .model_copy(update={"checksum": "sha256:" + "0" * 64})
        )
        announce(publisher, topology, info.weight_update(store.root, run=run()))  # v7
        announce(publisher, topology, lying)
        reasons = dead_letters(raw_channel, dlq, expect=2)
        assert any("too_far" in r and "max_version_jump 4" in r for r in reasons), reasons
        assert any("mismatch" in r for r in reasons), reasons
        # Another experiment's announcement of the same id is not ours: ignored, acked,
        # not remembered; the genuine v3 after it is taken.
        other = store.get(3).weight_update(store.root, run=f"other/{store.run_id}")
        announce(publisher, topology, other)
        time.sleep(0.5)
        announce(publisher, topology, store.get(3).weight_update(store.root, run=run()))
        wait_for(lambda: floor() == 3, what="the floor at v3")
        assert dead_letters(raw_channel, dlq, expect=1, timeout=1.0) == []


def test_pacing_figures_are_typed_and_in_range(broker_settings, raw_channel, tmp_path):
    """groups_trained = -1e12 made 10^12 groups outstanding and held every request while
    /healthz said 200. Figures out of range are dead-lettered in either schema major; those
    that hold pass; pacing that holds everything past the deadline is unhealthy."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    store = CheckpointStore(tmp_path / "store")
    scheduler, consumer, svc = service(
        broker_settings,
        tmp_path,
        "pace",
        max_staleness=1,
        initial_groups_per_step=1,
        node_budget=3,
        pacing_hold_deadline_s=1.0,
    )
    run = lambda: f"pace/{store.run_id}"  # noqa: E731
    dlq = topology.dlq(WEIGHT_UPDATES)
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        [request] = take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest)
        publisher.publish(
            *committed(
                topology,
                [result(request.id, i, gflops=2.0 + i, source=f"int k{i};") for i in range(2)],
            )
        )
        take(raw_channel, topology.name(ROLLOUT_BATCHES), RolloutBatch)
        # One batch sent, nothing trained: the next iteration is held for staleness...
        assert (
            take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest, timeout=1.0) == []
        )
        # ...and past the deadline the service says so.
        wait_for(lambda: not svc.health()[0], 10, "pacing that holds everything to be unhealthy")
        _healthy, detail = svc.health()
        stuck = detail["pacing_holds_every_request"]
        assert stuck["reason"] == "staleness" and stuck["outstanding"] == 1, detail

        # The forgery, as weight-update/1 (metrics) and as weight-update/2 (fields).
        v1 = commit(store, 1, groups_trained=1, groups_dropped=0, groups_per_step=1)
        genuine = v1.weight_update(store.root, run=run())
        old_style = msgpack.unpackb(
            encode(
                WeightUpdateV1(
                    **{
                        k: v for k, v in genuine.model_dump().items() if not k.startswith("groups_")
                    },
                )
            )
        )
        old_style["metrics"] = {"groups_trained": -1e12, "groups_per_step": 1.0}
        topology.declare(raw_channel)
        raw_channel.basic_publish(topology.name(WEIGHT_UPDATES), "", msgpack.packb(old_style))
        announce(publisher, topology, genuine.model_copy(update={"groups_trained": 5}))
        reasons = dead_letters(raw_channel, dlq, expect=2)
        assert any(
            "invalid weight-update/1: groups_trained: Input should be greater than "
            "or equal to 0" in r
            for r in reasons
        ), reasons
        assert any("pacing" in r and "differ from the manifest" in r for r in reasons), reasons
        assert int(scheduler.store.get("policy_version", 0)) == 0
        assert not svc.health()[0]

        # The genuine one (old schema too: a learner not yet upgraded) releases the hold.
        legacy = WeightUpdateV1(
            **{
                **{k: v for k, v in genuine.model_dump().items() if not k.startswith("groups_")},
                "metrics": {"groups_trained": 1.0, "groups_dropped": 0.0, "groups_per_step": 1.0},
            }
        )
        raw_channel.basic_publish(topology.name(WEIGHT_UPDATES), "", encode(legacy))
        released = take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest)
        assert [r.iteration for r in released] == [1] and released[0].min_policy_version == 1
        wait_for(lambda: svc.health()[0], 5, "healthy again", svc.health)

        # More groups done than batches sent (forged or replayed batches counted): the
        # store's version is taken, paced by the batches sent. Refusing it held every
        # request for good.
        v2 = commit(store, 2, groups_trained=7, groups_dropped=0, groups_per_step=1)
        announce(publisher, topology, v2.weight_update(store.root, run=run()))
        wait_for(lambda: int(scheduler.store.get("policy_version", 0)) == 2, 10, "v2 taken")
        assert int(scheduler.store.get("groups_trained", 0)) == 1
        assert REGISTRY.get_sample_value("hpcrl_scheduler_pacing_clamped_total") >= 1
        # Fewer done than an earlier version: refused.
        v3 = commit(store, 3, groups_trained=0, groups_dropped=0, groups_per_step=1)
        announce(publisher, topology, v3.weight_update(store.root, run=run()))
        [reason] = dead_letters(raw_channel, dlq, expect=1)
        assert "0 groups done is fewer than the 1 of an earlier version" in reason
        assert int(scheduler.store.get("policy_version", 0)) == 2


def test_weight_update_2_is_what_the_store_announces(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    info = commit(store, 1, groups_trained=4, groups_dropped=1, groups_per_step=2)
    update = info.weight_update(store.root, run="e/r")
    assert isinstance(update, WeightUpdate)
    assert (update.groups_trained, update.groups_dropped, update.groups_per_step) == (4, 1, 2)
    assert update.metrics == {"loss": 0.5}
