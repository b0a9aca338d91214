"""The fork's guarantees with tensor parallelism: prefill and decode at TP=2 (two scheduler ranks each, gloo,
mooncake per rank) behind the Rust gateway, and prefill TP=2 with decode TP=1 (upstream's head-sliced transfer).

Every decision that changes which collectives a rank calls is taken once for all ranks
(managers/fork_core/rank_agreement.py); a rank that called a different collective would hang its server, which
the deployments' short gloo timeout (testing.pd_cluster.TEST_GLOO_TIMEOUT_S) turns into a failed test. Every
answer is judged; "nothing held" covers every rank (the resource report's `other_ranks`).

float32 on both sides and on the control server (TP=1, no PD): greedy completions then do not depend on the
order of the ranks' partial sums (see test_pause_greedy_e2e.py on bf16 ties).
"""

from __future__ import annotations

import threading
import time

import pytest

from conftest import FP32
from testing import pd_checks
from testing.pd_checks import PD_ROLES, ClosedLoop, assert_idle
from testing.pd_cluster import (PDCluster, SingleServer, generate, generate_concurrently, http_get, http_post_json,
                                prompts, wait_until)

pytestmark = [pytest.mark.e2e, pytest.mark.tp]

MAX_NEW = 16
CALL_TIMEOUT_S = 120.0
ANSWER_BOUND_S = 30.0  # on 2 cores shared by 4 scheduler ranks, a gateway and the control (measured: < 10 s)


@pytest.fixture(scope="module")
def tp_deployment(deployments, tiny_model):
    cluster = PDCluster(str(tiny_model), balancer="router", tp=2, prefill_args=FP32, decode_args=FP32)
    single = SingleServer(str(tiny_model), args=FP32)
    deployments._start(cluster, single)
    return cluster, single


@pytest.fixture(scope="module")
def reference(tp_deployment):
    single = tp_deployment[1]
    texts = prompts(64)  # ClosedLoop's prompts
    out = generate_concurrently(single.url, texts, max_new_tokens=MAX_NEW)
    assert all(r["status"] == 200 for r in out), out
    return {t: r["output_ids"] for t, r in zip(texts, out)}


def _other_ranks_reported(cluster):
    for role in PD_ROLES:
        others = cluster.resources(role)["other_ranks"]
        assert others is not None and len(others) == 1, (role, others)


def test_completions_at_tp2_equal_the_control_and_every_rank_is_idle(tp_deployment, reference):
    cluster, _ = tp_deployment
    _other_ranks_reported(cluster)
    texts = list(reference)[:16]
    out = generate_concurrently(cluster.url, texts, max_new_tokens=MAX_NEW, timeout=CALL_TIMEOUT_S)
    wrong = [(t, r["status"], r["output_ids"]) for t, r in zip(texts, out)
             if r["status"] != 200 or r["output_ids"] != reference[t]]
    assert not wrong, wrong
    assert_idle(cluster, PD_ROLES)


def test_aborts_of_half_the_requests_in_flight_at_tp2_are_abort_answers(tp_deployment, reference):
    """Half of 16 requests in flight aborted by rid on both servers (as the gateway's client would): each an
    abort answer naming the client, the others their completions; every rank idle after; serving continues."""
    cluster, _ = tp_deployment
    texts = list(reference)[:16]
    results = {}

    def one(i):
        results[i] = generate(cluster.url, texts[i], 200, timeout=CALL_TIMEOUT_S, rid=f"tp2-abort-{i}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(texts))]
    for t in threads:
        t.start()
    wait_until(lambda: sum(cluster.resources("decode")["queues"].values()) >= 4 or len(results) == len(texts),
               60, "requests in flight on decode")
    for i in range(0, len(texts), 2):
        for role in PD_ROLES:
            status, body = http_post_json(f"{cluster[role].url}/abort_request", {"rid": f"tp2-abort-{i}"},
                                          timeout=CALL_TIMEOUT_S)
            assert status == 200, (role, status, body)
    for t in threads:
        t.join(CALL_TIMEOUT_S)
        assert not t.is_alive()
    bad = []
    for i, r in sorted(results.items()):
        finish = (r["meta"] or {}).get("finish_reason") or {}
        if r["status"] != 200:
            bad.append((i, r["status"], str(r["error"])[:200]))
        elif i % 2 and finish.get("type") != "length":
            bad.append((i, "not aborted, not completed", finish))
        elif not i % 2 and finish.get("type") not in ("abort", "length"):
            bad.append((i, "aborted", finish))
        elif finish.get("type") == "abort" and not pd_checks.is_client_abort(finish):
            bad.append((i, "abort answer", finish))
    assert not bad, bad
    assert any(((results[i]["meta"] or {}).get("finish_reason") or {}).get("type") == "abort"
               for i in range(0, len(texts), 2)), "no request was still running at its abort"
    assert_idle(cluster, PD_ROLES)
    out = generate_concurrently(cluster.url, texts[:4], max_new_tokens=MAX_NEW, timeout=CALL_TIMEOUT_S)
    assert [r["output_ids"] for r in out] == [reference[t] for t in texts[:4]]


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_update_continue_cycles_at_tp2_under_load(tp_deployment, tiny_model, reference, mode):
    """pause (mode) -> update_weights_from_disk (the same checkpoint) -> continue, on prefill then decode, 4 times,
    while 6 clients run: every answer a completion of the control or upstream's abort answer, none an error, none
    slower than ANSWER_BOUND_S; every rank idle after."""
    cluster, _ = tp_deployment
    baseline = assert_idle(cluster, PD_ROLES)
    loop = ClosedLoop(cluster.url, 6, max_new_tokens=MAX_NEW, timeout=CALL_TIMEOUT_S).start()
    refused, calls = [], []  # calls: (seconds, cycle, role, path, wall-clock start) of each call, for a slow answer
    try:
        for cycle in range(4):
            done = loop.completed()
            wait_until(lambda: loop.completed() >= done + 3, 120, f"completions before cycle {cycle}")
            for path, payload in (("pause_generation", {"mode": mode}),
                                  ("update_weights_from_disk", {"model_path": str(tiny_model),
                                                                "flush_cache": mode == "abort"}),
                                  ("continue_generation", {})):
                for role in PD_ROLES:
                    started, at = time.monotonic(), time.strftime("%H:%M:%S")
                    status, body = http_post_json(f"{cluster[role].url}/{path}", payload, timeout=CALL_TIMEOUT_S)
                    calls.append((round(time.monotonic() - started, 2), cycle, role, path, at))
                    if status != 200 or (isinstance(body, dict) and body.get("success") is False):
                        refused.append((cycle, role, path, status, body))
        done = loop.completed()
        wait_until(lambda: loop.completed() >= done + 6, 120, "completions after the last cycle")
    finally:
        loop.stop()
        for role in PD_ROLES:
            http_post_json(f"{cluster[role].url}/continue_generation", {}, timeout=CALL_TIMEOUT_S)
    assert not refused, refused
    bad = []
    for r in loop.results:
        finish = (r["meta"] or {}).get("finish_reason") or {}
        if r["status"] == 200 and finish.get("type") == "abort" and finish.get("status_code") is None:
            continue
        if r["status"] == 200 and finish.get("type") in ("length", "stop") and r["output_ids"] == reference[
                r["prompt"]]:
            continue
        bad.append((r["status"], finish, str(r["error"])[:200]))
    assert not bad, bad[:5]
    slow = sorted(round(r["latency"], 1) for r in loop.results if r["latency"] > ANSWER_BOUND_S)
    assert not slow, (slow, "slowest calls:", sorted(calls, reverse=True)[:4])
    assert_idle(cluster, PD_ROLES, baseline=baseline)


def test_release_and_resume_without_a_pause_at_tp2(tp_deployment, reference):
    """The colocated loop's offload/onload at TP=2: flush, release {}, resume ["weights"], resume ["kv_cache"]."""
    cluster, _ = tp_deployment
    for body, path in (({}, "release_memory_occupation"), ({"tags": ["weights"]}, "resume_memory_occupation"),
                       ({"tags": ["kv_cache"]}, "resume_memory_occupation")):
        for role in PD_ROLES:
            if path == "release_memory_occupation":  # the framework's flush, polled until 200
                wait_until(lambda: http_get(f"{cluster[role].url}/flush_cache", timeout=30)[0] == 200, 30,
                           "flush 200", interval=1.0)
            status, reply = http_post_json(f"{cluster[role].url}/{path}", body, timeout=CALL_TIMEOUT_S)
            assert status == 200, (role, path, status, reply)
    texts = list(reference)[:6]
    out = generate_concurrently(cluster.url, texts, max_new_tokens=MAX_NEW, timeout=CALL_TIMEOUT_S)
    assert [r["output_ids"] for r in out] == [reference[t] for t in texts]
    assert_idle(cluster, PD_ROLES)


@pytest.fixture(scope="module")
def sliced_deployment(deployments, tiny_model, tp_deployment):
    """Prefill TP=2, decode TP=1: each decode rank receives head slices from both prefill ranks."""
    cluster = PDCluster(str(tiny_model), balancer="router", tp=2, decode_tp=1, prefill_args=FP32,
                        decode_args=FP32)
    deployments._start(cluster)
    return cluster


def test_head_sliced_transfer_prefill_tp2_decode_tp1(sliced_deployment, reference):
    texts = list(reference)[:16]
    out = generate_concurrently(sliced_deployment.url, texts, max_new_tokens=MAX_NEW, timeout=CALL_TIMEOUT_S)
    wrong = [(t, r["status"]) for t, r in zip(texts, out) if r["status"] != 200 or r["output_ids"] != reference[t]]
    assert not wrong, wrong
    assert_idle(sliced_deployment, PD_ROLES)
