"""Real CPU servers (1P1D behind the mini load balancer, mooncake over TCP, float32, greedy): a KV chunk write that
fails on prefill (prefill alive) before decode's first token is recovered: decode's tokenizer re-runs the request
under a new bootstrap room (docs/recovery.md). The client gets 200 with the calm control's text, a stream has exactly
one finish and no abort or error event, `meta_info` says it was recovered, both servers are idle after and keep
serving. A fault on every attempt is answered as without recovery: 500 naming the chunk, within the budget.

Stock upstream 0.5.23 (and the fork with SGLANG_FORK_RECOVERY_ATTEMPTS=0): the failed request answers 500 naming the
failed KV chunk (non-streaming), a stream ends with finish_reason abort carrying the 500 (measured: 6 of 6 streams).
The fault switch's `+first` fires on a request's first attempt only."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from testing.pd_checks import PD_ROLES, assert_idle
from testing.pd_cluster import generate, prompts

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 12
RELEASE_ENV = {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "3"}
FAULTS = "kv+first:rid=rec-once-,kv:rid=rec-always-"
BUDGET_S = 20.0
RECOVERY_ENV = {"SGLANG_FORK_RECOVERY_ATTEMPTS": "1", "SGLANG_FORK_RECOVERY_BUDGET": str(BUDGET_S)}
CHUNK_REASON = "Failed to send kv chunk"
# a recovered request: its failed attempt (a scheduler tick or two on each side) plus a calm one, generously
RECOVERED_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def deployment(deployments, shared_single):
    cluster, single = deployments.pd_and_single(
        shared_single, prefill_env={"SGLANG_TEST_DISAGG_FAIL_CHUNKS": FAULTS, **RELEASE_ENV},
        decode_env={**RELEASE_ENV, **RECOVERY_ENV})
    try:
        yield cluster, single
    finally:
        deployments.discard(cluster)


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
