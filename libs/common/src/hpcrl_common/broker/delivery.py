"""What a handler sees and answers: a :class:`Delivery`, and a list of :class:`Publish`,
:data:`DEFER`, or :class:`Reject` / :class:`Ignore` raised."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpcrl_common.broker.publishing import Publish
from hpcrl_common.messages import Message


class Reject(Exception):
    """Raised by a handler for a message that can never succeed: dead-letter it now.

    Its id is not remembered as handled: a later message with the same id (the genuine one
    after a forgery) is handled."""


class Ignore(Exception):
    """Raised by a handler for a message that is not for it (another experiment's): acked,
    counted ``ignored``, and its id not remembered as handled, so that a message of the
    same id meant for this consumer is still handled. Dedup is of messages handled, not of
    ids seen."""


class _Deferred:
    def __repr__(self) -> str:
        return "DEFER"


DEFER = _Deferred()
"""Returned by a handler that will settle the delivery later with :meth:`Consumer.settle`."""


@dataclass
class Delivery:
    """A received message as the consumer tracks it until it is settled."""

    queue: str
    tag: int
    generation: int
    attempt: int
    body: bytes
    headers: dict[str, Any]
    message_id: str = ""
    user_id: str | None = None  # verified by RabbitMQ: the publisher's broker user
    key: tuple[str, str] = ("", "")  # (queue, message id): what idempotency is keyed on
    extra_tags: list[int] = field(default_factory=list)
    received_at: float = field(default_factory=time.monotonic)


Handler = Callable[[Message, Delivery], "Sequence[Publish] | _Deferred"]


def delivery_count(headers: dict[str, Any]) -> int:
    """The broker's ``x-delivery-count``; 0 when absent or not a sane count.

    Anyone who can publish can set headers, so the value may be a string, a list or a huge
    number: such a value counts as 0 and never raises.
    """
    count = headers.get("x-delivery-count", 0)
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count < 1_000_000:
        return 0
    return count


def _as_text(headers: dict[str, Any]) -> dict[str, str]:
    return {str(key): repr(value)[:1000] for key, value in headers.items() if str(key)}
