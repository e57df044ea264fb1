"""A real benchmarker replica (`hpcrl-benchmarker serve` subprocess) for the reward client."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcrl_common.config import BrokerSettings
from tests.benchmarker.test_service import start_replica, stop_replica, write_config


@pytest.fixture
def replica(broker_settings: BrokerSettings, tmp_path: Path) -> Iterator[subprocess.Popen]:
    proc = start_replica(write_config(tmp_path / "bench.toml", broker_settings, tmp_path))
    yield proc
    stop_replica(proc)
