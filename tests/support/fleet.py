"""The four real services as subprocesses on one experiment, and what the fleet drills
observe and assert (``tests/fleet``): from the scheduler's SQLite, the learner's
checkpoint store, the broker and each service's /metrics and /healthz, never from logs."""

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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hpcrl_benchmarker.host import has_avx512
from hpcrl_common.access import SCHEDULER_SUBSCRIBER
from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import (
    BenchResult,
    RolloutBatch,
    WeightUpdate,
    decode,
)
from hpcrl_common.topology import (
    GENERATE_REQUESTS,
    REASON_HEADER,
    ROLLOUT_BATCHES,
    WEIGHT_UPDATES,
    WORK_QUEUES,
    Topology,
)
from hpcrl_scheduler.store import Store
from tests.support.models import chat_model
from tests.support.rabbit_node import free_port
from tests.support.waiting import wait_for

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


def system_rabbitmqctl(*args: str) -> str:
    """The shared node's ``rabbitmqctl``; its stdout."""
    return subprocess.run(
        ["rabbitmqctl", *args], capture_output=True, text=True, check=True, timeout=60
    ).stdout


def process_state(pid: int) -> str:
    """Each thread's state and kernel wait channel: what a hung process is waiting on."""
    rows = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        with contextlib.suppress(OSError):
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = (task / "wchan").read_text().strip() or "-"
            rows.append(f"{task.name}:{state}:{wchan}")
    return "threads (tid:state:wchan): " + (" ".join(rows) or "none readable")


class Fleet:
    """The four services as subprocesses on one experiment config; what the test observes."""

    def __init__(
        self,
        root: Path,
        settings: BrokerSettings,
        *,
        iterations: int,
        rabbitmqctl: Callable[..., str] | None = None,
        service_urls: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``settings``: the broker as the test (an administrator) reaches it, and what every
        service's config says; ``service_urls``: a service's own broker URL (its role's user)
        where it differs; ``env``: more settings for every service (``HPCRL__...``)."""
        self.root = root
        self.rabbitmqctl = rabbitmqctl or system_rabbitmqctl
        self.settings = settings
        self.service_urls = dict(service_urls or {})
        self.env = dict(env or {})
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
        role_users = "".join(
            f"{role} = {json.dumps(user)}\n" for role, user in s.role_users.items()
        )
        return f"""
[broker]
url = "{s.url}"
failover_urls = {json.dumps(s.failover_urls)}
namespace = "{s.namespace}"
heartbeat_s = {HEARTBEAT_S}
delivery_limit = {s.delivery_limit}
prefetch = 8
reconnect_initial_s = 0.2
reconnect_max_s = 2.0
declare_topology = {json.dumps(s.declare_topology)}
authenticate_publishers = {json.dumps(s.authenticate_publishers)}

[broker.role_users]
{role_users}
[logging]
format = "json"

[experiment]
name = "{EXPERIMENT}"
seed = 18
data_dir = "{root / "data"}"

[scheduler]
metrics_port = {self.ports["scheduler"]}
iterations = {self.iterations}
group_size = {GROUP_SIZE}
node_budget = 2
max_tokens = {MAX_TOKENS}
max_staleness = 1
initial_groups_per_step = {GROUPS_PER_STEP}
isa = "{"avx512" if has_avx512() else "avx2"}"
db_path = "{self.db_path}"
tick_s = 0.2

[generator]
metrics_port = {self.ports["generator"]}
backend = "transformers"
model_path = "{self.policy}"
checkpoint_dir = "{self.checkpoints}"
max_model_len = 1024
version_poll_s = 0.2

[learner]
metrics_port = {self.ports["learner"]}
model_path = "{self.policy}"
checkpoint_dir = "{self.checkpoints}"
groups_per_step = {GROUPS_PER_STEP}
learning_rate = 1e-4
device = "cpu"
max_sequence_tokens = 2048

[benchmarker]
metrics_port = {self.ports["benchmarker"]}
concurrency = 1
work_dir = "{root / "bench"}"
lock_path = "{root / "bench.lock"}"
# The node is shared with every other service and the broker.
pin_threads = false
"""

    # --- processes ------------------------------------------------------------------------

    def start(self, service: str, *, port: int | None = None) -> Proc:
        argv = [str(BIN / f"hpcrl-{service}"), "serve", "--config", str(self.config)]
        if service == "benchmarker" and not has_avx512():
            argv += ["--allow-isa", "avx2"]
        port = port or self.ports[service]
        env = {**os.environ, **self.env, f"HPCRL__{service.upper()}__METRICS_PORT": str(port)}
        if service in self.service_urls:
            env["HPCRL__BROKER__URL"] = self.service_urls[service]
        label = f"{service}.{sum(p.service == service for p in self.procs)}"
        log = self.logs / f"{label}.log"
        with log.open("ab") as handle:
            popen = subprocess.Popen(
                argv,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        proc = Proc(service, label, popen, port, log)
        self.procs.append(proc)
        return proc

    def wait_healthy(self, proc: Proc, timeout: float = 120.0) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            if not proc.alive():
                raise AssertionError(
                    f"{proc.label} exited with {proc.popen.returncode} "
                    f"while starting:\n{self.tail(proc)}"
                )
            health = self.health(proc)
            return health if health and health.get("healthy") else None

        return wait_for(
            ready, timeout, f"{proc.label} to be healthy", lambda: self.tail(proc), every=0.25
        )

    def health(self, proc: Proc) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{proc.port}/healthz", timeout=5
            ) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:  # 503: the body says why
            return json.loads(exc.read() or b"{}")
        except (OSError, ValueError):
            return None

    def metric(self, proc: Proc, name: str, **labels: str) -> float:
        """The sum of the samples of one metric on the process's /metrics whose labels
        include ``labels``."""
        with urllib.request.urlopen(f"http://127.0.0.1:{proc.port}/metrics", timeout=5) as response:
            text = response.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )

    def signal(self, proc: Proc, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def freeze(self, proc: Proc) -> None:
        self.signal(proc, signal.SIGSTOP)
        proc.frozen = True

    def thaw(self, proc: Proc) -> None:
        self.signal(proc, signal.SIGCONT)
        proc.frozen = False

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
            raise AssertionError(
                f"{proc.label} did not stop within {grace_s} s of SIGTERM; "
                f"{threads}\n{self.tail(proc, 80)}"
            ) from None

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
                raise AssertionError(
                    f"{proc.label} exited with {proc.popen.returncode}:\n{self.tail(proc)}"
                )

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
            rows = connection.execute(
                "SELECT body FROM outbox WHERE queue = ? ORDER BY seq", (queue,)
            ).fetchall()
        finally:
            connection.close()
        return [bytes(row[0]) for row in rows]

    def result_rows(self) -> list[tuple[str, str, float | None, int, float, str]]:
        """(id, group id, reward, late, received_at, benchmarker) of every stored result."""
        connection = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=30)
        try:
            rows = connection.execute(
                "SELECT id, group_id, reward, late, received_at, body FROM results"
            ).fetchall()
        finally:
            connection.close()
        return [
            (r[0], r[1], r[2], r[3], r[4], decode(bytes(r[5]), BenchResult).benchmarker)
            for r in rows
        ]

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
        return sorted(
            row["name"]
            for row in (json.loads(out) if out.strip() else [])
            if row["name"].startswith(prefix)
        )

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
                    inodes.add(target[len("socket:[") : -1])
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
        out = self.rabbitmqctl(
            "-q", "list_channels", "--formatter", "json", "name", "messages_unacknowledged"
        )
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
            f"{group.id}/{i}" for i in range(group.group_size)
        ]
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
        dlqs = {
            base: fleet.depth(channel, fleet.topology.dlq(base))
            for base in [*WORK_QUEUES, WEIGHT_UPDATES]
        }
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
        leftovers = {
            name: count for name in fleet.queue_names() if (count := fleet.depth(channel, name))
        }
    assert not leftovers, f"queues still holding messages: {leftovers}"
    return {
        "groups": len(ids),
        "results": len(rows),
        "versions": len(versions),
        "scheduler_saw_version": seen_version,
        "queued_announcements": late_updates,
    }


def wait_done(
    fleet: Fleet, scheduler: Proc, learner: Proc, timeout: float = 240.0, refused: int = 0
) -> None:
    """The scheduler exits 0 once every iteration is closed; then the learner trains the
    last batches (all but ``refused``: batches the drill expects it to dead-letter)."""
    scheduler.retired = True  # its exit is expected now

    def finished() -> bool:
        fleet.check_alive()
        return not scheduler.alive()

    wait_for(finished, timeout, "the scheduler to finish the experiment", fleet.tails, every=0.5)
    assert scheduler.popen.returncode == 0, fleet.tail(scheduler)
    sent = fleet.store.count_batches_sent() - refused

    def trained() -> bool:
        fleet.check_alive()
        return fleet.groups_trained() >= sent

    wait_for(
        trained,
        120,
        f"the learner to train all {sent} batches",
        lambda: (fleet.groups_trained(), fleet.health(learner)),
        every=0.5,
    )


def stop_all(fleet: Fleet) -> dict[str, int]:
    """SIGTERM every service still running; their exit statuses."""
    return {proc.label: fleet.terminate(proc) for proc in fleet.procs if proc.alive()}


def connected(fleet: Fleet, proc: Proc) -> bool | None:
    """Its /healthz's ``connected`` (None when it does not answer)."""
    health = fleet.health(proc)
    return None if health is None else bool(health.get("connected"))


def start_and_wait_mid_run(fleet: Fleet) -> tuple[dict[str, Proc], dict[str, int]]:
    """Start the four services and wait until the run is under way: the learner has
    committed a version and a service holds unacknowledged work (its broker channels).
    The services and what each held."""
    procs = {service: fleet.start(service) for service in SERVICES}
    for proc in procs.values():
        fleet.wait_healthy(proc)
    wait_for(
        lambda: fleet.check_alive() or fleet.learner_version() >= 1,
        240,
        "the first policy version",
        fleet.tails,
        every=0.5,
    )

    def holding() -> dict[str, int] | None:
        fleet.check_alive()
        held = fleet.held_by_each(list(procs.values()))
        return held if any(held.values()) else None

    # The benchmarker is frozen while the drill looks: the candidates the broker hands it
    # stay unacknowledged, and no group can close, so the run cannot end between two looks
    # (each takes a rabbitmqctl call, ~1 s). Unfrozen, a 16-iteration run under the full
    # suite once reached its end before any look found work held mid-run.
    benchmarker = procs["benchmarker"]
    fleet.freeze(benchmarker)
    try:
        held = wait_for(holding, 120, "a service to hold unacked work", fleet.tails, every=0.0)
    finally:
        fleet.thaw(benchmarker)
    assert not fleet.done()
    return procs, held
