"""Hypothesis strategies producing valid instances of every wire message."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from hpcrl_common.messages import (
    PACING_FIELDS,
    STATUSES,
    BenchResult,
    BenchSpec,
    Candidate,
    CandidateCommitment,
    ChatMessage,
    CommitmentEntry,
    GenerateRequest,
    HostInfo,
    PackedArray,
    RolloutBatch,
    RolloutData,
    RolloutSample,
    SamplingParams,
    Timing,
    WeightUpdate,
    candidate_id,
    commitment_id,
    text_sha256,
)
from hpcrl_common.rewards import MAX_ABS_REWARD, reward_for_status

ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,40}", fullmatch=True)
text = st.text(max_size=200)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
rewards = st.floats(-MAX_ABS_REWARD, MAX_ABS_REWARD, allow_nan=False)
text_hashes = st.from_regex(r"[0-9a-f]{64}", fullmatch=True)
positive = st.floats(min_value=1e-9, max_value=1e6, allow_nan=False)
stages = st.integers(1, 6)
timestamps = st.floats(min_value=0, max_value=4e9, allow_nan=False)


def token_ids(max_size: int = 64) -> st.SearchStrategy[PackedArray]:
    return st.lists(st.integers(0, 2**31 - 1), max_size=max_size).map(
        lambda xs: PackedArray.of(xs, "<i4")
    )


@st.composite
def aligned_tokens(draw: st.DrawFn) -> tuple[PackedArray, PackedArray]:
    n = draw(st.integers(0, 64))
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
    logprobs = draw(st.lists(st.floats(-50, 0, width=32), min_size=n, max_size=n))
    return PackedArray.of(tokens, "<i4"), PackedArray.of(np.array(logprobs), "<f4")


bench_specs = st.builds(
    BenchSpec,
    task=st.sampled_from(["matmul", "gemv"]),
    stage=stages,
    opt_level=st.sampled_from(["O0", "O1", "O3"]),
)


@st.composite
def rollout_data(draw: st.DrawFn) -> RolloutData:
    completion, logprobs = draw(aligned_tokens())
    return RolloutData(
        prompt_token_ids=draw(token_ids()),
        completion_token_ids=completion,
        sampling_logprobs=logprobs,
        policy_version=draw(st.integers(0, 10_000)),
        finish_reason=draw(st.none() | st.sampled_from(["stop", "length"])),
    )


generate_requests = st.builds(
    GenerateRequest,
    id=ids,
    experiment=ids,
    iteration=st.integers(0, 100),
    parent_id=st.none() | ids,
    mode=st.sampled_from(["seed", "deepen", "improve", "repair"]),
    prompt=st.lists(
        st.builds(ChatMessage, role=st.sampled_from(["system", "user"]), content=text),
        min_size=1,
        max_size=3,
    ),
    group_size=st.integers(1, 64),
    sampling=st.builds(
        SamplingParams,
        temperature=st.floats(0, 2),
        top_p=st.floats(0.01, 1),
        max_tokens=st.integers(1, 4096),
        seed=st.none() | st.integers(0, 2**31),
    ),
    min_policy_version=st.integers(0, 1000),
    bench=bench_specs,
    created_at=timestamps,
)


@st.composite
def candidates(draw: st.DrawFn) -> Candidate:
    group, index = draw(ids), draw(st.integers(0, 1023))
    return Candidate(
        id=candidate_id(group, index),
        group_id=group,
        index=index,
        completion=draw(text),
        bench=draw(bench_specs),
        rollout=draw(st.none() | rollout_data()),
        generator=draw(ids),
        created_at=draw(timestamps),
    )


hosts = st.builds(
    HostInfo,
    hostname=ids,
    cpu_model=text,
    isa=st.lists(st.sampled_from(["avx2", "avx512f"])),
    cores=st.integers(1, 256),
    compiler=text,
    host_class=ids,
    peak_gflops=st.just(1e6),
)


@st.composite
def timings(draw: st.DrawFn) -> Timing:
    runs = draw(st.lists(positive, min_size=1, max_size=10))
    return Timing(
        runs_s=runs,
        mean_s=float(np.mean(runs)),
        median_s=float(np.median(runs)),
        min_s=min(runs),
        max_s=max(runs),
        cv=float(np.std(runs) / np.mean(runs)),
    )


@st.composite
def bench_results(draw: st.DrawFn) -> BenchResult:
    group, index = draw(ids), draw(st.integers(0, 1023))
    status = draw(st.sampled_from(STATUSES))
    gflops = draw(positive) if status == "success" else None
    return BenchResult(
        id=candidate_id(group, index),
        group_id=group,
        index=index,
        status=status,
        reward=reward_for_status(status, gflops),
        gflops=gflops,
        timing=draw(timings()) if gflops is not None else None,
        techniques=draw(st.lists(st.sampled_from(["simd", "openmp", "prefetch"]), unique=True)),
        generalizes=draw(st.none() | st.booleans()),
        error=draw(text),
        source=draw(st.none() | text),
        bench=draw(bench_specs),
        compile_flags=draw(st.lists(st.sampled_from(["-O3", "-fopenmp", "-march=native"]))),
        host=draw(hosts),
        benchmarker=draw(ids),
        durations_s=draw(st.dictionaries(st.sampled_from(["compile", "verify", "time"]), positive)),
        rollout=draw(st.none() | rollout_data()),
        created_at=draw(timestamps),
        completion_sha256=draw(st.none() | text_hashes),
    )


@st.composite
def rollout_samples(draw: st.DrawFn) -> RolloutSample:
    completion, logprobs = draw(aligned_tokens())
    status = draw(st.sampled_from(STATUSES))
    # A failure keeps its penalty; a success's reward is within every reward mode's range.
    reward = (
        draw(st.floats(0.0, 100.0, allow_nan=False))
        if status == "success"
        else reward_for_status(status, None)
    )
    return RolloutSample(
        candidate_id=draw(ids),
        completion_token_ids=completion,
        sampling_logprobs=logprobs,
        policy_version=draw(st.integers(0, 1000)),
        reward=reward,
        status=status,
        completion_sha256=draw(st.none() | text_hashes),
    )


rollout_batches = st.builds(
    RolloutBatch,
    id=ids,
    experiment=ids,
    iteration=st.integers(0, 100),
    prompt_token_ids=token_ids(),
    samples=st.lists(rollout_samples(), min_size=1, max_size=4),
    reward_mode=st.sampled_from(["raw", "group_normalized", "parent_relative"]),
    host_class=ids,
    created_at=timestamps,
)


@st.composite
def weight_updates(draw: st.DrawFn) -> WeightUpdate:
    version = draw(st.integers(1, 10_000))
    return WeightUpdate(
        id=f"v{version}",
        version=version,
        parent_version=draw(st.integers(0, version - 1)),
        uri=f"/ckpt/v{version}",
        format=draw(st.sampled_from(["full", "lora"])),
        checksum="sha256:" + draw(st.from_regex(r"[0-9a-f]{64}", fullmatch=True)),
        base_model=draw(ids),
        metrics=draw(
            st.dictionaries(ids.filter(lambda k: k not in PACING_FIELDS), finite, max_size=3)
        ),
        groups_trained=draw(st.none() | st.integers(0, 2**40)),
        groups_dropped=draw(st.integers(0, 2**40)),
        groups_per_step=draw(st.none() | st.integers(1, 4096)),
        created_at=draw(timestamps),
    )


@st.composite
def candidate_commitments(draw: st.DrawFn) -> CandidateCommitment:
    group = draw(ids)
    indices = draw(st.lists(st.integers(0, 1023), min_size=1, max_size=8, unique=True))
    entries = [
        CommitmentEntry(
            index=index,
            rollout_sha256=draw(text_hashes),
            completion_sha256=text_sha256(body),
            completion=body,
        )
        for index, body in zip(
            indices,
            draw(st.lists(text, min_size=len(indices), max_size=len(indices))),
            strict=True,
        )
    ]
    return CandidateCommitment(
        id=commitment_id(group, entries),
        group_id=group,
        entries=entries,
        generator=draw(ids),
        created_at=draw(timestamps),
    )


ANY_MESSAGE = st.one_of(
    generate_requests,
    candidates(),
    candidate_commitments(),
    bench_results(),
    rollout_batches,
    weight_updates(),
)


# --- fixed examples for tests that need one concrete message ------------------------------


def sample_weight_update(version: int = 2) -> WeightUpdate:
    return WeightUpdate(
        id=f"v{version}",
        version=version,
        parent_version=version - 1,
        uri=f"/ckpt/v{version}",
        format="full",
        checksum="sha256:" + "ab" * 32,
        metrics={"loss": 0.5},
    )


def sample_rollout(n: int = 5) -> RolloutData:
    return RolloutData(
        prompt_token_ids=PackedArray.of(range(10), "<i4"),
        completion_token_ids=PackedArray.of(range(100, 100 + n), "<i4"),
        sampling_logprobs=PackedArray.of(np.linspace(-2, -0.1, n), "<f4"),
        policy_version=1,
    )


def sample_candidate(group: str = "g1", index: int = 0) -> Candidate:
    return Candidate(
        id=candidate_id(group, index),
        group_id=group,
        index=index,
        completion="void matmul_optimized(void) {}",
        bench=BenchSpec(task="matmul", stage=1),
        rollout=sample_rollout(),
    )


def sample_request(request_id: str = "r1") -> GenerateRequest:
    return GenerateRequest(
        id=request_id,
        experiment="exp",
        iteration=0,
        mode="seed",
        prompt=[ChatMessage(role="user", content="write a kernel")],
        group_size=2,
        bench=BenchSpec(task="matmul", stage=1),
    )
