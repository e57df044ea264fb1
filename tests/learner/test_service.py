"""The learner service against the real RabbitMQ, with a real tiny model."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from hpcrl_common.broker import Publish, Publisher
from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import WeightUpdate, decode
from hpcrl_common.replay import replay_line
from hpcrl_common.topology import ROLLOUT_BATCHES, WEIGHT_UPDATES, Topology
from hpcrl_learner.backends import StepResult
from hpcrl_learner.backends.torch import TorchTrainer
from hpcrl_learner.batches import TrainSequence
from hpcrl_learner.config import LearnerConfig, LearnerSettings
from hpcrl_learner.service import build
from hpcrl_learner.state import StateStore
from tests.conftest import RunningConsumer
from tests.support.waiting import wait_for

from .conftest import BAD, GOOD, PROMPT, good_bad_batch, rollout_batch

pytestmark = pytest.mark.broker

HANGING_LEARNER = Path(__file__).with_name("hanging_learner.py")


def tail_of(log: Path) -> Callable[[], str]:
    """What ``wait_for`` shows of a learner's log when it times out."""
    return lambda: "\n" + log.read_text()[-3000:] if log.exists() else ""


def listen_to_weight_updates(channel, settings: BrokerSettings) -> str:
    topology = Topology(settings.namespace, settings.delivery_limit)
    topology.declare(channel)
    queue = topology.subscriber_queue(WEIGHT_UPDATES, "test-listener")
    channel.queue_declare(queue, durable=True)
    channel.queue_bind(queue, topology.name(WEIGHT_UPDATES))
    return queue


def drain(channel, queue: str) -> list[WeightUpdate]:
    updates = []
    while True:
        method, _props, body = channel.basic_get(queue, auto_ack=True)
        if method is None:
            return updates
        updates.append(decode(body, WeightUpdate))


def publish(settings: BrokerSettings, *batches) -> None:
    topology = Topology(settings.namespace, settings.delivery_limit)
    with Publisher(settings, "test-scheduler") as publisher:
        publisher.publish(*(Publish(topology.name(ROLLOUT_BATCHES), b) for b in batches))


def queue_depth(channel, settings: BrokerSettings) -> int:
    name = Topology(settings.namespace).name(ROLLOUT_BATCHES)
    return channel.queue_declare(name, passive=True).method.message_count


def base_logprobs(model: Path) -> dict[str, np.ndarray]:
    trainer = TorchTrainer(LearnerSettings(model_path=model))
    seqs = [
        TrainSequence(np.array(PROMPT), np.array(ids), np.zeros(len(ids), np.float32), 0.0)
        for ids in (GOOD, BAD)
    ]
    good, bad = trainer.logprobs(seqs)
    return {"good": good, "bad": bad}


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


@pytest.mark.slow
def test_learner_learns_commits_announces_and_drops_stale(
    broker_settings, raw_channel, tiny_model, tmp_path
):
    store_dir = tmp_path / "store"
    replay = tmp_path / "replay.jsonl"
    replay.write_text(  # two examples: one replayed, one held out as the drift probe
        replay_line(PROMPT, GOOD, stage=1, mode="seed")
        + replay_line(PROMPT, BAD, stage=2, mode="deepen")
    )
    config = LearnerConfig(
        broker=broker_settings,
        learner=LearnerSettings(
            model_path=tiny_model,
            checkpoint_dir=store_dir,
            groups_per_step=2,
            learning_rate=3e-3,
            max_staleness=1,
            metrics_port=0,
            replay_coef=0.1,
            replay_path=replay,
        ),
    )
    updates_queue = listen_to_weight_updates(raw_channel, broker_settings)
    lp = base_logprobs(tiny_model)
    publish(broker_settings, *(good_bad_batch(f"g{i}", lp) for i in range(4)))
    dropped_before = metric("hpcrl_learner_stale_groups_dropped_total")
    consumer, learner = build(config)
    with RunningConsumer(consumer):
        store = CheckpointStore(store_dir)
        wait_for(lambda: len(store.versions()) == 2, 180, "two committed versions")
        # version 2 now: a group sampled by version 0 is 2 behind, max_staleness 1: dropped.
        # g0 again is a redelivery of a trained batch: acked, not trained.
        publish(
            broker_settings, good_bad_batch("old", lp, policy_version=0), good_bad_batch("g0", lp)
        )
        wait_for(
            lambda: metric("hpcrl_learner_stale_groups_dropped_total") > dropped_before,
            60,
            "the stale group to be dropped",
        )
        wait_for(lambda: queue_depth(raw_channel, broker_settings) == 0, 60, "an empty queue")
        time.sleep(1.0)
    assert queue_depth(raw_channel, broker_settings) == 0  # everything acked, nothing pending
    assert not learner.pending and learner.failed is None
    versions = store.versions()
    assert [(v.version, v.parent_version) for v in versions] == [(1, 0), (2, 1)]
    assert [v.metrics["groups_trained"] for v in versions] == [2.0, 4.0]
    assert all(v.metrics["groups_per_step"] == 2.0 for v in versions)
    assert versions[0].metrics["reward_max"] == 100.0
    assert versions[0].metrics["reward_mean"] == 30.0
    # optimisation health, per step: entropy, clip fraction, grad norm, zero-variance share;
    # beta = 0: no reference, so no KL to version 0 (left out, not 0)
    for v in versions:
        assert 0 < v.metrics["entropy"] < np.log(learner.backend.vocab_size)
        assert 0 <= v.metrics["clip_fraction"] <= 1 and v.metrics["grad_norm"] > 0
        assert v.metrics["zero_variance_fraction"] == 0.0 and v.metrics["groups_skipped"] == 0
        assert "kl" not in v.metrics
        assert 0 < v.metrics["replay_nll"] < 50  # nats per token of a real model: finite, set
        assert 0 < v.metrics["taught_nll"] < 50
    assert metric("hpcrl_learner_entropy") == pytest.approx(versions[-1].metrics["entropy"])
    assert metric("hpcrl_learner_replay_nll") == pytest.approx(versions[-1].metrics["replay_nll"])
    assert metric("hpcrl_learner_taught_nll") == pytest.approx(versions[-1].metrics["taught_nll"])
    assert all(store.verify(v) for v in versions)
    updates = drain(raw_channel, updates_queue)
    assert [u.version for u in updates] == [1, 2]
    assert updates[-1].uri == str((store_dir / "v000002").resolve())
    assert updates[-1].format == "full" and updates[-1].checksum == versions[1].checksum
    # the committed version, loaded as a generator would, prefers the rewarded completion
    trained = TorchTrainer(LearnerSettings(model_path=store.path_of(versions[-1])))
    seqs = [
        TrainSequence(np.array(PROMPT), np.array(ids), np.zeros(len(ids), np.float32), 0.0)
        for ids in (GOOD, BAD)
    ]
    good, bad = (float(x.sum()) for x in trained.logprobs(seqs))
    assert good > float(lp["good"].sum()) + 0.3
    assert bad < float(lp["bad"].sum()) - 0.3


@pytest.mark.parametrize("on_arrival", [True, False], ids=["on arrival", "at the step"])
def test_a_group_is_trained_as_it_arrives_when_asked(
    broker_settings, tiny_model, tmp_path, on_arrival
):
    """With train_on_arrival the first group's passes run while the step waits for its
    second group; either way the step trains both and commits once."""
    store_dir = tmp_path / "store"
    config = LearnerConfig(
        broker=broker_settings,
        learner=LearnerSettings(
            model_path=tiny_model,
            checkpoint_dir=store_dir,
            groups_per_step=2,
            learning_rate=1e-3,
            metrics_port=0,
            train_on_arrival=on_arrival,
        ),
    )
    lp = base_logprobs(tiny_model)
    consumer, learner = build(config)
    with RunningConsumer(consumer):
        publish(broker_settings, good_bad_batch("first", lp))
        wait_for(lambda: len(learner.pending) == 1, 60, "the first group held")
        time.sleep(0.5)  # the handler has returned; nothing more is coming for it
        assert learner.backend.accumulated == (4 if on_arrival else 0)
        publish(broker_settings, good_bad_batch("second", lp))
        store = CheckpointStore(store_dir)
        wait_for(lambda: len(store.versions()) == 1, 120, "the step to commit")
    [version] = store.versions()
    assert version.metrics["groups_trained"] == 2.0
    assert version.metrics["tokens"] == 2 * 2 * (len(GOOD) + len(BAD))  # both groups, once
    assert learner.backend.accumulated == 0


@pytest.mark.parametrize("skip", [False, True], ids=["trained", "skipped"])
def test_zero_variance_groups_are_counted_and_skipped_when_asked(
    broker_settings, tiny_model, tmp_path, skip
):
    store_dir = tmp_path / "store"
    config = LearnerConfig(
        broker=broker_settings,
        learner=LearnerSettings(
            model_path=tiny_model,
            checkpoint_dir=store_dir,
            groups_per_step=2,
            beta=0.01,
            learning_rate=1e-3,
            metrics_port=0,
            skip_zero_variance_groups=skip,
        ),
    )
    lp = base_logprobs(tiny_model)
    flat = rollout_batch(
        "flat",
        [GOOD, BAD, GOOD, BAD],
        [-40.0] * 4,
        logprobs=[lp["good"], lp["bad"], lp["good"], lp["bad"]],
    )
    consumer, learner = build(config)
    with RunningConsumer(consumer):
        publish(broker_settings, flat)
        wait_for(lambda: len(learner.pending) == 1, 60, "the flat group held")
        time.sleep(0.5)
        assert learner.backend.accumulated == (0 if skip else 4)
        publish(broker_settings, good_bad_batch("preferring", lp))
        store = CheckpointStore(store_dir)
        wait_for(lambda: len(store.versions()) == 1, 120, "the step to commit")
    [version] = store.versions()
    assert version.metrics["groups_trained"] == 2.0  # acked and counted either way
    assert version.metrics["zero_variance_fraction"] == 0.5
    assert version.metrics["groups_skipped"] == (1.0 if skip else 0.0)
    assert version.metrics["tokens"] == (1 if skip else 2) * 2 * (len(GOOD) + len(BAD))
    assert version.metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # beta > 0: measured
    assert metric("hpcrl_learner_zero_variance_group_fraction") == 0.5


# --- crash: kill -9 between receiving and checkpointing, then restart --------------------------


def write_config(path: Path, settings: BrokerSettings, model: Path, store: Path) -> Path:
    path.write_text(f"""
[broker]
url = "{settings.url}"
namespace = "{settings.namespace}"
heartbeat_s = 5
delivery_limit = {settings.delivery_limit}
[logging]
format = "json"
[learner]
model_path = "{model}"
checkpoint_dir = "{store}"
groups_per_step = 2
learning_rate = 1e-3
metrics_port = 0
""")
    return path


def start_learner(
    config: Path, log: Path, hang: str | None = None, marker: Path | None = None
) -> subprocess.Popen:
    """The real learner CLI in its own process; with ``hang``, one that stops dead at that
    point and touches ``marker`` (tests/learner/hanging_learner.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCRL")}
    launcher = ["-m", "hpcrl_learner.cli"]
    if hang is not None:
        launcher = [str(HANGING_LEARNER), hang, str(marker)]
    return subprocess.Popen(
        [sys.executable, *launcher, "serve", "--config", str(config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("ab"),
    )


@pytest.mark.slow
@pytest.mark.parametrize("point", ["received", "before_commit", "after_commit"])
def test_kill_9_loses_no_batch_and_trains_none_twice(
    broker_settings, raw_channel, tiny_model, tmp_path, point
):
    store_dir = tmp_path / "store"
    config = write_config(tmp_path / "exp.toml", broker_settings, tiny_model, store_dir)
    log, marker = tmp_path / "learner.log", tmp_path / "hung"
    updates_queue = listen_to_weight_updates(raw_channel, broker_settings)
    lp = base_logprobs(tiny_model)
    publish(broker_settings, good_bad_batch("b1", lp), good_bad_batch("b2", lp))

    first = start_learner(config, log, hang=point, marker=marker)
    try:
        wait_for(marker.exists, 180, f"the learner to reach {point}", tail_of(log))
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    store = CheckpointStore(store_dir)
    committed_before = [v.version for v in store.versions()]
    assert committed_before == ([1] if point == "after_commit" else [])

    publish(broker_settings, good_bad_batch("b3", lp), good_bad_batch("b4", lp))
    second = start_learner(config, log)
    try:
        wait_for(
            lambda: len(store.versions()) >= 2, 180, "two versions after restart", tail_of(log)
        )
        wait_for(lambda: queue_depth(raw_channel, broker_settings) == 0, 60, "an empty queue")
        time.sleep(1.0)
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0, log.read_text()[-3000:]

    versions = store.versions()
    assert [(v.version, v.parent_version) for v in versions] == [(1, 0), (2, 1)]  # no gap/dup
    assert [v.metrics["groups_trained"] for v in versions] == [2.0, 4.0]
    states = StateStore(store_dir)
    step1, _ = states.load(1)
    step2, _ = states.load(2)
    assert sorted(step2.trained_ids) == ["b1", "b2", "b3", "b4"]  # each exactly once
    if point == "after_commit":
        assert sorted(step1.trained_ids) == ["b1", "b2"]  # redelivered b1, b2 not retrained
    assert not list(store_dir.glob(".staging-*"))
    assert not list((store_dir / "learner-state").glob(".staging-*"))
    assert queue_depth(raw_channel, broker_settings) == 0
    announced = [u.version for u in drain(raw_channel, updates_queue)]
    assert sorted(set(announced)) == [1, 2]  # v1 re-announced on restart is a duplicate id


class SkipsSteps:
    """The real torch backend, except that its first ``skips`` steps report a non-finite
    gradient and change nothing (as the real one does when a gradient is NaN)."""

    def __init__(self, real, skips: int) -> None:
        self.real, self.skips = real, skips

    def __getattr__(self, name: str):
        return getattr(self.real, name)

    def step(self, sequences):
        if self.skips > 0:
            self.skips -= 1
            return StepResult(skipped=True, **dict.fromkeys(NOT_MEASURED, math.nan))
        return self.real.step(sequences)


NOT_MEASURED = [f.name for f in dataclasses.fields(StepResult) if f.name != "skipped"]


def skipping_factory(skips: int):
    from hpcrl_learner.backends.torch import torch_backend

    return lambda *args: SkipsSteps(torch_backend(*args), skips)


def test_a_skipped_step_consumes_no_batch(broker_settings, raw_channel, tiny_model, tmp_path):
    """Skipped updates used to commit a version and ack every group of the step: the groups
    were lost without an error. Now they are retried, then dead-lettered with the reason."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    store_dir = tmp_path / "store"
    config = LearnerConfig(
        broker=broker_settings,
        learner=LearnerSettings(
            model_path=tiny_model, checkpoint_dir=store_dir, groups_per_step=2, metrics_port=0
        ),
    )
    lp = base_logprobs(tiny_model)
    publish(broker_settings, good_bad_batch("s0", lp), good_bad_batch("s1", lp))
    skipped_before = metric("hpcrl_learner_skipped_updates_total")
    consumer, learner = build(config, backend_factory=skipping_factory(1))
    store = CheckpointStore(store_dir)
    with RunningConsumer(consumer):
        wait_for(lambda: len(store.versions()) == 1, 120, "the retried step to commit")
        wait_for(lambda: queue_depth(raw_channel, broker_settings) == 0, 60, "an empty queue")
    assert metric("hpcrl_learner_skipped_updates_total") == skipped_before + 1
    assert store.versions()[0].metrics["groups_trained"] == 2.0  # both groups, trained once
    assert (
        raw_channel.queue_declare(topology.dlq(ROLLOUT_BATCHES), passive=True).method.message_count
        == 0
    )

    # A step that can never be taken: the groups end in the DLQ with the reason, no version.
    publish(broker_settings, good_bad_batch("n0", lp), good_bad_batch("n1", lp))
    consumer, learner = build(config, backend_factory=skipping_factory(100))
    with RunningConsumer(consumer):
        wait_for(
            lambda: (
                raw_channel.queue_declare(
                    topology.dlq(ROLLOUT_BATCHES), passive=True
                ).method.message_count
                == 2
            ),
            120,
            "both groups dead-lettered",
        )
    assert len(store.versions()) == 1 and learner.failed is None
    _method, props, _body = raw_channel.basic_get(topology.dlq(ROLLOUT_BATCHES), auto_ack=True)
    assert "update skipped: non-finite gradients" in props.headers["x-hpcrl-reason"]


def test_absurd_rewards_never_reach_training(broker_settings, raw_channel, tiny_model, tmp_path):
    """A reward of 1e200 made advantages NaN: it is refused at the boundary (dead-lettered),
    and the valid groups around it are trained; a reward within the contract but beyond the
    learner's bound is refused by the learner and counted as dropped."""
    import msgpack

    from hpcrl_common.messages import encode

    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    lp = base_logprobs(tiny_model)
    absurd = msgpack.unpackb(encode(good_bad_batch("absurd", lp)))
    absurd["samples"][0]["reward"] = 1e200
    # Within the contract's bound (1e6), beyond learner.max_abs_reward: refused by the learner.
    too_big = msgpack.unpackb(encode(good_bad_batch("too-big", lp)))
    too_big["samples"][0]["reward"] = 5e5
    topology.declare(raw_channel)
    for raw in (absurd, too_big):
        raw_channel.basic_publish(
            topology.work_exchange(ROLLOUT_BATCHES),
            topology.name(ROLLOUT_BATCHES),
            msgpack.packb(raw),
        )
    publish(broker_settings, good_bad_batch("v0", lp), good_bad_batch("v1", lp))
    config = LearnerConfig(
        broker=broker_settings,
        learner=LearnerSettings(
            model_path=tiny_model,
            checkpoint_dir=tmp_path / "store",
            groups_per_step=2,
            metrics_port=0,
        ),
    )
    consumer, _learner = build(config)
    store = CheckpointStore(tmp_path / "store")
    with RunningConsumer(consumer):
        wait_for(lambda: len(store.versions()) == 1, 120, "a step of the valid groups")
    assert store.versions()[0].metrics["groups_trained"] == 2.0
    # The group the learner refused is done too (the scheduler must not count it outstanding
    # for good); the one the contract refused at the boundary never reached it.
    assert store.versions()[0].metrics["groups_dropped"] == 1.0
    reasons = []
    while (got := raw_channel.basic_get(topology.dlq(ROLLOUT_BATCHES), auto_ack=True))[0]:
        reasons.append(got[1].headers["x-hpcrl-reason"])
    assert len(reasons) == 2 and all("reward" in reason for reason in reasons), reasons


def test_a_second_learner_on_the_same_store_refuses_to_start(broker_settings, tiny_model, tmp_path):
    """Two learners on one store would each commit "the next version" and announce weights
    the other never trained."""
    config = write_config(tmp_path / "exp.toml", broker_settings, tiny_model, tmp_path / "store")
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = start_learner(config, first_log)
    try:
        wait_for(
            lambda: (
                "learner ready" in first_log.read_text(errors="replace")
                if first_log.exists()
                else False
            ),
            120,
            "the first learner",
            tail_of(first_log),
        )
        second = start_learner(config, second_log)
        assert second.wait(120) == 2
        assert "another learner is writing the checkpoint store" in second_log.read_text()
        assert first.poll() is None  # the first one is untouched
    finally:
        first.terminate()
        first.wait(30)


def test_only_tokens_of_the_judged_text_within_bounds_are_trained(
    broker_settings, raw_channel, tiny_model, tmp_path
):
    """Issue 28, generator and scheduler roles: the text of a good completion judged with
    token ids [66] * 40; a batch of 8 x 8,003-token sequences; rewards of 1e6; a sample
    without the judged text's hash. Each is dead-lettered with its reason; the valid groups
    around them are trained."""
    from .conftest import judged_hash

    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    lp = base_logprobs(tiny_model)
    swapped = good_bad_batch("swapped", lp)
    swapped = swapped.model_copy(
        update={
            "samples": [
                swapped.samples[0].model_copy(
                    update={
                        "completion_token_ids": rollout_batch("x", [[66] * 40], [1.0])
                        .samples[0]
                        .completion_token_ids,
                        "sampling_logprobs": rollout_batch("x", [[66] * 40], [1.0])
                        .samples[0]
                        .sampling_logprobs,
                        "completion_sha256": judged_hash(GOOD),
                    }
                ),
                *swapped.samples[1:],
            ]
        }
    )
    long = rollout_batch("long", [[30 + i] * 8003 for i in range(8)], [100.0, -40.0] * 4)
    huge = rollout_batch("huge", [GOOD, BAD], [1e6, 0.5])
    unhashed = good_bad_batch("unhashed", lp)
    unhashed = unhashed.model_copy(
        update={
            "samples": [s.model_copy(update={"completion_sha256": None}) for s in unhashed.samples]
        }
    )
    publish(
        broker_settings,
        swapped,
        long,
        huge,
        unhashed,
        good_bad_batch("ok0", lp),
        good_bad_batch("ok1", lp),
    )
    config = LearnerConfig(
        broker=broker_settings,
        learner=LearnerSettings(
            model_path=tiny_model,
            checkpoint_dir=tmp_path / "store",
            groups_per_step=2,
            metrics_port=0,
        ),
    )
    consumer, learner = build(config)
    store = CheckpointStore(tmp_path / "store")
    with RunningConsumer(consumer):
        wait_for(lambda: len(store.versions()) == 1, 120, "a step of the valid groups")
    assert learner.failed is None and store.versions()[0].metrics["groups_trained"] == 2.0
    reasons = {}
    for _ in range(4):
        method, props, _body = raw_channel.basic_get(topology.dlq(ROLLOUT_BATCHES), auto_ack=True)
        assert method is not None, reasons
        reasons[props.message_id] = props.headers["x-hpcrl-reason"]
    assert "swapped/0: its 40 token ids decode to a text" in reasons["swapped"]
    assert "other than the one the benchmarker judged" in reasons["swapped"]
    assert "8007 tokens > max_sequence_tokens 4096" in reasons["long"]
    assert "learner.max_abs_reward" in reasons["huge"]
    assert "no completion_sha256" in reasons["unhashed"]


def test_with_skip_copied_lines_a_step_credits_only_the_edit(
    broker_settings, raw_channel, tiny_model, tmp_path
):
    """learner.skip_copied_lines over the broker: each sample's credit is made from its own
    tokens' text against the prompt's lines (the policy's tokenizer), and the groups train."""
    lp = base_logprobs(tiny_model)
    publish(broker_settings, good_bad_batch("edit0", lp), good_bad_batch("edit1", lp))
    config = LearnerConfig(
        broker=broker_settings,
        learner=LearnerSettings(
            model_path=tiny_model,
            checkpoint_dir=tmp_path / "store",
            groups_per_step=2,
            metrics_port=0,
            skip_copied_lines=True,
        ),
    )
    consumer, learner = build(config)
    tokenizer = learner.texts.tokenizer()
    prompt = np.array(tokenizer("a = 1;\nb = 2;\n", add_special_tokens=False)["input_ids"])
    child = np.array(tokenizer("a = 1;\nc = 3;\n", add_special_tokens=False)["input_ids"])
    [mask] = learner._credit(prompt, [child])
    credited = tokenizer.decode(child[mask > 0].tolist())
    assert "c = 3" in credited and "a = 1" not in credited
    store = CheckpointStore(tmp_path / "store")
    with RunningConsumer(consumer):
        wait_for(lambda: len(store.versions()) == 1, 120, "a step of both groups")
    assert learner.failed is None and store.versions()[0].metrics["groups_trained"] == 2.0
