"""Requests waiting for the engine, so that one engine call samples several groups together.

Each handler thread brings one generate request and waits. Whichever thread holds the engine
takes its own request and every other waiting one whose policy-version floor the loaded
version meets (oldest first, up to a limit) and samples them in one call: the engine decodes
all their sequences together, and every group still comes from one policy version.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from hpcrl_common.messages import GenerateRequest
from hpcrl_generator.sampling import Sample


@dataclass(frozen=True)
class Sampled:
    """What one request got: its prompt's tokens, its samples, the version and engine time."""

    prompt_ids: list[int]
    samples: list[Sample]
    version: int
    seconds: float
    groups_in_call: int


@dataclass(eq=False)
class Waiting:
    request: GenerateRequest
    _done: threading.Event = field(default_factory=threading.Event)
    _result: Sampled | None = None
    _error: BaseException | None = None

    @property
    def floor(self) -> int:
        return self.request.min_policy_version

    def done(self) -> bool:
        return self._done.is_set()

    def finish(self, result: Sampled) -> None:
        self._result = result
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def result(self) -> Sampled:
        """The request's samples, or the exception its sampling raised (raised here, in the
        request's own handler thread, so the consumer settles that request alone)."""
        if not self._done.is_set():
            raise RuntimeError("a request left the engine unsampled")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class WaitingRequests:
    """A thread-safe FIFO of requests waiting for the engine."""

    def __init__(self, clock=time.monotonic) -> None:
        self._changed = threading.Condition()
        self._waiting: list[Waiting] = []
        self._clock = clock

    def add(self, request: GenerateRequest) -> Waiting:
        waiting = Waiting(request)
        with self._changed:
            self._waiting.append(waiting)
            self._changed.notify_all()
        return waiting

    def __len__(self) -> int:
        with self._changed:
            return len(self._waiting)

    def gather(self, limit: int, window_s: float) -> None:
        """Wait up to ``window_s`` for ``limit`` requests to be waiting: the scheduler
        publishes an iteration's requests together, and they reach the handler threads a
        few milliseconds apart."""
        deadline = self._clock() + window_s
        with self._changed:
            while len(self._waiting) < limit:
                left = deadline - self._clock()
                if left <= 0:
                    return
                self._changed.wait(left)

    def take(self, first: Waiting, loaded: int, limit: int) -> list[Waiting]:
        """``first`` and, oldest first, the other requests that ``loaded`` may serve, at most
        ``limit`` in all; they leave the queue."""
        with self._changed:
            others = [w for w in self._waiting if w is not first and w.floor <= loaded]
            batch = [first, *others[: max(0, limit - 1)]]
            taken = set(map(id, batch))
            self._waiting = [w for w in self._waiting if id(w) not in taken]
        return batch

    def drop(self, waiting: Waiting) -> None:
        with self._changed:
            self._waiting = [w for w in self._waiting if w is not waiting]
