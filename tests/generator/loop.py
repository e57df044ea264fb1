"""The weight loop over the real RabbitMQ, run with either backend's sampler."""

from __future__ import annotations

import time
from pathlib import Path

from hpcrl_common.broker import Consumer, Publish, Publisher
from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_common.messages import Candidate, ChatMessage
from hpcrl_common.topology import CODE_TO_BENCH, GENERATE_REQUESTS, WEIGHT_UPDATES
from hpcrl_generator.config import GeneratorSection
from hpcrl_generator.service import Generator

from ..conftest import RunningConsumer
from ..support.waiting import wait_for
from .conftest import commit_version
from .helpers import request, take_candidates, tokens


def run_weight_loop(
    sampler,
    models: dict[str, Path],
    broker_settings,
    raw_channel,
    store_root: Path,
    reference_v1: list[int],
    prompt: list[ChatMessage] | None = None,
) -> dict[str, Candidate]:
    """v0 candidates → a request with floor 1 waits → the learner commits and announces v1 →
    the generator reloads → the waiting request's candidates carry v1 and its greedy tokens.

    Every request has ``prompt`` (default: the short PROMPT); returns all candidates by id:
    g0 (v0, greedy), g1 and g2 (v1, greedy), g3 (v1, seeded sampling)."""
    assert sampler.version == 0
    store = CheckpointStore(store_root)
    section = GeneratorSection(
        model_path=models["v0"],
        checkpoint_dir=store_root,
        backend=sampler.backend,
        poll_manifest=False,  # the announcement alone must be enough
        version_poll_s=0.2,
        version_wait_s=120,
    )
    consumer = Consumer(broker_settings, "generator-test", concurrency=section.handler_threads)
    generator = Generator(sampler, section, consumer.topology, replica="loop-test")
    generator.start()
    generator.attach(consumer)
    out_queue = consumer.topology.name(CODE_TO_BENCH)
    got: dict[str, Candidate] = {}
    with RunningConsumer(consumer), Publisher(broker_settings, "scheduler-test") as publisher:
        requests_queue = consumer.topology.name(GENERATE_REQUESTS)
        publisher.publish(Publish(requests_queue, request("g0", group_size=2, prompt=prompt)))
        wait_for(
            lambda: (
                take_candidates(raw_channel, out_queue, got) is not None
                and {"g0/0", "g0/1"} <= got.keys()
            ),
            60,
            "v0 candidates",
        )
        v0_tokens = tokens(got["g0/0"])
        assert got["g0/0"].rollout.policy_version == 0
        assert tokens(got["g0/1"]) == v0_tokens  # greedy: the group is one completion

        publisher.publish(
            Publish(requests_queue, request("g1", group_size=2, floor=1, prompt=prompt))
        )
        time.sleep(3)  # plenty of time to sample from the old policy, if it wrongly would
        take_candidates(raw_channel, out_queue, got)
        assert not any(key.startswith("g1/") for key in got), "sampled below the floor"

        info = commit_version(store, models["v1"], 1)  # what the learner does
        publisher.publish(
            Publish(
                "",
                info.weight_update(store.root, run=f"exp/{store.run_id}"),
                exchange=consumer.topology.name(WEIGHT_UPDATES),
            )
        )
        wait_for(
            lambda: (
                take_candidates(raw_channel, out_queue, got) is not None
                and {"g1/0", "g1/1"} <= got.keys()
            ),
            60,
            "v1 candidates",
        )
        publisher.publish(Publish(requests_queue, request("g2", group_size=1, prompt=prompt)))
        publisher.publish(
            Publish(
                requests_queue, request("g3", group_size=3, temperature=1.0, seed=3, prompt=prompt)
            )
        )
        wait_for(
            lambda: (
                take_candidates(raw_channel, out_queue, got) is not None
                and {"g2/0", "g3/0", "g3/1", "g3/2"} <= got.keys()
            ),
            60,
            "requests without a floor after the reload",
        )
    for key in ("g1/0", "g1/1", "g2/0"):
        assert got[key].rollout.policy_version == 1
        assert tokens(got[key]) == reference_v1  # the same as a fresh load of v1
    assert all(got[f"g3/{i}"].rollout.policy_version == 1 for i in range(3))
    assert reference_v1 != v0_tokens
    assert generator.tracker.loaded == 1 and sampler.version == 1
    return got
