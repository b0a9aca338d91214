"""2P1D on separate hosts (testing/hosts.py): two prefill servers, one decode and the mini load balancer each in a
network namespace of its own on one switch. Under closed-loop load the switch stops forwarding between the second
prefill and decode (silent: nothing refused, nothing reset), while the balancer, the first prefill and this test
still reach every host. The balancer keeps picking either prefill at random, so about half the requests are bound
to the silent pair. Asserted: prefill2 and decode each declare the other lost within two heartbeats, and nobody
else is declared lost; every request bound to the silent pair ends (502 naming the lost peer, or 504 at its
deadline), none waits past its deadline, and the first prefill carries the rest (completions all through the cut,
no end charged to it); every server gives everything back; once the link heals both count the recovery within a
heartbeat and prefill2 serves again, with no restart and no manual step. docs/peer-liveness.md ("Silent peers").

Recovery is on on both prefills and decode (PARTITION_ENV): the answers are those of recovery off (a 502 naming the
lost peer is not a recoverable cause, and recovery re-runs a request on the prefill it came from, never on the other);
every recovery started ended (judge_partition_recoveries). Measured with it on (CPU, TCP, network namespaces): 4 x 502
after 8.3-8.5 s, 12 completions during the cut, no recovery started.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from testing.pd_checks import (PEER_LOSSES, PEER_RECOVERIES, ClosedLoop, assert_idle, delta, end_causes,
                               judge_partition_answers, judge_partition_recoveries, request_recoveries,
                               wait_counter_rises)
from testing.pd_checks import (PARTITION_ANSWER_BOUND as ANSWER_BOUND, PARTITION_DEADLINE as DEADLINE,
                               PARTITION_DETECT_BOUND as DETECT_BOUND, PARTITION_ENV as ENV,
                               PARTITION_RECOVER_BOUND as RECOVER_BOUND)
from testing.pd_cluster import metric_sum, wait_until

pytestmark = pytest.mark.e2e  # its own 4 servers: 63 s on the 2-core box (104 s under other sessions' load)

HOST_ROLES = ("prefill", "prefill2", "decode", "lb")  # the pd_hosts fixture makes these hosts
ROLES = ("prefill", "prefill2", "decode")
CLIENTS = 4
PROMPT_TOKENS = "sglang:prompt_tokens_total"


@pytest.fixture(scope="module")
def cluster(pd_hosts, deployments):
    """2P1D + mini LB, each on its own host (torn down before the hosts)."""
    c = deployments.pd(hosts=pd_hosts.hosts, prefills=2, prefill_env=ENV, decode_env=ENV)
    yield c
    pd_hosts.heal()


def _counts(cluster, name: str) -> dict:
    return {role: metric_sum(cluster[role].metrics(), name) for role in ROLES}


def _causes(cluster) -> dict:
    """End causes per server (both prefills label their ends role="prefill")."""
    return {(server,) + key: n for server in ROLES for key, n in end_causes(cluster[server].metrics()).items()}


def test_silent_partition_of_one_prefill_the_other_carries_the_load(cluster, pd_hosts):
    baseline = assert_idle(cluster, ROLES)
    losses, recoveries = _counts(cluster, PEER_LOSSES), _counts(cluster, PEER_RECOVERIES)
    causes = _causes(cluster)
    assert all(cluster[role].env.get("SGLANG_FORK_RECOVERY_ATTEMPTS") == "1" for role in ROLES)
    recoveries_before = request_recoveries(cluster["decode"].metrics())
    peers = {role: cluster[role].address for role in ("prefill2", "decode")}
    loop = ClosedLoop(cluster.url, CLIENTS, max_new_tokens=16, timeout=DEADLINE + 30, ignore_eos=True).start()
    try:
        wait_until(lambda: loop.completed() >= 2 * CLIENTS, 90, "closed-loop completions before the cut")
        t_cut = time.monotonic()
        pd_hosts.cut("prefill2", "decode")
        detected = wait_counter_rises(cluster, ("prefill2", "decode"), PEER_LOSSES, losses, t_cut, DETECT_BOUND + 5,
                                      "prefill2 and decode to declare each other lost")
        # the cut lasts until requests bound to the silent pair have ended and the other prefill has served more
        wait_until(lambda: sum(r["status"] != 200 for r in loop.results if r["t"] >= t_cut) >= CLIENTS
                   and sum(r["status"] == 200 for r in loop.results if r["t"] - r["latency"] >= t_cut) >= 2 * CLIENTS,
                   ANSWER_BOUND + 30, "requests bound to the silent pair to end, the others served")
        during = [r for r in loop.results if r["t"] >= t_cut]
        t_heal = time.monotonic()
        pd_hosts.heal()
        # a KV write prefill2 had in flight at the cut makes mooncake reconnect to decode during the cut; every
        # transfer to decode (its probe's read too) waits for that connect's next SYN, up to about the cut's length
        # after the heal (the SYN timer doubles while cut; docs/peer-liveness.md). Decode, which writes nothing to
        # prefill2, has no such wait.
        cut_seconds = t_heal - t_cut
        bounds = {"decode": RECOVER_BOUND, "prefill2": RECOVER_BOUND + cut_seconds}
        recovered = wait_counter_rises(cluster, ("prefill2", "decode"), PEER_RECOVERIES, recoveries, t_heal,
                                       max(bounds.values()) + 10, "prefill2 and decode to count the recovery")
        t_back = time.monotonic()
        served_by_prefill2 = metric_sum(cluster["prefill2"].metrics(), PROMPT_TOKENS)
        # requests sent from now on: each one served, prefill2's share among them
        wait_until(lambda: metric_sum(cluster["prefill2"].metrics(), PROMPT_TOKENS) > served_by_prefill2
                   and sum(r["status"] == 200 for r in loop.results if r["t"] - r["latency"] >= t_back) >= 2 * CLIENTS,
                   60, "prefill2 serving again after the heal")
    finally:
        loop.stop()
        pd_hosts.heal()
    print(f"\n2P1D silent partition of prefill2: declared lost after {detected} s; recovery counted {recovered} s "
          f"after the heal; statuses during the cut {dict(Counter(r['status'] for r in during))}; "
          f"all {dict(loop.summary())}")
    judge_partition_answers(loop.results, peers, ANSWER_BOUND)
    reruns = judge_partition_recoveries(recoveries_before, request_recoveries(cluster["decode"].metrics()),
                                        loop.results)
    print(f"request recoveries (cause, outcome): {reruns}")
    assert any(r["status"] != 200 for r in during), "no request was bound to the silent pair"
    assert sum(r["status"] == 200 for r in during) >= 2 * CLIENTS, "the other prefill did not carry the load"
    for role, seconds in detected.items():
        assert seconds <= DETECT_BOUND, (role, seconds)
    for role, seconds in recovered.items():
        assert seconds <= bounds[role], (role, seconds, bounds[role])
    assert all(r["status"] == 200 for r in loop.results if r["t"] - r["latency"] >= t_back), loop.summary()
    assert_idle(cluster, ROLES, baseline)
    # the silent pair counted the loss and the recovery once each; the first prefill lost nobody
    assert delta(losses, _counts(cluster, PEER_LOSSES)) == {"prefill2": 1, "decode": 1}
    wait_until(lambda: delta(recoveries, _counts(cluster, PEER_RECOVERIES)) == {"prefill2": 1, "decode": 1}, 10,
               "both recoveries counted", on_timeout=lambda: str(delta(recoveries, _counts(cluster, PEER_RECOVERIES))))
    moved = delta(causes, _causes(cluster))
    assert any(cause == "peer_failure" for (_, _, cause, _) in moved), moved
    assert not any(server == "prefill" for (server, _, _, _) in moved), moved  # nothing ended on the first prefill

