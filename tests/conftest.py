"""Fixtures shared by every suite: the real RabbitMQ, isolated per test by a namespace."""

from __future__ import annotations

import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator

import pika
import pytest
from hypothesis import settings

from hpcrl_common.broker import Consumer
from hpcrl_common.config import BrokerSettings
from hpcrl_common.topology import Topology

BROKER_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"

# Hypothesis's per-example deadline (200 ms) measures the node, not the code: on 2 shared
# cores a pure reward example took 281 ms once and 0.65 ms when replayed. Tests that need a
# time bound state it themselves.
settings.register_profile("hpcrl", deadline=None)
settings.load_profile("hpcrl")


def _broker_answers() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def rabbitmq() -> str:
    if not _broker_answers():
        pytest.fail("RabbitMQ is not answering on 127.0.0.1:5672; run `make install` first")
    return BROKER_URL


@pytest.fixture
def broker_settings(rabbitmq: str) -> Iterator[BrokerSettings]:
    """Settings with a fresh namespace; everything it declared is deleted afterwards."""
    settings = BrokerSettings(
        url=rabbitmq,
        namespace=f"test-{uuid.uuid4().hex[:10]}",
        heartbeat_s=5,
        delivery_limit=3,
        prefetch=4,
        reconnect_initial_s=0.2,
        reconnect_max_s=2.0,
    )
    yield settings
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq))
    try:
        topology = Topology(settings.namespace, settings.delivery_limit)
        channel = connection.channel()
        topology.delete(channel)
        for queue in list_queues(settings.namespace):
            channel.queue_delete(queue)
    finally:
        connection.close()


def list_queues(prefix: str) -> list[str]:
    out = subprocess.run(
        ["rabbitmqctl", "-q", "list_queues", "--no-table-headers", "name"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.strip() for line in out.splitlines() if line.strip().startswith(prefix + ".")]


@pytest.fixture
def raw_channel(rabbitmq: str) -> Iterator[pika.adapters.blocking_connection.BlockingChannel]:
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq))
    channel = connection.channel()
    channel.confirm_delivery()
    yield channel
    if connection.is_open:
        connection.close()


class RunningConsumer:
    """A consumer running its loop on a background thread for the length of a test."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.thread = threading.Thread(target=consumer.run, daemon=True)

    def __enter__(self) -> Consumer:
        self.thread.start()
        if not self.consumer.connected.wait(15):
            raise TimeoutError("consumer did not connect within 15 s")
        return self.consumer

    def __exit__(self, *exc: object) -> None:
        self.consumer.stop()
        self.thread.join(15)


def close_connections(client: str) -> int:
    """Make the broker close every connection named ``client``, as an operator would."""
    out = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "--no-table-headers", "pid", "client_properties"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    closed = 0
    for line in out.splitlines():
        pid, _, props = line.partition("\t")
        if f'{{"connection_name","{client}"}}' in props:
            subprocess.run(
                ["rabbitmqctl", "-q", "close_connection", pid, "test: forced close"],
                check=True,
                capture_output=True,
            )
            closed += 1
    return closed
