"""Ends that fall between modules, end to end on a real 1P1D (mooncake over TCP):

- hole 2: prefill SIGKILLed while decode holds rooms it aborted a moment before (client
  disconnects and /abort_request), parked in upstream's deferred KV release waiting
  for prefill's drain acks. The loss settles every room bound to the lost prefill,
  whatever its state: decode is idle within the heartbeat detection time + 2 s
  (upstream: its 30 s release timeout).
- hole 1: a request decode ends before decode's scheduler created its room (decode's
  tokenizer aborts it while prefill already serves) reaches prefill at once: prefill's
  bootstrap queue is empty within about a second, no request waits for minutes.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time

import pytest

from conftest import resume_frozen, shared_env
from testing.pd_checks import (
    END_CAUSES,
    PD_ROLES,
    PEER_LOSSES,
    assert_idle,
    assert_serves,
    at_gate,
    bootstrap_queue,
    cluster_end_causes,
    delta,
    is_completion_or_abort_answer,
    leg_body,
    post,
    skewed_abort_pause_cycles,
    wait_end_causes,
    waiting_for_peer,
)
from testing.pd_cluster import (
    generate,
    http_get,
    http_post_json,
    metric_sum,
    parse_prometheus,
    wait_until,
)

pytestmark = pytest.mark.e2e

HEARTBEAT = 2.0  # upstream's floor
ENV = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": str(HEARTBEAT),
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
}
RELEASES = "sglang:decode_deferred_kv_release_total"
# A refused connection is a loss at the monitor's next pass (one interval); then the
# deferred release is resolved on the scheduler's next tick. The bound:
# detection + 2 s.
IDLE_AFTER_LOSS_S = HEARTBEAT + 2.0


@pytest.fixture(scope="module")
def cluster(shared_liveness):
    """The shared peer-liveness 1P1D (conftest): ENV, and either scheduler rejects a
    request that names a priority (hole 1, a rejection)."""
    c = shared_liveness.deployment
    shared_env(c, PD_ROLES, ENV, ("--abort-on-priority-when-disabled",))
    try:
        yield c
    finally:
        resume_frozen(c)


class Leg(threading.Thread):
    """One /generate to one server; `disconnect()` closes the client's socket."""

    def __init__(self, url: str, payload: dict):
        super().__init__(daemon=True)
        host, port = url.rsplit("//", 1)[1].split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=120)
        self.payload = payload
        self.status = self.body = self.ended_at = None

    def run(self):
        try:
            self.conn.request("POST", "/generate", json.dumps(self.payload), {"Content-Type": "application/json"})
            resp = self.conn.getresponse()
            self.status, raw = resp.status, resp.read()
            try:
                self.body = json.loads(raw)
            except ValueError:
                self.body = raw.decode(errors="replace")
        except Exception as e:  # disconnected by the test, or the server was killed
            self.body = repr(e)
        self.ended_at = time.monotonic()

    def disconnect(self):
        # shutdown, not close: close() from another thread does not end the reader's
        # recv, and sends no FIN while it is blocked there
        self.conn.sock.shutdown(socket.SHUT_RDWR)


def _warm_baseline(cluster) -> dict:
    """One request served (decode knows prefill), then both servers idle: the baseline."""
    warm = generate(cluster.url, "warm up", max_new_tokens=4)
    assert warm["status"] == 200, warm
    return assert_idle(cluster, PD_ROLES)


def _deferred(server) -> int:
    return server.resources()["transfer_rooms"]["_deferred_abort_ack_tracker"]


def test_prefill_killed_while_decode_awaits_drain_acks(cluster):
    """Hole 2: rooms decode aborted (waiting for prefill's drain ack) when prefill dies
    are settled by the loss: decode idle within detection + 2 s, not 30 s."""
    prefill, decode = cluster["prefill"], cluster["decode"]
    baseline = _warm_baseline(cluster)  # decode fetched prefill's info
    losses = metric_sum(decode.metrics(), PEER_LOSSES)
    drained = metric_sum(decode.metrics(), RELEASES, outcome="drained")
    timed_out = metric_sum(decode.metrics(), RELEASES, outcome="timeout")
    aborts = metric_sum(decode.metrics(), END_CAUSES, role="decode", cause="client_abort")

    # prefill frozen: decode preallocates, tells prefill (the message waits in its
    # socket) and waits for KV that does not come; prefill cannot ack any drain
    prefill.freeze()
    n = 8
    rooms = random.sample(range(1, 2**62), n)
    rids = [f"hole2-{i}-{room}" for i, room in enumerate(rooms)]
    legs = [Leg(decode.url, leg_body(cluster, r, f"held {i}: hello world", rid=rid)) for i, (r, rid) in enumerate(zip(rooms, rids))]
    for leg in legs:
        leg.start()
    wait_until(lambda: decode.resources()["queues"]["decode_transfer"] == n, 60, "decode handshakes")
    # half the clients go away, the other half are aborted by rid
    for leg in legs[: n // 2]:
        leg.disconnect()
    for rid in rids[n // 2:]:
        status, _ = http_post_json(decode.url + "/abort_request", {"rid": rid}, timeout=10)
        assert status == 200
    # every room is aborted and parked: waiting for prefill's drain ack
    wait_until(lambda: decode.resources()["queues"]["decode_transfer"] == 0 and _deferred(decode) == n, 30,
               "decode to park every aborted room for prefill's drain ack",
               on_timeout=lambda: json.dumps(decode.resources()["transfer_rooms"]))
    for leg in legs[n // 2:]:
        leg.join(10)
    assert [leg.status for leg in legs[n // 2:]] == [200] * (n - n // 2), [leg.body for leg in legs[n // 2:]]
    for leg in legs[n // 2:]:
        assert leg.body["meta_info"]["finish_reason"]["type"] == "abort", leg.body

    prefill.kill()
    t_kill = time.monotonic()
    assert_idle(cluster, ("decode",), baseline, timeout=IDLE_AFTER_LOSS_S)
    idle_after = time.monotonic() - t_kill
    assert idle_after <= IDLE_AFTER_LOSS_S, idle_after
    assert http_get(decode.url + "/flush_cache")[0] == 200
    assert metric_sum(decode.metrics(), PEER_LOSSES) == losses + 1
    # released as drained (on the lost peer's behalf), none by the 30 s timeout
    assert metric_sum(decode.metrics(), RELEASES, outcome="drained") == drained + n
    assert metric_sum(decode.metrics(), RELEASES, outcome="timeout") == timed_out
    assert metric_sum(decode.metrics(), END_CAUSES, role="decode", cause="client_abort") == aborts + n
    assert "timed out after" not in decode.tail(200)

    prefill.start()
    prefill.wait_healthy()
    assert_serves(cluster.url, 6)
    assert_idle(cluster, PD_ROLES, baseline)


# ----------------------------------------------------------------------------- hole 1


def _call(server, endpoint: str, body=None):
    status, reply, _ = post(server, endpoint, body)
    assert status == 200, (server.role, endpoint, status, reply)
    return reply


def _copy_ends_at_once(server, leg, t0) -> str:
    """`server`'s copy, waiting for the other server (prefill: for decode's handshake, it
    waited for its bootstrap timeout; decode: for prefill's KV, it waited for the transfer
    deadline, 600 s), was let go within about a second of `t0`, answered as an abort.
    Returns the abort's message."""
    wait_until(lambda: waiting_for_peer(server) == 0, 5, f"{server.role} to let go of its copy",
               interval=0.05, on_timeout=lambda: str(server.resources()["queues"]))
    emptied = time.monotonic() - t0
    leg.join(10)
    assert not leg.is_alive(), f"{server.role}'s leg hangs"
    assert emptied <= 1.5, emptied  # "about a second" on two loaded cores
    assert leg.ended_at - t0 <= 5.0, leg.ended_at - t0
    assert _abort_answer(leg), (leg.status, leg.body)
    return leg.body["meta_info"]["finish_reason"]["message"]


def _gate_or_abort_answer(r) -> bool:
    """What decode's pause gate answers an aborted request, relayed by the load
    balancer: upstream's abort answer (200, finish_reason abort; issue 14)."""
    return r["status"] == 200 and r["meta"]["finish_reason"]["type"] == "abort"


class Client(threading.Thread):
    def __init__(self, url: str, rid: str, text: str):
        super().__init__(daemon=True)
        self.url, self.rid, self.text = url, rid, text
        self.result = self.ended_at = None

    def run(self):
        self.result = generate(self.url, self.text, max_new_tokens=8, timeout=120, rid=self.rid)
        self.ended_at = time.monotonic()


def _warm_baseline_counts(cluster):
    """Warm up; the idle baseline and prefill's client-abort / bootstrap-failure counts
    before a hole-1 case (it ends prefill's copies as aborts, never as failures)."""
    prefill = cluster["prefill"]
    baseline = _warm_baseline(cluster)
    aborts = metric_sum(prefill.metrics(), END_CAUSES, role="prefill", cause="client_abort")
    return baseline, aborts, metric_sum(prefill.metrics(), "sglang:num_bootstrap_failed_reqs_total")


def _assert_prefill_ended_as_aborts(prefill, aborts: float, failed: float, n: int) -> None:
    """Prefill ended `n` copies as decode's end: `n` client aborts counted since `aborts`
    (its count then), none as a bootstrap failure (still `failed`)."""
    assert metric_sum(prefill.metrics(), END_CAUSES, role="prefill", cause="client_abort") == aborts + n
    assert metric_sum(prefill.metrics(), "sglang:num_bootstrap_failed_reqs_total") == failed


def test_abort_at_decodes_gate_reaches_prefill_at_once(cluster):
    """Hole 1: decode paused (abort mode), prefill serving. A request reaches both;
    prefill's copy waits for decode's handshake, decode's copy waits at its pause gate.
    /abort_request at decode ends it there -- and prefill's copy within about a second,
    not after its bootstrap timeout."""
    prefill, decode = cluster["prefill"], cluster["decode"]
    baseline, aborts, failed = _warm_baseline_counts(cluster)

    _call(decode, "pause_generation", {"mode": "abort"})
    try:
        n = 4
        clients = [Client(cluster.url, f"hole1-{i}-{random.getrandbits(40)}", f"gate {i}: hello") for i in range(n)]
        for c in clients:
            c.start()
        wait_until(lambda: bootstrap_queue(prefill) == n, 30, "prefill's copies waiting for decode's handshake")
        t_abort = time.monotonic()
        for c in clients:
            assert http_post_json(decode.url + "/abort_request", {"rid": c.rid}, timeout=10)[0] == 200
        wait_until(lambda: bootstrap_queue(prefill) == 0, 5, "prefill's bootstrap queue to empty",
                   interval=0.05, on_timeout=lambda: str(prefill.resources()["queues"]))
        emptied = time.monotonic() - t_abort
        for c in clients:
            c.join(10)
        assert not [c.rid for c in clients if c.is_alive()], "a request hangs"
        assert emptied <= 1.5, emptied  # "about a second" on two loaded cores
        for c in clients:
            assert _gate_or_abort_answer(c.result), c.result
            assert c.ended_at - t_abort <= 5.0, c.ended_at - t_abort
        assert_idle(cluster, ("prefill",), baseline, timeout=5)
        # prefill ended its copies as aborts (decode's end), not bootstrap failures
        _assert_prefill_ended_as_aborts(prefill, aborts, failed, n)
    finally:
        _call(decode, "continue_generation")
    assert_idle(cluster, PD_ROLES, baseline)
    assert_serves(cluster.url, 4)


def _priority(body: dict) -> dict:
    """The request with a priority while priority scheduling is off: a scheduler rejects it (503)."""
    return dict(body, priority=1)


def _other_rejects(cluster, waiter: str, rid_tag: str, text: str, reject, want_status: int, word: str) -> str:
    """`waiter`'s copy of a request waits for the other server (prefill's for decode's
    handshake; decode's, its handshake sent, for prefill's KV); the other server rejects
    the request before its room exists there (`reject(body)` answered `want_status`,
    naming `word`); `waiter`'s copy is let go at once (_copy_ends_at_once). Returns the
    abort's message."""
    server = cluster[waiter]
    other = cluster["decode" if waiter == "prefill" else "prefill"]
    room = random.getrandbits(62)
    body = leg_body(cluster, room, text, rid=f"{rid_tag}-{room}")
    leg = Leg(server.url, body)
    leg.start()
    if waiter == "prefill":
        wait_until(lambda: bootstrap_queue(server) == 1, 30, "prefill's copy waiting for decode's handshake")
    else:
        wait_until(lambda: _decode_transfer(server) == 1, 30, "decode's copy waiting for prefill's KV")
    t0 = time.monotonic()
    status, reply = http_post_json(other.url + "/generate", reject(body), timeout=30)
    assert status == want_status and word in str(reply), (status, reply)
    return _copy_ends_at_once(server, leg, t0)


def _decode_rejects(cluster, rid_tag: str, text: str, reject, want_status: int, word: str) -> None:
    """Prefill's copy waits for decode's handshake; decode rejects the request
    (`_other_rejects`). Prefill's copy ends within about a second as decode's end (an
    abort, not a bootstrap failure), nothing is held, serving goes on."""
    prefill = cluster["prefill"]
    baseline, aborts, failed = _warm_baseline_counts(cluster)
    _other_rejects(cluster, "prefill", rid_tag, text, reject, want_status, word)
    assert_idle(cluster, PD_ROLES, baseline, timeout=5)
    # prefill ended its copy as decode's end (an abort), not as a bootstrap failure
    _assert_prefill_ended_as_aborts(prefill, aborts, failed, 1)
    assert_serves(cluster.url, 2)


def test_request_decodes_scheduler_rejects_reaches_prefill_at_once(cluster):
    """Hole 1, a rejection: decode's scheduler rejects the request before its room
    exists (a priority while priority scheduling is off: 503). Prefill's copy, waiting
    for decode's handshake, ends within about a second as decode's end (an abort), not
    after its bootstrap timeout."""
    _decode_rejects(cluster, "rejected", "rejected by decode: hello", _priority, 503, "priority")


def _decode_transfer(server) -> int:
    return server.resources()["queues"]["decode_transfer"]


def _abort_answer(leg) -> bool:
    """upstream's abort answer: 200, finish_reason abort."""
    return leg.status == 200 and leg.body["meta_info"]["finish_reason"]["type"] == "abort"


def _abort_leg(server, rid: str, leg) -> float:
    """/abort_request for `rid` at `server`, whose own leg `leg` is then answered as an
    abort (within its 5 s join). Returns when the abort was sent."""
    t0 = time.monotonic()
    assert http_post_json(server.url + "/abort_request", {"rid": rid}, timeout=10)[0] == 200
    leg.join(5)
    assert _abort_answer(leg), (leg.status, leg.body)
    return t0


def _legs_held_by_prefills_gate(cluster, tag: str, text: str):
    """Prefill paused: one request's two legs sent straight to the servers, until
    decode's copy waits for KV and prefill's at prefill's pause gate. Returns
    (rid, decode leg, prefill leg)."""
    prefill, decode = cluster["prefill"], cluster["decode"]
    room = random.getrandbits(62)
    rid = f"{tag}-{room}"
    body = leg_body(cluster, room, f"{text}: hello", rid=rid)
    d_leg, p_leg = Leg(decode.url, body), Leg(prefill.url, body)
    d_leg.start()
    p_leg.start()
    wait_until(lambda: _decode_transfer(decode) == 1 and at_gate(prefill) == 1, 30,
               "decode's copy waiting for KV and prefill's at its gate")
    return rid, d_leg, p_leg


def _prefill_rejects(cluster, rid_tag: str, text: str, reject, want_status: int, word: str, says: str) -> None:
    """Decode's copy, its handshake sent, waits for prefill's KV; prefill rejects the
    request (`_other_rejects`). Decode's copy ends within about a second as an abort whose
    message starts with `says` and names `word`, counted in decode's transfer queue as
    prefill's end (an abort, not a failure); nothing is held, serving goes on."""
    prefill = cluster["prefill"]
    baseline, _, failed = _warm_baseline_counts(cluster)
    before = cluster_end_causes(cluster)
    message = _other_rejects(cluster, "decode", rid_tag, text, reject, want_status, word)
    assert message.startswith(says) and word in message, message
    assert_idle(cluster, PD_ROLES, baseline, timeout=5)
    # decode ended its copy in its transfer queue as prefill's end (an abort), not a failure
    wait_end_causes(cluster, before, {("decode", "client_abort", "decode_transfer"): 1})
    assert metric_sum(prefill.metrics(), "sglang:num_bootstrap_failed_reqs_total") == failed
    assert_serves(cluster.url, 2)


def test_request_prefills_scheduler_rejects_reaches_decode_at_once(cluster):
    """Hole 1's mirror, a rejection: prefill's scheduler rejects the request before its
    room exists there (a priority: 503) while decode's copy, its handshake sent, waits
    for prefill's KV. Decode's copy ends within about a second, as an abort."""
    _prefill_rejects(cluster, "rejected-on-prefill", "rejected by prefill: hello", _priority, 503, "priority",
                     says="rejected by prefill's scheduler")


TOO_MANY_TOKENS = 4096  # beyond the tiny model's context (1024): the tokenizer's validation rejects it


def _too_long(body: dict) -> dict:
    return dict(body, sampling_params=dict(body["sampling_params"], max_new_tokens=TOO_MANY_TOKENS))


def test_request_decodes_tokenizer_rejects_reaches_prefill_at_once(cluster):
    """Hole 1, a rejection before decode's scheduler: decode's tokenizer rejects the
    request (its validation: more tokens than the context; 400) while prefill's copy
    waits for decode's handshake. Prefill's copy ends within about a second as decode's
    end (an abort), not after its bootstrap timeout."""
    _decode_rejects(cluster, "tokenizer-rejected", "rejected by decode's tokenizer: hello", _too_long, 400,
                    "context length")


def test_request_prefills_tokenizer_rejects_reaches_decode_at_once(cluster):
    """Hole 1's mirror, a rejection before prefill's scheduler: prefill's tokenizer
    rejects the request (more tokens than the context; 400) while decode's copy, its
    handshake sent, waits for prefill's KV. Decode's copy ends within about a second,
    as an abort naming the rejection (it waited for the transfer deadline, 600 s)."""
    _prefill_rejects(cluster, "tokenizer-rejected-on-prefill", "rejected by prefill's tokenizer: hello", _too_long,
                     400, "context length", says="rejected by prefill's tokenizer")


def test_abort_at_prefills_gate_reaches_decode_at_once(cluster):
    """Hole 1's mirror: prefill paused (abort mode), decode serving. A request reaches
    both; decode's copy waits for prefill's KV, prefill's copy waits at prefill's pause
    gate. /abort_request at prefill ends it there -- and decode's copy within about a
    second, whether decode's handshake reached prefill before or after."""
    prefill = cluster["prefill"]
    baseline, _, _ = _warm_baseline_counts(cluster)
    before = cluster_end_causes(cluster)
    _call(prefill, "pause_generation", {"mode": "abort"})
    try:
        rid, d_leg, p_leg = _legs_held_by_prefills_gate(cluster, "prefill-gate", "ended at prefill's gate")
        t0 = _abort_leg(prefill, rid, p_leg)
        _copy_ends_at_once(cluster["decode"], d_leg, t0)
        assert at_gate(prefill) == 0
    finally:
        _call(prefill, "continue_generation")
    assert_idle(cluster, PD_ROLES, baseline, timeout=5)
    wait_end_causes(cluster, before, {("decode", "client_abort", "decode_transfer"): 1})
    assert_serves(cluster.url, 2)


def test_decode_abort_while_prefills_gate_holds_the_copy(cluster):
    """The other order of the same skew: decode's copy (waiting for KV) is aborted while
    prefill's copy waits at prefill's pause gate. Prefill drops decode's handshake at
    once (nothing held there but the gate's request); after continue_generation
    prefill's copy ends at creation as decode's end, and both servers are idle."""
    prefill, decode = cluster["prefill"], cluster["decode"]
    baseline, aborts, failed = _warm_baseline_counts(cluster)
    _call(prefill, "pause_generation", {"mode": "abort"})
    try:
        rid, d_leg, p_leg = _legs_held_by_prefills_gate(cluster, "decode-ends-first", "ended on decode first")
        t0 = _abort_leg(decode, rid, d_leg)
        # prefill holds only the request at its gate: decode's handshake is dropped
        assert_idle(cluster, PD_ROLES, {"prefill": dict(baseline["prefill"], pause_gate_held=1),
                                        "decode": baseline["decode"]}, timeout=5)
        assert time.monotonic() - t0 <= 5.0
    finally:
        _call(prefill, "continue_generation")
    p_leg.join(10)
    assert not p_leg.is_alive(), "prefill's leg hangs after continue"
    assert _abort_answer(p_leg), (p_leg.status, p_leg.body)
    assert_idle(cluster, PD_ROLES, baseline, timeout=5)
    _assert_prefill_ended_as_aborts(prefill, aborts, failed, 1)
    assert_serves(cluster.url, 2)


SKEW_CYCLES = 6
SKEW_CLIENTS = 6
UNANSWERED_S = 10.0


@pytest.mark.parametrize("first", PD_ROLES)
def test_skewed_abort_pause_cycles_leave_nothing_waiting(cluster, first):
    """The issue's soak, bounded: abort-mode pause cycles where `first` is continued
    before the other server, which then aborts the requests held at its gate, under
    closed-loop traffic through the load balancer (the mini LB; the Rust gateway:
    test_gateway.py). No request is unanswered after 10 s; after each cycle the running
    server's waiting queue (prefill: bootstrap; decode: prealloc + transfer) empties
    within a second of the other's end; every answer is a completion or upstream's
    abort answer."""
    prefill, decode = cluster["prefill"], cluster["decode"]
    baseline = _warm_baseline(cluster)
    results = skewed_abort_pause_cycles(prefill, decode, cluster.url, SKEW_CYCLES, SKEW_CLIENTS, UNANSWERED_S,
                                        first=first)
    wrong = [(r["status"], r["error"]) for r in results if not is_completion_or_abort_answer(r)]
    assert not wrong, wrong
    assert sum(r["meta"]["finish_reason"]["type"] != "abort" for r in results) >= SKEW_CYCLES
    assert sum(r["meta"]["finish_reason"]["type"] == "abort" for r in results) >= SKEW_CYCLES  # the gate's ends
    assert_idle(cluster, PD_ROLES, baseline)


# ----------------------------------------------------------------------------- mixed faults

SOAK_ROUNDS = 2
SOAK_CLIENTS = 6


def test_closed_loop_soak_mixing_faults_judges_every_answer(cluster):
    """Closed-loop clients through the load balancer while pause cycles in every mode
    (servers paused and continued in either order), aborts by rid on both servers,
    abort_all and short freezes of either server follow one another (testing/soak.py).
    Every answer is a completion equal to its reference (divergence only after a
    retract pause) or an abort answer that an aborting fault explains; no error, none
    open after 30 s; nothing held afterwards and serving goes on."""
    from testing.soak import Soak, schedule

    baseline = _warm_baseline(cluster)
    before = cluster_end_causes(cluster)
    soak = Soak(cluster, clients=SOAK_CLIENTS, seed=13)
    report = soak.run(schedule(SOAK_ROUNDS, seed=13))
    print("soak", report.summary(), "diverged after retract:", report.diverged_after_retract)
    assert not report.wrong, report.wrong[:10]
    summary = report.summary()
    assert summary.get("200/length", 0) >= len(report.windows), summary  # it served throughout
    assert_idle(cluster, PD_ROLES, baseline)
    # none of these faults is a deadline, a lost peer or a failed transfer: no end was
    # counted as one (the abort-kind causes are counted exactly in their own tests)
    moved = delta(before, cluster_end_causes(cluster))
    errors = {k: v for k, v in moved.items() if k[1] in ("timeout", "peer_failure", "transport")}
    assert not errors, moved
    assert_serves(cluster.url, 4)
