"""The queue of requests waiting for the engine (pure, no engine)."""

from __future__ import annotations

import threading
import time

from hpcrl_generator.batching import WaitingRequests

from .helpers import request


def test_a_call_takes_its_own_request_then_the_oldest_the_version_may_serve():
    queue = WaitingRequests()
    old, high, mine, young, youngest = (
        queue.add(request(rid, floor=floor))
        for rid, floor in (("old", 0), ("high", 5), ("mine", 2), ("young", 1), ("youngest", 0))
    )
    batch = queue.take(mine, loaded=2, limit=3)
    assert batch == [mine, old, young]
    assert len(queue) == 2
    assert queue.take(youngest, loaded=2, limit=3) == [youngest]  # "high" waits for v5
    assert len(queue) == 1 and not high.done()


def test_gather_returns_as_soon_as_enough_requests_wait():
    queue = WaitingRequests()
    queue.add(request("a"))
    threading.Timer(0.05, lambda: queue.add(request("b"))).start()
    began = time.monotonic()
    queue.gather(2, window_s=5.0)
    assert time.monotonic() - began < 2.0 and len(queue) == 2
    began = time.monotonic()
    queue.gather(3, window_s=0.2)  # nobody else comes: the window bounds the wait
    assert 0.15 <= time.monotonic() - began < 2.0
