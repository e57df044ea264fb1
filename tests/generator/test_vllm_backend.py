"""The vLLM backend for real (vLLM's CPU build, tiny local model): one engine per module."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: run deploy/local/install-vllm.sh")

from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_common.messages import (
    Candidate,
    RolloutBatch,
    RolloutSample,
    SamplingParams,
    WeightUpdate,
)
from hpcrl_common.topology import Topology
from hpcrl_generator.backends.transformers import TransformersSampler
from hpcrl_generator.config import GeneratorSection
from hpcrl_generator.prompt import render_prompt
from hpcrl_generator.sampling import GroupJob
from hpcrl_generator.service import Generator

from .conftest import commit_version
from .helpers import LONG_PROMPT, PROMPT, assert_same_samples, save_lora_adapter
from .loop import run_weight_loop
from .test_transformers_backend import teacher_forced_logprobs

if TYPE_CHECKING:
    from hpcrl_generator.backends.vllm import VLLMSampler

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=5)
MAX_MODEL_LEN = 1024  # LONG_PROMPT spans several prefix-cache blocks, plus a completion


def start_engine(model: Path, **lora: bool | int) -> VLLMSampler:
    from hpcrl_generator.backends.vllm import VLLMSampler

    return VLLMSampler(
        model,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        kv_cache_space_gib=1,
        cpu_threads=1,  # as the demo runs it
        **lora,
    )


def engine_workers() -> list[int]:
    """Pids of the vLLM worker processes this test process started (at any depth)."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        names[int(entry.name)] = stat[stat.index("(") + 1 : stat.rindex(")")]
        parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    return [pid for pid, name in names.items() if name.startswith("VLLM::Worker") and descends(pid)]


@pytest.fixture(scope="module")
def engine(tiny_models):
    sampler = start_engine(tiny_models["v0"])
    yield sampler
    sampler.close()


@pytest.fixture(scope="module")
def reference(tiny_models):
    return {name: TransformersSampler(tiny_models[name]) for name in ("v0", "v1")}


def test_cpu_threads_give_the_worker_that_many_threads_on_every_core(engine):
    """generator.cpu_threads = 1: vLLM's own binding would pin the worker to one core."""
    workers = engine_workers()
    assert workers, "no vLLM worker process found below this test process"
    every_core = os.sched_getaffinity(0)
    for pid in workers:
        environ = dict(
            item.split("=", 1)
            for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
            if "=" in item
        )
        assert environ.get("OMP_NUM_THREADS") == "1"
        assert environ.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind"
        for thread in Path(f"/proc/{pid}/task").iterdir():
            assert os.sched_getaffinity(int(thread.name)) == every_core
    # The settings lasted only while the engine started.
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ


def test_greedy_output_and_logprobs_match_transformers(engine, reference):
    ids = render_prompt(engine.tokenizer, PROMPT)
    assert ids == render_prompt(reference["v0"].tokenizer, PROMPT)
    got = engine.generate(ids, 3, GREEDY)
    want = reference["v0"].generate(ids, 1, GREEDY)[0]
    assert len(got) == 3 and all(s.token_ids == want.token_ids for s in got)
    assert got[0].logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert got[0].finish_reason == want.finish_reason


def test_sampled_logprobs_are_the_raw_distributions(engine, reference):
    ids = render_prompt(engine.tokenizer, PROMPT)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=5)
    samples = engine.generate(ids, 4, params)
    assert [s.token_ids for s in samples] == [s.token_ids for s in engine.generate(ids, 4, params)]
    assert len({tuple(s.token_ids) for s in samples}) > 1
    model = reference["v0"].model
    for sample in samples:
        assert sample.logprobs == pytest.approx(
            teacher_forced_logprobs(model, ids, sample.token_ids), abs=1e-3
        )


def test_groups_sampled_in_one_call_are_what_each_gets_alone(engine):
    """Batching across groups changes neither a group's samples nor their log-probs."""
    short, long = (render_prompt(engine.tokenizer, p) for p in (PROMPT, LONG_PROMPT))
    jobs = [
        GroupJob(short, 3, GREEDY),
        GroupJob(long, 4, SAMPLED),
        GroupJob(short, 2, SAMPLED.model_copy(update={"seed": 9, "max_tokens": 6})),
    ]
    together = engine.generate_groups(jobs)
    assert [len(group) for group in together] == [3, 4, 2]
    assert all(len(s.token_ids) <= 6 for s in together[2])
    for job, group in zip(jobs, together, strict=True):
        assert_same_samples(
            group, engine.generate(job.prompt_token_ids, job.n, job.sampling), tol=1e-3
        )


def test_seeded_groups_longer_than_a_default_step_budget_are_sampled_together(engine):
    """Seeded groups whose prompts overflow vLLM's default step budget (4,096 tokens on CPU):
    a prompt prefilled in chunks rewinds its request's generator, which a CPU generator
    cannot do, and the engine died. The CPU budget holds every sequence's whole context."""
    ids = render_prompt(
        engine.tokenizer,
        [LONG_PROMPT[0], LONG_PROMPT[1].model_copy(update={"content": LONG_PROMPT[1].content * 2})],
    )
    jobs = [GroupJob(ids, 4, SAMPLED.model_copy(update={"seed": seed})) for seed in (1, 2)]
    assert sum(job.n for job in jobs) * len(ids) > 4096 and len(ids) + 10 <= MAX_MODEL_LEN
    together = engine.generate_groups(jobs)
    for job, group in zip(jobs, together, strict=True):
        assert_same_samples(
            group, engine.generate(job.prompt_token_ids, job.n, job.sampling), tol=1e-3
        )


def test_hot_reload_equals_a_fresh_load_and_keeps_tied_embeddings_tied(
    engine, reference, tiny_models
):
    ids = render_prompt(engine.tokenizer, PROMPT)
    v0 = engine.generate(ids, 1, GREEDY)[0]
    engine.load_weights(tiny_models["v1"], 1)
    embed_sum, head_sum = engine.weight_fingerprint()[0]
    assert embed_sum == head_sum
    v1 = engine.generate(ids, 1, GREEDY)[0]
    fresh_v1 = reference["v1"].generate(ids, 1, GREEDY)[0]
    assert v1.token_ids == fresh_v1.token_ids and v1.token_ids != v0.token_ids
    assert v1.logprobs == pytest.approx(fresh_v1.logprobs, abs=1e-4)
    engine.load_weights(tiny_models["v0"], 0)  # back to the base: the same as at start
    again = engine.generate(ids, 1, GREEDY)[0]
    assert again.token_ids == v0.token_ids
    assert again.logprobs == pytest.approx(v0.logprobs, abs=1e-5)


def test_a_checkpoint_of_another_shape_is_refused_and_the_engine_lives(
    engine, tiny_models, tmp_path
):
    store = CheckpointStore(tmp_path)
    info = commit_version(store, tiny_models["wide"], 1)
    section = GeneratorSection(
        model_path=tiny_models["v0"], checkpoint_dir=tmp_path, poll_manifest=False
    )
    generator = Generator(engine, section, Topology("t"), replica="r")
    update: WeightUpdate = info.weight_update(store.root, run=f"exp/{store.run_id}")
    generator.on_weight_update(update, None)
    assert generator.tracker.loaded == 0 and engine.version == 0
    ids = render_prompt(engine.tokenizer, PROMPT)
    assert len(engine.generate(ids, 1, GREEDY)[0].token_ids) > 0


# --- the prefix cache across reloads ----------------------------------------------------


def long_prompt_ids(engine: VLLMSampler) -> list[int]:
    """LONG_PROMPT's ids, checked to fill three or more prefix-cache blocks and part of one."""
    cache = engine.llm.llm_engine.vllm_config.cache_config
    ids = render_prompt(engine.tokenizer, LONG_PROMPT)
    assert cache.enable_prefix_caching
    assert len(ids) // cache.block_size >= 3 and len(ids) % cache.block_size, (
        f"{len(ids)} prompt tokens, blocks of {cache.block_size}"
    )
    return ids


def sampled_past_the_cache(engine: VLLMSampler, ids: list[int], n: int) -> list[list[int]]:
    """SAMPLED's token ids for a request with a new cache salt: no cached block can match it,
    so it is computed from the loaded weights alone, as a freshly started engine would."""
    from vllm import SamplingParams as VLLMSamplingParams

    params = VLLMSamplingParams(
        n=n,
        temperature=SAMPLED.temperature,
        top_p=SAMPLED.top_p,
        max_tokens=SAMPLED.max_tokens,
        seed=SAMPLED.seed,
        logprobs=0,
    )
    (output,) = engine.llm.generate(
        [{"prompt_token_ids": ids, "cache_salt": uuid.uuid4().hex}],
        params,
        use_tqdm=False,
        lora_request=engine._lora,
    )
    return [list(completion.token_ids) for completion in output.outputs]


def assert_equals_a_fresh_load(
    engine: VLLMSampler, fresh: TransformersSampler, ids: list[int]
) -> None:
    """Greedy: a fresh load's tokens and log-probs. Seeded sampling: a fresh load's log-probs
    of the sampled tokens, and the tokens of a request that bypasses the prefix cache."""
    assert_same_samples(engine.generate(ids, 1, GREEDY), fresh.generate(ids, 1, GREEDY))
    sampled = engine.generate(ids, 3, SAMPLED)
    assert [s.token_ids for s in sampled] == sampled_past_the_cache(engine, ids, 3)
    for sample in sampled:
        assert sample.logprobs == pytest.approx(
            teacher_forced_logprobs(fresh.model, ids, sample.token_ids), abs=1e-4
        )


def test_a_reload_never_reuses_the_old_versions_prefix_cache(engine, reference, tiny_models):
    ids = long_prompt_ids(engine)
    engine.generate(ids, 1, GREEDY)  # v0's keys and values of the prompt are now cached
    engine.load_weights(tiny_models["v1"], 1)
    assert_equals_a_fresh_load(engine, reference["v1"], ids)
    engine.load_weights(tiny_models["v0"], 0)  # and back, past v1's cached blocks
    assert_equals_a_fresh_load(engine, reference["v0"], ids)


@pytest.fixture
def lora_engine(tiny_models: dict[str, Path]) -> Iterator[VLLMSampler]:
    sampler = start_engine(tiny_models["v0"], enable_lora=True, max_lora_rank=8)
    yield sampler
    sampler.close()


def merged(base: Path, adapter: Path, version: int) -> TransformersSampler:
    fresh = TransformersSampler(base)
    fresh.load_weights(adapter, version, "lora")
    return fresh


def test_lora_switches_and_a_return_to_full_weights_equal_fresh_loads(
    lora_engine, reference, tiny_models, tmp_path
):
    ids = long_prompt_ids(lora_engine)
    lora_engine.generate(ids, 1, GREEDY)  # the base's blocks are cached
    for version in (1, 2):
        adapter = save_lora_adapter(tiny_models["v0"], tmp_path / f"v{version}", seed=version)
        lora_engine.load_weights(adapter, version, "lora")
        assert_equals_a_fresh_load(lora_engine, merged(tiny_models["v0"], adapter, version), ids)
    lora_engine.load_weights(tiny_models["v1"], 3)  # full weights again, no adapter
    assert_equals_a_fresh_load(lora_engine, reference["v1"], ids)


def rollout_batch(group: list[Candidate]) -> RolloutBatch:
    """What the scheduler sends the learner for one group (rewards do not matter here)."""
    samples = []
    for candidate in group:
        rollout = candidate.rollout
        assert rollout is not None
        samples.append(
            RolloutSample(
                candidate_id=candidate.id,
                completion_token_ids=rollout.completion_token_ids,
                sampling_logprobs=rollout.sampling_logprobs,
                policy_version=rollout.policy_version,
                reward=float(candidate.index),
                status="success",
            )
        )
    assert group[0].rollout is not None
    return RolloutBatch(
        id=group[0].group_id,
        experiment="test",
        iteration=0,
        prompt_token_ids=group[0].rollout.prompt_token_ids,
        samples=samples,
        reward_mode="raw",
    )


def by_group(candidates: list[Candidate]) -> list[list[Candidate]]:
    groups: dict[str, list[Candidate]] = {}
    for candidate in candidates:
        groups.setdefault(candidate.group_id, []).append(candidate)
    return list(groups.values())


def learner_view(
    candidates: list[Candidate], policy: Path, autocast: str = "off"
) -> tuple[float, np.ndarray]:
    """What the learner makes of ``candidates`` on ``policy``: its step metric ``sampler_kl``
    (learning rate 0, so the step changes nothing) and its log-probs minus the sampler's.
    ``autocast`` off by default: the sampler computes in float32, so the two must agree to
    float rounding; bf16 autocast (the learner's default where the CPU has it) adds its own
    rounding."""
    from hpcrl_learner.backends.torch import TorchTrainer
    from hpcrl_learner.batches import prepare_group
    from hpcrl_learner.config import LearnerSettings

    settings = LearnerSettings(
        model_path=policy, device="cpu", learning_rate=0.0, autocast=autocast
    )
    trainer = TorchTrainer(settings)
    sequences = [
        seq
        for group in by_group(candidates)
        for seq in prepare_group(
            rollout_batch(group),
            1,
            adv_eps=settings.adv_eps,
            vocab_size=trainer.vocab_size,
            max_sequence_tokens=settings.max_sequence_tokens,
        ).sequences
    ]
    sampler_kl = trainer.step(sequences).sampler_kl
    trainer_logprobs = np.concatenate(trainer.logprobs(sequences))
    return sampler_kl, trainer_logprobs - np.concatenate([s.sampling_logprobs for s in sequences])


@pytest.mark.broker
def test_weight_loop_over_rabbitmq_and_the_learner_agrees_with_the_sampler(
    engine, reference, tiny_models, broker_settings, raw_channel, tmp_path
):
    ids = long_prompt_ids(engine)  # g0 caches it under v0; g1 to g3 are sampled from v1
    want = reference["v1"].generate(ids, 1, GREEDY)[0].token_ids
    got = run_weight_loop(
        engine,
        tiny_models,
        broker_settings,
        raw_channel,
        tmp_path / "store",
        want,
        prompt=LONG_PROMPT,
    )
    after_v1 = [c for c in got.values() if c.group_id != "g0"]
    sampler_kl, delta = learner_view(after_v1, tiny_models["v1"])
    per_token_k3 = np.expm1(delta) - delta  # k3 of KL(sampler || trainer), per token
    assert len(delta) > 20
    assert sampler_kl <= 1e-3 and per_token_k3.max() <= 1e-3
    # With the learner's default autocast (bf16 where the CPU multiplies it natively) the
    # rounding adds up to a few 1e-3 on this spiky random model (4e-3 seen); stale weights
    # gave ~10, so the weights are still told apart by three orders of magnitude.
    default_kl, _ = learner_view(after_v1, tiny_models["v1"], autocast="auto")
    assert default_kl <= 5e-2
    assert np.abs(delta).mean() <= 1e-4, np.abs(delta).max()
