"""Throwaway RabbitMQ nodes on this machine, beside the shared ``rabbit@localhost``.

For tests that need a broker configured differently from the shared one (TLS-only listeners,
later a cluster of several nodes). Each :class:`RabbitNode` has its own node name, ports,
Erlang cookie, config, data and log directories, all under one work directory, and is
stopped (then killed if need be) when its ``with`` block ends, whatever happened inside.

The real scripts in ``/usr/lib/rabbitmq/bin`` run as the current user with our environment
(``/usr/sbin/rabbitmq*`` would switch to the ``rabbitmq`` user and drop it). The system's
``rabbitmq-env.conf`` is replaced by an empty file so that its ``NODENAME`` does not apply;
the node shares the system's epmd, bound to 127.0.0.1, as cluster members on one host must.

Usage::

    with RabbitNode(tmp_path, lambda node: f"listeners.tcp.default = 127.0.0.1:{node.port}"
                    ) as node:
        node.ctl("list_queues")
        url = node.url()

    with start_nodes(tmp_path, 3) as nodes:  # one shared cookie: ready to be clustered
        ...

    with start_cluster(tmp_path, 3) as nodes:  # nodes[1:] joined nodes[0]
        nodes[0].kill()  # lose it as a crash would; its files stay
        nodes[0].start().wait_started()  # back, and a member again
        nodes[1].wait_running_nodes(nodes)
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")
SERVER = RABBIT_BIN / "rabbitmq-server"
# Ports not to hand out: the shared node's AMQP and distribution ports, epmd, and the range
# the CLI tools' own short-lived Erlang nodes listen on (RABBITMQ_CTL_DIST_PORT_MIN/MAX).
_RESERVED_PORTS = {4369, 5671, 5672, 25672, *range(35672, 35693)}
_LOWEST_DRAWN_PORT = 20000
_HANDED_OUT: set[int] = set()

Config = str | Callable[["RabbitNode"], str] | None
_CONNECTION_NAME = re.compile(r'\{"connection_name","((?:[^"\\]|\\.)*)"\}')


class RabbitNodeError(RuntimeError):
    """The node did not start (the message ends with its log's tail) or a command failed."""


def require_rabbitmq() -> None:
    """Skip the calling test when the RabbitMQ server is not installed here."""
    if not SERVER.exists():
        pytest.skip(f"{SERVER} is missing: RabbitMQ is not installed on this machine")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on now and this process has not handed out.

    Drawn below the kernel's ephemeral range: a port the kernel picked for ``bind(0)`` can be
    taken as the local end of any outgoing connection (a client's to a broker node) before the
    service it was meant for binds it, and then that service fails with "Address already in
    use". Ports below the range are only ever taken by an explicit bind."""
    low = _ephemeral_range_start()
    rng = random.Random()
    while True:
        port = rng.randrange(_LOWEST_DRAWN_PORT, low) if low > _LOWEST_DRAWN_PORT + 1000 else 0
        if port in _RESERVED_PORTS or port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = sock.getsockname()[1]
        if port not in _RESERVED_PORTS and port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def _ephemeral_range_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def new_cookie() -> str:
    return secrets.token_hex(16).upper()


def default_config(node: RabbitNode) -> str:
    """Plain AMQP on 127.0.0.1 at ``node.port``."""
    return f"listeners.tcp.default = 127.0.0.1:{node.port}\n"


class RabbitNode:
    """One extra RabbitMQ node; a context manager that starts it and always stops it.

    ``config`` is the text of its ``rabbitmq.conf``, or a function of the node that returns
    it (to use ``node.port`` or ``node.base``); by default plain AMQP on ``node.port``.
    ``port`` is a free port picked for the config's listener (AMQP or AMQPS) unless given;
    ``dist_port`` is the node's Erlang distribution port (RABBITMQ_DIST_PORT). Nodes meant
    to form a cluster must share ``cookie``. ``workdir`` keeps the node's files for a
    post-mortem; without one they go to a temporary directory deleted at :meth:`stop`.
    """

    def __init__(
        self,
        workdir: Path | None = None,
        config: Config = None,
        *,
        name: str | None = None,
        port: int | None = None,
        dist_port: int | None = None,
        cookie: str | None = None,
        startup_timeout_s: float = 90.0,
    ) -> None:
        self.name = name or f"hpcrl-t{secrets.token_hex(4)}@localhost"
        self._own_dir = workdir is None
        parent = Path(tempfile.mkdtemp(prefix="rabbit-node-")) if workdir is None else workdir
        self.base = parent / self.name.partition("@")[0]
        self.port = port or free_port()
        self.dist_port = dist_port or free_port()
        self.cookie = cookie or new_cookie()
        self.startup_timeout_s = startup_timeout_s
        self._config = config
        self.config_text = ""
        self.log_file = self.base / "log" / f"{self.name}.log"
        self.console_file = self.base / "console.out"
        self.process: subprocess.Popen[bytes] | None = None
        self.env = self._environment()

    def __repr__(self) -> str:
        return f"RabbitNode({self.name}, port={self.port}, dist_port={self.dist_port})"

    # --- files and environment --------------------------------------------------------------

    def _environment(self) -> dict[str, str]:
        base = self.base
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env.update(
            {
                "HOME": str(base / "home"),  # its .erlang.cookie, for the server and the CLI
                "LANG": env.get("LANG") or "C.UTF-8",
                "RABBITMQ_CONF_ENV_FILE": str(base / "rabbitmq-env.conf"),
                "RABBITMQ_NODENAME": self.name,
                "RABBITMQ_DIST_PORT": str(self.dist_port),
                "RABBITMQ_CONFIG_FILE": str(base / "rabbitmq.conf"),
                "RABBITMQ_CONFIG_FILES": str(base / "conf.d"),
                "RABBITMQ_ADVANCED_CONFIG_FILE": str(base / "advanced.config"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "enabled_plugins"),
                "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
                "RABBITMQ_MNESIA_DIR": str(base / "mnesia" / self.name),
                "RABBITMQ_FEATURE_FLAGS_FILE": str(base / "mnesia" / "feature_flags"),
                "RABBITMQ_PLUGINS_EXPAND_DIR": str(base / "plugins-expand"),
                "RABBITMQ_LOG_BASE": str(base / "log"),
                "RABBITMQ_LOGS": str(self.log_file),
                "RABBITMQ_PID_FILE": str(base / "rabbitmq.pid"),
                "RABBITMQ_MOTD_FILE": str(base / "motd"),
                "ERL_EPMD_ADDRESS": "127.0.0.1",
                "ERL_FLAGS": "-kernel inet_dist_use_interface {127,0,0,1}",
                "ERL_CRASH_DUMP": str(base / "erl_crash.dump"),
            }
        )
        return env

    def _write_files(self) -> None:
        base = self.base
        for sub in ("home", "conf.d", "mnesia", "log", "plugins-expand"):
            (base / sub).mkdir(parents=True, exist_ok=True)
        cookie = base / "home" / ".erlang.cookie"
        if cookie.exists():
            cookie.chmod(0o600)
        cookie.write_text(self.cookie)
        cookie.chmod(0o400)
        (base / "rabbitmq-env.conf").write_text("")
        # No plugins: in particular not the management plugin, whose port is the shared one.
        (base / "enabled_plugins").write_text("[].\n")
        config = self._config
        if config is None:
            config = default_config
        self.config_text = config(self) if callable(config) else config
        (base / "rabbitmq.conf").write_text(self.config_text)

    # --- life cycle ---------------------------------------------------------------------

    def start(self) -> RabbitNode:
        """Launch the server in the background; :meth:`wait_started` waits for it.

        A node that was killed (or stopped, with a ``workdir``) can be started again: its
        data directory, and so its cluster membership, is still there.
        """
        require_rabbitmq()
        if self.process is not None:
            raise RabbitNodeError(f"{self.name} was already started")
        self._write_files()
        with self.console_file.open("ab") as console:
            self.process = subprocess.Popen(
                [str(SERVER)],
                env=self.env,
                cwd=self.base,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def wait_started(self, timeout_s: float | None = None) -> None:
        """Return once the node runs RabbitMQ; otherwise raise with the log's tail."""
        if self.process is None:
            raise RabbitNodeError(f"{self.name} was not started")
        deadline = time.monotonic() + (timeout_s or self.startup_timeout_s)
        last = ""
        while True:
            if self.process.poll() is not None:
                raise RabbitNodeError(
                    f"{self.name} exited with status {self.process.returncode} while "
                    f"starting\n{self.log_tail()}"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise RabbitNodeError(
                    f"{self.name} did not start within {timeout_s or self.startup_timeout_s} s"
                    f" (last await_startup: {last.strip()[-500:]})\n{self.log_tail()}"
                )
            try:
                result = self.ctl(
                    "await_startup", "-t", str(max(int(left), 1)), check=False, timeout_s=left + 10
                )
            except subprocess.TimeoutExpired:
                continue
            if result.returncode == 0:
                return
            last = result.stdout + result.stderr
            time.sleep(1.0)  # not up yet (e.g. not registered with epmd): try again

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the node (``rabbitmqctl stop``, then SIGTERM, then SIGKILL). Idempotent."""
        process, self.process = self.process, None
        try:
            if process is not None and process.poll() is None:
                asked = False
                with contextlib.suppress(subprocess.TimeoutExpired):
                    asked = self.ctl("stop", check=False, timeout_s=timeout_s).returncode == 0
                steps = [(signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)]
                if asked:
                    steps.insert(0, (None, 30.0))  # give the VM time to exit
                for sig, wait_s in steps:
                    if sig is not None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(process.pid, sig)  # its own session: the VM and helpers
                    try:
                        process.wait(wait_s)
                        break
                    except subprocess.TimeoutExpired:
                        continue
                # Helpers of the VM (erl_child_setup, inet_gethost) share its group.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
        finally:
            if self._own_dir:
                shutil.rmtree(self.base.parent, ignore_errors=True)

    def kill(self, timeout_s: float = 30.0) -> None:
        """Lose the node as a crash would: SIGKILL to the VM and its helpers, no goodbye to
        its peers or clients. Its files stay: :meth:`start` brings it back. Idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout_s)

    def __enter__(self) -> RabbitNode:
        self.start()
        try:
            self.wait_started()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # --- talking to it --------------------------------------------------------------------

    def ctl(
        self, *args: str, tool: str = "rabbitmqctl", check: bool = True, timeout_s: float = 90.0
    ) -> subprocess.CompletedProcess[str]:
        """Run a CLI tool (rabbitmqctl, rabbitmq-diagnostics, ...) against this node."""
        result = subprocess.run(
            [str(RABBIT_BIN / tool), "-n", self.name, *args],
            env=self.env,
            cwd=self.base,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
        if check and result.returncode != 0:
            raise RabbitNodeError(
                f"{tool} -n {self.name} {' '.join(args)} exited with {result.returncode}:\n"
                f"{result.stdout}{result.stderr}"
            )
        return result

    def diagnostics(
        self, *args: str, check: bool = True, timeout_s: float = 90.0
    ) -> subprocess.CompletedProcess[str]:
        return self.ctl(*args, tool="rabbitmq-diagnostics", check=check, timeout_s=timeout_s)

    # --- clustering ----------------------------------------------------------------------

    def join(self, seed: RabbitNode, timeout_s: float = 120.0) -> None:
        """Make this running node a member of ``seed``'s cluster (same cookie needed):
        ``stop_app``, ``join_cluster``, ``start_app``. What the node held alone is lost."""
        self.ctl("stop_app", timeout_s=timeout_s)
        self.ctl("join_cluster", seed.name, timeout_s=timeout_s)
        self.ctl("start_app", timeout_s=timeout_s)

    def cluster_status(self) -> dict:
        """``rabbitmqctl cluster_status`` as JSON (``running_nodes``, ``disk_nodes``, ...)."""
        return json.loads(self.ctl("-q", "cluster_status", "--formatter", "json").stdout)

    def running_nodes(self) -> set[str]:
        return set(self.cluster_status().get("running_nodes", []))

    def wait_running_nodes(
        self, nodes: Sequence[RabbitNode | str], timeout_s: float = 60.0
    ) -> None:
        """Wait until this node sees exactly ``nodes`` running in its cluster."""
        want = {node if isinstance(node, str) else node.name for node in nodes}
        deadline = time.monotonic() + timeout_s
        seen: set[str] | str = set()
        while time.monotonic() < deadline:
            try:
                seen = self.running_nodes()
            except (RabbitNodeError, subprocess.TimeoutExpired, ValueError) as exc:
                seen = str(exc)[-300:]
            if seen == want:
                return
            time.sleep(0.5)
        raise RabbitNodeError(
            f"{self.name}: running nodes are {seen}, not {sorted(want)}, after {timeout_s} s"
        )

    def connection_names(self) -> list[str]:
        """The ``connection_name`` (client property) of every client connected to this node."""
        out = self.ctl("-q", "list_connections", "--no-table-headers", "client_properties").stdout
        return _CONNECTION_NAME.findall(out)

    def queues(self, *items: str, vhost: str = "/") -> list[dict]:
        """``rabbitmqctl list_queues`` of ``items`` (name, type, messages, members, leader,
        online, ...), one dict per queue, from a single CLI call."""
        out = self.ctl("-q", "list_queues", "--vhost", vhost, "--formatter", "json", *items).stdout
        return json.loads(out) if out.strip() else []

    def quorum_members(self, queue: str, vhost: str = "/") -> dict[str, str]:
        """node -> Raft state (leader, follower, ...) of a quorum queue's members, by
        ``rabbitmq-queues quorum_status``; a member whose node is down shows ``nodedown``."""
        out = self.ctl(
            "-q",
            "quorum_status",
            queue,
            "--vhost",
            vhost,
            "--formatter",
            "json",
            tool="rabbitmq-queues",
        ).stdout
        members = {}
        for row in json.loads(out):
            state = row["Raft State"]  # [nodedown, Node] (or another error) when unreachable
            members[row["Node Name"]] = state if isinstance(state, str) else str(state[0])
        return members

    def url(
        self,
        user: str = "guest",
        password: str = "guest",
        *,
        scheme: str = "amqp",
        host: str = "127.0.0.1",
        port: int | None = None,
        vhost: str = "%2F",
    ) -> str:
        return f"{scheme}://{user}:{password}@{host}:{port or self.port}/{vhost}"

    def log_tail(self, lines: int = 60) -> str:
        """The first error lines and the last ``lines`` lines of the log and the console."""
        parts = []
        for path in (self.log_file, self.console_file):
            try:
                text = path.read_text(errors="replace").splitlines()
            except OSError as exc:
                parts.append(f"--- {path}: {exc.strerror} ---")
                continue
            errors = [line for line in text[:-lines] if "[error]" in line][:15]
            if errors:  # the cause often comes long before the last lines
                parts.append(f"--- {path} (first errors) ---\n" + "\n".join(errors))
            parts.append(f"--- {path} (last {lines} lines) ---\n" + "\n".join(text[-lines:]))
        return "\n".join(parts)


@contextlib.contextmanager
def start_nodes(
    workdir: Path | None, configs: int | Sequence[Config], **options: object
) -> Iterator[list[RabbitNode]]:
    """Several nodes with one cookie (as a cluster needs), started side by side.

    ``configs`` is a count (default config each) or one config per node; ``options`` go to
    every :class:`RabbitNode` (``cookie`` defaults to one fresh cookie for all). All are
    stopped on exit, also when one fails to start.
    """
    if isinstance(configs, int):
        configs = [None] * configs
    options.setdefault("cookie", new_cookie())
    nodes = [RabbitNode(workdir, config, **options) for config in configs]  # type: ignore[arg-type]
    with contextlib.ExitStack() as stack:
        for node in nodes:
            stack.callback(node.stop)
            node.start()
        for node in nodes:
            node.wait_started()
        yield nodes


@contextlib.contextmanager
def start_cluster(
    workdir: Path | None, configs: int | Sequence[Config], **options: object
) -> Iterator[list[RabbitNode]]:
    """:func:`start_nodes`, then every node after the first joins the first: one cluster,
    all of whose members run when the block starts. All are stopped on exit."""
    with start_nodes(workdir, configs, **options) as nodes:
        for node in nodes[1:]:
            node.join(nodes[0])
        for node in nodes:
            node.wait_running_nodes(nodes)
        yield nodes
