"""Typed config: TOML + environment overrides, errors that name the key and its source."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from hpcrl_common.config import ConfigError, Section, ServiceConfig, load_config


class DemoSection(Section):
    concurrency: int = Field(1, ge=1)
    allow_isa: list[str] = []


class DemoConfig(ServiceConfig):
    benchmarker: DemoSection = DemoSection()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exp.toml"
    path.write_text(text)
    return path


def test_defaults_without_a_file():
    config = load_config(DemoConfig, None, env={})
    assert config.broker.url.startswith("amqp://") and config.benchmarker.concurrency == 1


def test_file_then_environment_overrides(tmp_path):
    path = write(tmp_path, '[broker]\nprefetch = 3\n[benchmarker]\nconcurrency = 2\n'
                           '[scheduler]\nanything = "is another service\'s business"\n')
    env = {"HPCRL__BENCHMARKER__CONCURRENCY": "4", "HPCRL__BENCHMARKER__ALLOW_ISA": '["avx2"]',
           "HPCRL__LOGGING__LEVEL": "debug", "UNRELATED": "x"}
    config = load_config(DemoConfig, path, env=env)
    assert config.broker.prefetch == 3
    assert config.benchmarker.concurrency == 4
    assert config.benchmarker.allow_isa == ["avx2"]
    assert config.logging.level == "debug"


@pytest.mark.parametrize(
    ("toml", "env", "expected"),
    [
        ("[broker]\nprefetch = 0\n", {}, "broker.prefetch: Input should be greater than or equal"),
        ("[broker]\nprefech = 3\n", {}, "broker.prefech: unknown key (value 3) [from file"),
        ("[brokr]\nurl = 'x'\n", {}, "brokr: unknown key"),
        ("", {"HPCRL__BENCHMARKER__CONCURRENCY": "many"},
         "benchmarker.concurrency: Input should be a valid integer, unable to parse string as an "
         "integer (value 'many') [from environment HPCRL__BENCHMARKER__CONCURRENCY]"),
        ("[logging]\nlevel = 'loud'\n", {}, "logging.level: Input should be"),
    ],
)
def test_errors_name_the_bad_key_and_its_source(tmp_path, toml, env, expected):
    with pytest.raises(ConfigError) as caught:
        load_config(DemoConfig, write(tmp_path, toml), env=env)
    assert expected in str(caught.value)


def test_unreadable_files_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(DemoConfig, tmp_path / "missing.toml", env={})
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(DemoConfig, write(tmp_path, "[broker\n"), env={})
