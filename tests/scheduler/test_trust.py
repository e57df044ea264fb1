"""Issue 28: one benchmarker credential must not steer training. On the real RabbitMQ, with
the scheduler service in process and results published straight onto ``bench-results``:

* a result above its host class's peak is dead-lettered, whatever peak it claims;
* a group's winner is measured a second time before its rewards, pool and batch take
  effect; a second measurement far below the claim drops the winner and marks the results
  and the host suspect (metric, /healthz), and the next best is confirmed in turn.
"""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY

from hpcrl_common.broker import Consumer, Publish, Publisher
from hpcrl_common.messages import (
    BenchResult,
    Candidate,
    GenerateRequest,
    HostInfo,
    RolloutBatch,
)
from hpcrl_common.topology import (
    BENCH_RESULTS,
    CANDIDATE_COMMITMENTS,
    CODE_TO_BENCH,
    GENERATE_REQUESTS,
    REASON_HEADER,
    ROLLOUT_BATCHES,
    Topology,
)
from hpcrl_scheduler.config import SchedulerConfig, SchedulerSection
from hpcrl_scheduler.peaks import PeakBook
from hpcrl_scheduler.scheduler import Scheduler
from hpcrl_scheduler.service import SchedulerService
from hpcrl_scheduler.store import Store

from ..conftest import RunningConsumer
from .helpers import commitment, committed, deliver, result
from .test_service_broker import take

CLASS = "amd-epyc/avx512f/gcc12/0123456789ab"


def host(peak: float, cores: int = 2, hostname: str = "node1") -> HostInfo:
    return HostInfo(
        hostname=hostname,
        cpu_model="AMD EPYC",
        isa=["avx512f", "avx2"],
        cores=cores,
        compiler="gcc 12",
        host_class=CLASS,
        peak_gflops=peak,
    )


def bench_result(
    group_id: str,
    index: int,
    gflops: float | None,
    *,
    peak: float = 384.0,
    benchmarker: str = "benchmarker-a",
    status: str = "success",
    hostname: str = "node1",
    kernel: int | None = None,
) -> BenchResult:
    """``kernel``: whose source it reports (a confirmation's: the candidate it measured
    again, whose committed text yields that source); its own index by default."""
    kernel = index if kernel is None else kernel
    base = result(group_id, index, status, gflops, source=f"/* kernel {kernel} */ void k(){{}}")
    return BenchResult.model_validate(
        {**base.model_dump(), "host": host(peak, hostname=hostname), "benchmarker": benchmarker}
    )


def service(
    broker_settings, tmp_path, name: str, **section
) -> tuple[Scheduler, Consumer, SchedulerService]:
    config = SchedulerConfig(
        broker=broker_settings,
        experiment={"name": name, "seed": 1},
        scheduler=SchedulerSection(
            **{
                "iterations": 1,
                "group_size": 2,
                "node_budget": 1,
                "max_staleness": 0,
                "metrics_port": 0,
                "tick_s": 0.1,
                "exit_when_done": False,
                **section,
            }
        ),
    )
    scheduler = Scheduler(config, Store(tmp_path / f"{name}.sqlite"))
    consumer = Consumer(broker_settings, f"scheduler-{name}", concurrency=2)
    return scheduler, consumer, SchedulerService(scheduler, consumer)


def measured_again(
    publisher: Publisher, topology: Topology, check: Candidate, gflops: float, kernel: int
) -> None:
    """Another benchmarker's answer to a confirmation request: ``kernel``'s text, ``gflops``."""
    publisher.publish(
        Publish(
            topology.name(BENCH_RESULTS),
            bench_result(check.group_id, 0, gflops, benchmarker="benchmarker-b", kernel=kernel),
        )
    )


def dead_letters(channel, queue: str, expect: int, timeout: float = 20.0) -> list[str]:
    found: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(found) < expect:
        method, props, _body = channel.basic_get(queue, auto_ack=True)
        if method is None:
            time.sleep(0.05)
            continue
        found.append(props.headers[REASON_HEADER])
    return found


pytestmark = pytest.mark.broker


def test_a_result_above_its_host_classs_peak_is_refused(broker_settings, raw_channel, tmp_path):
    """The issue's forgery: 5,000 GFLOPS claiming a peak of 1e6 on a class whose hosts report
    384. Also one under the formula's bound (2 cores x 6 GHz x 32 = 384) but above what the
    class's genuine host reported (200): a message can only lower its class's peak."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    scheduler, consumer, _service = service(
        broker_settings, tmp_path, "peak", reward_mode="raw", confirm_winners=False
    )
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        [request] = take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest)
        genuine = bench_result(request.id, 0, 1.7, peak=200.0)
        forged = [
            bench_result(request.id, 1, 5000.0, peak=1e6, benchmarker="evil"),
            bench_result(request.id, 1, 300.0, peak=1e6, benchmarker="evil"),
        ]
        publisher.publish(*committed(topology, [genuine]))
        time.sleep(0.5)  # the genuine host's report first
        # The generator's candidate 1 has one rollout, which every report of it carries.
        publisher.publish(Publish(topology.name(CANDIDATE_COMMITMENTS), commitment(forged[:1])))
        reasons = []
        for each in forged:  # one at a time: the same id twice at once is one delivery
            publisher.publish(Publish(topology.name(BENCH_RESULTS), each))
            reasons += dead_letters(raw_channel, topology.dlq(BENCH_RESULTS), expect=1)
        assert len(reasons) == 2, reasons
        assert all("above the peak of host class" in r for r in reasons), reasons
        assert all("200 GFLOPS (seen; the result claims 1e+06)" in r for r in reasons), reasons
        publisher.publish(
            Publish(topology.name(BENCH_RESULTS), bench_result(request.id, 1, 1.5, peak=384.0))
        )
        [batch] = take(raw_channel, topology.name(ROLLOUT_BATCHES), RolloutBatch)
    assert [s.reward for s in batch.samples] == [1.7, 1.5]
    assert max(p.gflops or 0 for p in scheduler.store.all_programs()) == 1.7
    assert (
        REGISTRY.get_sample_value("hpcrl_scheduler_results_ignored_total", {"reason": "above_peak"})
        >= 2
    )


def test_the_operators_registry_wins_over_what_hosts_report(tmp_path):
    book = PeakBook({"AMD EPYC": 50.0}, max_clock_ghz=6.0, max_cores=1024)
    store = Store(tmp_path / "peaks.sqlite")
    with store.tx():
        assert book.admit(store, bench_result("g.s0.t0.g0000", 0, 40.0, peak=1e6)) is None
        refused = book.admit(store, bench_result("g.s0.t0.g0000", 1, 60.0, peak=1e6))
    assert refused is not None and "50 GFLOPS (registry" in refused


def test_a_winner_that_does_not_reproduce_is_dropped_and_its_host_suspect(
    broker_settings, raw_channel, tmp_path
):
    """The issue's case under the peak: 300 GFLOPS claimed where the kernel does ~2. Its
    second measurement (another replica) finds 1.9: the claim is dropped and both results
    and the host are marked suspect; the next best (2.0) is confirmed (2.1) and only then
    does the group's batch go out, normalised by the confirmed maximum."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    scheduler, consumer, svc = service(
        broker_settings, tmp_path, "confirm", reward_mode="group_normalized"
    )
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        [request] = take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest)
        honest = bench_result(request.id, 0, 2.0, benchmarker="benchmarker-b", hostname="node2")
        forged = bench_result(request.id, 1, 300.0, benchmarker="evil")
        publisher.publish(*committed(topology, (honest, forged)))
        [check] = take(raw_channel, topology.name(CODE_TO_BENCH), Candidate)
        assert check.group_id == f"{request.id}.confirm1" and check.rollout is None
        assert check.generator == f"confirm|evil|{CLASS}"
        assert "/* kernel 1 */" in check.completion
        assert take(raw_channel, topology.name(ROLLOUT_BATCHES), RolloutBatch, timeout=1.0) == []
        second = bench_result(
            check.group_id, 0, 1.9, benchmarker="benchmarker-b", hostname="node2", kernel=1
        )
        publisher.publish(Publish(topology.name(BENCH_RESULTS), second))
        [again] = take(raw_channel, topology.name(CODE_TO_BENCH), Candidate)
        assert again.group_id == f"{request.id}.confirm2"
        assert again.generator == f"confirm|benchmarker-b|{CLASS}"
        assert "/* kernel 0 */" in again.completion
        publisher.publish(
            Publish(
                topology.name(BENCH_RESULTS),
                bench_result(again.group_id, 0, 2.1, benchmarker="benchmarker-a"),
            )
        )
        [batch] = take(raw_channel, topology.name(ROLLOUT_BATCHES), RolloutBatch)
        healthy, detail = svc.health()
    assert [(s.candidate_id, s.reward) for s in batch.samples] == [(honest.id, 100.0)]
    assert [p.id for p in scheduler.store.all_programs() if p.id != "seed"] == [honest.id]
    assert healthy and list(detail["suspect_hosts"]) == ["node1/evil"]
    assert "300 GFLOPS claimed, 1.9 measured" in detail["suspect_hosts"]["node1/evil"]["reason"]
    assert REGISTRY.get_sample_value("hpcrl_scheduler_suspect_results_total") >= 2
    assert REGISTRY.get_sample_value("hpcrl_scheduler_suspect_hosts") >= 1
    group = scheduler.store.group(request.id)
    assert group is not None and group.excluded == 1


@pytest.mark.parametrize("without_source", ["drop", "count"])
def test_a_winner_without_its_source_is_dropped_unless_told_to_count_it(
    broker_settings, raw_channel, tmp_path, without_source
):
    """A success under the peak but with no source cannot be measured again. Counted, one
    benchmarker credential set the group's maximum that way; now it is dropped and the next
    best is confirmed, unless the operator runs benchmarkers without sources (count)."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    _scheduler, consumer, _svc = service(
        broker_settings,
        tmp_path,
        f"nosrc-{without_source}",
        reward_mode="group_normalized",
        confirm_without_source=without_source,
    )
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        [request] = take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest)
        honest = bench_result(request.id, 0, 2.0, benchmarker="benchmarker-b", hostname="node2")
        sourceless = bench_result(request.id, 1, 300.0, benchmarker="evil").model_copy(
            update={"source": None}
        )
        publisher.publish(*committed(topology, (honest, sourceless)))
        if without_source == "drop":
            [check] = take(raw_channel, topology.name(CODE_TO_BENCH), Candidate)
            assert check.group_id == f"{request.id}.confirm1"
            assert "/* kernel 0 */" in check.completion  # the honest one, confirmed instead
            publisher.publish(
                Publish(
                    topology.name(BENCH_RESULTS),
                    bench_result(check.group_id, 0, 2.1, benchmarker="benchmarker-a"),
                )
            )
        [batch] = take(raw_channel, topology.name(ROLLOUT_BATCHES), RolloutBatch)
    rewards = dict((s.candidate_id, s.reward) for s in batch.samples)
    if without_source == "drop":
        assert rewards == {honest.id: 100.0}
    else:
        assert rewards[sourceless.id] == 100.0 and rewards[honest.id] < 1.0


def test_a_confirmed_winner_counts_at_the_lower_of_its_two_measurements():
    from hpcrl_scheduler.confirm import ConfirmState, judge

    group = "g.s0.t0.g0000"
    results = [bench_result(group, i, g) for i, g in enumerate((2.0, 9.0, 1.0))]
    results.append(bench_result(group, 3, 1.8))  # measured once, above the winner's 2nd
    state = ConfirmState(adjusted={f"{group}/0": 1.5}, dropped=[f"{group}/1"])
    applied = state.apply(results)
    assert [(r.id, r.gflops, r.reward) for r in applied] == [
        (f"{group}/0", 1.5, 1.5),
        (f"{group}/2", 1.0, 1.0),
        (f"{group}/3", 1.5, 1.5),
    ]
    second = bench_result(f"{group}.confirm1", 0, 0.9)
    assert judge(results[0], second, 2.0)[0] == "agreed"  # 2.2x: noise on a busy node
    assert judge(results[1], second, 2.0)[0] == "disagreed"  # 10x
    failed = bench_result(f"{group}.confirm1", 0, None, status="runtime_error")
    assert judge(results[0], failed, 2.0)[0] == "disagreed"


def test_a_winner_is_not_confirmed_by_its_own_broker_user_where_another_has_the_class(tmp_path):
    """A benchmarker credential reads code-to-bench, so it could take the confirmation of its
    own claim and agree with itself: where another user (site) has sent results of the class,
    the second measurement must come from it."""
    from hpcrl_common.topology import CODE_TO_BENCH

    config = SchedulerConfig(
        experiment={"name": "users", "seed": 1},
        scheduler=SchedulerSection(
            iterations=1, group_size=2, node_budget=1, max_staleness=0, metrics_port=0
        ),
    )
    scheduler = Scheduler(config, Store(tmp_path / "users.sqlite"))
    scheduler.step()
    [request] = [m for _, q, m in scheduler.store.unsent() if q == GENERATE_REQUESTS]

    def confirmations() -> list[Candidate]:
        return [m for _, q, m in scheduler.store.unsent() if q == CODE_TO_BENCH]

    deliver(
        scheduler,
        bench_result(request.id, 0, 2.0, benchmarker="b-site-b"),
        publisher="hpcrl-benchmarker.site-b",
    )
    deliver(
        scheduler,
        bench_result(request.id, 1, 30.0, benchmarker="evil"),
        publisher="hpcrl-benchmarker.site-a",
    )
    [first] = confirmations()
    deliver(
        scheduler,
        bench_result(first.group_id, 0, 29.0, benchmarker="evil-2", kernel=1),
        publisher="hpcrl-benchmarker.site-a",
    )  # itself: not enough
    assert scheduler.store.group(request.id).state != "closed"
    second = confirmations()[-1]
    assert second.group_id == f"{request.id}.confirm2" and "/* kernel 1 */" in second.completion
    deliver(
        scheduler,
        bench_result(second.group_id, 0, 2.2, benchmarker="b-site-b", kernel=1),
        publisher="hpcrl-benchmarker.site-b",
    )  # the other site: 13x less
    assert "node1/evil" in scheduler.suspect_hosts()
    third = confirmations()[-1]  # the next best, 2.0 from site b: another user confirms it
    assert third.group_id == f"{request.id}.confirm3" and "/* kernel 0 */" in third.completion
    deliver(
        scheduler,
        bench_result(third.group_id, 0, 2.1, benchmarker="b2"),
        publisher="hpcrl-benchmarker.site-a",
    )
    group = scheduler.store.group(request.id)
    assert group is not None and group.state == "closed" and group.excluded == 1
    assert [p.id for p in scheduler.store.all_programs() if p.id != "seed"] == [f"{request.id}/0"]


@pytest.mark.parametrize("rounds", [3, 1])
def test_a_runner_up_measured_once_above_the_confirmed_winner_is_measured_again(
    broker_settings, raw_channel, tmp_path, rounds
):
    """The winner (3.0) is confirmed at 2.0, its lower measurement; the runner-up (2.8,
    measured once) would count at that ceiling too, tied with it. With rounds left it is
    measured again (2.6) and the group's rewards rank the two by their lower measurements;
    with one round it is capped at the ceiling, as before."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    _scheduler, consumer, _svc = service(
        broker_settings,
        tmp_path,
        f"runner-up-{rounds}",
        reward_mode="group_normalized",
        confirm_rounds=rounds,
    )
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        [request] = take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest)
        winner = bench_result(request.id, 0, 3.0)
        runner_up = bench_result(request.id, 1, 2.8)
        publisher.publish(*committed(topology, (winner, runner_up)))
        [check] = take(raw_channel, topology.name(CODE_TO_BENCH), Candidate)
        assert "/* kernel 0 */" in check.completion
        measured_again(publisher, topology, check, 2.0, kernel=0)
        if rounds > 1:
            [again] = take(raw_channel, topology.name(CODE_TO_BENCH), Candidate)
            assert again.group_id == f"{request.id}.confirm2"
            assert "/* kernel 1 */" in again.completion
            assert take(raw_channel, topology.name(ROLLOUT_BATCHES), RolloutBatch, 1.0) == []
            measured_again(publisher, topology, again, 2.6, kernel=1)
        [batch] = take(raw_channel, topology.name(ROLLOUT_BATCHES), RolloutBatch)
        assert take(raw_channel, topology.name(CODE_TO_BENCH), Candidate, timeout=0.5) == []
    rewards = {s.candidate_id: s.reward for s in batch.samples}
    if rounds > 1:
        assert rewards == {runner_up.id: 100.0, winner.id: pytest.approx(100.0 * 2.0 / 2.6)}
    else:
        assert rewards == {winner.id: 100.0, runner_up.id: 100.0}


def test_a_runner_up_whose_second_measurement_is_far_below_is_dropped_and_its_host_suspect(
    broker_settings, raw_channel, tmp_path
):
    """Measured again, the runner-up is judged as a winner is: 2.8 claimed above the
    confirmed winner's 2.0, 0.5 measured again (beyond the tolerance's 3x) drops it and marks
    its host; the winner's figure stands alone in the batch."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    _scheduler, consumer, svc = service(
        broker_settings, tmp_path, "runner-up-forged", reward_mode="group_normalized"
    )
    with RunningConsumer(consumer), Publisher(broker_settings) as publisher:
        [request] = take(raw_channel, topology.name(GENERATE_REQUESTS), GenerateRequest)
        winner = bench_result(request.id, 0, 3.0)
        forged = bench_result(request.id, 1, 2.8, benchmarker="evil", hostname="node3")
        publisher.publish(*committed(topology, (winner, forged)))
        [check] = take(raw_channel, topology.name(CODE_TO_BENCH), Candidate)
        measured_again(publisher, topology, check, 2.0, kernel=0)
        [again] = take(raw_channel, topology.name(CODE_TO_BENCH), Candidate)
        assert "/* kernel 1 */" in again.completion
        measured_again(publisher, topology, again, 0.5, kernel=1)
        [batch] = take(raw_channel, topology.name(ROLLOUT_BATCHES), RolloutBatch)
        _healthy, detail = svc.health()
    assert {s.candidate_id: s.reward for s in batch.samples} == {winner.id: 100.0}
    assert "node3/evil" in detail["suspect_hosts"]
