"""Real CPU servers (1P1D, mooncake over TCP, greedy; TP 1 in `make test`, TP 2 float32 in `make test-tp`), behind
the mini load balancer and behind the Rust gateway (sglang-router 0.3.2, its defaults, the engines registered with
POST /workers): a KV chunk write that fails on prefill (prefill alive) before decode's first token is recovered:
decode's tokenizer re-runs the request under a new bootstrap room, and prefill answers its leg of the failed room as
an abort handed to that recovery (docs/recovery.md). The client gets 200 with the calm control's text, a stream has
exactly one finish and no abort or error event, `meta_info` says it was recovered, the gateway neither retries nor
charges a circuit, both servers are idle after (every rank) and keep serving. A fault on every attempt is answered as
without recovery: 500 naming the chunk, once, within the budget.

Stock upstream 0.5.23 (and the fork with SGLANG_FORK_RECOVERY_ATTEMPTS=0): the failed request answers 500 naming the
failed KV chunk (non-streaming), a stream ends with finish_reason abort carrying the 500 (measured: 6 of 6 streams);
behind the gateway a non-streaming one is retried on a new room (5 attempts, both circuits charged each time).
The fault switch's `+first` fires on a request's first attempt only."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from conftest import FP32, TP2, topology_params
from testing.pd_checks import PD_ROLES, assert_idle, cluster_end_causes, wait_end_causes
from testing.pd_cluster import Gateway, PDCluster, SingleServer, generate, metric_sum, prompts

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 12
RELEASE_ENV = {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "3"}
FAULTS = "kv+first:rid=rec-once-,kv:rid=rec-always-"
BUDGET_S = 20.0
RECOVERY_ENV = {"SGLANG_FORK_RECOVERY_ATTEMPTS": "1", "SGLANG_FORK_RECOVERY_BUDGET": str(BUDGET_S)}
CHUNK_REASON = "Failed to send kv chunk"
# a recovered request: its failed attempt (a scheduler tick or two on each side) plus a calm one, generously
RECOVERED_WITHIN_S = 30.0


# the gateway's own retries (sglang-router 0.3.2 defaults: 5 attempts in all, 50-169 ms apart)
GATEWAY_ATTEMPTS = 5
# prefill counts the failed room's request as before (the verdict's row tags it transport), once: no gateway retry
PREFILL_FAILED_ONCE = {("prefill", "transport", "prefill_inflight"): 1}
# Recovery is one knob for both servers: decode re-runs the request, prefill answers its leg as handed over.
ENVS = {"prefill_env": {"SGLANG_TEST_DISAGG_FAIL_CHUNKS": FAULTS, **RELEASE_ENV, **RECOVERY_ENV},
        "decode_env": {**RELEASE_ENV, **RECOVERY_ENV}}


@pytest.fixture(scope="module", params=topology_params(TP2))
def deployment(deployments, shared_single, request):
    """(the 1P1D behind its mini LB, a plain control server): TP 1 beside the shared control; TP 2 on both servers
    (float32) beside its own float32 control (`make test-tp`)."""
    if request.param.multi_rank:
        cluster = PDCluster(deployments.model, **request.param.pd_kwargs(**ENVS))
        single = SingleServer(deployments.model, args=FP32)
        with deployments.scoped(cluster, single):
            yield cluster, single
        return
    cluster, single = deployments.pd_and_single(shared_single, **ENVS)
    try:
        yield cluster, single
    finally:
        deployments.discard(cluster)


@pytest.fixture(scope="module")
def gateway(deployment):
    """The Rust gateway (its defaults: retries, circuit breaker) in front of the same engines, each registered with
    POST /workers."""
    with Gateway.fronting(deployment[0]) as gw:
        yield gw


def _charged(gateway):
    """(retries made, retries exhausted, failures charged to each engine's circuit) as the gateway counts them."""
    metrics = gateway.metrics()
    return (metric_sum(metrics, "smg_worker_retries_total"), metric_sum(metrics, "smg_worker_retries_exhausted_total"),
            gateway.failures(metrics))


def _stream(url: str, payload: dict, timeout: float = 60.0):
    req = urllib.request.Request(url + "/generate", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _events(body: str):
    """The stream's data events (JSON), and whether it ended with [DONE]."""
    data = [line[len("data:"):].strip() for line in body.splitlines() if line.startswith("data:")]
    done = bool(data) and data[-1] == "[DONE]"
    return [json.loads(d) for d in data if d != "[DONE]"], done


def _calm(single, text):
    calm = generate(single.url, text, max_new_tokens=MAX_NEW_TOKENS)
    assert calm["status"] == 200, calm
    return calm


def _timed(cluster, text, rid):
    """(the PD deployment's answer to `text` under `rid`, the seconds it took)."""
    t0 = time.monotonic()
    got = generate(cluster.url, text, max_new_tokens=MAX_NEW_TOKENS, rid=rid)
    return got, time.monotonic() - t0


def test_a_failed_kv_write_before_the_first_token_is_recovered_non_streaming(deployment):
    cluster, single = deployment
    baseline = assert_idle(cluster, PD_ROLES)
    text = prompts(3)[1]
    calm = _calm(single, text)
    got, took = _timed(cluster, text, "rec-once-ns-1")
    assert got["status"] == 200, got
    assert got["text"] == calm["text"] and got["output_ids"] == calm["output_ids"], (got, calm)
    assert got["meta"]["recovery"] == {"attempts": 1, "cause": "chunk_failure"}, got["meta"]
    assert took < RECOVERED_WITHIN_S, took
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    again = generate(cluster.url, text, max_new_tokens=MAX_NEW_TOKENS, rid="calm-after-ns")
    assert again["status"] == 200 and again["text"] == calm["text"] and "recovery" not in again["meta"], again


def test_a_failed_kv_write_before_the_first_token_is_recovered_streaming(deployment):
    cluster, single = deployment
    baseline = assert_idle(cluster, PD_ROLES)
    text = prompts(4)[2]
    calm = _calm(single, text)
    payload = {"text": text, "rid": "rec-once-s-1", "stream": True,
               "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}}
    t0 = time.monotonic()
    status, body = _stream(cluster.url, payload)
    took = time.monotonic() - t0
    assert status == 200, body
    events, done = _events(body)
    assert done, body
    finishes = [e["meta_info"]["finish_reason"] for e in events if e["meta_info"].get("finish_reason")]
    assert len(finishes) == 1 and finishes[0]["type"] != "abort", finishes
    assert not any("error" in e for e in events), body
    assert events[-1]["text"] == calm["text"], (events[-1], calm)  # /generate streams the text so far
    assert events[-1]["meta_info"]["recovery"] == {"attempts": 1, "cause": "chunk_failure"}
    assert took < RECOVERED_WITHIN_S, took
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)


def test_a_fault_on_every_attempt_answers_the_failure_once_within_the_budget(deployment):
    cluster, single = deployment
    baseline = assert_idle(cluster, PD_ROLES)
    text = prompts(5)[3]
    calm = _calm(single, text)
    got, took = _timed(cluster, text, "rec-always-ns-1")
    assert got["status"] == 500 and CHUNK_REASON in str(got["error"]), got
    assert took < BUDGET_S + 10, took
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    again = generate(cluster.url, text, max_new_tokens=MAX_NEW_TOKENS, rid="calm-after-always")
    assert again["status"] == 200 and again["text"] == calm["text"], again


# ----------------------------------------------------------------------------- behind the Rust gateway
#
# sglang-router 0.3.2 (docs/gateway.md) sends the same request to both servers and waits for both; it keeps decode's
# body only if prefill's leg answers 2xx, else it answers prefill's status and retries a 5xx on a new room, charging
# both circuits. A stream's prefill leg answers its 200 before any output (its failure rides inside its own stream,
# which the gateway reads and drops), so only a non-streaming request ever saw prefill's 500.


def test_behind_the_gateway_a_recovered_request_answers_decode_s_text_non_streaming(deployment, gateway):
    """Prefill's leg of the failed room answers 200, finish_reason abort handed to decode's recovery (no longer the
    chunk's 500), so the gateway keeps decode's recovered body: one answer, no retry, no failure charged.
    The fork before prefill handed the room over: prefill's leg answered 500, the gateway answered "Prefill server
    error (500 ...)" or retried on a new room (where the first-attempt fault fired again), charging both circuits.
    Stock upstream 0.5.23: no recovery; the gateway retries the 500 (5 attempts, both circuits charged each)."""
    cluster, single = deployment
    baseline = assert_idle(cluster, PD_ROLES)
    text = prompts(6)[4]
    calm = _calm(single, text)
    before, ended = _charged(gateway), cluster_end_causes(cluster, ("prefill",))
    got, took = _timed(gateway, text, "rec-once-gw-ns-1")
    assert got["status"] == 200, got
    assert got["text"] == calm["text"] and got["output_ids"] == calm["output_ids"], (got, calm)
    assert got["meta"]["recovery"] == {"attempts": 1, "cause": "chunk_failure"}, got["meta"]
    assert took < RECOVERED_WITHIN_S, took
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    wait_end_causes(cluster, ended, PREFILL_FAILED_ONCE, roles=("prefill",))
    again = generate(gateway.url, text, max_new_tokens=MAX_NEW_TOKENS, rid="calm-after-gw-ns")
    assert again["status"] == 200 and again["text"] == calm["text"] and "recovery" not in again["meta"], again
    assert _charged(gateway) == before, (before, _charged(gateway))


def test_behind_the_gateway_a_recovered_stream_has_one_finish_and_no_abort(deployment, gateway):
    """The same as a stream: one stream, the calm text, exactly one finish, no abort or error event; no retry, no
    failure charged. (The gateway never saw prefill's 500 for a stream: this holds before prefill handed rooms over
    too, and guards the streamed recovery behind the gateway.)"""
    cluster, single = deployment
    baseline = assert_idle(cluster, PD_ROLES)
    text = prompts(7)[5]
    calm = _calm(single, text)
    before, ended = _charged(gateway), cluster_end_causes(cluster, ("prefill",))
    payload = {"text": text, "rid": "rec-once-gw-s-1", "stream": True,
               "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}}
    t0 = time.monotonic()
    status, body = _stream(gateway.url, payload)
    took = time.monotonic() - t0
    assert status == 200, body
    events, done = _events(body)
    assert done, body
    finishes = [e["meta_info"]["finish_reason"] for e in events if e["meta_info"].get("finish_reason")]
    assert len(finishes) == 1 and finishes[0]["type"] != "abort", finishes
    assert not any("error" in e for e in events), body
    assert events[-1]["text"] == calm["text"], (events[-1], calm)
    assert events[-1]["meta_info"]["recovery"] == {"attempts": 1, "cause": "chunk_failure"}
    assert took < RECOVERED_WITHIN_S, took
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    wait_end_causes(cluster, ended, PREFILL_FAILED_ONCE, roles=("prefill",))
    again = generate(gateway.url, text, max_new_tokens=MAX_NEW_TOKENS, rid="calm-after-gw-s")
    assert again["status"] == 200 and again["text"] == calm["text"], again
    assert _charged(gateway) == before, (before, _charged(gateway))


def test_behind_the_gateway_a_fault_on_every_attempt_answers_the_failure_once(deployment, gateway):
    """A fault on every attempt: prefill's leg of the first room answers as handed over, the recovery attempt's room
    fails too (its leg, the last attempt the knob allows, answers the chunk's 500 to decode), and decode answers the
    failure, 500 naming the chunk, as without recovery. The gateway sees decode's 500 and does what it does with any
    500 (as before recovery, and as for stock upstream's): retries it on a new room until its attempts are spent,
    charging both circuits each time; the client gets one answer, that 500 (the gateway's "decode_internal_error"
    carrying decode's message), within the budget (each attempt fails at once). Neither circuit opens (5 of the 10
    consecutive failures that open one)."""
    cluster, single = deployment
    baseline = assert_idle(cluster, PD_ROLES)
    text = prompts(8)[6]
    calm = _calm(single, text)
    _, exhausted, charged = _charged(gateway)
    got, took = _timed(gateway, text, "rec-always-gw-1")
    assert got["status"] == 500 and CHUNK_REASON in str(got["error"]), got
    assert took < 2 * BUDGET_S, took  # measured 0.6-4.6 s for the gateway's 5 attempts (TP 1, TP 2)
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    metrics = gateway.metrics()
    assert gateway.failures(metrics) == {role: n + GATEWAY_ATTEMPTS for role, n in charged.items()}, metrics
    assert metric_sum(metrics, "smg_worker_retries_exhausted_total") > exhausted, metrics
    assert gateway.circuit_opens(metrics) == {role: 0 for role in PD_ROLES}, metrics
    again = generate(gateway.url, text, max_new_tokens=MAX_NEW_TOKENS, rid="calm-after-gw-always")
    assert again["status"] == 200 and again["text"] == calm["text"], again
