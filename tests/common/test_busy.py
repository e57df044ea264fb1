"""Busy time (hpcrl_service_busy_seconds_total): wall time with at least one item in progress,
overlapping items counted once, waits inside an item left out; over real threads."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from prometheus_client import REGISTRY

from hpcrl_common.broker import Consumer, Publish, Publisher
from hpcrl_common.metrics import BUSY_SECONDS_NAME, FIRST_BUSY_NAME, BusyTime
from hpcrl_common.topology import GENERATE_REQUESTS, Topology

from ..conftest import RunningConsumer
from ..support.waiting import wait_for
from .strategies import sample_request


class FakeClock:
    """A clock the test moves by hand, read by the tracker from several threads."""

    def __init__(self) -> None:
        self.now = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class Item:
    """One item on its own thread, moved through working() (and idle()) step by step."""

    def __init__(self, busy: BusyTime) -> None:
        self.busy = busy
        self._commands: list[str] = []
        self._go = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._go.acquire()
        with self.busy.working():
            self._done.release()
            self._go.acquire()
            if self._commands and self._commands[0] == "idle":
                self._commands.pop(0)
                with self.busy.idle():
                    self._done.release()
                    self._go.acquire()
                self._done.release()
                self._go.acquire()
        self._done.release()

    def step(self, command: str = "") -> None:
        """Advance the item's thread one step and wait until it got there."""
        if command:
            self._commands.append(command)
        self._go.release()
        assert self._done.acquire(timeout=5), "the item's thread did not move"

    def join(self) -> None:
        self._thread.join(5)
        assert not self._thread.is_alive()


def test_overlapping_items_on_threads_count_once():
    clock = FakeClock()
    busy = BusyTime(clock=clock)
    first, second = Item(busy), Item(busy)
    first.step()  # t=0: first starts
    clock.advance(5)
    second.step()  # t=5: second starts while first runs
    clock.advance(5)
    first.step()  # t=10: first ends; second still runs
    clock.advance(5)
    second.step()  # t=15: second ends
    assert busy.seconds() == 15.0  # 0..15, not 10 + 10
    clock.advance(10)  # nothing runs: not counted
    third = Item(busy)
    third.step()
    clock.advance(2)
    assert busy.seconds() == 17.0  # an open item counts up to now
    third.step()
    for item in (first, second, third):
        item.join()
    assert busy.seconds() == 17.0


def test_a_wait_inside_an_item_counts_only_while_another_item_works():
    clock = FakeClock()
    busy = BusyTime(clock=clock)
    waiter, worker = Item(busy), Item(busy)
    waiter.step()  # t=0: starts
    clock.advance(1)
    waiter.step("idle")  # t=1: waits (e.g. for the engine): alone, so nothing counts
    clock.advance(4)
    assert busy.seconds() == 1.0
    worker.step()  # t=5: another item works while the first still waits
    clock.advance(3)
    assert busy.seconds() == 4.0
    waiter.step()  # t=8: the wait ends, the first item works again
    clock.advance(1)
    worker.step()  # t=9
    clock.advance(1)
    waiter.step()  # t=10: the first item ends
    waiter.join()
    worker.join()
    assert busy.seconds() == 6.0  # 0..1 and 5..10


def test_idle_outside_an_item_takes_nothing_from_another_thread():
    clock = FakeClock()
    busy = BusyTime(clock=clock)
    worker = Item(busy)
    worker.step()
    with busy.idle():  # this thread has no item: it must not stop the worker's time
        clock.advance(3)
    assert busy.seconds() == 3.0
    worker.step()
    worker.join()
    with busy.idle():
        clock.advance(1)
    assert busy.seconds() == 3.0


def test_real_threads_overlapping_in_real_time():
    busy = BusyTime()
    start = threading.Barrier(4)

    def item() -> None:
        start.wait()
        with busy.working():
            time.sleep(0.3)

    threads = [threading.Thread(target=item) for _ in range(4)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - began
    # Four overlapping 0.3 s items: about 0.3 s busy (the sum would be 1.2 s).
    assert 0.3 <= busy.seconds() <= min(wall, 0.6)


def test_the_counter_accrues_during_an_item_and_the_first_start_is_a_wall_time():
    client = f"busy-{uuid.uuid4().hex[:8]}"
    clock = FakeClock()
    busy = BusyTime(client, clock=clock, wall_clock=lambda: 1_700_000_000.0)

    def value() -> float | None:
        return REGISTRY.get_sample_value(f"{BUSY_SECONDS_NAME}_total", {"client": client})

    assert value() == 0.0
    assert REGISTRY.get_sample_value(FIRST_BUSY_NAME, {"client": client}) is None  # not 1970
    worker = Item(busy)
    worker.step()
    clock.advance(7)
    assert value() == 0.0  # not yet flushed: the counter moves on a flush or at the end
    busy.flush()  # what /metrics does before each scrape
    assert value() == 7.0
    clock.advance(2)
    worker.step()
    worker.join()
    assert value() == 9.0 == busy.seconds()
    assert REGISTRY.get_sample_value(FIRST_BUSY_NAME, {"client": client}) == 1_700_000_000.0


@pytest.mark.broker
def test_a_consumer_counts_its_overlapping_handlers_and_ticks_once(broker_settings):
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    both_in = threading.Barrier(2, timeout=10)
    handled: list[str] = []

    def handler(message, _delivery) -> list[Publish]:
        both_in.wait()  # the two handlers run at the same time
        time.sleep(0.5)
        handled.append(message.id)
        return []

    client = f"busy-consumer-{uuid.uuid4().hex[:6]}"
    consumer = Consumer(broker_settings, client, concurrency=2)
    consumer.subscribe(GENERATE_REQUESTS, handler)
    with RunningConsumer(consumer), Publisher(broker_settings, "busy-pub") as publisher:
        assert consumer.busy.seconds() == 0.0
        publisher.publish(
            *(Publish(topology.name(GENERATE_REQUESTS), sample_request(f"b{i}")) for i in range(2))
        )
        wait_for(lambda: len(handled) == 2)
    handlers = consumer.busy.seconds()
    assert 0.5 <= handlers < 0.9  # two 0.5 s handlers at once: about 0.5 s, not 1.0 s
    assert REGISTRY.get_sample_value(
        f"{BUSY_SECONDS_NAME}_total", {"client": client}
    ) == pytest.approx(handlers)

    ticks: list[float] = []

    def tick() -> list[Publish]:
        time.sleep(0.2)
        ticks.append(time.monotonic())
        return []

    timed = Consumer(broker_settings, f"{client}-tick")
    timed.every(0.05, tick)
    with RunningConsumer(timed):
        wait_for(lambda: len(ticks) >= 3)
    assert timed.busy.seconds() >= 0.6  # periodic tasks are work too
