"""A silent partition between prefill and decode on separate hosts (testing/hosts.py): prefill, decode and the
mini load balancer each in their own network namespace, one switch between them. The switch stops forwarding
between prefill and decode (no RST, nothing refused: connects and reads time out) under closed-loop load, while
the balancer and this test still reach both. Asserted: each side declares the other lost within two heartbeats;
every request bound to the silent peer ends (502 naming it, or 504 at its deadline), none waits past its
deadline; both sides give everything back; once the link heals the peer is served again within a heartbeat,
with no restart and no manual step. docs/peer-liveness.md ("Silent peers").

Recovery is on on both servers (PARTITION_ENV: SGLANG_FORK_RECOVERY_ATTEMPTS=1); the answers are those of recovery
off, as docs/recovery.md ("A partition between prefill and decode") decides: the requests bound to the silent peer end
502 naming it (the in-flight ones, once decode declares prefill lost) or 504 in decode_prealloc (the next ones, at
their deadline), neither a recoverable cause. Asserted besides: every recovery started (a chunk failure of a request
handshaken around the heal, re-run on the healed link) ended, recovered or answered, none left held
(judge_partition_recoveries, the recoveries counter). Measured (CPU, TCP, network namespaces, 4 closed-loop clients)
with recovery off and on: 4 x 502 after 8.8 s (off) / 10.0 s (on), 4 x 504 after 15.1-15.4 s (both), no recovery
started, served again 0.6-0.7 s after the heal. Stock upstream 0.5.23 has no recovery: this is the off outcome.
"""

from __future__ import annotations

import time

import pytest

from testing.pd_checks import (PD_ROLES, PEER_LOSSES, PEER_RECOVERIES, ClosedLoop, assert_idle, cluster_end_causes,
                               delta, judge_partition_answers, judge_partition_recoveries, request_recoveries,
                               wait_counter_rises)
from testing.pd_checks import (PARTITION_ANSWER_BOUND as ANSWER_BOUND, PARTITION_DEADLINE as DEADLINE,
                               PARTITION_DETECT_BOUND as DETECT_BOUND, PARTITION_ENV as ENV,
                               PARTITION_RECOVER_BOUND as RECOVER_BOUND)
from testing.pd_cluster import generate, metric_sum, wait_until

pytestmark = pytest.mark.e2e

CLIENTS = 4


@pytest.fixture(scope="module")
def cluster(pd_hosts, deployments):
    """1P1D + mini LB, each on its own host (torn down before the hosts)."""
    c = deployments.pd(hosts=pd_hosts.hosts, prefill_env=ENV, decode_env=ENV)
    yield c
    pd_hosts.heal()


def _counts(cluster, name: str) -> dict:
    return {role: metric_sum(cluster[role].metrics(), name) for role in PD_ROLES}


def test_silent_partition_between_prefill_and_decode(cluster, pd_hosts):
    baseline = assert_idle(cluster, PD_ROLES)
    losses, recoveries = _counts(cluster, PEER_LOSSES), _counts(cluster, PEER_RECOVERIES)
    causes = cluster_end_causes(cluster)
    assert all(cluster[role].env.get("SGLANG_FORK_RECOVERY_ATTEMPTS") == "1" for role in PD_ROLES)
    recoveries_before = request_recoveries(cluster["decode"].metrics())
    peers = {role: cluster[role].address for role in PD_ROLES}
    loop = ClosedLoop(cluster.url, CLIENTS, max_new_tokens=16, timeout=DEADLINE + 30, ignore_eos=True).start()
    try:
        wait_until(lambda: loop.completed() >= 2 * CLIENTS, 60, "closed-loop completions before the cut")

        t_cut = time.monotonic()
        pd_hosts.cut("prefill", "decode")
        detected = wait_counter_rises(cluster, PD_ROLES, PEER_LOSSES, losses, t_cut, DETECT_BOUND + 5,
                                      "both sides to declare the other lost")
        # the link stays cut until the requests in flight at the cut and the next ones each client sent to the
        # silent peers have ended (prefill ends those no decode can take; decode's wait for the prefill ends at
        # its deadline, or when prefill's answer arrives after the heal)
        wait_until(lambda: sum(r["status"] != 200 for r in loop.results if r["t"] >= t_cut) >= 2 * CLIENTS,
                   ANSWER_BOUND + 5, "requests bound to the silent peer to end")
        during = loop.results[:]
        t_heal = time.monotonic()
        # served again within a heartbeat's bound, unless a KV write was in flight at the cut: mooncake then
        # connects to decode again during the cut, and prefill's probes of the session wait for that connect's next
        # SYN, up to about the cut's length after the heal (docs/peer-liveness.md; measured once here: prefill's
        # aux write failed at the cut, the cut lasted 22 s, served again 15.4 s after the heal). The 2P1D test
        # bounds prefill2 the same way.
        bound = RECOVER_BOUND + (t_heal - t_cut)
        pd_hosts.heal()
        probes = []

        def probe_served():  # one request at a time from the test itself (the clients may still be waiting)
            probes.append(generate(cluster.url, "served again?", 4, timeout=ANSWER_BOUND))
            probes[-1]["t"] = time.monotonic()
            return probes[-1]["status"] == 200

        wait_until(probe_served, bound + 10, "a request sent after the heal served", interval=0.1)
        served = probes[-1]["t"]
        recovered_after = served - t_heal
        n_heal = loop.completed()
        wait_until(lambda: loop.completed() >= n_heal + 2 * CLIENTS, 60, "serving after the heal")
    finally:
        loop.stop()
        pd_hosts.heal()
    print(f"\nsilent partition: declared lost after {detected} s; served again {recovered_after:.2f} s after the heal;"
          f" answers {dict(loop.summary())}; probes after the heal {[(r['status'], round(r['latency'], 2)) for r in probes]}")
    for r in probes:
        r["finish"] = (r["meta"] or {}).get("finish_reason", {}).get("type")
    reruns = judge_partition_recoveries(recoveries_before, request_recoveries(cluster["decode"].metrics()),
                                        loop.results + probes)
    print(f"request recoveries (cause, outcome): {reruns}")
    judge_partition_answers(probes[:-1], peers, ANSWER_BOUND)
    failed = [r for r in during if r["status"] != 200]
    assert failed, "no request was bound to the silent peer"
    judge_partition_answers(loop.results, peers, ANSWER_BOUND)
    assert all(r["latency"] <= ANSWER_BOUND for r in probes), [r["latency"] for r in probes]
    for role, seconds in detected.items():
        assert seconds <= DETECT_BOUND, (role, seconds)
    assert recovered_after <= bound, (recovered_after, bound)
    assert all(r["status"] == 200 for r in loop.results if r["t"] - r["latency"] >= served), loop.summary()
    assert_idle(cluster, PD_ROLES, baseline)
    # each side counted the loss and the recovery once
    assert delta(losses, _counts(cluster, PEER_LOSSES)) == {"prefill": 1, "decode": 1}
    wait_until(lambda: delta(recoveries, _counts(cluster, PEER_RECOVERIES)) == {"prefill": 1, "decode": 1}, 10,
               "both recoveries counted", on_timeout=lambda: str(delta(recoveries, _counts(cluster, PEER_RECOVERIES))))
    moved = delta(causes, cluster_end_causes(cluster))
    assert any(cause == "peer_failure" for (_, cause, _) in moved), moved
