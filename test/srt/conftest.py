"""Shared fixtures: the tiny model, one 1P1D deployment (+ a plain control server)
per test module, and helpers to wait until a server holds nothing again.

Servers run under $SGLANG_FORK_PYTHON (see testing.pd_cluster).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from testing.pd_cluster import PDCluster, SingleServer, start_all, wait_until
from testing.tiny_model import ensure_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL_DIR = REPO_ROOT / ".cache" / "tiny-llama"
IDLE_TIMEOUT = 60.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failure, attach the tail of every server log of the module's deployment."""
    outcome = yield
    report = outcome.get_result()
    funcargs = getattr(item, "funcargs", {})
    deployment = funcargs.get("pd_deployment") or funcargs.get("gateway_deployment")
    if report.failed and deployment:
        for d in deployment:
            for role, server in d.servers.items():
                report.sections.append((f"{role} log", server.tail(30)))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_tiny_model(TINY_MODEL_DIR)


@pytest.fixture(scope="module")
def pd_deployment(tiny_model):
    """(PDCluster, SingleServer) started together, torn down after the module."""
    cluster = PDCluster(str(tiny_model))
    single = SingleServer(str(tiny_model), log_dir=str(cluster.log_dir))
    start_all(cluster, single)
    try:
        yield cluster, single
    finally:
        errors = []
        for d in (cluster, single):
            try:
                d.teardown()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]


@pytest.fixture(scope="module")
def pd_cluster(pd_deployment) -> PDCluster:
    return pd_deployment[0]


@pytest.fixture(scope="module")
def single_server(pd_deployment) -> SingleServer:
    return pd_deployment[1]


# ----------------------------------------------------------------------------- idleness


def held(report: dict) -> dict:
    """The parts of a fork_pd_resources report that must return to baseline when idle.

    KV tokens kept as evictable prefix cache are not held: only `held`/`protected`
    count. Everything else is a count of slots or entries owned by live requests.
    """
    out = {
        "kv_held": report["kv_tokens"]["held"],
        "kv_protected": report["kv_tokens"]["protected"],
        "req_slots_in_use": report["req_slots"]["total"] - report["req_slots"]["free"],
    }
    if report["metadata_slots"] is not None:
        slots = report["metadata_slots"]
        out["metadata_slots_in_use"] = slots["total"] - slots["free"]
    out.update({f"queue.{k}": v for k, v in report["queues"].items()})
    out.update({f"rooms.{k}": v for k, v in (report["transfer_rooms"] or {}).items()})
    return out


def assert_idle(deployment, roles, baseline: dict | None = None, timeout: float = IDLE_TIMEOUT) -> dict:
    """Poll until every role holds what it held at baseline (default: nothing)."""
    expected = {
        role: (held(baseline[role]) if baseline else None) for role in roles
    }
    last = {}

    def idle():
        for role in roles:
            now = held(deployment.resources(role))
            last[role] = now
            want = expected[role] or {k: 0 for k in now}
            if now != want:
                return False
        return True

    def describe():
        lines = []
        for role in roles:
            want = expected[role] or {k: 0 for k in last.get(role, {})}
            diff = {
                k: (v, want.get(k)) for k, v in last.get(role, {}).items() if v != want.get(k)
            }
            lines.append(f"{role}: (now, expected) {diff}")
        return "\n".join(lines)

    wait_until(idle, timeout, "servers to release everything", on_timeout=describe)
    return {role: deployment.resources(role) for role in roles}


# Queue harnesses (testing/queue_harness.py): one of each per test module, with its
# idle snapshot as the baseline its tests return to.
@pytest.fixture(scope="module")
def prefill_h():
    from testing.queue_harness import PrefillHarness

    with PrefillHarness() as h:
        h.idle = h.snapshot()
        yield h


@pytest.fixture(scope="module")
def decode_h():
    from testing.queue_harness import DecodeHarness

    with DecodeHarness() as h:
        h.idle = h.snapshot()
        yield h


# Per-peer tables (fork_pd_resources.peers / mooncake_pair "peers"): entries upstream's
# decode heartbeat adds per prefill on its own schedule (0 or 1 each between two
# beats) are bounded by the prefills known, and compared as such.
HEARTBEAT_TABLES = ("heartbeat_failures", "session_pool")


def stable_peer_tables(peers: dict) -> dict:
    out = {k: v for k, v in peers.items() if k not in HEARTBEAT_TABLES}
    for k in HEARTBEAT_TABLES:
        if k in peers:
            out[k + "<=prefills"] = peers[k] <= peers.get("prefill_info_table", 0)
    return out


# The production Rust gateway (sglang-router, its defaults) with self-registered
# engines, a mini LB over the same engines and a plain control server.
@pytest.fixture(scope="module")
def gateway_deployment(tiny_model):
    """(PDCluster(balancer="router"), MiniLB over its engines, SingleServer)."""
    from testing.pd_cluster import MiniLB

    cluster = PDCluster(str(tiny_model), balancer="router")
    single = SingleServer(str(tiny_model), log_dir=str(cluster.log_dir))
    started = [cluster, single]
    try:
        start_all(cluster, single)
        mini = MiniLB(cluster["prefill"].url, cluster.bootstrap_port, cluster["decode"].url,
                      log_dir=str(cluster.log_dir))
        started.append(mini)
        mini.start()
        yield cluster, mini, single
    finally:
        errors = []
        for d in reversed(started):
            try:
                d.teardown()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]
