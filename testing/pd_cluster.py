"""Bring up sglang servers for tests: 1 prefill + 1 decode + a load balancer (the mini LB
or the production Rust gateway with self-registering engines), or one plain server, on free 127.0.0.1 ports, and take them apart again.

Every process started here (and its whole tree: launch_server forks a scheduler and a
detokenizer) is killed on teardown, on exceptions, on Ctrl-C / SIGTERM and at exit,
and teardown verifies nothing is left. Each server can be frozen (SIGSTOP), resumed,
killed and restarted on the same ports; its Prometheus metrics and the fork's resource
report (`fork_pd_resources`, see sglang.srt.managers.fork_core.pd_resource_report) are readable.

The python that runs the servers is $SGLANG_FORK_PYTHON (default: this interpreter).
Servers get no workaround flags or env: what they need on CPU is in the fork itself.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import psutil

PYTHON_ENV = "SGLANG_FORK_PYTHON"
HOST = "127.0.0.1"
DEFAULT_HEALTH_TIMEOUT = 300.0  # 3 servers starting at once on a busy 2-core box: 60-110 s
POLL_INTERVAL = 0.25

# Deployment configuration, not workarounds: tests talk to loopback only (the
# transfer engine would otherwise advertise the host's detected address), and the
# model is local. Mooncake picks TCP by itself when the host has no RDMA device.
# One intra-op thread per server process: a deployment runs several schedulers on a
# 2-core machine, and torch's default (a thread per core, spin-waiting after each
# parallel region) made every forward pass wait for the other processes' spinning
# threads -- measured: 200 requests took 6-8x longer and 10x more scheduler CPU per
# iteration (bench/README.md, "Threads").
BASE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "SGLANG_HOST_IP": HOST,
    "OMP_NUM_THREADS": "1",
}
# Pools for the tiny model (256 B of KV per token), big enough that decode admits 20+
# requests at once despite reserving num_reserved_decode_tokens (512) for each;
# --sleep-on-idle because an idle scheduler otherwise spins a whole core, and a test
# deployment runs 3 schedulers on a 2-core machine.
BASE_SERVER_ARGS = (
    "--device", "cpu",
    "--max-total-tokens", "32768",
    "--max-running-requests", "32",
    "--sleep-on-idle",
    "--enable-metrics",
)


def fork_python() -> str:
    return os.environ.get(PYTHON_ENV) or sys.executable


class ClusterError(RuntimeError):
    pass


# ----------------------------------------------------------------------------- ports


def _port_window() -> range:
    """Ports to hand out: below the kernel's ephemeral range.

    A port the kernel handed us (bind to 0) lies in the ephemeral range, where every
    outgoing connection and every `bind(0)` of the servers themselves (mooncake, torch,
    the gateway's clients) draws its local port too. A server takes ~35 s on a loaded
    2-core machine to bind its HTTP port, so such a port was seen taken by then (CI:
    `[Errno 98] address already in use`). Ports below that range are only ever taken
    by whoever asks for them by number.
    """
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    if lo >= 22000:
        # 22000-29999 is where upstream draws its own below-ephemeral ports
        # (sglang.srt.utils.network.get_free_port_below_ephemeral); mooncake's RPC
        # ports lie at 15000-17000.
        return range(17100, 22000)
    if 65535 - hi >= 2000:
        return range(hi + 1, 65536)
    raise ClusterError(f"no port window outside the ephemeral range {lo}-{hi}")


_PORT_LOCK_DIR = Path(tempfile.gettempdir()) / "sglang-fork-test-ports"
_held_ports: Dict[int, int] = {}  # port -> fd of its lock file, held until this process exits
_ports_lock = threading.Lock()


def free_ports(n: int) -> List[int]:
    """n distinct ports, free on 127.0.0.1 now and reserved for this process.

    Drawn outside the ephemeral range (see _port_window) and reserved machine-wide by
    an flock on a per-port file, held until this process exits, so two test processes
    on one machine never hand out the same port, and one process never hands a port
    out twice (a killed server restarts on its own ports; those stay ours).
    """
    import fcntl
    import random

    window = _port_window()
    _PORT_LOCK_DIR.mkdir(parents=True, exist_ok=True)
    ports: List[int] = []
    with _ports_lock:
        start = random.randrange(len(window))
        for i in range(len(window)):
            if len(ports) == n:
                break
            port = window[(start + i) % len(window)]
            if port in _held_ports:
                continue
            fd = os.open(_PORT_LOCK_DIR / f"{port}.lock", os.O_CREAT | os.O_RDWR, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((HOST, port))
            except OSError:
                os.close(fd)  # taken by someone outside this scheme; leave it
                continue
            finally:
                s.close()
            _held_ports[port] = fd
            ports.append(port)
    if len(ports) < n:
        raise ClusterError(f"only {len(ports)} of {n} free ports in {window.start}-{window.stop - 1}")
    return ports


# ----------------------------------------------------------------------------- HTTP


def http_get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_post_json(url: str, payload: Any, timeout: float = 120.0) -> tuple[int, Any]:
    req = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        body, status = e.read(), e.code
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode(errors="replace")


def http_request(url: str, method: str, timeout: float = 30.0) -> tuple[int, bytes]:
    """A body-less request with any method (DELETE ...)."""
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def parse_prometheus(text: str) -> Dict[str, float]:
    """Prometheus text format -> {'name{labels}': value} ('name' when unlabelled)."""
    out: Dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "}" in line:
            key, _, rest = line.rpartition("}")
            key += "}"
        else:
            key, _, rest = line.partition(" ")
        value = rest.split()[0]
        out[key] = float(value)
    return out


def metric_sum(metrics: Mapping[str, float], name: str) -> float:
    """Sum of every sample of `name` over all label sets."""
    return sum(
        v for k, v in metrics.items() if k == name or k.startswith(name + "{")
    )


def wait_until(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = POLL_INTERVAL,
    on_timeout: Optional[Callable[[], str]] = None,
) -> Any:
    """Poll predicate until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    last_exc: Optional[BaseException] = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except ClusterError:
            raise
        except Exception as e:  # the thing polled is allowed to be not ready yet
            last_exc = e
        if time.monotonic() >= deadline:
            detail = on_timeout() if on_timeout else ""
            raise ClusterError(
                f"timed out after {timeout:.0f}s waiting for {what}"
                + (f" (last error: {last_exc!r})" if last_exc else "")
                + (f"\n{detail}" if detail else "")
            )
        time.sleep(interval)


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


def _proc_status(pid: int) -> Optional[str]:
    """psutil's status of pid, or None once it is gone."""
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return None


# ----------------------------------------------------------------------------- deployments


def _role_env(extra: Optional[Mapping[str, str]]) -> Dict[str, str]:
    return {**os.environ, **BASE_ENV, **(extra or {})}


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


def _launch_server_argv(model: str, port: int, nccl_port: int, args: Iterable[str]) -> List[str]:
    return [
        fork_python(), "-m", "sglang.launch_server",
        "--model-path", str(model),
        "--host", HOST,
        "--port", str(port),
        "--nccl-port", str(nccl_port),
        *BASE_SERVER_ARGS,
        *args,
    ]


# Tensor parallelism on CPU (docs/multi-rank.md): one scheduler process per rank, torch.distributed over gloo,
# each rank bound to its own core (upstream's NUMA check otherwise asks for one NUMA node per rank), a gloo timeout
# of seconds instead of upstream's 120 minutes so that a rank stuck in a collective fails the test.
TEST_GLOO_TIMEOUT_S = 90


def tp_args(tp: int) -> Tuple[str, ...]:
    return () if tp == 1 else ("--tp-size", str(tp))


def tp_env(tp: int, env: Optional[Mapping[str, str]]) -> Optional[Mapping[str, str]]:
    if tp == 1:
        return env
    cores = os.cpu_count() or 1
    return {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(rank % cores) for rank in range(tp)),
            "SGLANG_FORK_GLOO_TIMEOUT": str(TEST_GLOO_TIMEOUT_S), **(env or {})}


BALANCERS = ("mini", "router")
# How long the gateway may take to run its registration workflow for one engine
# (health probe, /get_server_info, /get_model_info) once POST /workers accepted it.
REGISTER_TIMEOUT = 60.0
PD_ROLES = ("prefill", "decode")


class PDCluster(Deployment):
    """1 prefill (or more: `prefills`) + 1 decode (mooncake over TCP on loopback) + a load balancer (role 'lb').

    balancer="mini" (default): sglang-router's Python mini LB, given both engines on its
    command line. balancer="router": the production Rust gateway (`Gateway`, its
    defaults unless `lb_args` says otherwise), reachable as `gateway`; each engine
    registers itself with it once it is healthy.
    """

    def __init__(
        self,
        model: str,
        *,
        prefill_env: Optional[Mapping[str, str]] = None,
        decode_env: Optional[Mapping[str, str]] = None,
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        lb_env: Optional[Mapping[str, str]] = None,
        lb_args: Sequence[str] = (),
        balancer: str = "mini",
        log_dir: Optional[str] = None,
        tp: int = 1,
        decode_tp: Optional[int] = None,
        hosts: Optional[Mapping[str, Any]] = None,
        prefills: int = 1,
    ):
        """`hosts`: role (prefill, decode, lb) -> testing.hosts.Host to run it on (default: this host).
        `prefills`: more than one prefill server (roles prefill, prefill2, ...; each its own bootstrap port, the same
        env and args), behind the mini LB (which picks one at random per request)."""
        if balancer not in BALANCERS:
            raise ValueError(f"balancer must be one of {BALANCERS}, not {balancer!r}")
        if prefills > 1 and balancer != "mini":
            raise ValueError("more than one prefill: only behind the mini LB")
        super().__init__(log_dir)
        self.tp = {"prefill": tp, "decode": tp if decode_tp is None else decode_tp}
        prefill_args, prefill_env = (*tp_args(self.tp["prefill"]), *prefill_args), tp_env(self.tp["prefill"], prefill_env)
        decode_args, decode_env = (*tp_args(self.tp["decode"]), *decode_args), tp_env(self.tp["decode"], decode_env)
        self.balancer = balancer
        (p_port, p_nccl, bootstrap, d_port, d_nccl, lb_port, prom_port) = free_ports(7)
        self.bootstrap_port = bootstrap
        pd = ["--disaggregation-transfer-backend", "mooncake"]
        prefill = self._add(
            "prefill",
            _launch_server_argv(model, p_port, p_nccl, [
                "--disaggregation-mode", "prefill",
                "--disaggregation-bootstrap-port", str(bootstrap),
                *pd, *prefill_args,
            ]),
            _role_env(prefill_env),
            p_port,
        )
        decode = self._add(
            "decode",
            _launch_server_argv(model, d_port, d_nccl, [
                "--disaggregation-mode", "decode", *pd, *decode_args,
            ]),
            _role_env(decode_env),
            d_port,
        )
        self.prefill_roles = ["prefill"]
        self.bootstrap_ports = {"prefill": bootstrap}
        for i in range(2, prefills + 1):
            role = f"prefill{i}"
            port, nccl, boot = free_ports(3)
            self._add(role, _launch_server_argv(model, port, nccl, [
                "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot),
                *pd, *prefill_args,
            ]), _role_env(prefill_env), port)
            self.prefill_roles.append(role)
            self.bootstrap_ports[role] = boot
        hosts = hosts or {}
        for role in self.servers:
            if role in hosts:
                self.servers[role].place(hosts[role])
        self.gateway: Optional[Gateway] = None
        if balancer == "mini":
            self._add("lb", _mini_lb_argv([(self.servers[r].url, self.bootstrap_ports[r]) for r in self.prefill_roles],
                                          decode.url, lb_port, lb_args),
                      _role_env(lb_env), lb_port)
        else:
            self.gateway = Gateway(prefill, decode, bootstrap, role="lb", env=lb_env, args=lb_args,
                                   port=lb_port, prometheus_port=prom_port, log_dir=str(self.log_dir))
            self.servers["lb"] = self.gateway["lb"]
        if "lb" in hosts:
            self.servers["lb"].place(hosts["lb"])

    @property
    def url(self) -> str:
        return self.servers["lb"].url

    @property
    def multi_rank(self) -> bool:
        """A server runs more than one rank (tensor parallelism)."""
        return max(self.tp.values()) > 1

    def wait_healthy(self, timeout: float = DEFAULT_HEALTH_TIMEOUT) -> "PDCluster":
        super().wait_healthy(timeout)
        if self.gateway is not None:
            try:
                self.gateway.register_workers()
            except BaseException:
                self.teardown()
                raise
        return self


def _mini_lb_argv(prefills: Sequence[Tuple[str, int]], decode_url: str, port: int,
                  args: Sequence[str] = ()) -> List[str]:
    """`prefills`: (url, bootstrap port) of each prefill server."""
    return [
        fork_python(), "-m", "sglang_router.launch_router", "--pd-disaggregation", "--mini-lb",
        "--host", HOST,
        *(a for url, boot in prefills for a in ("--prefill", url, str(boot))),
        "--decode", decode_url,
        "--port", str(port),
        *args,
    ]


class Gateway(Deployment):
    """The production Rust gateway (`launch_router --pd-disaggregation` without `--mini-lb`,
    its own defaults -- retries, circuit breaker, health checks -- unless `args` says
    otherwise) in front of a prefill and a decode server, started with no workers: each
    engine registers itself with `POST /workers` as RL frameworks do (register_worker /
    deregister_worker). Its Prometheus endpoint gets a free loopback port (the default
    29000 would collide between deployments).

    PDCluster(balancer="router") starts one as its role 'lb'; alone (role 'gateway') it
    fronts engines that already run, e.g. the shared 1P1D of the test suite.
    """

    def __init__(self, prefill: Server, decode: Server, bootstrap_port: int, *, role: str = "gateway",
                 env: Optional[Mapping[str, str]] = None, args: Sequence[str] = (),
                 port: Optional[int] = None, prometheus_port: Optional[int] = None,
                 log_dir: Optional[str] = None):
        super().__init__(log_dir)
        self.engines = {"prefill": prefill, "decode": decode}
        self.bootstrap_port = bootstrap_port
        self.role = role
        if port is None or prometheus_port is None:
            port, prometheus_port = free_ports(2)
        self.prometheus_port = prometheus_port
        self._add(role, [
            fork_python(), "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--host", HOST,
            "--port", str(port),
            "--prometheus-host", HOST,
            "--prometheus-port", str(prometheus_port),
            *args,
        ], _role_env(env), port)

    @classmethod
    @contextlib.contextmanager
    def fronting(cls, cluster: "PDCluster", args: Sequence[str] = ()) -> Iterator["Gateway"]:
        """A gateway started in front of a running cluster's engines, each registered with POST /workers;
        torn down on exit."""
        gw = cls(cluster["prefill"], cluster["decode"], cluster.bootstrap_port, log_dir=str(cluster.log_dir),
                 args=args)
        try:
            gw.start()
            gw.register_workers()
            yield gw
        finally:
            gw.teardown()

    @property
    def url(self) -> str:
        return self.servers[self.role].url

    # -- the worker API

    def workers(self) -> List[Dict[str, Any]]:
        """GET /workers: one dict per registered worker."""
        status, body = http_get(self.url + "/workers")
        if status != 200:
            raise ClusterError(f"GET /workers -> {status}: {body[:200]!r}")
        return json.loads(body)["workers"]

    def worker(self, role: str) -> Optional[Dict[str, Any]]:
        """The gateway's entry for this engine (matched by url), or None."""
        url = self.engines[role].url
        for w in self.workers():
            if w.get("url") == url:
                return w
        return None

    def register_worker(self, role: str, timeout: float = REGISTER_TIMEOUT) -> Dict[str, Any]:
        """POST /workers for this engine as an RL framework does; returns the gateway's
        entry once its registration workflow has added it (the POST only queues it)."""
        payload: Dict[str, Any] = {"url": self.engines[role].url, "worker_type": role}
        if role == "prefill":
            payload["bootstrap_port"] = self.bootstrap_port
        status, body = http_post_json(self.url + "/workers", payload, timeout=30)
        if status not in (200, 201, 202):
            raise ClusterError(f"POST /workers {payload} -> {status}: {body}")
        return wait_until(
            lambda: self.worker(role),
            timeout,
            f"gateway to list the {role} worker",
            on_timeout=lambda: self.servers[self.role].tail(20),
        )

    def register_workers(self) -> None:
        """Both engines, prefill first."""
        for role in PD_ROLES:
            self.register_worker(role)

    def deregister_worker(self, role: str, timeout: float = REGISTER_TIMEOUT) -> None:
        """GET /workers, find this engine's id by url, DELETE /workers/{id}; returns
        once the gateway no longer lists it."""
        entry = self.worker(role)
        if entry is None:
            raise ClusterError(f"{role} is not registered with the gateway")
        status, body = http_request(self.url + f"/workers/{entry['id']}", "DELETE")
        if status not in (200, 202, 204):
            raise ClusterError(f"DELETE /workers/{entry['id']} -> {status}: {body[:200]!r}")
        wait_until(
            lambda: self.worker(role) is None,
            timeout,
            f"gateway to drop the {role} worker",
        )

    # -- what it counted

    def metrics(self) -> Dict[str, float]:
        """The gateway's Prometheus metrics (its own port)."""
        status, body = http_get(f"http://{self.servers[self.role].address}:{self.prometheus_port}/metrics")
        if status != 200:
            raise ClusterError(f"gateway /metrics -> {status}")
        return parse_prometheus(body.decode())

    def failures(self, metrics: Optional[Mapping[str, float]] = None) -> Dict[str, float]:
        """Failed attempts the circuit breaker charged to each engine (its outcome counter)."""
        metrics = self.metrics() if metrics is None else metrics
        return {role: metrics.get(
            f'smg_worker_cb_outcomes_total{{worker="{self.engines[role].url}",outcome="failure"}}', 0.0)
            for role in PD_ROLES}

    def circuit_opens(self, metrics: Optional[Mapping[str, float]] = None) -> Dict[str, float]:
        """How often each engine's circuit opened (transitions to "open", from any state)."""
        metrics = self.metrics() if metrics is None else metrics
        return {role: sum(v for k, v in metrics.items()
                          if k.startswith("smg_worker_cb_transitions_total")
                          and f'"{self.engines[role].url}"' in k and 'to="open"' in k)
                for role in PD_ROLES}

    def circuit_states(self, metrics: Optional[Mapping[str, float]] = None) -> Dict[str, Optional[float]]:
        """Each engine's circuit state now (0 = closed; None: the gateway exports none for it)."""
        metrics = self.metrics() if metrics is None else metrics
        return {role: metrics.get(f'smg_worker_cb_state{{worker="{self.engines[role].url}"}}')
                for role in PD_ROLES}


class MiniLB(Deployment):
    """A mini load balancer (role 'mini_lb') in front of engines that already run, e.g.
    beside the Rust gateway of a PDCluster(balancer="router") to compare the two."""

    def __init__(self, prefill_url: str, bootstrap_port: int, decode_url: str,
                 *, log_dir: Optional[str] = None):
        super().__init__(log_dir)
        (port,) = free_ports(1)
        self._add("mini_lb", _mini_lb_argv([(prefill_url, bootstrap_port)], decode_url, port), _role_env(None), port)

    @property
    def url(self) -> str:
        return self.servers["mini_lb"].url


class SingleServer(Deployment):
    """One non-disaggregated server (role 'single')."""

    def __init__(
        self,
        model: str,
        *,
        env: Optional[Mapping[str, str]] = None,
        args: Sequence[str] = (),
        log_dir: Optional[str] = None,
    ):
        super().__init__(log_dir)
        port, nccl = free_ports(2)
        self._add("single", _launch_server_argv(model, port, nccl, list(args)), _role_env(env), port)

    @property
    def url(self) -> str:
        return self.servers["single"].url


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


# ----------------------------------------------------------------------------- requests


def generate(url: str, text: str, max_new_tokens: int = 32, timeout: float = 120.0,
             sampling: Optional[Mapping[str, Any]] = None, **extra) -> Dict[str, Any]:
    """One greedy /generate; returns status, latency, output ids and text. `sampling`:
    sampling params merged over the greedy defaults (temperature 0, max_new_tokens);
    `extra`: other top-level fields of the request (rid, ...)."""
    if "sampling_params" in extra:
        raise TypeError("generate: pass sampling params as sampling=, merged over the greedy defaults")
    payload = {
        "text": text,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, **(sampling or {})},
        **extra,
    }
    t0 = time.monotonic()
    try:
        status, body = http_post_json(url + "/generate", payload, timeout=timeout)
    except Exception as e:
        status, body = None, repr(e)
    latency = time.monotonic() - t0
    ok = status == 200 and isinstance(body, dict)
    return {
        "status": status,
        "latency": latency,
        "output_ids": body.get("output_ids") if ok else None,
        "text": body.get("text") if ok else None,
        "meta": body.get("meta_info") if ok else None,
        "error": None if ok else body,
    }


def generate_concurrently(url: str, prompts: Sequence[str], **kw) -> List[Dict[str, Any]]:
    """All prompts at once, one thread each; results in prompt order."""
    results: List[Optional[Dict[str, Any]]] = [None] * len(prompts)

    def run(i):
        results[i] = generate(url, prompts[i], **kw)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results  # type: ignore[return-value]


def prompts(n: int) -> List[str]:
    """n distinct prompts in the tiny tokenizer's vocabulary."""
    words = "the quick brown fox jumps over the lazy dog hello world paris london".split()
    return [
        f"request {i}: " + " ".join(words[(i + k) % len(words)] for k in range(5 + i % 7))
        for i in range(n)
    ]
