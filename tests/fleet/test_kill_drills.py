"""Issue #18: kill drills with counts, benchmarker replicas coming and going mid-run, and the
whole broker restarted mid-run.

The four real services run as separate processes (``hpcrl-<service> serve``, the commands an
operator runs) on one fresh broker namespace, with one experiment TOML: a tiny random Qwen2
(``tests.support.models.chat_model``) is version 0 of both the generator (transformers backend)
and the learner, the scheduler keeps its SQLite store and the learner its checkpoint store in
the test's tmp directory, and each service serves /metrics and /healthz on a port of its own.

The tiny policy writes noise, so every candidate is a ``format_violation`` with no source: no
child can be repaired, deepened or improved, and each SQD iteration is exactly one group (the
seed's). With ``groups_per_step = 2`` and ``max_staleness = 1`` the services work in lockstep
(the next request waits until the learner has caught up), so a service that is down stalls
the run, and the run cannot finish without every restarted service doing its part.

``test_kill_minus_nine_of_each_service_in_turn``: the scheduler, the generator, the benchmarker
and the learner are each killed with SIGKILL (the whole process group, as a node or container
loss would) at a moment when the broker shows that the victim holds unacknowledged work. To
make that moment certain, the victim is frozen (SIGSTOP) first, so the broker delivers its
next messages to a process that can no longer ack them; just before the kill, a passive
declare shows nothing of its queue ready and ``rabbitmqctl list_channels`` shows the victim's
channel holding them (``list_queues`` counts are refreshed only every few seconds, too late
to decide on). The scheduler holds all G results of a group, the generator a request, the
benchmarker the G candidates of a group, the learner a deferred batch (half a step,
uncommitted, after a committed version). Each is restarted at once. Then duplicates are
delivered for certain: copies of the first group's request, of one of its results and of its
rollout batch (trained on before the learner's kill) are published again; the restarted
generator samples the request again and the benchmarker judges the copies, and the
scheduler's and the learner's /metrics must show every copy ignored. The experiment must
complete. Then, from the scheduler's SQLite store (read-only: the store's named operations,
and three reads of the outbox and results tables, which have no named operation for them),
the learner's checkpoint store (manifest and committed learner state) and the broker, never
from logs:

* every group planned is closed exactly once (complete, with its G results): none pending or
  in flight, one generation request and one rollout batch in the outbox per group;
* every candidate has exactly one stored result with one recorded reward, none late, and
  appears in exactly one rollout batch, with that reward;
* the learner trained every batch exactly once (its committed ``trained_ids``), dropped none,
  its versions are 1..V with no gap and no restart, and after the kill it came back at the
  version it had committed (its /healthz) and its next version's parent is that version;
* every work queue and every dead-letter queue is empty once the services are stopped (so
  nothing was dead-lettered), and so is every other queue of the namespace except the
  scheduler's durable weight-updates queue, which may hold only announcements newer than the
  last version the scheduler recorded (the learner's last step ends after the scheduler has
  finished, and a finished scheduler stops consuming).

``test_benchmarker_replica_added_and_another_removed_mid_run``: the run starts with replica A;
replica B is added after the first group; once B has judged something, A is frozen between two
groups until it holds its share of the next group's candidates (B judges the rest), then gets
SIGTERM (graceful; SIGCONT lets it act on it). The run completes with the same counts, A exits
0 within its stop grace, both replicas judged candidates (the ``benchmarker`` field of the
stored results, and each replica's ``hpcrl_benchmarker_results_total`` on its /metrics), and
the groups requested after A exited were judged by B alone.

``test_whole_broker_restarted_mid_run``: the same fleet on a RabbitMQ node of its own
(``tests.support.rabbit_node``), stopped with ``rabbitmqctl stop`` once the learner has
committed a version and a service holds unacknowledged work (its channel, as above), and
started again 5 s after every service's /healthz says it is disconnected. Every service stays
up, reconnects (``connected`` again, ``hpcrl_broker_reconnects_total`` at least 1), and the
run completes with the same counts: the quorum queues kept what was queued, and what was
held went back to its queue when the broker closed the connections.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hpcrl_common.broker import Publish, Publisher
from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import (
    GenerateRequest,
    RolloutBatch,
    decode,
)
from hpcrl_common.topology import (
    BENCH_RESULTS,
    CODE_TO_BENCH,
    GENERATE_REQUESTS,
    ROLLOUT_BATCHES,
    WORK_QUEUES,
)
from tests.support.fleet import (
    GROUP_SIZE,
    GROUPS_PER_STEP,
    HEARTBEAT_S,
    SERVICES,
    Fleet,
    Kill,
    Proc,
    assert_nothing_lost_nothing_twice,
    connected,
    start_and_wait_mid_run,
    stop_all,
    wait_done,
    wait_for,
)
from tests.support.rabbit_node import RabbitNode, free_port

pytestmark = [pytest.mark.broker, pytest.mark.slow]


@pytest.fixture
def fleet_factory(broker_settings: BrokerSettings, tmp_path: Path) -> Iterator[Callable]:
    fleets: list[Fleet] = []
    settings = broker_settings.model_copy(update={"delivery_limit": 5})

    def make(iterations: int) -> Fleet:
        fleet = Fleet(tmp_path, settings, iterations=iterations)
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        fleet.close()


# --- drill 1: kill -9 of each service in turn --------------------------------------------------


def latest_group(fleet: Fleet):
    groups = fleet.groups()
    return groups[-1] if groups else None


def wait_closed(fleet: Fleet, group_id: str, timeout: float = 120.0) -> None:
    def closed() -> bool:
        fleet.check_alive()
        group = fleet.store.group(group_id)
        return group is not None and group.state == "closed"

    wait_for(closed, timeout, f"group {group_id} to close", fleet.tails)


def next_group(fleet: Fleet, after: str, timeout: float = 120.0):
    """The group published after group ``after`` (ids sort in planning order)."""

    def published():
        fleet.check_alive()
        return next((g for g in fleet.groups() if g.id > after and g.state != "pending"), None)

    return wait_for(published, timeout, f"a group after {after}", fleet.tails)


def kill_holding(
    fleet: Fleet,
    victim: Proc,
    queue: str,
    holds: Callable[[int], bool],
    kills: list[Kill],
    what: str,
    extra: Callable[[], dict[str, Any]] = dict,
    timeout: float = 120.0,
) -> None:
    """``victim`` is frozen, and the only consumer of ``queue``: wait until nothing of the
    queue is ready and the broker shows the victim holding unacked what ``holds`` asks for,
    then SIGKILL it."""
    assert victim.frozen

    def held() -> tuple[int, int] | None:
        ready, unacked = fleet.ready(queue), fleet.held_by(victim)
        return (ready, unacked) if ready == 0 and holds(unacked) else None

    ready, unacked = wait_for(
        held,
        timeout,
        f"the frozen {victim.label} to hold {what}",
        lambda: (fleet.ready(queue), fleet.held_by(victim), fleet.tails()),
        every=0.3,
    )
    kills.append(
        Kill(victim.service, queue, ready, unacked, fleet.iteration(), fleet.done(), extra())
    )
    fleet.kill9(victim)


def inject_duplicates(fleet: Fleet, group_id: str) -> list[str]:
    """Publish again, as a redelivery would bring them, the request, the first result and
    the rollout batch of a closed group; what was sent."""
    request = decode(
        next(
            b
            for b in fleet.outbox_bodies(GENERATE_REQUESTS)
            if decode(b, GenerateRequest).id == group_id
        ),
        GenerateRequest,
    )
    result = fleet.store.results_of(group_id)[0]
    batch = decode(
        next(
            b
            for b in fleet.outbox_bodies(ROLLOUT_BATCHES)
            if decode(b, RolloutBatch).id == group_id
        ),
        RolloutBatch,
    )
    assert batch.id in fleet.learner_state(fleet.learner_version())["trained_ids"]
    with Publisher(fleet.settings) as publisher:
        publisher.publish(
            Publish(fleet.topology.name(GENERATE_REQUESTS), request),
            Publish(fleet.topology.name(BENCH_RESULTS), result),
            Publish(fleet.topology.name(ROLLOUT_BATCHES), batch),
        )
    return [
        f"{GENERATE_REQUESTS} {request.id}",
        f"{BENCH_RESULTS} {result.id}",
        f"{ROLLOUT_BATCHES} {batch.id}",
    ]


def start_fleet(fleet: Fleet) -> dict[str, Proc]:
    """The four services started, each healthy."""
    procs = {service: fleet.start(service) for service in SERVICES}
    for proc in procs.values():
        fleet.wait_healthy(proc)
    return procs


def kill_the_scheduler_holding_results(fleet: Fleet, procs: dict[str, Proc], kills: list[Kill]):
    """1. The scheduler, holding every result of a group. The generator is held back (frozen)
    until the group's request is confirmed by the broker and the scheduler is frozen in turn;
    then the generator samples, the benchmarker judges, and all G results go to a scheduler
    that cannot store them. Restarted, it resumes its run. Returns the first group."""
    store = fleet.store
    first = wait_for(lambda: latest_group(fleet), 120, "the first group", fleet.tails)
    target = first
    for _ in range(3):  # should the generator have sampled the next group before its freeze
        wait_closed(fleet, target.id)
        fleet.freeze(procs["generator"])
        target = next_group(fleet, target.id)
        wait_for(lambda: store.count_unsent() == 0, 30, "its request to be confirmed")
        fleet.freeze(procs["scheduler"])
        stored = store.count_results(target.id)
        fleet.thaw(procs["generator"])
        if stored == 0:
            break
        fleet.thaw(procs["scheduler"])
    assert stored == 0, "the generator was never frozen in time"
    kill_holding(
        fleet,
        procs["scheduler"],
        BENCH_RESULTS,
        lambda unacked: unacked >= GROUP_SIZE,
        kills,
        f"the results of {target.id}",
        lambda: {"group": target.id},
    )
    created_at = store.get("created_at")
    procs["scheduler"] = fleet.start("scheduler")
    health = fleet.wait_healthy(procs["scheduler"])
    # Resumed its run (same store, same iteration or later), not a fresh one.
    assert health["iteration"] >= kills[-1].at_iteration, health
    assert store.get("created_at") == created_at
    return first


def kill_between_groups(
    fleet: Fleet,
    procs: dict[str, Proc],
    kills: list[Kill],
    service: str,
    queue: str,
    holds: Callable[[int, str], bool],
    what: str,
) -> None:
    """``service``, frozen between two groups, is killed once it holds ``what`` of the next
    (``holds(unacked, group id)``), and restarted."""
    current = latest_group(fleet)
    wait_closed(fleet, current.id)
    fleet.freeze(procs[service])
    target = next_group(fleet, current.id)
    kill_holding(
        fleet,
        procs[service],
        queue,
        lambda unacked: holds(unacked, target.id),
        kills,
        f"{what} of {target.id}",
        lambda: {"group": target.id},
    )
    procs[service] = fleet.start(service)
    fleet.wait_healthy(procs[service])


def kill_the_generator_holding_a_request(
    fleet: Fleet, procs: dict[str, Proc], kills: list[Kill]
) -> None:
    """2. The generator, frozen between two groups: it receives the next request."""
    kill_between_groups(
        fleet,
        procs,
        kills,
        "generator",
        GENERATE_REQUESTS,
        lambda unacked, _group: unacked >= 1,
        "the request",
    )


def kill_the_benchmarker_holding_candidates(
    fleet: Fleet, procs: dict[str, Proc], kills: list[Kill]
) -> None:
    """3. The benchmarker, frozen between two groups: it receives all G candidates of the
    next."""
    kill_between_groups(
        fleet,
        procs,
        kills,
        "benchmarker",
        CODE_TO_BENCH,
        lambda unacked, group: (
            unacked >= 1 and unacked + fleet.store.count_results(group) == GROUP_SIZE
        ),
        "the candidates",
    )


def kill_the_learner_holding_half_a_step(
    fleet: Fleet, procs: dict[str, Proc], kills: list[Kill]
) -> tuple[int, int]:
    """4. The learner, holding a deferred batch (half a step, uncommitted) after at least one
    committed version. Returns the version and groups trained it had committed."""
    learner = procs["learner"]

    def half_a_step() -> bool:
        fleet.check_alive()
        return (
            fleet.learner_version() >= 1
            and (fleet.health(learner) or {}).get("pending_groups") == 1
        )

    wait_for(
        half_a_step,
        120,
        "the learner to hold half a step",
        lambda: (fleet.health(learner), fleet.tails()),
        every=0.05,
    )
    fleet.freeze(learner)
    version_before, trained_before = fleet.learner_version(), fleet.groups_trained()
    kill_holding(
        fleet,
        learner,
        ROLLOUT_BATCHES,
        lambda unacked: unacked >= 1,
        kills,
        "a deferred batch",
        lambda: {"version": version_before, "groups_trained": trained_before},
    )
    procs["learner"] = fleet.start("learner")
    health = fleet.wait_healthy(procs["learner"])
    # It came back at the version it had committed, not at version 0. Its health may already
    # be a step further: the redelivered half step and a waiting group make one at once.
    assert started_at_version(procs["learner"]) == version_before >= 1, fleet.tail(learner)
    assert health["policy_version"] >= version_before, health
    return version_before, trained_before


def started_at_version(learner: Proc) -> int:
    """The version a learner process said it started from (its "learner ready" log line)."""
    for line in learner.log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "learner ready":
            return int(event["version"])
    raise AssertionError(f"{learner.label} logged no 'learner ready'")


def send_duplicates_and_see_them_ignored(
    fleet: Fleet, procs: dict[str, Proc], group_id: str
) -> tuple[list[str], dict[str, float]]:
    """Duplicates, delivered for certain: copies of the first group's request, of one of its
    results and of its rollout batch (trained on before the learner's kill). The restarted
    generator has no memory of the request and samples it again, so its G candidates are
    judged again too; none of it may count. Returns what was sent and the counts ignored."""
    assert not fleet.done(), "the run ended before the duplicates could be sent"
    duplicates = inject_duplicates(fleet, group_id)

    def ignored() -> dict[str, float] | None:
        fleet.check_alive()  # the scheduler too: its counters go with it
        counts = {
            # A result the scheduler has stored is not filed again; a copy of one it has
            # already handled is acked by its consumer without reaching the handler.
            "scheduler_results_ignored": fleet.metric(
                procs["scheduler"], "hpcrl_scheduler_results_ignored_total"
            )
            + fleet.metric(
                procs["scheduler"],
                "hpcrl_broker_consumed_total",
                queue=fleet.topology.name(BENCH_RESULTS),
                outcome="duplicate",
            ),
            "learner_duplicate_batches": fleet.metric(
                procs["learner"], "hpcrl_learner_duplicate_batches_total"
            ),
        }
        return (
            counts
            if counts["scheduler_results_ignored"] >= 1 + GROUP_SIZE
            and counts["learner_duplicate_batches"] >= 1
            else None
        )

    return duplicates, wait_for(
        ignored, 120, "the duplicates to be delivered and ignored", fleet.tails, every=0.3
    )


def stop_every_service(fleet: Fleet) -> None:
    """Once the run is done: every service stops, with exit code 0."""
    codes = stop_all(fleet)
    assert set(codes.values()) <= {0}, codes


def assert_each_killed_once_and_nothing_lost(
    fleet: Fleet,
    kills: list[Kill],
    learner_before: tuple[int, int],
    duplicates: list[str],
    ignored: dict[str, float],
) -> dict[str, Any]:
    """Every service was killed once, mid-run; the drills' counts hold; the learner's first
    version after its kill continues the one (``learner_before``: version, groups trained)
    it had committed. Returns the counts."""
    version_before, trained_before = learner_before
    print(f"\n{'killed':<12}{'holding on':<18}{'ready':>6}{'unacked':>8}{'iteration':>10}  extra")
    for kill in kills:
        print(
            f"{kill.service:<12}{kill.queue:<18}{kill.ready:>6}{kill.unacked:>8}"
            f"{kill.at_iteration:>10}  {kill.extra}"
        )
    assert [kill.service for kill in kills] == list(SERVICES)
    assert not any(kill.run_done for kill in kills), "the run ended before a kill"
    print(f"duplicates sent: {duplicates}; ignored: {ignored}")
    counts = assert_nothing_lost_nothing_twice(fleet)
    # The learner resumed: its first version after the kill continues the one before.
    after = [v for v in fleet.checkpoint_store().versions() if v.version > version_before]
    assert after and after[0].parent_version == version_before, after
    assert int(after[0].metrics["groups_trained"]) == trained_before + GROUPS_PER_STEP
    return counts


def test_kill_minus_nine_of_each_service_in_turn(fleet_factory):
    started = time.monotonic()
    timings: dict[str, float] = {}

    def lap(name: str) -> None:
        timings[name] = time.monotonic() - started

    fleet: Fleet = fleet_factory(iterations=10)
    procs = start_fleet(fleet)
    lap("start")
    kills: list[Kill] = []
    first = kill_the_scheduler_holding_results(fleet, procs, kills)
    lap("scheduler")
    kill_the_generator_holding_a_request(fleet, procs, kills)
    lap("generator")
    kill_the_benchmarker_holding_candidates(fleet, procs, kills)
    lap("benchmarker")
    learner_before = kill_the_learner_holding_half_a_step(fleet, procs, kills)
    lap("learner")
    duplicates, ignored = send_duplicates_and_see_them_ignored(fleet, procs, first.id)
    lap("duplicates")
    wait_done(fleet, procs["scheduler"], procs["learner"])
    lap("done")
    stop_every_service(fleet)
    counts = assert_each_killed_once_and_nothing_lost(
        fleet, kills, learner_before, duplicates, ignored
    )
    lap("total")
    print(f"counts: {counts}")
    print("timings: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))


# --- drill 2: a benchmarker replica added, another removed -----------------------------------


def replica_name(proc: Proc) -> str:
    """The ``benchmarker`` field of its results (hpcrl_benchmarker.service.replica_name)."""
    return f"benchmarker-{os.uname().nodename}-{proc.pid}"


def a_holds(fleet: Fleet, a: Proc, group_id: str) -> tuple[int] | None:
    """(candidates the frozen replica A holds unacked,) once every candidate of the group is
    either stored as a result or held by A (B has judged its share); else None."""
    held, stored = fleet.held_by(a), fleet.store.count_results(group_id)
    if fleet.ready(CODE_TO_BENCH) or held + stored != GROUP_SIZE:
        return None
    return (held,)


def test_benchmarker_replica_added_and_another_removed_mid_run(fleet_factory):
    started = time.monotonic()
    fleet: Fleet = fleet_factory(iterations=6)
    procs = start_fleet(fleet)
    a = procs["benchmarker"]

    first = wait_for(lambda: latest_group(fleet), 120, "the first group", fleet.tails)
    wait_closed(fleet, first.id)
    b = fleet.start("benchmarker", port=free_port())  # added
    fleet.wait_healthy(b)

    def b_judged() -> bool:
        fleet.check_alive()
        return any(row[5] == replica_name(b) for row in fleet.result_rows())

    wait_for(
        b_judged,
        120,
        "replica B to judge a candidate",
        lambda: (Counter(row[5] for row in fleet.result_rows()), fleet.tails()),
    )
    judged_a = fleet.metric(a, "hpcrl_benchmarker_results_total")

    # A is removed while it holds candidates: frozen between two groups, it is handed its
    # share of the next group (B judges the rest), then gets SIGTERM (and SIGCONT to act on
    # it). Whatever it was holding must be judged once, by A before it exits or by B.
    held = 0
    for _ in range(3):  # the broker may give A nothing of a group; then try the next one
        current = latest_group(fleet)
        wait_closed(fleet, current.id)
        fleet.freeze(a)
        target = next_group(fleet, current.id)
        held = wait_for(
            lambda group=target.id: a_holds(fleet, a, group),
            120,
            f"B to judge its share of {target.id} while A holds the rest",
            fleet.tails,
            every=0.5,
        )[0]
        if held:
            break
        fleet.thaw(a)
    assert held >= 1, "the broker never gave replica A a candidate"
    done_at_removal = fleet.done()
    assert fleet.iteration() < fleet.iterations - 1, "no iteration left to plan after A"
    # The scheduler waits while A is removed, so that the run still has groups to request
    # once A has exited: on a fast node the run's last groups once all went out during A's
    # stop, leaving nothing to show that B alone judges after it.
    scheduler = procs["scheduler"]
    fleet.freeze(scheduler)
    removed_at = time.monotonic()
    a.retired = True
    fleet.signal(a, signal.SIGTERM)  # removed, gracefully
    fleet.thaw(a)
    # Within its stop grace (30 s) and a margin: a stop never waits on work left running.
    code_a = fleet.terminate(a, grace_s=45)
    exited_at = time.time()
    stop_s = time.monotonic() - removed_at
    fleet.thaw(scheduler)
    assert code_a == 0, fleet.tail(a)
    assert not done_at_removal, "the run ended before replica A could be removed"

    wait_done(fleet, procs["scheduler"], procs["learner"])
    judged_b = fleet.metric(b, "hpcrl_benchmarker_results_total")
    codes = stop_all(fleet)
    assert set(codes.values()) <= {0}, codes
    counts = assert_nothing_lost_nothing_twice(fleet)

    rows = fleet.result_rows()
    by_replica = Counter(row[5] for row in rows)
    assert set(by_replica) == {replica_name(a), replica_name(b)}, by_replica
    # Groups requested after A had exited were judged by B alone (and there were some).
    later = {g.id for g in fleet.groups() if g.published_at and g.published_at > exited_at}
    after_exit = Counter(row[5] for row in rows if row[1] in later)
    assert set(after_exit) == {replica_name(b)}, (after_exit, len(later))
    assert judged_a >= 1 and judged_b >= by_replica[replica_name(b)], (judged_a, judged_b)
    print(f"\nA held {held} candidate(s) at SIGTERM, stopped in {stop_s:.1f} s")
    print(
        f"stored results by replica: {dict(by_replica)}; of groups requested after A "
        f"exited ({len(later)}): "
        f"{dict(after_exit)}; /metrics results_total: A {judged_a:.0f} (at SIGTERM), "
        f"B {judged_b:.0f}"
    )
    print(f"counts: {counts}; total {time.monotonic() - started:.0f} s")


# --- drill 3: the whole broker restarted (a single node) -------------------------------------


@pytest.fixture
def private_broker(tmp_path: Path) -> Iterator[RabbitNode]:
    """A node of its own, to stop and start again (its data directory survives)."""
    with RabbitNode(tmp_path / "rabbit") as node:
        yield node


def test_whole_broker_restarted_mid_run(private_broker: RabbitNode, tmp_path: Path):
    node = private_broker
    settings = BrokerSettings(
        url=node.url(),
        namespace="restart-drill",
        heartbeat_s=HEARTBEAT_S,
        delivery_limit=5,
        reconnect_initial_s=0.2,
        reconnect_max_s=2.0,
    )
    # Long enough that the run is still going after the first version: a 6-iteration run of
    # failing candidates once finished in 3 s, before the drill's first look at the broker.
    fleet = Fleet(
        tmp_path / "fleet",
        settings,
        iterations=16,
        rabbitmqctl=lambda *args: node.ctl(*args).stdout,
    )
    try:
        started = time.monotonic()
        # Mid-run: the learner has committed a version, and services hold unacked work.
        procs, held = start_and_wait_mid_run(fleet)
        queued = {base: fleet.ready(base) for base in WORK_QUEUES}
        at = {
            "iteration": fleet.iteration(),
            "version": fleet.learner_version(),
            "results": len(fleet.result_rows()),
        }
        down_at = time.monotonic()
        node.stop()  # every connection closed by the broker; then nothing answers

        def all_disconnected() -> bool:
            fleet.check_alive()
            return all(connected(fleet, proc) is False for proc in procs.values())

        wait_for(
            all_disconnected,
            30,
            "every service to see the broker gone",
            lambda: {p.label: fleet.health(p) for p in procs.values()},
        )
        time.sleep(5)  # a few reconnect attempts against a closed port
        fleet.check_alive()
        node.start().wait_started()
        up_at = time.monotonic()

        def all_reconnected() -> bool:
            fleet.check_alive()
            return all(
                connected(fleet, proc)
                for proc in procs.values()
                if proc.alive() and not proc.retired
            )

        reconnect_s = wait_for(
            lambda: all_reconnected() and time.monotonic(),
            60,
            "every service to reconnect",
            lambda: {p.label: fleet.health(p) for p in procs.values()},
        )
        reconnect_s -= up_at
        reconnects = {
            p.label: fleet.metric(p, "hpcrl_broker_reconnects_total")
            for p in procs.values()
            if p.alive()
        }
        assert all(count >= 1 for count in reconnects.values()), reconnects

        wait_done(fleet, procs["scheduler"], procs["learner"])
        codes = stop_all(fleet)
        assert set(codes.values()) <= {0}, codes
        counts = assert_nothing_lost_nothing_twice(fleet)
    finally:
        fleet.close()
    print(
        f"\nbroker stopped at iteration {at['iteration']}, policy version {at['version']}, "
        f"{at['results']} results stored, queued {queued}, held {held}; down for "
        f"{up_at - down_at:.1f} s (stop and start included); every service reconnected "
        f"{reconnect_s:.1f} s after it was up; reconnects {reconnects}"
    )
    print(f"counts: {counts}; total {time.monotonic() - started:.0f} s")
