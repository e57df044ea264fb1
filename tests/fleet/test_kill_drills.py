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

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hpcrl_benchmarker.host import has_avx512
from hpcrl_common.access import SCHEDULER_SUBSCRIBER
from hpcrl_common.broker import Publish, Publisher
from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import (
    BenchResult,
    GenerateRequest,
    RolloutBatch,
    WeightUpdate,
    decode,
)
from hpcrl_common.topology import (
    BENCH_RESULTS,
    CODE_TO_BENCH,
    GENERATE_REQUESTS,
    REASON_HEADER,
    ROLLOUT_BATCHES,
    WEIGHT_UPDATES,
    WORK_QUEUES,
    Topology,
)
from hpcrl_scheduler.store import Store
from tests.support.models import chat_model
from tests.support.rabbit_node import RabbitNode, free_port

pytestmark = [pytest.mark.broker, pytest.mark.slow]

BIN = Path(sys.executable).parent
EXPERIMENT = "kill-drill"
GROUP_SIZE = 4
GROUPS_PER_STEP = 2
MAX_TOKENS = 96
# A frozen process sends no heartbeats: the broker must not close its connection (and take
# its unacked messages back) before the test kills it.
HEARTBEAT_S = 30
SERVICES = ("scheduler", "generator", "benchmarker", "learner")


# --- the fleet -------------------------------------------------------------------------------


@dataclass
class Proc:
    service: str
    label: str
    popen: subprocess.Popen
    port: int
    log: Path
    frozen: bool = False
    retired: bool = False  # stopped or killed by the test on purpose

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass
class Kill:
    service: str
    queue: str
    ready: int
    unacked: int
    at_iteration: int
    run_done: bool
    extra: dict[str, Any] = field(default_factory=dict)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str,
             detail: Callable[[], object] = lambda: "", every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}: {detail()}")


def system_rabbitmqctl(*args: str) -> str:
    """The shared node's ``rabbitmqctl``; its stdout."""
    return subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, check=True,
                          timeout=60).stdout


class Fleet:
    """The four services as subprocesses on one experiment config; what the test observes."""

    def __init__(self, root: Path, settings: BrokerSettings, *, iterations: int,
                 rabbitmqctl: Callable[..., str] | None = None) -> None:
        self.root = root
        self.rabbitmqctl = rabbitmqctl or system_rabbitmqctl
        self.settings = settings
        self.iterations = iterations
        self.topology = Topology(settings.namespace, settings.delivery_limit)
        self.policy = chat_model(root / "policy")
        self.checkpoints = root / "checkpoints"
        self.db_path = root / "scheduler.sqlite"
        self.config = root / "experiment.toml"
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.ports = {service: free_port() for service in SERVICES}
        self.procs: list[Proc] = []
        self._store: Store | None = None
        self.config.write_text(self._config_text())

    def _config_text(self) -> str:
        s, root = self.settings, self.root
        return f"""
[broker]
url = "{s.url}"
namespace = "{s.namespace}"
heartbeat_s = {HEARTBEAT_S}
delivery_limit = {s.delivery_limit}
prefetch = 8
reconnect_initial_s = 0.2
reconnect_max_s = 2.0

[logging]
format = "json"

[experiment]
name = "{EXPERIMENT}"
seed = 18
data_dir = "{root / 'data'}"

[scheduler]
metrics_port = {self.ports['scheduler']}
iterations = {self.iterations}
group_size = {GROUP_SIZE}
node_budget = 2
max_tokens = {MAX_TOKENS}
max_staleness = 1
initial_groups_per_step = {GROUPS_PER_STEP}
isa = "{'avx512' if has_avx512() else 'avx2'}"
db_path = "{self.db_path}"
tick_s = 0.2

[generator]
metrics_port = {self.ports['generator']}
backend = "transformers"
model_path = "{self.policy}"
checkpoint_dir = "{self.checkpoints}"
max_model_len = 1024
version_poll_s = 0.2

[learner]
metrics_port = {self.ports['learner']}
model_path = "{self.policy}"
checkpoint_dir = "{self.checkpoints}"
groups_per_step = {GROUPS_PER_STEP}
learning_rate = 1e-4
device = "cpu"
max_sequence_tokens = 2048

[benchmarker]
metrics_port = {self.ports['benchmarker']}
concurrency = 1
work_dir = "{root / 'bench'}"
lock_path = "{root / 'bench.lock'}"
# The node is shared with every other service and the broker.
pin_threads = false
"""

    # --- processes ------------------------------------------------------------------------

    def start(self, service: str, *, port: int | None = None) -> Proc:
        argv = [str(BIN / f"hpcrl-{service}"), "serve", "--config", str(self.config)]
        if service == "benchmarker" and not has_avx512():
            argv += ["--allow-isa", "avx2"]
        port = port or self.ports[service]
        env = {**os.environ, f"HPCRL__{service.upper()}__METRICS_PORT": str(port)}
        label = f"{service}.{sum(p.service == service for p in self.procs)}"
        log = self.logs / f"{label}.log"
        with log.open("ab") as handle:
            popen = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        proc = Proc(service, label, popen, port, log)
        self.procs.append(proc)
        return proc

    def wait_healthy(self, proc: Proc, timeout: float = 120.0) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            if not proc.alive():
                raise AssertionError(f"{proc.label} exited with {proc.popen.returncode} "
                                     f"while starting:\n{self.tail(proc)}")
            health = self.health(proc)
            return health if health and health.get("healthy") else None

        return wait_for(ready, timeout, f"{proc.label} to be healthy",
                        lambda: self.tail(proc), every=0.25)

    def health(self, proc: Proc) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{proc.port}/healthz",
                                        timeout=5) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:  # 503: the body says why
            return json.loads(exc.read() or b"{}")
        except (OSError, ValueError):
            return None

    def metric(self, proc: Proc, name: str, **labels: str) -> float:
        """The sum of the samples of one metric on the process's /metrics whose labels
        include ``labels``."""
        with urllib.request.urlopen(f"http://127.0.0.1:{proc.port}/metrics",
                                    timeout=5) as response:
            text = response.read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples if sample.name == name
                   and labels.items() <= sample.labels.items())

    def signal(self, proc: Proc, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def freeze(self, proc: Proc) -> None:
        self.signal(proc, signal.SIGSTOP)
        proc.frozen = True

    def kill9(self, proc: Proc) -> None:
        """SIGKILL to the whole process group (the service and any sandbox it runs)."""
        proc.retired = True
        self.signal(proc, signal.SIGKILL)
        proc.popen.wait(30)
        proc.frozen = False

    def terminate(self, proc: Proc, grace_s: float = 60.0) -> int:
        """SIGTERM (graceful stop) and the exit status."""
        proc.retired = True
        self.signal(proc, signal.SIGTERM)
        try:
            return proc.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            threads = process_state(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)  # every thread's stack, into its log
            time.sleep(2)
            raise AssertionError(f"{proc.label} did not stop within {grace_s} s of SIGTERM; "
                                 f"{threads}\n{self.tail(proc, 80)}") from None

    def close(self) -> None:
        for proc in self.procs:
            if proc.alive():
                if proc.frozen:
                    self.signal(proc, signal.SIGCONT)
                self.signal(proc, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(30)
        if self._store is not None:
            self._store.close()

    def tail(self, proc: Proc, lines: int = 30) -> str:
        try:
            text = proc.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return f"--- {proc.label} ---\n" + "\n".join(text[-lines:])

    def tails(self) -> str:
        return "\n".join(self.tail(p, 15) for p in self.procs)

    # --- the scheduler's store (read-only) -------------------------------------------------

    @property
    def store(self) -> Store:
        if self._store is None:
            wait_for(self.db_path.exists, 120, "the scheduler's database", self.tails)
            self._store = Store(self.db_path, read_only=True)
        return self._store

    def iteration(self) -> int:
        return int(self.store.get("iteration", -1))

    def done(self) -> bool:
        """Every iteration planned and every group closed (what makes the scheduler exit)."""
        t = self.iteration()
        return t == self.iterations - 1 and self.store.count_open_groups(t) == 0

    def check_alive(self) -> None:
        for proc in self.procs:
            if not proc.retired and not proc.alive():
                raise AssertionError(f"{proc.label} exited with {proc.popen.returncode}:\n"
                                     f"{self.tail(proc)}")

    def groups(self) -> list:
        return [g for t in range(self.iteration() + 1) for g in self.store.groups_of_iteration(t)]

    def outbox_counts(self) -> dict[tuple[str, str], int]:
        """(queue, message id) -> outbox rows. The store has no named operation for this
        count, so it is one read-only query (every row, sent or not, is a publication)."""
        connection = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=30)
        try:
            rows = connection.execute(
                "SELECT queue, message_id, COUNT(*) FROM outbox GROUP BY queue, message_id"
            ).fetchall()
        finally:
            connection.close()
        return {(queue, message_id): count for queue, message_id, count in rows}

    def outbox_bodies(self, queue: str) -> list[bytes]:
        connection = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=30)
        try:
            rows = connection.execute("SELECT body FROM outbox WHERE queue = ? ORDER BY seq",
                                      (queue,)).fetchall()
        finally:
            connection.close()
        return [bytes(row[0]) for row in rows]

    def result_rows(self) -> list[tuple[str, str, float | None, int, float, str]]:
        """(id, group id, reward, late, received_at, benchmarker) of every stored result."""
        connection = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=30)
        try:
            rows = connection.execute(
                "SELECT id, group_id, reward, late, received_at, body FROM results").fetchall()
        finally:
            connection.close()
        return [(r[0], r[1], r[2], r[3], r[4], decode(bytes(r[5]), BenchResult).benchmarker)
                for r in rows]

    # --- the learner's checkpoint store ----------------------------------------------------

    def checkpoint_store(self) -> CheckpointStore:
        return CheckpointStore(self.checkpoints)

    def learner_version(self) -> int:
        latest = self.checkpoint_store().latest()
        return 0 if latest is None else latest.version

    def groups_trained(self) -> int:
        latest = self.checkpoint_store().latest()
        return 0 if latest is None else int(latest.metrics.get("groups_trained", 0))

    def learner_state(self, version: int) -> dict[str, Any]:
        path = self.checkpoints / "learner-state" / f"v{version:06d}" / "state.json"
        return json.loads(path.read_text())

    # --- the broker ------------------------------------------------------------------------

    # RabbitMQ's own queue statistics (``rabbitmqctl list_queues``) are refreshed every few
    # seconds; what a drill decides on must be exact: a queue's ready messages come from a
    # passive declare, and what a process holds unacked from its channels (the channel
    # processes answer ``list_channels`` from their live state).

    def queue_names(self) -> list[str]:
        """Every queue of this namespace (names only: the counts rabbitmqctl gives lag)."""
        out = self.rabbitmqctl("-q", "list_queues", "--formatter", "json", "name")
        prefix = self.settings.namespace + "."
        return sorted(row["name"] for row in (json.loads(out) if out.strip() else [])
                      if row["name"].startswith(prefix))

    def ready(self, base: str) -> int:
        with self.channel() as channel:
            return self.depth(channel, self.topology.name(base))

    def broker_ports(self, proc: Proc) -> set[int]:
        """Local TCP ports of the process's connections to the broker (from /proc)."""
        broker_port = urllib.parse.urlsplit(self.settings.url).port or 5672
        inodes = set()
        fds = Path(f"/proc/{proc.pid}/fd")
        for fd in fds.iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
        ports = set()
        for table in ("tcp", "tcp6"):
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{proc.pid}/net/{table}").read_text().splitlines()[1:]:
                    fields = line.split()
                    local, remote, inode = fields[1], fields[2], fields[9]
                    if inode in inodes and int(remote.rsplit(":", 1)[1], 16) == broker_port:
                        ports.add(int(local.rsplit(":", 1)[1], 16))
        return ports

    def held_by(self, proc: Proc) -> int:
        """Messages delivered to the process and not yet acked, by the broker's channels."""
        return self.held_by_each([proc])[proc.label]

    def held_by_each(self, procs: list[Proc]) -> dict[str, int]:
        """``held_by`` for several processes from one ``rabbitmqctl`` call (each takes ~1 s)."""
        ports = {proc.label: self.broker_ports(proc) for proc in procs}
        out = self.rabbitmqctl("-q", "list_channels", "--formatter", "json", "name",
                               "messages_unacknowledged")
        held = dict.fromkeys(ports, 0)
        for row in json.loads(out) if out.strip() else []:
            local = row["name"].split(" -> ")[0]  # "127.0.0.1:PORT -> 127.0.0.1:5672 (1)"
            port = int(local.rsplit(":", 1)[1])
            for label, owned in ports.items():
                if port in owned:
                    held[label] += int(row["messages_unacknowledged"])
        return held

    @contextlib.contextmanager
    def channel(self) -> Iterator[Any]:
        connection = pika.BlockingConnection(pika.URLParameters(self.settings.url))
        try:
            yield connection.channel()
        finally:
            if connection.is_open:
                connection.close()

    def depth(self, channel: Any, queue: str) -> int:
        return channel.queue_declare(queue, passive=True).method.message_count


# --- what every drill asserts at the end -----------------------------------------------------


def assert_nothing_lost_nothing_twice(fleet: Fleet) -> dict[str, Any]:
    """The counts of the issue, from the store, the checkpoint store and the broker."""
    store = fleet.store
    t = fleet.iteration()
    assert t == fleet.iterations - 1, f"the scheduler stopped at iteration {t}"
    assert store.count_pending_groups() == 0
    assert store.count_groups_in_flight() == 0
    assert store.count_unsent() == 0
    groups = fleet.groups()
    for i in range(fleet.iterations):
        states = store.count_groups_by_state(i)
        assert states["pending"] == states["published"] == 0, (i, states)
        assert states["closed"] >= 1, (i, states)
    ids = [g.id for g in groups]
    assert len(ids) == len(set(ids))

    # Every group closed once, complete, with G results, each with one reward.
    outbox = fleet.outbox_counts()
    rows = fleet.result_rows()
    per_candidate = Counter(row[0] for row in rows)
    assert set(per_candidate.values()) == {1}
    assert not [row for row in rows if row[3]], "late results: a group closed short"
    rewards = {row[0]: row[2] for row in rows}
    for group in groups:
        assert group.state == "closed" and group.close_reason == "complete", group
        assert group.outcome == "sent", group
        assert store.count_results(group.id) == group.group_size == GROUP_SIZE
        assert [r.id for r in store.results_of(group.id)] == [
            f"{group.id}/{i}" for i in range(group.group_size)]
        assert outbox.get((GENERATE_REQUESTS, group.id)) == 1, "requested more than once"
        assert outbox.get((ROLLOUT_BATCHES, group.id)) == 1, "closed more than once"
    assert all(rewards[cid] is not None for cid in rewards), "a result without a reward"
    assert sum(len(store.rewards_of_iteration(i)) for i in range(fleet.iterations)) == len(rows)
    assert len(rows) == len(groups) * GROUP_SIZE
    assert store.count_batches_sent() == len(groups)

    # One rollout batch per group; every candidate in exactly one, with its stored reward.
    batches = [decode(body, RolloutBatch) for body in fleet.outbox_bodies(ROLLOUT_BATCHES)]
    assert sorted(b.id for b in batches) == sorted(ids)
    samples = Counter(s.candidate_id for b in batches for s in b.samples)
    assert set(samples) == set(rewards) and set(samples.values()) == {1}
    for batch in batches:
        for sample in batch.samples:
            assert sample.reward == pytest.approx(rewards[sample.candidate_id])

    # The learner trained every batch once, dropped none, and never started over.
    versions = fleet.checkpoint_store().versions()
    assert len(ids) % GROUPS_PER_STEP == 0, "the sizing leaves a partial step"
    assert [v.version for v in versions] == list(range(1, len(ids) // GROUPS_PER_STEP + 1))
    assert [v.parent_version for v in versions] == [v.version - 1 for v in versions]
    trained = [int(v.metrics["groups_trained"]) for v in versions]
    assert trained == [GROUPS_PER_STEP * v.version for v in versions], trained
    assert versions[-1].metrics.get("groups_dropped", 0) == 0
    state = fleet.learner_state(versions[-1].version)
    assert state["version"] == versions[-1].version
    assert sorted(state["trained_ids"]) == sorted(ids), "trained ids differ from the groups"
    assert state["groups_trained"] == len(ids) and state["groups_dropped"] == 0

    # The broker: every work queue and dead-letter queue empty. The services are stopped, so
    # nothing is unacked: once the broker has closed their connections (it takes back what
    # they held at once), a queue's message count is everything it holds.
    time.sleep(1.0)
    seen_version = int(store.get("policy_version", 0))
    with fleet.channel() as channel:
        depths = {base: fleet.depth(channel, fleet.topology.name(base)) for base in WORK_QUEUES}
        dlqs = {base: fleet.depth(channel, fleet.topology.dlq(base))
                for base in [*WORK_QUEUES, WEIGHT_UPDATES]}
        dead = []
        for base, count in dlqs.items():
            for _ in range(count):
                method, props, body = channel.basic_get(fleet.topology.dlq(base), auto_ack=True)
                if method is not None:
                    dead.append((base, (props.headers or {}).get(REASON_HEADER), body[:80]))
        # The scheduler stops consuming once done; the learner's later announcements wait in
        # its durable queue. Anything else there would be an update it never took.
        subscriber = fleet.topology.subscriber_queue(WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER)
        late_updates = []
        while True:
            method, _props, body = channel.basic_get(subscriber, auto_ack=True)
            if method is None:
                break
            late_updates.append(decode(body, WeightUpdate).version)
    assert depths == dict.fromkeys(WORK_QUEUES, 0), depths
    assert not dead, f"dead letters: {dead}"
    assert all(v > seen_version for v in late_updates), (seen_version, late_updates)
    with fleet.channel() as channel:
        leftovers = {name: count for name in fleet.queue_names()
                     if (count := fleet.depth(channel, name))}
    assert not leftovers, f"queues still holding messages: {leftovers}"
    return {"groups": len(ids), "results": len(rows), "versions": len(versions),
            "scheduler_saw_version": seen_version, "queued_announcements": late_updates}


def wait_done(fleet: Fleet, scheduler: Proc, learner: Proc, timeout: float = 240.0) -> None:
    """The scheduler exits 0 once every iteration is closed; then the learner trains the
    last batches."""
    scheduler.retired = True  # its exit is expected now

    def finished() -> bool:
        fleet.check_alive()
        return not scheduler.alive()

    wait_for(finished, timeout, "the scheduler to finish the experiment", fleet.tails, every=0.5)
    assert scheduler.popen.returncode == 0, fleet.tail(scheduler)
    sent = fleet.store.count_batches_sent()

    def trained() -> bool:
        fleet.check_alive()
        return fleet.groups_trained() >= sent

    wait_for(trained, 120, f"the learner to train all {sent} batches",
             lambda: (fleet.groups_trained(), fleet.health(learner)), every=0.5)


def stop_all(fleet: Fleet) -> dict[str, int]:
    """SIGTERM every service still running; their exit statuses."""
    return {proc.label: fleet.terminate(proc) for proc in fleet.procs if proc.alive()}


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


def kill_holding(fleet: Fleet, victim: Proc, queue: str, holds: Callable[[int], bool],
                 kills: list[Kill], what: str, extra: Callable[[], dict[str, Any]] = dict,
                 timeout: float = 120.0) -> None:
    """``victim`` is frozen, and the only consumer of ``queue``: wait until nothing of the
    queue is ready and the broker shows the victim holding unacked what ``holds`` asks for,
    then SIGKILL it."""
    assert victim.frozen

    def held() -> tuple[int, int] | None:
        ready, unacked = fleet.ready(queue), fleet.held_by(victim)
        return (ready, unacked) if ready == 0 and holds(unacked) else None

    ready, unacked = wait_for(held, timeout, f"the frozen {victim.label} to hold {what}",
                              lambda: (fleet.ready(queue), fleet.held_by(victim),
                                       fleet.tails()), every=0.3)
    kills.append(Kill(victim.service, queue, ready, unacked, fleet.iteration(), fleet.done(),
                      extra()))
    fleet.kill9(victim)


def inject_duplicates(fleet: Fleet, group_id: str) -> list[str]:
    """Publish again, as a redelivery would bring them, the request, the first result and
    the rollout batch of a closed group; what was sent."""
    request = decode(next(b for b in fleet.outbox_bodies(GENERATE_REQUESTS)
                          if decode(b, GenerateRequest).id == group_id), GenerateRequest)
    result = fleet.store.results_of(group_id)[0]
    batch = decode(next(b for b in fleet.outbox_bodies(ROLLOUT_BATCHES)
                        if decode(b, RolloutBatch).id == group_id), RolloutBatch)
    assert batch.id in fleet.learner_state(fleet.learner_version())["trained_ids"]
    with Publisher(fleet.settings) as publisher:
        publisher.publish(Publish(fleet.topology.name(GENERATE_REQUESTS), request),
                          Publish(fleet.topology.name(BENCH_RESULTS), result),
                          Publish(fleet.topology.name(ROLLOUT_BATCHES), batch))
    return [f"{GENERATE_REQUESTS} {request.id}", f"{BENCH_RESULTS} {result.id}",
            f"{ROLLOUT_BATCHES} {batch.id}"]


def test_kill_minus_nine_of_each_service_in_turn(fleet_factory):
    started = time.monotonic()
    fleet: Fleet = fleet_factory(iterations=10)
    procs = {service: fleet.start(service) for service in SERVICES}
    for proc in procs.values():
        fleet.wait_healthy(proc)
    timings = {"start": time.monotonic() - started}
    kills: list[Kill] = []
    store = fleet.store

    # 1. The scheduler, holding every result of a group. The generator is held back (frozen)
    #    until the group's request is confirmed by the broker and the scheduler is frozen in
    #    turn; then the generator samples, the benchmarker judges, and all G results go to a
    #    scheduler that cannot store them.
    first = wait_for(lambda: latest_group(fleet), 120, "the first group", fleet.tails)
    target = first
    for _ in range(3):  # should the generator have sampled the next group before its freeze
        wait_closed(fleet, target.id)
        fleet.freeze(procs["generator"])
        target = next_group(fleet, target.id)
        wait_for(lambda: store.count_unsent() == 0, 30, "its request to be confirmed")
        fleet.freeze(procs["scheduler"])
        stored = store.count_results(target.id)
        fleet.signal(procs["generator"], signal.SIGCONT)
        procs["generator"].frozen = False
        if stored == 0:
            break
        fleet.signal(procs["scheduler"], signal.SIGCONT)
        procs["scheduler"].frozen = False
    assert stored == 0, "the generator was never frozen in time"
    kill_holding(fleet, procs["scheduler"], BENCH_RESULTS,
                 lambda unacked: unacked >= GROUP_SIZE, kills,
                 f"the results of {target.id}", lambda: {"group": target.id})
    created_at = store.get("created_at")
    procs["scheduler"] = fleet.start("scheduler")
    health = fleet.wait_healthy(procs["scheduler"])
    # Resumed its run (same store, same iteration or later), not a fresh one.
    assert health["iteration"] >= kills[-1].at_iteration, health
    assert store.get("created_at") == created_at
    timings["scheduler"] = time.monotonic() - started

    # 2. The generator, frozen between two groups: it receives the next request.
    current = latest_group(fleet)
    wait_closed(fleet, current.id)
    fleet.freeze(procs["generator"])
    target = next_group(fleet, current.id)
    kill_holding(fleet, procs["generator"], GENERATE_REQUESTS,
                 lambda unacked: unacked >= 1, kills, f"the request of {target.id}",
                 lambda: {"group": target.id})
    procs["generator"] = fleet.start("generator")
    fleet.wait_healthy(procs["generator"])
    timings["generator"] = time.monotonic() - started

    # 3. The benchmarker, frozen between two groups: it receives all G candidates of the next.
    current = latest_group(fleet)
    wait_closed(fleet, current.id)
    fleet.freeze(procs["benchmarker"])
    target = next_group(fleet, current.id)
    kill_holding(fleet, procs["benchmarker"], CODE_TO_BENCH,
                 lambda unacked: unacked >= 1
                 and unacked + store.count_results(target.id) == GROUP_SIZE, kills,
                 f"the candidates of {target.id}", lambda: {"group": target.id})
    procs["benchmarker"] = fleet.start("benchmarker")
    fleet.wait_healthy(procs["benchmarker"])
    timings["benchmarker"] = time.monotonic() - started

    # 4. The learner, holding a deferred batch (half a step, uncommitted) after at least one
    #    committed version.
    learner = procs["learner"]

    def half_a_step() -> bool:
        fleet.check_alive()
        return fleet.learner_version() >= 1 and \
            (fleet.health(learner) or {}).get("pending_groups") == 1

    wait_for(half_a_step, 120, "the learner to hold half a step",
             lambda: (fleet.health(learner), fleet.tails()), every=0.05)
    fleet.freeze(learner)
    version_before, trained_before = fleet.learner_version(), fleet.groups_trained()
    kill_holding(fleet, learner, ROLLOUT_BATCHES, lambda unacked: unacked >= 1, kills,
                 "a deferred batch",
                 lambda: {"version": version_before, "groups_trained": trained_before})
    procs["learner"] = fleet.start("learner")
    health = fleet.wait_healthy(procs["learner"])
    # It came back at the version it had committed, not at version 0.
    assert health["policy_version"] == version_before >= 1, health
    timings["learner"] = time.monotonic() - started

    # Duplicates, delivered for certain: copies of the first group's request, of one of its
    # results and of its rollout batch (trained on before the learner's kill). The restarted
    # generator has no memory of the request and samples it again, so its G candidates are
    # judged again too; none of it may count.
    assert not fleet.done(), "the run ended before the duplicates could be sent"
    duplicates = inject_duplicates(fleet, first.id)

    def ignored() -> dict[str, float] | None:
        fleet.check_alive()  # the scheduler too: its counters go with it
        counts = {
            # A result the scheduler has stored is not filed again; a copy of one it has
            # already handled is acked by its consumer without reaching the handler.
            "scheduler_results_ignored": fleet.metric(
                procs["scheduler"], "hpcrl_scheduler_results_ignored_total") + fleet.metric(
                procs["scheduler"], "hpcrl_broker_consumed_total",
                queue=fleet.topology.name(BENCH_RESULTS), outcome="duplicate"),
            "learner_duplicate_batches": fleet.metric(
                procs["learner"], "hpcrl_learner_duplicate_batches_total"),
        }
        return counts if counts["scheduler_results_ignored"] >= 1 + GROUP_SIZE and \
            counts["learner_duplicate_batches"] >= 1 else None

    ignored = wait_for(ignored, 120, "the duplicates to be delivered and ignored",
                       fleet.tails, every=0.3)
    timings["duplicates"] = time.monotonic() - started

    wait_done(fleet, procs["scheduler"], procs["learner"])
    timings["done"] = time.monotonic() - started
    codes = stop_all(fleet)
    assert set(codes.values()) <= {0}, codes

    print(f"\n{'killed':<12}{'holding on':<18}{'ready':>6}{'unacked':>8}{'iteration':>10}  extra")
    for kill in kills:
        print(f"{kill.service:<12}{kill.queue:<18}{kill.ready:>6}{kill.unacked:>8}"
              f"{kill.at_iteration:>10}  {kill.extra}")
    assert [kill.service for kill in kills] == list(SERVICES)
    assert not any(kill.run_done for kill in kills), "the run ended before a kill"
    print(f"duplicates sent: {duplicates}; ignored: {ignored}")
    counts = assert_nothing_lost_nothing_twice(fleet)
    # The learner resumed: its first version after the kill continues the one before.
    after = [v for v in fleet.checkpoint_store().versions() if v.version > version_before]
    assert after and after[0].parent_version == version_before, after
    assert int(after[0].metrics["groups_trained"]) == trained_before + GROUPS_PER_STEP
    timings["total"] = time.monotonic() - started
    print(f"counts: {counts}")
    print("timings: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))


# --- drill 2: a benchmarker replica added, another removed -----------------------------------


def replica_name(proc: Proc) -> str:
    """The ``benchmarker`` field of its results (hpcrl_benchmarker.service.replica_name)."""
    return f"benchmarker-{os.uname().nodename}-{proc.pid}"


def process_state(pid: int) -> str:
    """Each thread's state and kernel wait channel: what a hung process is waiting on."""
    rows = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        with contextlib.suppress(OSError):
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = (task / "wchan").read_text().strip() or "-"
            rows.append(f"{task.name}:{state}:{wchan}")
    return "threads (tid:state:wchan): " + (" ".join(rows) or "none readable")


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
    procs = {service: fleet.start(service) for service in SERVICES}
    for proc in procs.values():
        fleet.wait_healthy(proc)
    a = procs["benchmarker"]

    first = wait_for(lambda: latest_group(fleet), 120, "the first group", fleet.tails)
    wait_closed(fleet, first.id)
    b = fleet.start("benchmarker", port=free_port())  # added
    fleet.wait_healthy(b)

    def b_judged() -> bool:
        fleet.check_alive()
        return any(row[5] == replica_name(b) for row in fleet.result_rows())

    wait_for(b_judged, 120, "replica B to judge a candidate",
             lambda: (Counter(row[5] for row in fleet.result_rows()), fleet.tails()))
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
        held = wait_for(lambda group=target.id: a_holds(fleet, a, group), 120,
                        f"B to judge its share of {target.id} while A holds the rest",
                        fleet.tails, every=0.5)[0]
        if held:
            break
        fleet.signal(a, signal.SIGCONT)
        a.frozen = False
    assert held >= 1, "the broker never gave replica A a candidate"
    done_at_removal = fleet.done()
    removed_at = time.monotonic()
    a.retired = True
    fleet.signal(a, signal.SIGTERM)  # removed, gracefully
    fleet.signal(a, signal.SIGCONT)
    a.frozen = False
    # Within its stop grace (30 s) and a margin: a stop never waits on work left running.
    code_a = fleet.terminate(a, grace_s=45)
    exited_at = time.time()
    stop_s = time.monotonic() - removed_at
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
    print(f"stored results by replica: {dict(by_replica)}; of groups requested after A "
          f"exited ({len(later)}): "
          f"{dict(after_exit)}; /metrics results_total: A {judged_a:.0f} (at SIGTERM), "
          f"B {judged_b:.0f}")
    print(f"counts: {counts}; total {time.monotonic() - started:.0f} s")


# --- drill 3: the whole broker restarted (a single node) -------------------------------------


@pytest.fixture
def private_broker(tmp_path: Path) -> Iterator[RabbitNode]:
    """A node of its own, to stop and start again (its data directory survives)."""
    with RabbitNode(tmp_path / "rabbit") as node:
        yield node


def connected(fleet: Fleet, proc: Proc) -> bool | None:
    """Its /healthz's ``connected`` (None when it does not answer)."""
    health = fleet.health(proc)
    return None if health is None else bool(health.get("connected"))


def test_whole_broker_restarted_mid_run(private_broker: RabbitNode, tmp_path: Path):
    node = private_broker
    settings = BrokerSettings(url=node.url(), namespace="restart-drill", heartbeat_s=HEARTBEAT_S,
                              delivery_limit=5, reconnect_initial_s=0.2, reconnect_max_s=2.0)
    # Long enough that the run is still going after the first version: a 6-iteration run of
    # failing candidates once finished in 3 s, before the drill's first look at the broker.
    fleet = Fleet(tmp_path / "fleet", settings, iterations=16,
                  rabbitmqctl=lambda *args: node.ctl(*args).stdout)
    try:
        started = time.monotonic()
        procs = {service: fleet.start(service) for service in SERVICES}
        for proc in procs.values():
            fleet.wait_healthy(proc)

        # Mid-run: the learner has committed a version, and services hold unacked work.
        wait_for(lambda: fleet.check_alive() or fleet.learner_version() >= 1, 240,
                 "the first policy version", fleet.tails, every=0.5)

        def holding() -> dict[str, int] | None:
            fleet.check_alive()
            held = fleet.held_by_each(list(procs.values()))
            return held if any(held.values()) else None

        held = wait_for(holding, 120, "a service to hold unacked work", fleet.tails, every=0.0)
        assert not fleet.done()
        queued = {base: fleet.ready(base) for base in WORK_QUEUES}
        at = {"iteration": fleet.iteration(), "version": fleet.learner_version(),
              "results": len(fleet.result_rows())}
        down_at = time.monotonic()
        node.stop()  # every connection closed by the broker; then nothing answers

        def all_disconnected() -> bool:
            fleet.check_alive()
            return all(connected(fleet, proc) is False for proc in procs.values())

        wait_for(all_disconnected, 30, "every service to see the broker gone",
                 lambda: {p.label: fleet.health(p) for p in procs.values()})
        time.sleep(5)  # a few reconnect attempts against a closed port
        fleet.check_alive()
        node.start().wait_started()
        up_at = time.monotonic()

        def all_reconnected() -> bool:
            fleet.check_alive()
            return all(connected(fleet, proc) for proc in procs.values()
                       if proc.alive() and not proc.retired)

        reconnect_s = wait_for(lambda: all_reconnected() and time.monotonic(), 60,
                               "every service to reconnect",
                               lambda: {p.label: fleet.health(p) for p in procs.values()})
        reconnect_s -= up_at
        reconnects = {p.label: fleet.metric(p, "hpcrl_broker_reconnects_total")
                      for p in procs.values() if p.alive()}
        assert all(count >= 1 for count in reconnects.values()), reconnects

        wait_done(fleet, procs["scheduler"], procs["learner"])
        codes = stop_all(fleet)
        assert set(codes.values()) <= {0}, codes
        counts = assert_nothing_lost_nothing_twice(fleet)
    finally:
        fleet.close()
    print(f"\nbroker stopped at iteration {at['iteration']}, policy version {at['version']}, "
          f"{at['results']} results stored, queued {queued}, held {held}; down for "
          f"{up_at - down_at:.1f} s (stop and start included); every service reconnected "
          f"{reconnect_s:.1f} s after it was up; reconnects {reconnects}")
    print(f"counts: {counts}; total {time.monotonic() - started:.0f} s")
