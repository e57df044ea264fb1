"""The queue topology, declared in one place.

Work queues are durable quorum queues with a delivery limit: a message that has been
delivered and returned more than ``delivery_limit`` times is dead-lettered by the broker
itself (the backstop for a message that crashes its consumer). Each work queue has its own
dead-letter queue ``<queue>.dlq`` bound to the dead-letter exchange with the queue's name as
routing key; consumers also dead-letter explicitly, with the reason in a header.
``weight-updates`` is a fanout exchange: every subscriber gets its own queue.

Two paths lead into a dead-letter queue, and no broker user may write into either at will:
the broker's own dead-lettering (a work queue's ``x-dead-letter-exchange``: the shared
``dead-letter`` exchange, which no role may publish to) and a consumer's explicit dead
letter, published to the dead-letter queue's own inbox ``<queue>.dlq.in``, which only the
role that consumes ``<queue>`` may write (see :mod:`hpcrl_common.access`). So a role can put
messages only into the dead-letter queues of what it consumes.

Every durable queue is a quorum queue, replicated on each node of a clustered broker, so that
losing a node loses none of them: a classic queue lives on the node that declared it and can
be neither used nor redeclared while that node is down. Only the auto-deleted queues of
ephemeral subscribers (generator replicas) are classic, as quorum queues cannot be.
Brokers set up by releases before this one have classic dead-letter queues and a classic
scheduler update queue; :meth:`Topology.declare` can keep them (``classic``) until
``hpcrl-broker-admin migrate`` has made them quorum queues.

Messages for a work queue are published to its own direct exchange ``<queue>.in``, never to
the default exchange: a broker user's write right can then be limited to the queues of its
role (see :mod:`hpcrl_common.access`). The topology is declared by each service at start
(``broker.declare_topology``) or once by an admin (``hpcrl-broker-admin``), after which the
services only :meth:`Topology.check` that it exists.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from hpcrl_common.messages import (
    BenchResult,
    Candidate,
    CandidateCommitment,
    GenerateRequest,
    Message,
    RewardRequest,
    RolloutBatch,
    WeightUpdate,
)

GENERATE_REQUESTS = "generate-requests"
CODE_TO_BENCH = "code-to-bench"
BENCH_RESULTS = "bench-results"
ROLLOUT_BATCHES = "rollout-batches"
# Generator → scheduler: what the generator sent for each candidate (a hash of its rollout),
# so that no other role's message can have tokens trained that the generator did not send.
CANDIDATE_COMMITMENTS = "candidate-commitments"
WEIGHT_UPDATES = "weight-updates"
DEAD_LETTER_EXCHANGE = "dead-letter"
# Outside trainers' reward path (hpcrl-reward-client), apart from the scheduler's: requests
# into a work queue the benchmarkers also consume; each verdict goes through the direct
# exchange ``reward-verdicts.in`` to the requesting client's own queue
# ``reward-verdicts.<client>`` (routing key: that queue's name).
REWARD_REQUESTS = "reward-requests"
REWARD_VERDICTS = "reward-verdicts"

WORK_QUEUES: dict[str, type[Message]] = {
    GENERATE_REQUESTS: GenerateRequest,
    CODE_TO_BENCH: Candidate,
    BENCH_RESULTS: BenchResult,
    ROLLOUT_BATCHES: RolloutBatch,
    REWARD_REQUESTS: RewardRequest,
    CANDIDATE_COMMITMENTS: CandidateCommitment,
}
FANOUT_EXCHANGES: dict[str, type[Message]] = {WEIGHT_UPDATES: WeightUpdate}

INBOX_SUFFIX = ".in"

REASON_HEADER = "x-hpcrl-reason"
SOURCE_QUEUE_HEADER = "x-hpcrl-source-queue"
CONSUMER_HEADER = "x-hpcrl-consumer"
# The broker user that published a message a consumer dead-lettered (the dead letter's own
# user_id property is the consumer's user).
PUBLISHER_HEADER = "x-hpcrl-publisher"
# The publisher's user_id of a message moved by `hpcrl-broker-admin migrate`: RabbitMQ refuses
# a user_id other than the connection's own, so the property cannot travel as it is.
ORIGINAL_USER_HEADER = "x-hpcrl-user-id"

QUORUM = "quorum"


@dataclass(frozen=True)
class DurableQueue:
    """A replicated (quorum) queue and the ``(exchange, routing key)`` bindings that feed it."""

    name: str
    arguments: dict[str, Any] = field(default_factory=lambda: {"x-queue-type": QUORUM})
    bindings: tuple[tuple[str, str], ...] = ()

    def declare(self, channel: BlockingChannel, *, classic: bool = False) -> None:
        """Declare and bind it; ``classic``: it exists as a classic queue made by an older
        release, which redeclaring as a quorum queue would refuse (406), so only check it."""
        if classic:
            channel.queue_declare(self.name, passive=True)
        else:
            channel.queue_declare(self.name, durable=True, arguments=self.arguments)
        for exchange, routing_key in self.bindings:
            channel.queue_bind(self.name, exchange, routing_key=routing_key)

    def unbind(self, channel: BlockingChannel) -> None:
        for exchange, routing_key in self.bindings:
            channel.queue_unbind(self.name, exchange, routing_key=routing_key)


def is_queue_type_conflict(exc: pika.exceptions.ChannelClosedByBroker) -> bool:
    """Whether the broker refused a declare because the queue exists with another type
    (a classic queue of an older release declared again as a quorum queue)."""
    return exc.reply_code == 406 and "'x-queue-type'" in str(exc.reply_text)


def classic_queues(
    open_channel: Callable[[], BlockingChannel], queues: Sequence[DurableQueue]
) -> list[str]:
    """Which of ``queues`` exist as classic queues (made by an older release).

    Each is declared as it should be on a channel of its own (a refused declare closes its
    channel): one that was missing is made, a classic one is refused with 406.
    """
    found = []
    for queue in queues:
        channel = open_channel()
        try:
            channel.queue_declare(queue.name, durable=True, arguments=queue.arguments)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if not is_queue_type_conflict(exc):
                raise
            found.append(queue.name)
            continue
        channel.close()
    return found


@dataclass(frozen=True)
class Topology:
    """Names and declarations. ``namespace`` isolates experiments (and tests) on one vhost."""

    namespace: str = ""
    delivery_limit: int = 5

    def name(self, base: str) -> str:
        return f"{self.namespace}.{base}" if self.namespace else base

    def dlq(self, base: str) -> str:
        return self.name(f"{base}.dlq")

    @property
    def dead_letter_exchange(self) -> str:
        return self.name(DEAD_LETTER_EXCHANGE)

    def dead_letter_inbox(self, base: str) -> str:
        """The exchange consumers of ``base`` publish their explicit dead letters to."""
        return inbox_of(self.dlq(base))

    def work_exchange(self, base: str) -> str:
        """The exchange that publishers of work queue ``base`` write to."""
        return inbox_of(self.name(base))

    def subscriber_queue(self, exchange_base: str, subscriber: str) -> str:
        return self.name(f"{exchange_base}.{subscriber}")

    @property
    def reward_verdicts_exchange(self) -> str:
        """The direct exchange benchmarkers publish a client's verdicts to."""
        return inbox_of(self.name(REWARD_VERDICTS))

    def reply_queue(self, client: str) -> str:
        """A client's own verdict queue (also the routing key of its verdicts)."""
        return self.name(f"{REWARD_VERDICTS}.{client}")

    def reply_queue_spec(self, client: str) -> DurableQueue:
        """Made by the admin with the client's broker user (``access.definitions``), or by
        the client itself where it may configure (``broker.declare_topology``)."""
        queue = self.reply_queue(client)
        return DurableQueue(queue, bindings=((self.reward_verdicts_exchange, queue),))

    def expected_schema(self, queue: str) -> type[Message]:
        if queue.startswith(self.name(REWARD_VERDICTS) + "."):
            return BenchResult
        for base, cls in {**WORK_QUEUES, **FANOUT_EXCHANGES}.items():
            if queue == self.name(base) or queue.startswith(self.name(base) + "."):
                return cls
        raise KeyError(f"no schema is registered for queue {queue!r}")

    def declare(self, channel: BlockingChannel, *, classic: Collection[str] = ()) -> None:
        """Idempotently declare every exchange and queue the services use.

        The queues named in ``classic`` (see :func:`classic_queues`) are kept as they are.
        """
        channel.exchange_declare(self.dead_letter_exchange, exchange_type="direct", durable=True)
        for base in WORK_QUEUES:
            self._declare_work_queue(channel, base, classic)
        for base in FANOUT_EXCHANGES:
            channel.exchange_declare(self.name(base), exchange_type="fanout", durable=True)
            self._declare_dlq(channel, base, classic)
        for base in [*WORK_QUEUES, *FANOUT_EXCHANGES]:
            inbox = self.dead_letter_inbox(base)
            channel.exchange_declare(inbox, exchange_type="direct", durable=True)
            channel.queue_bind(self.dlq(base), inbox, routing_key=self.name(base))
        channel.exchange_declare(
            self.reward_verdicts_exchange, exchange_type="direct", durable=True
        )

    def dead_letter_queue(self, base: str) -> DurableQueue:
        return DurableQueue(
            self.dlq(base), bindings=((self.dead_letter_exchange, self.name(base)),)
        )

    def dead_letter_queues(self) -> list[DurableQueue]:
        return [self.dead_letter_queue(base) for base in [*WORK_QUEUES, *FANOUT_EXCHANGES]]

    def durable_subscriber_queue(self, exchange_base: str, subscriber: str) -> DurableQueue:
        """The queue of a subscriber that must get every message even across its restarts."""
        return DurableQueue(
            self.subscriber_queue(exchange_base, subscriber),
            {"x-queue-type": QUORUM, **self.dead_letter_arguments(exchange_base)},
            # The queue's name as routing key, as pika's queue_bind has always bound it
            # (a fanout exchange ignores it; migrate unbinds it).
            ((self.name(exchange_base), self.subscriber_queue(exchange_base, subscriber)),),
        )

    def missing(self, open_channel: Callable[[], BlockingChannel]) -> list[str]:
        """What ``declare`` makes and the broker lacks, by passive declares (no rights needed).

        A failed passive declare closes its channel, so each check gets a fresh one.
        """
        absent = []
        checks: list[tuple[str, Callable[[BlockingChannel], object]]] = [
            (
                f"exchange {self.dead_letter_exchange}",
                lambda ch: ch.exchange_declare(self.dead_letter_exchange, passive=True),
            )
        ]
        for base in WORK_QUEUES:
            queue, inbox = self.name(base), self.work_exchange(base)
            checks.append((f"queue {queue}", lambda ch, q=queue: ch.queue_declare(q, passive=True)))
            checks.append(
                (f"exchange {inbox}", lambda ch, e=inbox: ch.exchange_declare(e, passive=True))
            )
        for base in FANOUT_EXCHANGES:
            exchange = self.name(base)
            checks.append(
                (
                    f"exchange {exchange}",
                    lambda ch, e=exchange: ch.exchange_declare(e, passive=True),
                )
            )
        for base in [*WORK_QUEUES, *FANOUT_EXCHANGES]:
            inbox = self.dead_letter_inbox(base)
            checks.append(
                (f"exchange {inbox}", lambda ch, e=inbox: ch.exchange_declare(e, passive=True))
            )
        verdicts = self.reward_verdicts_exchange
        checks.append(
            (f"exchange {verdicts}", lambda ch: ch.exchange_declare(verdicts, passive=True))
        )
        channel = open_channel()
        for what, check in checks:
            try:
                check(channel)
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code != 404:
                    raise
                absent.append(what)
                channel = open_channel()
        if channel.is_open:
            channel.close()
        return absent

    def declare_subscriber(
        self,
        channel: BlockingChannel,
        exchange_base: str,
        subscriber: str,
        *,
        durable: bool,
        classic: Collection[str] = (),
    ) -> str:
        """A queue of one subscriber to a fanout exchange.

        Durable subscribers (the scheduler) get every update even across their restarts, in
        a quorum queue (kept as it is when named in ``classic``); ephemeral ones (generator
        replicas) get an exclusive auto-deleted classic queue (no other connection, another
        replica's included, may delete, purge or read it) and read the checkpoint manifest
        on start instead. Their dead letters go through the dead-letter queue's inbox, which
        the generator role may write, not the shared dead-letter exchange.
        """
        if durable:
            queue = self.durable_subscriber_queue(exchange_base, subscriber)
            queue.declare(channel, classic=queue.name in classic)
            return queue.name
        name = self.subscriber_queue(exchange_base, subscriber)
        channel.queue_declare(
            name,
            durable=False,
            auto_delete=True,
            exclusive=True,
            arguments={
                "x-dead-letter-exchange": self.dead_letter_inbox(exchange_base),
                "x-dead-letter-routing-key": self.name(exchange_base),
            },
        )
        channel.queue_bind(name, self.name(exchange_base))
        return name

    def _declare_work_queue(
        self, channel: BlockingChannel, base: str, classic: Collection[str]
    ) -> None:
        self._declare_dlq(channel, base, classic)
        channel.queue_declare(
            self.name(base), durable=True, arguments=self.work_queue_arguments(base)
        )
        channel.exchange_declare(self.work_exchange(base), exchange_type="direct", durable=True)
        channel.queue_bind(self.name(base), self.work_exchange(base), routing_key=self.name(base))

    def work_queue_arguments(self, base: str) -> dict[str, Any]:
        return {
            "x-queue-type": "quorum",
            "x-delivery-limit": self.delivery_limit,
            **self.dead_letter_arguments(base),
        }

    def _declare_dlq(self, channel: BlockingChannel, base: str, classic: Collection[str]) -> None:
        queue = self.dead_letter_queue(base)
        queue.declare(channel, classic=queue.name in classic)

    def dead_letter_arguments(self, base: str) -> dict[str, str]:
        return {
            "x-dead-letter-exchange": self.dead_letter_exchange,
            "x-dead-letter-routing-key": self.name(base),
        }

    def delete(self, channel: BlockingChannel) -> None:
        """Remove everything ``declare`` made (used by tests and `make clean-broker`)."""
        for base in [*WORK_QUEUES, *FANOUT_EXCHANGES]:
            if base in WORK_QUEUES:
                channel.queue_delete(self.name(base))
                channel.exchange_delete(self.work_exchange(base))
            else:
                channel.exchange_delete(self.name(base))
            channel.queue_delete(self.dlq(base))
            channel.exchange_delete(self.dead_letter_inbox(base))
        channel.exchange_delete(self.reward_verdicts_exchange)
        channel.exchange_delete(self.dead_letter_exchange)


def inbox_of(queue: str) -> str:
    """The exchange name of a full work-queue name (what :class:`Publish` routes through)."""
    return queue + INBOX_SUFFIX
