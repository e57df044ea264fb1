"""Each role locked to its own queues, on the real RabbitMQ: users, permissions, user_id checks.

A fresh vhost per test module holds the experiment's topology, imported with
``rabbitmqctl import_definitions`` from what :func:`hpcrl_common.access.definitions` writes
(the same document ``hpcrl-broker-admin definitions`` produces).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from urllib.parse import quote

import pika
import pika.exceptions
import pytest

from hpcrl_common.access import (
    ROLES,
    SCHEDULER_SUBSCRIBER,
    definitions,
    publisher_allowed,
    role_permissions,
)
from hpcrl_common.broker import Consumer, Publish, Publisher
from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import (
    BenchResult,
    BenchSpec,
    Candidate,
    GenerateRequest,
    HostInfo,
    RolloutBatch,
    RolloutSample,
    WeightUpdate,
    encode,
)
from hpcrl_common.topology import (
    BENCH_RESULTS,
    CODE_TO_BENCH,
    GENERATE_REQUESTS,
    PUBLISHER_HEADER,
    REASON_HEADER,
    ROLLOUT_BATCHES,
    WEIGHT_UPDATES,
    Topology,
)

from ..conftest import RunningConsumer
from .strategies import sample_candidate, sample_request, sample_rollout

pytestmark = pytest.mark.broker
NAMESPACE = "exp"


def rabbitmqctl(*args: str) -> str:
    return subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, check=True
    ).stdout


def import_definitions(text: str) -> None:
    # rabbitmqctl reads the file as the rabbitmq user: a world-readable temporary file.
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        handle.write(text)
    os.chmod(handle.name, stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)
    try:
        rabbitmqctl("import_definitions", handle.name)
    finally:
        os.unlink(handle.name)


class Site:
    """A vhost with the experiment's topology and one user per role."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:8]
        self.vhost = f"hpcrl-test-{tag}"
        self.role_users = {role: f"t{tag}-{role}" for role in ROLES}
        self.passwords = {user: uuid.uuid4().hex for user in self.role_users.values()}
        self.topology = Topology(NAMESPACE, 3)

    def settings(self, role: str | None = None, **changes) -> BrokerSettings:
        """A role's settings (its own user), or the administrator's (guest) for None."""
        if role is None:
            user, password = "guest", "guest"
        else:
            user = self.role_users[role]
            password = self.passwords[user]
        url = f"amqp://{user}:{password}@127.0.0.1:5672/{quote(self.vhost, safe='')}"
        return BrokerSettings(
            url=url,
            namespace=NAMESPACE,
            delivery_limit=3,
            heartbeat_s=5,
            reconnect_initial_s=0.2,
            reconnect_max_s=1.0,
            declare_topology=role is None,
            authenticate_publishers=True,
            role_users=self.role_users,
            **changes,
        )

    def create(self) -> None:
        users = {user: (role, self.passwords[user]) for role, user in self.role_users.items()}
        import_definitions(json.dumps(definitions(self.topology, self.vhost, users)))
        rabbitmqctl("set_permissions", "-p", self.vhost, "guest", ".*", ".*", ".*")

    def remove(self) -> None:
        rabbitmqctl("delete_vhost", self.vhost)
        for user in self.role_users.values():
            rabbitmqctl("delete_user", user)

    def channel(self, role: str | None) -> pika.adapters.blocking_connection.BlockingChannel:
        params = pika.URLParameters(self.settings(role).url)
        params.connection_attempts = 1
        channel = pika.BlockingConnection(params).channel()
        channel.confirm_delivery()
        return channel


@pytest.fixture(scope="module")
def site(rabbitmq: str) -> Iterator[Site]:
    site = Site()
    site.create()
    yield site
    site.remove()


def refused(action) -> bool:
    """True when the broker closes the channel with ACCESS_REFUSED (403)."""
    try:
        action()
    except pika.exceptions.ChannelClosedByBroker as exc:
        return exc.reply_code == 403
    return False


# --- pure --------------------------------------------------------------------------------


def test_the_benchmarker_role_names_only_its_queues():
    import re

    topology = Topology("exp", 3)
    rules = role_permissions(topology, "benchmarker")
    assert re.fullmatch(rules.read, "exp.code-to-bench")
    assert not re.fullmatch(rules.read, "exp.rollout-batches")
    assert re.fullmatch(rules.write, "exp.bench-results.in")
    assert not re.fullmatch(rules.write, "exp.bench-results")  # the queue itself: no binds
    assert not re.fullmatch(rules.write, "exp.weight-updates")
    assert not re.fullmatch(rules.write, "amq.default")
    assert rules.configure == "^$"
    generator = role_permissions(topology, "generator")
    assert re.fullmatch(generator.configure, "exp.weight-updates.node7.cluster-123")
    assert not re.fullmatch(generator.configure, "exp.weight-updates.scheduler")
    assert not re.fullmatch(generator.configure, "exp.weight-updates.dlq")


def test_only_the_role_that_owns_a_queue_may_publish_into_it():
    users = {role: f"hpcrl-{role}" for role in ROLES}
    assert publisher_allowed(BENCH_RESULTS, "hpcrl-benchmarker", users) is None
    assert publisher_allowed(BENCH_RESULTS, "hpcrl-benchmarker.site-b", users) is None
    assert "only the benchmarker role" in publisher_allowed(BENCH_RESULTS, "hpcrl-generator", users)
    assert publisher_allowed(BENCH_RESULTS, "hpcrl-benchmarkerX", users) is not None
    assert "unauthenticated" in publisher_allowed(WEIGHT_UPDATES, None, users)
    assert publisher_allowed(WEIGHT_UPDATES, "hpcrl-learner", users) is None


# --- the real broker ---------------------------------------------------------------------


def test_a_benchmarkers_credentials_reach_only_its_own_queues(site: Site):
    t = site.topology
    ok = site.channel("benchmarker")
    ok.basic_get(t.name(CODE_TO_BENCH))  # its input
    ok.basic_publish(
        t.work_exchange(BENCH_RESULTS),
        t.name(BENCH_RESULTS),
        encode(sample_candidate()),
        mandatory=True,
    )  # its output
    method, _props, _body = site.channel(None).basic_get(t.name(BENCH_RESULTS), auto_ack=True)
    assert method is not None  # it arrived (and is gone again: later tests count dead letters)
    forbidden = {
        "read rollout batches": lambda ch: ch.basic_get(t.name(ROLLOUT_BATCHES)),
        "announce weights": lambda ch: ch.basic_publish(t.name(WEIGHT_UPDATES), "", b"x"),
        "publish via the default exchange": lambda ch: ch.basic_publish(
            "", t.name(BENCH_RESULTS), b"x"
        ),
        "publish generation requests": lambda ch: ch.basic_publish(
            t.work_exchange(GENERATE_REQUESTS), t.name(GENERATE_REQUESTS), b"x"
        ),
        "delete a queue": lambda ch: ch.queue_delete(t.name(ROLLOUT_BATCHES)),
        "delete its own input": lambda ch: ch.queue_delete(t.name(CODE_TO_BENCH)),
        "declare a queue": lambda ch: ch.queue_declare(f"{NAMESPACE}.spy"),
        "delete an exchange": lambda ch: ch.exchange_delete(t.work_exchange(BENCH_RESULTS)),
        "bind a queue": lambda ch: ch.queue_bind(
            t.name(BENCH_RESULTS), t.work_exchange(CODE_TO_BENCH)
        ),
    }
    failures = [
        what
        for what, action in forbidden.items()
        if not refused(lambda a=action: a(site.channel("benchmarker")))
    ]
    assert not failures, f"a benchmarker could: {failures}"
    depth = site.channel(None).queue_declare(t.dlq(BENCH_RESULTS), passive=True)
    assert depth.method.message_count == 0  # nothing it wrote landed anywhere else


def test_a_learners_credentials_cannot_read_results_or_requests(site: Site):
    t = site.topology
    for queue in (BENCH_RESULTS, GENERATE_REQUESTS, CODE_TO_BENCH):
        assert refused(lambda q=queue: site.channel("learner").basic_get(t.name(q)))
    assert refused(
        lambda: site.channel("generator").basic_publish(t.name(WEIGHT_UPDATES), "", b"x")
    )


def test_a_forged_user_id_is_refused_by_the_broker(site: Site):
    channel = site.channel(None)
    props = pika.BasicProperties(user_id=site.role_users["benchmarker"])
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as caught:
        channel.basic_publish(
            site.topology.work_exchange(BENCH_RESULTS),
            site.topology.name(BENCH_RESULTS),
            b"x",
            properties=props,
        )
    assert caught.value.reply_code == 406  # PRECONDITION_FAILED: user_id is not the user


def host() -> HostInfo:
    return HostInfo(
        hostname="n",
        cpu_model="c",
        isa=["avx512f"],
        cores=2,
        compiler="gcc",
        host_class="c",
        peak_gflops=500.0,
    )


def test_every_role_runs_with_only_its_own_permissions(site: Site):
    """The whole loop, each hop a Consumer with its role's user, topology checked not declared,
    publishers authenticated: request -> candidate -> result -> batch -> weight update."""
    t = site.topology
    seen: dict[str, list] = {"updates_generator": [], "updates_scheduler": [], "batches": []}

    def generate(request: GenerateRequest, _d) -> list[Publish]:
        candidate = Candidate(
            id=f"{request.id}/0",
            group_id=request.id,
            index=0,
            completion="void f(void) {}",
            bench=request.bench,
            rollout=sample_rollout(),
        )
        return [Publish(t.name(CODE_TO_BENCH), candidate)]

    def bench(candidate: Candidate, _d) -> list[Publish]:
        result = BenchResult(
            id=candidate.id,
            group_id=candidate.group_id,
            index=0,
            status="success",
            reward=12.0,
            gflops=12.0,
            bench=candidate.bench,
            host=host(),
            rollout=candidate.rollout,
        )
        return [Publish(t.name(BENCH_RESULTS), result)]

    def schedule(result: BenchResult, _d) -> list[Publish]:
        rollout = result.rollout
        assert rollout is not None
        sample = RolloutSample(
            candidate_id=result.id,
            completion_token_ids=rollout.completion_token_ids,
            sampling_logprobs=rollout.sampling_logprobs,
            policy_version=0,
            reward=result.reward,
            status=result.status,
        )
        batch = RolloutBatch(
            id=result.group_id,
            experiment="exp",
            iteration=0,
            prompt_token_ids=rollout.prompt_token_ids,
            samples=[sample],
            reward_mode="raw",
        )
        return [Publish(t.name(ROLLOUT_BATCHES), batch)]

    def learn(batch: RolloutBatch, _d) -> list[Publish]:
        seen["batches"].append(batch.id)
        update = WeightUpdate(
            id="v1",
            version=1,
            parent_version=0,
            uri="/ckpt/v1",
            format="full",
            checksum="sha256:" + "ab" * 32,
        )
        return [Publish("", update, exchange=t.name(WEIGHT_UPDATES), mandatory=False)]

    consumers = {role: Consumer(site.settings(role), f"role-{role}") for role in ROLES}
    consumers["generator"].subscribe(GENERATE_REQUESTS, generate)
    consumers["generator"].subscribe_fanout(
        WEIGHT_UPDATES,
        "node1.example.org-42",
        lambda m, _d: seen["updates_generator"].append(m.id) or [],
        durable=False,
    )
    consumers["benchmarker"].subscribe(CODE_TO_BENCH, bench)
    consumers["scheduler"].subscribe(BENCH_RESULTS, schedule)
    consumers["scheduler"].subscribe_fanout(
        WEIGHT_UPDATES,
        "scheduler",
        lambda m, _d: seen["updates_scheduler"].append(m.id) or [],
        durable=True,
    )
    consumers["learner"].subscribe(ROLLOUT_BATCHES, learn)
    running = [RunningConsumer(c) for c in consumers.values()]
    for each in running:
        each.__enter__()
    try:
        request = sample_request("r1")
        Publisher(site.settings("scheduler"), "role-scheduler-pub").publish(
            Publish(t.name(GENERATE_REQUESTS), request)
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
            seen["updates_generator"] and seen["updates_scheduler"]
        ):
            time.sleep(0.1)
    finally:
        for each in running:
            each.__exit__(None, None, None)
    assert seen == {
        "updates_generator": ["v1"],
        "updates_scheduler": ["v1"],
        "batches": [request.id],
    }
    admin = site.channel(None)
    for base in (GENERATE_REQUESTS, CODE_TO_BENCH, BENCH_RESULTS, ROLLOUT_BATCHES):
        assert admin.queue_declare(t.dlq(base), passive=True).method.message_count == 0


def test_a_message_from_the_wrong_role_is_dead_lettered(site: Site):
    """An administrator's (or any other role's) result is not a benchmarker's result."""
    t = site.topology
    handled: list = []
    consumer = Consumer(site.settings("scheduler"), "wrong-role")
    consumer.subscribe(BENCH_RESULTS, lambda m, _d: handled.append(m.id) or [])
    forged = BenchResult(
        id="g/0",
        group_id="g",
        index=0,
        status="success",
        reward=50.0,
        gflops=50.0,
        bench=BenchSpec(task="matmul", stage=1),
        host=host(),
    )
    admin = site.channel(None)
    admin.basic_publish(
        t.work_exchange(BENCH_RESULTS),
        t.name(BENCH_RESULTS),
        encode(forged),
        properties=pika.BasicProperties(user_id="guest"),
    )
    admin.basic_publish(t.work_exchange(BENCH_RESULTS), t.name(BENCH_RESULTS), encode(forged))
    dead: list = []
    publishers: list = []
    with RunningConsumer(consumer):
        deadline = time.monotonic() + 20
        while len(dead) < 2 and time.monotonic() < deadline:
            method, props, _body = admin.basic_get(t.dlq(BENCH_RESULTS), auto_ack=True)
            if method is None:
                time.sleep(0.1)
            else:
                dead.append(props.headers[REASON_HEADER])
                # Who dead-lettered it (broker-checked) and who had published it.
                assert props.user_id == site.role_users["scheduler"]
                publishers.append(props.headers.get(PUBLISHER_HEADER))
    assert handled == []
    assert len(dead) == 2
    assert "user 'guest' may not publish to bench-results" in dead[0]
    assert "unauthenticated publisher" in dead[1]
    assert publishers == ["guest", None]


def test_a_service_waits_for_the_topology_instead_of_declaring_it(site: Site):
    fresh = Site()
    fresh.vhost, fresh.topology = site.vhost, Topology("absent", 3)
    settings = site.settings("benchmarker").model_copy(update={"namespace": "absent"})
    consumer = Consumer(settings, "no-topology")
    consumer.subscribe(CODE_TO_BENCH, lambda m, _d: [])
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        assert not consumer.connected.wait(3)  # it cannot run without its queues ...
        assert thread.is_alive()  # ... but it waits for them instead of dying
        assert not consumer.healthy()[0]
    finally:
        consumer.stop()
        thread.join(10)


def test_the_admin_command_writes_definitions_rabbitmq_imports(tmp_path, rabbitmq):
    import sys

    tag = uuid.uuid4().hex[:8]
    vhost = f"hpcrl-admin-{tag}"
    config = tmp_path / "exp.toml"
    config.write_text(
        f'[broker]\nurl = "amqp://guest:guest@127.0.0.1:5672/{vhost}"\n'
        f'namespace = "e{tag}"\n[broker.role_users]\n'
        + "".join(f'{role} = "a{tag}-{role}"\n' for role in ROLES)
    )
    admin = [sys.executable, "-m", "hpcrl_common.admin"]
    out = tmp_path / "defs.json"
    done = subprocess.run(
        [
            *admin,
            "definitions",
            "--config",
            str(config),
            "--password-dir",
            str(tmp_path / "secrets"),
            "--out",
            str(out),
            "--extra-user",
            "benchmarker:site-b",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    users = {f"a{tag}-{role}" for role in ROLES} | {f"a{tag}-benchmarker.site-b"}
    for user in users:
        secret = tmp_path / "secrets" / f"{user}.password"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert secret.read_text().strip() not in out.read_text()  # only hashes go in
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    try:
        import_definitions(out.read_text())
        password = (tmp_path / "secrets" / f"a{tag}-benchmarker.site-b.password").read_text()
        params = pika.URLParameters(
            f"amqp://a{tag}-benchmarker.site-b:{password.strip()}@127.0.0.1:5672/{vhost}"
        )
        channel = pika.BlockingConnection(params).channel()
        channel.basic_get(f"e{tag}.code-to-bench")  # the site's benchmarker reads its queue
        assert refused(lambda: channel.basic_get(f"e{tag}.rollout-batches"))
        rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        declared = subprocess.run(
            [*admin, "declare", "--config", str(config)], capture_output=True, text=True
        )
        assert declared.returncode == 0, declared.stderr
        assert "guest:***@" in declared.stdout and "guest:guest" not in declared.stdout
    finally:
        for command in (["delete_vhost", vhost], *(["delete_user", user] for user in users)):
            subprocess.run(["rabbitmqctl", "-q", *command], capture_output=True)


def refused_with(action) -> int | None:
    """The reply code the broker closed the channel with (403 refused, 405 locked), or None."""
    try:
        action()
    except pika.exceptions.ChannelClosedByBroker as exc:
        return exc.reply_code
    return None


def test_no_role_keeps_delete_bind_or_dead_letter_rights_it_does_not_need(site: Site):
    """Issue 28's residual rights: a generator deleted another replica's update queue, the
    scheduler bound `weight-updates` into the generators' inbox, and any role could write into
    any dead-letter queue (which an operator replaying dead letters would re-inject)."""
    t = site.topology
    admin = site.channel(None)
    replica = Consumer(site.settings("generator"), "replica-a")
    replica.subscribe_fanout(WEIGHT_UPDATES, "replica-a", lambda m, _d: [], durable=False)
    scheduler = Consumer(site.settings("scheduler"), "sched")  # checks its queue, binds nothing
    scheduler.subscribe_fanout(WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER, lambda m, _d: [], durable=True)
    with RunningConsumer(replica), RunningConsumer(scheduler):
        queue = t.subscriber_queue(WEIGHT_UPDATES, "replica-a")
        # Another replica (same role, other connection): its queue is exclusive.
        assert refused_with(lambda: site.channel("generator").queue_delete(queue)) == 405
        assert refused_with(lambda: site.channel("generator").queue_purge(queue)) == 405
        assert replica.connected.is_set() and replica.healthy()[0]  # still consuming
    forbidden = {
        ("scheduler", "bind weight-updates into the generators' inbox"): lambda ch: (
            ch.exchange_bind(t.work_exchange(GENERATE_REQUESTS), t.name(WEIGHT_UPDATES))
        ),
        ("scheduler", "bind weight-updates into the learner's inbox"): lambda ch: ch.exchange_bind(
            t.work_exchange(ROLLOUT_BATCHES), t.name(WEIGHT_UPDATES)
        ),
        ("scheduler", "delete its update queue"): lambda ch: ch.queue_delete(
            t.subscriber_queue(WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER)
        ),
        ("generator", "delete the update dead letters' inbox"): lambda ch: ch.exchange_delete(
            t.dead_letter_inbox(WEIGHT_UPDATES)
        ),
        ("generator", "bind the update DLQ"): lambda ch: ch.queue_bind(
            t.dlq(WEIGHT_UPDATES), t.name(WEIGHT_UPDATES)
        ),
    }
    for role in ROLES:  # no role writes to the broker's own dead-letter path ...
        forbidden[(role, "publish to the dead-letter exchange")] = lambda ch: ch.basic_publish(
            t.dead_letter_exchange, t.name(ROLLOUT_BATCHES), b"x"
        )
    for role, base in (
        ("benchmarker", ROLLOUT_BATCHES),
        ("learner", BENCH_RESULTS),
        ("generator", ROLLOUT_BATCHES),
        ("scheduler", CODE_TO_BENCH),
    ):
        # ... nor into the dead-letter queue of a queue it does not consume.
        forbidden[(role, f"dead-letter into {base}.dlq")] = lambda ch, b=base: ch.basic_publish(
            t.dead_letter_inbox(b), t.name(b), b"x"
        )
    failures = [
        f"{role}: {what}"
        for (role, what), action in forbidden.items()
        if refused_with(lambda r=role, a=action: a(site.channel(r))) != 403
    ]
    assert not failures, f"still allowed: {failures}"
    # What each role keeps: dead letters of its own input, through that queue's inbox.
    site.channel("benchmarker").basic_publish(
        t.dead_letter_inbox(CODE_TO_BENCH), t.name(CODE_TO_BENCH), b"bad", mandatory=True
    )
    method, _props, body = admin.basic_get(t.dlq(CODE_TO_BENCH), auto_ack=True)
    assert method is not None and body == b"bad"
    for base in (GENERATE_REQUESTS, BENCH_RESULTS, ROLLOUT_BATCHES, WEIGHT_UPDATES):
        assert admin.queue_declare(t.dlq(base), passive=True).method.message_count == 0


def test_a_generators_binding_of_weight_updates_delivers_nothing(site: Site):
    """A generator reads `weight-updates` to bind its replica queue, and may write to the
    candidates' inbox, so RabbitMQ lets it bind the one into the other; nothing flows: the
    learner publishes with routing key "" and the inbox routes only its queue's name."""
    t = site.topology
    generator = site.channel("generator")
    generator.exchange_bind(t.work_exchange(CODE_TO_BENCH), t.name(WEIGHT_UPDATES))
    try:
        update = WeightUpdate(
            id="v9",
            version=9,
            parent_version=8,
            uri="/ckpt/v9",
            format="full",
            checksum="sha256:" + "ab" * 32,
        )
        Publisher(site.settings("learner"), "learner-pub").publish(
            Publish("", update, exchange=t.name(WEIGHT_UPDATES), mandatory=False)
        )
        time.sleep(0.5)
        admin = site.channel(None)
        assert admin.queue_declare(t.name(CODE_TO_BENCH), passive=True).method.message_count == 0
    finally:
        generator.exchange_unbind(t.work_exchange(CODE_TO_BENCH), t.name(WEIGHT_UPDATES))


def test_read_rights_include_purge(site: Site):
    """What permissions cannot withhold (documented in hpcrl_common.access): RabbitMQ checks
    queue.purge against *read*, like consuming, so a consumer may purge its own input."""
    t = site.topology
    assert (
        refused_with(lambda: site.channel("benchmarker").queue_purge(t.name(CODE_TO_BENCH))) is None
    )
    assert (
        refused_with(lambda: site.channel("benchmarker").queue_purge(t.name(BENCH_RESULTS))) == 403
    )
