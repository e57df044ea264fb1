"""The benchmarker's side of the reward path, in process: where a verdict goes, what counts."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from hpcrl_benchmarker import service
from hpcrl_benchmarker.service import RewardHandler
from hpcrl_common.broker import Delivery, Publish, Reject
from hpcrl_common.messages import BenchResult, BenchSpec, Candidate, HostInfo, RewardRequest
from hpcrl_common.topology import Topology

HOST = HostInfo(
    hostname="n",
    cpu_model="c",
    isa=["avx2"],
    cores=2,
    compiler="gcc",
    host_class="c",
    peak_gflops=500.0,
)


def judge_everything_as_format_violation(candidate: Candidate, _delivery: Delivery):
    assert candidate.rollout is None and candidate.generator == ""  # never a confirmation
    result = BenchResult(
        id=candidate.id,
        group_id=candidate.group_id,
        index=candidate.index,
        status="format_violation",
        reward=-100.0,
        bench=candidate.bench,
        host=HOST,
    )
    return [Publish("t.bench-results", result)]


def request(client: str = "", group: str = "b") -> RewardRequest:
    return RewardRequest(
        id=f"{group}/0",
        group_id=group,
        index=0,
        completion="x",
        bench=BenchSpec(task="matmul", stage=6),
        client=client,
    )


def delivery(user_id: str | None) -> Delivery:
    return Delivery(
        queue="t.reward-requests",
        tag=1,
        generation=1,
        attempt=1,
        body=b"",
        headers={},
        user_id=user_id,
    )


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_the_verdict_goes_to_the_authenticated_user_not_the_named_client():
    t = Topology("t")
    handler = RewardHandler(judge_everything_as_format_violation, t, authenticated=True)
    before = sample(
        "hpcrl_benchmarker_client_verdicts_total",
        client="hpcrl-client.alice",
        status="format_violation",
    )
    [out] = handler(request(client="bob"), delivery("hpcrl-client.alice"))
    assert out.routing_key == "t.reward-verdicts.hpcrl-client.alice"
    assert out.exchange == "t.reward-verdicts.in" and out.message.id == "b/0"
    assert (
        sample(
            "hpcrl_benchmarker_client_verdicts_total",
            client="hpcrl-client.alice",
            status="format_violation",
        )
        == before + 1
    )
    assert sample("hpcrl_benchmarker_client_requests_total", client="hpcrl-client.alice") >= 1


def test_without_authentication_the_client_field_names_the_queue():
    t = Topology("t")
    handler = RewardHandler(judge_everything_as_format_violation, t, authenticated=False)
    [out] = handler(request(client="bob"), delivery("guest"))
    assert out.routing_key == "t.reward-verdicts.bob"
    [out] = handler(request(), delivery("guest"))
    assert out.routing_key == "t.reward-verdicts.guest"
    with pytest.raises(Reject, match="client"):
        handler(request(), delivery(None))


def test_client_labels_are_bounded(monkeypatch):
    monkeypatch.setattr(service, "MAX_CLIENT_LABELS", 2)
    handler = RewardHandler(judge_everything_as_format_violation, Topology(), authenticated=False)
    assert [handler.label(name) for name in ("a", "b", "c", "a")] == ["a", "b", "other", "a"]
