"""Shared fixtures: the tiny model, deployments of real servers started through one
factory (`deployments`) whose failures attach every server's log, one 1P1D (+ a plain
control server) per test module, the queue harnesses. The assertions shared by the
tests (nothing held, client abort, legs, end-cause counter) live in testing/pd_checks.py
and are re-exported here under their old names.

Servers run under $SGLANG_FORK_PYTHON (see testing.pd_cluster).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from testing.pd_checks import (  # noqa: F401  (re-exported for the test modules)
    HEARTBEAT_TABLES,
    IDLE_TIMEOUT,
    assert_idle,
    held,
    stable_peer_tables,
)
from testing.pd_cluster import Deployment, PDCluster, SingleServer, start_all
from testing.tiny_model import ensure_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL_DIR = REPO_ROOT / ".cache" / "tiny-llama"
LOG_LINES = 30

# Every deployment started through the factory and not yet torn down: a failing test
# (setup, call or teardown) gets the tail of each of their server logs.
_LIVE: "list[Deployment]" = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failure, attach the tail of every live server log."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for d in list(_LIVE):
            for role, server in d.servers.items():
                report.sections.append((f"{role} log ({d.log_dir})", server.tail(LOG_LINES)))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_tiny_model(TINY_MODEL_DIR)


class Deployments:
    """Starts deployments for one test module and takes them all apart after it
    (resuming frozen servers first). `pd(...)` takes PDCluster's keywords;
    `pd_and_single(...)` starts a plain control server next to it."""

    def __init__(self, model: Path):
        self.model = str(model)
        self.started: "list[Deployment]" = []

    def _start(self, *deployments: Deployment) -> None:
        _LIVE.extend(deployments)
        self.started.extend(deployments)
        start_all(*deployments)

    def pd(self, **kwargs) -> PDCluster:
        cluster = PDCluster(self.model, **kwargs)
        self._start(cluster)
        return cluster

    def pd_and_single(self, single_env=None, single_args=(), **kwargs):
        cluster = PDCluster(self.model, **kwargs)
        single = SingleServer(self.model, env=single_env, args=single_args, log_dir=str(cluster.log_dir))
        self._start(cluster, single)
        return cluster, single

    def teardown(self) -> None:
        errors = []
        for d in reversed(self.started):
            try:
                for server in d.servers.values():
                    if server.is_alive():  # a test may have failed while it was frozen
                        server.resume()
            except Exception as e:
                errors.append(e)
            try:
                d.teardown()
            except Exception as e:
                errors.append(e)
            if d in _LIVE:
                _LIVE.remove(d)
        self.started.clear()
        if errors:
            raise errors[0]


@pytest.fixture(scope="module")
def deployments(tiny_model):
    """The module's deployment factory (see Deployments)."""
    factory = Deployments(tiny_model)
    try:
        yield factory
    finally:
        factory.teardown()


@pytest.fixture(scope="module")
def pd_deployment(deployments):
    """(PDCluster, SingleServer) started together, torn down after the module."""
    return deployments.pd_and_single()


@pytest.fixture(scope="module")
def pd_cluster(pd_deployment) -> PDCluster:
    return pd_deployment[0]


@pytest.fixture(scope="module")
def single_server(pd_deployment) -> SingleServer:
    return pd_deployment[1]


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


# The production Rust gateway (sglang-router, its defaults) with self-registered
# engines, a mini LB over the same engines and a plain control server.
@pytest.fixture(scope="module")
def gateway_deployment(deployments):
    """(PDCluster(balancer="router"), MiniLB over its engines, SingleServer)."""
    from testing.pd_cluster import MiniLB

    cluster, single = deployments.pd_and_single(balancer="router")
    mini = MiniLB(cluster["prefill"].url, cluster.bootstrap_port, cluster["decode"].url,
                  log_dir=str(cluster.log_dir))
    deployments._start(mini)
    return cluster, mini, single
