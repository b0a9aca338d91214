"""RL weight-update steps behind the production Rust gateway (and the mini LB), over the shared 1P1D.

The partial-rollout loop of RL frameworks (docs/pause-release-resume.md, "Using the fork
from an RL framework"), driven one engine after the other as frameworks do (prefill
first, then decode, or the reverse): `pause_generation {}` (abort, upstream's default)
-> `update_weights_from_disk` (with and without `flush_cache`) -> `continue_generation`,
while closed-loop clients send through the gateway (`sglang_router.launch_router
--pd-disaggregation`, its defaults, engines registered with `POST /workers`). Upstream
answers every call 200 on an engine its abort-mode pause emptied; so must the fork.

The gateway is started in front of the shared default 1P1D (conftest.shared_pd), which
is handed back serving the same checkpoint.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import nullcontext

import pytest

from testing.pd_checks import PD_ROLES, ClosedLoop, assert_idle, assert_serves, weight_versions
from testing.pd_cluster import Gateway, http_post_json, wait_until

pytestmark = pytest.mark.e2e

CLIENTS = 8
CALL_TIMEOUT_S = 120.0
# An RL client waits on each answer: none may take longer, pause or not (measured: < 3 s).
ANSWER_BOUND_S = 20.0
# Each step: which engine gets each call first, and the update's flush_cache.
STEPS = (("prefill", True), ("decode", True), ("prefill", False), ("decode", False),
         *((("prefill", True), ("decode", True)) * 4))


@pytest.fixture(scope="module")
def cluster(shared_pd):
    return shared_pd.deployment


@pytest.fixture(scope="module")
def gateway(cluster):
    """The Rust gateway in front of the shared engines, each registered with POST /workers."""
    with Gateway.fronting(cluster) as gw:
        yield gw


class Preempted:
    """While active, the server's scheduler process runs in short bursts (SIGSTOP /
    SIGCONT: RUN_S running, STOP_S stopped), as a scheduler on a loaded 2-core box is
    preempted, while its HTTP process runs freely. The abort-mode pause's race needs
    the scheduler preempted right after it answered the aborted requests and before its
    loop's next pass; on an idle box the scheduler always wins it. Always continued on exit."""

    RUN_S, STOP_S = 0.0005, 0.01

    def __init__(self, server):
        tree = server.processes()
        procs = [p for p in tree if p.name().startswith("sglang::schedul")]
        assert len(procs) == 1, [p.name() for p in tree]
        self.proc = procs[0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.proc.send_signal(signal.SIGSTOP)
            self._stop.wait(self.STOP_S)
            self.proc.send_signal(signal.SIGCONT)
            self._stop.wait(self.RUN_S)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)
        self.proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("balancer", ("router", "mini"))
def test_abort_pause_update_continue_one_engine_after_the_other(cluster, balancer, tiny_model, request):
    """Per step, each call on one engine then the other (the order alternates): pause {}
    -> update_weights_from_disk (flush_cache true, then false) -> continue, with 8
    closed-loop clients through the balancer (the Rust gateway, or the shared 1P1D's mini
    LB); each pause call meets a scheduler preempted as on a loaded box (`Preempted`).
    Every call is 200 (the update `success`), both engines report the step's
    weight_version, every client answer is a completion or upstream's abort answer naming
    the pause, within the bound; the gateway charges no failure to either engine; nothing
    is held afterwards and serving continues."""
    gateway = request.getfixturevalue("gateway") if balancer == "router" else None
    url = gateway.url if gateway is not None else cluster.url  # the shared 1P1D's own balancer: the mini LB
    baseline = assert_idle(cluster, PD_ROLES)
    failures_before = gateway.failures() if gateway is not None else None
    calls, refused = [], []
    t_start = time.monotonic()
    loop = ClosedLoop(url, CLIENTS, max_new_tokens=16, timeout=CALL_TIMEOUT_S, ignore_eos=True).start()
    try:
        for step, (first, flush) in enumerate(STEPS):
            order = (first, "decode" if first == "prefill" else "prefill")
            done = loop.completed()
            wait_until(lambda: loop.completed() >= done + CLIENTS // 2, 120, f"completions before step {step}")
            version = f"gw-rl-{step}"
            for path, payload in (("pause_generation", {}),
                                  ("update_weights_from_disk", {"model_path": str(tiny_model),
                                                                "weight_version": version,
                                                                "flush_cache": flush}),
                                  ("continue_generation", {})):
                for role in order:
                    t0 = time.monotonic()
                    calls.append((step, role, path, "sent", round(t0 - t_start, 2)))
                    preempted = Preempted(cluster[role]) if path == "pause_generation" else nullcontext()
                    with preempted:
                        status, body = http_post_json(f"{cluster[role].url}/{path}", payload,
                                                      timeout=CALL_TIMEOUT_S)
                    calls.append((step, role, path, status, round(time.monotonic() - t_start, 2)))
                    if status != 200 or (isinstance(body, dict) and body.get("success") is False):
                        # what each server still holds right after the refusal
                        refused.append((step, role, path, status, body,
                                        {r: cluster.resources(r) for r in PD_ROLES}))
            assert not refused, [(s, r, p, st, b, {role: (rep["not_idle"], rep["queues"], rep["transfer_rooms"])
                                                    for role, rep in reports.items()})
                                 for s, r, p, st, b, reports in refused]
            assert weight_versions(cluster) == {r: version for r in PD_ROLES}, step
        done = loop.completed()
        wait_until(lambda: loop.completed() >= done + CLIENTS, 120, "completions after the last step")
    finally:
        loop.stop()
        for role in PD_ROLES:  # never hand the shared deployment back paused
            http_post_json(f"{cluster[role].url}/continue_generation", {}, timeout=CALL_TIMEOUT_S)
    print(f"calls {calls}; answers {dict(loop.summary())}")

    # Every control call answered 200 (the update succeeded, cache flushed when asked):
    # asserted after each step above, with what each server held right after a refusal.
    # What the clients saw: completions and the pause's abort answers, each in time.
    wrong = [(r["status"], r["finish"], round(r["t"] - t_start, 2), (r["meta"] or {}).get("id"),
              str(r["error"] or (r["meta"] or {}).get("finish_reason"))[:200])
             for r in loop.results
             if not (r["status"] == 200 and (r["finish"] == "length" or (
                 r["finish"] == "abort" and r["meta"]["finish_reason"].get("status_code") is None
                 and "pause_generation" in r["meta"]["finish_reason"]["message"])))]
    assert not wrong, wrong
    slow = sorted(round(r["latency"], 1) for r in loop.results if r["latency"] > ANSWER_BOUND_S)
    assert not slow, slow
    assert any(r["finish"] == "abort" for r in loop.results), "no request was in flight at a pause"
    # What was counted: the gateway charged no failure to either engine (the mini LB counts none).
    if gateway is not None:
        assert gateway.failures() == failures_before
    # What is left held: nothing; and serving continues (asserted above: completions after).
    assert_idle(cluster, PD_ROLES, baseline=baseline)


# ----------------------------------------------------------------------------- ends at a tokenizer, skewed pauses

SKEW_HELD = 4  # requests the skew holds, beside the one both tokenizers reject
TOO_MANY_TOKENS = 4096  # max_new_tokens beyond the tiny model's context (1024): each tokenizer rejects it (400)
UNANSWERED_S = 10.0
EMPTIED_S = 1.5  # "within about a second" on two loaded cores


@pytest.mark.parametrize("first", PD_ROLES)
def test_ends_at_a_tokenizer_under_skewed_pauses_through_the_gateway(cluster, gateway, first):
    """Issue 13's hole 1 through the Rust gateway for ends a tokenizer makes before its
    scheduler sees the request, with skewed pause windows: both engines paused in abort
    mode, released, resumed, and `first` continued before the other. The gateway sends
    the same body to both engines and waits for both legs. Then SKEW_HELD requests and
    one asking more tokens than the context are sent through it:
    - the running engine holds each accepted request's copy waiting for the other
      (prefill: bootstrap queue; decode: prealloc + transfer) and rejects the long one
      at its tokenizer (400); the paused engine's gate holds every other copy;
    - `/abort_request` by rid at the paused engine ends the accepted ones at its gate
      (its tokenizer, before its scheduler): the running engine lets go of their copies
      within about a second (the room ledger tells it), each client gets 200 abort;
    - continue: the paused engine's tokenizer rejects the long one too, and its client
      gets the 400 upstream gives.
    Every answer within 10 s; the gateway charges no failure; nothing held; serving continues."""
    from testing.pd_checks import at_gate, cluster_end_causes, delta, post, start_legs, waiting_for_peer

    prefill, decode = cluster["prefill"], cluster["decode"]
    running, paused = (prefill, decode) if first == "prefill" else (decode, prefill)
    baseline = assert_idle(cluster, PD_ROLES)
    failures_before = gateway.failures()
    causes_before = cluster_end_causes(cluster)
    tag = f"tokenizer-{first}-{time.monotonic_ns()}"
    accepted = [{"rid": f"{tag}-{i}", "text": f"held by the skew {i}: hello world",
                 "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}} for i in range(SKEW_HELD)]
    too_long = {"rid": f"{tag}-long", "text": "more tokens than the context: hello world",
                "sampling_params": {"temperature": 0.0, "max_new_tokens": TOO_MANY_TOKENS}}

    def ok(server, endpoint, body=None):
        status, reply, _ = post(server, endpoint, body)
        assert status == 200, (server.role, endpoint, status, reply)

    try:
        for endpoint, body in (("pause_generation", {"mode": "abort"}), ("release_memory_occupation", None),
                               ("resume_memory_occupation", None)):
            ok(running, endpoint, body)
            ok(paused, endpoint, body)
        ok(running, "continue_generation")
        legs = start_legs(gateway.url, accepted + [too_long])
        wait_until(lambda: waiting_for_peer(running) == SKEW_HELD and at_gate(paused) == SKEW_HELD + 1, 30,
                   f"the accepted copies waiting at {first}, every copy at the other's gate",
                   on_timeout=lambda: f"{running.resources()['queues']}, at the gate: {at_gate(paused)}")
        t_end = time.monotonic()
        for body in accepted:
            ok(paused, "abort_request", {"rid": body["rid"]})
        wait_until(lambda: waiting_for_peer(running) == 0, 5, f"{first} to let go of the accepted copies",
                   interval=0.05, on_timeout=lambda: str(running.resources()["queues"]))
        emptied = time.monotonic() - t_end
        for leg in legs[:-1]:
            leg.join(5)
        assert at_gate(paused) == 1  # the long one only
    finally:
        for server in (paused, running):  # never hand the shared deployment back paused
            http_post_json(f"{server.url}/continue_generation", {}, timeout=CALL_TIMEOUT_S)
    legs[-1].join(UNANSWERED_S)
    answers = [(leg.body["rid"], leg.status, round(leg.out.get("seconds", -1), 2), str(leg.response)[:300])
               for leg in legs]
    print(f"{first} first: emptied {emptied:.2f}s; answers {answers}")

    # What the clients saw: one clean answer each, within the bound.
    assert all(leg.done() for leg in legs), answers
    for leg in legs[:-1]:  # upstream's abort answer, naming the client's abort
        reason = leg.response["meta_info"]["finish_reason"] if leg.status == 200 else None
        assert reason is not None and reason["type"] == "abort" and reason.get("status_code") is None, answers
        assert reason["message"].startswith("Aborted by the client"), answers
    long_leg = legs[-1]
    assert long_leg.status == 400 and "context length" in str(long_leg.response), answers
    assert max(leg.out["seconds"] for leg in legs) <= UNANSWERED_S, answers
    # How long: the running engine let go of the copies within about a second of their end.
    assert emptied <= EMPTIED_S, emptied
    # What was counted: the gateway charged neither engine (200 aborts and a 4xx are no
    # failures); the running engine ended each accepted copy in its waiting stage as the
    # client's abort, and nothing else ended in a scheduler (the long one never reached one).
    assert gateway.failures() == failures_before
    stages = {"prefill": ("prefill_bootstrap",), "decode": ("decode_prealloc", "decode_transfer")}[first]
    moved = {}

    def counted():
        moved.update(d=delta(causes_before, cluster_end_causes(cluster)))
        return (sum(moved["d"].values()) == SKEW_HELD
                and all(role == first and cause == "client_abort" and stage in stages
                        for role, cause, stage in moved["d"]))

    wait_until(counted, 10, "the end causes counted", on_timeout=lambda: str(moved))
    # What is left held: nothing; and serving continues.
    assert_idle(cluster, PD_ROLES, baseline)
    assert_serves(gateway.url, 2)
