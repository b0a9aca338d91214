"""The four kinds of deployment the tests start: `PDCluster` (1 prefill + 1 decode + a load
balancer: the mini LB or the production Rust gateway with self-registering engines, at
any tensor-parallel topology, optionally on test hosts), `Gateway` (the Rust gateway in
front of engines that already run), `MiniLB` and `SingleServer` (one plain server), on
free loopback ports (testing.ports), as processes of testing.processes.

Servers get no workaround flags or env: what they need on CPU is in the fork itself.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

from testing.http_client import http_get, http_post_json, http_request, metric_sum, parse_prometheus
from testing.polling import ClusterError, wait_until
from testing.ports import HOST, free_ports
from testing.processes import DEFAULT_HEALTH_TIMEOUT, Deployment, Server, fork_python


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



def _role_env(extra: Optional[Mapping[str, str]]) -> Dict[str, str]:
    return {**os.environ, **BASE_ENV, **(extra or {})}



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
        more_decodes: Sequence[Sequence[str]] = (),
    ):
        """`hosts`: role (prefill, decode, lb) -> testing.hosts.Host to run it on (default: this host).
        `prefills`: more than one prefill server (roles prefill, prefill2, ...; each its own bootstrap port, the same
        env and args), behind the mini LB (which picks one at random per request) or the gateway (each registered as
        a prefill worker with its bootstrap port).
        `more_decodes`: more decode servers (roles decode2, decode3, ...), each with decode's env and args plus its
        own args here (later ones win), behind the gateway (each registered as a decode worker)."""
        if balancer not in BALANCERS:
            raise ValueError(f"balancer must be one of {BALANCERS}, not {balancer!r}")
        if more_decodes and balancer != "router":
            raise ValueError("more than one decode: only behind the gateway (the mini LB cannot remove one)")
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
        self.decode_roles = ["decode"]
        for i, extra in enumerate(more_decodes, start=2):
            port, nccl = free_ports(2)
            self._add(f"decode{i}", _launch_server_argv(model, port, nccl, [
                "--disaggregation-mode", "decode", *pd, *decode_args, *extra,
            ]), _role_env(decode_env), port)
            self.decode_roles.append(f"decode{i}")
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
                                   port=lb_port, prometheus_port=prom_port, log_dir=str(self.log_dir),
                                   more_decodes={r: self.servers[r] for r in self.decode_roles[1:]},
                                   more_prefills=self.more_prefills())
            self.servers["lb"] = self.gateway["lb"]
        if "lb" in hosts:
            self.servers["lb"].place(hosts["lb"])

    @property
    def url(self) -> str:
        return self.servers["lb"].url

    def more_prefills(self) -> Dict[str, Tuple[Server, int]]:
        """prefill2, ...: (server, bootstrap port) each, as a Gateway fronting them takes them."""
        return {r: (self.servers[r], self.bootstrap_ports[r]) for r in self.prefill_roles[1:]}

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
                 log_dir: Optional[str] = None, more_decodes: Optional[Mapping[str, Server]] = None,
                 more_prefills: Optional[Mapping[str, Tuple[Server, int]]] = None):
        super().__init__(log_dir)
        more_prefills = more_prefills or {}
        self.engines = {"prefill": prefill, **{r: s for r, (s, _) in more_prefills.items()}, "decode": decode,
                        **(more_decodes or {})}
        self.bootstrap_port = bootstrap_port
        self.bootstrap_ports = {"prefill": bootstrap_port, **{r: b for r, (_, b) in more_prefills.items()}}
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
    def fronting(cls, cluster: "PDCluster", args: Sequence[str] = (), host: Any = None) -> Iterator["Gateway"]:
        """A gateway started in front of a running cluster's engines (every prefill, the first decode), each
        registered with POST /workers; on `host` (a testing.hosts.Host) if given; torn down on exit."""
        gw = cls(cluster["prefill"], cluster["decode"], cluster.bootstrap_port, log_dir=str(cluster.log_dir),
                 args=args, more_prefills=getattr(cluster, "more_prefills", dict)())
        if host is not None:
            gw[gw.role].place(host)
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
        payload: Dict[str, Any] = {"url": self.engines[role].url, "worker_type": role.rstrip("0123456789")}
        if role in self.bootstrap_ports:
            payload["bootstrap_port"] = self.bootstrap_ports[role]
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
        """Every engine, prefill first."""
        for role in self.engines:
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
            f'smg_worker_cb_outcomes_total{{worker="{engine.url}",outcome="failure"}}', 0.0)
            for role, engine in self.engines.items()}

    def charged(self) -> tuple:
        """(retries made, retries exhausted, failures charged to each engine's circuit) as the gateway counts them
        now: a test compares two readings to say the gateway neither retried nor charged a circuit."""
        metrics = self.metrics()
        return (metric_sum(metrics, "smg_worker_retries_total"),
                metric_sum(metrics, "smg_worker_retries_exhausted_total"), self.failures(metrics))

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

