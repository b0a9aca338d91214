"""1P1D behind the production Rust gateway (sglang-router, `launch_router
--pd-disaggregation` without `--mini-lb`, its default retries / circuit breaker /
health checks), engines self-registered with `POST /workers` as RL frameworks do.

One deployment for the module (conftest.gateway_deployment: the gateway cluster, a
mini LB over the same engines, a plain control server); each test starts by checking
the deployment is idle.
"""

from __future__ import annotations

import time

import pytest

from conftest import assert_idle, held
from testing.pd_cluster import generate, generate_concurrently, metric_sum, prompts

pytestmark = pytest.mark.e2e

PD_ROLES = ("prefill", "decode")
N_REQUESTS = 20
MAX_NEW_TOKENS = 32
BURST_DEADLINE_S = 90.0  # generous for a loaded 2-core machine (measured: 2-12 s)


def cb_states(cluster) -> dict:
    """The gateway's circuit state per registered engine url (0 = closed)."""
    metrics = cluster.router_metrics()
    out = {}
    for role in PD_ROLES:
        key = f'smg_worker_cb_state{{worker="{cluster[role].url}"}}'
        out[role] = metrics.get(key)
    return out


def test_engines_registered_themselves(gateway_deployment):
    cluster, _, _ = gateway_deployment
    workers = {w["worker_type"]: w for w in cluster.router_workers()}
    assert set(workers) == set(PD_ROLES), workers
    for role in PD_ROLES:
        assert workers[role]["url"] == cluster[role].url
        assert workers[role]["is_healthy"] is True
    assert workers["prefill"]["bootstrap_port"] == cluster.bootstrap_port


def test_burst_through_gateway_matches_mini_lb_and_single_server(gateway_deployment):
    cluster, mini, single = gateway_deployment
    baseline = assert_idle(cluster, PD_ROLES)
    texts = prompts(N_REQUESTS)

    t0 = time.monotonic()
    via_gateway = generate_concurrently(cluster.url, texts, max_new_tokens=MAX_NEW_TOKENS)
    burst_s = time.monotonic() - t0
    via_mini = generate_concurrently(mini.url, texts, max_new_tokens=MAX_NEW_TOKENS)
    reference = generate_concurrently(single.url, texts, max_new_tokens=MAX_NEW_TOKENS)

    # What the client saw: the same token ids on all three paths.
    for name, results in (("gateway", via_gateway), ("mini", via_mini), ("single", reference)):
        failed = [(i, r["status"], r["error"]) for i, r in enumerate(results) if r["status"] != 200]
        assert not failed, (name, failed)
    for i, (gw, mn, ref) in enumerate(zip(via_gateway, via_mini, reference)):
        assert gw["output_ids"], i
        assert gw["output_ids"] == mn["output_ids"] == ref["output_ids"], (i, texts[i])
        assert gw["meta"]["finish_reason"] == ref["meta"]["finish_reason"], i

    # How long it took.
    assert burst_s < BURST_DEADLINE_S, burst_s

    # What is left held: nothing beyond the idle baseline on either engine.
    after = assert_idle(cluster, PD_ROLES, baseline=baseline)
    for role in PD_ROLES:
        assert held(after[role]) == held(baseline[role]), role

    # What was counted: the gateway saw no failure and kept every circuit closed.
    metrics = cluster.router_metrics()
    assert metric_sum(metrics, "smg_worker_retries_exhausted_total") == 0
    assert cb_states(cluster) == {"prefill": 0.0, "decode": 0.0}
    for role in PD_ROLES:
        key = f'smg_worker_cb_outcomes_total{{worker="{cluster[role].url}",outcome="failure"}}'
        assert metrics.get(key, 0.0) == 0.0, (role, key)
