"""Typed configuration: one experiment TOML shared by all services, plus env overrides.

Each service validates the common sections (``broker``, ``logging``, ``experiment``) and its
own section; sections of other services are skipped, unknown ones are errors. Environment
variables ``HPCRL__<SECTION>__<KEY>=value`` override the file (nested keys with more ``__``).
Every error names the offending key and where its value came from.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ENV_PREFIX = "HPCRL__"
SERVICE_SECTIONS = ("generator", "benchmarker", "learner", "scheduler")


class Section(BaseModel):
    """Base of every config section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


class BrokerSettings(Section):
    url: str = Field(
        "amqp://guest:guest@127.0.0.1:5672/%2F", description="AMQP URL of RabbitMQ"
    )
    namespace: str = Field("", description="prefix of every queue/exchange name")
    prefetch: int = Field(8, ge=1, le=10_000, description="unacked messages per consumer")
    heartbeat_s: int = Field(30, ge=0, le=3600, description="AMQP heartbeat interval")
    delivery_limit: int = Field(5, ge=1, le=100, description="tries before dead-lettering")
    max_message_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="body size limit")
    reconnect_initial_s: float = Field(0.5, gt=0, description="first reconnect delay")
    reconnect_max_s: float = Field(30.0, gt=0, description="reconnect delay cap")


class LoggingSettings(Section):
    level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="debug, info, warning or error"
    )
    format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto: console on a terminal, JSON otherwise"
    )


class ExperimentSettings(Section):
    name: str = Field("default", min_length=1, max_length=128,
                      description="names the run: group ids, the scheduler's database")
    seed: int = Field(0, description="seed of selection tie-breaks and sampling")
    task: str = Field("matmul", description="task name or path of a task TOML")
    opt_level: Literal["O0", "O1", "O2", "O3"] = Field(
        "O3", description="gcc optimisation level of the benchmarks (the paper's O0/O1/O3)"
    )
    data_dir: Path = Field(Path("data"), description="where services keep local state")


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
    data = _drop_other_services(model, data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, origin)) from None


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


def _drop_other_services(model: type[ServiceConfig], data: dict[str, Any]) -> dict[str, Any]:
    known = set(model.model_fields)
    return {k: v for k, v in data.items() if k in known or k not in SERVICE_SECTIONS}


def _explain(exc: ValidationError, origin: Mapping[tuple[str, ...], str]) -> str:
    lines = ["invalid configuration:"]
    for error in exc.errors():
        loc = tuple(str(part) for part in error["loc"])
        key = ".".join(loc)
        message = "unknown key" if error["type"] == "extra_forbidden" else error["msg"]
        where = _origin_of(loc, origin)
        value = error.get("input")
        shown = "" if isinstance(value, dict | list) or value is None else f" (value {value!r})"
        lines.append(f"  {key}: {message}{shown}{f' [from {where}]' if where else ''}")
    return "\n".join(lines)


def _origin_of(loc: tuple[str, ...], origin: Mapping[tuple[str, ...], str]) -> str:
    for end in range(len(loc), 0, -1):
        if loc[:end] in origin:
            return origin[loc[:end]]
    return ""
