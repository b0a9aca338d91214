"""Faults aimed at ONE rank of a TP=2 server (prefill and decode at TP=2, mini load balancer, float32): the ranks
still agree. Each case: one answer, with the status and end cause a TP=1 deployment gives for the same fault, within
its bound; every rank of both servers idle after (the resource report's `other_ranks`); serving continues. No hang:
a rank stuck in a collective fails after the deployment's short gloo timeout (testing.pd_cluster.TEST_GLOO_TIMEOUT_S).

- a chunk write failed on prefill rank 1 alone, or on rank 0 (the answering rank) alone: 500 naming the write (TP=1: test_chunk_failures_e2e), counted as a
  transport end on every rank of both servers (rooms ended on one rank reach the others with their reason:
  disaggregation/fork_ending/room_agreement);
- prefill rank 1's transfer worker stalled: a short stall only delays the answer (200, the same tokens); one past
  the transfer deadline is the deadline's 504 at prefill_inflight (TP=1: test_transfer_deadline_e2e), and the
  worker's late report once it runs again leaves nothing behind;
- decode's handshake arriving after prefill's deadline ended the room reaches both prefill ranks: decode is answered
  Failed (504) at once and neither prefill rank re-creates the room (TP=1: test_transfer_deadline_mooncake).

The faults come from the fault switch SGLANG_TEST_DISAGG_FAIL_CHUNKS with its rank selector (`kind@1:rid=...`).
"""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from testing.pd_checks import PD_ROLES, Leg, assert_idle, end_cause_samples, leg_body
from testing.pd_cluster import generate, metric_sum, prompts, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.tp]

FP32 = ("--dtype", "float32")
MAX_NEW = 12
DEADLINE_S = 10.0  # prefill's transfer deadline; decode's is far (its stage starts earlier: prefill's decides)
STALL_S = 3.0  # rank 1's worker reports a write this late: within the deadline
FREEZE_S = 25.0  # ... and this late: past it
FAULTS = ("kv@0:rid=tpr-fail-kv-rank0-,"
          "kv@1:rid=tpr-fail-kv-rank1-,"
          f"kv+delay={STALL_S:g}@1:rid=tpr-stall-,"
          f"kv+delay={FREEZE_S:g}@1:rid=tpr-freeze-")
# decode holds a failed room's pages until prefill acks a drain or this passes (upstream: 30 s)
RELEASE_ENV = {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "3"}
CALL_TIMEOUT_S = 120.0
# an answer within a few scheduler ticks of its cause, on 2 cores shared by 4 scheduler ranks and the balancer
TICKS_S = 8.0
CHUNK_FAILURES = "sglang:pd_transfer_chunk_failures_total"
KV_WRITE_FAILED = "Failed to send kv chunk"


@pytest.fixture(scope="module")
def cluster(deployments):
    return deployments.pd(
        tp=2,
        prefill_args=FP32, decode_args=FP32,
        prefill_env={"SGLANG_TEST_DISAGG_FAIL_CHUNKS": FAULTS,
                     "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": str(DEADLINE_S), **RELEASE_ENV},
        decode_env={"SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": "120", **RELEASE_ENV},
    )


def _causes(cluster) -> dict:
    """End-cause samples of both servers by (tp_rank, role, cause, stage): every rank counts its own."""
    out = {}
    for role in PD_ROLES:
        for labels, value in end_cause_samples(cluster.metrics(role)):
            out[(labels["tp_rank"], labels["role"], labels["cause"], labels["stage"])] = value
    return out


def _wait_causes(cluster, before: dict, ends: dict, timeout: float = 15.0) -> None:
    """Until the end-cause counter moved by `ends` {(role, cause, stage): n} on the answering rank (tp_rank 0), and
    nothing else; a rank that counts too (each rank counts its own series) must have counted the same."""
    last = {}

    def moved():
        now = _causes(cluster)
        delta = {k: now.get(k, 0) - before.get(k, 0) for k in set(now) | set(before)
                 if now.get(k, 0) != before.get(k, 0)}
        by_rank = {}
        for (rank, *key), n in delta.items():
            by_rank.setdefault(rank, {})[tuple(key)] = n
        last["by_rank"] = by_rank
        return by_rank.get("0", {}) == ends and all(d == ends for d in by_rank.values())

    wait_until(moved, timeout, "end causes on every rank", on_timeout=lambda: f"{last.get('by_rank')} != {ends}")


def _chunk_failures(cluster) -> dict:
    return {role: metric_sum(cluster.metrics(role), CHUNK_FAILURES) for role in PD_ROLES}


def _serves(cluster, baseline, text: str, output_ids: list) -> None:
    out = generate(cluster.url, text, max_new_tokens=MAX_NEW, timeout=CALL_TIMEOUT_S, rid=f"tpr-ok-{random.random()}")
    assert out["status"] == 200 and out["output_ids"] == output_ids, out
    assert_idle(cluster, PD_ROLES, baseline=baseline)


@pytest.fixture(scope="module")
def plain(cluster):
    """Each prompt's tokens from the deployment without any fault (greedy, float32)."""
    texts = prompts(4)
    out = [generate(cluster.url, t, max_new_tokens=MAX_NEW, timeout=CALL_TIMEOUT_S) for t in texts]
    assert all(r["status"] == 200 for r in out), out
    return {t: r["output_ids"] for t, r in zip(texts, out)}


@pytest.mark.parametrize("rank", [1, 0])
def test_chunk_failure_on_one_rank_alone_answers_as_at_tp1(cluster, plain, rank):
    baseline = assert_idle(cluster, PD_ROLES)
    for role in PD_ROLES:
        assert len(cluster.resources(role)["other_ranks"]) == 1, role
    before, failures = _causes(cluster), _chunk_failures(cluster)
    texts = list(plain)
    results = {}

    def run(i):
        rid = f"tpr-fail-kv-rank{rank}-0" if i == 0 else f"tpr-ok-burst-{i}"
        results[i] = generate(cluster.url, texts[i], max_new_tokens=MAX_NEW, timeout=CALL_TIMEOUT_S, rid=rid)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CALL_TIMEOUT_S + 10)
    bad = results[0]
    # the answering rank names the write that failed (on rank 1 alone, upstream: "unknown reason from another rank")
    assert bad["status"] == 500 and KV_WRITE_FAILED in str(bad["error"]), bad
    for i in range(1, len(texts)):
        assert results[i]["status"] == 200 and results[i]["output_ids"] == plain[texts[i]], (i, results[i])
    slowest = max(results[i]["latency"] for i in range(1, len(texts)))
    assert bad["latency"] <= slowest + TICKS_S, (bad["latency"], slowest)
    assert_idle(cluster, PD_ROLES, baseline=baseline)
    # as at TP=1: one transport end on each side where the KV was in flight (on every rank), one failed write
    # counted by prefill and one failed request by decode
    _wait_causes(cluster, before, {("prefill", "transport", "prefill_inflight"): 1,
                                   ("decode", "transport", "decode_transfer"): 1})
    after = _chunk_failures(cluster)
    assert {r: after[r] - failures[r] for r in PD_ROLES} == {"prefill": 1, "decode": 1}, (failures, after)
    _serves(cluster, baseline, texts[0], plain[texts[0]])


def test_stalled_transfer_on_rank_1_within_the_deadline_only_delays(cluster, plain):
    baseline = assert_idle(cluster, PD_ROLES)
    before = _causes(cluster)
    text = list(plain)[1]
    out = generate(cluster.url, text, max_new_tokens=MAX_NEW, timeout=CALL_TIMEOUT_S, rid="tpr-stall-0")
    assert out["status"] == 200 and out["output_ids"] == plain[text], out
    assert STALL_S <= out["latency"] <= STALL_S + TICKS_S + 5, out["latency"]
    assert_idle(cluster, PD_ROLES, baseline=baseline)
    _wait_causes(cluster, before, {}, timeout=3)


def test_frozen_transfer_on_rank_1_past_the_deadline_is_the_deadlines_504(cluster, plain):
    baseline = assert_idle(cluster, PD_ROLES)
    before = _causes(cluster)
    text = list(plain)[2]
    t0 = time.monotonic()
    out = generate(cluster.url, text, max_new_tokens=MAX_NEW, timeout=CALL_TIMEOUT_S, rid="tpr-freeze-0")
    # decided on rank 0's clock at prefill's inflight stage, while rank 1's worker is still stalled
    assert out["status"] == 504 and "prefill_inflight" in json.dumps(out["error"]), out
    assert DEADLINE_S <= out["latency"] <= DEADLINE_S + TICKS_S + 5, out["latency"]
    assert out["latency"] < FREEZE_S
    _wait_causes(cluster, before, {("prefill", "timeout", "prefill_inflight"): 1,
                                   ("decode", "timeout", "decode_transfer"): 1})
    # once rank 1's worker runs again its late report of the ended room leaves nothing behind on any rank
    wait_until(lambda: time.monotonic() - t0 > FREEZE_S, FREEZE_S + 5, "rank 1's transfer worker to run again")
    assert_idle(cluster, PD_ROLES, baseline=baseline)
    _serves(cluster, baseline, text, plain[text])
    _wait_causes(cluster, before, {("prefill", "timeout", "prefill_inflight"): 1,
                                   ("decode", "timeout", "decode_transfer"): 1}, timeout=3)


def test_late_handshake_reaching_rank_1_is_answered_failed_and_creates_nothing(cluster, plain):
    baseline = assert_idle(cluster, PD_ROLES)
    before = _causes(cluster)
    room = random.randint(1, 2**62)
    body = leg_body(cluster, room, list(plain)[3], max_new_tokens=MAX_NEW)
    prefill_leg = Leg(cluster["prefill"].url, body, timeout=CALL_TIMEOUT_S)
    prefill_leg.start()
    prefill_leg.join(DEADLINE_S + TICKS_S + 10)
    # decode never came: the bootstrap stage expired (rank 0's clock), on both prefill ranks
    assert prefill_leg.status == 504 and "prefill_bootstrap" in json.dumps(prefill_leg.response), prefill_leg.out
    assert DEADLINE_S <= prefill_leg.out["seconds"] <= DEADLINE_S + TICKS_S, prefill_leg.out
    assert_idle(cluster, ("prefill",), baseline=baseline)
    # now decode's leg: its rank 0 hands its pages to prefill rank 0, its rank 1 to prefill rank 1
    decode_leg = Leg(cluster["decode"].url, body, timeout=CALL_TIMEOUT_S)
    decode_leg.start()
    decode_leg.join(CALL_TIMEOUT_S)
    # told by prefill (the room's memory on every rank), not by decode's own deadline
    assert decode_leg.status == 504 and "prefill_bootstrap" in json.dumps(decode_leg.response), decode_leg.out
    assert decode_leg.out["seconds"] <= TICKS_S, decode_leg.out
    # neither prefill rank re-created the room (upstream, and rank 1 before: request_status/transfer_infos kept)
    assert_idle(cluster, PD_ROLES, baseline=baseline)
    _wait_causes(cluster, before, {("prefill", "timeout", "prefill_bootstrap"): 1,
                                   ("decode", "timeout", "decode_transfer"): 1})
    _serves(cluster, baseline, list(plain)[3], plain[list(plain)[3]])
