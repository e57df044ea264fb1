"""Issue 28's forgery drill: every forgery of the issue's table, sent by a hostile holder of each
role's legitimate broker credential into a running fleet, with publisher authentication on
and off.

The four real services run as in the kill drills (``tests.support.fleet``: ``hpcrl-<service>
serve`` subprocesses, the tiny random policy, the transformers generator), but each with its
own role's broker user, on a vhost of its own whose users, permissions and topology come from
``hpcrl_common.access.definitions`` (``tests.reward_client.test_access.ClientSite``: the four
roles and two reward clients, alice and bob); the services only check the topology
(``broker.declare_topology = false``) and, in the ``auth-on`` run, accept a message only from a
role that may publish it (``broker.authenticate_publishers``). The test reads the broker as
the administrator (guest) and the scheduler's SQLite, the checkpoint store, /metrics and
/healthz, never logs.

Each phase is a test of its own (in order, on the one fleet of its parametrization):

1. *residual rights*, each role on the broker: no delete of another replica's queue (it is
   exclusive: RESOURCE_LOCKED), no bind of ``weight-updates`` into another role's inbox, no
   write into the dead-letter exchange or another queue's dead letters, no candidate
   commitment but the generator's (ACCESS_REFUSED); what
   RabbitMQ cannot withhold (``hpcrl_common.access``): a purge of its own input (done with
   every service frozen and nothing ready, so that it takes nothing), a generator's bind of
   ``weight-updates`` into ``code-to-bench.in`` (kept for the whole run: it must deliver
   nothing), a write into its own input's dead letters;
2. *learner* (and guest): version 2**31-1 of the pinned run, announced by the learner's user
   and by the administrator's; ``groups_trained = -1e12`` under the id ``v2``; "v3" before
   the learner committed v3;
3. *scheduler*: a batch of 8 x 8,003-token sequences at +-1e6 reward, and each bound alone;
4. *client* (reward client alice naming bob's queue): the one forgery that only publisher
   authentication stops; without it the verdict goes to bob, as documented;
5. *benchmarker*: with the replica frozen holding a whole group, a success of 5,000 GFLOPS
   claiming a peak of 1e6 for the real host's class, one under the peak (0.9 x, no token
   data) that does not reproduce, and one with an honest figure whose rollout is not the
   candidate's (40 x token 66): not what the generator committed to, so dead-lettered;
6. *benchmarker*, on the next group: a success under the peak without its source (and
   without token data): it cannot be measured again, so it is dropped
   (``scheduler.confirm_without_source``);
7. *benchmarker*, on the next group: a correct kernel's source from elsewhere, with an
   honest figure, reported for one of the group's candidates (a text of the tiny policy that
   holds no kernel) with that candidate's genuine tokens and the hash of its genuine text:
   everything the commitment checks is right, and the success is the group's winner. Its
   second measurement compiles the generator's committed text, not the reported source, so
   it is a disagreement (the host suspect) and the candidate's tokens are not trained at the
   top reward. The candidates are read off a tap queue the administrator binds to
   ``code-to-bench``'s inbox, as the forging replica would have them;
8. *generator*: with the generator frozen holding a request, the text of a correct kernel
   with token ids ``[66] * 40``, and the generator's commitment to it (the credential may
   commit to what it sends); its winner is confirmed from that committed text;
9. phase 5's foreign rollout was not trained: the group went to the learner with the
   genuine candidate's tokens in its place;
10. *the run carried on*: the experiment finished, genuine versions loaded, nothing lost;
    the dead-letter queues hold exactly the forgeries, each with its reason;
11. phase 8's refused batch and phase 3's forged ones count as done (dropped) for the
    scheduler's pacing: the learner reports them with its next version.

Differences from the kill drills' settings, through the environment: ``scheduler.
max_staleness = 2`` (lockstep with one step of slack: a batch the learner refuses is reported
done only with its next version, phase 11, and under ``max_staleness = 1`` the learner would
wait for a group that the scheduler holds back until then), and
``ratio_deepen = ratio_improve = 0`` (the forged kernels' successes are not expanded, so every
iteration is one group, as in the kill drills, and the learner's steps come out even).
"""

from __future__ import annotations

import dataclasses
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pika
import pytest

from hpcrl_common.access import ROLES, SCHEDULER_SUBSCRIBER
from hpcrl_common.broker import Publish, Publisher
from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import (
    BenchResult,
    BenchSpec,
    Candidate,
    CandidateCommitment,
    GenerateRequest,
    HostInfo,
    PackedArray,
    RewardRequest,
    RolloutBatch,
    RolloutData,
    RolloutSample,
    WeightUpdate,
    decode,
    encode,
    text_sha256,
)
from hpcrl_common.task import builtin_seed
from hpcrl_common.topology import (
    BENCH_RESULTS,
    CANDIDATE_COMMITMENTS,
    CODE_TO_BENCH,
    CONSUMER_HEADER,
    GENERATE_REQUESTS,
    REASON_HEADER,
    REWARD_REQUESTS,
    ROLLOUT_BATCHES,
    WEIGHT_UPDATES,
    WORK_QUEUES,
    Topology,
)
from tests.common.test_access import refused_with
from tests.reward_client.test_access import ClientSite
from tests.support.fleet import (
    EXPERIMENT,
    GROUP_SIZE,
    GROUPS_PER_STEP,
    SERVICES,
    Fleet,
    Proc,
    stop_all,
    system_rabbitmqctl,
    wait_done,
    wait_for,
)

pytestmark = [pytest.mark.broker, pytest.mark.slow]

# One group per iteration (four phases take one each, and groups pass while the test checks
# between them); the generator's forged group is refused by the learner, so the other
# ITERATIONS - 1 make whole steps.
ITERATIONS = 13
FINAL_VERSION = (ITERATIONS - 1) // GROUPS_PER_STEP
EARLY_VERSION = 3  # announced while the learner is at v1
NAMESPACE = "exp"  # ClientSite's topology
FORGED_REPLICA = "benchmarker-forged"
KERNEL = builtin_seed("matmul")  # correct: the SQD seed
KERNEL_TEXT = f"```c\n{KERNEL}\n```\n"
TOKENS_66 = [66] * 40
ENV = {
    "HPCRL__SCHEDULER__MAX_STALENESS": "2",
    "HPCRL__SCHEDULER__RATIO_DEEPEN": "0",
    "HPCRL__SCHEDULER__RATIO_IMPROVE": "0",
}
DEAD_LETTER_BASES = (*WORK_QUEUES, WEIGHT_UPDATES)


@dataclasses.dataclass
class Dead:
    base: str
    message_id: str | None
    reason: str
    consumer: str


@dataclasses.dataclass
class Expected:
    """A forgery's dead letters: ``count`` of them in ``base``'s DLQ, each reason holding one
    of ``reasons`` (every text of a tuple)."""

    base: str
    message_id: str
    count: int
    reasons: list[tuple[str, ...]]
    phase: str


@dataclasses.dataclass
class Drill:
    auth: bool
    site: ClientSite
    fleet: Fleet
    procs: dict[str, Proc]
    started: float
    dead: list[Dead] = dataclasses.field(default_factory=list)
    expected: list[Expected] = dataclasses.field(default_factory=list)
    refused_batches: set[str] = dataclasses.field(default_factory=set)
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def t(self) -> Topology:
        return self.fleet.topology

    def user(self, role: str) -> str:
        return self.site.role_users[role]

    def settings(self, user: str | None) -> BrokerSettings:
        return self.fleet.settings.model_copy(update={"url": self.site.url(user)})

    def publisher(self, role: str) -> Publisher:
        """A confirming publisher with the role's own user (its user_id set, as the services
        set theirs)."""
        return Publisher(self.settings(self.user(role)), f"forger-{role}")

    def raw(self, role: str, exchange: str, routing_key: str, body: bytes, message_id: str) -> None:
        """Publish a body no schema would let us build, as ``role``."""
        user = self.user(role)
        channel = self.site.channel(user)
        try:
            channel.basic_publish(
                exchange,
                routing_key,
                body,
                mandatory=True,
                properties=pika.BasicProperties(
                    user_id=user, message_id=message_id, delivery_mode=pika.DeliveryMode.Persistent
                ),
            )
        finally:
            channel.connection.close()

    def expect(
        self, base: str, message_id: str, count: int, phase: str, *reasons: tuple[str, ...]
    ) -> None:
        self.expected.append(Expected(base, message_id, count, list(reasons), phase))

    def drain(self) -> list[Dead]:
        """Move everything in the dead-letter queues into ``dead``; what was new."""
        new = []
        with self.fleet.channel() as channel:
            for base in DEAD_LETTER_BASES:
                while True:
                    method, props, _body = channel.basic_get(self.t.dlq(base), auto_ack=True)
                    if method is None:
                        break
                    headers = props.headers or {}
                    new.append(
                        Dead(
                            base,
                            props.message_id,
                            str(headers.get(REASON_HEADER, "")),
                            str(headers.get(CONSUMER_HEADER, "")),
                        )
                    )
        self.dead += new
        return new

    def dead_of(self, base: str, message_id: str) -> list[Dead]:
        return [d for d in self.dead if d.base == base and d.message_id == message_id]

    def await_dead(
        self,
        base: str,
        message_id: str,
        count: int,
        timeout: float = 60.0,
    ) -> list[Dead]:
        def arrived() -> list[Dead] | None:
            self.fleet.check_alive()
            self.drain()
            found = self.dead_of(base, message_id)
            return found if len(found) >= count else None

        return wait_for(
            arrived,
            timeout,
            f"{count} dead letter(s) of {message_id} in {base}.dlq",
            lambda: (self.dead, self.fleet.tails()),
            every=0.2,
        )

    def freeze(self, *services: str) -> None:
        for service in services:
            self.fleet.freeze(self.procs[service])

    def thaw(self, *services: str) -> None:
        for service in services:
            proc = self.procs[service]
            if proc.frozen:
                self.fleet.thaw(proc)

    def lap(self, name: str) -> None:
        self.timings[name] = round(time.monotonic() - self.started, 1)


def vhost_ctl(vhost: str) -> Callable[..., str]:
    """The fleet's rabbitmqctl: queues listed in the drill's vhost (channels are global)."""

    def ctl(*args: str) -> str:
        if "list_queues" in args:
            args = ("-p", vhost, *args)
        return system_rabbitmqctl(*args)

    return ctl


@pytest.fixture(scope="class", params=[True, False], ids=["auth-on", "auth-off"])
def drill(request, rabbitmq: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Drill]:
    auth: bool = request.param
    site = ClientSite()
    site.create()
    started = time.monotonic()
    root = tmp_path_factory.mktemp(f"forgery-{'on' if auth else 'off'}")
    settings = BrokerSettings(
        url=site.url(None),
        namespace=NAMESPACE,
        delivery_limit=3,
        declare_topology=False,
        authenticate_publishers=auth,
        role_users=site.role_users,
        heartbeat_s=30,
        reconnect_initial_s=0.2,
        reconnect_max_s=2.0,
    )
    fleet = Fleet(
        root,
        settings,
        iterations=ITERATIONS,
        rabbitmqctl=vhost_ctl(site.vhost),
        service_urls={s: site.url(site.role_users[s]) for s in SERVICES},
        env=ENV,
    )
    try:
        procs = {service: fleet.start(service) for service in SERVICES}
        for proc in procs.values():
            fleet.wait_healthy(proc)
        drill = Drill(auth, site, fleet, procs, started)
        drill.lap("healthy")
        yield drill
        print(
            f"\nforgery drill, publisher authentication {'on' if auth else 'off'}: "
            f"timings (s since start) {drill.timings}"
        )
    finally:
        for proc in fleet.procs:
            if proc.frozen:
                fleet.signal(proc, signal.SIGCONT)
        fleet.close()
        site.remove()


def latest_group(fleet: Fleet):
    groups = fleet.groups()
    return groups[-1] if groups else None


def wait_closed(drill: Drill, group_id: str, timeout: float = 120.0) -> None:
    def closed() -> bool:
        drill.fleet.check_alive()
        group = drill.fleet.store.group(group_id)
        return group is not None and group.state == "closed"

    wait_for(
        closed,
        timeout,
        f"group {group_id} to close",
        lambda: (drill.fleet.health(drill.procs["scheduler"]), drill.fleet.tails()),
        every=0.2,
    )


def next_group(drill: Drill, after: str, timeout: float = 120.0):
    def published():
        drill.fleet.check_alive()
        groups = drill.fleet.groups()
        # By iteration and ordinal: as text, "….t10.g0000" sorts before "….t9.g0000".
        last = next((g.iteration, g.ordinal) for g in groups if g.id == after)
        return next(
            (g for g in groups if (g.iteration, g.ordinal) > last and g.state != "pending"),
            None,
        )

    return wait_for(published, timeout, f"a group after {after}", drill.fleet.tails, every=0.2)


def request_of(fleet: Fleet, group_id: str) -> GenerateRequest:
    return next(
        r
        for r in (decode(b, GenerateRequest) for b in fleet.outbox_bodies(GENERATE_REQUESTS))
        if r.id == group_id
    )


def batch_of(fleet: Fleet, group_id: str) -> RolloutBatch | None:
    return next(
        (
            b
            for b in (decode(body, RolloutBatch) for body in fleet.outbox_bodies(ROLLOUT_BATCHES))
            if b.id == group_id
        ),
        None,
    )


def freeze_benchmarker_holding_a_group(drill: Drill) -> Any:
    """The benchmarker frozen once it holds every candidate of the next group, none judged."""
    fleet = drill.fleet
    return freeze_for_next_group(
        drill,
        "benchmarker",
        lambda g, held: (
            held >= GROUP_SIZE
            and fleet.store.count_results(g.id) == 0
            and fleet.ready(CODE_TO_BENCH) == 0
        ),
        "every candidate",
    )


def freeze_for_next_group(
    drill: Drill, service: str, holds: Callable[[Any, int], bool], what: str
) -> Any:
    """Freeze ``service`` between two groups; the next group, once the frozen service holds
    (unacked) what ``holds(group, held)`` asks for."""
    fleet = drill.fleet
    current = latest_group(fleet)
    wait_closed(drill, current.id)
    assert current.iteration < ITERATIONS - 1, "the run ended before this phase"
    drill.freeze(service)
    target = next_group(drill, current.id)

    def holding() -> bool:
        fleet.check_alive()
        return holds(target, fleet.held_by(drill.procs[service]))

    wait_for(
        holding,
        120,
        f"the frozen {service} to hold {what} of {target.id}",
        lambda: (fleet.held_by(drill.procs[service]), fleet.tails()),
        every=0.3,
    )
    return target


def tokenizer(fleet: Fleet):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(fleet.policy))


# --- the phases --------------------------------------------------------------------------------


@pytest.mark.usefixtures("drill")
class TestForgeryDrill:
    def test_1_residual_rights(self, drill: Drill):
        t, fleet, site = drill.t, drill.fleet, drill.site
        replica_queue = next(
            q
            for q in fleet.queue_names()
            if q.startswith(t.name(WEIGHT_UPDATES) + ".")
            and q != t.subscriber_queue(WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER)
            and q != t.dlq(WEIGHT_UPDATES)
        )

        def as_(role: str, action: Callable[[Any], Any]) -> int | None:
            channel = site.channel(drill.user(role))
            try:
                return refused_with(lambda: action(channel))
            finally:
                if channel.connection.is_open:
                    channel.connection.close()

        # Another generator replica's update queue (the running one's): exclusive.
        codes = {
            "generator: delete another replica's update queue": as_(
                "generator", lambda ch: ch.queue_delete(replica_queue)
            ),
            "generator: purge another replica's update queue": as_(
                "generator", lambda ch: ch.queue_purge(replica_queue)
            ),
        }
        assert codes == dict.fromkeys(codes, 405), codes  # RESOURCE_LOCKED
        refused = {
            ("scheduler", "bind weight-updates into the generators' inbox"): lambda ch: (
                ch.exchange_bind(t.work_exchange(GENERATE_REQUESTS), t.name(WEIGHT_UPDATES))
            ),
            ("scheduler", "bind weight-updates into the learner's inbox"): lambda ch: (
                ch.exchange_bind(t.work_exchange(ROLLOUT_BATCHES), t.name(WEIGHT_UPDATES))
            ),
            ("generator", "bind weight-updates into the learner's inbox"): lambda ch: (
                ch.exchange_bind(t.work_exchange(ROLLOUT_BATCHES), t.name(WEIGHT_UPDATES))
            ),
            ("generator", "delete the update dead letters' inbox"): lambda ch: ch.exchange_delete(
                t.dead_letter_inbox(WEIGHT_UPDATES)
            ),
            ("scheduler", "delete its update queue"): lambda ch: ch.queue_delete(
                t.subscriber_queue(WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER)
            ),
        }
        consumed = {
            "scheduler": [BENCH_RESULTS],
            "generator": [GENERATE_REQUESTS],
            "benchmarker": [CODE_TO_BENCH],
            "learner": [ROLLOUT_BATCHES],
        }
        for role in ROLES:
            refused[(role, "publish to the dead-letter exchange")] = lambda ch: ch.basic_publish(
                t.dead_letter_exchange, t.name(ROLLOUT_BATCHES), b"x"
            )
            for base in WORK_QUEUES:
                if base not in consumed[role] and base in (
                    GENERATE_REQUESTS,
                    CODE_TO_BENCH,
                    BENCH_RESULTS,
                    ROLLOUT_BATCHES,
                ):
                    refused[(role, f"write into {base}.dlq")] = lambda ch, b=base: ch.basic_publish(
                        t.dead_letter_inbox(b), t.name(b), b"x"
                    )
                    refused[(role, f"purge {base}")] = lambda ch, b=base: ch.queue_purge(t.name(b))
        # Only the generator commits to candidates; only the scheduler reads commitments.
        for role in ROLES:
            if role != "generator":
                refused[(role, "write a candidate commitment")] = lambda ch: ch.basic_publish(
                    t.work_exchange(CANDIDATE_COMMITMENTS), t.name(CANDIDATE_COMMITMENTS), b"x"
                )
            if role != "scheduler":
                refused[(role, "purge candidate-commitments")] = lambda ch: ch.queue_purge(
                    t.name(CANDIDATE_COMMITMENTS)
                )
        codes = {f"{role}: {what}": as_(role, action) for (role, what), action in refused.items()}
        assert {what for what, code in codes.items() if code != 403} == set(), codes

        # What stays, as documented (hpcrl_common.access; README, Security). A generator may
        # bind weight-updates into the candidates' inbox: kept bound for the whole run, it
        # must deliver nothing (announcements have routing key "", the inbox routes only
        # its queue's name): phase 10 finds no update in code-to-bench or its dead letters.
        assert (
            as_(
                "generator",
                lambda ch: ch.exchange_bind(t.work_exchange(CODE_TO_BENCH), t.name(WEIGHT_UPDATES)),
            )
            is None
        )
        # A role writes into the dead letters of its own input (its consumer's path).
        assert (
            as_(
                "benchmarker",
                lambda ch: ch.basic_publish(
                    t.dead_letter_inbox(CODE_TO_BENCH),
                    t.name(CODE_TO_BENCH),
                    b"hostile",
                    properties=pika.BasicProperties(message_id="hostile-dead-letter"),
                    mandatory=True,
                ),
            )
            is None
        )
        drill.expect(CODE_TO_BENCH, "hostile-dead-letter", 1, "rights", ("",))
        # A role may purge its own input: RabbitMQ checks queue.purge against the read
        # right that consuming needs. Done with every service frozen and nothing ready (the
        # consumers' prefetch holds what was queued), so it takes nothing from the run.
        own = {
            "scheduler": [
                t.name(BENCH_RESULTS),
                t.name(CANDIDATE_COMMITMENTS),
                t.subscriber_queue(WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER),
            ],
            "generator": [t.name(GENERATE_REQUESTS)],
            "benchmarker": [t.name(CODE_TO_BENCH)],
            "learner": [t.name(ROLLOUT_BATCHES)],
        }
        drill.freeze(*SERVICES)
        try:
            time.sleep(0.5)  # what a process had written before its stop reaches the broker

            def nothing_ready() -> bool:
                with fleet.channel() as channel:
                    return all(fleet.depth(channel, q) == 0 for qs in own.values() for q in qs)

            wait_for(nothing_ready, 30, "nothing ready in the services' inputs", every=0.3)
            purged = {}
            for role, queues in own.items():
                for queue in queues:
                    channel = site.channel(drill.user(role))
                    try:
                        purged[f"{role}: {queue}"] = channel.queue_purge(queue).method.message_count
                    finally:
                        channel.connection.close()
        finally:
            drill.thaw(*SERVICES)
        assert purged == dict.fromkeys(purged, 0), purged
        drill.lap("rights")

    def test_2_learner_forgeries(self, drill: Drill):
        """Version 2**31-1 of the pinned run (learner's user, and the administrator's),
        ``groups_trained = -1e12`` under the genuine v2's id, "v3" before v3 exists."""
        t, fleet = drill.t, drill.fleet
        wait_for(
            lambda: fleet.check_alive() or fleet.learner_version() >= 1,
            120,
            "the learner's v1",
            fleet.tails,
            every=0.3,
        )
        store = fleet.checkpoint_store()
        v1 = store.get(1)
        run = f"{EXPERIMENT}/{store.run_id}"
        genuine = v1.weight_update(store.root, run=run)
        assert fleet.learner_version() < EARLY_VERSION, "too late for the early announcement"

        def forged(version: int, parent: int) -> WeightUpdate:
            return genuine.model_copy(
                update={"id": f"v{version}", "version": version, "parent_version": parent}
            )

        top = forged(2**31 - 1, 1)
        by_admin = forged(2**31 - 2, 1)
        early = forged(EARLY_VERSION, EARLY_VERSION - 1)
        with drill.publisher("learner") as publisher:
            for update in (top, early):
                publisher.publish(
                    Publish(t.name(WEIGHT_UPDATES), update, exchange=t.name(WEIGHT_UPDATES))
                )
        with Publisher(drill.settings(None), "forger-admin") as publisher:
            publisher.publish(
                Publish(t.name(WEIGHT_UPDATES), by_admin, exchange=t.name(WEIGHT_UPDATES))
            )
        # As weight-update/2 (a typed field) and as weight-update/1 (a float in metrics,
        # the issue's): both under the id of the genuine v2, which must still be taken.
        negative = msgpack.unpackb(encode(forged(2, 1)))
        negative["groups_trained"] = -(10**12)
        legacy = {
            **negative,
            "schema": "weight-update/1",
            "metrics": {"groups_trained": -1e12, "groups_per_step": 2.0},
        }
        for field in ("groups_trained", "groups_dropped", "groups_per_step"):
            legacy.pop(field, None)
        for body in (negative, legacy):
            drill.raw("learner", t.name(WEIGHT_UPDATES), "", msgpack.packb(body), "v2")

        # Both subscribers (the scheduler and the generator replica) refuse each one.
        not_in_store = ("refused (not_in_store)", "is not in the manifest")
        for update in (top, early):
            drill.await_dead(WEIGHT_UPDATES, update.id, 2)
            drill.expect(WEIGHT_UPDATES, update.id, 2, "learner", not_in_store)
        drill.await_dead(WEIGHT_UPDATES, by_admin.id, 2)
        admin_refused = (
            (f"user 'guest' may not publish to {WEIGHT_UPDATES}",) if drill.auth else not_in_store
        )
        drill.expect(WEIGHT_UPDATES, by_admin.id, 2, "learner (guest)", admin_refused)
        drill.await_dead(WEIGHT_UPDATES, "v2", 4)
        drill.expect(
            WEIGHT_UPDATES, "v2", 4, "learner", ("groups_trained", "greater than or equal to 0")
        )
        for expected in drill.expected[-4:]:
            check_reasons(drill, expected)

        # The floor never above what the store holds; pacing not held by the figures.
        floor = int(fleet.store.get("policy_version", 0))
        assert floor <= fleet.learner_version() < EARLY_VERSION
        assert int(fleet.store.get("groups_trained", 0)) >= 0
        healthy = fleet.health(drill.procs["scheduler"])
        assert healthy and healthy["healthy"] and "pacing_holds_every_request" not in healthy
        ignored = fleet.metric(
            drill.procs["scheduler"],
            "hpcrl_scheduler_weight_updates_ignored_total",
            reason="not_in_store",
        )
        assert ignored == (2 if drill.auth else 3), ignored
        drill.lap("learner")

    def test_3_scheduler_forgery(self, drill: Drill):
        """8 x 8,003-token sequences at +-1e6 (the issue's), then each bound alone."""
        t, fleet = drill.t, drill.fleet
        version = fleet.learner_version()  # fresh: not dropped as stale before the checks

        def batch(batch_id: str, lengths: int, rewards: list[float]) -> dict:
            samples = [
                RolloutSample(
                    candidate_id=f"{batch_id}/{i}",
                    completion_token_ids=PackedArray.of([30 + i] * lengths, "<i4"),
                    sampling_logprobs=PackedArray.of([-0.5] * lengths, "<f4"),
                    policy_version=version,
                    reward=1.0,
                    status="success",
                    completion_sha256="0" * 64,
                )
                for i in range(len(rewards))
            ]
            raw = msgpack.unpackb(
                encode(
                    RolloutBatch(
                        id=batch_id,
                        experiment=EXPERIMENT,
                        iteration=0,
                        prompt_token_ids=PackedArray.of([1, 2, 3, 4], "<i4"),
                        samples=samples,
                        reward_mode="raw",
                    )
                )
            )
            for sample, reward in zip(raw["samples"], rewards, strict=True):
                sample["reward"] = reward
            return raw

        forged = {
            "forged-issue": (batch("forged-issue", 8003, [1e6, -1e6] * 4), ("reward",)),
            "forged-long": (
                batch("forged-long", 8003, [100.0, 1.0] * 4),
                ("8007 tokens > max_sequence_tokens 2048",),
            ),
            "forged-reward": (
                batch("forged-reward", 40, [1e6, 1.0] * 4),
                ("learner.max_abs_reward",),
            ),
        }
        for batch_id, (raw, _reason) in forged.items():
            drill.raw(
                "scheduler",
                t.work_exchange(ROLLOUT_BATCHES),
                t.name(ROLLOUT_BATCHES),
                msgpack.packb(raw),
                batch_id,
            )
        for batch_id, (_raw, reason) in forged.items():
            drill.await_dead(ROLLOUT_BATCHES, batch_id, 1)
            drill.expect(ROLLOUT_BATCHES, batch_id, 1, "scheduler", reason)
            check_reasons(drill, drill.expected[-1])
        drill.notes["forged_batches"] = set(forged)
        # Those the learner itself refused (counted as dropped); one outside its reward
        # mode's range is refused by the contract at the boundary, before the learner.
        drill.notes["forged_refused_by_learner"] = {
            batch_id
            for batch_id in forged
            if not drill.dead_of(ROLLOUT_BATCHES, batch_id)[0].reason.startswith("invalid ")
        }
        health = fleet.health(drill.procs["learner"])
        assert health and health["healthy"] and health["failed"] is None, health
        drill.lap("scheduler")

    def test_4_client_forgery(self, drill: Drill):
        """Alice names bob's verdict queue: with publisher authentication the replica answers
        the broker-verified user (alice); without it the request's ``client`` field names the
        queue, so bob gets it (README, "Use the benchmarker fleet from your own trainer")."""
        t, fleet, site = drill.t, drill.fleet, drill.site
        group = uuid.uuid4().hex
        forged = RewardRequest(
            id=f"{group}/0",
            group_id=group,
            index=0,
            completion="no code",
            bench=BenchSpec(task="matmul", stage=6),
            client=site.bob,
        )
        channel = site.channel(site.alice)
        try:
            channel.basic_publish(
                t.work_exchange(REWARD_REQUESTS),
                t.name(REWARD_REQUESTS),
                encode(forged),
                mandatory=True,
                properties=pika.BasicProperties(user_id=site.alice, message_id=forged.id),
            )
        finally:
            channel.connection.close()
        gets, other = (site.alice, site.bob) if drill.auth else (site.bob, site.alice)

        def verdict() -> BenchResult | None:
            fleet.check_alive()
            with fleet.channel() as admin:
                method, _props, body = admin.basic_get(t.reply_queue(gets), auto_ack=True)
            return None if method is None else decode(body, BenchResult)

        result = wait_for(verdict, 60, f"the verdict in {gets}'s queue", fleet.tails)
        assert result.id == forged.id and result.status == "format_violation"
        with fleet.channel() as admin:
            assert fleet.depth(admin, t.reply_queue(other)) == 0
        drill.lap("client")

    def test_5_benchmarker_forgery(self, drill: Drill):
        """The replica frozen holding a whole group; as its user: a success of 5,000 GFLOPS
        claiming peak 1e6 on the real host's class (index 3); one of 0.9 x the class's peak
        with a correct kernel's source that measures ~1 GFLOPS (index 2); and, for phase 9,
        an honest figure whose rollout is not the candidate's (index 1)."""
        t, fleet = drill.t, drill.fleet
        procs = drill.procs
        real = next(r for g in fleet.groups() for r in fleet.store.results_of(g.id))
        target = freeze_benchmarker_holding_a_group(drill)
        try:
            request = request_of(fleet, target.id)
            host = real.host
            peak = host.peak_gflops  # the class's peak as the scheduler has seen it
            judged = tokenizer(fleet).decode(TOKENS_66, skip_special_tokens=True)

            def result(
                index: int,
                gflops: float,
                host: HostInfo,
                rollout: RolloutData | None = None,
                sha: str | None = None,
            ):
                return BenchResult(
                    id=f"{target.id}/{index}",
                    group_id=target.id,
                    index=index,
                    status="success",
                    reward=gflops,
                    gflops=gflops,
                    source=KERNEL,
                    bench=request.bench,
                    host=host,
                    benchmarker=FORGED_REPLICA,
                    rollout=rollout,
                    completion_sha256=sha,
                )

            # The forger's tokens, and the hash of "the text it judged" (that of its tokens).
            rollout = RolloutData(
                prompt_token_ids=PackedArray.of([1, 2, 3], "<i4"),
                completion_token_ids=PackedArray.of(TOKENS_66, "<i4"),
                sampling_logprobs=PackedArray.of([-0.1] * len(TOKENS_66), "<f4"),
                policy_version=request.min_policy_version,
            )
            above = result(
                3,
                5000.0,
                host.model_copy(update={"peak_gflops": 1e6}),
                rollout,
                text_sha256(judged),
            )
            # No token data: it tests the second measurement, not the commitment.
            inflated = result(2, round(0.9 * peak, 1), host)
            # An honest figure for a correct kernel.
            steering = result(1, 0.1, host, rollout, text_sha256(judged))
            with drill.publisher("benchmarker") as publisher:
                publisher.publish(
                    *(Publish(t.name(BENCH_RESULTS), r) for r in (above, inflated, steering))
                )
            drill.await_dead(BENCH_RESULTS, above.id, 1)
            # Its rollout is not the one the generator committed to for candidate 1.
            drill.await_dead(BENCH_RESULTS, steering.id, 1)
            wait_for(
                lambda: {r.id for r in fleet.store.results_of(target.id)} == {inflated.id},
                30,
                "the one under the peak with no token data filed",
            )
        finally:
            drill.thaw("benchmarker")
        drill.expect(
            BENCH_RESULTS,
            above.id,
            1,
            "benchmarker",
            (
                "gflops 5000 is above the peak of host class",
                f"{host.host_class!r}, {peak:g} GFLOPS (seen; the result claims 1e+06)",
            ),
        )
        check_reasons(drill, drill.expected[-1])
        drill.expect(
            BENCH_RESULTS,
            steering.id,
            1,
            "benchmarker",
            (
                f"result {steering.id} refused (rollout_mismatch)",
                "is not the one the generator committed to",
            ),
        )
        check_reasons(drill, drill.expected[-1])
        wait_closed(drill, target.id, 180)

        group = fleet.store.group(target.id)
        assert group.close_reason == "complete" and group.excluded == 1, group
        # Not filed as best: neither forged figure is a program of the pool.
        assert max(p.gflops or 0.0 for p in fleet.store.all_programs()) < 0.5 * peak
        # The one that did not reproduce: dropped, the host suspect, the reason in /healthz.
        # Measured again is candidate 2's committed text (the tiny policy's, no kernel in
        # it), not the correct kernel the result reports.
        health = fleet.health(procs["scheduler"])
        suspect = health["suspect_hosts"][f"{host.hostname}/{FORGED_REPLICA}"]
        assert f"{inflated.gflops:g} GFLOPS claimed" in suspect["reason"], suspect
        assert "the committed text measured again yields no kernel" in suspect["reason"], suspect
        assert (
            fleet.metric(
                procs["scheduler"], "hpcrl_scheduler_results_ignored_total", reason="above_peak"
            )
            == 1
        )
        assert fleet.metric(procs["scheduler"], "hpcrl_scheduler_suspect_results_total") == 2
        batch = batch_of(fleet, target.id)
        assert batch is not None and inflated.id not in {s.candidate_id for s in batch.samples}
        drill.notes["steering"] = (target.id, steering.id)
        drill.notes.update(host=host, peak=peak, rollout=rollout, sha=text_sha256(judged))
        drill.lap("benchmarker")

    def test_6_benchmarker_success_without_source(self, drill: Drill):
        """Phase 5's forger again, on the next group: a success of 0.8 x the class's peak
        with no source (index 0) and no token data."""
        t, fleet = drill.t, drill.fleet
        host, peak = drill.notes["host"], drill.notes["peak"]
        target = freeze_benchmarker_holding_a_group(drill)
        try:
            request = request_of(fleet, target.id)
            gflops = round(0.8 * peak, 1)
            claim = BenchResult(
                id=f"{target.id}/0",
                group_id=target.id,
                index=0,
                status="success",
                reward=gflops,
                gflops=gflops,
                source=None,
                bench=request.bench,
                host=host,
                benchmarker=FORGED_REPLICA,
                # No token data: with the forger's, the commitment refuses it first (phase 5).
                rollout=None,
            )
            with drill.publisher("benchmarker") as publisher:
                publisher.publish(Publish(t.name(BENCH_RESULTS), claim))
            wait_for(lambda: fleet.store.count_results(target.id) == 1, 30, "the claim filed")
        finally:
            drill.thaw("benchmarker")
        wait_closed(drill, target.id, 120)
        drill.lap("benchmarker, no source")
        best = max(fleet.store.all_programs(), key=lambda p: p.gflops or 0.0)
        batch = batch_of(fleet, target.id)
        rewards = {s.candidate_id: s.reward for s in batch.samples} if batch else {}
        assert (best.gflops or 0.0) < 0.5 * peak, (
            f"{best.id}: {best.gflops:g} GFLOPS, never measured again (no source), is the "
            f"run's best; the group's rewards: {rewards}"
        )

    def test_7_benchmarker_foreign_source_for_a_committed_candidate(self, drill: Drill):
        """The replica frozen holding the next group; as its user, candidate 0 reported with
        the correct kernel's source at an honest figure (0.1 GFLOPS, below what it runs at),
        that candidate's genuine rollout and the hash of its genuine text."""
        t, fleet, procs = drill.t, drill.fleet, drill.procs
        host = drill.notes["host"]
        tap = f"drill-tap-{uuid.uuid4().hex[:8]}"
        with fleet.channel() as channel:  # the administrator's
            channel.queue_declare(tap, durable=False, auto_delete=False)
            channel.queue_bind(tap, t.work_exchange(CODE_TO_BENCH), t.name(CODE_TO_BENCH))
        suspects = fleet.metric(procs["scheduler"], "hpcrl_scheduler_suspect_results_total")
        try:
            target = freeze_benchmarker_holding_a_group(drill)
            try:
                seen: dict[int, Candidate] = {}
                with fleet.channel() as channel:
                    while len(seen) < GROUP_SIZE:
                        method, _props, body = channel.basic_get(tap, auto_ack=True)
                        assert method is not None, f"the tap holds {sorted(seen)} of {target.id}"
                        candidate = decode(body, Candidate)
                        if candidate.group_id == target.id:
                            seen[candidate.index] = candidate
                genuine = seen[0]
                assert genuine.rollout is not None
                forged = BenchResult(
                    id=genuine.id,
                    group_id=target.id,
                    index=0,
                    status="success",
                    reward=0.1,
                    gflops=0.1,
                    source=KERNEL,
                    bench=genuine.bench,
                    host=host,
                    benchmarker=FORGED_REPLICA,
                    rollout=genuine.rollout,
                    completion_sha256=text_sha256(genuine.completion),
                )
                with drill.publisher("benchmarker") as publisher:
                    publisher.publish(Publish(t.name(BENCH_RESULTS), forged))
                wait_for(
                    lambda: {r.id for r in fleet.store.results_of(target.id)} == {forged.id},
                    30,
                    "the forged result filed (its rollout is the committed one)",
                )
            finally:
                drill.thaw("benchmarker")
        finally:
            with fleet.channel() as channel:
                channel.queue_delete(tap)
        wait_closed(drill, target.id, 180)
        drill.lap("benchmarker, foreign source")
        # Measured again was the committed text (no kernel in it): a disagreement.
        health = fleet.health(procs["scheduler"])
        suspect = health["suspect_hosts"][f"{host.hostname}/{FORGED_REPLICA}"]
        assert suspect["last_result"] == forged.id, suspect
        assert "0.1 GFLOPS claimed for a source" in suspect["reason"], suspect
        assert "committed text measured again yields no kernel" in suspect["reason"], suspect
        assert (
            fleet.metric(procs["scheduler"], "hpcrl_scheduler_suspect_results_total")
            == suspects + 2
        )
        group = fleet.store.group(target.id)
        assert group.close_reason == "complete" and group.excluded == 1, group
        assert fleet.store.program(forged.id) is None
        # Its genuine tokens go to the learner as the failure they are, not at the top.
        batch = batch_of(fleet, target.id)
        rewards = {s.candidate_id: s.reward for s in batch.samples} if batch else {}
        assert forged.id not in rewards, rewards
        assert all(reward < 100.0 for reward in rewards.values()), rewards

    def test_8_generator_forgery(self, drill: Drill):
        """The generator frozen holding a request; as its user, candidate 3 of that group:
        the text of a correct kernel with token ids [66] * 40."""
        t, fleet = drill.t, drill.fleet
        target = freeze_for_next_group(
            drill,
            "generator",
            lambda g, held: held >= 1 and fleet.ready(GENERATE_REQUESTS) == 0,
            "the request",
        )
        try:
            request = request_of(fleet, target.id)
            forged = Candidate(
                id=f"{target.id}/3",
                group_id=target.id,
                index=3,
                completion=KERNEL_TEXT,
                bench=request.bench,
                generator="generator-forged",
                rollout=RolloutData(
                    prompt_token_ids=PackedArray.of([1, 2, 3], "<i4"),
                    completion_token_ids=PackedArray.of(TOKENS_66, "<i4"),
                    sampling_logprobs=PackedArray.of([-0.1] * len(TOKENS_66), "<f4"),
                    policy_version=request.min_policy_version,
                ),
            )
            # The generator's credential commits to what it sends, so the scheduler takes it;
            # the learner's check of tokens against the judged text is what stops it.
            commitment = CandidateCommitment.of([forged], "generator-forged")
            with drill.publisher("generator") as publisher:
                publisher.publish(
                    Publish(t.name(CANDIDATE_COMMITMENTS), commitment),
                    Publish(t.name(CODE_TO_BENCH), forged),
                )

            def judged() -> BenchResult | None:
                fleet.check_alive()
                return next(
                    (r for r in fleet.store.results_of(target.id) if r.id == forged.id), None
                )

            result = wait_for(judged, 120, f"{forged.id} to be judged", fleet.tails)
        finally:
            drill.thaw("generator")
        # It is a correct kernel: a success, the group's best (reward 100 in the batch) ...
        assert result.status == "success" and result.completion_sha256 == text_sha256(
            KERNEL_TEXT
        ), result
        wait_closed(drill, target.id, 180)
        batch = batch_of(fleet, target.id)
        [sample] = [s for s in batch.samples if s.candidate_id == forged.id]
        assert sample.reward == 100.0
        # ... which the learner refuses: its tokens are not those of the judged text.
        drill.await_dead(ROLLOUT_BATCHES, target.id, 1, timeout=120)
        drill.expect(
            ROLLOUT_BATCHES,
            target.id,
            1,
            "generator",
            (
                f"{forged.id}: its 40 token ids decode to a text",
                "other than the one the benchmarker judged",
            ),
        )
        check_reasons(drill, drill.expected[-1])
        drill.refused_batches.add(target.id)
        drill.lap("generator")

    def test_9_benchmarker_rollout_is_the_candidates(self, drill: Drill):
        fleet = drill.fleet
        group_id, forged_id = drill.notes["steering"]

        def settled() -> bool:  # trained, or refused by the learner
            fleet.check_alive()
            drill.drain()
            return group_id in trained_ids(fleet) or bool(drill.dead_of(ROLLOUT_BATCHES, group_id))

        wait_for(settled, 120, f"the learner to take {group_id}", fleet.tails, every=0.5)
        batch = batch_of(fleet, group_id)
        forged = [
            s
            for s in (batch.samples if batch else [])
            if s.completion_token_ids.numpy().tolist() == TOKENS_66
        ]
        trained = group_id in trained_ids(fleet)
        assert not (forged and trained), (
            f"{forged_id}: the learner trained {len(TOKENS_66)} x token 66 at reward "
            f"{forged[0].reward:g} (group {group_id}, confirmed: a correct kernel's source at "
            f"0.1 GFLOPS)"
        )
        # The forgery was refused at the scheduler, and the group trained whole with the
        # genuine candidate 1 (judged once the replica thawed) in its place.
        assert not forged and trained, (forged, trained)
        [sample] = [s for s in batch.samples if s.candidate_id == forged_id]
        assert sample.completion_token_ids.numpy().tolist() != TOKENS_66
        assert (
            fleet.metric(
                drill.procs["scheduler"],
                "hpcrl_scheduler_results_ignored_total",
                reason="rollout_mismatch",
            )
            == 1
        )
        assert len(drill.dead_of(BENCH_RESULTS, forged_id)) == 1

    def test_10_the_run_carried_on(self, drill: Drill):
        t, fleet, procs = drill.t, drill.fleet, drill.procs
        wait_done(fleet, procs["scheduler"], procs["learner"], refused=len(drill.refused_batches))
        # The generator loaded the genuine last version (an early "v3" was refused first).
        wait_for(
            lambda: (
                fleet.metric(procs["generator"], "hpcrl_generator_policy_version") == FINAL_VERSION
            ),
            60,
            f"the generator to load v{FINAL_VERSION}",
            fleet.tails,
        )
        codes = stop_all(fleet)
        assert set(codes.values()) == {0}, codes
        drill.lap("done")

        store = fleet.store
        groups = fleet.groups()
        ids = [g.id for g in groups]
        assert fleet.iteration() == ITERATIONS - 1 and len(ids) == ITERATIONS, ids
        assert store.count_pending_groups() == store.count_groups_in_flight() == 0
        assert store.count_unsent() == 0
        outbox = fleet.outbox_counts()
        for group in groups:
            assert group.state == "closed" and group.close_reason == "complete", group
            assert [r.id for r in store.results_of(group.id)] == [
                f"{group.id}/{i}" for i in range(GROUP_SIZE)
            ]
            assert outbox.get((GENERATE_REQUESTS, group.id)) == 1
            assert outbox.get((ROLLOUT_BATCHES, group.id)) == 1
        rows = fleet.result_rows()
        assert len(rows) == len(set(r[0] for r in rows)) == ITERATIONS * GROUP_SIZE
        assert not [r for r in rows if r[3]], "late results"

        # The learner trained every batch but the refused one, once; versions 1..V, no gap.
        versions = fleet.checkpoint_store().versions()
        assert [v.version for v in versions] == list(range(1, FINAL_VERSION + 1))
        assert [v.parent_version for v in versions] == [v.version - 1 for v in versions]
        state = fleet.learner_state(FINAL_VERSION)
        assert sorted(state["trained_ids"]) == sorted(set(ids) - drill.refused_batches)
        # Batches the learner refused are done too (dropped), phase 3's forged ones included.
        refused = drill.refused_batches | drill.notes["forged_refused_by_learner"]
        assert state["groups_dropped"] == len(refused), refused
        assert not set(state["trained_ids"]) & drill.notes["forged_batches"]
        # The scheduler took the genuine versions (v2 despite a forged body under "v2", v3
        # despite an early "v3"); it stops before the learner's last step, whose announcement
        # waits in its queue.
        # The scheduler admits the last group only once v3 has made room (pacing).
        floor = int(store.get("policy_version", 0))
        assert EARLY_VERSION <= floor <= FINAL_VERSION, floor

        time.sleep(1.0)  # the broker takes back what stopped services held
        drill.drain()
        with fleet.channel() as channel:
            depths = {base: fleet.depth(channel, t.name(base)) for base in WORK_QUEUES}
            late = []
            queue = t.subscriber_queue(WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER)
            while (got := channel.basic_get(queue, auto_ack=True))[0] is not None:
                late.append(decode(got[2], WeightUpdate).version)
        assert depths == dict.fromkeys(WORK_QUEUES, 0), depths
        assert all(floor < v <= FINAL_VERSION for v in late), (floor, late)
        with fleet.channel() as channel:
            leftovers = {q: n for q in fleet.queue_names() if (n := fleet.depth(channel, q))}
        assert not leftovers, leftovers

        # The dead letters are exactly the forgeries, each with its reason: no genuine
        # message was dead-lettered (lost), no forgery went through unnoticed.
        got = Counter((d.base, d.message_id) for d in drill.dead)
        want = Counter({(e.base, e.message_id): e.count for e in drill.expected})
        assert got == want, {"unexpected": got - want, "missing": want - got}
        for expected in drill.expected:
            check_reasons(drill, expected)
        drill.lap("checked")
        print(f"\ndead letters ({'with' if drill.auth else 'without'} publisher authentication):")
        for dead in drill.dead:
            print(
                f"  {dead.base:<16} {dead.message_id!s:<34} {dead.consumer:<36} {dead.reason[:110]}"
            )

    def test_11_a_refused_batch_is_counted_done(self, drill: Drill):
        # The learner reports every batch it refused as dropped (done), so the scheduler does
        # not count it outstanding for good; the forged ones make the learner's count exceed
        # what the scheduler sent, which the scheduler paces by (clamped), not refuses.
        fleet = drill.fleet
        assert drill.refused_batches, "phase 8 did not run"
        last = fleet.checkpoint_store().latest()
        done = int(last.metrics["groups_trained"] + last.metrics.get("groups_dropped", 0))
        sent = fleet.store.count_batches_sent()
        forged = drill.notes["forged_refused_by_learner"]
        assert done == sent + len(forged), (
            f"the learner's v{last.version} accounts for "
            f"{done} groups; the scheduler sent {sent}, the "
            f"learner refused {len(forged)} forged ones"
        )


def trained_ids(fleet: Fleet) -> set[str]:
    version = fleet.learner_version()
    return set(fleet.learner_state(version)["trained_ids"]) if version else set()


def check_reasons(drill: Drill, expected: Expected) -> None:
    dead = drill.dead_of(expected.base, expected.message_id)
    assert len(dead) == expected.count, (expected, dead)
    for each in dead:
        assert any(all(part in each.reason for part in texts) for texts in expected.reasons), (
            f"{expected.phase}: {expected.message_id} dead-lettered by {each.consumer} with "
            f"{each.reason!r}, expected {expected.reasons}"
        )
