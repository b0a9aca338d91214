"""Pause, release, resume, continue on 1P1D with requests in flight (pd_pause).

The shared default 1P1D (conftest.shared_pd; no control server: the control run is the
same cluster before the first cycle). Every test starts and ends idle, running, with the
transfer engine registrations of the baseline.
"""

from __future__ import annotations

import os
import threading
import time
from functools import partial

import pytest

from conftest import TP2, TP2_DECODE_TP1, topology_params, topology_pd
from testing.pd_checks import (
    PD_ROLES,
    abort_gate_until_let_go,
    assert_idle,
    at_gate,
    call,
    held,
    on_both,
    requests_held,
    waiting_for_peer,
)
from testing.pd_cluster import (
    PDCluster,
    generate,
    generate_concurrently,
    prompts,
    wait_until,
)

pytestmark = pytest.mark.e2e

MODES = ("abort", "in_place", "retract")
CYCLES = int(os.environ.get("PD_PAUSE_CYCLES", "20"))
# 4 scheduler ranks and a gateway on 2 cores: fewer cycles per case (each mode and order still covered)
CYCLES_MULTI_RANK = int(os.environ.get("PD_PAUSE_CYCLES_TP", "5"))
CONCURRENCY = 8
MAX_NEW_TOKENS = 64
REQUEST_DEADLINE_S = 60.0  # generous on 2 loaded cores; a hang is minutes
ANSWER_AFTER_CONTINUE_S = 10.0  # after the last continue, every request is answered
MIN_CYCLES_IN_FLIGHT = 0.7  # share of cycles that must pause with requests in flight
ABORT_ANSWER_S = 1.0
LONG_PAUSE_S = 2.0
RELEASE_MESSAGE = "engine memory released during pause"


@pytest.fixture(scope="module", params=topology_params(TP2, TP2_DECODE_TP1))
def cluster(shared_pd, deployments, request) -> PDCluster:
    """TP=1: the shared default 1P1D (conftest.shared_pd) behind the mini LB: taken idle,
    running and serving, and left so (checked when the module ends). Multi-rank
    (TP 2 on both servers, or prefill TP 2 with decode TP 1): the module's own, behind the Rust gateway."""
    if request.param.multi_rank:
        yield from topology_pd(deployments, request.param, balancer="router")
    else:
        yield shared_pd.deployment


@pytest.fixture(scope="module")
def control(cluster):
    """Outputs of the cluster before any cycle."""
    assert_idle(cluster, PD_ROLES)
    texts = prompts(CONCURRENCY)
    out = generate_concurrently(cluster.url, texts, max_new_tokens=MAX_NEW_TOKENS)
    assert all(r["status"] == 200 for r in out), [r["error"] for r in out]
    return {t: r["output_ids"] for t, r in zip(texts, out)}


# control calls: `call` gives (status, reply, seconds); `both` calls prefill then decode
both = partial(on_both, at_once=False)


def pause_report(cluster, role):
    r = cluster.resources(role)
    return r["pause"], r["te_registration"]


ABORT_REASONS = {
    # mode -> what an abort answer's message may name (docs/pause-release-resume.md,
    # "Using the fork from an RL framework"): every abort is upstream's answer, HTTP
    # 200 with finish_reason "abort" and no error status.
    # abort mode: what the pause ends names the pause; with both servers paused at once
    # a request whose decode copy finished its transfer between the pause's abort_all
    # and upstream's own is still answered by upstream's ("Abort in waiting queue" /
    # the client message; docs/pause-release-resume.md, known limits).
    "abort": ("pause_generation(mode=abort)", "Abort", RELEASE_MESSAGE),
    "in_place": (RELEASE_MESSAGE,),
    "retract": (RELEASE_MESSAGE,),
}


def abort_answer(result, mode: str) -> bool:
    """The documented abort answer for `mode`: 200, finish_reason abort, no status,
    a message naming why. 499/503/500 are never an answer to a pause."""
    if result["status"] != 200:
        return False
    reason = result["meta"]["finish_reason"]
    return (
        reason["type"] == "abort"
        and reason.get("status_code") is None
        and any(why in reason.get("message", "") for why in ABORT_REASONS[mode])
    )


def judge(burst, control, mode, outcomes, where):
    """Each request of `burst` ended as a completion (the control's output; another
    only if it was seen retracted) or as the documented abort answer; nothing else."""
    for text, r in zip(burst.texts, burst.join()):
        assert r is not None, (where, "unanswered")
        if r["status"] == 200 and r["meta"]["finish_reason"]["type"] != "abort":
            want = control[text]
            if r["output_ids"] == want:
                outcomes["completed"] += 1
                continue
            # A request retracted mid-decode is re-bootstrapped: prefill recomputes
            # its KV in one pass, and on the tiny random bf16 model greedy decoding
            # may then diverge. Allowed only for a request seen retracted; it must
            # still be a whole, well-formed completion.
            assert r["meta"].get("num_retractions", 0) > 0, (where, "diverged", r)
            assert r["meta"]["finish_reason"]["type"] == "length", (where, r)
            assert len(r["output_ids"]) == len(want), (where, text)
            outcomes["diverged_after_retraction"] += 1
        else:
            assert abort_answer(r, mode), (where, r)
            outcomes["aborted"] += 1


class Burst:
    """CONCURRENCY requests in threads, each remembering when it ended."""

    def __init__(self, cluster, tag: str, max_new_tokens: int = MAX_NEW_TOKENS):
        self.texts = prompts(CONCURRENCY)
        self.rids = [f"{tag}-{i}" for i in range(CONCURRENCY)]
        self.results = [None] * CONCURRENCY
        self.ended = [None] * CONCURRENCY

        def run(i):
            self.results[i] = generate(
                cluster.url, self.texts[i], max_new_tokens=max_new_tokens,
                timeout=REQUEST_DEADLINE_S + 30, rid=self.rids[i],
            )
            self.ended[i] = time.monotonic()

        self.threads = [threading.Thread(target=run, args=(i,), daemon=True)
                        for i in range(CONCURRENCY)]
        for t in self.threads:
            t.start()

    def join(self, timeout: float = REQUEST_DEADLINE_S):
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        hung = [self.rids[i] for i, t in enumerate(self.threads) if t.is_alive()]
        assert not hung, f"requests still open {timeout}s later: {hung}"
        return self.results


def held_once_started(cluster, burst) -> int:
    """Poll until the servers hold some of `burst`'s requests (or all of them ended) and
    return what that poll saw: the count the caller's pause then meets (or 0). Asking
    the servers again would read a burst that ended in between as "nothing in flight"."""
    seen = []

    def held_or_done():
        seen.append(requests_held(cluster))
        return seen[-1] or all(burst.ended)

    wait_until(held_or_done, 30, "requests in flight")
    return seen[-1]


def in_flight(cluster) -> bool:
    """Some request is held by a server (queues, running batch or KV)."""
    return any(any(v for v in held(cluster.resources(r)).values()) for r in PD_ROLES)


def assert_baseline(cluster, baseline):
    assert_idle(cluster, PD_ROLES, baseline=baseline)
    for role in PD_ROLES:
        pause, te = pause_report(cluster, role)
        assert pause == {"paused": False, "mode": None, "clock_paused": False}, (role, pause)
        assert te == baseline[role]["te_registration"], role


def test_calls_upstream_cannot_survive_get_409_naming_the_state(cluster, control):
    """Only sequences upstream itself cannot survive are 409 (issue 14); the rest of
    upstream's sequences are in test_rl_loops.py."""
    baseline = assert_idle(cluster, PD_ROLES)
    for role in PD_ROLES:
        def rejected(endpoint, body, state):
            before = pause_report(cluster, role)
            status, reply, _ = call(cluster, role, endpoint, body)
            assert status == 409, (role, endpoint, status, reply)
            assert f"engine state is '{state}'" in str(reply), reply
            assert pause_report(cluster, role) == before, (role, endpoint)

        def unknown_mode(state):
            # rejected by request validation (400) before any handler: names the state
            before = pause_report(cluster, role)
            status, reply, _ = call(cluster, role, "pause_generation", {"mode": "sideways"})
            assert status == 400, (role, state, status, reply)
            message = reply.get("message", "") if isinstance(reply, dict) else str(reply)
            assert f"engine state is '{state}'" in message and "mode" in message, reply
            assert pause_report(cluster, role) == before

        rejected("resume_memory_occupation", {}, "running")  # upstream: KeyError
        before = pause_report(cluster, role)
        assert call(cluster, role, "continue_generation")[0] == 200  # a no-op, as upstream
        assert pause_report(cluster, role) == before
        unknown_mode("running")

        assert call(cluster, role, "pause_generation", {"mode": "in_place"})[0] == 200
        rejected("pause_generation", {"mode": "retract"}, "paused")
        rejected("resume_memory_occupation", {}, "paused")
        unknown_mode("paused")
        assert call(cluster, role, "release_memory_occupation")[0] == 200
        rejected("release_memory_occupation", {}, "released")
        rejected("pause_generation", {"mode": "abort"}, "released")
        unknown_mode("released")
        assert call(cluster, role, "resume_memory_occupation")[0] == 200
        rejected("resume_memory_occupation", {}, "resumed")
        unknown_mode("resumed")
        assert call(cluster, role, "continue_generation")[0] == 200
        # continue while memory is released: the pause ends, the engine serves again at the resume
        assert call(cluster, role, "pause_generation", {"mode": "in_place"})[0] == 200
        assert call(cluster, role, "release_memory_occupation")[0] == 200
        assert call(cluster, role, "continue_generation")[0] == 200
        report = cluster.resources(role)  # the pause ended; the scheduler waits for its memory
        assert (report["engine_state"]["state"], report["engine_state"]["mode"], report["pause"]["paused"]) == (
            "released", None, True), report
        assert call(cluster, role, "resume_memory_occupation")[0] == 200
        report = cluster.resources(role)
        assert (report["engine_state"]["state"], report["pause"]["paused"]) == ("running", False), report
    assert_baseline(cluster, baseline)
    # A later correct cycle still works, and the cluster serves what it served.
    texts = list(control)
    out = generate_concurrently(cluster.url, texts, max_new_tokens=MAX_NEW_TOKENS)
    assert [r["output_ids"] for r in out] == [control[t] for t in texts]


@pytest.mark.parametrize("mode", MODES)
def test_full_cycles_under_load(cluster, control, mode):
    cycles = CYCLES_MULTI_RANK if cluster.multi_rank else CYCLES
    baseline = assert_idle(cluster, PD_ROLES)
    outcomes = {"completed": 0, "diverged_after_retraction": 0, "aborted": 0}
    in_flight_at_pause = []
    t_start = time.monotonic()
    for cycle in range(cycles):
        burst = Burst(cluster, f"{mode}-{cycle}")
        in_flight_at_pause.append(held_once_started(cluster, burst))
        both(cluster, "pause_generation", {"mode": mode})
        both(cluster, "release_memory_occupation")
        for role in PD_ROLES:  # released: nothing registered with the transfer engine
            assert pause_report(cluster, role)[1]["registered_regions"] == 0, role
        both(cluster, "resume_memory_occupation")
        both(cluster, "continue_generation")
        burst.join(ANSWER_AFTER_CONTINUE_S + 30)
        judge(burst, control, mode, outcomes, (mode, cycle))
        assert_baseline(cluster, baseline)
    elapsed = time.monotonic() - t_start
    busy = sum(1 for n in in_flight_at_pause if n)
    assert busy >= MIN_CYCLES_IN_FLIGHT * cycles, (mode, in_flight_at_pause)
    if mode == "abort":  # what is in flight at an abort-mode pause is aborted
        assert outcomes["aborted"] > 0, outcomes
    # After the last cycle the cluster serves exactly what it served before.
    texts = list(control)
    out = generate_concurrently(cluster.url, texts, max_new_tokens=MAX_NEW_TOKENS)
    assert [r["output_ids"] for r in out] == [control[t] for t in texts]
    assert_baseline(cluster, baseline)
    print(f"{mode}: {cycles} cycles in {elapsed:.1f}s, {outcomes}, "
          f"held at each pause {in_flight_at_pause}")


def _skewed_cycles(cluster, control, mode, first, cycles):
    """Pause `first` server, then the other; continue `first`, then the other, while
    requests keep arriving: a request can reach one server inside its pause window
    and the other outside it."""
    second = [r for r in PD_ROLES if r != first][0]
    baseline = assert_idle(cluster, PD_ROLES)
    outcomes = {"completed": 0, "diverged_after_retraction": 0, "aborted": 0}
    in_flight_at_pause = []
    gate_ends = []  # abort mode: copies `first` held when `second` aborted its gate
    for cycle in range(cycles):
        early = Burst(cluster, f"skew-{mode}-{first}-{cycle}-a")
        in_flight_at_pause.append(held_once_started(cluster, early))
        assert call(cluster, first, "pause_generation", {"mode": mode})[0] == 200
        late = Burst(cluster, f"skew-{mode}-{first}-{cycle}-b")  # meets one paused server
        _poll(lambda: requests_held(cluster) > 0, 2.0)
        assert call(cluster, second, "pause_generation", {"mode": mode})[0] == 200
        assert call(cluster, first, "continue_generation")[0] == 200
        after = Burst(cluster, f"skew-{mode}-{first}-{cycle}-c")  # one server still paused
        if mode == "abort":
            # issue 13 hole 1: the copies `first` serves wait for the peer's handshake
            # or KV while the other copies wait at `second`'s pause gate; `second`
            # aborts those (abort_all: a client or gateway giving up): `first` must
            # hear of it at once, whatever the pause order
            ended_at_gate = _end_at_gate(cluster, first, second, (late, after), cycle)
            gate_ends.append(ended_at_gate)
        else:
            _poll(lambda: requests_held(cluster) > 0, 2.0)
        assert call(cluster, second, "continue_generation")[0] == 200
        for b in (early, late, after):
            b.join(ANSWER_AFTER_CONTINUE_S + 30)
            judge(b, control, mode, outcomes, (mode, first, cycle))
        assert_baseline(cluster, baseline)
    busy = sum(1 for n in in_flight_at_pause if n)
    assert busy >= MIN_CYCLES_IN_FLIGHT * cycles, in_flight_at_pause
    if mode == "abort":
        # each cycle ended requests at the gate while their copies waited on `first`
        assert len(gate_ends) == cycles and all(gate_ends), gate_ends
    print(f"skewed {mode} ({first} first): {outcomes}, held at each pause {in_flight_at_pause}, "
          f"copies waiting on {first} when {second}'s gate was aborted {gate_ends}")


GATE_END_TOLD_S = 1.5  # the "within a second" of the end, with a margin for 2 loaded cores


def _end_at_gate(cluster, first, second, bursts, cycle) -> int:
    """`bursts` (the one that met the first pause and the one sent while `first` runs and
    `second` is paused): wait until each of their open requests has its copy on `first`
    waiting for `second` and its other copy at `second`'s gate, abort everything on
    `second`, and assert `first` let go of those copies within GATE_END_TOLD_S. Returns
    how many copies were waiting. Both bursts count: the earlier one's copies held at the
    gate must not stand in for the later one's still on their way to it (an abort that
    missed them leaves their copies on `first` waiting until `second` continues)."""
    def all_waiting():
        open_now = sum(1 for burst in bursts for e in burst.ended if e is None)
        waiting = waiting_for_peer(cluster[first])
        # and `second`'s tokenizer holds their other copies (the balancer may still be
        # sending them): the abort must meet every one of them at the gate
        held = at_gate(cluster[second])
        return waiting if open_now > 0 and waiting >= open_now and held >= open_now else 0

    waiting = wait_until(all_waiting, 30, f"the burst's copies waiting on {first} (cycle {cycle})",
                         on_timeout=lambda: f"{cluster.resources(first)['queues']}, "
                                            f"at {second}'s gate: {at_gate(cluster[second])}")
    told = abort_gate_until_let_go(cluster[first], cluster[second], 10,
                                   f"{first} to let go of the copies ended at {second}'s gate (cycle {cycle})")
    assert told <= GATE_END_TOLD_S, (cycle, first, told)
    return waiting


def _poll(predicate, timeout: float) -> bool:
    """Bounded polling for a window worth waiting for (not an assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


SKEW_CYCLES = int(os.environ.get("PD_PAUSE_SKEW_CYCLES", "6"))
SKEW_CYCLES_MULTI_RANK = int(os.environ.get("PD_PAUSE_SKEW_CYCLES_TP", "3"))


def _skewed(cluster, control, mode, first):
    """_skewed_cycles, the cluster left running whatever happened (a failed cycle leaves a server paused)."""
    try:
        _skewed_cycles(cluster, control, mode, first, SKEW_CYCLES_MULTI_RANK if cluster.multi_rank else SKEW_CYCLES)
    finally:
        for role in PD_ROLES:
            call(cluster, role, "continue_generation")


@pytest.mark.parametrize("mode", ("in_place", "retract"))
@pytest.mark.parametrize("first", PD_ROLES)
def test_skewed_pause_windows(cluster, control, mode, first):
    _skewed(cluster, control, mode, first)


@pytest.mark.parametrize("first", PD_ROLES)
def test_skewed_pause_windows_abort_mode(cluster, control, first):
    """Issue 13 hole 1: decode's gate aborts a request whose prefill copy was let
    through; prefill must hear of it. Hangs without the room ledger's fix."""
    _skewed(cluster, control, "abort", first)


def test_abort_during_long_pause_is_answered_within_1s(cluster, control):
    baseline = assert_idle(cluster, PD_ROLES)
    try:
        _abort_during_long_pause(cluster, baseline)
    finally:  # leave the cluster running for the next test, whatever happened
        for role in PD_ROLES:
            call(cluster, role, "continue_generation")


def _abort_during_long_pause(cluster, baseline):
    """Half the open requests are aborted one after another while paused; they sit
    wherever the pause found them (prefill's pause gate, bootstrap or waiting queue,
    last batch or inflight queue; decode's prealloc, transfer or waiting queue or
    running batch), so one run covers several places."""
    burst = Burst(cluster, "long-pause", max_new_tokens=128)
    wait_until(lambda: in_flight(cluster), 30, "requests in flight")
    both(cluster, "pause_generation", {"mode": "in_place"})
    open_rids = [rid for rid, r in zip(burst.rids, burst.results) if r is None]
    assert open_rids, "every request finished before the pause"
    victims = [burst.rids.index(rid) for rid in open_rids[: max(1, len(open_rids) // 2)]]
    # A long pause: nothing moves, and the victims are still open 2 s later.
    time.sleep(LONG_PAUSE_S)  # the pause under test, not a synchronisation
    assert all(burst.results[v] is None for v in victims)
    answered = []
    for victim in victims:
        t0 = time.monotonic()
        for role in PD_ROLES:
            assert call(cluster, role, "abort_request", {"rid": burst.rids[victim]})[0] == 200
        wait_until(lambda: burst.ended[victim] is not None, 10, "the abort to be answered")
        answered.append(round(burst.ended[victim] - t0, 2))
        assert answered[-1] <= ABORT_ANSWER_S, (burst.rids[victim], answered)
        r = burst.results[victim]  # a client abort: upstream's answer, on any stage
        assert r["status"] == 200 and r["meta"]["finish_reason"]["type"] == "abort", r
        assert r["meta"]["finish_reason"].get("status_code") is None, r
    # Still paused: the others did not move on.
    for role in PD_ROLES:
        assert pause_report(cluster, role)[0]["paused"], role
    both(cluster, "continue_generation")
    for i, r in enumerate(burst.join()):
        if i not in victims:
            assert r["status"] == 200 and r["meta"]["finish_reason"]["type"] != "abort", r
    assert_baseline(cluster, baseline)
    print(f"{len(victims)} aborts answered during the pause in {answered} s")


REBOOTSTRAP_TOKENS = 400  # decode is still running the request when its pause retracts it
TRANSFER_FAILURES = ("sglang:num_bootstrap_failed_reqs_total", "sglang:num_transfer_failed_reqs_total")


def failures_counted(cluster) -> dict:
    from testing.pd_cluster import metric_sum

    return {(role, name): metric_sum(cluster.metrics(role), name) for role in PD_ROLES for name in TRANSFER_FAILURES}


def assert_rebootstrapped_request_completed(cluster, d_leg, t0, causes, failed_before, baseline) -> None:
    """The re-bootstrapped request's client (decode's leg) got the completion within ANSWER_AFTER_CONTINUE_S of `t0`;
    no end and no failure was counted on either server; nothing is held and serving continues."""
    from testing.pd_checks import cluster_end_causes, delta

    wait_until(d_leg.done, REQUEST_DEADLINE_S, "the re-bootstrapped request to be answered")
    answer = d_leg.response
    assert d_leg.status == 200, d_leg.out
    assert answer["meta_info"]["finish_reason"]["type"] == "length", answer["meta_info"]
    assert len(answer["output_ids"]) == REBOOTSTRAP_TOKENS
    assert d_leg.out["ended"] - t0 < ANSWER_AFTER_CONTINUE_S, d_leg.out["ended"] - t0
    # What was counted: no end on either server (a completion), no failure.
    assert delta(causes, cluster_end_causes(cluster)) == {}
    assert failures_counted(cluster) == failed_before
    # What is left held: nothing; serving continues.
    assert_idle(cluster, PD_ROLES, baseline)
    assert generate(cluster.url, "hello", max_new_tokens=8)["status"] == 200


def test_retract_rebootstrap_reaches_a_prefill_paused_with_the_first_leg(cluster):
    """Upstream's retract re-bootstrap re-sends a request decode retracted to its prefill
    (`/generate`, same rid and room). A prefill paused while that request's KV was on the
    wire used to keep its first leg (KV sent, not yet answered) until its own continue:
    decode continued first, its re-send met prefill's tokenizer still holding the rid (400
    "Duplicate request ID detected") and the client got 500 "PD retract rebootstrap
    /generate failed" (seen in the room-ledger soak). Now the paused prefill answers a leg
    whose KV reached decode at once: the re-send waits at prefill's pause gate, and the
    request completes after both continue."""
    import random
    import uuid

    from testing.pd_checks import Leg, cluster_end_causes, leg_body

    baseline = assert_idle(cluster, PD_ROLES)
    prefill, decode = cluster["prefill"], cluster["decode"]
    causes, failed_before = cluster_end_causes(cluster), failures_counted(cluster)
    rid = f"reboot-{uuid.uuid4().hex}"
    body = leg_body(cluster, random.getrandbits(62), "the lazy dog " * 60, REBOOTSTRAP_TOKENS, rid=rid,
                    ignore_eos=True)  # several 64-token chunks on the wire
    d_leg = Leg(decode.url, body)
    d_leg.start()
    paused = []
    try:
        wait_until(lambda: decode.resources()["queues"]["decode_transfer"] == 1, 30, "decode handshake")
        decode.freeze()  # prefill's KV cannot reach decode yet
        try:
            p_leg = Leg(prefill.url, body)
            p_leg.start()
            wait_until(lambda: prefill.resources()["queues"]["prefill_inflight"] == 1, 60, "prefill inflight")
            assert call(cluster, "prefill", "pause_generation", {"mode": "retract"})[0] == 200
            paused.append("prefill")
        finally:
            decode.resume()
        # The KV arrives while prefill is paused; decode runs the request, and retracts it.
        wait_until(lambda: decode.resources()["queues"]["running"] == 1, 60, "decode running")
        assert call(cluster, "decode", "pause_generation", {"mode": "retract"})[0] == 200
        paused.append("decode")
        wait_until(lambda: decode.resources()["queues"]["decode_held_rebootstrap"] == 1, 30, "decode retracted it")
        # What prefill answers while paused: its leg (KV sent), at once (bounded wait; asserted below).
        p_leg.join(10)
        first_leg = dict(p_leg.out, queues=prefill.resources()["queues"])
        assert pause_report(cluster, "prefill")[0]["paused"]
        # Decode continues first: its re-send reaches the still paused prefill.
        t0 = time.monotonic()
        for role in ("decode", "prefill"):
            assert call(cluster, role, "continue_generation")[0] == 200
            paused.remove(role)
    finally:
        for role in paused:
            call(cluster, role, "continue_generation")
    # What the client saw: the completion, in time (it was 500 "PD retract rebootstrap /generate failed").
    assert_rebootstrapped_request_completed(cluster, d_leg, t0, causes, failed_before, baseline)
    # Prefill's first leg: answered while prefill was paused, as a completion.
    assert first_leg.get("status") == 200, first_leg
    assert first_leg["body"]["meta_info"]["finish_reason"]["type"] == "length", first_leg


def test_retract_rebootstrap_waits_while_prefills_tokenizer_holds_the_first_leg(cluster):
    """The same re-send reaching a prefill that is *not* paused but whose tokenizer still
    holds the first leg (its KV is on decode, its answer not through the detokenizer
    yet; under load, the next inflight poll and the detokenizer lag behind decode's
    continue): upstream's tokenizer refused it (400 "Duplicate request ID detected") and
    the client got 500 "PD retract rebootstrap /generate failed", or, when decode's
    scheduler read the room between upstream's abort() and its reason, a 200 abort
    "Aborted by the client." where nobody aborted (the room-ledger soak in CI). Now the
    re-send waits for the first leg's end and is served: the request completes."""
    import random
    import signal
    import uuid

    import psutil

    from testing.pd_checks import Leg, cluster_end_causes, leg_body

    baseline = assert_idle(cluster, PD_ROLES)
    prefill, decode = cluster["prefill"], cluster["decode"]
    detokenizer = [p for p in prefill.processes() if p.name().startswith("sglang::detoken")]
    assert len(detokenizer) == 1, [p.name() for p in prefill.processes()]
    detokenizer = detokenizer[0]
    causes, failed_before = cluster_end_causes(cluster), failures_counted(cluster)
    rid = f"reboot-held-{uuid.uuid4().hex}"
    body = leg_body(cluster, random.getrandbits(62), "the lazy dog " * 60, REBOOTSTRAP_TOKENS, rid=rid,
                    ignore_eos=True)
    d_leg = Leg(decode.url, body)
    d_leg.start()
    paused = []
    detokenizer.send_signal(signal.SIGSTOP)  # prefill's answers stay in its scheduler's output socket
    try:
        wait_until(lambda: detokenizer.status() == psutil.STATUS_STOPPED, 10, "prefill's detokenizer stopped")
        wait_until(lambda: decode.resources()["queues"]["decode_transfer"] == 1, 30, "decode handshake")
        p_leg = Leg(prefill.url, body)
        p_leg.start()
        # The KV reaches decode, which runs the request; prefill's first leg is done in its scheduler
        # but its tokenizer still holds the rid.
        wait_until(lambda: decode.resources()["queues"]["running"] == 1, 60, "decode running")
        wait_until(lambda: prefill.resources()["queues"]["prefill_inflight"] == 0, 30, "prefill's leg concluded")
        assert not p_leg.done(), p_leg.out
        assert call(cluster, "decode", "pause_generation", {"mode": "retract"})[0] == 200
        paused.append("decode")
        wait_until(lambda: decode.resources()["queues"]["decode_held_rebootstrap"] == 1, 30, "decode retracted it")
        assert call(cluster, "decode", "continue_generation")[0] == 200
        paused.remove("decode")
        # The re-send reaches prefill's tokenizer, which holds the first leg: it waits (upstream: 400 at once,
        # and decode answers the client).
        wait_until(lambda: prefill.resources()["rebootstrap_waiting"] == 1 or d_leg.done(), 30,
                   "the re-send waiting at prefill's tokenizer")
        assert not d_leg.done(), d_leg.out
    finally:
        detokenizer.send_signal(signal.SIGCONT)
        for role in paused:
            call(cluster, role, "continue_generation")
    t0 = time.monotonic()
    wait_until(p_leg.done, 10, "prefill's first leg answered once its detokenizer runs")
    assert p_leg.status == 200 and p_leg.response["meta_info"]["finish_reason"]["type"] == "length", p_leg.out
    assert_rebootstrapped_request_completed(cluster, d_leg, t0, causes, failed_before, baseline)
    assert prefill.resources()["rebootstrap_waiting"] == 0
