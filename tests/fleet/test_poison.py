"""Issue #18: poison and malformed messages at volume on every queue.

All four services run their real consumers in this process on one fresh namespace (the
scheduler with a tmp SQLite store, the learner from ``build(config)``, the generator with the
transformers backend, the benchmarker from ``build_consumer``), one tiny chat model serving as
the policy of both the generator and the learner. Then more than a thousand malformed
messages, mutated from valid messages of every schema with a fixed seed, go to every work
queue and to the weight-updates exchange, in a shuffled order.

Every one must end in the dead-letter queue of the queue it was sent to, exactly once per
receiving queue (both subscribers of the fanout exchange dead-letter their own copy), with a
non-empty ``x-hpcrl-reason``; every service must stay healthy; and valid work must flow
afterwards through the whole chain: the scheduler (whose loop is held until the poison is
dead-lettered) sends a request, the generator samples candidates, the benchmarker judges them,
the scheduler stores the results and sends the group to the learner, which trains, commits and
announces version 1, which the scheduler records and the generator loads.

A second, fast test sends header values that RabbitMQ carries but pika cannot (a double beyond
int64, a timestamp beyond datetime's range) to a bare Consumer: they too must be dead-lettered
once with a reason, and must not stop the consumer or take valid messages down with them.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import random
import struct
import threading
import time
import typing
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import msgpack
import pika
import pika.data
import pika.exceptions
import pytest
from pydantic import BaseModel

from hpcrl_benchmarker.config import BenchmarkerConfig, BenchmarkerSection
from hpcrl_benchmarker.host import detect
from hpcrl_benchmarker.pipeline import Benchmarker
from hpcrl_benchmarker.service import build_consumer
from hpcrl_common.access import SCHEDULER_SUBSCRIBER
from hpcrl_common.broker import Consumer
from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_common.config import BrokerSettings, ExperimentSettings
from hpcrl_common.messages import (
    MESSAGE_TYPES,
    BenchResult,
    BenchSpec,
    Candidate,
    CandidateCommitment,
    ChatMessage,
    GenerateRequest,
    HostInfo,
    Message,
    MessageError,
    PackedArray,
    RewardRequest,
    RolloutBatch,
    RolloutData,
    RolloutSample,
    SamplingParams,
    Timing,
    WeightUpdate,
    commitment_id,
    decode,
    encode,
)
from hpcrl_common.topology import (
    BENCH_RESULTS,
    CANDIDATE_COMMITMENTS,
    CODE_TO_BENCH,
    GENERATE_REQUESTS,
    REASON_HEADER,
    REWARD_REQUESTS,
    ROLLOUT_BATCHES,
    SOURCE_QUEUE_HEADER,
    WEIGHT_UPDATES,
    WORK_QUEUES,
    Topology,
)
from hpcrl_generator.backends import make_sampler
from hpcrl_generator.config import GeneratorSection
from hpcrl_generator.service import Generator
from hpcrl_learner.config import LearnerConfig, LearnerSettings
from hpcrl_learner.service import Learner
from hpcrl_learner.service import build as build_learner
from hpcrl_scheduler.config import SchedulerConfig, SchedulerSection
from hpcrl_scheduler.scheduler import Scheduler
from hpcrl_scheduler.service import SchedulerService
from hpcrl_scheduler.store import Store
from tests.conftest import RunningConsumer
from tests.support.models import chat_model
from tests.support.waiting import wait_for

pytestmark = pytest.mark.broker

SEED = 18
MAX_BYTES = 64 * 1024  # broker.max_message_bytes of every service in this test
PER_WORK_QUEUE = 260
PER_FANOUT = 200
EXPERIMENT = "fleet-poison"
GENERATOR_REPLICA = "fleet-generator"
MAX_MODEL_LEN = 1024
MAX_SEQUENCE_TOKENS = 2048
GROUP_SIZE = 2

# --- valid messages, the material of every mutation ----------------------------------------


def _rollout() -> RolloutData:
    return RolloutData(
        prompt_token_ids=PackedArray.of([1, 2, 3, 4], "<i4"),
        completion_token_ids=PackedArray.of([5, 6, 7], "<i4"),
        sampling_logprobs=PackedArray.of([-0.5, -0.25, -1.0], "<f4"),
        policy_version=0,
        finish_reason="stop",
    )


def _host() -> HostInfo:
    return HostInfo(
        hostname="node1",
        cpu_model="Test CPU",
        isa=["avx2", "avx512f"],
        cores=8,
        compiler="gcc 12",
        host_class="x86-avx512",
        peak_gflops=2000.0,
    )


BENCH = BenchSpec(task="matmul", stage=2, opt_level="O3")


def valid_messages() -> dict[str, Message]:
    """One valid message of each schema, with every optional part filled in."""
    request = GenerateRequest(
        id="poison-req",
        experiment="elsewhere",
        iteration=1,
        parent_id="seed",
        mode="improve",
        prompt=[
            ChatMessage(role="system", content="You are an expert HPC programmer."),
            ChatMessage(role="user", content="Write a faster matmul kernel in C."),
        ],
        group_size=4,
        sampling=SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, seed=7),
        min_policy_version=0,
        bench=BENCH,
    )
    candidate = Candidate(
        id="pg/1",
        group_id="pg",
        index=1,
        completion="```c\nvoid f(void) {}\n```",
        bench=BENCH,
        rollout=_rollout(),
        generator="r1",
    )
    result = BenchResult(
        id="pg/1",
        group_id="pg",
        index=1,
        status="success",
        reward=12.5,
        gflops=12.5,
        timing=Timing(
            runs_s=[0.1, 0.11, 0.12],
            mean_s=0.11,
            median_s=0.11,
            min_s=0.1,
            max_s=0.12,
            cv=0.05,
            attempts=2,
        ),
        techniques=["openmp"],
        generalizes=True,
        source="void f(void) {}",
        bench=BENCH,
        compile_flags=["gcc", "-O3"],
        host=_host(),
        benchmarker="b1",
        durations_s={"compile": 0.5, "run": 1.25},
        rollout=_rollout(),
    )
    samples = [
        RolloutSample(
            candidate_id=f"pg/{i}",
            completion_token_ids=PackedArray.of([5, 6], "<i4"),
            sampling_logprobs=PackedArray.of([-0.5, -0.75], "<f4"),
            policy_version=0,
            reward=reward,
            status=status,
        )
        for i, (reward, status) in enumerate([(12.5, "success"), (-40.0, "compile_error")])
    ]
    batch = RolloutBatch(
        id="pg",
        experiment="elsewhere",
        iteration=0,
        prompt_token_ids=PackedArray.of([1, 2, 3, 4], "<i4"),
        samples=samples,
        reward_mode="group_normalized",
        host_class="x86-avx512",
    )
    update = WeightUpdate(
        id="v3",
        run="elsewhere/r1",
        version=3,
        parent_version=2,
        uri="file:///nowhere/3",
        format="full",
        checksum="sha256:" + "ab" * 32,
        base_model="tiny",
        groups_trained=4,
        metrics={"loss": 0.5},
    )
    reward = RewardRequest(
        id="pr/1",
        group_id="pr",
        index=1,
        completion="```c\nvoid f(void) {}\n```",
        bench=BENCH,
        client="c1",
    )
    return {
        GENERATE_REQUESTS: request,
        CODE_TO_BENCH: candidate,
        BENCH_RESULTS: result,
        ROLLOUT_BATCHES: batch,
        WEIGHT_UPDATES: update,
        REWARD_REQUESTS: reward,
        # a valid commitment to a group the scheduler never sent: refused by its handler
        CANDIDATE_COMMITMENTS: CandidateCommitment.of([candidate], generator="elsewhere"),
    }


# --- raw-dict helpers ----------------------------------------------------------------------

Path_ = tuple[Any, ...]


def pack(value: Any, **kwargs: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True, **kwargs)


def get_at(raw: Any, path: Path_) -> Any:
    for part in path:
        raw = raw[part]
    return raw


def set_at(raw: Any, path: Path_, value: Any) -> None:
    get_at(raw, path[:-1])[path[-1]] = value


def submodel(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = submodel(arg)
        if found is not None:
            return found
    return None


def model_nodes(raw: dict[str, Any], cls: type[BaseModel]) -> list[tuple[Path_, type[BaseModel]]]:
    """Every dict of ``raw`` that is a (sub-)model, with its path and model class."""
    nodes: list[tuple[Path_, type[BaseModel]]] = [((), cls)]

    def walk(node: dict[str, Any], model: type[BaseModel], path: Path_) -> None:
        for name, info in model.model_fields.items():
            sub, value = submodel(info.annotation), node.get(name)
            if sub is None:
                continue
            items = (
                [((*path, name), value)]
                if isinstance(value, dict)
                else (
                    [((*path, name, i), v) for i, v in enumerate(value)]
                    if isinstance(value, list)
                    else []
                )
            )
            for where, item in items:
                if isinstance(item, dict):
                    nodes.append((where, sub))
                    walk(item, sub, where)

    walk(raw, cls, ())
    return nodes


def leaves(value: Any, path: Path_ = ()) -> Iterator[tuple[Path_, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from leaves(item, (*path, index))
    else:
        yield path, value


def containers(value: Any, path: Path_ = ()) -> Iterator[Path_]:
    """Paths of every non-root dict and list."""
    items = (
        value.items()
        if isinstance(value, dict)
        else (enumerate(value) if isinstance(value, list) else [])
    )
    for key, item in items:
        if isinstance(item, dict | list):
            yield (*path, key)
            yield from containers(item, (*path, key))


def packed_arrays(raw: dict[str, Any]) -> list[Path_]:
    return [
        path
        for path in containers(raw)
        if isinstance(get_at(raw, path), dict) and set(get_at(raw, path)) == {"dtype", "data"}
    ]


def sized_str(build: Callable[[int], bytes], size: int) -> bytes:
    """A body of exactly ``size`` bytes, built around a string of adjustable length."""
    n = size
    for _ in range(4):
        body = build(n)
        if len(body) == size:
            return body
        n += size - len(body)
    raise AssertionError(f"could not hit {size} bytes")


# --- poison ----------------------------------------------------------------------------------


@dataclass
class Poison:
    base: str  # queue or exchange it is sent to
    kind: str
    body: bytes
    headers: dict[str, Any] | None = None
    raw_headers: bytes | None = None  # a header table pika could not write (floats)
    message_id: str | None = None
    handled: bool = False  # a valid message the handler refuses (not the decoder)


@dataclass
class Ctx:
    base: str
    message: Message
    raw: dict[str, Any]
    body: bytes
    others: list[bytes]
    other_tags: list[str]

    @property
    def cls(self) -> type[Message]:
        return type(self.message)

    def copy(self) -> dict[str, Any]:
        return copy.deepcopy(self.raw)


Mutation = Callable[[random.Random, Ctx], "bytes | Poison"]

SCHEMA_NAMES = {
    GENERATE_REQUESTS: "generate-request",
    CODE_TO_BENCH: "candidate",
    BENCH_RESULTS: "bench-result",
    ROLLOUT_BATCHES: "rollout-batch",
    WEIGHT_UPDATES: "weight-update",
    REWARD_REQUESTS: "reward-request",
    CANDIDATE_COMMITMENTS: "candidate-commitment",
}


def random_bytes(rng: random.Random, ctx: Ctx) -> bytes:
    return rng.randbytes(rng.choice([0, 1, 2, 3, 7, 16, 64, 500, 4000]))


def not_msgpack(rng: random.Random, ctx: Ctx) -> bytes:
    text = json.dumps(ctx.raw, default=lambda b: b.hex())
    return rng.choice(
        [
            text.encode(),
            text.encode("utf-16"),
            zlib.compress(ctx.body),
            b"\xc1",
            b"<candidate id='1'/>",
            b"hello, queue",
            ctx.body.hex().encode(),
            bytes(reversed(ctx.body)),
        ]
    )


def truncated(rng: random.Random, ctx: Ctx) -> bytes:
    return ctx.body[: rng.randrange(1, len(ctx.body))]


def trailing_bytes(rng: random.Random, ctx: Ctx) -> bytes:
    return ctx.body + rng.choice([b"\x00", b"\xc0", b"\xc1", ctx.body, rng.randbytes(9)])


def non_map(rng: random.Random, ctx: Ctx) -> bytes:
    return pack(
        rng.choice(
            [
                list(ctx.raw.values()),
                [ctx.raw],
                42,
                -1,
                SCHEMA_NAMES[ctx.base] + "/1",
                None,
                True,
                3.14,
                b"\x00\x01",
                [],
                "",
                msgpack.ExtType(7, b"x"),
                [ctx.raw, ctx.raw],
                list(ctx.raw.items()),
            ]
        )
    )


def bad_map_keys(rng: random.Random, ctx: Ctx) -> bytes:
    raw = ctx.copy()
    choice = rng.randrange(5)
    if choice == 0:
        return pack({1: "x", 2: "y"})
    if choice == 1:
        return pack({**raw, 7: 1})
    if choice == 2:
        return pack({key.encode(): value for key, value in raw.items()})
    if choice == 3:  # bytes keys in a nested object
        path = rng.choice(
            [p for p in containers(raw) if isinstance(get_at(raw, p), dict) and get_at(raw, p)]
        )
        set_at(raw, path, {key.encode(): value for key, value in get_at(raw, path).items()})
        return pack(raw)
    return pack({**raw, "nested": {None: 1}} if rng.random() < 0.5 else {**raw, 1.5: "f"})


MARK = "Zq9Wk7Xj3"


def invalid_utf8(rng: random.Random, ctx: Ctx) -> bytes:
    raw = ctx.copy()
    paths = [p for p, v in leaves(raw) if isinstance(v, str)]
    set_at(raw, rng.choice(paths), MARK)
    body = pack(raw)
    assert body.count(MARK.encode()) == 1
    bad = rng.choice([b"\xff" * len(MARK), b"\xc3\x28" * 4 + b"\xa0", b"\xed\xa0\x80" * 3])
    return body.replace(MARK.encode(), bad)


def deep_nesting(rng: random.Random, ctx: Ctx) -> bytes:
    depth = rng.choice([100, 900, 2000, 20_000, 60_000])
    nested = b"\x91" * depth + b"\xc0"
    if rng.random() < 0.5:
        return nested
    return b"\x82" + pack("schema") + pack(ctx.message.schema_tag()) + pack("id") + nested


def ext_type(rng: random.Random, ctx: Ctx) -> bytes:
    raw = ctx.copy()
    value = rng.choice(
        [
            msgpack.ExtType(rng.randrange(128), rng.randbytes(4)),
            msgpack.Timestamp(0),
            msgpack.Timestamp(2**33, 5),
        ]
    )
    path = rng.choice([("schema",), *(p for p, _ in leaves(raw))])
    set_at(raw, path, value)
    return pack(raw)


def wrong_schema(rng: random.Random, ctx: Ctx) -> bytes:
    return rng.choice(ctx.others)


def swapped_tag(rng: random.Random, ctx: Ctx) -> bytes:
    return pack({**ctx.raw, "schema": rng.choice(ctx.other_tags)})


def bad_major(rng: random.Random, ctx: Ctx) -> bytes:
    name = SCHEMA_NAMES[ctx.base]
    # A major no build reads (weight-update is at 2, and still reads 1).
    tag = rng.choice(
        [
            f"{name}/{MESSAGE_TYPES[name].SCHEMA_MAJOR + 1}",
            f"{name}/0",
            f"{name}/01",
            f"{name}/1.0",
            f"{name}/\u00b9",
            f"{name}/\u0661",
            f"{name}/\uff11",
            f"{name}/ 1",
            f"{name}/1\n",
            f"{name}/+1",
            f"{name}/-1",
            f"{name}/",
            name,
            f"{name}/1/1",
            "/1",
            f"{name.upper()}/1",
            f"{name}\x00/1",
            f"{name}/{'9' * 30}",
            f"{name}/1e0",
            f"{name}/0x1",
            f" {name}/1",
            f"{name}/\u0967",
            f"{name}/\U0001d7cf",
            "unknown/1",
            "",
        ]
    )
    return pack({**ctx.raw, "schema": tag})


def bad_tag_type(rng: random.Random, ctx: Ctx) -> bytes:
    raw = ctx.copy()
    if rng.random() < 0.2:
        del raw["schema"]
        return pack(raw)
    raw["schema"] = rng.choice(
        [
            1,
            None,
            [SCHEMA_NAMES[ctx.base], 1],
            ctx.message.schema_tag().encode(),
            {"name": SCHEMA_NAMES[ctx.base]},
            True,
            1.0,
            -(2**63),
        ]
    )
    return pack(raw)


def missing_key(rng: random.Random, ctx: Ctx) -> bytes:
    raw = ctx.copy()
    options = [((), "schema")]
    for path, model in model_nodes(raw, ctx.cls):
        node = get_at(raw, path)
        options += [
            (path, name)
            for name, info in model.model_fields.items()
            if info.is_required() and name in node
        ]
    path, name = rng.choice(options)
    del get_at(raw, path)[name]
    return pack(raw)


def extra_key(rng: random.Random, ctx: Ctx) -> bytes:
    raw = ctx.copy()
    path, model = rng.choice(model_nodes(raw, ctx.cls))
    node = get_at(raw, path)
    name = rng.choice(
        [
            "Id",
            "group-id",
            "schema_version",
            "",
            "\u043a\u043b\u044e\u0447",
            "__class__",
            "x" * 300,
            f"extra_{rng.randrange(10**6)}",
            "id ",
            "dtype2",
        ]
    )
    assert name not in model.model_fields
    node[name] = rng.choice([1, "v", None, [1], {"a": 1}, b"\x00"])
    return pack(raw)


def _wrong_for(rng: random.Random, current: Any) -> Any:
    if isinstance(current, bool):
        pool: list[Any] = [1, "true", 1.0, [True]]
    elif isinstance(current, int):
        pool = ["7", 7.5, [7], {"v": 7}, b"7"]
    elif isinstance(current, float):
        pool = ["1.5", [1.5], {"v": 1.5}, b"\x00", True]
    elif isinstance(current, str):
        pool = [123, 1.5, ["x"], {"x": 1}, current.encode(), True]
    elif isinstance(current, bytes):
        pool = [current.hex(), list(current), 5, True]
    else:
        raise AssertionError(f"no wrong value for {current!r}")
    return rng.choice(pool)


def wrong_type(rng: random.Random, ctx: Ctx) -> bytes:
    raw = ctx.copy()
    if rng.random() < 0.3:  # a whole object or list replaced
        path = rng.choice(list(containers(raw)))
        current = get_at(raw, path)
        set_at(
            raw,
            path,
            rng.choice(
                ["not an object", 5, [current]]
                if isinstance(current, dict)
                else ["not a list", {"0": 1}, 5]
            ),
        )
        return pack(raw)
    path, current = rng.choice(
        [(p, v) for p, v in leaves(raw) if v is not None and p != ("schema",)]
    )
    set_at(raw, path, _wrong_for(rng, current))
    return pack(raw)


def non_finite(rng: random.Random, ctx: Ctx) -> bytes:
    raw = ctx.copy()
    floats = [p for p, v in leaves(raw) if isinstance(v, float)]
    for path in rng.sample(floats, rng.randint(1, min(3, len(floats)))):
        set_at(raw, path, rng.choice([math.nan, math.inf, -math.inf]))
    return pack(raw, use_single_float=rng.random() < 0.3)


OUT_OF_BOUNDS: dict[str, list[tuple[Path_, Any]]] = {
    GENERATE_REQUESTS: [
        (("group_size",), 0),
        (("group_size",), 1025),
        (("group_size",), -1),
        (("iteration",), -1),
        (("sampling", "temperature"), 10.5),
        (("sampling", "temperature"), -0.1),
        (("sampling", "top_p"), 0.0),
        (("sampling", "top_p"), 1.5),
        (("sampling", "max_tokens"), 0),
        (("sampling", "max_tokens"), 65_537),
        (("bench", "stage"), 0),
        (("bench", "stage"), 7),
        (("prompt",), []),
        (("id",), ""),
        (("id",), "has space"),
        (("id",), "x" * 257),
        (("id",), "\u00fc"),
        (("experiment",), "x" * 257),
        (("mode",), "yolo"),
        (("bench", "opt_level"), "O4"),
        (("prompt", 0, "role"), "tool"),
        (("created_at",), -1.0),
        (("min_policy_version",), -1),
        (("parent_id",), "a b"),
        (("bench", "task"), ""),
        (("sampling", "max_tokens"), 2**63 - 1),
    ],
    CODE_TO_BENCH: [
        (("index",), -1),
        (("index",), 1024),
        (("id",), "pg/9"),
        (("id",), "other/1"),
        (("group_id",), "has space"),
        (("bench", "task"), ""),
        (("bench", "stage"), 7),
        (("rollout", "policy_version"), -1),
        (("generator",), "x" * 257),
        (("created_at",), -5.0),
        (("rollout", "finish_reason"), "x" * 257),
        (("bench", "task"), "t" * 257),
    ],
    BENCH_RESULTS: [
        (("reward",), 1e7),
        (("reward",), 13.0),
        (("reward",), -1e9),
        (("gflops",), 2e6),
        (("gflops",), 3000.0),
        (("gflops",), -1.0),
        (("status",), "ok"),
        (("status",), "compile_error"),
        (("timing", "runs_s"), []),
        (("timing", "runs_s"), [0.0]),
        (("timing", "runs_s"), [-1.0]),
        (("timing", "cv"), -1.0),
        (("timing", "attempts"), 0),
        (("timing", "attempts"), 101),
        (("host", "cores"), 0),
        (("host", "peak_gflops"), 0.0),
        (("host", "peak_gflops"), 2e6),
        (("index",), 1024),
        (("durations_s",), {"x": -1.0}),
        (("error",), "e" * 64_001),
        (("timing", "mean_s"), 0.0),
    ],
    ROLLOUT_BATCHES: [
        (("samples",), []),
        (("samples", 0, "reward"), 2e6),
        (("samples", 1, "reward"), -2e6),
        (("samples", 0, "status"), "meh"),
        (("reward_mode",), "other"),
        (("iteration",), -1),
        (("samples", 0, "policy_version"), -1),
        (("samples", 0, "candidate_id"), ""),
        (("experiment",), "x" * 257),
        (("host_class",), "h" * 257),
    ],
    WEIGHT_UPDATES: [
        (("version",), 0),
        (("version",), 2**31),
        (("version",), -1),
        (("parent_version",), 3),
        (("parent_version",), 9),
        (("parent_version",), -1),
        (("checksum",), "sha256:xyz"),
        (("checksum",), "md5:" + "a" * 32),
        (("checksum",), "sha256:" + "AB" * 32),
        (("format",), "delta"),
        (("uri",), ""),
        (("uri",), "u" * 4097),
        (("run",), "r" * 257),
        (("metrics",), {"loss": "high"}),
        (("id",), "v 3"),
    ],
    REWARD_REQUESTS: [
        (("index",), -1),
        (("index",), 1024),
        (("id",), "pr/9"),
        (("group_id",), "has space"),
        (("bench", "task"), ""),
        (("bench", "stage"), 0),
        (("client",), "has space"),
        (("client",), "c" * 300),
        (("created_at",), -5.0),
    ],
    CANDIDATE_COMMITMENTS: [
        (("entries",), []),
        (("entries", 0, "index"), -1),
        (("entries", 0, "index"), 1024),
        (("entries", 0, "completion_sha256"), "0" * 64),  # not the text's hash
        (("entries", 0, "rollout_sha256"), "not hex"),
        (("id",), "g@0000000000000000"),  # not the entries' digest
        (("group_id",), "has space"),
        (("generator",), "g" * 300),
        (("created_at",), -5.0),
    ],
}


def out_of_bounds(rng: random.Random, ctx: Ctx) -> bytes:
    raw = ctx.copy()
    path, value = rng.choice(OUT_OF_BOUNDS[ctx.base])
    set_at(raw, path, copy.deepcopy(value))
    return pack(raw)


def bad_packed_array(rng: random.Random, ctx: Ctx) -> bytes:
    raw = ctx.copy()
    arrays = packed_arrays(raw)
    if not arrays:  # no arrays in this schema: an array where a scalar belongs
        path, _ = rng.choice([(p, v) for p, v in leaves(raw) if p != ("schema",)])
        set_at(raw, path, {"dtype": "<i4", "data": b"\x00" * 8})
        return pack(raw)
    path = rng.choice(arrays)
    array = get_at(raw, path)
    name = path[-1]
    choice = rng.randrange(7)
    if choice == 0:
        array["dtype"] = rng.choice(["<f2", ">i4", "int32", "<u4", "", "<i4 ", 4, None, "|b1"])
    elif choice == 1:
        array["data"] += b"\x00"  # not a whole number of items
    elif choice == 2:
        array["data"] = rng.choice([array["data"].hex(), list(array["data"]), None, 0])
    elif choice == 3:  # floats where ids belong, ids where log-probs belong
        array["dtype"] = "<i4" if name == "sampling_logprobs" else "<f4"
    elif choice == 4 and name != "prompt_token_ids":  # one item more than its partner
        array["data"] += array["data"][: 8 if array["dtype"] in ("<i8", "<f8") else 4]
    elif choice == 5:
        array["extra"] = 1
    else:
        del array[rng.choice(["dtype", "data"])]
    return pack(raw)


def oversized_body(rng: random.Random, ctx: Ctx) -> bytes:
    raw = ctx.copy()
    choice = rng.randrange(6)
    if choice == 0:
        return rng.randbytes(MAX_BYTES + rng.randint(1, 5000))
    if choice == 1:  # exactly one byte over the limit, otherwise a fine message
        path = rng.choice(
            [
                p
                for p, v in leaves(raw)
                if isinstance(v, str)
                and p != ("schema",)
                and p[-1] not in ("id", "group_id", "candidate_id", "checksum")
            ]
        )

        def build(n: int) -> bytes:
            set_at(raw, path, "A" * n)
            return pack(raw)

        return sized_str(build, MAX_BYTES + 1)
    if choice == 2:
        return pack(list(range(100)) * 800)
    if choice == 3:
        return pack({**raw, "pad": b"\x00" * (MAX_BYTES + rng.randint(0, 10_000))})
    if choice == 4:
        arrays = packed_arrays(raw)
        if arrays:
            set_at(raw, rng.choice(arrays), {"dtype": "<i4", "data": b"\x01\x00\x00\x00" * 20_000})
            return pack(raw)
    path = rng.choice([p for p, v in leaves(raw) if isinstance(v, str) and p != ("schema",)])
    set_at(raw, path, "B" * (MAX_BYTES * rng.randint(1, 3)))
    return pack(raw)


def oversized_array(rng: random.Random, ctx: Ctx) -> bytes:
    raw = ctx.copy()
    if ctx.base == GENERATE_REQUESTS:
        raw["prompt"] = [{"role": "user", "content": "hi"}] * 65  # limit 64 messages
    elif ctx.base == BENCH_RESULTS:
        raw["timing"]["runs_s"] = [0.1] * 1001  # limit 1000 runs
    elif ctx.base == ROLLOUT_BATCHES:
        raw["samples"] = [raw["samples"][0]] * 1025  # limit 1024 samples (and over MAX_BYTES)
    elif ctx.base == CODE_TO_BENCH:
        # Log-probs over 8 MiB (MAX_ARRAY_BYTES) now and then, else over MAX_BYTES: either
        # way the body limit refuses them first.
        size = 8 * 1024 * 1024 + 4 if rng.random() < 0.15 else 25_000 * 4
        raw["rollout"]["sampling_logprobs"]["data"] = b"\x00" * size
    else:
        raw["metrics"] = {f"m{i}": 1.0 for i in range(8000)}  # only the body limit holds here
    return pack(raw)


LONG_TEXT_SEED = 1234


def handler_reject(rng: random.Random, ctx: Ctx) -> Poison:
    """Valid messages that the service itself must refuse (dead-lettered by its handler)."""
    n = rng.randrange(10**9)
    raw = ctx.copy()
    if ctx.base == GENERATE_REQUESTS:
        if rng.random() < 0.15:  # a floor no version reaches: retried, then dead-lettered
            raw.update(id=f"floor-{n}", min_policy_version=1_000_000)
            kind = "floor_never_reached"
        else:  # a prompt the model's context cannot hold
            letters = random.Random(LONG_TEXT_SEED + n)
            text = " ".join("".join(letters.choices("qxzjvkw", k=5)) for _ in range(4000))
            raw.update(id=f"long-{n}")
            raw["prompt"] = [{"role": "user", "content": text}]
            kind = "prompt_too_long"
    elif ctx.base in (CODE_TO_BENCH, REWARD_REQUESTS):
        group = f"unknown-task-{n}"
        raw.update(id=f"{group}/1", group_id=group)
        raw["bench"]["task"] = rng.choice(
            ["no-such-task", "/etc/passwd", "../matmul", "matmul.toml", "MATMUL"]
        )
        kind = "unknown_task"
    elif ctx.base == BENCH_RESULTS:
        group = f"no-such-group-{n}"
        raw.update(id=f"{group}/1", group_id=group)
        kind = "unknown_group"
    elif ctx.base == CANDIDATE_COMMITMENTS:
        group = f"no-such-group-{n}"
        assert isinstance(ctx.message, CandidateCommitment)
        raw.update(id=commitment_id(group, ctx.message.entries), group_id=group)
        kind = "unknown_group"
    else:
        assert ctx.base == ROLLOUT_BATCHES
        raw["id"] = f"bad-batch-{n}"
        for i, sample in enumerate(raw["samples"]):
            sample["candidate_id"] = f"bad-batch-{n}/{i}"
        choice = rng.randrange(5)
        if choice == 0:
            raw["samples"][0]["completion_token_ids"]["data"] = PackedArray.of(
                [5, 1_000_000], "<i4"
            ).data
            kind = "token_outside_vocabulary"
        elif choice == 1:
            raw["prompt_token_ids"]["data"] = PackedArray.of([1, -3, 2], "<i4").data
            kind = "negative_token_id"
        elif choice == 2:
            raw["samples"][1]["sampling_logprobs"]["data"] = PackedArray.of(
                [math.nan, -0.5], "<f4"
            ).data
            kind = "nan_sampling_logprobs"
        elif choice == 3:
            raw["prompt_token_ids"]["data"] = b""
            kind = "empty_prompt"
        else:
            raw["prompt_token_ids"]["data"] = PackedArray.of(
                [3] * (MAX_SEQUENCE_TOKENS + 10), "<i4"
            ).data
            kind = "sequence_too_long"
    body = pack(raw)
    message = decode(body, ctx.cls, max_bytes=MAX_BYTES)  # valid as a message
    return Poison(ctx.base, f"handler_reject:{kind}", body, message_id=message.id, handled=True)


MUTATIONS: dict[str, Mutation] = {
    "random_bytes": random_bytes,
    "not_msgpack": not_msgpack,
    "truncated": truncated,
    "trailing_bytes": trailing_bytes,
    "non_map": non_map,
    "bad_map_keys": bad_map_keys,
    "invalid_utf8": invalid_utf8,
    "deep_nesting": deep_nesting,
    "ext_type": ext_type,
    "wrong_schema": wrong_schema,
    "swapped_tag": swapped_tag,
    "bad_major": bad_major,
    "bad_tag_type": bad_tag_type,
    "missing_key": missing_key,
    "extra_key": extra_key,
    "wrong_type": wrong_type,
    "non_finite": non_finite,
    "out_of_bounds": out_of_bounds,
    "bad_packed_array": bad_packed_array,
    "oversized_body": oversized_body,
    "oversized_array": oversized_array,
    "handler_reject": handler_reject,
}
# What the reason must say, for kinds with one certain cause.
REASON_PREFIXES: dict[str, tuple[str, ...]] = {
    "oversized_body": ("oversized message",),
    "wrong_schema": ("unexpected schema",),
    "swapped_tag": ("unexpected schema",),
    "truncated": ("not valid msgpack",),
    "trailing_bytes": ("not one msgpack object",),
    "bad_major": ("unsupported major version", "field 'schema' must be", "unknown schema name"),
    "handler_reject": ("rejected by handler", "handler failed"),
}

WEIRD_HEADERS: list[dict[str, Any]] = [
    {"x-delivery-count": "3"},
    {"x-delivery-count": ["a", 1]},
    {"x-delivery-count": 2**62},
    {"x-delivery-count": -7},
    {"x-delivery-count": True},
    {"x-delivery-count": {"n": 1}},
    {"x-delivery-count": None},
    {"x-delivery-count": Decimal("2.5")},
    {"x-delivery-count": b"\x02"},
    {"x-delivery-count": 2},
    {"x-delivery-count": 999_999_999},
    {"x-hpcrl-reason": "forged reason", "x-hpcrl-source-queue": "elsewhere"},
    {"x-death": "not a list"},
    {"x-death": [{"count": "x"}]},
    {"\u043a\u043b\u044e\u0447": "\u0437\u043d\u0430\u0447\u0435\u043d\u0438\u0435"},
    {"k" * 255: "v" * 5000},
    {"nested": {"a": [1, {"b": None}], "c": {"d": {"e": []}}}},
    {"when": datetime(1970, 1, 1)},
    {"bin": bytes(range(256))},
    {"": "empty name"},
]
DECODE_ONLY_HEADERS = ("x-death",)  # the broker itself reads these when it dead-letters


def header_table(entries: list[tuple[bytes, bytes]]) -> bytes:
    """An AMQP field table from (name, type letter + encoded value) pairs."""
    payload = b"".join(bytes([len(name)]) + name + value for name, value in entries)
    return struct.pack(">I", len(payload)) + payload


def float_table(rng: random.Random) -> bytes:
    """Double and float header values, which pika reads as truncated integers and cannot write
    (finite ones: RabbitMQ closes the publisher's channel on a NaN or infinite header value)."""
    return header_table(
        [
            (b"x-delivery-count", b"d" + struct.pack(">d", rng.choice([1.0, 2.5, -3.75]))),
            (b"weight", b"f" + struct.pack(">f", rng.choice([3.0, -0.5, 1e9]))),
            (b"ok", b"S" + struct.pack(">I", 3) + b"yes"),
        ]
    )


class RawHeaderProperties(pika.BasicProperties):
    """Properties whose header table goes out as the bytes given."""

    def __init__(self, table: bytes, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._table = table

    def encode(self) -> list[bytes]:
        marker = {"m": "PLACEHOLDER-OF-THE-RAW-HEADER-TABLE"}
        self.headers = marker
        try:
            encoded = b"".join(super().encode())
        finally:
            self.headers = None
        pieces: list[bytes] = []
        pika.data.encode_table(pieces, marker)
        old = b"".join(pieces)
        assert encoded.count(old) == 1
        return [encoded.replace(old, self._table)]


def make_poison(rng: random.Random) -> list[Poison]:
    messages = valid_messages()
    encoded = {base: encode(message) for base, message in messages.items()}
    poison: list[Poison] = []
    for base, message in messages.items():
        count = PER_FANOUT if base == WEIGHT_UPDATES else PER_WORK_QUEUE
        ctx = Ctx(
            base,
            message,
            msgpack.unpackb(encoded[base], raw=False),
            encoded[base],
            [body for b, body in encoded.items() if b != base],
            [m.schema_tag() for b, m in messages.items() if b != base],
        )
        kinds = [k for k in MUTATIONS if not (k == "handler_reject" and base == WEIGHT_UPDATES)]
        for index in range(count):
            kind = kinds[index % len(kinds)]
            made = MUTATIONS[kind](rng, ctx)
            item = made if isinstance(made, Poison) else Poison(base, kind, made)
            if item.message_id is None and rng.random() < 0.8:
                item.message_id = f"poison-{base}-{index}"
            if rng.random() < 0.3:
                headers = dict(rng.choice(WEIRD_HEADERS))
                if not (item.handled and any(h in headers for h in DECODE_ONLY_HEADERS)):
                    item.headers = headers
            elif not item.handled and rng.random() < 0.04:
                item.raw_headers = float_table(rng)
            poison.append(item)
    return poison


def check_is_poison(item: Poison) -> None:
    """Before anything is sent: the decoder refuses every malformed body (the handler-level
    ones are valid messages), so a body that slipped through would show here, by kind."""
    cls = Topology().expected_schema(item.base)
    if item.handled:
        decode(item.body, cls, max_bytes=MAX_BYTES)
        return
    try:
        message = decode(item.body, cls, max_bytes=MAX_BYTES)
    except MessageError as exc:
        assert exc.reason
        return
    raise AssertionError(
        f"{item.kind} poison on {item.base} decodes as a valid message: {message!r:.300}"
    )


# --- the fleet -------------------------------------------------------------------------------


class GatedSchedulerService(SchedulerService):
    """The real scheduler service; its loop (plan, admit, publish) waits for ``opened``.
    Its consumer serves bench-results and weight-updates all along."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.opened = threading.Event()
        super().__init__(*args, **kwargs)

    def tick(self) -> list:
        if not self.opened.is_set():
            return []
        return super().tick()


def sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


REASON_KINDS = (
    "oversized message",
    "not valid msgpack",
    "not one msgpack object",
    "message must be a msgpack map",
    "missing field 'schema'",
    "field 'schema' must be",
    "unknown schema name",
    "unsupported major version",
    "unexpected schema",
    "rejected by handler",
    "handler failed",
)


def reason_category(reason: str) -> str:
    for prefix in REASON_KINDS:
        if reason.startswith(prefix):
            return prefix
    return reason.split(":")[0][:48]  # "invalid <schema>/<major>"


def make_checked_poison(rng: random.Random) -> list[Poison]:
    """The poison, each item checked to be poison, in a random order."""
    poison = make_poison(rng)
    for item in poison:
        check_is_poison(item)
    rng.shuffle(poison)
    return poison


@dataclass
class PoisonFleet:
    """The four real services, in this process, on one namespace; the broker as the test sees
    it (``raw_channel``)."""

    topology: Topology
    raw_channel: Any
    checkpoints: Path
    scheduler: Scheduler
    scheduler_service: GatedSchedulerService
    learner: Learner
    generator: Generator
    sampler: Any
    services: dict[str, tuple[Consumer, Callable[[], tuple[bool, dict[str, Any]]]]]
    # The weight-updates fanout's queues: the scheduler's durable one, the generator's own.
    subscribers: list[str]
    bases: list[str]  # the queues the poison goes to: the work queues and the fanout

    def depth(self, queue: str) -> int:
        return self.raw_channel.queue_declare(queue, passive=True).method.message_count

    def dlq_depths(self) -> dict[str, int]:
        return {base: self.depth(self.topology.dlq(base)) for base in self.bases}

    def assert_healthy(self, when: str) -> None:
        for name, (consumer, health) in self.services.items():
            ok, detail = consumer.healthy()
            assert ok, f"{name} consumer unhealthy {when}: {detail}"
            ok, detail = health()
            assert ok, f"{name} service unhealthy {when}: {detail}"


def build_fleet(settings: BrokerSettings, raw_channel: Any, tmp_path: Path) -> PoisonFleet:
    """The scheduler (its loop gated), the learner, the generator and the benchmarker, on a
    tiny random policy (version 0 of the generator and the learner); none consuming yet."""
    topology = Topology(settings.namespace, settings.delivery_limit)
    policy = chat_model(tmp_path / "policy")
    checkpoints = tmp_path / "checkpoints"
    experiment = ExperimentSettings(name=EXPERIMENT, seed=SEED)

    scheduler_config = SchedulerConfig(
        broker=settings,
        experiment=experiment,
        scheduler=SchedulerSection(
            iterations=1,
            group_size=GROUP_SIZE,
            node_budget=1,
            max_tokens=16,
            initial_groups_per_step=1,
            metrics_port=0,
            tick_s=0.1,
            exit_when_done=False,
            checkpoint_dir=checkpoints,
        ),
    )
    scheduler = Scheduler(scheduler_config, Store(tmp_path / "scheduler.sqlite"))
    scheduler_consumer = Consumer(settings, "scheduler", concurrency=2)
    scheduler_service = GatedSchedulerService(scheduler, scheduler_consumer)

    learner_consumer, learner = build_learner(
        LearnerConfig(
            broker=settings,
            experiment=experiment,
            learner=LearnerSettings(
                model_path=policy,
                checkpoint_dir=checkpoints,
                groups_per_step=1,
                learning_rate=1e-4,
                metrics_port=0,
                device="cpu",
                max_sequence_tokens=MAX_SEQUENCE_TOKENS,
            ),
        )
    )

    section = GeneratorSection(
        model_path=policy,
        checkpoint_dir=checkpoints,
        backend="transformers",
        max_model_len=MAX_MODEL_LEN,
        metrics_port=0,
        replica=GENERATOR_REPLICA,
        version_wait_s=0.5,
        version_poll_s=0.1,
        poll_manifest=False,
    )
    sampler = make_sampler(section)
    generator_consumer = Consumer(settings, "generator", concurrency=section.concurrency)
    generator = Generator(sampler, section, generator_consumer.topology)
    generator.start()
    generator.attach(generator_consumer)

    bench_section = BenchmarkerSection(
        work_dir=tmp_path / "bench", lock_path=tmp_path / "lock", metrics_port=0, concurrency=1
    )
    benchmarker = Benchmarker(bench_section, detect())
    bench_consumer = build_consumer(
        BenchmarkerConfig(broker=settings, benchmarker=bench_section), benchmarker
    )

    return PoisonFleet(
        topology=topology,
        raw_channel=raw_channel,
        checkpoints=checkpoints,
        scheduler=scheduler,
        scheduler_service=scheduler_service,
        learner=learner,
        generator=generator,
        sampler=sampler,
        services={
            "scheduler": (scheduler_consumer, scheduler_service.health),
            "learner": (learner_consumer, learner.health),
            "generator": (generator_consumer, generator.health),
            "benchmarker": (bench_consumer, benchmarker.health),
        },
        subscribers=[
            topology.subscriber_queue(WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER),
            topology.subscriber_queue(WEIGHT_UPDATES, GENERATOR_REPLICA),
        ],
        bases=[*WORK_QUEUES, WEIGHT_UPDATES],
    )


@dataclass(frozen=True)
class DeadLetterPlan:
    """The poison sent to each queue, and what its DLQ must end up with."""

    sent: dict[str, list[Poison]]
    copies: dict[str, int]  # dead letters per item: one per subscriber of the fanout
    expected: dict[str, Counter]  # body sha256 -> dead letters
    want: dict[str, int]  # dead letters in all


def plan_dead_letters(poison: list[Poison], fleet: PoisonFleet) -> DeadLetterPlan:
    bases = fleet.bases
    sent = {base: [p for p in poison if p.base == base] for base in bases}
    copies = {base: len(fleet.subscribers) if base == WEIGHT_UPDATES else 1 for base in bases}
    expected = {base: Counter({sha(p.body): 0 for p in sent[base]}) for base in bases}
    for base in bases:
        for item in sent[base]:
            expected[base][sha(item.body)] += copies[base]
    want = {base: len(sent[base]) * copies[base] for base in bases}
    return DeadLetterPlan(sent, copies, expected, want)


def assert_everyone_listening(fleet: PoisonFleet) -> None:
    """No dead letter yet; both subscribers of the fanout exchange are listening (a generator
    replica's queue is exclusive to its connection: another one is refused with 405,
    RESOURCE_LOCKED)."""
    assert fleet.dlq_depths() == dict.fromkeys(fleet.bases, 0)
    assert fleet.depth(fleet.subscribers[0]) == 0
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as locked:
        fleet.raw_channel.connection.channel().queue_declare(fleet.subscribers[1], passive=True)
    assert locked.value.reply_code == 405


def publish_the_poison(fleet: PoisonFleet, poison: list[Poison], rng: random.Random) -> None:
    """Every item to its queue (through the exchange a producer uses), with random delivery
    modes, content types and types."""
    topology = fleet.topology
    for item in poison:
        exchange = (
            topology.name(WEIGHT_UPDATES)
            if item.base == WEIGHT_UPDATES
            else topology.work_exchange(item.base)
        )
        routing_key = "" if item.base == WEIGHT_UPDATES else topology.name(item.base)
        options: dict[str, Any] = {
            "delivery_mode": rng.choice([1, 2, 2]),
            "message_id": item.message_id,
            "content_type": rng.choice(["application/msgpack", "application/json", None]),
            "type": rng.choice([None, "candidate/1", "bogus/9"]),
        }
        properties = (
            RawHeaderProperties(item.raw_headers, **options)
            if item.raw_headers is not None
            else pika.BasicProperties(headers=item.headers, **options)
        )
        fleet.raw_channel.basic_publish(
            exchange, routing_key, item.body, properties=properties, mandatory=True
        )


def wait_for_every_dead_letter(fleet: PoisonFleet, plan: DeadLetterPlan) -> None:
    wait_for(
        lambda: fleet.dlq_depths() == plan.want,
        240,
        "every poison message in its DLQ",
        lambda: {"dlq": fleet.dlq_depths(), "want": plan.want},
    )


def assert_only_the_poison_dead_lettered(fleet: PoisonFleet, plan: DeadLetterPlan) -> None:
    """A second later: no more dead letters, every work queue empty, every service healthy."""
    time.sleep(1.0)
    assert fleet.dlq_depths() == plan.want  # and nothing more
    for base in WORK_QUEUES:
        assert fleet.depth(fleet.topology.name(base)) == 0, base
    fleet.assert_healthy("after the poison")


def run_valid_work(fleet: PoisonFleet) -> tuple[Any, list[str]]:
    """Valid work, afterwards: the scheduler's loop starts the whole chain, a group is
    sampled, judged, stored and trained on, and every service takes version 1. Returns the
    group and its results' statuses."""
    store = fleet.scheduler.store
    learner, generator = fleet.learner, fleet.generator
    scheduler_service = fleet.scheduler_service
    scheduler_service.opened.set()
    wait_for(
        lambda: store.count_batches_sent() == 1,
        240,
        "the group to be sampled, judged, stored and sent to the learner",
        lambda: {"dlq": fleet.dlq_depths(), "groups": store.groups_of_iteration(0)},
    )
    [group] = store.groups_of_iteration(0)
    assert group.state == "closed" and group.close_reason == "complete"
    assert store.count_results(group.id) == GROUP_SIZE
    statuses = sorted(r.status for r in store.results_of(group.id))
    wait_for(
        lambda: learner.version == 1,
        240,
        "the learner's step and commit",
        lambda: learner.health(),
    )
    wait_for(
        lambda: store.get("policy_version", 0) == 1 and scheduler_service.finished,
        120,
        "the scheduler to see version 1 and finish",
        lambda: scheduler_service.health(),
    )
    wait_for(
        lambda: generator.tracker.loaded == 1,
        120,
        "the generator to load version 1",
        lambda: generator.health(),
    )
    return group, statuses


def assert_the_valid_work_left_nothing(fleet: PoisonFleet, plan: DeadLetterPlan) -> None:
    """One version committed, every work queue empty, no dead letter added, all healthy."""
    assert [v.version for v in CheckpointStore(fleet.checkpoints).versions()] == [1]
    for base in WORK_QUEUES:
        assert fleet.depth(fleet.topology.name(base)) == 0, base
    assert fleet.dlq_depths() == plan.want  # the valid work added no dead letter
    fleet.assert_healthy("after the valid work")


def check_every_dead_letter(
    fleet: PoisonFleet, poison: list[Poison], plan: DeadLetterPlan
) -> dict[str, Counter]:
    """Every dead letter: the body sent, to the DLQ of its queue, with a reason. Returns the
    reasons' categories per queue."""
    topology = fleet.topology
    kinds_of: dict[str, set[str]] = defaultdict(set)
    for item in poison:
        kinds_of[sha(item.body)].add(item.kind.split(":")[0])
    reasons: dict[str, Counter] = {}
    for base in fleet.bases:
        got: Counter = Counter()
        sources: Counter = Counter()
        reasons[base] = Counter()
        while True:
            method, properties, body = fleet.raw_channel.basic_get(
                topology.dlq(base), auto_ack=True
            )
            if method is None:
                break
            headers = properties.headers or {}
            reason = headers.get(REASON_HEADER)
            assert isinstance(reason, str) and reason.strip(), (base, headers)
            assert reason != "forged reason", (base, headers)
            key = sha(body)
            for kind in kinds_of.get(key, ()):
                prefixes = REASON_PREFIXES.get(kind)
                ok = prefixes is None or reason.startswith(prefixes) or len(kinds_of[key]) > 1
                assert ok, (base, kind, reason)
            got[key] += 1
            sources[headers.get(SOURCE_QUEUE_HEADER)] += 1
            reasons[base][reason_category(reason)] += 1
        assert got == plan.expected[base], f"{base}: dead letters differ from what was sent"
        if base == WEIGHT_UPDATES:
            assert sources == dict.fromkeys(fleet.subscribers, len(plan.sent[base])), sources
        else:
            assert sources == {topology.name(base): len(plan.sent[base])}, sources
    return reasons


def print_what_was_sent_and_dead_lettered(
    fleet: PoisonFleet,
    poison: list[Poison],
    plan: DeadLetterPlan,
    reasons: dict[str, Counter],
    group: Any,
    statuses: list[str],
) -> None:
    sent, copies, want = plan.sent, plan.copies, plan.want
    print(f"\n{'queue':<18}{'sent':>6}{'x':>3}{'dead letters':>14}  weird headers")
    for base in fleet.bases:
        weird = sum(1 for p in sent[base] if p.headers or p.raw_headers)
        print(f"{base:<18}{len(sent[base]):>6}{copies[base]:>3}{want[base]:>14}  {weird}")
    print(f"{'total':<18}{len(poison):>6}{'':>3}{sum(want.values()):>14}")
    for base in fleet.bases:
        kinds = Counter(p.kind for p in sent[base])
        print(f"\n{base} kinds: " + ", ".join(f"{k}={n}" for k, n in sorted(kinds.items())))
        print(f"{base} reasons: " + ", ".join(f"{k!r}={n}" for k, n in reasons[base].most_common()))
    print(
        f"\nvalid chain: group {group.id}: results {statuses}, learner version "
        f"{fleet.learner.version}, generator loaded {fleet.generator.tracker.loaded}"
    )


@pytest.mark.slow
def test_poison_at_volume_is_dead_lettered_and_the_fleet_keeps_serving(
    broker_settings, raw_channel, tmp_path
):
    started = time.monotonic()
    timings: dict[str, float] = {}

    def lap(name: str, since: float) -> None:
        timings[name] = time.monotonic() - since

    rng = random.Random(SEED)
    settings = broker_settings.model_copy(update={"max_message_bytes": MAX_BYTES})
    poison = make_checked_poison(rng)
    fleet = build_fleet(settings, raw_channel, tmp_path)
    plan = plan_dead_letters(poison, fleet)
    lap("set-up", started)
    with contextlib.ExitStack() as stack:
        stack.callback(fleet.sampler.close)
        for consumer, _ in fleet.services.values():
            stack.enter_context(RunningConsumer(consumer))
        assert_everyone_listening(fleet)
        phase = time.monotonic()
        publish_the_poison(fleet, poison, rng)
        lap("publish", phase)
        wait_for_every_dead_letter(fleet, plan)
        lap("dead-lettering", phase)
        assert_only_the_poison_dead_lettered(fleet, plan)
        phase = time.monotonic()
        group, statuses = run_valid_work(fleet)
        lap("valid chain", phase)
        assert_the_valid_work_left_nothing(fleet, plan)
        phase = time.monotonic()
        reasons = check_every_dead_letter(fleet, poison, plan)
        lap("dlq check", phase)
    lap("total", started)
    print_what_was_sent_and_dead_lettered(fleet, poison, plan, reasons, group, statuses)
    print("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))


def test_headers_pika_cannot_carry_are_dead_lettered_with_a_reason(broker_settings, raw_channel):
    """Header values that RabbitMQ takes but pika cannot carry, on bodies that are poison
    anyway: a double beyond the int64 range (pika reads floats as integers, and cannot write
    that one back into the dead letter's headers) and a timestamp beyond datetime's range
    (pika cannot read the properties of the delivery at all). Either must be dead-lettered
    once, with a reason, by a consumer that stays connected, alive and serving."""
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    consumer = Consumer(broker_settings, "poison-headers")
    handled: list[str] = []
    consumer.subscribe(CODE_TO_BENCH, lambda message, _delivery: handled.append(message.id) or [])
    valid = valid_messages()[CODE_TO_BENCH]
    tables = {
        "huge double": header_table([(b"x-delivery-count", b"d" + struct.pack(">d", 1e30))]),
        "huge float": header_table([(b"weight", b"f" + struct.pack(">f", -1e20))]),
        "far timestamp": header_table([(b"when", b"T" + struct.pack(">Q", 2**40))]),
    }
    exchange, queue = topology.work_exchange(CODE_TO_BENCH), topology.name(CODE_TO_BENCH)
    running = RunningConsumer(consumer)
    with running:
        for name, table in tables.items():
            raw_channel.basic_publish(
                exchange,
                queue,
                name.encode(),
                properties=RawHeaderProperties(table, message_id=name),
                mandatory=True,
            )
        raw_channel.basic_publish(exchange, queue, encode(valid), mandatory=True)
        dlq = topology.dlq(CODE_TO_BENCH)
        wait_for(
            lambda: (
                handled == [valid.id]
                and raw_channel.queue_declare(dlq, passive=True).method.message_count == len(tables)
            ),
            30,
            "the valid message handled and every poison message dead-lettered",
            lambda: {
                "handled": handled,
                "connections": consumer.connections,
                "alive": running.thread.is_alive(),
                "dlq": raw_channel.queue_declare(dlq, passive=True).method.message_count,
            },
        )
        reasons = {}
        for _ in tables:
            method, properties, body = raw_channel.basic_get(dlq, auto_ack=True)
            assert method is not None
            reasons[body.decode()] = (properties.headers or {}).get(REASON_HEADER)
        assert all(reasons.get(name) for name in tables), reasons
        assert raw_channel.basic_get(dlq, auto_ack=True)[0] is None, "a dead letter twice"
        assert running.thread.is_alive(), "the consumer's loop died"
        assert consumer.connections == 1, f"{consumer.connections} connections: it reconnected"
        ok, detail = consumer.healthy()
        assert ok, detail
