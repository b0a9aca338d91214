"""Aborts end to end: real 1P1D servers (mooncake over TCP) + the mini load balancer.

Stages reached deterministically: the test plays the load balancer (same rid and
bootstrap room to both legs) to order the legs, and freezes decode to hold a request
inflight on prefill. Each case asserts what each leg's client got (upstream's client
abort: HTTP 200 with finish_reason "abort", no status; never 500, never a completion),
how long it took, that both servers are back to baseline (KV, slots, metadata slots,
per-room transfer state), the counters (client aborts counted by cause and stage, the
failure counters untouched), and that the deployment keeps serving. Then the soak:
2,000 requests aborted at random points at concurrency 16. One deployment for the
module; each test starts idle.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import TP2, TP2_DECODE_TP1, topology_params, topology_pd
from testing.pd_checks import PD_ROLES, Leg, assert_idle, assert_serves, end_causes, held, http_client_abort, leg_body
from testing.pd_checks import delta as _delta
from testing.pd_cluster import generate, http_post_json, metric_sum, prompts, wait_until

pytestmark = pytest.mark.e2e

FAILURE_COUNTERS = ("sglang:num_bootstrap_failed_reqs_total", "sglang:num_transfer_failed_reqs_total")
# An abort is answered within a couple of scheduler ticks; an idle CPU scheduler sleeps
# up to ~1 s per tick (--sleep-on-idle) and the machine is shared: generous.
ANSWER_S = 10.0
SOAK_N = int(os.environ.get("SGLANG_FORK_ABORT_SOAK_N", "2000"))
SOAK_N_MULTI_RANK = int(os.environ.get("SGLANG_FORK_ABORT_SOAK_N_TP", "400"))  # 4 scheduler ranks on 2 cores
SOAK_CONCURRENCY = 16
SOAK_MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module", params=topology_params(TP2, TP2_DECODE_TP1))
def cluster(deployments, request):
    """TP=1, TP=2 on both servers, prefill TP=2 with decode TP=1; the mini LB in front."""
    yield from topology_pd(deployments, request.param, prefill_args=["--chunked-prefill-size", "64"])


# ----------------------------------------------------------------------------- helpers


def _counts(cluster) -> dict:
    out = {}
    for role in PD_ROLES:
        m = cluster.metrics(role)
        for name in FAILURE_COUNTERS:
            out[(role, name)] = metric_sum(m, name)
        out.update(end_causes(m))
    return out



def _abort(server, rid: str) -> tuple:
    return http_post_json(server.url + "/abort_request", {"rid": rid}, timeout=30)


def _assert_aborted(leg: Leg, since: float, what: str) -> None:
    wait_until(leg.done, ANSWER_S + 20, f"{what} to be answered")
    assert http_client_abort(leg.out), (what, leg.out)
    assert "failed" not in json.dumps(leg.out["body"]), (what, leg.out)  # not a transfer failure
    assert leg.out["ended"] - since <= ANSWER_S, (what, leg.out["ended"] - since)


def _start_case(cluster, tag: str, text: str) -> tuple:
    """A matrix case's start: both servers idle (the baseline), the counters then, and one
    request's legs' body (a fresh rid `ab-<tag>-...` and room). Returns (baseline, before,
    rid, body)."""
    baseline = assert_idle(cluster, PD_ROLES)
    before = _counts(cluster)
    rid = f"ab-{tag}-{uuid.uuid4().hex}"
    return baseline, before, rid, leg_body(cluster, _room(), text, rid=rid)


def _leg_held(server, body: dict, queue: str, timeout: float, what: str) -> Leg:
    """One leg sent to `server`, held until its `queue` (fork_pd_resources) holds it."""
    leg = Leg(server.url, body)
    leg.start()
    wait_until(lambda: server.resources()["queues"][queue] == 1, timeout, what)
    return leg


def _abort_answered(server, rid: str, leg: Leg, what: str) -> None:
    """/abort_request for `rid` at `server`: accepted, and `leg` answered as a client abort within ANSWER_S."""
    t0 = time.monotonic()
    assert _abort(server, rid)[0] == 200
    _assert_aborted(leg, t0, what)


def _late_leg_aborted(server, body: dict, what: str) -> Leg:
    """A leg that reaches `server` after the other leg's abort: answered as a client abort within ANSWER_S."""
    leg = Leg(server.url, body)
    t1 = time.monotonic()
    leg.start()
    _assert_aborted(leg, t1, what)
    return leg


def _assert_serving(cluster, baseline) -> None:
    results = assert_serves(cluster.url, 3)
    assert all(r["meta"]["finish_reason"]["type"] != "abort" for r in results), results
    assert_idle(cluster, PD_ROLES, baseline)


def _assert_each_leg_one_abort(cluster, before, baseline, aborted: tuple, other: str) -> None:
    """After a matrix case: nothing held; the leg aborted in `aborted` (role, stage)
    counted once there as a client abort, the `other` role's leg once as a client abort
    in whatever stage it ended; no failure counted; serving goes on."""
    assert_idle(cluster, PD_ROLES, baseline)
    delta = _delta(before, _counts(cluster))
    role, stage = aborted
    assert delta.pop((role, "client_abort", stage)) == 1, delta
    assert sum(v for k, v in delta.items() if k[0] == other and k[1] == "client_abort") == 1, delta
    assert not [k for k in delta if k[1] in FAILURE_COUNTERS], delta
    _assert_serving(cluster, baseline)


def _room() -> int:
    return random.randint(1, 2**62)


# ----------------------------------------------------------------------------- the matrix


def test_abort_in_prefill_bootstrap_then_late_decode_leg(cluster):
    prefill, decode = cluster["prefill"], cluster["decode"]
    baseline, before, rid, body = _start_case(cluster, "boot", "the quick brown fox")
    p_leg = _leg_held(prefill, body, "prefill_bootstrap", 30, "prefill leg queued")
    _abort_answered(prefill, rid, p_leg, "prefill leg")

    # decode's leg arrives after prefill ended the room: answered at once, not after
    # decode's own 300 s bootstrap timer; prefill does not re-create the room
    d_leg = _late_leg_aborted(decode, body, "late decode leg")
    assert d_leg.out["body"]["output_ids"] == []
    _assert_each_leg_one_abort(cluster, before, baseline, ("prefill", "prefill_bootstrap"), "decode")


def test_abort_in_decode_transfer_then_late_prefill_leg(cluster):
    prefill, decode = cluster["prefill"], cluster["decode"]
    baseline, before, rid, body = _start_case(cluster, "dtr", "hello world paris london")
    d_leg = _leg_held(decode, body, "decode_transfer", 30, "decode handshake")
    assert held(decode.resources())["kv_held"] > 0
    _abort_answered(decode, rid, d_leg, "decode leg")
    assert d_leg.out["body"]["output_ids"] == []

    _late_leg_aborted(prefill, body, "late prefill leg")  # prefill's leg comes late: ends at once, sends nothing
    _assert_each_leg_one_abort(cluster, before, baseline, ("decode", "decode_transfer"), "prefill")


def test_abort_inflight_on_prefill_while_decode_frozen(cluster):
    """Decode handshakes, then freezes: prefill's transfer cannot finish. The abort
    on prefill answers and releases prefill now; decode, once resumed, ends the
    request as an abort without generating a token (prefill told it)."""
    prefill, decode = cluster["prefill"], cluster["decode"]
    baseline, before, rid, body = _start_case(cluster, "infl", "the lazy dog " * 60)  # several 64-token chunks
    d_leg = _leg_held(decode, body, "decode_transfer", 30, "decode handshake")
    decode.freeze()
    try:
        p_leg = _leg_held(prefill, body, "prefill_inflight", 60, "prefill inflight")
        _abort_answered(prefill, rid, p_leg, "prefill leg")
        # KV, slots, metadata slot and room tables come back while decode is frozen;
        # only the transfer engine's count of the chunk still on the wire to the
        # frozen peer (`_staging_outstanding`) waits for the write to end.
        # (every rank's own: with tensor parallelism each prefill rank writes its heads)
        def but_staging(report):
            return {k: v for k, v in held(report).items() if not k.endswith("rooms._staging_outstanding")}

        base = but_staging(baseline["prefill"])

        def released():
            return but_staging(prefill.resources()) == base

        wait_until(released, 20, "prefill to give everything back",
                   on_timeout=lambda: str({k: (v, base.get(k)) for k, v in held(prefill.resources()).items() if v != base.get(k)}))
    finally:
        decode.resume()
    t1 = time.monotonic()
    _assert_aborted(d_leg, t1, "decode leg")
    assert d_leg.out["body"]["output_ids"] == []
    _assert_each_leg_one_abort(cluster, before, baseline, ("prefill", "prefill_inflight"), "decode")


def test_abort_running_decode_through_the_lb_and_bad_aborts(cluster):
    baseline = assert_idle(cluster, PD_ROLES)
    prefill, decode = cluster["prefill"], cluster["decode"]
    before = _counts(cluster)
    rid = f"ab-run-{uuid.uuid4().hex}"
    lb_out = {}

    def run():
        status, body = http_post_json(cluster.url + "/generate", {
            "rid": rid, "text": "hello",
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 900, "ignore_eos": True},
        }, timeout=120)
        lb_out.update(status=status, body=body, ended=time.monotonic())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    wait_until(lambda: decode.resources()["queues"]["running"] == 1, 60, "decode running")
    t0 = time.monotonic()
    # both servers at once: ends exactly once
    with ThreadPoolExecutor(2) as ex:
        answers = list(ex.map(lambda s: _abort(s, rid), (prefill, decode)))
    assert [a[0] for a in answers] == [200, 200], answers
    t.join(ANSWER_S + 20)
    assert not t.is_alive()
    assert http_client_abort(lb_out), lb_out
    assert lb_out["ended"] - t0 <= ANSWER_S
    assert len(lb_out["body"]["output_ids"]) < 900

    # bad input: unknown, finished and already-aborted rids are harmless no-ops
    done = generate(cluster.url, "paris london", max_new_tokens=4)
    assert done["status"] == 200
    for bad in ("no-such-rid", rid, done["meta"]["id"]):
        for server in (prefill, decode):
            assert _abort(server, bad)[0] == 200
    assert_idle(cluster, PD_ROLES, baseline)
    delta = _delta(before, _counts(cluster))
    assert not [k for k in delta if k[1] in FAILURE_COUNTERS], delta
    _assert_serving(cluster, baseline)


# ----------------------------------------------------------------------------- soak


def _stream_and_disconnect(lb_url: str, body: dict, after_s: float) -> None:
    """A streaming request whose client goes away after `after_s` seconds."""
    host, port = lb_url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/generate", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        conn.sock.settimeout(after_s + 0.01)
        deadline = time.monotonic() + after_s
        resp = conn.getresponse()
        while time.monotonic() < deadline:
            if not resp.read1(4096):
                break
    except (TimeoutError, OSError, http.client.HTTPException):
        pass  # the client leaving is the point
    finally:
        conn.close()


def test_soak_random_aborts_leave_nothing_behind(cluster):
    rng = random.Random(5)
    soak_n = SOAK_N_MULTI_RANK if cluster.multi_rank else SOAK_N
    baseline = assert_idle(cluster, PD_ROLES)
    prefill, decode = cluster["prefill"], cluster["decode"]
    texts = prompts(20)
    control = [generate(cluster.url, p, max_new_tokens=SOAK_MAX_NEW_TOKENS) for p in texts]
    assert [r["status"] for r in control] == [200] * 20
    expected = {p: r["output_ids"] for p, r in zip(texts, control)}
    before = _counts(cluster)

    outcomes = {"aborted": 0, "completed": 0, "disconnected": 0}
    bad = []
    lock = threading.Lock()

    def one(i: int) -> None:
        text = texts[i % len(texts)]
        rid = f"soak-{i}-{uuid.uuid4().hex[:8]}"
        # half abort within 0.2 s (the request is still in a queue or its transfer on any box), half within 0.8 s
        # (mostly while decoding): how many land does not depend on how fast the box serves 8 tokens
        delay = rng.uniform(0.0, 0.8 if i % 2 else 0.2)
        body = {"rid": rid, "text": text,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": SOAK_MAX_NEW_TOKENS}}
        if i % 4 == 0:
            _stream_and_disconnect(cluster.url, body, delay)
            with lock:
                outcomes["disconnected"] += 1
            return
        out = {}
        t = threading.Thread(target=lambda: out.update(zip(
            ("status", "body"), http_post_json(cluster.url + "/generate", body, timeout=120))), daemon=True)
        t.start()
        t.join(delay)
        targets = [(prefill,), (decode,), (prefill, decode)][i % 3]
        for server in targets:
            _abort(server, rid)
        t.join(120)
        with lock:
            if http_client_abort(out):
                outcomes["aborted"] += 1
            elif out.get("status") == 200 and out["body"]["output_ids"] == expected[text]:
                outcomes["completed"] += 1  # finished before the abort landed: a real completion
            else:
                bad.append({"rid": rid, "abort_to": [s.role for s in targets], "delay": round(delay, 3),
                            "answered": not t.is_alive(), **out})

    t0 = time.monotonic()
    with ThreadPoolExecutor(SOAK_CONCURRENCY) as ex:
        list(ex.map(one, range(soak_n)))
    took = time.monotonic() - t0
    print(f"soak: {soak_n} requests in {took:.0f}s: {outcomes}")
    assert not bad, bad[:5]
    assert outcomes["aborted"] > soak_n // 10, outcomes  # the aborts really landed mid-flight

    assert_idle(cluster, PD_ROLES, baseline, timeout=120)
    delta = _delta(before, _counts(cluster))
    assert not [k for k in delta if k[1] in FAILURE_COUNTERS], delta
    assert not [k for k in delta if len(k) == 3 and k[1] != "client_abort"], delta

    fresh = [generate(cluster.url, p, max_new_tokens=SOAK_MAX_NEW_TOKENS) for p in texts]
    assert [r["status"] for r in fresh] == [200] * 20
    assert [r["output_ids"] for r in fresh] == [r["output_ids"] for r in control]
    assert_idle(cluster, PD_ROLES, baseline)
