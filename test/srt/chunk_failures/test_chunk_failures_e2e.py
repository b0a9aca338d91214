"""Real CPU servers (1P1D through the mini load balancer, mooncake over TCP): a failed KV or
aux chunk write of one request among 16 concurrent ends that request 500 on both sides,
naming the failed write; the other 15 answer token-identical to a plain server; both
servers give everything back and keep serving; the failures are counted by kind and,
once per side, as a "transport" end. The failing request is answered about when the
batch it was part of is (not after some timeout).

The fault switch (SGLANG_TEST_DISAGG_FAIL_CHUNKS on prefill) picks the request by rid
prefix: the mini load balancer draws bootstrap rooms itself, rids pass through.
"""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from conftest import FP32, TP2, TP2_DECODE_TP1, topology_params
from testing.pd_checks import (PD_ROLES, PEER_LOSSES, PEER_RECOVERIES, Leg, assert_idle, cluster_end_causes, leg_body,
                               wait_end_causes)
from testing.pd_cluster import PDCluster, SingleServer, generate, generate_concurrently, metric_sum, prompts, wait_until

pytestmark = pytest.mark.e2e

N = 16
FAILING = 5
MAX_NEW_TOKENS = 16
# Decode holds a failed room's pages until prefill acks a drain or this deadline passes
# (upstream's deferred release, 30 s by default); prefill forgets the room's poison mark
# after the same time (poison_expiry.after_poison).
RELEASE_ENV = {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "3"}
FAULTS = "kv:rid=e2e-fail-kv-,aux:rid=e2e-fail-aux-"
# upstream's failed-session probe loop, fast enough for a test (defaults: 30 s / 300 s)
PROBE_ENV = {
    "SGLANG_FAILED_SESSION_PROBE_INTERVAL_S": "0.5",
    "SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S": "1",
}
# A write to a frozen peer fails on mooncake's own timeout (30 s); a probe of it gets
# no answer within chunk_failures' bound (SGLANG_FORK_SESSION_PROBE_TIMEOUT, 5 s).
FROZEN_PEER_S = 75.0
PROBE_BOUND_S = 5.0
# prefill's peer monitor: a session still blacklisted a heartbeat later is a lost decode
HEARTBEAT_S = 2.0
HEARTBEAT_ENV = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": str(HEARTBEAT_S)}
REASON = {"kv": "Failed to send kv chunk", "aux": "Failed to send aux data"}
BURST_DEADLINE_S = 90.0
# The failed request ends when its failed write is seen (the transfer worker's next
# status poll, then a scheduler tick on each side): no later than the slowest request
# of its batch plus a few ticks, generously (an idle CPU scheduler sleeps ~1 s a tick).
FAILED_AFTER_BATCH_S = 5.0
FAILED_REQS = "sglang:num_transfer_failed_reqs_total"
CHUNK_FAILURES = "sglang:pd_transfer_chunk_failures_total"


@pytest.fixture(scope="module", params=topology_params(TP2, TP2_DECODE_TP1))
def deployment(deployments, shared_single, request):
    """(1P1D behind the mini LB, a plain control server): TP=1 beside the shared control; multi-rank
    (TP 2 on both servers, or prefill TP 2 with decode TP 1) beside its own float32 control.
    The fault switch fails the write on every prefill rank."""
    env = dict(prefill_env={"SGLANG_TEST_DISAGG_FAIL_CHUNKS": FAULTS, **RELEASE_ENV, **PROBE_ENV, **HEARTBEAT_ENV},
               decode_env=RELEASE_ENV)
    if not request.param.multi_rank:
        cluster, single = deployments.pd_and_single(shared_single, **env)
        try:
            yield cluster, single
        finally:
            deployments.discard(cluster)
        return
    cluster = PDCluster(deployments.model, **request.param.pd_kwargs(**env))
    single = SingleServer(deployments.model, args=FP32)
    with deployments.scoped(cluster, single):
        yield cluster, single


def _chunk_failures(cluster, role, kind):
    return metric_sum(cluster.metrics(role), CHUNK_FAILURES, kind=kind, role=role)


def _counters(cluster, kind):
    return {
        role: (metric_sum(cluster.metrics(role), FAILED_REQS), _chunk_failures(cluster, role, kind))
        for role in PD_ROLES
    }


def _assert_counted_on_every_rank(cluster, before, after):
    """One failed request, counted by every rank of each side (upstream counts a failed transfer on each
    rank's scheduler); one failed chunk write per prefill rank that attempted it (the fault switch fails the
    write on every prefill rank, each writing its own heads; a rank that hears of the failed room first
    writes nothing), and as many on decode. At TP=1: 1 and 1. The end cause is counted once
    (wait_end_causes)."""
    for role in PD_ROLES:
        ranks = cluster.tp[role]
        assert after[role][0] - before[role][0] == ranks, (role, before, after)
        assert 1 <= after[role][1] - before[role][1] <= cluster.tp["prefill"], (role, before, after)


def _assert_serving_continues(cluster, baseline, requests, expected_ids=None):
    """After a failure: each request ((rid or None, text), one at a time) answers 200 --
    with these output ids when given -- and both servers are back to `baseline`."""
    results = []
    for rid, text in requests:
        extra = {"rid": rid} if rid is not None else {}
        results.append(generate(cluster.url, text, max_new_tokens=MAX_NEW_TOKENS, **extra))
    assert [r["status"] for r in results] == [200] * len(results), results
    if expected_ids is not None:
        assert [r["output_ids"] for r in results] == expected_ids
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)


@pytest.mark.parametrize("kind", ["kv", "aux"])
def test_one_failed_chunk_among_16_fails_only_that_request(deployment, kind):
    cluster, single = deployment
    baseline = assert_idle(cluster, PD_ROLES)
    before = _counters(cluster, kind)
    causes = cluster_end_causes(cluster)
    texts = prompts(N)
    reference = generate_concurrently(single.url, texts, max_new_tokens=MAX_NEW_TOKENS)
    assert all(r["status"] == 200 for r in reference)

    results = [None] * N

    def run(i):
        rid = f"e2e-fail-{kind}-{i}" if i == FAILING else f"e2e-ok-{kind}-{i}"
        results[i] = generate(cluster.url, texts[i], max_new_tokens=MAX_NEW_TOKENS, rid=rid)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BURST_DEADLINE_S + 30)

    bad = results[FAILING]
    assert bad["status"] == 500, bad
    assert REASON[kind] in str(bad["error"]), bad
    for i, (pd, ref) in enumerate(zip(results, reference)):
        if i == FAILING:
            continue
        assert pd["status"] == 200, (i, pd)
        assert pd["output_ids"] == ref["output_ids"], (i, pd["output_ids"], ref["output_ids"])
        assert pd["latency"] < BURST_DEADLINE_S
    slowest = max(r["latency"] for i, r in enumerate(results) if i != FAILING)
    assert bad["latency"] <= slowest + FAILED_AFTER_BATCH_S, (bad["latency"], slowest)

    # both servers give everything back (decode the failed room's pages after its
    # release deadline; prefill its poison mark after the same time)
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)

    _assert_counted_on_every_rank(cluster, before, _counters(cluster, kind))
    # ended once on each side, as a transport failure, where the KV was in flight
    wait_end_causes(cluster, causes, {
        ("prefill", "transport", "prefill_inflight"): 1,
        ("decode", "transport", "decode_transfer"): 1,
    })

    # still serving, and the decode session was not taken out
    _assert_serving_continues(cluster, baseline, [(f"e2e-again-{kind}", texts[FAILING])],
                              expected_ids=[reference[FAILING]["output_ids"]])
    wait_end_causes(cluster, causes, {
        ("prefill", "transport", "prefill_inflight"): 1,
        ("decode", "transport", "decode_transfer"): 1,
    })  # the request after ended nothing


def test_failed_write_to_a_frozen_decode_takes_its_session_out_until_it_answers(deployment):
    """A real failed write (the transfer worker's own failure path, not a stand-in
    nomination) to a frozen decode: the request ends 500 naming the write on both
    sides, the session is probed, gets no answer within the probe's bound and is
    blacklisted; a heartbeat later the decode is declared lost (still frozen) but its
    identity is kept. Once decode runs again -- resumed, not restarted -- it answers,
    is let back in and requests flow again, the first one included (mooncake drops its
    connections to the frozen peer and fails the first transfer to it after that: the
    probe's read must take that failure, not a request)."""
    cluster, _ = deployment
    prefill, decode = cluster["prefill"], cluster["decode"]
    baseline = assert_idle(cluster, PD_ROLES)
    assert prefill.resources()["peers"]["failed_sessions"] == 0
    before = _counters(cluster, "kv")
    causes = cluster_end_causes(cluster)
    losses = metric_sum(cluster.metrics("prefill"), PEER_LOSSES)
    recoveries = metric_sum(cluster.metrics("prefill"), PEER_RECOVERIES)
    body = leg_body(cluster, random.randint(1, 2**62), "the quick brown fox " * 10,
                    rid="e2e-fail-kv-frozen-decode")
    decode_leg = Leg(decode.url, body, timeout=FROZEN_PEER_S + 120)
    decode_leg.start()
    wait_until(lambda: decode.resources()["queues"]["decode_transfer"] == 1, 60, "decode handshake")
    decode.freeze()
    try:
        prefill_leg = Leg(prefill.url, body, timeout=FROZEN_PEER_S + 60)
        prefill_leg.start()
        wait_until(prefill_leg.done, FROZEN_PEER_S, "prefill's answer")
        assert prefill_leg.status == 500, prefill_leg.out
        assert REASON["kv"] in json.dumps(prefill_leg.response), prefill_leg.out
        # the worker nominated decode's session; the probe gets no answer within its
        # bound (not mooncake's 60 s): out
        t_answer = time.monotonic()
        wait_until(lambda: prefill.resources()["peers"]["failed_sessions"] == 1, PROBE_BOUND_S + 10,
                   "the frozen decode's session to be blacklisted",
                   on_timeout=lambda: str(prefill.resources()["peers"]))
        assert time.monotonic() - t_answer <= PROBE_BOUND_S + 5
        # still out at the next heartbeat: the decode is declared lost, once per prefill rank, while frozen;
        # its registration is kept and its session held out
        # (each prefill rank's monitor watches its own session to the decode: each declares it lost)
        ranks = cluster.tp["prefill"]
        wait_until(lambda: metric_sum(cluster.metrics("prefill"), PEER_LOSSES) == losses + ranks, 2 * HEARTBEAT_S + 10,
                   "the frozen decode to be declared lost", on_timeout=lambda: str(prefill.resources()["peers"]))
        peers = prefill.resources()["peers"]
        assert (peers["decode_kv_args_table"], peers["failed_sessions"], peers["monitor_held_out"]) == (1, 1, 1), peers
        assert_idle(cluster, ("prefill",), baseline, timeout=30)
    finally:
        decode.resume()
    t_resume = time.monotonic()
    wait_until(decode_leg.done, 30, "decode's answer after resume")
    assert decode_leg.status == 500 and REASON["kv"] in json.dumps(decode_leg.response), decode_leg.out
    # decode answers again: its session is let back in and the recovery counted, once per prefill rank
    wait_until(lambda: prefill.resources()["peers"]["failed_sessions"] == 0, 15, "the session back")
    assert time.monotonic() - t_resume < 15
    wait_until(lambda: metric_sum(cluster.metrics("prefill"), PEER_RECOVERIES) == recoveries + ranks, 10,
               "the recovery to be counted")
    assert metric_sum(cluster.metrics("prefill"), PEER_LOSSES) == losses + ranks
    assert prefill.resources()["peers"]["monitor_held_out"] == 0
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    _assert_counted_on_every_rank(cluster, before, _counters(cluster, "kv"))
    wait_end_causes(cluster, causes, {
        ("prefill", "transport", "prefill_inflight"): 1,
        ("decode", "transport", "decode_transfer"): 1,
    })
    # served again by the same (resumed) decode: 200s, nothing more ended
    _assert_serving_continues(cluster, baseline, [(None, p) for p in prompts(3)])
    wait_end_causes(cluster, causes, {
        ("prefill", "transport", "prefill_inflight"): 1,
        ("decode", "transport", "decode_transfer"): 1,
    })
