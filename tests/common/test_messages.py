"""Wire format: every schema round-trips; malformed bodies fail with a precise reason."""

from __future__ import annotations

import contextlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcrl_common.messages import (
    BenchResult,
    Candidate,
    CandidateCommitment,
    CandidateCommitmentV1,
    MessageError,
    PackedArray,
    RolloutBatch,
    WeightUpdate,
    decode,
    encode,
    rollout_sha256,
    text_sha256,
)

from .strategies import ANY_MESSAGE, candidates, sample_candidate, sample_weight_update


@settings(max_examples=300, deadline=None)
@given(ANY_MESSAGE)
def test_every_schema_round_trips(message):
    body = encode(message)
    assert decode(body) == message
    assert decode(body, type(message)) == message


@given(candidates())
def test_arrays_travel_as_raw_little_endian_bytes(candidate):
    raw = msgpack.unpackb(encode(candidate))
    assert raw["schema"] == "candidate/1"
    if candidate.rollout is not None:
        packed = raw["rollout"]["completion_token_ids"]
        assert packed["dtype"] == "<i4" and isinstance(packed["data"], bytes)
        np.testing.assert_array_equal(
            np.frombuffer(packed["data"], "<i4"), candidate.rollout.completion_token_ids.numpy()
        )


def _body_of(message, **changes) -> bytes:
    raw = msgpack.unpackb(encode(message))
    for key, value in changes.items():
        if value is _DELETE:
            del raw[key]
        else:
            raw[key] = value
    return msgpack.packb(raw)


_DELETE = object()


def _weight_update() -> WeightUpdate:
    return sample_weight_update()


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"\xc1garbage", "not valid msgpack"),
        (msgpack.packb([1, 2, 3]), "must be a msgpack map"),
        (msgpack.packb({"id": "x"}), "missing field 'schema'"),
        (msgpack.packb({"schema": "candidate"}), "'<name>/<major>'"),
        (msgpack.packb({"schema": "telemetry/1", "id": "x"}), "unknown schema name 'telemetry'"),
        (msgpack.packb({"schema": "candidate/2", "id": "x"}), "unsupported major version '2'"),
        (msgpack.packb({"id": "a"}) + b"\x01", "trailing bytes"),
    ],
)
def test_structural_garbage_is_rejected_with_reason(body, reason):
    with pytest.raises(MessageError) as caught:
        decode(body)
    assert reason in caught.value.reason


def test_field_errors_name_the_field():
    update = WeightUpdate(
        id="v2",
        version=2,
        parent_version=1,
        uri="/c/v2",
        format="full",
        checksum="sha256:" + "0" * 64,
    )
    cases = {
        "version": ("two", "version: Input should be a valid integer"),
        "format": ("zip", "format: Input should be 'full' or 'lora'"),
        "uri": (_DELETE, "uri: Field required"),
        "checksum": ("md5:abc", "checksum: String should match pattern"),
        "extra": (1, "extra: Extra inputs are not permitted"),
        "parent_version": (5, "parent_version must be lower than version"),
    }
    for key, (value, reason) in cases.items():
        with pytest.raises(MessageError) as caught:
            decode(_body_of(update, **{key: value}))
        assert reason in caught.value.reason, (key, caught.value.reason)
        assert caught.value.reason.startswith("invalid weight-update/2")


def test_non_finite_numbers_and_bad_arrays_are_rejected():
    candidate = sample_candidate()
    raw = msgpack.unpackb(encode(candidate))
    raw["rollout"]["sampling_logprobs"]["data"] += b"\x00"
    with pytest.raises(MessageError, match="not a whole number of"):
        decode(msgpack.packb(raw))
    raw = msgpack.unpackb(encode(candidate))
    raw["rollout"]["sampling_logprobs"] = PackedArray.of([0.0] * 999, "<f4").model_dump()
    with pytest.raises(MessageError, match="sampling log-probs"):
        decode(msgpack.packb(raw))
    update = _weight_update()
    with pytest.raises(MessageError, match="finite"):
        decode(_body_of(update, metrics={"loss": float("nan")}))


def test_stable_ids_are_enforced():
    candidate = sample_candidate()
    with pytest.raises(MessageError, match="candidate id must be"):
        decode(_body_of(candidate, id="something-else"))


def test_oversized_and_wrong_queue():
    update = encode(_weight_update())
    with pytest.raises(MessageError, match="oversized message"):
        decode(update, max_bytes=len(update) - 1)
    with pytest.raises(MessageError, match="unexpected schema 'weight-update/2'"):
        decode(update, (Candidate, BenchResult))
    assert isinstance(decode(update, (RolloutBatch, WeightUpdate)), WeightUpdate)


def test_strict_types_reject_coercion():
    update = _weight_update()
    with pytest.raises(MessageError, match="version"):
        decode(_body_of(update, version="3"))
    with pytest.raises(MessageError, match="uri"):
        decode(_body_of(update, uri=b"/bytes/not/str"))


@pytest.mark.parametrize(
    "version", ["\u00b9", "\u0661", "\uff11", "01", "+1", " 1", "1_0", "99999999999999999999999"]
)
def test_a_schema_version_is_plain_ascii_digits(version):
    raw = msgpack.unpackb(encode(sample_candidate()))
    with pytest.raises(MessageError, match="unsupported major version"):
        decode(msgpack.packb({**raw, "schema": f"candidate/{version}"}))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=12), st.binary(max_size=64))
def test_decode_raises_nothing_but_message_error(version, garbage):
    raw = msgpack.unpackb(encode(sample_candidate()))
    for body in (msgpack.packb({**raw, "schema": f"candidate/{version}"}), garbage):
        with contextlib.suppress(MessageError):
            decode(body)


def _result_fields(**changes) -> dict:
    host = {
        "hostname": "n1",
        "cpu_model": "cpu",
        "isa": ["avx2"],
        "cores": 2,
        "compiler": "gcc",
        "host_class": "c",
        "peak_gflops": 200.0,
    }
    fields = {
        "schema": "bench-result/1",
        "id": "g/0",
        "group_id": "g",
        "index": 0,
        "status": "success",
        "reward": 12.5,
        "gflops": 12.5,
        "bench": {"task": "matmul", "stage": 1},
        "host": host,
    }
    return {**fields, **changes}


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"reward": 1e308, "gflops": 1e308}, "less than or equal to 1000000"),
        ({"reward": -1e200}, "greater than or equal to -1000000"),
        ({"reward": 99.0}, "does not follow from status 'success'"),
        ({"status": "compile_error", "gflops": None, "reward": 50.0}, "reward table gives -40.0"),
        ({"status": "verification_error", "gflops": None, "reward": -40.0}, "gives -10.0"),
        ({"reward": 300.0, "gflops": 300.0}, "above the host's theoretical peak 200.0"),
    ],
)
def test_a_result_whose_numbers_do_not_add_up_is_refused(changes, reason):
    assert decode(msgpack.packb(_result_fields()))  # the unchanged result is fine
    with pytest.raises(MessageError, match=reason):
        decode(msgpack.packb(_result_fields(**changes)))


def test_rollout_rewards_are_bounded():
    batch = msgpack.unpackb(encode(_sample_batch()))
    batch["samples"][0]["reward"] = 1e200
    with pytest.raises(MessageError, match=r"samples\.0\.reward"):
        decode(msgpack.packb(batch))


def _sample_batch() -> RolloutBatch:
    from hpcrl_common.messages import RolloutSample

    tokens = PackedArray.of([1, 2, 3], "<i4")
    sample = RolloutSample(
        candidate_id="g/0",
        completion_token_ids=tokens,
        sampling_logprobs=PackedArray.of([-0.1] * 3, "<f4"),
        policy_version=0,
        reward=1.0,
        status="success",
    )
    return RolloutBatch(
        id="g",
        experiment="e",
        iteration=0,
        prompt_token_ids=tokens,
        samples=[sample],
        reward_mode="raw",
    )


# --- weight-update/2 and the rollout batch's bounds (issue 28) ------------------------------


def _v1(**metrics: float) -> bytes:
    from hpcrl_common.messages import WeightUpdateV1

    return encode(
        WeightUpdateV1(
            id="v3",
            run="e/r",
            version=3,
            parent_version=2,
            uri="/c/3",
            format="full",
            checksum="sha256:" + "a" * 64,
            metrics={"loss": 0.5, **metrics},
        )
    )


def test_weight_update_1_is_still_read_with_its_pacing_figures_typed():
    update = decode(_v1(groups_trained=8.0, groups_dropped=1.0, groups_per_step=4.0), WeightUpdate)
    assert (update.groups_trained, update.groups_dropped, update.groups_per_step) == (8, 1, 4)
    assert update.metrics == {"loss": 0.5}
    assert decode(_v1(), WeightUpdate).groups_trained is None
    assert msgpack.unpackb(encode(update))["schema"] == "weight-update/2"


@pytest.mark.parametrize(
    ("figures", "reason"),
    [
        ({"groups_trained": -1e12}, "groups_trained: Input should be greater than or equal to 0"),
        ({"groups_trained": 2.5}, "groups_trained: Input should be a valid integer"),
        ({"groups_trained": 3.0, "groups_per_step": 0.0}, "groups_per_step"),
        ({"groups_trained": 1e300}, "groups_trained: Input should be less than or equal"),
    ],
)
def test_pacing_figures_out_of_range_are_refused_in_either_major(figures, reason):
    with pytest.raises(MessageError, match=reason) as caught:
        decode(_v1(**figures), WeightUpdate)
    assert caught.value.reason.startswith("invalid weight-update/1")
    raw = msgpack.unpackb(encode(sample_weight_update()))
    raw.update(
        {k: int(v) if float(v).is_integer() and abs(v) < 1e18 else v for k, v in figures.items()}
    )
    with pytest.raises(MessageError, match=reason.split(":")[0]):
        decode(msgpack.packb(raw))


def test_weight_update_2_keeps_pacing_figures_out_of_metrics():
    raw = msgpack.unpackb(encode(sample_weight_update()))
    raw["metrics"] = {"groups_trained": 4.0}
    with pytest.raises(MessageError, match="fields of weight-update/2, not metrics"):
        decode(msgpack.packb(raw))


def _batch(mode: str, reward: float, status: str = "success") -> dict:
    from hpcrl_common.messages import RolloutSample

    sample = RolloutSample(
        candidate_id="g/0",
        completion_token_ids=PackedArray.of([1], "<i4"),
        sampling_logprobs=PackedArray.of([-1.0], "<f4"),
        policy_version=0,
        reward=0.0,
        status="success",
    )
    raw = msgpack.unpackb(
        encode(
            RolloutBatch(
                id="g",
                experiment="e",
                iteration=0,
                prompt_token_ids=PackedArray.of([1], "<i4"),
                samples=[sample],
                reward_mode=mode,
            )
        )
    )  # type: ignore[arg-type]
    raw["samples"][0].update(reward=reward, status=status)
    return raw


@pytest.mark.parametrize(
    ("mode", "reward", "status", "reason"),
    [
        ("group_normalized", 1e6, "success", "outside \\[-100, 1000\\]"),
        ("group_normalized", -1e6, "success", "outside \\[-100, 1000\\]"),
        ("parent_relative", 1e5, "success", "outside \\[-100, 9900\\]"),
        ("raw", -500.0, "success", "outside \\[-100, 1e\\+06\\]"),
        ("raw", -1e6, "compile_error", "is not its penalty -40"),
    ],
)
def test_rollout_rewards_stay_in_their_modes_range(mode, reward, status, reason):
    with pytest.raises(MessageError, match=reason):
        decode(msgpack.packb(_batch(mode, reward, status)))
    decode(msgpack.packb(_batch(mode, 100.0 if status == "success" else -40.0, status)))


def test_a_commitment_covers_everything_the_learner_takes_from_a_candidate():
    candidate = sample_candidate("g7", 2)
    assert candidate.rollout is not None
    commitment = CandidateCommitment.of([candidate, sample_candidate("g7", 3)], "gen-a")
    assert decode(encode(commitment), CandidateCommitment) == commitment
    assert commitment.id.startswith("g7@") and commitment.generator == "gen-a"
    [entry, _] = commitment.entries
    assert entry.completion_sha256 == text_sha256(candidate.completion)
    assert entry.rollout_sha256 == rollout_sha256(candidate.rollout)
    # The dtype a producer chose does not change it ...
    rollout = candidate.rollout
    wider = rollout.model_copy(
        update={
            "completion_token_ids": PackedArray.of(rollout.completion_token_ids.numpy(), "<i8"),
            "sampling_logprobs": PackedArray.of(rollout.sampling_logprobs.numpy(), "<f8"),
        }
    )
    assert rollout_sha256(wider) == entry.rollout_sha256
    # ... every field the learner reads does.
    ids = rollout.completion_token_ids.numpy()
    changed = {
        "completion ids": {"completion_token_ids": PackedArray.of([*ids[:-1], 66], "<i4")},
        "prompt ids": {"prompt_token_ids": PackedArray.of([1, 2, 3], "<i4")},
        "log-probs": {
            "sampling_logprobs": PackedArray.of(rollout.sampling_logprobs.numpy() - 0.5, "<f4")
        },
        "version": {"policy_version": rollout.policy_version + 1},
        "finish reason": {"finish_reason": "length"},
    }
    for what, update in changed.items():
        assert rollout_sha256(rollout.model_copy(update=update)) != entry.rollout_sha256, what


def test_a_commitment_under_another_id_or_twice_one_index_is_refused():
    commitment = CandidateCommitment.of([sample_candidate("g7", 2)])
    raw = msgpack.unpackb(encode(commitment))
    with pytest.raises(MessageError, match="commitment id must be 'g7@"):
        decode(msgpack.packb({**raw, "id": "g7@0000000000000000"}))
    twice = {**raw, "entries": raw["entries"] * 2}
    with pytest.raises(MessageError, match="a candidate index is committed twice"):
        decode(msgpack.packb(twice))
    with pytest.raises(ValueError, match="one group"):
        CandidateCommitment.of([sample_candidate("g7", 2), sample_candidate("g8", 2)])


def test_a_commitment_carries_each_candidates_text_under_its_hash():
    """candidate-commitment/2: the text a winner's second measurement compiles, checked at
    the boundary against the hash the id and the results are held to."""
    candidate = sample_candidate("g7", 2)
    commitment = CandidateCommitment.of([candidate])
    assert commitment.schema_tag() == "candidate-commitment/2"
    [entry] = commitment.entries
    assert entry.completion == candidate.completion
    raw = msgpack.unpackb(encode(commitment))
    swapped = {**raw["entries"][0], "completion": "```c\nvoid fast(void) {}\n```\n"}
    with pytest.raises(MessageError, match=r"completion_sha256 .* is not the hash of its"):
        decode(msgpack.packb({**raw, "entries": [swapped]}))
    no_text = {k: v for k, v in raw["entries"][0].items() if k != "completion"}
    with pytest.raises(MessageError, match=r"entries\.0\.completion: Field required"):
        decode(msgpack.packb({**raw, "entries": [no_text]}))


def test_a_commitment_of_major_1_is_still_read_as_it_is():
    """A generator of the release before commits with hashes only: read (a rolling upgrade)
    as a CandidateCommitmentV1, under the same id; a /1 with texts is not one."""
    commitment = CandidateCommitment.of([sample_candidate("g7", 2), sample_candidate("g7", 3)])
    raw = msgpack.unpackb(encode(commitment))
    hashes = [{k: v for k, v in e.items() if k != "completion"} for e in raw["entries"]]
    old = decode(
        msgpack.packb({**raw, "schema": "candidate-commitment/1", "entries": hashes}),
        CandidateCommitment,
    )
    assert isinstance(old, CandidateCommitmentV1) and old.id == commitment.id
    assert [(e.index, e.completion_sha256) for e in old.entries] == [
        (e.index, e.completion_sha256) for e in commitment.entries
    ]
    with pytest.raises(MessageError, match=r"entries\.0\.completion: Extra inputs"):
        decode(msgpack.packb({**raw, "schema": "candidate-commitment/1"}))
    with pytest.raises(MessageError, match="this build reads 2, 1"):
        decode(msgpack.packb({**raw, "schema": "candidate-commitment/3"}))
