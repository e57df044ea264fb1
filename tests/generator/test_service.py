"""The generator service with the transformers backend: weight loop, floors, refusals."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import REGISTRY

from hpcrl_common.broker import Reject
from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_common.messages import ChatMessage, WeightUpdate
from hpcrl_common.metrics import BusyTime
from hpcrl_common.topology import Topology
from hpcrl_generator.backends.transformers import TransformersSampler
from hpcrl_generator.config import GeneratorSection
from hpcrl_generator.service import Generator, SamplingFailed, VersionNotReady

from .conftest import commit_version
from .helpers import candidates, request, tokens
from .loop import run_weight_loop


def greedy_tokens(model_dir) -> list[int]:
    fresh = TransformersSampler(model_dir)
    generator = Generator(
        fresh,
        GeneratorSection(model_path=model_dir, backend="transformers"),
        Topology("x"),
        replica="ref",
    )
    (candidate, *_) = candidates(generator.on_request(request("ref"), None))
    return tokens(candidate)


def make(models, store_root=None, **overrides) -> Generator:
    section = GeneratorSection(
        model_path=models["v0"],
        checkpoint_dir=store_root,
        backend="transformers",
        version_poll_s=0.1,
        **overrides,
    )
    sampler = TransformersSampler(models["v0"], max_model_len=section.max_model_len)
    return Generator(sampler, section, Topology("t"), replica="r1")


@pytest.mark.broker
@pytest.mark.slow
def test_weight_loop_over_rabbitmq(tiny_models, broker_settings, raw_channel, tmp_path):
    run_weight_loop(
        TransformersSampler(tiny_models["v0"]),
        tiny_models,
        broker_settings,
        raw_channel,
        tmp_path / "store",
        greedy_tokens(tiny_models["v1"]),
    )


def test_a_late_replica_starts_from_the_newest_valid_version(tiny_models, tmp_path):
    store = CheckpointStore(tmp_path)
    commit_version(store, tiny_models["v1"], 1)
    commit_version(store, tiny_models["v2"], 2)
    broken = commit_version(store, tiny_models["v1"], 3)
    (store.path_of(broken) / "config.json").write_text("{}")  # checksum no longer matches
    generator = make(tiny_models, tmp_path)
    generator.start()
    assert generator.tracker.loaded == 2 and generator.sampler.version == 2
    out = candidates(generator.on_request(request("late"), None))
    assert all(c.rollout.policy_version == 2 for c in out)
    assert tokens(out[0]) == greedy_tokens(tiny_models["v2"])


def test_a_bad_announcement_is_refused_and_the_policy_keeps_serving(tiny_models, tmp_path):
    store = CheckpointStore(tmp_path)
    info = commit_version(store, tiny_models["v1"], 1)
    generator = make(tiny_models, tmp_path, poll_manifest=False)
    refused = ("hpcrl_generator_announcements_refused_total", {"reason": "mismatch"})
    before = REGISTRY.get_sample_value(*refused)
    genuine = info.weight_update(store.root, run=f"exp/{store.run_id}")
    lying = WeightUpdate(**{**genuine.model_dump(), "checksum": "sha256:" + "1" * 64})
    with pytest.raises(Reject, match="refused \\(mismatch\\)"):
        generator.on_weight_update(lying, None)
    assert REGISTRY.get_sample_value(*refused) == (before or 0) + 1
    assert generator.tracker.loaded == 0
    out = candidates(generator.on_request(request("still-v0"), None))
    assert out[0].rollout.policy_version == 0


def test_an_announcement_is_loaded_at_once_when_the_engine_is_idle(tiny_models, tmp_path):
    store = CheckpointStore(tmp_path)
    generator = make(tiny_models, tmp_path, poll_manifest=False)
    info = commit_version(store, tiny_models["v1"], 1)
    generator.on_weight_update(info.weight_update(store.root, run=f"exp/{store.run_id}"), None)
    assert generator.tracker.loaded == 1
    assert REGISTRY.get_sample_value("hpcrl_generator_policy_version") == 1


def test_a_floor_that_never_comes_times_out_for_a_retry(tiny_models, tmp_path):
    generator = make(tiny_models, tmp_path, version_wait_s=0.5)
    waits = REGISTRY.get_sample_value("hpcrl_generator_version_waits_total") or 0
    with pytest.raises(VersionNotReady, match="policy version 3 not available"):
        generator.on_request(request("early", floor=3), None)
    assert REGISTRY.get_sample_value("hpcrl_generator_version_waits_total") == waits + 1


def test_a_prompt_longer_than_the_context_is_rejected(tiny_models):
    generator = make(tiny_models, max_model_len=80)
    long = [ChatMessage(role="user", content="register blocking " * 40)]
    with pytest.raises(Reject, match="no room for a completion"):
        generator.on_request(request("long", prompt=long), None)
    out = candidates(generator.on_request(request("short", max_tokens=500), None))  # capped
    assert len(tokens(out[0])) + len(out[0].rollout.prompt_token_ids) <= 80


def test_waiting_for_a_floor_or_for_the_engine_is_not_busy_time(tiny_models, tmp_path):
    """hpcrl_service_busy_seconds_total counts sampling, not a request's waits: for a policy
    version that has not come, or for the engine while another request holds it."""
    generator = make(tiny_models, tmp_path, version_wait_s=0.6)
    generator.busy = busy = BusyTime()  # what attach() does with the consumer's
    began = time.monotonic()
    with busy.working(), pytest.raises(VersionNotReady):
        generator.on_request(request("early", floor=3), None)
    assert time.monotonic() - began >= 0.6 and busy.seconds() < 0.3

    before = busy.seconds()
    done = threading.Event()

    def sample() -> None:
        with busy.working():
            generator.on_request(request("queued"), None)
        done.set()

    with generator._engine:  # another request samples meanwhile (not counted here)
        thread = threading.Thread(target=sample)
        began = time.monotonic()
        thread.start()
        time.sleep(0.5)
        assert busy.seconds() - before < 0.1
    thread.join(60)
    assert done.is_set()
    assert busy.seconds() - before <= time.monotonic() - began - 0.4


def queue_behind_the_engine(generator: Generator, requests) -> tuple[list[int], dict]:
    """Send ``requests`` from handler threads while the engine is busy, then free it.
    Returns the size of every engine call and each request's candidates (or exception)."""
    calls: list[int] = []
    sample_groups = generator.sampler.generate_groups

    def counted(jobs):
        calls.append(len(jobs))
        return sample_groups(jobs)

    generator.sampler.generate_groups = counted
    outcomes: dict = {}

    def send(req) -> None:
        try:
            outcomes[req.id] = candidates(generator.on_request(req, None))
        except Exception as exc:  # the outcome under test
            outcomes[req.id] = exc

    threads = [threading.Thread(target=send, args=(req,)) for req in requests]
    with generator._engine:  # another call samples meanwhile: these requests wait
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while len(generator._waiting) < len(requests) and time.monotonic() < deadline:
            time.sleep(0.01)
    for thread in threads:
        thread.join(120)
    return calls, outcomes


def test_requests_waiting_for_the_engine_are_sampled_together(tiny_models, tmp_path):
    generator = make(tiny_models, tmp_path, max_batch_groups=3)
    requests = [request(f"r{i}", group_size=2, temperature=0.9, seed=i) for i in range(4)]
    calls, outcomes = queue_behind_the_engine(generator, requests)
    assert calls == [3, 1]  # oldest three together, the fourth in the next call
    alone = make(tiny_models, tmp_path, max_batch_groups=1)
    for req in requests:
        got = outcomes[req.id]
        assert [c.group_id for c in got] == [req.id] * 2
        want = candidates(alone.on_request(req, None))
        assert [tokens(c) for c in got] == [tokens(c) for c in want]


def test_a_request_whose_floor_is_not_met_does_not_join_a_call(tiny_models, tmp_path):
    generator = make(
        tiny_models, tmp_path, max_batch_groups=4, poll_manifest=False, version_wait_s=0.5
    )
    calls, outcomes = queue_behind_the_engine(
        generator, [request("now"), request("later", floor=1)]
    )
    assert calls == [1]
    assert outcomes["now"][0].rollout.policy_version == 0
    assert isinstance(outcomes["later"], VersionNotReady)


def test_one_bad_request_in_a_call_is_rejected_alone(tiny_models):
    generator = make(tiny_models, max_model_len=80, max_batch_groups=4)
    long = [ChatMessage(role="user", content="register blocking " * 40)]
    calls, outcomes = queue_behind_the_engine(
        generator, [request("long", prompt=long), request("short")]
    )
    assert calls == [1]
    assert isinstance(outcomes["long"], Reject)
    assert len(outcomes["short"]) == 2


def test_a_failed_engine_call_fails_each_of_its_requests_on_its_own(tiny_models, tmp_path):
    generator = make(tiny_models, tmp_path, max_batch_groups=4)

    def broken(jobs):
        raise RuntimeError("engine died")

    generator.sampler.generate_groups = broken
    threads_errors = []
    for _ in range(2):  # the same failure twice: tracebacks must not pile up across calls
        _calls, outcomes = queue_behind_the_engine(generator, [request("a"), request("b")])
        threads_errors.append(outcomes)
    for outcomes in threads_errors:
        a, b = outcomes["a"], outcomes["b"]
        assert isinstance(a, SamplingFailed) and isinstance(b, SamplingFailed) and a is not b
        assert "engine died" in str(a)
