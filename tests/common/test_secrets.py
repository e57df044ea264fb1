"""Secrets never show: not in config errors, logs of a failing connection, or --help."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from hpcrl_common.broker import Consumer
from hpcrl_common.config import BrokerSettings, ConfigError, ServiceConfig, load_config, mask_url
from hpcrl_common.topology import CODE_TO_BENCH

SECRET = "s3cret-Passw0rd"


def test_urls_are_masked():
    assert (
        mask_url(f"amqps://hpcrl-benchmarker:{SECRET}@broker:5671/exp")
        == "amqps://hpcrl-benchmarker:***@broker:5671/exp"
    )
    assert mask_url("amqp://broker/exp") == "amqp://broker/exp"


@pytest.mark.parametrize(
    "env",
    [
        {"HPCRL__BROKER__URL": f"http://u:{SECRET}@broker/exp"},
        {"HPCRL__BROKER__URL": f"amqp://u:{SECRET}@broker/exp", "HPCRL__BROKER__TLS_CA_FILE": "/x"},
        {"HPCRL__BROKER__URL": f"amqp://u:{SECRET}@broker/exp", "HPCRL__BROKER__PREFETCH": "no"},
    ],
)
def test_config_errors_do_not_echo_the_password(env):
    with pytest.raises(ConfigError) as caught:
        load_config(ServiceConfig, None, env=env)
    assert SECRET not in str(caught.value)


@pytest.mark.broker
def test_a_refused_login_is_logged_without_the_password(rabbitmq, capfd):
    settings = BrokerSettings(
        url=f"amqp://guest:{SECRET}@127.0.0.1:5672/%2F",
        reconnect_initial_s=0.2,
        reconnect_max_s=0.5,
    )
    consumer = Consumer(settings, "secret-test")
    consumer.subscribe(CODE_TO_BENCH, lambda m, _d: [])
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    time.sleep(2.0)
    consumer.stop()
    thread.join(10)
    out, err = capfd.readouterr()
    assert "reconnecting" in out + err  # it did try, and said so
    assert SECRET not in out + err


@pytest.mark.parametrize(
    "command",
    [
        "hpcrl_benchmarker.cli",
        "hpcrl_scheduler.cli",
        "hpcrl_learner.cli",
        "hpcrl_generator.cli",
        "hpcrl_common.admin",
    ],
)
def test_help_shows_no_secret_from_the_environment(command, monkeypatch):
    monkeypatch.setenv("HPCRL__BROKER__URL", f"amqp://u:{SECRET}@broker/exp")
    done = subprocess.run(
        [sys.executable, "-m", command, "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stdout + done.stderr


def test_a_url_with_a_user_and_no_password_takes_the_password_file(tmp_path):
    from hpcrl_common.broker import connection_parameters

    secret = tmp_path / "benchmarker.password"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    settings = BrokerSettings(
        url="amqps://hpcrl-benchmarker@broker.example.org:5671/exp", password_file=secret
    )
    [params] = connection_parameters(settings, "test")
    assert params.credentials.username == "hpcrl-benchmarker"
    assert params.credentials.password == SECRET
    assert params.virtual_host == "exp" and params.port == 5671
