"""hpcrl-broker-admin: the one-off broker set-up of an experiment, run by an operator.

    hpcrl-broker-admin definitions --config exp.toml --password-dir secrets/ --out defs.json
    rabbitmqctl import_definitions defs.json          # vhost, users, permissions, topology
    hpcrl-broker-admin declare --config exp.toml      # or: only the topology, as an admin user

After this the services run with ``broker.declare_topology = false`` and one user per role
(``broker.role_users``), each allowed only its own queues (see :mod:`hpcrl_common.access`).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pika

from hpcrl_common.access import ROLES, SCHEDULER_SUBSCRIBER, Role, definitions
from hpcrl_common.broker import connection_parameters, open_connection
from hpcrl_common.config import ConfigError, ServiceConfig, load_config
from hpcrl_common.service import add_config_argument
from hpcrl_common.topology import WEIGHT_UPDATES, Topology


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpcrl-broker-admin", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    defs = commands.add_parser(
        "definitions", help="write a RabbitMQ definitions file: vhost, role users, topology")
    add_config_argument(defs)
    defs.add_argument("--password-dir", type=Path, required=True,
                      help="one <user>.password file per user (mode 600); existing files are "
                      "kept, missing ones get a new random password")
    defs.add_argument("--out", type=Path, required=True, help="definitions JSON to write")
    defs.add_argument("--vhost", help="default: the vhost of broker.url")
    defs.add_argument("--extra-user", action="append", default=[], metavar="ROLE:NAME",
                      help="another user of a role, named <role user>.<NAME> (e.g. "
                      "benchmarker:site-b); repeatable")
    declare = commands.add_parser(
        "declare", help="declare the topology with the config's (admin) broker user")
    add_config_argument(declare)
    args = parser.parse_args(argv)
    try:
        config = load_config(ServiceConfig, args.config)
        if args.command == "definitions":
            return write_definitions(config, args)
        return declare_topology(config)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def write_definitions(config: ServiceConfig, args: argparse.Namespace) -> int:
    broker = config.broker
    vhost = args.vhost or unquote(urlsplit(broker.url).path.lstrip("/")) or "/"
    users: dict[str, tuple[Role, str]] = {}
    for role in ROLES:
        users[broker.role_users[role]] = (role, "")
    for extra in args.extra_user:
        role, _, name = extra.partition(":")
        if role not in ROLES or not name or "." in name:
            raise ValueError(f"--extra-user {extra!r}: expected ROLE:NAME with a role of "
                             f"{', '.join(ROLES)} and a NAME without dots")
        users[f"{broker.role_users[role]}.{name}"] = (role, "")  # type: ignore[index]
    args.password_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    users = {name: (role, _password(args.password_dir / f"{name}.password"))
             for name, (role, _) in users.items()}
    topology = Topology(broker.namespace, broker.delivery_limit)
    document = definitions(topology, vhost, users)
    _write_private(args.out, json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.out}: vhost {vhost!r}, users {', '.join(sorted(users))}; passwords in "
          f"{args.password_dir}/<user>.password")
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
        channel = connection.channel()
        topology.declare(channel)
        # The scheduler's durable update queue is known in advance; generator replicas make
        # their own auto-deleted ones.
        topology.declare_subscriber(channel, WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER, durable=True)
    except pika.exceptions.AMQPError as exc:
        raise ValueError(f"declaring the topology failed: {exc!r}") from None
    finally:
        connection.close()
    print(f"declared the topology (namespace {broker.namespace!r}) on {broker.masked_url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
