"""Two clients' credentials against a real replica that authenticates publishers: each gets
its own verdicts only, and may do nothing else on the broker."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pika
import pika.exceptions
import pytest

from hpcrl_common.access import ROLES, definitions
from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import BenchResult, BenchSpec, RewardRequest, decode, encode
from hpcrl_common.topology import (
    BENCH_RESULTS,
    CODE_TO_BENCH,
    REWARD_REQUESTS,
    Topology,
)
from hpcrl_reward_client import RewardClient, RewardRequestSpec
from tests.benchmarker.conftest import ALLOW_ISA
from tests.benchmarker.test_service import stop_replica
from tests.common.test_access import import_definitions, rabbitmqctl

pytestmark = pytest.mark.broker


class ClientSite:
    """A vhost with the topology, one user per role and two client users, alice and bob."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:8]
        self.vhost = f"hpcrl-rc-{tag}"
        self.role_users = {**{role: f"t{tag}-{role}" for role in ROLES}, "client": f"t{tag}-client"}
        self.alice, self.bob = f"t{tag}-client.alice", f"t{tag}-client.bob"
        self.roles = {
            **{user: role for role, user in self.role_users.items() if role != "client"},
            self.alice: "client",
            self.bob: "client",
        }
        self.passwords = {user: uuid.uuid4().hex for user in self.roles}
        self.topology = Topology("exp", 3)

    def url(self, user: str | None) -> str:
        creds = "guest:guest" if user is None else f"{user}:{self.passwords[user]}"
        return f"amqp://{creds}@127.0.0.1:5672/{quote(self.vhost, safe='')}"

    def settings(self, user: str) -> BrokerSettings:
        return BrokerSettings(
            url=self.url(user),
            namespace="exp",
            delivery_limit=3,
            heartbeat_s=5,
            reconnect_initial_s=0.2,
            reconnect_max_s=1.0,
            declare_topology=False,
            authenticate_publishers=True,
            role_users=self.role_users,
        )

    def create(self) -> None:
        users = {user: (role, self.passwords[user]) for user, role in self.roles.items()}
        import_definitions(json.dumps(definitions(self.topology, self.vhost, users)))
        rabbitmqctl("set_permissions", "-p", self.vhost, "guest", ".*", ".*", ".*")

    def remove(self) -> None:
        rabbitmqctl("delete_vhost", self.vhost)
        for user in self.roles:
            rabbitmqctl("delete_user", user)

    def channel(self, user: str | None) -> pika.adapters.blocking_connection.BlockingChannel:
        params = pika.URLParameters(self.url(user))
        params.connection_attempts = 1
        channel = pika.BlockingConnection(params).channel()
        channel.confirm_delivery()
        return channel


@pytest.fixture
def site(rabbitmq: str) -> Iterator[ClientSite]:
    site = ClientSite()
    site.create()
    yield site
    site.remove()


@pytest.fixture
def replica(site: ClientSite, tmp_path: Path) -> Iterator[subprocess.Popen]:
    """A replica with the benchmarker role's user, checking publishers."""
    config = tmp_path / "bench.toml"
    users = "".join(f'{role} = "{user}"\n' for role, user in site.role_users.items())
    config.write_text(f"""
[broker]
url = "{site.url(site.role_users["benchmarker"])}"
namespace = "exp"
delivery_limit = 3
heartbeat_s = 5
declare_topology = false
authenticate_publishers = true

[broker.role_users]
{users}
[benchmarker]
metrics_port = 0
concurrency = 2
work_dir = "{tmp_path / "work"}"
lock_path = "{tmp_path / "timing.lock"}"
""")
    args = [sys.executable, "-m", "hpcrl_benchmarker.cli", "serve", "--config", str(config)]
    for isa in ALLOW_ISA:
        args += ["--allow-isa", isa]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    yield proc
    stop_replica(proc)


def refused(action) -> bool:
    try:
        action()
    except pika.exceptions.ChannelClosedByBroker as exc:
        return exc.reply_code == 403
    return False


def get_one(channel, queue: str, timeout: float) -> bytes | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        method, _props, body = channel.basic_get(queue, auto_ack=True)
        if method is not None:
            return body
        time.sleep(0.2)
    return None


def request(client: str = "", task: str = "matmul") -> RewardRequest:
    group = uuid.uuid4().hex
    return RewardRequest(
        id=f"{group}/0",
        group_id=group,
        index=0,
        completion="no code",
        bench=BenchSpec(task=task, stage=6),
        client=client,
    )


def test_each_client_gets_only_its_own_verdicts_and_nothing_else(
    site: ClientSite, replica: subprocess.Popen
):
    t = site.topology
    with RewardClient(site.settings(site.bob), timeout_s=120) as bob:
        assert bob.reply_queue == t.reply_queue(site.bob)
        [verdict] = bob.score([RewardRequestSpec("no code")])
    assert verdict.status == "format_violation" and verdict.benchmarker.startswith("benchmarker-")
    # Alice names bob's queue in the request: the replica answers the broker-verified user.
    alice = site.channel(site.alice)
    forged = request(client=site.bob)
    alice.basic_publish(
        t.work_exchange(REWARD_REQUESTS),
        t.name(REWARD_REQUESTS),
        encode(forged),
        properties=pika.BasicProperties(user_id=site.alice),
        mandatory=True,
    )
    body = get_one(alice, t.reply_queue(site.alice), timeout=60)
    assert body is not None and decode(body, BenchResult).id == forged.id
    admin = site.channel(None)
    assert admin.queue_declare(t.reply_queue(site.bob), passive=True).method.message_count == 0
    # A request naming no task the replica knows runs nothing: dead-lettered, no verdict.
    alien = request(task="/etc/passwd")
    alice.basic_publish(
        t.work_exchange(REWARD_REQUESTS),
        t.name(REWARD_REQUESTS),
        encode(alien),
        properties=pika.BasicProperties(user_id=site.alice),
        mandatory=True,
    )
    body = get_one(admin, t.dlq(REWARD_REQUESTS), timeout=60)
    assert body is not None and decode(body, RewardRequest).id == alien.id
    assert get_one(alice, t.reply_queue(site.alice), timeout=1) is None
    # What alice's credentials cannot do.
    forbidden = {
        "read bob's verdicts": lambda ch: ch.basic_get(t.reply_queue(site.bob)),
        "purge bob's verdicts": lambda ch: ch.queue_purge(t.reply_queue(site.bob)),
        "read the scheduler's results": lambda ch: ch.basic_get(t.name(BENCH_RESULTS)),
        "read the requests": lambda ch: ch.basic_get(t.name(REWARD_REQUESTS)),
        "forge a verdict": lambda ch: ch.basic_publish(
            t.reward_verdicts_exchange, t.reply_queue(site.bob), b"x"
        ),
        "send a candidate": lambda ch: ch.basic_publish(
            t.work_exchange(CODE_TO_BENCH), t.name(CODE_TO_BENCH), b"x"
        ),
        "publish a result": lambda ch: ch.basic_publish(
            t.work_exchange(BENCH_RESULTS), t.name(BENCH_RESULTS), b"x"
        ),
        "bind the verdicts into her queue": lambda ch: ch.queue_bind(
            t.reply_queue(site.alice),
            t.reward_verdicts_exchange,
            routing_key=t.reply_queue(site.bob),
        ),
        "declare a queue": lambda ch: ch.queue_declare("exp.reward-verdicts.spy"),
        "delete bob's queue": lambda ch: ch.queue_delete(t.reply_queue(site.bob)),
        "use the default exchange": lambda ch: ch.basic_publish("", t.reply_queue(site.bob), b"x"),
    }
    failures = [
        what
        for what, action in forbidden.items()
        if not refused(lambda a=action: a(site.channel(site.alice)))
    ]
    assert not failures, f"a client could: {failures}"
    # A service's user is not a client: the broker refuses its request.
    generator = site.channel(site.role_users["generator"])
    assert refused(
        lambda: generator.basic_publish(
            t.work_exchange(REWARD_REQUESTS), t.name(REWARD_REQUESTS), b"x"
        )
    )
    assert replica.poll() is None
