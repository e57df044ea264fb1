"""Quorum dead-letter queues on a broker set up by an older release (issue #18).

Releases before it declared the dead-letter queues and the scheduler's update queue as classic
queues, which a quorum declare is refused on (406). Against the real RabbitMQ: services keep
running on such a broker and say what to run; ``hpcrl-broker-admin migrate`` makes those
queues quorum queues without losing a message, and carries on after a run cut short.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from pika.adapters.blocking_connection import BlockingChannel
from structlog.testing import capture_logs

from hpcrl_common import admin
from hpcrl_common.access import SCHEDULER_SUBSCRIBER, role_permissions
from hpcrl_common.broker import Consumer, Reject
from hpcrl_common.config import BrokerSettings
from hpcrl_common.topology import (
    CODE_TO_BENCH,
    FANOUT_EXCHANGES,
    ORIGINAL_USER_HEADER,
    REASON_HEADER,
    WEIGHT_UPDATES,
    WORK_QUEUES,
    DurableQueue,
    Topology,
)

from ..conftest import RunningConsumer
from ..support.waiting import wait_for

pytestmark = pytest.mark.broker

MIGRATE_HINT = "hpcrl-broker-admin migrate"


def declare_as_before(channel: BlockingChannel, topology: Topology) -> None:
    """The topology as releases before quorum dead-letter queues declared it."""
    channel.exchange_declare(topology.dead_letter_exchange, "direct", durable=True)
    for base in [*WORK_QUEUES, *FANOUT_EXCHANGES]:
        channel.queue_declare(topology.dlq(base), durable=True)
        channel.queue_bind(
            topology.dlq(base), topology.dead_letter_exchange, routing_key=topology.name(base)
        )
    for base in WORK_QUEUES:
        channel.queue_declare(
            topology.name(base), durable=True, arguments=topology.work_queue_arguments(base)
        )
        channel.exchange_declare(topology.work_exchange(base), "direct", durable=True)
        channel.queue_bind(
            topology.name(base), topology.work_exchange(base), routing_key=topology.name(base)
        )
    channel.exchange_declare(topology.name(WEIGHT_UPDATES), "fanout", durable=True)
    scheduler = topology.subscriber_queue(WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER)
    channel.queue_declare(
        scheduler, durable=True, arguments=topology.dead_letter_arguments(WEIGHT_UPDATES)
    )
    channel.queue_bind(scheduler, topology.name(WEIGHT_UPDATES))


def queue_types(namespace: str) -> dict[str, str]:
    out = subprocess.run(
        ["rabbitmqctl", "-q", "list_queues", "--no-table-headers", "name", "type"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = (line.split("\t") for line in out.splitlines() if line.startswith(namespace + "."))
    return {name.strip(): kind.strip() for name, kind in rows}


def dead_letter(channel: BlockingChannel, topology: Topology, base: str, tag: str) -> None:
    """A dead letter as a consumer publishes it (reason header, the publisher's user_id)."""
    properties = pika.BasicProperties(
        delivery_mode=2, message_id=tag, user_id="guest", headers={REASON_HEADER: f"reason {tag}"}
    )
    channel.basic_publish(
        topology.dead_letter_exchange,
        topology.name(base),
        tag.encode(),
        properties=properties,
        mandatory=True,
    )


def drain(channel: BlockingChannel, queue: str) -> list[tuple[pika.BasicProperties, bytes]]:
    found = []
    while True:
        method, properties, body = channel.basic_get(queue, auto_ack=True)
        if method is None:
            return found
        found.append((properties, body))


@pytest.fixture
def old_broker(broker_settings: BrokerSettings, raw_channel: BlockingChannel) -> Iterator[Topology]:
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    declare_as_before(raw_channel, topology)
    yield topology


@pytest.fixture
def admin_config(broker_settings: BrokerSettings, tmp_path: Path) -> Path:
    """An administrator's config for the test's namespace."""
    config = tmp_path / "admin.toml"
    config.write_text(
        f'[broker]\nurl = "{broker_settings.url}"\n'
        f'namespace = "{broker_settings.namespace}"\n'
        f"delivery_limit = {broker_settings.delivery_limit}\n"
    )
    return config


@pytest.fixture
def migrate(admin_config: Path):
    """``hpcrl-broker-admin migrate`` for the test's namespace: its exit status."""
    return lambda: admin.main(["migrate", "--config", str(admin_config)])


def test_services_keep_running_on_classic_queues_and_say_to_migrate(
    broker_settings, raw_channel, old_broker
):
    topology = old_broker

    def refuse(_message, _delivery):
        raise Reject("never good")

    consumer = Consumer(broker_settings, "on-an-old-broker")
    consumer.subscribe(CODE_TO_BENCH, refuse)
    consumer.subscribe_fanout(WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER, lambda _m, _d: [], durable=True)
    with capture_logs() as logs, RunningConsumer(consumer):
        raw_channel.basic_publish(
            topology.work_exchange(CODE_TO_BENCH),
            topology.name(CODE_TO_BENCH),
            b"not msgpack",
            mandatory=True,
        )
        dlq = topology.dlq(CODE_TO_BENCH)
        wait_for(
            lambda: raw_channel.queue_declare(dlq, passive=True).method.message_count == 1,
            what="the dead letter in the classic DLQ",
        )
    warned = [entry for entry in logs if MIGRATE_HINT in entry["event"]]
    assert {queue for entry in warned for queue in entry["queues"]} == {
        *map(topology.dlq, [*WORK_QUEUES, *FANOUT_EXCHANGES]),
        topology.subscriber_queue(WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER),
    }
    assert set(queue_types(topology.namespace).values()) == {"classic", "quorum"}  # untouched


def test_migrate_moves_every_message_into_quorum_queues(
    broker_settings, raw_channel, old_broker, migrate, capsys
):
    topology = old_broker
    bases = [*WORK_QUEUES, *FANOUT_EXCHANGES]
    for base in bases:
        for index in range(3):
            dead_letter(raw_channel, topology, base, f"{base}-{index}")
    raw_channel.basic_publish(
        topology.name(WEIGHT_UPDATES),
        "",
        b"update",
        properties=pika.BasicProperties(delivery_mode=2),
    )

    assert migrate() == 0
    out = capsys.readouterr().out
    assert f"{topology.dlq(CODE_TO_BENCH)}: a quorum queue now, holding 3 messages" in out

    types = queue_types(topology.namespace)
    assert set(types.values()) == {"quorum"}, types
    assert not [name for name in types if name.endswith(admin.MIGRATING_SUFFIX)]
    for base in bases:
        moved = drain(raw_channel, topology.dlq(base))
        assert [body for _props, body in moved] == [f"{base}-{i}".encode() for i in range(3)]
        for properties, body in moved:
            assert properties.message_id == body.decode()
            assert properties.headers[REASON_HEADER] == f"reason {body.decode()}"
            assert properties.headers[ORIGINAL_USER_HEADER] == "guest"
            assert properties.delivery_mode == 2
    scheduler = topology.subscriber_queue(WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER)
    assert [body for _props, body in drain(raw_channel, scheduler)] == [b"update"]

    # The queues are bound as before: new dead letters and updates reach them.
    dead_letter(raw_channel, topology, CODE_TO_BENCH, "after")
    raw_channel.basic_publish(topology.name(WEIGHT_UPDATES), "", b"next")
    assert [body for _p, body in drain(raw_channel, topology.dlq(CODE_TO_BENCH))] == [b"after"]
    assert [body for _p, body in drain(raw_channel, scheduler)] == [b"next"]

    assert migrate() == 0  # a second run has nothing to do
    assert "a quorum queue now" not in capsys.readouterr().out
    consumer = Consumer(broker_settings, "on-a-migrated-broker")
    consumer.subscribe_fanout(WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER, lambda _m, _d: [], durable=True)
    with capture_logs() as logs, RunningConsumer(consumer):
        pass
    assert not [entry for entry in logs if MIGRATE_HINT in entry["event"]]


def test_a_migration_cut_short_carries_on(raw_channel, old_broker, migrate):
    """A run that died after filling the holding queue (classic queue still there), or after
    deleting the classic queue: the rerun ends with every message in the quorum queue."""
    topology = old_broker
    for base, classic_left in ((CODE_TO_BENCH, True), (WEIGHT_UPDATES, False)):
        dlq = topology.dead_letter_queue(base)
        holding = DurableQueue(dlq.name + admin.MIGRATING_SUFFIX, bindings=dlq.bindings)
        dead_letter(raw_channel, topology, base, f"{base}-0")
        holding.declare(raw_channel)
        dlq.unbind(raw_channel)
        admin.move_messages(raw_channel, dlq.name, holding.name)
        if classic_left:
            # and bound again, as a service that reconnected meanwhile binds it
            dlq.declare(raw_channel, classic=True)
        else:
            raw_channel.queue_delete(dlq.name)
        dead_letter(raw_channel, topology, base, f"{base}-1")  # reaches one or both

    assert migrate() == 0
    types = queue_types(topology.namespace)
    assert set(types.values()) == {"quorum"}, types
    for base in (CODE_TO_BENCH, WEIGHT_UPDATES):
        bodies = {body for _p, body in drain(raw_channel, topology.dlq(base))}
        assert bodies == {f"{base}-0".encode(), f"{base}-1".encode()}


def test_migrate_leaves_a_consumed_queue_alone(rabbitmq, raw_channel, old_broker, migrate, capsys):
    topology = old_broker
    scheduler = topology.subscriber_queue(WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER)
    raw_channel.basic_publish(
        topology.name(WEIGHT_UPDATES),
        "",
        b"update",
        properties=pika.BasicProperties(delivery_mode=2),
    )
    wait_for(lambda: raw_channel.queue_declare(scheduler, passive=True).method.message_count)
    reader = pika.BlockingConnection(pika.URLParameters(rabbitmq))
    try:
        reader.channel().basic_consume(scheduler, lambda *_args: None)  # never acks
        assert migrate() == 1
    finally:
        reader.close()
    err = capsys.readouterr().err
    assert f"{scheduler} has 1 consumer(s): stop them" in err
    types = queue_types(topology.namespace)
    assert types[scheduler] == "classic"
    assert types[topology.dlq(CODE_TO_BENCH)] == "quorum"  # the others were migrated
    assert migrate() == 0  # once the scheduler is stopped
    assert [body for _p, body in drain(raw_channel, scheduler)] == [b"update"]


def test_a_service_running_through_the_migration_loses_no_dead_letter(
    broker_settings, raw_channel, old_broker, migrate
):
    topology = old_broker
    inbox, queue = topology.work_exchange(CODE_TO_BENCH), topology.name(CODE_TO_BENCH)
    dlq = topology.dlq(CODE_TO_BENCH)

    def depth() -> int:
        return raw_channel.queue_declare(dlq, passive=True).method.message_count

    consumer = Consumer(broker_settings, "through-the-migration")
    consumer.subscribe(CODE_TO_BENCH, lambda _m, _d: [])
    with RunningConsumer(consumer):
        raw_channel.basic_publish(inbox, queue, b"before", mandatory=True)
        wait_for(lambda: depth() == 1, what="the first dead letter (classic queue)")
        assert migrate() == 0
        assert queue_types(topology.namespace)[dlq] == "quorum"
        raw_channel.basic_publish(inbox, queue, b"after", mandatory=True)
        wait_for(lambda: depth() == 2, what="the second dead letter (quorum queue)")
    assert sorted(body for _p, body in drain(raw_channel, dlq)) == [b"after", b"before"]


def test_declare_on_an_old_broker_names_migrate(old_broker, admin_config, capsys):
    assert admin.main(["declare", "--config", str(admin_config)]) == 2
    err = capsys.readouterr().err
    assert "inequivalent arg 'x-queue-type'" in err and f"`{MIGRATE_HINT}` instead" in err
    assert "Traceback" not in err


def test_a_generator_may_not_touch_the_holding_queues():
    """Its replica queues are 'anything under weight-updates', but not what migrate holds."""
    configure = role_permissions(Topology("exp"), "generator").configure
    for queue in ("dlq", "scheduler", "dlq.migrating", "scheduler.migrating"):
        assert not re.fullmatch(configure, f"exp.weight-updates.{queue}"), queue
    assert re.fullmatch(configure, "exp.weight-updates.gpu-node-3-4242")
