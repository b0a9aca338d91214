"""Processes the tests launch (`Server`: one launch_server or router and its whole process
tree) and the sets torn down together (`Deployment`).

Every process started here (and its whole tree: launch_server forks a scheduler and a
detokenizer) is killed on teardown, on exceptions, on Ctrl-C / SIGTERM and at exit,
and teardown verifies nothing is left. Each server can be frozen (SIGSTOP), resumed,
killed and restarted on the same ports; its Prometheus metrics and the fork's resource
report (`fork_pd_resources`, see sglang.srt.managers.fork_report.pd_resource_report) are readable.

The python that runs the servers is $SGLANG_FORK_PYTHON (default: this interpreter).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import psutil

from testing.http_client import http_get, parse_prometheus
from testing.polling import POLL_INTERVAL, ClusterError, wait_until
from testing.ports import HOST

PYTHON_ENV = "SGLANG_FORK_PYTHON"
DEFAULT_HEALTH_TIMEOUT = 300.0  # 3 servers starting at once on a busy 2-core box: 60-110 s


def fork_python() -> str:
    return os.environ.get(PYTHON_ENV) or sys.executable



# ----------------------------------------------------------------------------- process registry

_live: "set[Server]" = set()
_live_lock = threading.Lock()
_handlers_installed = False


def _kill_all_live() -> None:
    with _live_lock:
        servers = list(_live)
    for server in servers:
        server.kill()


def _on_signal(signum, frame):
    # Turn SIGTERM/SIGHUP into SystemExit so finally-blocks and atexit run.
    raise SystemExit(128 + signum)


def _install_handlers() -> None:
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(_kill_all_live)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _on_signal)


def _group_members(pgid: int) -> List[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and _proc_alive(p):
                out.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return out


def _proc_alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ----------------------------------------------------------------------------- one server


@dataclass(eq=False)
class Server:
    """One process we launched (launch_server or the router) and its descendants."""

    role: str
    argv: List[str]
    env: Dict[str, str]
    port: int
    log_path: Path
    health_path: str = "/health"
    address: str = HOST  # where it listens (its test host's address once placed)
    netns: Optional[str] = None  # its test host's network namespace (testing/hosts.py), None: this one
    popen: Optional[subprocess.Popen] = None
    # Every process of the tree we have seen, keyed by pid, for teardown.
    _seen: Dict[int, psutil.Process] = field(default_factory=dict)
    _log_file: Any = None

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    def place(self, host: Any) -> None:
        """Run on a test host (testing.hosts.Host): in its namespace, bound to its address, which the server
        also advertises (SGLANG_HOST_IP: bootstrap and mooncake's local hostname), as on its own machine."""
        if self.popen is not None:
            raise ClusterError(f"{self.role}: place before starting")
        self.address, self.netns = host.address, host.netns
        for flag in ("--host", "--prometheus-host"):
            if flag in self.argv:
                self.argv[self.argv.index(flag) + 1] = host.address
        self.env = {**self.env, "SGLANG_HOST_IP": host.address}

    # -- lifecycle

    def start(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            raise ClusterError(f"{self.role} already running")
        _install_handlers()
        self._log_file = open(self.log_path, "ab")
        self._log_file.write(f"\n==== start {time.strftime('%H:%M:%S')} {self.argv}\n".encode())
        self._log_file.flush()
        self.popen = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, *self.argv] if self.netns else self.argv,
            env=self.env,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # own process group: killpg reaches the tree
        )
        with _live_lock:
            _live.add(self)
        self._remember()

    def wait_healthy(self, timeout: float = DEFAULT_HEALTH_TIMEOUT) -> float:
        """Poll the health endpoint until 200; returns seconds waited."""
        t0 = time.monotonic()

        deadline = t0 + timeout
        while True:
            if self.popen.poll() is not None:
                raise ClusterError(
                    f"{self.role} exited with {self.popen.returncode}\n{self.tail()}"
                )
            try:
                if http_get(self.url + self.health_path, timeout=5)[0] == 200:
                    break
            except OSError:  # not listening yet, or busy starting
                pass
            if time.monotonic() >= deadline:
                raise ClusterError(
                    f"{self.role} not healthy after {timeout:.0f}s\n{self.tail()}"
                )
            time.sleep(POLL_INTERVAL)
        self._remember()
        return time.monotonic() - t0

    def freeze(self, timeout: float = 10.0) -> List[int]:
        """SIGSTOP every process of the tree; returns once each one is stopped (signal
        delivery is asynchronous: a test must not act on a tree still running)."""
        pids = self._signal_tree(signal.SIGSTOP)

        def stopped():
            return all(_proc_status(pid) in (psutil.STATUS_STOPPED, None) for pid in pids)

        wait_until(stopped, timeout, f"{self.role}: every process stopped", interval=0.02)
        return pids

    def resume(self) -> List[int]:
        return self._signal_tree(signal.SIGCONT)

    def kill(self, timeout: float = 30.0) -> None:
        """SIGKILL the whole tree (and its process group) and wait until it is gone."""
        if self.popen is None:
            return
        self._remember()
        procs = [p for p in self._seen.values() if _proc_alive(p)]
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        alive = [p for p in alive if _proc_alive(p)]
        # Also anything left in the process group that we never saw (e.g. forked
        # after the last look and reparented when its parent died).
        alive += [p for p in _group_members(self.popen.pid) if p.pid not in {a.pid for a in alive}]
        if alive:
            raise ClusterError(f"{self.role}: processes survived SIGKILL: {alive}")
        self._seen.clear()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        with _live_lock:
            _live.discard(self)

    def restart(self, timeout: float = DEFAULT_HEALTH_TIMEOUT) -> float:
        """Kill, start again with the same argv (same ports), wait healthy."""
        self.kill()
        self.start()
        return self.wait_healthy(timeout)

    # -- introspection

    def pids(self) -> List[int]:
        """The live process tree: launch process first, then descendants."""
        return [p.pid for p in self.processes()]

    def processes(self) -> List[psutil.Process]:
        """The live process tree as psutil processes (launch process first)."""
        self._remember()
        return self._tree()

    def is_alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def scheduler(self, rank: int) -> psutil.Process:
        """The scheduler process of TP rank `rank` (upstream titles it sglang::scheduler_TP<rank>): what a fault
        aimed at one rank of a multi-rank server kills or freezes."""
        title = f"sglang::scheduler_TP{rank}"
        found = [p for p in self.processes() if " ".join(p.cmdline()).split(" ")[0] == title]
        if len(found) != 1:
            raise ClusterError(f"{self.role}: {len(found)} processes titled {title}: "
                               f"{[p.cmdline() for p in self.processes()]}")
        return found[0]

    def tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                lines = deque(f, maxlen=n)
        except OSError:
            return f"[{self.role}] no log at {self.log_path}"
        body = b"".join(lines).decode(errors="replace")
        return f"---- last {n} lines of {self.log_path} ----\n{body}"

    def metrics(self, timeout: float = 10.0) -> Dict[str, float]:
        status, body = http_get(self.url + "/metrics", timeout=timeout)
        if status != 200:
            raise ClusterError(f"{self.role} /metrics -> {status}")
        return parse_prometheus(body.decode())

    def server_info(self, timeout: float = 10.0) -> Dict[str, Any]:
        status, body = http_get(self.url + "/server_info", timeout=timeout)
        if status != 200:
            raise ClusterError(f"{self.role} /server_info -> {status}: {body[:200]!r}")
        return json.loads(body)

    def resources(self, timeout: float = 10.0) -> Dict[str, Any]:
        """The fork's resource report of the (single, dp=1) scheduler."""
        states = self.server_info(timeout)["internal_states"]
        if len(states) != 1 or "fork_pd_resources" not in states[0]:
            raise ClusterError(
                f"{self.role}: no fork_pd_resources in {len(states)} internal_states "
                "(is the fork's sglang.srt.plugins entry point installed?)"
            )
        return states[0]["fork_pd_resources"]

    # -- internals

    def _tree(self) -> List[psutil.Process]:
        if self.popen is None:
            return []
        try:
            root = psutil.Process(self.popen.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        return [p for p in procs if _proc_alive(p)]

    def _remember(self) -> None:
        for p in self._tree():
            self._seen.setdefault(p.pid, p)  # psutil.Process guards pid reuse

    def _signal_tree(self, sig: int) -> List[int]:
        procs = self._tree()
        if not procs:
            raise ClusterError(f"{self.role} is not running")
        for p in procs:
            p.send_signal(sig)
        self._remember()
        return [p.pid for p in procs]


def exited(process: psutil.Process) -> bool:
    """A process that exited (its sockets closed): reaped, or a zombie its (stopped or gone) parent has not reaped."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _proc_status(pid: int) -> Optional[str]:
    """psutil's status of pid, or None once it is gone."""
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return None


class Deployment:
    """A set of servers that is torn down together (context manager)."""

    def __init__(self, log_dir: Optional[str] = None):
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="sglang-pd-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.servers: Dict[str, Server] = {}
        self.startup_seconds: Dict[str, float] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.teardown()

    def __getitem__(self, role: str) -> Server:
        return self.servers[role]

    def _add(self, role, argv, env, port, health_path="/health") -> Server:
        server = Server(
            role=role,
            argv=[str(a) for a in argv],
            env=env,
            port=port,
            log_path=self.log_dir / f"{role}.log",
            health_path=health_path,
        )
        self.servers[role] = server
        return server

    def launch(self) -> "Deployment":
        """Start every process without waiting (see wait_healthy / start_all)."""
        try:
            for server in self.servers.values():
                server.start()
        except BaseException:
            self.teardown()
            raise
        self._t0 = time.monotonic()
        return self

    def wait_healthy(self, timeout: float = DEFAULT_HEALTH_TIMEOUT) -> "Deployment":
        """Wait for each server in start order within one overall deadline."""
        deadline = self._t0 + timeout
        try:
            for role, server in self.servers.items():
                server.wait_healthy(max(1.0, deadline - time.monotonic()))
                self.startup_seconds[role] = time.monotonic() - self._t0
        except BaseException:
            self.teardown()
            raise
        return self

    def start(self, timeout: float = DEFAULT_HEALTH_TIMEOUT) -> "Deployment":
        return self.launch().wait_healthy(timeout)

    def resources(self, role: str) -> Dict[str, Any]:
        return self.servers[role].resources()

    def metrics(self, role: str) -> Dict[str, float]:
        return self.servers[role].metrics()

    def all_pids(self) -> List[int]:
        return [pid for s in self.servers.values() for pid in s.pids()]

    def teardown(self) -> None:
        """Kill every tree we started; raise if anything survived."""
        errors = []
        for server in reversed(list(self.servers.values())):
            try:
                server.kill()
            except Exception as e:
                errors.append(e)
        if errors:
            raise ClusterError(f"teardown left processes: {errors}")


def start_all(*deployments: Deployment, timeout: float = DEFAULT_HEALTH_TIMEOUT) -> None:
    """Launch several deployments at once, then wait for all; tear all down on failure."""
    try:
        for d in deployments:
            d.launch()
        for d in deployments:
            d.wait_healthy(timeout)
    except BaseException:
        for d in deployments:
            d.teardown()
        raise

