"""Peer crash and restart end to end: real 1P1D servers (mooncake over TCP), one
deployment for the module. A SIGKILLed peer is noticed by the survivor (a refused
connection / failed write, heartbeat 2 s), every request bound to it ends with 502
naming it, the survivor gives everything back, and the peer restarted on the same
ports is served again with outputs identical to a control run -- without touching the
survivor. Then the same peer is killed and restarted under traffic, over and over.

The tests play the load balancer for the in-flight requests (same bootstrap room to
both legs), so each leg's answer is visible; the control and recovery runs go through
the mini load balancer.
"""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from conftest import (LIVENESS_ARGS, LIVENESS_ENV, TP2, TP2_DECODE_TP1, resume_frozen, shared_env, topology_params,
                      topology_pd)
from testing.pd_checks import (
    PD_ROLES,
    PEER_LOSSES,
    PEER_RECOVERIES,
    assert_idle,
    assert_named_5xx,
    assert_serves,
    delta,
    end_causes,
    held,
    leg_body,
    lost_by_cause,
    stable_peer_tables,
    start_legs,
    wait_end_causes,
)
from testing.pd_cluster import exited, generate, metric_sum, prompts, wait_until

pytestmark = pytest.mark.e2e

HEARTBEAT = 2.0  # upstream's floor
DEADLINE = 15.0  # the fallback for what cannot be observed; well above detection
ENV = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": str(HEARTBEAT),
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
    "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": str(DEADLINE),
}
# detection (one heartbeat) + a scheduler tick, generously: a busy 2-core machine. Counted from when the
# killed peer is gone (`kill()` returned: every process of its tree exited): the kernel closes a killed
# process's sockets only in its exit, after tearing down its memory, so no survivor can see the death
# earlier. That teardown is not the fork's: a TP 2 server is two scheduler processes (and the tokenizer's,
# the detokenizer's) exiting on two loaded cores, which took from 2 to 12 s.
DETECT_BOUND = HEARTBEAT + 6.0
N_INFLIGHT = 16
N_AFTER = 20


@pytest.fixture(scope="module", params=topology_params(TP2, TP2_DECODE_TP1))
def cluster(shared_liveness, deployments, request):
    """TP=1: the shared peer-liveness 1P1D (conftest), running with ENV; multi-rank (TP 2 on both servers, or
    prefill TP 2 with decode TP 1): the module's own with the same env and args. The mini LB in front."""
    if request.param.multi_rank:
        yield from topology_pd(deployments, request.param, prefill_env=LIVENESS_ENV, decode_env=LIVENESS_ENV,
                               prefill_args=LIVENESS_ARGS, decode_args=LIVENESS_ARGS)
        return
    c = shared_liveness.deployment
    shared_env(c, PD_ROLES, ENV)
    try:
        yield c
    finally:
        resume_frozen(c)


@pytest.fixture(autouse=True)
def restart_a_killed_server(cluster):
    """A test that failed with a server killed leaves it restarted (same ports) for the next test."""
    yield
    if all(cluster[role].is_alive() for role in PD_ROLES):
        return
    for role in PD_ROLES:
        if not cluster[role].is_alive():
            cluster[role].restart()
    # one request, as a test that passed ends with: decode knows the prefill again
    assert generate(cluster.url, "restarted", max_new_tokens=1)["status"] == 200


@pytest.fixture(scope="module")
def control(cluster):
    """The 20 recovery prompts answered by the healthy deployment (greedy)."""
    results = assert_serves(cluster.url, N_AFTER)
    return [r["output_ids"] for r in results]


def _causes(server) -> dict:
    return end_causes(server.metrics())


def _before_the_fault(cluster, survivor: str) -> tuple:
    """Both servers idle (the baseline), then the survivor's per-peer tables, its loss and
    recovery counts and its end causes. Returns (baseline, peers, losses, recoveries, causes)."""
    baseline = assert_idle(cluster, PD_ROLES)
    server = cluster[survivor]
    return baseline, _peers(server), _count(server, PEER_LOSSES), _count(server, PEER_RECOVERIES), _causes(server)


def _peers(server) -> dict:
    return server.resources()["peers"]


def _count(server, name: str) -> float:
    """A counter summed over its label sets: the loss and recovery counters move once per rank of the
    survivor (each rank's monitor watches its own session to the peer)."""
    return metric_sum(server.metrics(), name)


def _recover(cluster, control, survivor: str, baseline: dict, peers_before: dict) -> None:
    """20 requests through the load balancer: all 200, outputs equal the control run;
    then both sides idle and the survivor's per-peer tables as before the crash."""
    results = assert_serves(cluster.url, N_AFTER)
    assert [r["output_ids"] for r in results] == control
    assert_idle(cluster, PD_ROLES, baseline)
    # per-peer tables as before the crash (upstream's heartbeat refills its entries
    # for a prefill within one interval)
    wait_until(lambda: stable_peer_tables(_peers(cluster[survivor])) == stable_peer_tables(peers_before), HEARTBEAT + 10,
               "per-peer tables as before", on_timeout=lambda: f"{_peers(cluster[survivor])} != {peers_before}")


def _in_flight_to_frozen_decode(cluster, label: str):
    """16 requests prefill holds in flight (KV computed, transfer started) to a frozen decode: the decode legs first
    (decode hands prefill its pages), then decode frozen, then the prefill legs. Returns (decode legs, prefill legs)."""
    prefill, decode = cluster["prefill"], cluster["decode"]
    rooms = random.sample(range(1, 2**62), N_INFLIGHT)
    texts = [f"{label} {i}: " + "the quick brown fox " * 20 for i in range(N_INFLIGHT)]
    decode_legs = start_legs(decode.url, [leg_body(cluster, r, t) for t, r in zip(texts, rooms)])
    wait_until(lambda: decode.resources()["queues"]["decode_transfer"] == N_INFLIGHT, 60, "decode handshakes")
    decode.freeze()
    prefill_legs = start_legs(prefill.url, [leg_body(cluster, r, t) for t, r in zip(texts, rooms)])
    wait_until(lambda: held(prefill.resources())["queue.prefill_inflight"] == N_INFLIGHT, 60,
               "prefill to hold all 16 requests in flight")
    return decode_legs, prefill_legs


def test_decode_killed_in_flight_then_restarted(cluster, control):
    prefill, decode = cluster["prefill"], cluster["decode"]
    baseline, peers_before, losses, recoveries, causes = _before_the_fault(cluster, "prefill")
    assert peers_before["decode_kv_args_table"] == 1, peers_before

    decode_legs, prefill_legs = _in_flight_to_frozen_decode(cluster, "in flight")
    t_kill = time.monotonic()
    decode.kill()
    t_gone = time.monotonic()
    print(f"decode killed: gone after {t_gone - t_kill:.1f}s")

    for leg in prefill_legs + decode_legs:
        leg.join(DEADLINE + 30)
    assert not [leg for leg in prefill_legs + decode_legs if leg.is_alive()], "a request hangs"
    # every prefill leg ends within detection + a tick, with a 5xx naming the lost
    # decode: 502 "decode peer ... lost", or 500 for a request whose own write was the
    # one that failed (before the loss was known)
    assert_named_5xx(prefill_legs, "decode", t_gone, DETECT_BOUND, cluster.multi_rank)
    # each prefill leg counted once, by the cause its answer names, in its stage
    expected = {("prefill", c, "prefill_inflight"): n for c, n in lost_by_cause(prefill_legs).items()}
    wait_end_causes(cluster, causes, expected, roles=("prefill",))
    # prefill gave everything back and forgot the dead incarnation, decode still down
    assert_idle(cluster, ("prefill",), baseline, timeout=10)
    def forgotten():
        p = _peers(prefill)
        return p["decode_kv_args_table"] == 0 and p["failed_sessions"] == 0 and p["session_failures"] == 0

    wait_until(forgotten, DETECT_BOUND, "prefill to forget the dead decode session", on_timeout=lambda: str(_peers(prefill)))
    assert _count(prefill, PEER_LOSSES) == losses + cluster.tp["prefill"]
    assert "decode peer 127.0.0.1:" in prefill.tail(400) and "PD peer lost" in prefill.tail(400)

    decode.start()
    decode.wait_healthy()
    _recover(cluster, control, "prefill", baseline, peers_before)
    assert _count(prefill, PEER_RECOVERIES) == recoveries + cluster.tp["prefill"]
    assert _count(prefill, PEER_LOSSES) == losses + cluster.tp["prefill"]
    assert delta(causes, _causes(prefill)) == expected  # the recovery run ended nothing


def test_decode_rank_lost_by_one_prefill_rank_alone(cluster, control):
    """TP 2: decode frozen with 16 requests in flight, then only its rank-1 scheduler killed. Decode's rank 0 still
    takes connections (a stopped process's listening socket does), so only prefill rank 1's peer monitor loses its
    peer: every prefill leg is answered as when the whole decode dies (502 naming the lost decode rank, or 500 naming
    the write that failed to it), each counted once by the cause its answer names, one loss counted (rank 1's).
    Then decode is taken down and restarted: nothing held on any prefill rank, and serving goes on."""
    if cluster.tp["decode"] < 2:
        pytest.skip("one decode rank: no rank to lose alone")
    prefill, decode = cluster["prefill"], cluster["decode"]
    baseline, peers_before, losses, recoveries, causes = _before_the_fault(cluster, "prefill")

    try:
        decode_legs, prefill_legs = _in_flight_to_frozen_decode(cluster, "rank lost")
        rank1 = decode.scheduler(1)
        rank1.kill()
        # exited (a zombie: its frozen parent does not reap it): its sockets are closed
        wait_until(lambda: exited(rank1), 30, "decode rank 1 to exit", interval=0.05)
        t_gone = time.monotonic()
        for leg in prefill_legs:
            leg.join(DEADLINE + 30)
        assert not [leg for leg in prefill_legs if leg.is_alive()], "a request hangs"
        assert_named_5xx(prefill_legs, "decode", t_gone, DETECT_BOUND, multi_rank=True)
        expected = {("prefill", c, "prefill_inflight"): n for c, n in lost_by_cause(prefill_legs).items()}
        wait_end_causes(cluster, causes, expected, roles=("prefill",))
        # prefill rank 1's monitor loses its peer (a failed write may have answered first); rank 0's does not
        wait_until(lambda: _count(prefill, PEER_LOSSES) > losses, DETECT_BOUND, "prefill rank 1 to count the loss")
        assert _count(prefill, PEER_LOSSES) == losses + 1
    finally:
        decode.kill()
    for leg in decode_legs:
        leg.join(30)
    assert not [leg for leg in decode_legs if leg.is_alive()], "a decode leg hangs"
    assert_idle(cluster, ("prefill",), baseline, timeout=DETECT_BOUND + 10)

    decode.start()
    decode.wait_healthy()
    _recover(cluster, control, "prefill", baseline, peers_before)
    assert _count(prefill, PEER_LOSSES) == losses + cluster.tp["prefill"]  # rank 0's too, when the rest of decode died
    assert _count(prefill, PEER_RECOVERIES) == recoveries + cluster.tp["prefill"]
    assert delta(causes, _causes(prefill)) == expected  # nothing else ended


def test_prefill_killed_in_flight_then_restarted(cluster, control):
    prefill, decode = cluster["prefill"], cluster["decode"]
    baseline, peers_before, losses, recoveries, causes = _before_the_fault(cluster, "decode")
    assert peers_before["prefill_info_table"] == 1, peers_before

    # decode legs only: decode preallocates, tells prefill, and waits for the KV
    rooms = random.sample(range(1, 2**62), N_INFLIGHT)
    texts = [f"waiting {i}: hello world" for i in range(N_INFLIGHT)]
    decode_legs = start_legs(decode.url, [leg_body(cluster, r, t) for t, r in zip(texts, rooms)])
    wait_until(lambda: decode.resources()["queues"]["decode_transfer"] == N_INFLIGHT, 60, "decode handshakes")
    t_kill = time.monotonic()
    prefill.kill()
    t_gone = time.monotonic()
    print(f"prefill killed: gone after {t_gone - t_kill:.1f}s")

    for leg in decode_legs:
        leg.join(DEADLINE + 30)
    assert not [leg for leg in decode_legs if leg.is_alive()], "a request hangs"
    addr = f"127.0.0.1:{cluster.bootstrap_port}"
    assert [leg.status for leg in decode_legs] == [502] * N_INFLIGHT, [leg.response for leg in decode_legs]
    assert_named_5xx(decode_legs, "prefill", t_gone, DETECT_BOUND, cluster.multi_rank)
    assert f"prefill peer {addr} lost" in json.dumps(decode_legs[0].response)
    expected = {("decode", "peer_failure", "decode_transfer"): N_INFLIGHT}
    wait_end_causes(cluster, causes, expected, roles=("decode",))
    assert_idle(cluster, ("decode",), baseline, timeout=10)
    assert _peers(decode)["prefill_info_table"] == 0
    assert _peers(decode)["connection_pool"] == 0
    assert _count(decode, PEER_LOSSES) == losses + cluster.tp["decode"]
    assert f"prefill peer {addr} lost" in decode.tail(400)

    prefill.start()
    prefill.wait_healthy()
    _recover(cluster, control, "decode", baseline, peers_before)
    assert _count(decode, PEER_RECOVERIES) == recoveries + cluster.tp["decode"]
    assert _count(decode, PEER_LOSSES) == losses + cluster.tp["decode"]
    assert delta(causes, _causes(decode)) == expected  # the recovery run ended nothing


class Traffic(threading.Thread):
    """Requests through the load balancer, 2 at a time, until stopped."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.results: list = []
        self._halt = threading.Event()

    def run(self):
        texts = prompts(8)
        lock = threading.Lock()

        def worker(k):
            i = k
            while not self._halt.is_set():
                r = generate(self.url, texts[i % len(texts)], max_new_tokens=8, timeout=DEADLINE + 60)
                with lock:
                    self.results.append(r)
                i += 2
                if r["status"] != 200:
                    # pacing, not synchronisation: while decode is down the balancer
                    # fails at once, and each failure leaves a prefill leg waiting
                    self._halt.wait(0.5)

        workers = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(2)]
        for w in workers:
            w.start()
        self._halt.wait()
        for w in workers:
            w.join(DEADLINE + 90)
        self.hung = [w for w in workers if w.is_alive()]

    def stop(self):
        self._halt.set()
        self.join(DEADLINE + 120)


KILLS = 2  # repeated: nothing accumulates on the survivor across kills (each kill ~25 s of make test; 5 took ~2.5 min more)
KILLS_MULTI_RANK = 2  # a TP=2 server takes 1-2 min to start on 2 cores


def test_decode_killed_and_restarted_repeatedly_under_traffic(cluster, control):
    prefill, decode = cluster["prefill"], cluster["decode"]
    baseline, peers_before, losses, recoveries, causes = _before_the_fault(cluster, "prefill")
    kills = KILLS_MULTI_RANK if cluster.multi_rank else KILLS
    traffic = Traffic(cluster.url)
    traffic.start()
    try:
        for k in range(kills):
            served = len(traffic.results)
            wait_until(lambda: len(traffic.results) >= served + 2, 60, f"traffic before kill {k}")
            decode.kill()
            decode.start()
            decode.wait_healthy()
            served = len(traffic.results)
            wait_until(
                lambda: any(r["status"] == 200 for r in traffic.results[served:]), 90,
                f"a request served after restart {k}",
            )
    finally:
        traffic.stop()
    assert not traffic.is_alive() and not traffic.hung, "a request hangs"
    statuses = [r["status"] for r in traffic.results]
    # every request ended: a completion, or an error (the load balancer's, while
    # decode was down); none took longer than the deadline fallback allows
    assert all(s is not None for s in statuses), statuses
    assert max(r["latency"] for r in traffic.results) <= DEADLINE + 15, sorted(r["latency"] for r in traffic.results)[-5:]
    ok = [r for r in traffic.results if r["status"] == 200]
    assert len(ok) >= 2 * kills
    # nothing accumulated on the survivor: rooms, KV, sessions, sockets
    assert_idle(cluster, PD_ROLES, baseline, timeout=DEADLINE + 30)
    assert _count(prefill, PEER_LOSSES) == losses + kills * cluster.tp["prefill"]
    assert _count(prefill, PEER_RECOVERIES) == recoveries + kills * cluster.tp["prefill"]
    # what prefill ended, it ended for the lost peer or because the load balancer gave
    # up the request when decode was down (a client abort of the prefill leg); how many
    # depends on what was in flight at each kill. None waited for the deadline fallback.
    ended = delta(causes, _causes(prefill))
    assert {cause for (_, cause, _) in ended} <= {"peer_failure", "transport", "client_abort"}, ended
    _recover(cluster, control, "prefill", baseline, peers_before)
