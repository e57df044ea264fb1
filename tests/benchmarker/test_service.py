"""The service path over the real RabbitMQ: `hpcrl-benchmarker serve` as a subprocess."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from hpcrl_common.broker import Publish, Publisher
from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import (
    BenchResult,
    BenchSpec,
    Candidate,
    PackedArray,
    RolloutData,
    candidate_id,
    decode,
)
from hpcrl_common.topology import BENCH_RESULTS, CODE_TO_BENCH, Topology

from .conftest import ALLOW_ISA, HAS_AVX512, kernel

pytestmark = pytest.mark.broker


def write_config(path: Path, settings: BrokerSettings, work: Path) -> Path:
    path.write_text(
        f"""
[broker]
url = "{settings.url}"
namespace = "{settings.namespace}"
heartbeat_s = 5
delivery_limit = 3

[logging]
format = "json"

[benchmarker]
metrics_port = 0
concurrency = 2
work_dir = "{work / "work"}"
lock_path = "{work / "timing.lock"}"
"""
    )
    return path


def start_replica(config: Path, own_session: bool = False) -> subprocess.Popen:
    """``own_session``: in a process group of its own, so that the test can kill all of it."""
    args = [sys.executable, "-m", "hpcrl_benchmarker.cli", "serve", "--config", str(config)]
    for isa in ALLOW_ISA:
        args += ["--allow-isa", isa]
    return subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=own_session
    )


@pytest.fixture
def replica(broker_settings: BrokerSettings, tmp_path: Path) -> Iterator[subprocess.Popen]:
    proc = start_replica(write_config(tmp_path / "bench.toml", broker_settings, tmp_path))
    yield proc
    stop_replica(proc)


def stop_replica(proc: subprocess.Popen) -> None:
    """SIGTERM (a clean stop), then SIGKILL after 15 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def candidate(group: str, index: int, code: str, stage: int = 6) -> Candidate:
    rollout = RolloutData(
        prompt_token_ids=PackedArray.of([1, 2, 3], "<i4"),
        completion_token_ids=PackedArray.of([4, 5], "<i4"),
        sampling_logprobs=PackedArray.of([-0.5, -0.25], "<f4"),
        policy_version=7,
    )
    return Candidate(
        id=candidate_id(group, index),
        group_id=group,
        index=index,
        completion=code,
        bench=BenchSpec(task="matmul", stage=stage),
        rollout=rollout,
    )


def collect(settings: BrokerSettings, count: int, timeout: float) -> list[BenchResult]:
    topology = Topology(settings.namespace, settings.delivery_limit)
    connection = pika.BlockingConnection(pika.URLParameters(settings.url))
    channel = connection.channel()
    results: list[BenchResult] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < count and time.monotonic() < deadline:
            method, _props, body = channel.basic_get(topology.name(BENCH_RESULTS))
            if method is None:
                time.sleep(0.2)
                continue
            results.append(decode(body, BenchResult))
            channel.basic_ack(method.delivery_tag)
    finally:
        connection.close()
    return results


def test_serve_benchmarks_candidates_over_the_broker(
    broker_settings: BrokerSettings, replica: subprocess.Popen
) -> None:
    sent = [
        candidate("g1", 0, f"```c\n{kernel('naive.c')}```"),
        candidate("g1", 1, "no code here"),
        candidate("g1", 2, kernel("ikj_omp.c"), stage=1),
    ]
    with Publisher(broker_settings, "test-producer") as publisher:
        for message in sent:
            publisher.publish(Publish(publisher.topology.name(CODE_TO_BENCH), message))
    results = {r.id: r for r in collect(broker_settings, len(sent), timeout=120)}
    assert replica.poll() is None, replica.stderr.read().decode() if replica.stderr else ""
    assert set(results) == {m.id for m in sent}
    ok, bad, staged = results["g1/0"], results["g1/1"], results["g1/2"]
    assert ok.status == "success" and ok.gflops and ok.gflops > 0 and ok.reward == ok.gflops
    assert ok.timing is not None and len(ok.timing.runs_s) == 3
    assert ok.generalizes is True
    assert ok.rollout == sent[0].rollout and ok.group_id == "g1" and ok.index == 0
    assert ok.bench == sent[0].bench
    assert ok.host.host_class and ok.compile_flags[:2] == ["gcc", "-O3"]
    assert bad.status == "format_violation" and bad.reward == -100 and bad.gflops is None
    assert staged.status == "stage_violation" and "openmp" in staged.techniques


def test_refuses_to_start_without_avx512_unless_allowed(
    broker_settings: BrokerSettings, tmp_path: Path
) -> None:
    if HAS_AVX512:
        pytest.skip("this host has AVX-512, so there is nothing to refuse here")
    config = write_config(tmp_path / "b.toml", broker_settings, tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCRL__")}
    out = subprocess.run(
        [sys.executable, "-m", "hpcrl_benchmarker.cli", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 3
    assert "avx512f" in out.stderr and "--allow-isa" in out.stderr


@pytest.mark.slow
def test_killed_replica_candidate_is_benchmarked_by_another(
    broker_settings: BrokerSettings, tmp_path: Path
) -> None:
    config = write_config(tmp_path / "bench.toml", broker_settings, tmp_path)
    first = start_replica(config)
    second = None
    try:
        with Publisher(broker_settings, "test-producer") as publisher:
            publisher.publish(
                Publish(
                    publisher.topology.name(CODE_TO_BENCH), candidate("g2", 0, kernel("infinite.c"))
                )
            )
        time.sleep(4)  # the first replica is now inside the 8 s run of this candidate
        assert first.poll() is None
        first.kill()
        first.wait()
        second = start_replica(config)
        results = collect(broker_settings, 1, timeout=90)
        assert [r.id for r in results] == ["g2/0"]
        assert results[0].status == "timeout" and results[0].reward == -30
        assert results[0].benchmarker.endswith(f"-{second.pid}")
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def replica_timing_an_endless_kernel(
    broker_settings: BrokerSettings, tmp_path: Path, group: str
) -> Iterator[subprocess.Popen]:
    """A serving replica 4 s into an endless kernel's 8 s run; killed at the end if it is
    still there."""
    config = write_config(tmp_path / "bench.toml", broker_settings, tmp_path)
    replica = start_replica(config, own_session=True)
    try:
        with Publisher(broker_settings, "test-producer") as publisher:
            publisher.publish(
                Publish(
                    publisher.topology.name(CODE_TO_BENCH),
                    candidate(group, 0, kernel("infinite.c")),
                )
            )
        time.sleep(4)  # inside the candidate's 8 s run
        assert replica.poll() is None
        yield replica
    finally:
        if replica.poll() is None:
            os.killpg(replica.pid, signal.SIGKILL)
            replica.wait()


def assert_handed_back(broker_settings: BrokerSettings) -> None:
    """No result was published; the candidate is back in the queue for another replica."""
    assert collect(broker_settings, 1, timeout=3) == []
    topology = Topology(broker_settings.namespace, broker_settings.delivery_limit)
    connection = pika.BlockingConnection(pika.URLParameters(broker_settings.url))
    try:
        queue = connection.channel().queue_declare(topology.name(CODE_TO_BENCH), passive=True)
        assert queue.method.message_count == 1
    finally:
        connection.close()


def test_sigterm_to_the_whole_replica_publishes_no_false_verdict(
    broker_settings: BrokerSettings, tmp_path: Path
) -> None:
    """Slurm's scancel and systemd signal every process of a replica, the sandboxed kernel
    too. The kernel then dies by that signal and used to be published as a runtime_error (-20)
    although it was fine; now the candidate goes back to the queue."""
    with replica_timing_an_endless_kernel(broker_settings, tmp_path, "g3") as replica:
        # What scancel and systemd's cgroup kill do: every process, the sandbox's included
        # (bwrap starts its own session, so a process-group signal would miss it).
        family = descendants(replica.pid)
        assert len(family) > 1
        for pid in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        replica.wait(60)
    assert_handed_back(broker_settings)


def test_sigterm_to_the_service_finishes_the_candidate_within_the_grace(
    broker_settings: BrokerSettings, tmp_path: Path
) -> None:
    """SIGTERM to the service alone (systemd's KillMode=mixed, Slurm's --signal=B:TERM): it
    takes nothing more and lets the candidate under way end, within its stop grace. A kernel
    that then runs into its time limit is not trusted as a timeout: it goes back to the queue."""
    with replica_timing_an_endless_kernel(broker_settings, tmp_path, "g4") as replica:
        signalled = time.monotonic()
        replica.send_signal(signal.SIGTERM)
        code = replica.wait(60)
        stop_s = time.monotonic() - signalled
    log = replica.stderr.read().decode() if replica.stderr else ""
    assert code == 0, log[-3000:]
    # It waited for the run to reach its limit (about 4 s more), and no longer.
    assert 1.0 < stop_s < 15.0, stop_s
    assert "exiting with work still running" not in log
    assert_handed_back(broker_settings)


def descendants(root: int) -> list[int]:
    """``root`` and every process below it, from /proc."""
    children: dict[int, list[int]] = {}
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat_file.parent.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


@pytest.mark.parametrize(
    ("status", "error", "untrusted"),
    [
        ("runtime_error", "killed by SIGTERM during the timed runs", True),
        ("runtime_error", "killed by SIGSEGV during the timed runs", False),
        ("compile_error", "error: expected ';'", False),
    ],
)
def test_a_kernel_killed_by_a_stop_signal_waits_for_the_services_own_signal(
    status: str, error: str, untrusted: bool
) -> None:
    """The kernel and the service get SIGTERM together; the service's handler runs a moment
    later on its main thread. Only a kernel killed by a stop signal waits for it."""
    import threading

    from hpcrl_benchmarker.service import STOP_SIGNAL_WAIT_S, BenchHandler
    from hpcrl_benchmarker.verdict import Verdict
    from hpcrl_common.messages import HostInfo

    host = HostInfo(
        hostname="n",
        cpu_model="c",
        isa=["avx512f"],
        cores=2,
        compiler="gcc",
        host_class="c",
        peak_gflops=500.0,
    )
    stopping = threading.Event()
    handler = BenchHandler.__new__(BenchHandler)
    handler.stopping = stopping.is_set
    threading.Timer(0.1, stopping.set).start()
    started = time.monotonic()
    assert handler._shutting_down(Verdict(status=status, host=host, error=error)) is untrusted
    waited = time.monotonic() - started
    assert waited < (STOP_SIGNAL_WAIT_S if untrusted else 0.05), waited


def test_a_confirmation_of_its_own_measurement_is_handed_back_once_then_measured(
    broker_settings: BrokerSettings, replica: subprocess.Popen
) -> None:
    """The scheduler re-measures a group's winner (hpcrl_scheduler.confirm): a replica named
    as the first measurement's hands it back once, for another replica of the class; alone,
    it then measures it itself (a real second measurement). Another replica's is measured at
    once."""
    import socket

    from hpcrl_benchmarker.host import detect
    from hpcrl_common import confirmation

    own = f"benchmarker-{socket.gethostname()}-{replica.pid}"
    host_class = detect().host_class
    code = f"```c\n{kernel('naive.c')}```"
    sent = [candidate("g9.confirm1", 0, code), candidate("g8.confirm1", 0, code)]
    sent = [
        message.model_copy(
            update={"generator": confirmation.label(name, host_class), "rollout": None}
        )
        for message, name in zip(sent, (own, "benchmarker-elsewhere-1"), strict=True)
    ]
    with Publisher(broker_settings, "test-scheduler") as publisher:
        for message in sent:
            publisher.publish(Publish(publisher.topology.name(CODE_TO_BENCH), message))
    results = {r.id: r for r in collect(broker_settings, len(sent), timeout=120)}
    assert {r.status for r in results.values()} == {"success"}, results
    assert all(r.benchmarker == own and r.gflops for r in results.values())
    replica.send_signal(signal.SIGTERM)
    replica.wait(30)
    log = replica.stderr.read().decode() if replica.stderr else ""
    handed = [line for line in log.splitlines() if "confirmation handed back" in line]
    assert len(handed) == 1 and "g9.confirm1/0" in handed[0], handed
