"""Reliable RabbitMQ messaging on pika, shared by every service.

The guarantees, end to end at-least-once and effectively-once with id-keyed consumers:

* publisher confirms + persistent messages + ``mandatory`` routing: a publish returns only
  once the broker has taken responsibility for the message;
* manual acks, sent only after the handler's own outputs are confirmed;
* handlers run on worker threads while the connection's I/O loop keeps the heartbeat alive;
* a body that is not a valid message is dead-lettered at once with the reason in the
  ``x-hpcrl-reason`` header; a handler that keeps raising is dead-lettered after
  ``delivery_limit`` tries (the quorum queue's own delivery limit is the backstop for a
  message that kills its consumer);
* on a lost connection the consumer reconnects with exponential backoff; unacked messages
  come back from the broker, and a message whose outputs were already produced is not
  handled again (an id-keyed memory of completed messages), so nothing is lost and nothing
  is done twice in effect.

The rooms, each read on its own:

* :mod:`~hpcrl_common.broker.connection`: addresses and failover, credentials, TLS, what a
  lost connection looks like, the backoff between attempts;
* :mod:`~hpcrl_common.broker.publishing`: one confirmed publish, the channel it goes out on,
  :class:`Publisher`;
* :mod:`~hpcrl_common.broker.delivery`: what a handler sees and answers;
* :mod:`~hpcrl_common.broker.consuming`: :class:`Consumer`, its loop and reconnects,
  settling and dead-lettering;
* :mod:`~hpcrl_common.broker.metrics`: the layer's Prometheus metrics.

Import from here: ``from hpcrl_common.broker import Consumer, Publish``.
"""

from hpcrl_common.broker.connection import (
    RECOVERABLE,
    BrokerSetupError,
    TlsRefused,
    broker_address,
    connection_parameters,
    open_connection,
    read_password,
    tls_context,
)
from hpcrl_common.broker.consuming import Consumer
from hpcrl_common.broker.delivery import (
    DEFER,
    Delivery,
    Handler,
    Ignore,
    Reject,
    _as_text,
    delivery_count,
)
from hpcrl_common.broker.metrics import (
    CONNECTED,
    CONSUMED,
    HANDLER_SECONDS,
    PERIODIC_FAILURES,
    PUBLISHED,
    RECONNECTS,
)
from hpcrl_common.broker.publishing import (
    ChannelRefused,
    Publish,
    Publisher,
    TopologyMissing,
    declare_keeping_classic,
    prepare_channel,
    publish_on,
)

__all__ = [
    "CONNECTED",
    "CONSUMED",
    "DEFER",
    "HANDLER_SECONDS",
    "PERIODIC_FAILURES",
    "PUBLISHED",
    "RECONNECTS",
    "RECOVERABLE",
    "BrokerSetupError",
    "ChannelRefused",
    "Consumer",
    "Delivery",
    "Handler",
    "Ignore",
    "Publish",
    "Publisher",
    "Reject",
    "TlsRefused",
    "TopologyMissing",
    "_as_text",
    "broker_address",
    "connection_parameters",
    "declare_keeping_classic",
    "delivery_count",
    "open_connection",
    "prepare_channel",
    "publish_on",
    "read_password",
    "tls_context",
]
