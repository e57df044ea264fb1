"""Who may do what on the broker: one user per role, each allowed only its own queues.

Pure: no I/O. RabbitMQ checks three permissions per vhost, each a regex over resource names
(queues and exchanges alike): *configure* (declare, delete: ``queue.declare``,
``queue.delete``, ``exchange.declare``, ``exchange.delete``; a passive declare needs none),
*write* (``basic.publish`` to an exchange; the destination of ``queue.bind`` or
``exchange.bind``; the dead-letter exchange of a declared queue) and *read* (``basic.get``,
``basic.consume``, ``queue.purge``; the source exchange of a binding). Publishing
through the default exchange needs write on ``amq.default``, which reaches every queue, so
each work queue has its own direct exchange ``<queue>.in`` and no role gets ``amq.default``.
Exchange names differ from queue names so that a role's write right on an exchange never
becomes a right to bind (or fill) a queue of the same name.

Roles (the four services of docs/SPEC.md section 2; docs/DESIGN.md section 3):

==========  =========================  ================================  ====================
role        consumes                   publishes                         configures
==========  =========================  ================================  ====================
scheduler   bench-results,             generate-requests, batches,       nothing
            candidate-commitments,     code-to-bench (confirmations)
            updates
generator   generate-requests, updates code-to-bench,                    its replica's queue
                                       candidate-commitments
benchmarker code-to-bench              bench-results                     nothing
learner     rollout-batches            weight-updates                    nothing
client      its reward-verdicts queue  reward-requests                   nothing
==========  =========================  ================================  ====================

A *client* is an outside trainer that uses the benchmarker fleet as a reward oracle
(``hpcrl-reward-client``); benchmarkers also consume ``reward-requests`` and may write to
``reward-verdicts.in``, which routes a verdict only to the queue its routing key names. A
benchmarker names the queue of the request's authenticated publisher (its ``user_id``), so
a client cannot direct verdicts to another client's queue; its own queue is made and bound
by the admin with its user (:func:`definitions`), and it may neither bind nor read another.
Client users are ``role_users["client"]`` (default ``hpcrl-client``) or ``<that>.<name>``.

Each role may also publish into the dead-letter queues of what it consumes, through each
one's inbox ``<queue>.dlq.in``; none may publish to the shared dead-letter exchange (the
broker's own path from the work queues), so no role can fill another's dead-letter queue.
The scheduler's update queue is made and bound by the admin (``hpcrl-broker-admin``): the
scheduler only checks it, so it needs no configure right and no read right on the
``weight-updates`` exchange, whose read right would let it bind the exchange into another
role's inbox. A generator replica binds its own queue, so it reads the exchange; its queue is
exclusive (no other connection may delete, purge or read it), and a binding of
``weight-updates`` into an exchange it may write delivers nothing (updates are published with
routing key "", which no binding of those direct exchanges has; and a consumer refuses a
message whose publisher's role may not publish into its queue).

What the read right cannot withhold: RabbitMQ checks ``queue.purge`` against read, as it does
consuming, so a role may purge its own input queue; consuming and acking every message would
drop them as surely.

Publishers are authenticated by the ``user_id`` property, which RabbitMQ checks against the
connection's user: :func:`publisher_allowed` tells a consumer whether that user holds a
role that may publish to the queue.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from hpcrl_common.config import ROLE_NAMES
from hpcrl_common.topology import (
    BENCH_RESULTS,
    CANDIDATE_COMMITMENTS,
    CODE_TO_BENCH,
    FANOUT_EXCHANGES,
    GENERATE_REQUESTS,
    REWARD_REQUESTS,
    ROLLOUT_BATCHES,
    WEIGHT_UPDATES,
    WORK_QUEUES,
    DurableQueue,
    Topology,
)

Role = Literal["scheduler", "generator", "benchmarker", "learner"]
ROLES: tuple[Role, ...] = ROLE_NAMES  # type: ignore[assignment]
SCHEDULER_SUBSCRIBER = "scheduler"
# Not a service: an outside trainer's reward client (not in ROLES, which are the services').
CLIENT_ROLE = "client"
AnyRole = Role | Literal["client"]

# The roles that may publish into each queue or exchange (by base name). The scheduler
# sends a group's winner to code-to-bench again, to be confirmed (hpcrl_scheduler.confirm).
PUBLISHER_ROLES: dict[str, tuple[AnyRole, ...]] = {
    GENERATE_REQUESTS: ("scheduler",),
    CODE_TO_BENCH: ("generator", "scheduler"),
    # What the generator sent for each candidate: only it may say (hpcrl_scheduler.commitments).
    CANDIDATE_COMMITMENTS: ("generator",),
    BENCH_RESULTS: ("benchmarker",),
    ROLLOUT_BATCHES: ("scheduler",),
    WEIGHT_UPDATES: ("learner",),
    REWARD_REQUESTS: (CLIENT_ROLE,),
}
NOTHING = "^$"


@dataclass(frozen=True)
class Permissions:
    configure: str
    write: str
    read: str


def role_permissions(topology: Topology, role: AnyRole, user: str = "") -> Permissions:
    """The regexes that let ``role`` do its work in the experiment's vhost, and no more.

    ``user``: the broker user, for the client role (it reads only its own verdict queue).
    """
    t = topology
    updates = re.escape(t.name(WEIGHT_UPDATES))
    scheduler_queue = re.escape(t.subscriber_queue(WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER))
    # A generator replica names its own auto-deleted update queue (hostname-pid by default):
    # anything under the exchange's name except the scheduler's queue, the DLQ and its
    # inbox, and the holding queues `hpcrl-broker-admin migrate` puts beside those.
    replica_queue = f"{updates}\\.(?!(?:{re.escape(SCHEDULER_SUBSCRIBER)}|dlq)(?:\\.|$)).+"

    def inbox(base: str) -> str:
        return re.escape(t.work_exchange(base))

    def dead_letters(base: str) -> str:
        return re.escape(t.dead_letter_inbox(base))

    def queue(base: str) -> str:
        return re.escape(t.name(base))

    if role == "scheduler":
        return Permissions(
            configure=NOTHING,
            write=_any(
                inbox(GENERATE_REQUESTS),
                inbox(ROLLOUT_BATCHES),
                inbox(CODE_TO_BENCH),
                dead_letters(BENCH_RESULTS),
                dead_letters(CANDIDATE_COMMITMENTS),
                dead_letters(WEIGHT_UPDATES),
            ),
            read=_any(queue(BENCH_RESULTS), queue(CANDIDATE_COMMITMENTS), scheduler_queue),
        )
    if role == "generator":
        return Permissions(
            configure=_any(replica_queue),
            write=_any(
                inbox(CODE_TO_BENCH),
                inbox(CANDIDATE_COMMITMENTS),
                dead_letters(GENERATE_REQUESTS),
                dead_letters(WEIGHT_UPDATES),
                replica_queue,
            ),
            read=_any(queue(GENERATE_REQUESTS), updates, replica_queue),
        )
    if role == "benchmarker":
        return Permissions(
            configure=NOTHING,
            write=_any(
                inbox(BENCH_RESULTS),
                dead_letters(CODE_TO_BENCH),
                re.escape(t.reward_verdicts_exchange),
                dead_letters(REWARD_REQUESTS),
            ),
            read=_any(queue(CODE_TO_BENCH), queue(REWARD_REQUESTS)),
        )
    if role == CLIENT_ROLE:
        if not user:
            raise ValueError("the client role's permissions name its user")
        return Permissions(
            configure=NOTHING,
            write=_any(inbox(REWARD_REQUESTS)),
            read=_any(re.escape(t.reply_queue(user))),
        )
    if role == "learner":
        return Permissions(
            configure=NOTHING,
            write=_any(updates, dead_letters(ROLLOUT_BATCHES)),
            read=_any(queue(ROLLOUT_BATCHES)),
        )
    raise ValueError(f"unknown role {role!r} (known: {', '.join(ROLES)})")


def _any(*patterns: str) -> str:
    return "^(?:" + "|".join(patterns) + ")$"


def publisher_allowed(
    queue_base: str, user_id: str | None, role_users: Mapping[str, str]
) -> str | None:
    """None when ``user_id`` may publish into ``queue_base``; else the reason it may not.

    The role's user is ``role_users[role]``; several users of one role (benchmarkers at
    two sites) are ``<user>.<site>``.
    """
    roles = PUBLISHER_ROLES[queue_base]
    users = [role_user(role_users, role) for role in roles]
    if user_id is not None and any(
        user_id == user or user_id.startswith(user + ".") for user in users
    ):
        return None
    who = "an unauthenticated publisher" if not user_id else f"user {user_id!r}"
    named = " or ".join(f"user {user!r} or {user!r}.<name>" for user in users)
    return (
        f"{who} may not publish to {queue_base}: only the {' or '.join(roles)} role ({named}) may"
    )


def role_user(role_users: Mapping[str, str], role: str) -> str:
    """The broker user of ``role``; the client role's defaults to ``hpcrl-client``."""
    return role_users.get(role) or f"hpcrl-{role}"


def password_hash(password: str, salt: bytes | None = None) -> str:
    """RabbitMQ's ``rabbit_password_hashing_sha256``: base64(salt + sha256(salt + pw))."""
    salt = os.urandom(4) if salt is None else salt
    digest = hashlib.sha256(salt + password.encode()).digest()
    return base64.b64encode(salt + digest).decode()


def definitions(
    topology: Topology, vhost: str, users: Mapping[str, tuple[AnyRole, str]]
) -> dict[str, Any]:
    """A RabbitMQ definitions document: the vhost, one user per entry, the topology.

    ``users`` maps user name to (role, password). Import it with
    ``rabbitmqctl import_definitions`` (or the management UI); the services then need no
    configure rights on shared resources.
    """
    return {
        "vhosts": [{"name": vhost}],
        "users": [
            {
                "name": name,
                "password_hash": password_hash(password),
                "hashing_algorithm": "rabbit_password_hashing_sha256",
                "tags": [],
            }
            for name, (_role, password) in sorted(users.items())
        ],
        "permissions": [
            {"user": name, "vhost": vhost, **role_permissions(topology, role, name).__dict__}
            for name, (role, _password) in sorted(users.items())
        ],
        **topology_definitions(
            topology,
            vhost,
            clients=sorted(
                name for name, (role, _password) in users.items() if role == CLIENT_ROLE
            ),
        ),
    }


def topology_definitions(
    topology: Topology,
    vhost: str,
    clients: Sequence[str] = (),
) -> dict[str, list[dict[str, Any]]]:
    """What :meth:`Topology.declare` makes, as definitions (queues, exchanges, bindings),
    and the verdict queue of each client user in ``clients``."""
    exchanges, queues, bindings = [], [], []

    def exchange(name: str, kind: str) -> None:
        exchanges.append(
            {
                "name": name,
                "vhost": vhost,
                "type": kind,
                "durable": True,
                "auto_delete": False,
                "internal": False,
                "arguments": {},
            }
        )

    def queue(name: str, arguments: dict[str, Any]) -> None:
        queues.append(
            {
                "name": name,
                "vhost": vhost,
                "durable": True,
                "auto_delete": False,
                "arguments": arguments,
            }
        )

    def bind(source: str, destination: str, key: str) -> None:
        bindings.append(
            {
                "source": source,
                "vhost": vhost,
                "destination": destination,
                "destination_type": "queue",
                "routing_key": key,
                "arguments": {},
            }
        )

    def durable(spec: DurableQueue) -> None:
        queue(spec.name, spec.arguments)
        for source, key in spec.bindings:
            bind(source, spec.name, key)

    exchange(topology.dead_letter_exchange, "direct")
    for dead_letters in topology.dead_letter_queues():
        durable(dead_letters)
    for base in [*WORK_QUEUES, *FANOUT_EXCHANGES]:
        exchange(topology.dead_letter_inbox(base), "direct")
        bind(topology.dead_letter_inbox(base), topology.dlq(base), topology.name(base))
    for base in WORK_QUEUES:
        queue(topology.name(base), topology.work_queue_arguments(base))
        exchange(topology.work_exchange(base), "direct")
        bind(topology.work_exchange(base), topology.name(base), topology.name(base))
    for base in FANOUT_EXCHANGES:
        exchange(topology.name(base), "fanout")
    # The scheduler's update queue is known in advance; generator replicas make their own.
    durable(topology.durable_subscriber_queue(WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER))
    exchange(topology.reward_verdicts_exchange, "direct")
    for client in clients:
        durable(topology.reply_queue_spec(client))
    return {"exchanges": exchanges, "queues": queues, "bindings": bindings}
