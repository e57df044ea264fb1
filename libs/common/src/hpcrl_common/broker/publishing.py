"""Publishing: one confirmed, persistent, ``mandatory`` message (:func:`publish_on`), the
channel it goes out on (:func:`prepare_channel`), and :class:`Publisher` for code that only
sends."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pika
import pika.exceptions
import structlog
from pika.adapters.blocking_connection import BlockingChannel

from hpcrl_common.broker.connection import (
    RECOVERABLE,
    _Backoff,
    connection_parameters,
    open_connection,
)
from hpcrl_common.broker.metrics import PUBLISHED
from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import Message, MessageError, encode
from hpcrl_common.topology import (
    DurableQueue,
    Topology,
    classic_queues,
    inbox_of,
    is_queue_type_conflict,
)

log = structlog.get_logger("hpcrl.broker")
# After a nacked publish (see ChannelRefused), the least wait before a new channel: long
# enough for the quorum queues of a lost node to have elected new leaders.
_REFUSED_PAUSE_S = 1.0


@dataclass(frozen=True)
class Publish:
    """One output message. ``routing_key`` is the full queue name (``topology.name(...)``)."""

    routing_key: str
    message: Message
    exchange: str = ""
    mandatory: bool = True
    # AMQP headers (text values), e.g. the reason of a dead letter published by a handler.
    headers: tuple[tuple[str, str], ...] = ()


class ChannelRefused(pika.exceptions.AMQPChannelError):
    """The broker nacked a publish: handled as a lost connection (reconnect, publish again).

    After a node is lost, RabbitMQ (3.10) nacks every publish to a quorum queue on a channel
    whose first publish to it came while the queue was electing a new leader, for as long
    as that channel lives; a new channel is served. Publishing again is safe: consumers
    dedupe by message id.
    """


class TopologyMissing(RuntimeError):
    """The admin step has not declared what this service needs yet: retried with backoff."""


def publish_on(
    channel: BlockingChannel, item: Publish, max_bytes: int, user_id: str | None = None
) -> None:
    """Publish one message persistently and wait for the broker's confirm.

    A message for a work queue goes through the queue's own exchange (``<queue>.in``); a
    ``user_id`` is checked by RabbitMQ against the connection's user, so consumers can trust
    it to say who published.
    """
    body = encode(item.message)
    if len(body) > max_bytes:
        raise MessageError(f"refusing to publish {len(body)} bytes > limit {max_bytes}")
    properties = pika.BasicProperties(
        delivery_mode=pika.DeliveryMode.Persistent,
        content_type="application/msgpack",
        message_id=item.message.id,
        type=item.message.schema_tag(),
        timestamp=int(time.time()),
        user_id=user_id,
        headers=dict(item.headers) or None,
    )
    exchange = item.exchange or inbox_of(item.routing_key)
    channel.basic_publish(
        exchange, item.routing_key, body, properties=properties, mandatory=item.mandatory
    )
    PUBLISHED.labels(item.routing_key or item.exchange).inc()


def prepare_channel(
    connection: pika.BlockingConnection, settings: BrokerSettings, topology: Topology
) -> BlockingChannel:
    """A confirming channel on a broker that holds the topology (declared or checked)."""
    if settings.declare_topology:
        channel = declare_keeping_classic(
            connection, topology.declare, topology.dead_letter_queues()
        )
    else:
        missing = topology.missing(connection.channel)
        if missing:
            raise TopologyMissing(
                f"the broker lacks {', '.join(missing)}: declare the topology first "
                f"(hpcrl-broker-admin declare), or set broker.declare_topology = true"
            )
        channel = connection.channel()
    channel.confirm_delivery()
    return channel


def declare_keeping_classic(
    connection: pika.BlockingConnection,
    declare: Callable[..., object],
    queues: Sequence[DurableQueue],
) -> BlockingChannel:
    """Run ``declare(channel, classic=...)`` on a new channel and return that channel.

    A broker set up by an older release has classic queues where this one declares quorum
    queues (``queues``), and refuses to redeclare them (406, which closes the channel): the
    service keeps those as they are, so that it runs on until an operator migrates them,
    and says so at each connect.
    """
    channel = connection.channel()
    try:
        declare(channel, classic=())
        return channel
    except pika.exceptions.ChannelClosedByBroker as exc:
        if not is_queue_type_conflict(exc):
            raise
    classic = classic_queues(connection.channel, queues)
    if classic:
        log.warning(
            "classic queues left by an older release: they are lost with the node "
            "that holds them; run `hpcrl-broker-admin migrate` to make them quorum "
            "queues",
            queues=classic,
        )
    channel = connection.channel()
    declare(channel, classic=classic)
    return channel


class Publisher:
    """A confirming publisher for code that only sends (CLIs, tests, one-shot tools)."""

    def __init__(
        self,
        settings: BrokerSettings,
        client: str = "publisher",
        *,
        topology: Topology | None = None,
    ) -> None:
        self.settings = settings
        self.topology = topology or Topology(settings.namespace, settings.delivery_limit)
        self._params = connection_parameters(settings, client)
        self._connection: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None

    def _ensure_channel(self) -> BlockingChannel:
        if self._channel is None or not self._channel.is_open:
            self.close()
            self._connection = open_connection(self._params)
            self._channel = prepare_channel(self._connection, self.settings, self.topology)
        return self._channel

    def publish(self, *items: Publish, attempts: int = 8) -> None:
        backoff = _Backoff(self.settings)
        for index, item in enumerate(items):
            for attempt in range(1, attempts + 1):
                try:
                    publish_on(
                        self._ensure_channel(),
                        item,
                        self.settings.max_message_bytes,
                        self._params[0].credentials.username,
                    )
                    break
                except (*RECOVERABLE, pika.exceptions.NackError) as exc:
                    self.close()  # a nacking channel stays so (see ChannelRefused): a new one
                    if attempt == attempts:
                        raise
                    delay = backoff.next()
                    if isinstance(exc, pika.exceptions.NackError):
                        delay = max(delay, _REFUSED_PAUSE_S)
                    log.warning(
                        "publish failed, retrying", error=repr(exc), delay_s=delay, item=index
                    )
                    time.sleep(delay)

    def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            with contextlib.suppress(RECOVERABLE):
                connection.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
