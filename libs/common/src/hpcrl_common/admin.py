"""hpcrl-broker-admin: the one-off broker set-up of an experiment, run by an operator.

    hpcrl-broker-admin definitions --config exp.toml --password-dir secrets/ --out defs.json
    rabbitmqctl import_definitions defs.json          # vhost, users, permissions, topology
    hpcrl-broker-admin declare --config exp.toml      # or: only the topology, as an admin user

After this the services run with ``broker.declare_topology = false`` and one user per role
(``broker.role_users``), each allowed only its own queues (see :mod:`hpcrl_common.access`).

    hpcrl-broker-admin migrate --config exp.toml      # once, on a broker of an older release

makes the dead-letter queues and the scheduler's update queue, classic queues before this
release, quorum queues (replicated, so a clustered broker keeps them when it loses a node),
keeping their messages; see :func:`migrate_queue`.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import struct
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from hpcrl_common.access import (
    CLIENT_ROLE,
    ROLES,
    SCHEDULER_SUBSCRIBER,
    AnyRole,
    definitions,
    role_user,
)
from hpcrl_common.broker import _as_text, connection_parameters, open_connection
from hpcrl_common.config import ConfigError, ServiceConfig, load_config
from hpcrl_common.service import add_config_argument
from hpcrl_common.topology import (
    ORIGINAL_USER_HEADER,
    WEIGHT_UPDATES,
    DurableQueue,
    Topology,
    classic_queues,
    is_queue_type_conflict,
)

MIGRATING_SUFFIX = ".migrating"
# Before the last look into an unbound holding queue: a publish routed to it just before
# the unbind may still be on its way in.
_SETTLE_S = 0.5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpcrl-broker-admin", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    defs = commands.add_parser(
        "definitions", help="write a RabbitMQ definitions file: vhost, role users, topology"
    )
    add_config_argument(defs)
    defs.add_argument(
        "--password-dir",
        type=Path,
        required=True,
        help="one <user>.password file per user (mode 600); existing files are "
        "kept, missing ones get a new random password",
    )
    defs.add_argument("--out", type=Path, required=True, help="definitions JSON to write")
    defs.add_argument("--vhost", help="default: the vhost of broker.url")
    defs.add_argument(
        "--extra-user",
        action="append",
        default=[],
        metavar="ROLE:NAME",
        help="another user of a role, named <role user>.<NAME> (e.g. "
        "benchmarker:site-b; client:alice for an outside trainer, with its "
        "own verdict queue); repeatable",
    )
    declare = commands.add_parser(
        "declare", help="declare the topology with the config's (admin) broker user"
    )
    add_config_argument(declare)
    migrate = commands.add_parser(
        "migrate",
        help="make the classic dead-letter and scheduler update queues of an older "
        "release quorum queues, keeping their messages; then declare the topology",
    )
    add_config_argument(migrate)
    args = parser.parse_args(argv)
    try:
        config = load_config(ServiceConfig, args.config)
        if args.command == "definitions":
            return write_definitions(config, args)
        if args.command == "migrate":
            return migrate_topology(config)
        return declare_topology(config)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def write_definitions(config: ServiceConfig, args: argparse.Namespace) -> int:
    broker = config.broker
    vhost = args.vhost or unquote(urlsplit(broker.url).path.lstrip("/")) or "/"
    users: dict[str, tuple[AnyRole, str]] = {}
    for role in ROLES:
        users[broker.role_users[role]] = (role, "")
    for extra in args.extra_user:
        role, _, name = extra.partition(":")
        if role not in (*ROLES, CLIENT_ROLE) or not name or "." in name:
            raise ValueError(
                f"--extra-user {extra!r}: expected ROLE:NAME with a role of "
                f"{', '.join((*ROLES, CLIENT_ROLE))} and a NAME without dots"
            )
        user = f"{role_user(broker.role_users, role)}.{name}"
        users[user] = (role, "")  # type: ignore[assignment]
    args.password_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    users = {
        name: (role, _password(args.password_dir / f"{name}.password"))
        for name, (role, _) in users.items()
    }
    topology = Topology(broker.namespace, broker.delivery_limit)
    document = definitions(topology, vhost, users)
    _write_private(args.out, json.dumps(document, indent=2) + "\n")
    print(
        f"wrote {args.out}: vhost {vhost!r}, users {', '.join(sorted(users))}; passwords in "
        f"{args.password_dir}/<user>.password"
    )
    return 0


def _password(path: Path) -> str:
    if path.exists():
        return path.read_text().strip("\r\n")
    password = secrets.token_urlsafe(24)
    _write_private(path, password + "\n")
    return password


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    path.chmod(0o600)


def declare_topology(config: ServiceConfig) -> int:
    broker = config.broker
    topology = Topology(broker.namespace, broker.delivery_limit)
    connection = open_connection(connection_parameters(broker, "hpcrl-broker-admin"))
    try:
        _declare_all(connection.channel(), topology)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if is_queue_type_conflict(exc):
            raise ValueError(
                f"declaring the topology failed: {exc.reply_text}; a broker set "
                f"up by an older release needs `hpcrl-broker-admin migrate` "
                f"instead"
            ) from None
        raise ValueError(f"declaring the topology failed: {exc!r}") from None
    except pika.exceptions.AMQPError as exc:
        raise ValueError(f"declaring the topology failed: {exc!r}") from None
    finally:
        _close(connection)
    print(f"declared the topology (namespace {broker.namespace!r}) on {broker.masked_url}")
    return 0


def _declare_all(channel: BlockingChannel, topology: Topology) -> None:
    topology.declare(channel)
    # The scheduler's durable update queue is known in advance; generator replicas make
    # their own auto-deleted ones.
    topology.declare_subscriber(channel, WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER, durable=True)


def _close(connection: pika.BlockingConnection) -> None:
    if connection.is_open:  # a connection-level error has closed it already
        connection.close()


class MigrationRefused(RuntimeError):
    """A queue cannot be migrated now; nothing of it was changed."""


def migrate_topology(config: ServiceConfig) -> int:
    """Migrate every queue that was classic in older releases, then declare the topology.

    Run it once every service runs this release: older services redeclare those queues as
    classic queues, which the broker refuses once they are quorum queues.
    """
    broker = config.broker
    topology = Topology(broker.namespace, broker.delivery_limit)
    queues = [
        *topology.dead_letter_queues(),
        topology.durable_subscriber_queue(WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER),
    ]
    connection = open_connection(connection_parameters(broker, "hpcrl-broker-admin"))
    refused = []
    try:
        for queue in queues:
            try:
                held = migrate_queue(connection, queue)
            except MigrationRefused as exc:
                refused.append(str(exc))
                continue
            if held is not None:
                print(f"{queue.name}: a quorum queue now, holding {held} messages")
        if not refused:
            _declare_all(connection.channel(), topology)
    except pika.exceptions.AMQPError as exc:
        raise ValueError(
            f"migrating failed: {exc!r}; no message was lost, and running "
            f"`hpcrl-broker-admin migrate` again carries on"
        ) from None
    finally:
        _close(connection)
    for reason in refused:
        print(f"error: {reason}", file=sys.stderr)
    if refused:
        return 1
    print(f"migrated the topology (namespace {broker.namespace!r}) on {broker.masked_url}")
    return 0


def migrate_queue(connection: pika.BlockingConnection, queue: DurableQueue) -> int | None:
    """Make ``queue`` a quorum queue if it is a classic one; return how many messages it then
    holds, or None when it was a quorum queue already.

    The messages go through a quorum holding queue ``<name>.migrating``, bound like the
    queue before the queue is unbound, so that a message routed meanwhile reaches one or
    the other (possibly both: a duplicate, never a loss). A message is acked only once its
    copy is confirmed, so a run cut short loses nothing, and a rerun carries on from
    whatever state it left (classic queue and holding queue, or holding queue alone).
    """
    holding = DurableQueue(queue.name + MIGRATING_SUFFIX, bindings=queue.bindings)
    # Also makes a missing queue (as a quorum queue): the rerun of a run cut short after
    # deleting the classic one.
    classic = bool(classic_queues(connection.channel, [queue]))
    if not classic and not _exists(connection, holding.name):
        return None
    if classic:
        channel = _confirming_channel(connection)
        _empty_classic(channel, queue, holding)
        # A channel that used the classic queue keeps its state under the name and crashes
        # on a publish to the quorum queue that now bears it (RabbitMQ 3.10): a new one.
        channel.close()
    channel = _confirming_channel(connection)
    queue.declare(channel)
    holding.unbind(channel)
    time.sleep(_SETTLE_S)
    move_messages(channel, holding.name, queue.name)
    # Unbound, unconsumed and empty: nothing can reach it any more. (Quorum queues do not
    # take if_empty.)
    channel.queue_delete(holding.name)
    held = channel.queue_declare(queue.name, passive=True).method.message_count
    channel.close()
    return held


def _confirming_channel(connection: pika.BlockingConnection) -> BlockingChannel:
    channel = connection.channel()
    channel.confirm_delivery()
    return channel


def _exists(connection: pika.BlockingConnection, queue: str) -> bool:
    channel = connection.channel()
    try:
        channel.queue_declare(queue, passive=True)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code != 404:
            raise
        return False
    channel.close()
    return True


def _empty_classic(channel: BlockingChannel, queue: DurableQueue, holding: DurableQueue) -> None:
    """Move the classic queue's messages to the holding queue and delete it."""
    consumers = channel.queue_declare(queue.name, passive=True).method.consumer_count
    if consumers:
        raise MigrationRefused(
            f"{queue.name} has {consumers} consumer(s): stop them (the scheduler consumes "
            f"its update queue) and run `hpcrl-broker-admin migrate` again"
        )
    holding.declare(channel)  # new messages reach the holding queue too ...
    queue.unbind(channel)  # ... and then only it
    move_messages(channel, queue.name, holding.name)
    # The broker refuses (and the rerun carries on) if a message or a consumer came since.
    channel.queue_delete(queue.name, if_empty=True, if_unused=True)


def move_messages(channel: BlockingChannel, source: str, target: str) -> int:
    """Move every message of ``source`` to ``target`` (through the default exchange), each
    acked only once the broker confirmed its copy: at-least-once. ``channel`` confirms."""
    moved = 0
    while True:
        method, properties, body = channel.basic_get(source, auto_ack=False)
        if method is None:
            return moved
        _republish(channel, target, properties, body)
        channel.basic_ack(method.delivery_tag)
        moved += 1


def _republish(
    channel: BlockingChannel, queue: str, properties: pika.BasicProperties, body: bytes
) -> None:
    headers = dict(properties.headers or {})
    # The holding queue's own redelivery count, which consumers of the new queue would
    # take for theirs.
    headers.pop("x-delivery-count", None)
    if properties.user_id is not None:
        # The broker refuses a user_id other than this connection's: keep it as a header.
        headers[ORIGINAL_USER_HEADER] = properties.user_id
        properties.user_id = None
    properties.headers = headers or None
    try:
        channel.basic_publish("", queue, body, properties=properties, mandatory=True)
    except (
        TypeError,
        ValueError,
        OverflowError,
        struct.error,
        pika.exceptions.UnsupportedAMQPFieldException,
    ):
        # Headers pika decoded but cannot encode again (nothing was sent): keep them as text.
        properties.headers = _as_text(headers)
        channel.basic_publish("", queue, body, properties=properties, mandatory=True)


if __name__ == "__main__":
    sys.exit(main())
