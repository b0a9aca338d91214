"""Real 1P1D servers (mooncake over TCP, --enable-metrics, behind the mini load balancer): after a failed KV chunk
write and a prefill killed and restarted, the two servers' /metrics export every metric the Grafana dashboard and
the Prometheus alert rules read (docs/grafana/pd-fork.json, docs/prometheus/pd-fork-rules.yml); every fork series
carries the scheduler's labels (model_name, tp_rank, ...); `peer` is the lost peer's host:port; the peer gauges
follow the loss and the recovery, the pause gauge a pause and its continue.

Upstream 0.5.23 exports none of the fork's metrics (the dashboard and the rules read upstream's
`sglang:num_requests_total`, `sglang:num_running_reqs`, `sglang:num_transfer_failed_reqs_total` too).
Before this change the chunk-failure counter carried none of the scheduler's labels (and was made without
--enable-metrics) and no gauge existed: the scrape lacked 6 of the names the dashboard reads.
"""

from __future__ import annotations

import time

import pytest

from conftest import TP2, topology_params, topology_pd
from testing.pd_checks import (CHUNK_FAILURES, PAUSED, PD_ROLES, PEER_LOSSES, PEER_RECOVERIES, PEERS_LOST,
                               assert_idle, exported_names, referenced_metrics, samples)
from testing.pd_cluster import HOST, generate, http_post_json, metric_sum, wait_until

pytestmark = pytest.mark.e2e

HEARTBEAT_S = 2.0  # upstream's floor; the decode's monitor probes each prefill once a heartbeat
ENV = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": str(HEARTBEAT_S),
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
    # decode holds a failed room's pages until prefill acks a drain or this passes (upstream's 30 s)
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "3",
}
FAULTS = "kv:rid=metrics-fail-"
# A refused bootstrap server is lost at the monitor's next tick; the gauges are set once a second.
DETECT_BOUND_S = HEARTBEAT_S + 6.0
GAUGE_BOUND_S = 5.0
FAILED_CHUNK_BOUND_S = 30.0
SCHEDULER_LABELS = ("model_name", "engine_type", "tp_rank")
TOKENIZER_LABELS = ("model_name", "engine_type")
RECOVERIES = "sglang:pd_request_recoveries_total"


@pytest.fixture(scope="module", params=topology_params(TP2))
def cluster(deployments, request):
    """TP=1 (make test) or TP=2 on both servers (make test-tp), behind the mini LB; the fault switch fails the KV
    write of a request whose rid starts with `metrics-fail-`."""
    yield from topology_pd(deployments, request.param, prefill_env={"SGLANG_TEST_DISAGG_FAIL_CHUNKS": FAULTS, **ENV},
                           decode_env=ENV)


def _ok(cluster, rid: str) -> dict:
    result = generate(cluster.url, f"{rid}: the quick brown fox", max_new_tokens=8, rid=rid)
    assert result["status"] == 200, result
    return result


def _series_carry_scheduler_labels(metrics, role: str) -> None:
    fork = [name for name in exported_names(metrics) if name.startswith("sglang:pd_")]
    assert fork, role
    for name in fork:
        for labels, _value in samples(metrics, name):
            # decode's tokenizer counts recoveries, with its labels (upstream's tokenizer metrics: no tp_rank)
            wanted = TOKENIZER_LABELS if name == RECOVERIES else SCHEDULER_LABELS
            missing = [k for k in wanted if k not in labels]
            assert not missing, (role, name, labels)
            assert labels["engine_type"] == role, (role, name, labels)


def test_every_metric_the_dashboard_and_rules_read_is_exported_after_faults(cluster):
    prefill, decode = cluster["prefill"], cluster["decode"]
    baseline = assert_idle(cluster, PD_ROLES)
    ranks = cluster.tp

    # a failed KV chunk write: 500 on both sides, counted by kind with the scheduler's labels
    t0 = time.monotonic()
    failed = generate(cluster.url, "metrics-fail: the quick brown fox", max_new_tokens=8, rid="metrics-fail-0")
    assert failed["status"] == 500 and "Failed to send kv chunk" in str(failed["error"]), failed
    assert time.monotonic() - t0 < FAILED_CHUNK_BOUND_S
    wait_until(lambda: metric_sum(prefill.metrics(), CHUNK_FAILURES, kind="kv", role="prefill") >= 1
               and metric_sum(decode.metrics(), CHUNK_FAILURES, kind="kv", role="decode") == 1, 10,
               "the failed chunk write counted on both sides")
    assert 1 <= metric_sum(prefill.metrics(), CHUNK_FAILURES, kind="kv", role="prefill") <= ranks["prefill"]
    _ok(cluster, "metrics-ok-0")
    assert_idle(cluster, PD_ROLES, baseline, timeout=60)
    scraped = {"prefill before": prefill.metrics()}
    _series_carry_scheduler_labels(scraped["prefill before"], "prefill")

    # the prefill killed: decode loses it (502s for its requests; none in flight here), then it comes back
    assert metric_sum(decode.metrics(), PEERS_LOST) == 0
    losses, recoveries = metric_sum(decode.metrics(), PEER_LOSSES), metric_sum(decode.metrics(), PEER_RECOVERIES)
    prefill.kill()
    t_gone = time.monotonic()
    wait_until(lambda: metric_sum(decode.metrics(), PEER_LOSSES) == losses + ranks["decode"], DETECT_BOUND_S,
               "decode to count the prefill lost")
    wait_until(lambda: metric_sum(decode.metrics(), PEERS_LOST) == ranks["decode"], GAUGE_BOUND_S,
               "decode's lost-peers gauge")
    print(f"prefill lost after {time.monotonic() - t_gone:.1f}s")
    scraped["decode, prefill lost"] = decode.metrics()
    addr = f"{HOST}:{cluster.bootstrap_port}"
    peers = {labels["peer"] for labels, value in samples(scraped["decode, prefill lost"], PEER_LOSSES) if value}
    assert peers == {addr}, peers

    prefill.start()
    prefill.wait_healthy()
    _ok(cluster, "metrics-ok-1")  # decode fetches the prefill's info again: recovered
    wait_until(lambda: metric_sum(decode.metrics(), PEER_RECOVERIES) == recoveries + ranks["decode"], 10,
               "decode to count the prefill back")
    wait_until(lambda: metric_sum(decode.metrics(), PEERS_LOST) == 0, GAUGE_BOUND_S, "the lost-peers gauge back at 0")
    back = {labels["peer"] for labels, value in samples(decode.metrics(), PEER_RECOVERIES) if value}
    assert back == {addr}, back
    assert_idle(cluster, ("decode",), baseline, timeout=60)
    assert_idle(cluster, ("prefill",), timeout=60)
    wait_until(lambda: PEERS_LOST in exported_names(prefill.metrics()), GAUGE_BOUND_S, "the restarted prefill's gauges")
    scraped["prefill after"] = prefill.metrics()
    scraped["decode after"] = decode.metrics()
    for where, metrics in scraped.items():
        _series_carry_scheduler_labels(metrics, where.split()[0].rstrip(","))

    exported = set().union(*(exported_names(m) for m in scraped.values()))
    missing = {name: sorted(where) for name, where in referenced_metrics().items() if name not in exported}
    assert not missing, missing


def test_pause_gauge_follows_pause_and_continue(cluster):
    servers = [cluster[role] for role in PD_ROLES]
    assert [metric_sum(s.metrics(), PAUSED) for s in servers] == [0, 0]
    try:
        for server in servers:
            status, body = http_post_json(f"{server.url}/pause_generation", {"mode": "in_place"}, timeout=60)
            assert status == 200, body
        wait_until(lambda: all(metric_sum(s.metrics(), PAUSED) == cluster.tp[r] for s, r in zip(servers, PD_ROLES)),
                   GAUGE_BOUND_S, "the pause gauges at 1")
    finally:
        for server in servers:
            http_post_json(f"{server.url}/continue_generation", {}, timeout=60)
    wait_until(lambda: all(metric_sum(s.metrics(), PAUSED) == 0 for s in servers), GAUGE_BOUND_S,
               "the pause gauges back at 0")
    _ok(cluster, "metrics-after-pause")
