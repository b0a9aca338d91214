"""Recovery under skewed timing (docs/recovery.md, "A recovery's life"): real CPU servers (1P1D behind the mini load
balancer, mooncake over TCP, float32, greedy), one deployment for every case. Each request's first KV chunk write
fails on prefill (`kv+first`), decode holds the end back and re-runs it; decode's test switch
(`SGLANG_TEST_FORK_RECOVERY_FAULTS`) holds the attempt HOLD_S before it starts, so a call lands in the window where
the request is in NO scheduler (`recovery_held` in decode's resource report), or makes the attempt unable to start.

Each case asserts the answer, the time it took, `sglang:pd_request_recoveries_total{cause,outcome}`, both servers
idle after (`recovery_held` included) and serving continuing. Stock upstream 0.5.23 (no recovery) answers every one
of these requests with the failed chunk's 500 at once (non-streaming; a stream: finish_reason abort carrying the
500), before any of the calls below could reach it; where the fork's answer differs, it is the recovered text or the
call's own answer (an abort's 200 with finish_reason abort, as upstream answers an abort it reaches)."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang.srt.disaggregation.fork_ending.verdict_wording import CLIENT_ABORT_MESSAGE, PAUSE_ABORT_MESSAGE
from testing.http_client import generate, http_get, metric_sum, prompts
from testing.pd_checks import PD_ROLES, assert_idle, call
from testing.polling import wait_until

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 8
HOLD_S = 12.0  # the attempt's test hold: the window a call lands in
LEFT_WITHIN_S = 8.0  # a stream's client gone: upstream's tokenizer looks every 4 s (margin for the mini LB and this box)
BUDGET_S = 60.0
RELEASE_ENV = {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "3"}
PREFILL_ENV = {"SGLANG_TEST_DISAGG_FAIL_CHUNKS": "kv+first:rid=skew-", **RELEASE_ENV}
DECODE_ENV = {"SGLANG_FORK_RECOVERY_ATTEMPTS": "1", "SGLANG_FORK_RECOVERY_BUDGET": str(BUDGET_S),
              "SGLANG_TEST_FORK_RECOVERY_FAULTS": f"hold={HOLD_S}:rid=skew-hold-,route:rid=skew-route-",
              **RELEASE_ENV}
RECOVERIES = "sglang:pd_request_recoveries_total"
OUTCOMES = ("started", "recovered", "failed", "not_started", "weights_changed", "aborted")
CHUNK_REASON = "Failed to send kv chunk"
ANSWERED_WITHIN_S = 5.0  # an answer decided in the window: the tokenizer answers at once (margin for this box)
WINDOW_S = 30.0  # a request's first attempt failing and its end held back


@pytest.fixture(scope="module")
def deployment(deployments, shared_single):
    cluster, single = deployments.pd_and_single(shared_single, prefill_env=PREFILL_ENV, decode_env=DECODE_ENV)
    try:
        yield cluster, single
    finally:
        deployments.discard(cluster)


def _outcomes(cluster):
    metrics = cluster.metrics("decode")
    return {o: metric_sum(metrics, RECOVERIES, cause="chunk_failure", outcome=o) for o in OUTCOMES}


def _counted(cluster, before, **expected):
    """Wait until the counter moved by exactly `expected` (every other outcome unchanged)."""
    want = {o: before[o] + expected.get(o, 0) for o in OUTCOMES}
    wait_until(lambda: _outcomes(cluster) == want, 10, f"recoveries counted {expected}",
               on_timeout=lambda: f"now {_outcomes(cluster)}, want {want}")


def _in_window(cluster):
    """Wait until decode holds the request between attempts (in no scheduler)."""
    wait_until(lambda: cluster.resources("decode").get("recovery_held") == 1, WINDOW_S,
               "decode to hold the request between recovery attempts")


def _send(pool, cluster, text, rid):
    """The request in the background: a future of (its answer, the monotonic time it came)."""
    def one():
        got = generate(cluster.url, text, max_new_tokens=MAX_NEW_TOKENS, rid=rid, timeout=120)
        return got, time.monotonic()
    return pool.submit(one)


def _calm(single, text):
    calm = generate(single.url, text, max_new_tokens=MAX_NEW_TOKENS)
    assert calm["status"] == 200, calm
    return calm


def _abort_answer(got, message, recovery=None):
    """Upstream's abort answer (200, finish_reason abort, nothing generated); `recovery`: the meta_info a re-run the
    scheduler answered carries (None: the request ended between attempts, answered by the tokenizer)."""
    assert got["status"] == 200, got
    reason = got["meta"]["finish_reason"]
    assert reason["type"] == "abort" and reason["message"] == message, reason
    assert got["output_ids"] == [] and got["meta"].get("recovery") == recovery, got


def _serves(cluster, single, text, rid):
    again = generate(cluster.url, text, max_new_tokens=MAX_NEW_TOKENS, rid=rid)
    assert again["status"] == 200 and again["text"] == _calm(single, text)["text"], again


@pytest.mark.parametrize("how", ["by_rid", "abort_all"])
def test_an_abort_between_attempts_is_answered_at_once_and_nothing_is_resubmitted(deployment, how):
    """Unchanged main: the abort reaches no scheduler (the request is in none), the attempt re-submits after it and
    the client gets the recovered completion (200, finish_reason length), never the abort."""
    cluster, single = deployment
    baseline, before = assert_idle(cluster, PD_ROLES), _outcomes(cluster)
    text, rid = prompts(6)[1], f"skew-hold-abort-{how}"
    with ThreadPoolExecutor(1) as pool:
        answer = _send(pool, cluster, text, rid)
        _in_window(cluster)
        t_abort = time.monotonic()
        status, _, _ = call(cluster, "decode", "abort_request", {"rid": rid} if how == "by_rid" else {"abort_all": True})
        assert status == 200
        got, t_got = answer.result()
    _abort_answer(got, CLIENT_ABORT_MESSAGE)
    assert t_got - t_abort < ANSWERED_WITHIN_S, t_got - t_abort
    _counted(cluster, before, started=1, aborted=1)
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    _serves(cluster, single, text, f"calm-after-abort-{how}")


def _stream_then_leave(url, body, leave):
    """A stream whose client goes away once `leave()` returns (polled): nothing was streamed before."""
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/generate", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        leave()
    finally:
        conn.close()


def test_a_stream_whose_client_leaves_between_attempts_ends_there(deployment):
    """Unchanged main: the disconnect's abort reaches no scheduler; the attempt re-runs the request on both servers
    for nobody (counted recovered)."""
    cluster, single = deployment
    baseline, before = assert_idle(cluster, PD_ROLES), _outcomes(cluster)
    body = {"text": prompts(7)[2], "rid": "skew-hold-leave-1",
            "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}}
    _stream_then_leave(cluster.url, body, lambda: _in_window(cluster))
    # the disconnect is seen within upstream's 4 s wait for output; the attempt's hold would end HOLD_S after the
    # window opened: released before that, the request ended in the window (unchanged main: only the re-submission
    # after the hold releases it)
    wait_until(lambda: cluster.resources("decode")["recovery_held"] == 0, LEFT_WITHIN_S,
               "decode to end the request whose client left")
    _counted(cluster, before, started=1, aborted=1)
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    _serves(cluster, single, body["text"], "calm-after-leave")


@pytest.mark.parametrize("mode", ["abort", "in_place", "retract"])
def test_a_pause_of_decode_between_attempts_ends_the_request_as_the_pause_says(deployment, mode):
    """abort mode: the pause's abort answer at once and the pause returns at once (unchanged main: the pause's
    abort_all reaches no scheduler; the pause waits for the request until the attempt re-submits it after the hold).
    in_place / retract: the attempt waits at the pause gate (`pause_gate_held`: unchanged main re-submits into the
    paused scheduler behind the gate) and the request is served after continue."""
    cluster, single = deployment
    baseline, before = assert_idle(cluster, PD_ROLES), _outcomes(cluster)
    text, rid = prompts(8)[3], f"skew-hold-pause-{mode}"
    calm = _calm(single, text)
    with ThreadPoolExecutor(1) as pool:
        answer = _send(pool, cluster, text, rid)
        _in_window(cluster)
        t_pause = time.monotonic()
        status, reply, took = call(cluster, "decode", "pause_generation", {"mode": mode})
        assert status == 200, reply
        try:
            if mode == "abort":
                assert took < ANSWERED_WITHIN_S, took
                got, t_got = answer.result()
                _abort_answer(got, PAUSE_ABORT_MESSAGE)
                assert t_got - t_pause < ANSWERED_WITHIN_S, t_got - t_pause
            else:
                wait_until(lambda: cluster.resources("decode")["pause_gate_held"] == 1, HOLD_S + 10,
                           "the attempt to wait at decode's pause gate")
                assert not answer.done()
        finally:
            assert call(cluster, "decode", "continue_generation", {})[0] == 200
        if mode != "abort":
            got, _ = answer.result()
            assert got["status"] == 200 and got["text"] == calm["text"], got
            assert got["meta"]["recovery"] == {"attempts": 1, "cause": "chunk_failure"}, got["meta"]
    _counted(cluster, before, started=1, **({"aborted": 1} if mode == "abort" else {"recovered": 1}))
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    _serves(cluster, single, text, f"calm-after-pause-{mode}")


def test_a_pause_of_prefill_between_attempts_holds_the_resent_leg_at_its_gate_until_continue(deployment):
    """The re-sent prefill leg meets prefill's pause gate like any request: it waits there (prefill's
    `pause_gate_held`), and the request is served after continue (the same on unchanged main: no fix)."""
    cluster, single = deployment
    baseline, before = assert_idle(cluster, PD_ROLES), _outcomes(cluster)
    text, rid = prompts(9)[4], "skew-hold-prefill-pause"
    calm = _calm(single, text)
    with ThreadPoolExecutor(1) as pool:
        answer = _send(pool, cluster, text, rid)
        _in_window(cluster)
        status, reply, _ = call(cluster, "prefill", "pause_generation", {"mode": "in_place"})
        assert status == 200, reply
        try:
            wait_until(lambda: cluster.resources("prefill")["pause_gate_held"] == 1, HOLD_S + 10,
                       "the re-sent leg to wait at prefill's pause gate")
            assert not answer.done()
        finally:
            assert call(cluster, "prefill", "continue_generation", {})[0] == 200
        got, _ = answer.result()
    assert got["status"] == 200 and got["text"] == calm["text"], got
    assert got["meta"]["recovery"] == {"attempts": 1, "cause": "chunk_failure"}, got["meta"]
    _counted(cluster, before, started=1, recovered=1)
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)


def test_an_abort_while_the_attempt_runs_is_the_scheduler_s_and_leaves_no_leg_on_prefill(deployment):
    """Prefill paused: the re-sent leg waits at prefill's gate while decode's scheduler holds the re-submitted
    request; the client's abort is answered by decode's scheduler (200, finish_reason abort), and after continue the
    leg prefill lets through ends (nothing held)."""
    cluster, single = deployment
    baseline, before = assert_idle(cluster, PD_ROLES), _outcomes(cluster)
    text, rid = prompts(10)[5], "skew-hold-inflight-abort"
    with ThreadPoolExecutor(1) as pool:
        answer = _send(pool, cluster, text, rid)
        _in_window(cluster)
        assert call(cluster, "prefill", "pause_generation", {"mode": "in_place"})[0] == 200
        try:
            wait_until(lambda: cluster.resources("prefill")["pause_gate_held"] == 1, HOLD_S + 10,
                       "the re-sent leg to wait at prefill's pause gate")
            t_abort = time.monotonic()
            assert call(cluster, "decode", "abort_request", {"rid": rid})[0] == 200
            got, t_got = answer.result()
        finally:
            assert call(cluster, "prefill", "continue_generation", {})[0] == 200
    _abort_answer(got, CLIENT_ABORT_MESSAGE, recovery={"attempts": 1, "cause": "chunk_failure"})
    assert t_got - t_abort < ANSWERED_WITHIN_S, t_got - t_abort
    _counted(cluster, before, started=1, aborted=1)
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    _serves(cluster, single, text, "calm-after-inflight-abort")


def test_an_attempt_that_cannot_start_answers_the_held_back_failure_at_once(deployment):
    """Prefill's bootstrap server does not answer `/route` (the switch asks a closed port): the held-back 500 at
    once, as without recovery (stock upstream: the same 500, without the attempt)."""
    cluster, single = deployment
    baseline, before = assert_idle(cluster, PD_ROLES), _outcomes(cluster)
    text = prompts(11)[6]
    t0 = time.monotonic()
    got = generate(cluster.url, text, max_new_tokens=MAX_NEW_TOKENS, rid="skew-route-1")
    took = time.monotonic() - t0
    assert got["status"] == 500 and CHUNK_REASON in str(got["error"]), got
    assert took < ANSWERED_WITHIN_S + 5, took
    _counted(cluster, before, started=1, not_started=1)
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    _serves(cluster, single, text, "calm-after-route")


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_a_weight_version_change_between_attempts_answers_the_failure(deployment, side):
    """Recovery runs only under the weight version of the first failure, on both sides: a version updated between
    the failure and the re-run answers the held-back 500, as stock upstream answers the failure (unchanged main
    recovers the request under the new version: 200)."""
    cluster, single = deployment
    baseline, before = assert_idle(cluster, PD_ROLES), _outcomes(cluster)
    text, rid = prompts(12)[7], f"skew-hold-weights-{side}"
    status, body = http_get(f"{cluster[side].url}/get_weight_version")
    assert status == 200, body
    old = json.loads(body)["weight_version"]
    with ThreadPoolExecutor(1) as pool:
        answer = _send(pool, cluster, text, rid)
        _in_window(cluster)
        t_window = time.monotonic()
        try:
            status, reply, _ = call(cluster, side, "update_weight_version",
                                    {"new_version": f"{old}-skew", "abort_all_requests": False})
            assert status == 200, reply
            got, t_got = answer.result()
        finally:
            assert call(cluster, side, "update_weight_version",
                        {"new_version": old, "abort_all_requests": False})[0] == 200
    assert got["status"] == 500 and CHUNK_REASON in str(got["error"]), got
    assert t_got - t_window < HOLD_S + ANSWERED_WITHIN_S, t_got - t_window  # at the re-run, after the hold
    _counted(cluster, before, started=1, weights_changed=1)
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    _serves(cluster, single, text, f"calm-after-weights-{side}")
