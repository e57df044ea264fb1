"""Message schemas that cross a queue, and their msgpack wire format.

Every message is a msgpack map with a ``schema`` key (``"<name>/<major>"``) and an ``id``.
Numeric arrays travel as :class:`PackedArray` (raw little-endian bytes plus dtype), never as
lists of Python numbers. :func:`decode` validates everything at the boundary and raises
:class:`MessageError` with a precise, human-readable reason; consumers dead-letter with it.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgpack
import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

from hpcrl_common.rewards import (
    FAILURE_REWARDS,
    MAX_ABS_REWARD,
    MAX_GFLOPS,
    REWARD_RANGES,
    STATUS_NAMES,
    reward_for_status,
)

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# --- shared field types -------------------------------------------------------------------

MessageId = Annotated[
    str, StringConstraints(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:/@+-]+$")
]
ShortText = Annotated[str, StringConstraints(max_length=256)]
LongText = Annotated[str, StringConstraints(max_length=1_000_000)]
ErrorText = Annotated[str, StringConstraints(max_length=64_000)]
Stage = Annotated[int, Field(ge=1, le=6)]
Version = Annotated[int, Field(ge=0)]
Timestamp = Annotated[float, Field(ge=0)]
Gflops = Annotated[float, Field(ge=0, le=MAX_GFLOPS)]
Reward = Annotated[float, Field(ge=-MAX_ABS_REWARD, le=MAX_ABS_REWARD)]
# sha256 of a completion's text (UTF-8), lower-case hex: what ties token ids to judged text.
TextHash = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
# A count of groups over a whole run (pacing figures); far above any real run, far below
# where a float or SQLite integer loses precision.
GroupCount = Annotated[int, Field(ge=0, le=2**40)]
OptLevel = Literal["O0", "O1", "O2", "O3"]
Mode = Literal["seed", "deepen", "improve", "repair"]
# "success" and the failures of hpcrl_common.rewards.FAILURES, in that table's order.
Status = Literal[STATUS_NAMES]  # type: ignore[valid-type]
STATUSES: tuple[str, ...] = STATUS_NAMES
MAX_ARRAY_BYTES = 8 * 1024 * 1024


class Strict(BaseModel):
    """Base for every wire model: strict types, no unknown keys, finite floats, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class PackedArray(Strict):
    """A 1-D numeric array as raw little-endian bytes."""

    dtype: Literal["<i4", "<i8", "<f4", "<f8"]
    data: Annotated[bytes, Field(max_length=MAX_ARRAY_BYTES)]

    @model_validator(mode="after")
    def _whole_items(self) -> PackedArray:
        itemsize = np.dtype(self.dtype).itemsize
        if len(self.data) % itemsize:
            raise ValueError(f"{len(self.data)} bytes is not a whole number of {self.dtype} items")
        return self

    @classmethod
    def of(cls, values: Any, dtype: str) -> PackedArray:
        array = np.ascontiguousarray(np.asarray(values, dtype=np.dtype(dtype)).ravel())
        return cls(dtype=dtype, data=array.tobytes())  # type: ignore[arg-type]

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype))

    def __len__(self) -> int:
        return len(self.data) // np.dtype(self.dtype).itemsize


def _is_int_array(array: PackedArray) -> bool:
    return array.dtype in ("<i4", "<i8")


# --- messages -----------------------------------------------------------------------------


class Message(Strict):
    """A top-level queue message. Subclasses set SCHEMA_NAME and SCHEMA_MAJOR."""

    SCHEMA_NAME: ClassVar[str] = ""
    SCHEMA_MAJOR: ClassVar[int] = 1

    id: MessageId

    @classmethod
    def schema_tag(cls) -> str:
        return f"{cls.SCHEMA_NAME}/{cls.SCHEMA_MAJOR}"


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: LongText


class SamplingParams(Strict):
    temperature: Annotated[float, Field(ge=0.0, le=10.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    max_tokens: Annotated[int, Field(ge=1, le=65_536)] = 1024
    seed: int | None = None


class BenchSpec(Strict):
    """What a benchmarker needs besides the code: which task, stage and optimisation level."""

    task: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    stage: Stage
    opt_level: OptLevel = "O3"


class GenerateRequest(Message):
    """Scheduler → generator: expand one pool node into a group of G completions."""

    SCHEMA_NAME: ClassVar[str] = "generate-request"

    experiment: ShortText
    iteration: Version
    parent_id: MessageId | None = None
    mode: Mode
    prompt: Annotated[list[ChatMessage], Field(min_length=1, max_length=64)]
    group_size: Annotated[int, Field(ge=1, le=1024)]
    sampling: SamplingParams = SamplingParams()
    min_policy_version: Version = 0
    bench: BenchSpec
    created_at: Timestamp = Field(default_factory=time.time)

    @property
    def group_id(self) -> str:
        return self.id


class RolloutData(Strict):
    """What the learner needs from one completion; opaque to the benchmarker."""

    prompt_token_ids: PackedArray
    completion_token_ids: PackedArray
    sampling_logprobs: PackedArray
    policy_version: Version
    finish_reason: ShortText | None = None

    @model_validator(mode="after")
    def _consistent(self) -> RolloutData:
        if not _is_int_array(self.prompt_token_ids):
            raise ValueError("prompt_token_ids must be an integer array")
        if not _is_int_array(self.completion_token_ids):
            raise ValueError("completion_token_ids must be an integer array")
        if _is_int_array(self.sampling_logprobs):
            raise ValueError("sampling_logprobs must be a float array")
        if len(self.completion_token_ids) != len(self.sampling_logprobs):
            raise ValueError(
                f"{len(self.completion_token_ids)} completion tokens but "
                f"{len(self.sampling_logprobs)} sampling log-probs"
            )
        return self


def text_sha256(text: str) -> str:
    """The hash that ties a completion's text to its token ids (``completion_sha256``)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def candidate_id(group_id: str, index: int) -> str:
    return f"{group_id}/{index}"


ROLLOUT_HASH_TAG = b"hpcrl-rollout/1\x00"


def rollout_sha256(rollout: RolloutData) -> str:
    """A hash of everything the learner takes from one candidate's rollout: prompt and
    completion token ids, sampling log-probs, policy version, finish reason. Arrays are
    hashed as int64 / float64 little-endian, so the dtype a producer chose does not change
    it; every field is length-prefixed."""
    digest = hashlib.sha256(ROLLOUT_HASH_TAG)

    def part(data: bytes) -> None:
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)

    part(str(rollout.policy_version).encode("ascii"))
    part((rollout.finish_reason or "").encode("utf-8", "surrogatepass"))
    part(rollout.prompt_token_ids.numpy().astype("<i8").tobytes())
    part(rollout.completion_token_ids.numpy().astype("<i8").tobytes())
    part(rollout.sampling_logprobs.numpy().astype("<f8").tobytes())
    return digest.hexdigest()


class Candidate(Message):
    """Generator → benchmarker: one completion to compile, verify and time."""

    SCHEMA_NAME: ClassVar[str] = "candidate"

    group_id: MessageId
    index: Annotated[int, Field(ge=0, lt=1024)]
    completion: LongText
    bench: BenchSpec
    rollout: RolloutData | None = None
    generator: ShortText = ""
    created_at: Timestamp = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _stable_id(self) -> Candidate:
        expected = candidate_id(self.group_id, self.index)
        if self.id != expected:
            raise ValueError(f"candidate id must be {expected!r}, got {self.id!r}")
        return self


# A client's name where publishers are not authenticated (then it names the reply queue):
# a queue-name piece, no dots at either end.
ClientName = Annotated[
    str, StringConstraints(max_length=128, pattern=r"^(?:[A-Za-z0-9_@-][A-Za-z0-9._@-]*)?$")
]


class RewardRequest(Message):
    """Outside trainer → benchmarker (``reward-requests``): one completion to judge for the
    caller; the verdict (a ``bench-result/1``, same id) goes to the caller's own reply queue
    (``reward-verdicts.<client>``), never to the scheduler. ``client`` names that queue only
    where publishers are not authenticated; otherwise the broker-verified ``user_id`` does."""

    SCHEMA_NAME: ClassVar[str] = "reward-request"

    group_id: MessageId
    index: Annotated[int, Field(ge=0, lt=1024)]
    completion: LongText
    bench: BenchSpec
    client: ClientName = ""
    created_at: Timestamp = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _stable_id(self) -> RewardRequest:
        expected = candidate_id(self.group_id, self.index)
        if self.id != expected:
            raise ValueError(f"reward request id must be {expected!r}, got {self.id!r}")
        return self


class HostInfo(Strict):
    """The class of machine a measurement was taken on; rewards compare only within a class."""

    hostname: ShortText
    cpu_model: ShortText
    isa: list[ShortText]
    cores: Annotated[int, Field(ge=1)]
    compiler: ShortText
    host_class: ShortText
    # Theoretical double-precision peak (an upper bound); a result above it cannot be genuine.
    peak_gflops: Annotated[float, Field(gt=0, le=MAX_GFLOPS)]


class Timing(Strict):
    runs_s: Annotated[list[Annotated[float, Field(gt=0)]], Field(min_length=1, max_length=1000)]
    mean_s: Annotated[float, Field(gt=0)]
    median_s: Annotated[float, Field(gt=0)]
    min_s: Annotated[float, Field(gt=0)]
    max_s: Annotated[float, Field(gt=0)]
    cv: Annotated[float, Field(ge=0)]
    # Timing attempts made (each a warm-up and the timed runs; the steadiest is the one
    # above), and whether even that one stayed above the benchmarker's max_timing_cv.
    # Optional, so results from before they existed still decode.
    attempts: Annotated[int, Field(ge=1, le=100)] = 1
    noisy: bool = False


class BenchResult(Message):
    """Benchmarker → scheduler: the verdict on one candidate (id = candidate id)."""

    SCHEMA_NAME: ClassVar[str] = "bench-result"

    group_id: MessageId
    index: Annotated[int, Field(ge=0, lt=1024)]
    status: Status
    reward: Reward
    gflops: Gflops | None = None
    timing: Timing | None = None
    techniques: list[ShortText] = []
    generalizes: bool | None = None
    error: ErrorText = ""
    source: LongText | None = None
    bench: BenchSpec
    compile_flags: list[ShortText] = []
    host: HostInfo
    benchmarker: ShortText = ""
    durations_s: dict[ShortText, Annotated[float, Field(ge=0)]] = {}
    rollout: RolloutData | None = None
    # sha256 of the completion text this verdict judged (the candidate's ``completion``),
    # set by the benchmarker: the learner trains the rollout's token ids only if they decode
    # to this text. Optional, so results of older benchmarkers still decode.
    completion_sha256: TextHash | None = None
    created_at: Timestamp = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _success_has_gflops(self) -> BenchResult:
        if self.id != candidate_id(self.group_id, self.index):
            raise ValueError(f"result id must be {candidate_id(self.group_id, self.index)!r}")
        if (self.status == "success") != (self.gflops is not None):
            raise ValueError("gflops must be set exactly when status is 'success'")
        expected = reward_for_status(self.status, self.gflops)
        if self.reward != expected:
            raise ValueError(
                f"reward {self.reward!r} does not follow from status "
                f"{self.status!r} (the reward table gives {expected!r})"
            )
        peak = self.host.peak_gflops
        if self.gflops is not None and self.gflops > peak:
            raise ValueError(
                f"gflops {self.gflops!r} is above the host's theoretical peak {peak!r}"
            )
        return self


class CommitmentEntryV1(Strict):
    """What the generator sent as candidate ``index`` of a group, as hashes only
    (``candidate-commitment/1``)."""

    index: Annotated[int, Field(ge=0, lt=1024)]
    rollout_sha256: TextHash  # rollout_sha256(candidate.rollout)
    completion_sha256: TextHash  # text_sha256(candidate.completion)


class CommitmentEntry(CommitmentEntryV1):
    """What the generator sent as candidate ``index`` of a group: the hash of its rollout,
    and its text with the text's hash (checked: ``text_sha256(completion)``). The text is
    what a winner's second measurement compiles (``hpcrl_scheduler.confirm``)."""

    completion: LongText  # candidate.completion

    @model_validator(mode="after")
    def _text_is_hashed(self) -> CommitmentEntry:
        actual = text_sha256(self.completion)
        if actual != self.completion_sha256:
            raise ValueError(
                f"candidate {self.index}: completion_sha256 {self.completion_sha256[:16]}… is "
                f"not the hash of its completion ({actual[:16]}…)"
            )
        return self


def commitment_id(group_id: str, entries: Sequence[CommitmentEntryV1]) -> str:
    """``<group id>@<16 hex>``: the group and a digest of what is committed, so that a
    group sampled again (a redelivered request) commits under an id of its own, which a
    consumer's memory of handled ids does not swallow. The same for both majors (the text
    is in the digest through its hash)."""
    digest = hashlib.sha256()
    for entry in sorted(entries, key=lambda e: e.index):
        digest.update(
            f"{entry.index}:{entry.rollout_sha256}:{entry.completion_sha256};".encode("ascii")
        )
    return f"{group_id}@{digest.hexdigest()[:16]}"


def _check_commitment(commitment: CandidateCommitment | CandidateCommitmentV1) -> None:
    indices = [entry.index for entry in commitment.entries]
    if len(set(indices)) != len(indices):
        raise ValueError("a candidate index is committed twice")
    expected = commitment_id(commitment.group_id, commitment.entries)
    if commitment.id != expected:
        raise ValueError(f"commitment id must be {expected!r}, got {commitment.id!r}")


class CandidateCommitment(Message):
    """Generator → scheduler (``candidate-commitments``): what the generator sent for each
    candidate of one group (the hash of its rollout, and its text), published before the
    candidates. The scheduler takes a result's rollout (the tokens the learner trains) only
    when it is one the generator committed to for that candidate id, and the text the
    benchmarker says it judged only when it is that candidate's; a group winner's second
    measurement compiles the committed text, not the source the first benchmarker reported.
    Only the generator role may publish here (``hpcrl_common.access``).

    Major 2 added each candidate's text (``CommitmentEntry.completion``);
    ``candidate-commitment/1`` (hashes only) is still read, as
    :class:`CandidateCommitmentV1`, during a rolling upgrade."""

    SCHEMA_NAME: ClassVar[str] = "candidate-commitment"
    SCHEMA_MAJOR: ClassVar[int] = 2

    group_id: MessageId
    entries: Annotated[list[CommitmentEntry], Field(min_length=1, max_length=1024)]
    generator: ShortText = ""
    created_at: Timestamp = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _stable_id(self) -> CandidateCommitment:
        _check_commitment(self)
        return self

    @classmethod
    def of(cls, candidates: list[Candidate], generator: str = "") -> CandidateCommitment:
        """The commitment to ``candidates`` (one group's, each with its rollout)."""
        if not candidates or len({c.group_id for c in candidates}) != 1:
            raise ValueError("a commitment covers the candidates of one group")
        entries = []
        for candidate in candidates:
            if candidate.rollout is None:
                raise ValueError(f"{candidate.id} has no rollout to commit to")
            entries.append(
                CommitmentEntry(
                    index=candidate.index,
                    rollout_sha256=rollout_sha256(candidate.rollout),
                    completion_sha256=text_sha256(candidate.completion),
                    completion=candidate.completion,
                )
            )
        group_id = candidates[0].group_id
        return cls(
            id=commitment_id(group_id, entries),
            group_id=group_id,
            entries=entries,
            generator=generator,
        )


class CandidateCommitmentV1(Message):
    """``candidate-commitment/1`` (hashes only), still read during a rolling upgrade. It has
    no text, so it cannot become a ``candidate-commitment/2``: :meth:`upgrade` hands it on as
    it is, and the scheduler files its hashes (a winner of its candidates has no committed
    text to be measured again from: ``scheduler.require_committed_text``)."""

    SCHEMA_NAME: ClassVar[str] = "candidate-commitment"
    SCHEMA_MAJOR: ClassVar[int] = 1

    group_id: MessageId
    entries: Annotated[list[CommitmentEntryV1], Field(min_length=1, max_length=1024)]
    generator: ShortText = ""
    created_at: Timestamp = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _stable_id(self) -> CandidateCommitmentV1:
        _check_commitment(self)
        return self

    def upgrade(self) -> CandidateCommitmentV1:
        return self


class RolloutSample(Strict):
    candidate_id: MessageId
    completion_token_ids: PackedArray
    sampling_logprobs: PackedArray
    policy_version: Version
    reward: Reward
    status: Status
    # The benchmarker's hash of the text it judged (BenchResult.completion_sha256); the
    # learner checks that completion_token_ids decode to it.
    completion_sha256: TextHash | None = None

    @model_validator(mode="after")
    def _aligned(self) -> RolloutSample:
        if len(self.completion_token_ids) != len(self.sampling_logprobs):
            raise ValueError("completion_token_ids and sampling_logprobs differ in length")
        if not _is_int_array(self.completion_token_ids) or _is_int_array(self.sampling_logprobs):
            raise ValueError("token ids must be integers and log-probs floats")
        if self.status != "success" and self.reward != FAILURE_REWARDS[self.status]:
            raise ValueError(
                f"reward {self.reward!r} of a {self.status!r} is not its penalty "
                f"{FAILURE_REWARDS[self.status]!r}"
            )
        return self


class RolloutBatch(Message):
    """Scheduler → learner: one complete group with its rewards (id = group id)."""

    SCHEMA_NAME: ClassVar[str] = "rollout-batch"

    experiment: ShortText
    iteration: Version
    prompt_token_ids: PackedArray
    samples: Annotated[list[RolloutSample], Field(min_length=1, max_length=1024)]
    reward_mode: Literal["raw", "group_normalized", "parent_relative"]
    host_class: ShortText = ""
    created_at: Timestamp = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _prompt_ids(self) -> RolloutBatch:
        if not _is_int_array(self.prompt_token_ids):
            raise ValueError("prompt_token_ids must be an integer array")
        low, high = REWARD_RANGES[self.reward_mode]
        for sample in self.samples:
            if not low <= sample.reward <= high:
                raise ValueError(
                    f"{sample.candidate_id}: reward {sample.reward!r} outside "
                    f"[{low:g}, {high:g}], the range of {self.reward_mode!r} "
                    f"rewards"
                )
        return self

    @property
    def min_policy_version(self) -> int:
        return min(sample.policy_version for sample in self.samples)


PACING_FIELDS = ("groups_trained", "groups_dropped", "groups_per_step")


class WeightUpdate(Message):
    """Learner → generators and scheduler (fanout): a new policy version, by reference.

    Major 2 made the learner's pacing figures typed fields (they were keys of ``metrics``);
    ``weight-update/1`` is still read, as :class:`WeightUpdateV1`, and upgraded to this.
    """

    SCHEMA_NAME: ClassVar[str] = "weight-update"
    SCHEMA_MAJOR: ClassVar[int] = 2

    # "<experiment>/<checkpoint store run id>": which run of training this version belongs to.
    run: ShortText = ""
    version: Annotated[int, Field(ge=1, lt=2**31)]
    parent_version: Version
    uri: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    format: Literal["full", "lora"]
    checksum: Annotated[str, StringConstraints(pattern=r"^sha256:[0-9a-f]{64}$")]
    base_model: ShortText = ""
    # The learner's progress for the scheduler's pacing (hpcrl_scheduler.pacing): groups
    # trained, and dropped (as stale, or refused: dead-lettered), in this run up to this
    # version, and groups per step. None:
    # not reported (a version committed without them).
    groups_trained: GroupCount | None = None
    groups_dropped: GroupCount = 0
    groups_per_step: Annotated[int, Field(ge=1, le=4096)] | None = None
    metrics: dict[ShortText, float] = {}
    created_at: Timestamp = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _ordered(self) -> WeightUpdate:
        if self.parent_version >= self.version:
            raise ValueError("parent_version must be lower than version")
        doubled = sorted(set(PACING_FIELDS) & set(self.metrics))
        if doubled:
            raise ValueError(f"metrics {doubled} are fields of weight-update/2, not metrics")
        return self


class WeightUpdateV1(Message):
    """``weight-update/1``, still read during a rolling upgrade (the pacing figures as floats
    in ``metrics``); :meth:`upgrade` makes the current :class:`WeightUpdate` of it, refusing
    figures that are not whole numbers in range."""

    SCHEMA_NAME: ClassVar[str] = "weight-update"
    SCHEMA_MAJOR: ClassVar[int] = 1

    run: ShortText = ""
    version: Annotated[int, Field(ge=1, lt=2**31)]
    parent_version: Version
    uri: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    format: Literal["full", "lora"]
    checksum: Annotated[str, StringConstraints(pattern=r"^sha256:[0-9a-f]{64}$")]
    base_model: ShortText = ""
    metrics: dict[ShortText, float] = {}
    created_at: Timestamp = Field(default_factory=time.time)

    def upgrade(self) -> WeightUpdate:
        fields = self.model_dump()
        metrics = dict(fields.pop("metrics"))
        for key in PACING_FIELDS:
            if key in metrics:
                value = metrics.pop(key)
                fields[key] = int(value) if float(value).is_integer() else value
        return WeightUpdate(**fields, metrics=metrics)


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.SCHEMA_NAME: cls
    for cls in (
        GenerateRequest,
        Candidate,
        CandidateCommitment,
        BenchResult,
        RolloutBatch,
        WeightUpdate,
        RewardRequest,
    )
}
# Older majors still read (a rolling upgrade), each with an ``upgrade()`` to the current one
# (or, where the current one holds more than the old one carried, to itself: the consumer
# then takes either, as the scheduler takes both majors of ``candidate-commitment``).
LEGACY_TYPES: dict[tuple[str, int], type[Message]] = {
    (cls.SCHEMA_NAME, cls.SCHEMA_MAJOR): cls for cls in (WeightUpdateV1, CandidateCommitmentV1)
}

# --- wire format --------------------------------------------------------------------------


class MessageError(ValueError):
    """A body that is not a valid message. ``reason`` is what goes into the DLQ header."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def encode(message: Message) -> bytes:
    body = message.model_dump(mode="python")
    body = {"schema": message.schema_tag(), **body}
    return msgpack.packb(body, use_bin_type=True)


M = TypeVar("M", bound=Message)


def decode(
    body: bytes,
    expected: type[M] | tuple[type[Message], ...] | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> M:
    """Parse and validate one message body; raise MessageError with the reason if invalid."""
    if not isinstance(body, bytes | bytearray | memoryview):
        raise MessageError(f"body must be bytes, got {type(body).__name__}")
    if len(body) > max_bytes:
        raise MessageError(f"oversized message: {len(body)} bytes > limit {max_bytes}")
    raw = _unpack(bytes(body))
    cls = _schema_class(raw)
    current = MESSAGE_TYPES[cls.SCHEMA_NAME]
    if expected is not None:
        allowed = expected if isinstance(expected, tuple) else (expected,)
        if current not in allowed:
            names = ", ".join(c.schema_tag() for c in allowed)
            raise MessageError(f"unexpected schema {cls.schema_tag()!r} here (expected {names})")
    fields = {k: v for k, v in raw.items() if k != "schema"}
    try:
        message = cls.model_validate(fields)
        if cls is not current:
            message = message.upgrade()  # type: ignore[attr-defined]
    except ValidationError as exc:
        raise MessageError(f"invalid {cls.schema_tag()}: {describe_errors(exc)}") from None
    return message  # type: ignore[return-value]


def _unpack(body: bytes) -> dict[str, Any]:
    try:
        raw = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except msgpack.ExtraData:
        raise MessageError("not one msgpack object: trailing bytes after the message") from None
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise MessageError(f"not valid msgpack: {exc}") from None
    if not isinstance(raw, dict):
        raise MessageError(f"message must be a msgpack map, got {type(raw).__name__}")
    return raw


# ASCII digits, no leading zero: str.isdigit() and int() also accept superscript, Arabic-Indic
# and full-width digits and "01", so one tag would have several spellings and some of them
# would raise outside MessageError.
_MAJOR_VERSION = re.compile(r"0|[1-9][0-9]{0,8}")


def _schema_class(raw: dict[str, Any]) -> type[Message]:
    tag = raw.get("schema")
    if tag is None:
        raise MessageError("missing field 'schema'")
    if not isinstance(tag, str) or tag.count("/") != 1:
        raise MessageError(f"field 'schema' must be '<name>/<major>', got {tag!r}")
    name, major_text = tag.split("/")
    cls = MESSAGE_TYPES.get(name)
    if cls is None:
        raise MessageError(f"unknown schema name {name!r} (known: {', '.join(MESSAGE_TYPES)})")
    if _MAJOR_VERSION.fullmatch(major_text) is None:
        legacy = None
    elif int(major_text) == cls.SCHEMA_MAJOR:
        return cls
    else:
        legacy = LEGACY_TYPES.get((name, int(major_text)))
    if legacy is None:
        majors = [cls.SCHEMA_MAJOR, *(m for (n, m) in LEGACY_TYPES if n == name)]
        raise MessageError(
            f"unsupported major version {major_text!r} of schema {name!r} "
            f"(this build reads {', '.join(map(str, majors))})"
        )
    return legacy


def describe_errors(exc: ValidationError, limit: int = 5) -> str:
    """Pydantic errors as 'field.path: message (got value)' joined by '; '."""
    parts = []
    for error in exc.errors()[:limit]:
        where = ".".join(str(part) for part in error["loc"]) or "<root>"
        got = error.get("input")
        shown = "" if isinstance(got, dict | list) else f" (got {_short(got)})"
        parts.append(f"{where}: {error['msg']}{shown}")
    if len(exc.errors()) > limit:
        parts.append(f"... {len(exc.errors()) - limit} more")
    return "; ".join(parts)


def _short(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
