"""A silent partition between the production gateway (sglang-router, PD mode) and the decode worker, each on its
own test host (testing/hosts.py); prefill and decode still reach each other, this test reaches all three. Under
closed-loop load: the gateway's own health check marks decode unhealthy (short health-check knobs, as a
deployment that wants to notice a partition sets them); requests in flight through the cut link are answered
once it heals (nothing is left waiting on either engine); new requests are answered at once (503, no decode
available) instead of hanging; after the heal the gateway marks decode healthy again
and serves, with no restart and no manual step. The gateway (0.3.2) charges both workers of an attempt for its
own failure to reach decode (docs/gateway.md): prefill is never charged more than decode, and its circuit never
opens. docs/peer-liveness.md ("Silent peers").

Recovery is on on both servers (SGLANG_FORK_RECOVERY_ATTEMPTS=1): prefill and decode still reach each other, no
transfer fails, and no recovery is started (the recoveries counter stays at 0); the answers are those of recovery off.
"""

from __future__ import annotations

import json
import time

import pytest

from testing.pd_checks import PD_ROLES, ClosedLoop, assert_idle, delta, request_recoveries
from testing.pd_cluster import generate, wait_until

pytestmark = pytest.mark.e2e

HEALTH_INTERVAL, HEALTH_FAILURES, HEALTH_TIMEOUT = 1, 2, 3  # upstream's /health takes >= 1 s (a generation)
GATEWAY_ARGS = (
    "--health-check-interval-secs", str(HEALTH_INTERVAL),
    "--health-failure-threshold", str(HEALTH_FAILURES),
    "--health-success-threshold", "1",
    "--health-check-timeout-secs", str(HEALTH_TIMEOUT),
)
DEADLINE = 15.0
ENV = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2", "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": str(DEADLINE),
       "SGLANG_FORK_RECOVERY_ATTEMPTS": "1"}
MARGIN = 4.0  # a busy 2-core machine
# the first failing check starts within an interval of the cut; each failing one takes its timeout
REMOVE_BOUND = HEALTH_FAILURES * (HEALTH_INTERVAL + HEALTH_TIMEOUT) + MARGIN
READMIT_BOUND = HEALTH_INTERVAL + MARGIN
PARTITION_S = 8.0  # how long the link stays cut after decode is removed
CLIENTS = 4


@pytest.fixture(scope="module")
def cluster(pd_hosts, deployments):
    c = deployments.pd(hosts=pd_hosts.hosts, balancer="router", lb_args=GATEWAY_ARGS, prefill_env=ENV, decode_env=ENV)
    yield c
    pd_hosts.heal()


def _healthy(gateway, role: str) -> bool:
    entry = gateway.worker(role)
    return bool(entry and entry.get("is_healthy"))


def test_gateway_partitioned_from_decode(cluster, pd_hosts):
    gateway = cluster.gateway
    baseline = assert_idle(cluster, PD_ROLES)
    failures = gateway.failures()
    recoveries = request_recoveries(cluster["decode"].metrics())
    loop = ClosedLoop(cluster.url, CLIENTS, max_new_tokens=16, timeout=120, ignore_eos=True).start()
    try:
        wait_until(lambda: loop.completed() >= 2 * CLIENTS, 60, "closed-loop completions before the cut")
        t_cut = time.monotonic()
        pd_hosts.cut("lb", "decode")
        wait_until(lambda: not _healthy(gateway, "decode"), REMOVE_BOUND + 10, "the gateway to mark decode unhealthy",
                   interval=0.1)
        removed_after = time.monotonic() - t_cut
        assert _healthy(gateway, "prefill")
        # while decode is out, a request is answered at once, not held
        t0 = time.monotonic()
        out = generate(cluster.url, "while decode is out", 4, timeout=30)
        refused = (out["status"], time.monotonic() - t0, json.dumps(out["error"]))
        wait_until(lambda: time.monotonic() - t_cut >= removed_after + PARTITION_S, PARTITION_S + 5,
                   "the partition to last")
        t_heal = time.monotonic()
        pd_hosts.heal()
        wait_until(lambda: _healthy(gateway, "decode"), READMIT_BOUND + 10, "the gateway to mark decode healthy",
                   interval=0.1)
        readmitted_after = time.monotonic() - t_heal
        probe = wait_until(lambda: (r := generate(cluster.url, "served again?", 4, timeout=60))["status"] == 200 and r,
                           30, "a request served after the heal")
        served_after = time.monotonic() - t_heal
        n = loop.completed()
        wait_until(lambda: loop.completed() >= n + 2 * CLIENTS, 60, "serving after the heal")
    finally:
        loop.stop()
        pd_hosts.heal()
    print(f"\ngateway-decode partition: decode marked unhealthy {removed_after:.2f} s after the cut, healthy again "
          f"{readmitted_after:.2f} s after the heal, served {served_after:.2f} s after it; request while out: "
          f"{refused[:2]}; answers {dict(loop.summary())}; failures charged {gateway.failures()} (before {failures})")
    assert removed_after <= REMOVE_BOUND, removed_after
    assert readmitted_after <= READMIT_BOUND, readmitted_after
    assert probe["status"] == 200
    assert refused[0] == 503 and "decode" in refused[2] and refused[1] <= MARGIN, refused
    for r in loop.results:  # completions, or "no decode available" while it was out
        assert r["status"] == 200 or (r["status"] == 503 and "decode" in json.dumps(r["error"])), r
    # requests in flight through the cut link were answered after the heal: nothing waits on either engine
    assert_idle(cluster, PD_ROLES, baseline)
    charged = {role: gateway.failures()[role] - failures[role] for role in PD_ROLES}
    assert charged["prefill"] <= charged["decode"], charged
    assert gateway.circuit_opens()["prefill"] == 0, gateway.circuit_opens()
    # recovery on, nothing for it to recover: no transfer between prefill and decode failed
    assert delta(recoveries, request_recoveries(cluster["decode"].metrics())) == {}
    assert not any((r["meta"] or {}).get("recovery") for r in loop.results)
