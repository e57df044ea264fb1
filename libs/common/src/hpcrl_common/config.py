"""Typed configuration: one experiment TOML shared by all services, plus env overrides.

Each service validates the common sections (``broker``, ``logging``, ``experiment``) and its
own section; sections of other services are skipped, unknown ones are errors. Environment
variables ``HPCRL__<SECTION>__<KEY>=value`` override the file (nested keys with more ``__``).
Every error names the offending key and where its value came from.

Keys of different services that state one fact (the base model, the checkpoint store, the
learner's step size) or must fit together are declared once, in ``RELATIONS``; every service
checks all of them on the merged file + environment before it drops the other sections, so a
disagreement stops whichever service is started first, with both keys named.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

ENV_PREFIX = "HPCRL__"
SERVICE_SECTIONS = ("generator", "benchmarker", "learner", "scheduler")


RelationKind = Literal["equal", "at_most", "implies"]


@dataclass(frozen=True)
class Relation:
    """``left`` *kind* ``right`` for two keys of different sections of one experiment config.

    equal: the same fact, stated where each service reads it; at_most: left <= right;
    implies: left true needs right true. ``read_as`` is the type both raw values (TOML or
    environment strings) are validated as before they are compared.
    """

    left: str
    kind: RelationKind
    right: str
    read_as: Any
    why: str


RELATIONS: tuple[Relation, ...] = (
    Relation(
        "learner.model_path",
        "equal",
        "generator.model_path",
        Path,
        "version 0 of the policy the learner trains and the generators sample",
    ),
    Relation(
        "learner.checkpoint_dir",
        "equal",
        "generator.checkpoint_dir",
        Path | None,
        "the generators load new versions only from the learner's store (an unset "
        "generator.checkpoint_dir serves version 0 only and is not compared)",
    ),
    Relation(
        "learner.checkpoint_dir",
        "equal",
        "scheduler.checkpoint_dir",
        Path | None,
        "the scheduler takes a policy version (its floor, the pacing figures) only "
        "from the learner's store (unset, it follows learner.checkpoint_dir of the same "
        "file)",
    ),
    Relation(
        "scheduler.initial_groups_per_step",
        "equal",
        "learner.groups_per_step",
        int,
        "the scheduler paces by it until the learner's first update: if max_staleness "
        "x it is below a step's worth the first step never fills, if above, generation "
        "runs further ahead than max_staleness",
    ),
    Relation(
        "scheduler.max_staleness",
        "at_most",
        "learner.max_staleness",
        int,
        "the learner drops groups sampled more versions behind than it allows",
    ),
    Relation(
        "generator.max_model_len",
        "at_most",
        "learner.max_sequence_tokens",
        int,
        "the learner refuses (dead-letters) longer prompt + completion sequences",
    ),
    Relation(
        "learner.lora.enabled",
        "implies",
        "generator.enable_lora",
        bool,
        "a LoRA learner publishes adapters, which vLLM loads only with enable_lora",
    ),
)

# Defaults of the related keys, written only here: a service checking a relation needs the
# default of a key of another service, whose package need not be installed on its host. The
# owning sections take their defaults from here (``related_default``). A key that is not
# listed is required.
RELATED_DEFAULTS: dict[str, Any] = {
    "learner.model_path": Path("models/base"),
    "learner.checkpoint_dir": Path("data/checkpoints"),
    "generator.checkpoint_dir": None,
    "scheduler.checkpoint_dir": None,
    "learner.groups_per_step": 4,
    "scheduler.initial_groups_per_step": 4,
    "scheduler.max_staleness": 2,
    "learner.max_staleness": 4,
    "generator.max_model_len": 4096,
    "learner.max_sequence_tokens": 4096,
    "learner.lora.enabled": False,
    "generator.enable_lora": False,
}


# Keys that, absent from the file and the environment, take the value of another service's
# key when that service's section is in the same file (its default if the key is not).
FOLLOWS: dict[str, str] = {"scheduler.checkpoint_dir": "learner.checkpoint_dir"}


def related_default(key: str) -> Any:
    """The default of a key named in ``RELATIONS``, for the Field of its own section."""
    return RELATED_DEFAULTS[key]


class Section(BaseModel):
    """Base of every config section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


ROLE_NAMES = ("scheduler", "generator", "benchmarker", "learner")


class BrokerSettings(Section):
    url: str = Field(
        "amqp://guest:guest@127.0.0.1:5672/%2F",
        description="AMQP URL of RabbitMQ: amqp:// or amqps:// (TLS); put the password in "
        "password_file, not here, outside a test machine",
    )
    failover_urls: list[str] = Field(
        default_factory=list,
        description="other nodes of the same cluster, tried in order after url when a "
        "connection cannot be made; same user, vhost and TLS settings as url (their "
        "user:password may be left out)",
    )
    password_file: Path | None = Field(
        None,
        description="file holding the broker password (replaces the URL's); must not "
        "be readable by other users",
    )
    tls_ca_file: Path | None = Field(
        None,
        description="CA bundle that signs the broker's certificate (amqps://; unset = "
        "the system's CAs)",
    )
    tls_cert_file: Path | None = Field(
        None, description="client certificate (PEM) for brokers that require one"
    )
    tls_key_file: Path | None = Field(None, description="key of tls_cert_file (PEM)")
    tls_server_name: str = Field(
        "", description="name the broker's certificate must carry (default: the URL's host)"
    )
    declare_topology: bool = Field(
        True,
        description="declare queues and exchanges at start (needs configure rights); "
        "false: only check they exist (made once by `hpcrl-broker-admin`)",
    )
    authenticate_publishers: bool = Field(
        False,
        description="accept a message only from the role that may publish it (its "
        "user_id, which RabbitMQ verifies); others are dead-lettered",
    )
    role_users: dict[str, str] = Field(
        default_factory=lambda: {role: f"hpcrl-{role}" for role in ROLE_NAMES},
        description="broker user of each role (scheduler, generator, benchmarker, learner); "
        "<user>.<name> also counts, e.g. one benchmarker user per site",
    )
    namespace: str = Field("", description="prefix of every queue/exchange name")
    prefetch: int = Field(8, ge=1, le=10_000, description="unacked messages per consumer")
    heartbeat_s: int = Field(30, ge=0, le=3600, description="AMQP heartbeat interval")
    delivery_limit: int = Field(5, ge=1, le=100, description="tries before dead-lettering")
    max_message_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="body size limit")
    reconnect_initial_s: float = Field(0.5, gt=0, description="first reconnect delay")
    reconnect_max_s: float = Field(30.0, gt=0, description="reconnect delay cap")

    @model_validator(mode="after")
    def _consistent(self) -> BrokerSettings:
        scheme = urlsplit(self.url).scheme
        if scheme not in ("amqp", "amqps"):
            raise ValueError(f"url must start with amqp:// or amqps://, got {scheme!r}://")
        for index, other in enumerate(self.failover_urls):
            _check_failover_url(f"failover_urls[{index}] ({mask_url(other)})", other, self.url)
        tls_files = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        if scheme == "amqp" and any(path is not None for path in tls_files):
            raise ValueError("tls_* files are set but url is amqp://, not amqps://")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if set(self.role_users) - {"client"} != set(ROLE_NAMES):
            raise ValueError(
                f"role_users must name exactly the roles {', '.join(ROLE_NAMES)} "
                f"(and optionally client)"
            )
        return self

    @property
    def masked_url(self) -> str:
        return mask_url(self.url)


def _check_failover_url(where: str, other: str, url: str) -> None:
    """Another node of url's cluster: same scheme, user, password (if given) and vhost."""
    mine, theirs = urlsplit(url), urlsplit(other)
    if theirs.scheme not in ("amqp", "amqps"):
        raise ValueError(f"{where} must start with amqp:// or amqps://, got {theirs.scheme!r}://")
    if theirs.scheme != mine.scheme:
        raise ValueError(
            f"{where} is {theirs.scheme}:// but url is {mine.scheme}://: every "
            f"node of the cluster is reached the same way (TLS or not)"
        )
    if not theirs.hostname:
        raise ValueError(f"{where} names no host")
    if theirs.username is not None and unquote(theirs.username) != unquote(mine.username or ""):
        theirs_user = unquote(theirs.username)
        mine_user = "none" if mine.username is None else repr(unquote(mine.username))
        raise ValueError(
            f"{where} has user {theirs_user!r}, url has {mine_user}: the nodes "
            f"of a cluster share users; leave user:password out of failover URLs"
        )
    if theirs.password is not None and theirs.password != mine.password:
        raise ValueError(
            f"{where} has a password other than url's: leave user:password out "
            f"of failover URLs (url's, or password_file, applies to each)"
        )
    if _vhost(theirs.path) != _vhost(mine.path):
        raise ValueError(
            f"{where} names vhost {_vhost(theirs.path)!r}, url "
            f"{_vhost(mine.path)!r}: failover URLs must name url's vhost"
        )


def _vhost(path: str) -> str:
    """The vhost of an AMQP URL's path, as pika reads it ("/" when none is named)."""
    return unquote(path.split("/")[1]) if len(path) > 1 else "/"


def mask_url(url: str) -> str:
    """The URL with its password replaced by ***, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


class LoggingSettings(Section):
    level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="debug, info, warning or error"
    )
    format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto: console on a terminal, JSON otherwise"
    )


DEFAULT_TASK = "matmul"


class ExperimentSettings(Section):
    name: str = Field(
        "default",
        min_length=1,
        max_length=128,
        description="names the run: group ids, the scheduler's database",
    )
    seed: int = Field(0, description="seed of selection tie-breaks and sampling")
    task: str = Field(
        DEFAULT_TASK,
        description="task name or path of a task TOML (the only task unless `tasks` is set)",
    )
    tasks: dict[str, float] = Field(
        default_factory=dict,
        description="several tasks in one run: a table task name or path -> weight (> 0), "
        "e.g. `matmul = 1` and `gemv = 1` under `[experiment.tasks]`; the scheduler splits each "
        "iteration's node budget by weight, one SQD pool per (task, stage); empty: `task` alone",
    )
    opt_level: Literal["O0", "O1", "O2", "O3"] = Field(
        "O3", description="gcc optimisation level of the benchmarks (the paper's O0/O1/O3)"
    )
    data_dir: Path = Field(Path("data"), description="where services keep local state")

    @model_validator(mode="after")
    def _tasks_consistent(self) -> ExperimentSettings:
        for name, weight in self.tasks.items():
            if not name.strip():
                raise ValueError("tasks: a task name may not be empty")
            if not weight > 0 or weight == float("inf"):
                raise ValueError(
                    f"tasks: the weight of {name!r} must be > 0 and finite, got {weight}"
                )
        # A `task` other than the default next to a `tasks` table that leaves it out is two
        # contradicting answers to "what does this run train on": refuse it rather than guess.
        if self.tasks and self.task != DEFAULT_TASK and self.task not in self.tasks:
            raise ValueError(
                f"task = {self.task!r} is not in tasks ({', '.join(self.tasks)}): name every task "
                "of the run in tasks, or leave task unset"
            )
        return self

    def task_weights(self) -> dict[str, float]:
        """The run's tasks and their weights: ``tasks``, or ``{task: 1.0}`` when it is empty."""
        return dict(self.tasks) if self.tasks else {self.task: 1.0}


class ServiceConfig(Section):
    """Common sections; each service subclasses this and adds its own section."""

    broker: BrokerSettings = BrokerSettings()
    logging: LoggingSettings = LoggingSettings()
    experiment: ExperimentSettings = ExperimentSettings()


class ConfigError(ValueError):
    pass


C = TypeVar("C", bound=ServiceConfig)


def load_config(
    model: type[C], path: str | Path | None = None, env: Mapping[str, str] | None = None
) -> C:
    """Read ``path`` (optional), overlay ``HPCRL__*`` variables, validate into ``model``."""
    env = os.environ if env is None else env
    data: dict[str, Any] = {}
    origin: dict[tuple[str, ...], str] = {}
    if path is not None:
        data = _read_toml(Path(path))
        _record_origin(data, (), f"file {path}", origin)
    _overlay_env(data, env, origin)
    # Before the other services' sections are dropped: they hold the other side.
    disagreements = _check_relations(data, origin)
    _follow(data, origin)
    data = _drop_other_services(model, data)
    try:
        config = model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, origin, disagreements)) from None
    if disagreements:
        raise ConfigError("\n".join(["invalid configuration:", *disagreements]))
    return config


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def _record_origin(
    data: Mapping[str, Any], prefix: tuple[str, ...], where: str, origin: dict
) -> None:
    for key, value in data.items():
        origin[(*prefix, key)] = where
        if isinstance(value, Mapping):
            _record_origin(value, (*prefix, key), where, origin)


def _overlay_env(data: dict[str, Any], env: Mapping[str, str], origin: dict) -> None:
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        keys = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
        if not all(keys):
            raise ConfigError(f"environment variable {name}: empty key segment")
        target = data
        for key in keys[:-1]:
            nested = target.setdefault(key, {})
            if not isinstance(nested, dict):
                raise ConfigError(f"environment variable {name}: {key!r} is not a section")
            target = nested
        target[keys[-1]] = _env_value(raw)
        origin[tuple(keys)] = f"environment {name}"


def _env_value(raw: str) -> Any:
    """Strings stay strings (pydantic coerces them); JSON lists and tables are parsed."""
    if raw[:1] in "[{":
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _follow(data: dict[str, Any], origin: dict[tuple[str, ...], str]) -> None:
    """Fill each unset key of ``FOLLOWS`` from the key it follows (see there)."""
    for key, source in FOLLOWS.items():
        (section, name), (other, other_name) = key.split("."), source.split(".")
        if (
            not isinstance(data.get(other), Mapping)
            or not isinstance(data.setdefault(section, {}), dict)
            or name in data[section]
        ):
            continue
        if other_name in data[other]:
            data[section][name] = data[other][other_name]
            origin[(section, name)] = _origin_of((other, other_name), origin)
        else:
            data[section][name] = RELATED_DEFAULTS[source]


def _drop_other_services(model: type[ServiceConfig], data: dict[str, Any]) -> dict[str, Any]:
    known = set(model.model_fields)
    return {k: v for k, v in data.items() if k in known or k not in SERVICE_SECTIONS}


def _check_relations(data: Mapping[str, Any], origin: Mapping[tuple[str, ...], str]) -> list[str]:
    """One line per violated relation, naming both keys, their values and their sources.

    A relation is checked only when both sections are in the file or the environment: a
    config without, say, a ``[learner]`` section describes no learner (a generator-only
    evaluation, one service's test). A key absent from its section takes its default, since
    that is what its service will run with. It is not compared when that leaves it without a
    value (required: its own service reports it; None: unset, e.g. generator.checkpoint_dir)
    or when its value is invalid (its own service reports that too).
    """
    lines = []
    for relation in RELATIONS:
        left_side = _related_value(data, origin, relation.left, relation.read_as)
        right_side = _related_value(data, origin, relation.right, relation.read_as)
        if left_side is None or right_side is None:
            continue
        (left, left_from), (right, right_from) = left_side, right_side
        if _holds(relation.kind, left, right):
            continue
        if relation.kind == "implies":
            claim = f"{relation.left} = true requires {relation.right} = true"
        else:
            verb = "must equal" if relation.kind == "equal" else "must be at most"
            claim = f"{relation.left} {verb} {relation.right}"
        lines.append(
            f"  {claim}, but {relation.left} = {_shown(left)} [{left_from}] and "
            f"{relation.right} = {_shown(right)} [{right_from}]: {relation.why}"
        )
    return lines


def _related_value(
    data: Mapping[str, Any], origin: Mapping[tuple[str, ...], str], key: str, read_as: Any
) -> tuple[Any, str] | None:
    """(value, where it came from) of a dotted key, or None when it is not to be compared."""
    path = tuple(key.split("."))
    if not isinstance(data.get(path[0]), Mapping):
        return None
    node: Any = data
    for part in path:
        if not isinstance(node, Mapping):
            return None  # not a table: its own service reports that
        if part not in node:
            if key not in RELATED_DEFAULTS:
                return None
            value, where = RELATED_DEFAULTS[key], "default"
            break
        node = node[part]
    else:
        value, where = node, f"from {_origin_of(path, origin)}"
    try:
        value = TypeAdapter(read_as).validate_python(value)
    except ValidationError:
        return None
    return None if value is None else (value, where)


def _holds(kind: RelationKind, left: Any, right: Any) -> bool:
    if kind == "equal":
        return bool(left == right)
    if kind == "at_most":
        return bool(left <= right)
    return bool(right or not left)


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return repr(str(value)) if isinstance(value, Path) else repr(value)


def _explain(
    exc: ValidationError, origin: Mapping[tuple[str, ...], str], extra: Sequence[str] = ()
) -> str:
    lines = ["invalid configuration:"]
    for error in exc.errors():
        loc = tuple(str(part) for part in error["loc"])
        key = ".".join(loc)
        message = "unknown key" if error["type"] == "extra_forbidden" else error["msg"]
        where = _origin_of(loc, origin)
        value = error.get("input")
        if isinstance(value, str) and key.endswith("url"):
            value = mask_url(value)  # never echo a password
        shown = "" if isinstance(value, dict | list) or value is None else f" (value {value!r})"
        lines.append(f"  {key}: {message}{shown}{f' [from {where}]' if where else ''}")
    return "\n".join([*lines, *extra])


def _origin_of(loc: tuple[str, ...], origin: Mapping[tuple[str, ...], str]) -> str:
    for end in range(len(loc), 0, -1):
        if loc[:end] in origin:
            return origin[loc[:end]]
    return ""
