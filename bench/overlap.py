"""Overlapped versus synchronous RL iterations over the real RabbitMQ, in one run.

The real generator service (its Generator on a Consumer, transformers backend, a tiny local
model) serves generate-requests; stand-ins play the rest of the loop with the real queues and
messages: a benchmarker that sleeps --bench-s per candidate (--bench-replicas at once) and
publishes bench-results; a scheduler that joins results into groups, publishes rollout
batches and paces requests; a learner that sleeps --learn-s per batch, commits a new version
to a CheckpointStore and announces it on weight-updates (the generator hot-loads it).

* synchronous (the paper's order): request i is sent only once version i exists, so
  generation, benchmarking and learning never overlap;
* overlapped: request i is sent as soon as version i - staleness exists (AReaL-style
  admission control), with that version as its floor.

Prints the wall time of N iterations both ways, the stage means (measured in the synchronous
run, where nothing contends), and last the ratio of the overlapped time per iteration to
max(gen, bench, learn); 1.0 is a perfect pipeline.

    .venv/bin/python bench/overlap.py [--iterations 8] [--group-size 4] [--bench-s 0.25]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

from hpcrl_common.broker import Consumer, Publish, Publisher
from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import (
    BenchResult,
    BenchSpec,
    Candidate,
    ChatMessage,
    GenerateRequest,
    HostInfo,
    RolloutBatch,
    RolloutSample,
    SamplingParams,
)
from hpcrl_common.topology import (
    BENCH_RESULTS,
    GENERATE_REQUESTS,
    ROLLOUT_BATCHES,
    WEIGHT_UPDATES,
    Topology,
)

HOST = HostInfo(
    hostname="sleeper",
    cpu_model="none",
    isa=["avx2"],
    cores=1,
    compiler="none",
    host_class="sleeper",
    peak_gflops=100.0,
)
PROMPT = [ChatMessage(role="user", content="Write a faster matrix multiplication kernel in C.")]


class Loop:
    """One run (sync or overlapped) on its own namespace."""

    def __init__(self, args: argparse.Namespace, models: list[Path], mode: str) -> None:
        self.args, self.models, self.mode = args, models, mode
        self.settings = BrokerSettings(
            url=args.url, namespace=f"overlap-{uuid.uuid4().hex[:8]}", prefetch=64
        )
        self.topology = Topology(self.settings.namespace, self.settings.delivery_limit)
        self.store_root = Path(tempfile.mkdtemp(prefix="hpcrl-overlap-store-"))
        self.store = CheckpointStore(self.store_root)
        self.version = 0
        self.version_changed = threading.Condition()
        self.groups: dict[str, list[BenchResult]] = {}
        self.gen_s: list[float] = []
        self.bench_s: list[float] = []
        self.learn_s: list[float] = []
        self.bench_first: dict[str, float] = {}
        self.lock = threading.Lock()
        self.learn_lock = threading.Lock()

    # --- stand-ins ------------------------------------------------------------------------

    def bench(self, candidate: Candidate, _delivery) -> list[Publish]:
        with self.lock:
            self.bench_first.setdefault(candidate.group_id, time.perf_counter())
        time.sleep(self.args.bench_s)
        result = BenchResult(
            id=candidate.id,
            group_id=candidate.group_id,
            index=candidate.index,
            status="success",
            reward=1.0 + candidate.index,
            gflops=1.0 + candidate.index,
            bench=candidate.bench,
            host=HOST,
            rollout=candidate.rollout,
        )
        return [Publish(self.topology.name(BENCH_RESULTS), result)]

    def schedule(self, result: BenchResult, _delivery) -> list[Publish]:
        with self.lock:
            group = self.groups.setdefault(result.group_id, [])
            if any(r.id == result.id for r in group):
                return []
            group.append(result)
            if len(group) < self.args.group_size:
                return []
            self.bench_s.append(time.perf_counter() - self.bench_first[result.group_id])
        samples = [
            RolloutSample(
                candidate_id=r.id,
                completion_token_ids=r.rollout.completion_token_ids,
                sampling_logprobs=r.rollout.sampling_logprobs,
                policy_version=r.rollout.policy_version,
                reward=r.reward,
                status=r.status,
            )
            for r in group
        ]
        batch = RolloutBatch(
            id=result.group_id,
            experiment="overlap",
            iteration=0,
            prompt_token_ids=group[0].rollout.prompt_token_ids,
            samples=samples,
            reward_mode="raw",
        )
        return [Publish(self.topology.name(ROLLOUT_BATCHES), batch)]

    def learn(self, batch: RolloutBatch, _delivery) -> list[Publish]:
        with self.learn_lock:  # one learner: versions are a sequence
            return self._learn()

    def _learn(self) -> list[Publish]:
        started = time.perf_counter()
        time.sleep(self.args.learn_s)
        version = self.version + 1
        staging = self.store.staging_dir(version)
        source = self.models[version % len(self.models)]
        for file in source.iterdir():
            shutil.copy2(file, staging / file.name)
        info = self.store.commit(staging, version, version - 1, "full", base_model="tiny")
        self.learn_s.append(time.perf_counter() - started)
        with self.version_changed:
            self.version = version
            self.version_changed.notify_all()
        update = info.weight_update(self.store_root, run=f"overlap/{self.store.run_id}")
        return [Publish("", update, exchange=self.topology.name(WEIGHT_UPDATES))]

    # --- the run --------------------------------------------------------------------------

    def wait_version(self, version: int) -> None:
        with self.version_changed:
            if not self.version_changed.wait_for(lambda: self.version >= version, timeout=600):
                raise TimeoutError(f"version {version} never came")

    def run(self) -> float:
        from hpcrl_generator.backends.transformers import TransformersSampler
        from hpcrl_generator.config import GeneratorSection
        from hpcrl_generator.service import Generator

        args = self.args
        sampler = TransformersSampler(self.models[0], dtype="float32")
        section = GeneratorSection(
            model_path=self.models[0],
            checkpoint_dir=self.store_root,
            backend="transformers",
            version_poll_s=0.02,
        )
        gen_consumer = Consumer(self.settings, "overlap-generator", concurrency=2)
        generator = Generator(sampler, section, gen_consumer.topology, replica="overlap")
        original = generator.on_request

        def timed(request, delivery):
            started = time.perf_counter()
            out = original(request, delivery)
            self.gen_s.append(time.perf_counter() - started)
            return out

        generator.on_request = timed  # type: ignore[method-assign]  (time each group)
        generator.attach(gen_consumer)
        bench_consumer = Consumer(self.settings, "overlap-bench", concurrency=args.bench_replicas)
        bench_consumer.subscribe("code-to-bench", self.bench)
        rest = Consumer(self.settings, "overlap-rest", concurrency=2)
        rest.subscribe(BENCH_RESULTS, self.schedule)
        rest.subscribe(ROLLOUT_BATCHES, self.learn)
        consumers = [gen_consumer, bench_consumer, rest]
        threads = [threading.Thread(target=c.run, daemon=True) for c in consumers]
        for thread in threads:
            thread.start()
        for consumer in consumers:
            consumer.connected.wait(30)
        try:
            with Publisher(self.settings, "overlap-scheduler") as publisher:
                started = time.perf_counter()
                for i in range(args.iterations):
                    floor = i if self.mode == "sync" else max(0, i - args.staleness)
                    self.wait_version(floor)
                    publisher.publish(
                        Publish(
                            self.topology.name(GENERATE_REQUESTS),
                            GenerateRequest(
                                id=f"it{i}",
                                experiment="overlap",
                                iteration=i,
                                mode="seed",
                                prompt=PROMPT,
                                group_size=args.group_size,
                                sampling=SamplingParams(
                                    temperature=1.0, max_tokens=args.max_tokens, seed=i
                                ),
                                min_policy_version=floor,
                                bench=BenchSpec(task="matmul", stage=1),
                            ),
                        )
                    )
                self.wait_version(args.iterations)
                return time.perf_counter() - started
        finally:
            for consumer in consumers:
                consumer.stop()
            for thread in threads:
                thread.join(15)
            with Publisher(self.settings, "overlap-cleanup") as cleanup:
                channel = cleanup._ensure_channel()
                self.topology.delete(channel)
            shutil.rmtree(self.store_root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--bench-s", type=float, default=0.25, help="sleep per candidate")
    parser.add_argument("--bench-replicas", type=int, default=2)
    parser.add_argument("--learn-s", type=float, default=0.5, help="sleep per learner step")
    parser.add_argument("--staleness", type=int, default=2, help="max_staleness (versions)")
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    args = parser.parse_args()

    from hpcrl_bootstrap.model import write_random_model

    root = Path(tempfile.mkdtemp(prefix="hpcrl-overlap-models-"))
    # Versions only need to be distinct full checkpoints of one shape: other seeds will do.
    models = [
        write_random_model(root / name, seed=seed) for seed, name in enumerate(("v0", "a", "b"))
    ]
    sync = Loop(args, models, "sync")
    sync_s = sync.run()
    overlap = Loop(args, models, "overlap")
    overlap_s = overlap.run()
    gen, bench, learn = (statistics.mean(x) for x in (sync.gen_s, sync.bench_s, sync.learn_s))
    n = args.iterations
    print(f"{n} iterations, G={args.group_size}, staleness {args.staleness}")
    print(f"stage means (sync run): gen {gen:.3f} s, bench {bench:.3f} s, learn {learn:.3f} s")
    print(f"synchronous: {sync_s:.2f} s ({sync_s / n:.3f} s/iteration)")
    print(f"overlapped:  {overlap_s:.2f} s ({overlap_s / n:.3f} s/iteration)")
    print(f"speed-up sync/overlapped: {sync_s / overlap_s:.2f}")
    print(
        f"overlapped s/iteration / max(gen, bench, learn): "
        f"{(overlap_s / n) / max(gen, bench, learn):.2f}"
    )


if __name__ == "__main__":
    main()
