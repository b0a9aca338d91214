"""RL frameworks drive the fork unchanged: their exact call sequences on 1P1D.

The loops are those of the public RL frameworks that drive sglang (see
docs/pause-release-resume.md, "Using the fork from an RL framework"), replayed call
for call through the mini load balancer, swapping two tiny checkpoints of the same
shapes (testing/tiny_model.py, seeds 0 and 1) in and out:
- colocated (offload/onload): flush_cache, release {} with no pause, resume
  ["weights"], update_weights_from_disk with weight_version, resume ["kv_cache"],
  then the next rollout with no continue_generation;
- partial rollout: pause_generation {} (abort, upstream's default) while 12
  closed-loop clients run, update, continue_generation; every request ends as a
  completion or as upstream's abort answer (200, finish_reason "abort").
Reference outputs of each checkpoint come from a plain (non-PD) server.
"""

from __future__ import annotations

import http.client
import json
import random
import select
import signal
import threading
import time
from functools import partial

import pytest

from conftest import TINY_MODEL_DIR
from testing import pd_checks
from testing.pd_cluster import (
    Gateway,
    PDCluster,
    generate,
    generate_concurrently,
    http_get,
    http_post_json,
    prompts,
    wait_until,
)
from testing.pd_checks import PD_ROLES, Leg, assert_idle, cluster_end_causes, delta, held, leg_body, weight_versions
from testing.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.e2e

STEPS = 4
N_PROMPTS = 6
MAX_NEW_TOKENS = 16
CLIENTS = 12
REQUEST_DEADLINE_S = 90.0  # generous on 2 loaded cores; a hang is minutes
CALL_TIMEOUT_S = 120.0
BUSY_NEW_TOKENS = 900  # a request that keeps decode busy for seconds (the tiny model's context is 1024)


@pytest.fixture(scope="module")
def checkpoints(tiny_model):
    second = ensure_tiny_model(TINY_MODEL_DIR.parent / "tiny-llama-seed1", seed=1)
    return {"A": str(tiny_model), "B": str(second)}


@pytest.fixture(scope="module")
def pd_deployment(checkpoints, shared_deployments, pd_deployment):
    """conftest's shared default 1P1D and control server, which serve checkpoint A;
    both are handed back serving A (the claims check it when the module ends)."""
    assert checkpoints["A"] == shared_deployments.model
    return pd_deployment


@pytest.fixture(scope="module")
def cluster(pd_cluster) -> PDCluster:
    return pd_cluster


@pytest.fixture(scope="module")
def reference(pd_deployment, checkpoints):
    """{checkpoint: {prompt: output_ids}} from the plain server, loading each in turn
    (and A again: the shared server is handed back as it was taken)."""
    single = pd_deployment[1]
    texts = prompts(N_PROMPTS)
    ref = {}
    for name in ("A", "B", "A"):  # the shared server is handed back with A loaded
        if name != "A" or ref:
            status, reply = http_post_json(
                f"{single.url}/update_weights_from_disk",
                {"model_path": checkpoints[name]}, timeout=CALL_TIMEOUT_S)
            assert status == 200 and reply["success"], reply
        if name in ref:
            continue
        out = generate_concurrently(single.url, texts, max_new_tokens=MAX_NEW_TOKENS)
        assert all(r["status"] == 200 for r in out), out
        ref[name] = {t: r["output_ids"] for t, r in zip(texts, out)}
    differing = [t for t in texts if ref["A"][t] != ref["B"][t]]
    assert len(differing) == len(texts), "the two checkpoints must answer differently"
    yield ref
    # the tests swap the checkpoints on the shared 1P1D: hand it back with A loaded
    cluster = pd_deployment[0]
    if _loaded(cluster, ref) != "A":
        update(cluster, checkpoints, "A", "A", [])


# the control calls, with the time a framework gives them
call = partial(pd_checks.call, timeout=CALL_TIMEOUT_S)
on_both = partial(pd_checks.on_both, timeout=CALL_TIMEOUT_S)


def flush_polled(url, attempts=60, interval=0.5):
    """The framework's flush: GET /flush_cache until 200 (it retries up to 60 times)."""
    wait_until(lambda: http_get(f"{url}/flush_cache", timeout=30)[0] == 200, attempts * interval,
               f"{url}/flush_cache 200", interval=interval)


def flush_until_ok(cluster, role, attempts=60):
    flush_polled(cluster[role].url, attempts)


def update(cluster, checkpoints, name, version, log):
    body = {"model_path": checkpoints[name], "weight_version": version}
    results = on_both(cluster, "update_weights_from_disk", body, log)
    for role, (_, reply, _) in results.items():
        assert reply["success"], (role, reply)
    assert weight_versions(cluster) == {r: version for r in PD_ROLES}


def rollout(cluster, reference, name):
    texts = list(reference[name])
    out = generate_concurrently(cluster.url, texts, max_new_tokens=MAX_NEW_TOKENS,
                                timeout=REQUEST_DEADLINE_S)
    other = "B" if name == "A" else "A"
    for t, r in zip(texts, out):
        assert r["status"] == 200 and r["meta"]["finish_reason"]["type"] != "abort", r
        assert r["output_ids"] == reference[name][t], (name, t)
        assert r["output_ids"] != reference[other][t], (name, t)


_requests_held = pd_checks.requests_held


def pause_state(cluster, role):
    return cluster.resources(role)["pause"]


def test_colocated_loop_release_without_pause_per_tag_resume(cluster, checkpoints, reference):
    """flush -> release {} (no pause) -> resume ["weights"] -> update -> resume
    ["kv_cache"] -> rollout, no continue; step 0 is a restarted engine (released and
    resumed with ["weights"] before its first update). One request sent while memory
    is released is held at the gate and served after the resume, with the new weights."""
    baseline = assert_idle(cluster, PD_ROLES)
    log = []
    loaded = "A"
    for step in range(STEPS):
        if step:
            rollout(cluster, reference, loaded)
        for role in PD_ROLES:
            flush_until_ok(cluster, role)
        on_both(cluster, "release_memory_occupation", {}, log)
        held_req = {}
        if step == 1:
            text = list(reference["A"])[0]
            t = threading.Thread(target=lambda: held_req.update(
                r=generate(cluster.url, text, max_new_tokens=MAX_NEW_TOKENS,
                           timeout=REQUEST_DEADLINE_S)), daemon=True)
            t.start()
        for role in PD_ROLES:  # released: nothing registered with the transfer engine
            assert cluster.resources(role)["te_registration"]["registered_regions"] == 0
        on_both(cluster, "resume_memory_occupation", {"tags": ["weights"]}, log)
        loaded = "B" if loaded == "A" else "A"
        update(cluster, checkpoints, loaded, f"step-{step}", log)
        if step == 1:
            assert "r" not in held_req, held_req  # held while kv_cache is released
        on_both(cluster, "resume_memory_occupation", {"tags": ["kv_cache"]}, log)
        if step == 1:
            t.join(REQUEST_DEADLINE_S)
            r = held_req["r"]
            assert r["status"] == 200 and r["output_ids"] == reference[loaded][text], r
        for role in PD_ROLES:
            assert pause_state(cluster, role)["paused"] is False, role
    rollout(cluster, reference, loaded)
    assert weight_versions(cluster) == {r: f"step-{STEPS - 1}" for r in PD_ROLES}
    assert_idle(cluster, PD_ROLES, baseline=baseline)
    assert all(status == 200 for _, _, status, _ in log)
    print("colocated loop calls (role, call, status, s):", log)


def test_release_with_kv_cache_tag_only(cluster, reference):
    """release {"tags": ["kv_cache"]} then resume {"tags": ["kv_cache"]}: serving again."""
    baseline = assert_idle(cluster, PD_ROLES)
    loaded = _loaded(cluster, reference)
    on_both(cluster, "release_memory_occupation", {"tags": ["kv_cache"]})
    status, reply, _ = call(cluster, "prefill", "resume_memory_occupation", {"tags": ["weights"]})
    assert status == 409 and "['weights'] not released" in str(reply), reply
    on_both(cluster, "resume_memory_occupation", {"tags": ["kv_cache"]})
    rollout(cluster, reference, loaded)
    assert_idle(cluster, PD_ROLES, baseline=baseline)


def _loaded(cluster, reference):
    text = list(reference["A"])[0]
    r = generate(cluster.url, text, max_new_tokens=MAX_NEW_TOKENS)
    assert r["status"] == 200, r
    return "A" if r["output_ids"] == reference["A"][text] else "B"


def test_release_without_pause_on_a_busy_engine_is_409_and_changes_nothing(cluster, reference):
    """release_memory_occupation with no pause while decode serves is 409 and changes
    nothing. The race with the requests finishing first is always won: one PD request is
    held on decode (its decode leg sent alone, waiting for its prefill leg, which the test
    sends only after the release call), besides the running ones."""
    baseline = assert_idle(cluster, PD_ROLES)
    loaded = _loaded(cluster, reference)
    texts = list(reference[loaded])
    results = {}
    room = random.getrandbits(62)
    held_body = leg_body(cluster, room, "held for the release: hello world", MAX_NEW_TOKENS,
                         rid=f"held-{room}", ignore_eos=True)
    held_legs = [Leg(cluster["decode"].url, held_body, timeout=REQUEST_DEADLINE_S)]
    held_legs[0].start()
    wait_until(lambda: pd_checks.waiting_for_peer(cluster["decode"]) == 1, 30, "decode holding the held leg")

    def run():  # each runs to its 900th token (seconds), far past the release's 1 s settle
        results["out"] = generate_concurrently(cluster.url, texts, max_new_tokens=BUSY_NEW_TOKENS,
                                               sampling={"ignore_eos": True}, timeout=REQUEST_DEADLINE_S)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    wait_until(lambda: held(cluster.resources("decode"))["queue.running"] > 0, 30, "requests running on decode")
    status, reply, took = call(cluster, "decode", "release_memory_occupation", {})
    held_legs.append(Leg(cluster["prefill"].url, dict(held_body), timeout=REQUEST_DEADLINE_S))
    held_legs[1].start()  # let the held request go
    t.join(REQUEST_DEADLINE_S)
    assert not t.is_alive()
    for leg in held_legs:
        leg.join(REQUEST_DEADLINE_S)
        assert leg.done(), leg.body
    if status == 200:
        assert call(cluster, "decode", "resume_memory_occupation", {})[0] == 200
    assert status == 409, (status, reply, took)
    assert "request(s) in flight" in str(reply) and "call pause_generation first" in str(reply)
    assert pause_state(cluster, "decode")["paused"] is False
    for r in results["out"]:  # nothing changed: every request completes
        assert r["status"] == 200 and r["meta"]["finish_reason"]["type"] == "length", r
    for leg in held_legs:  # the held one too, on both servers
        assert leg.status == 200 and leg.response["meta_info"]["finish_reason"]["type"] == "length", leg.out
    assert_idle(cluster, PD_ROLES, baseline=baseline)
    rollout(cluster, reference, loaded)


def test_partial_rollout_abort_pause_with_12_clients(cluster, checkpoints, reference):
    """12 closed-loop clients; per step: pause {} (abort) on both while requests run,
    update, continue. Every request ends within the deadline as a completion (of one
    of the checkpoints) or upstream's abort answer; none 499/503."""
    baseline = assert_idle(cluster, PD_ROLES)
    loaded = _loaded(cluster, reference)
    texts = list(reference["A"])
    stop = threading.Event()
    results, lock = [], threading.Lock()

    def client(i):
        k = 0
        while not stop.is_set() and k < 200:
            text = texts[(i + k) % len(texts)]
            r = generate(cluster.url, text, max_new_tokens=MAX_NEW_TOKENS,
                         timeout=REQUEST_DEADLINE_S + 30, rid=f"pr-{i}-{k}")
            with lock:
                results.append((text, r))
            k += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    log, in_flight_at_pause = [], []
    try:
        for step in range(STEPS):
            wait_until(lambda: _requests_held(cluster), 30, "requests in flight")
            in_flight_at_pause.append(_requests_held(cluster))
            on_both(cluster, "pause_generation", {}, log)
            loaded = "B" if loaded == "A" else "A"
            update(cluster, checkpoints, loaded, f"partial-{step}", log)
            on_both(cluster, "continue_generation", {}, log)
            n = len(results)
            wait_until(lambda: len(results) >= n + CLIENTS, REQUEST_DEADLINE_S,
                       "requests to complete after continue")
    finally:
        stop.set()
        deadline = time.monotonic() + REQUEST_DEADLINE_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    hung = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"clients still waiting {REQUEST_DEADLINE_S}s after the last step: {hung}"
    counts = {"completed": 0, "aborted": 0, "naming the pause": 0}
    for text, r in results:
        assert r["status"] == 200, r  # never 499 / 503 / 500
        reason = r["meta"]["finish_reason"]
        if reason["type"] == "abort":
            assert reason.get("status_code") is None, r
            assert reason["message"].startswith("Abort"), r  # "Aborted …" / upstream's "Abort in …"
            counts["aborted"] += 1
            counts["naming the pause"] += "pause_generation(mode=abort)" in reason["message"]
        else:
            assert r["output_ids"] in (reference["A"][text], reference["B"][text]), r
            counts["completed"] += 1
    assert counts["aborted"] > 0, (counts, in_flight_at_pause)
    assert_idle(cluster, PD_ROLES, baseline=baseline)
    rollout(cluster, reference, loaded)
    print(f"partial rollout: {counts}, held at each pause {in_flight_at_pause}, calls {log}")


def test_release_during_in_place_pause_ends_queued_requests_as_aborts(cluster, reference):
    """Release during an in_place/retract pause ends what sits in the PD queues with
    upstream's abort answer (200, finish_reason "abort", a message naming the
    release); what runs is retracted and completes after continue. Decode is frozen
    while the requests arrive, so their prefill copies are certainly waiting in
    prefill's bootstrap queue (no handshake can come) when prefill is paused."""
    baseline = assert_idle(cluster, PD_ROLES)
    loaded = _loaded(cluster, reference)
    texts = prompts(8)
    prefill, decode = cluster["prefill"], cluster["decode"]
    for mode in ("in_place", "retract"):
        out = {}
        before = cluster_end_causes(cluster)

        def run():
            out["r"] = generate_concurrently(cluster.url, texts, max_new_tokens=64,
                                             timeout=REQUEST_DEADLINE_S)

        decode.freeze()
        try:
            t = threading.Thread(target=run, daemon=True)
            t.start()
            wait_until(lambda: held(prefill.resources()).get("queue.prefill_bootstrap", 0) == len(texts),
                       30, "every prefill copy in prefill's bootstrap queue")
            status, reply, _ = call(cluster, "prefill", "pause_generation", {"mode": mode})
            assert status == 200, (mode, status, reply)
        finally:
            decode.resume()
        status, reply, _ = call(cluster, "decode", "pause_generation", {"mode": mode})
        assert status == 200, (mode, status, reply)
        on_both(cluster, "release_memory_occupation", {})
        on_both(cluster, "resume_memory_occupation", {})
        on_both(cluster, "continue_generation", {})
        t.join(REQUEST_DEADLINE_S)
        assert not t.is_alive(), "requests unanswered"
        aborted = 0
        for r in out["r"]:
            assert r["status"] == 200, r
            reason = r["meta"]["finish_reason"]
            if reason["type"] == "abort":
                assert reason.get("status_code") is None, r
                assert "engine memory released" in reason["message"], r
                aborted += 1
        assert aborted == len(texts), (mode, [r["meta"]["finish_reason"] for r in out["r"]])
        assert_idle(cluster, PD_ROLES, baseline=baseline)
        moved = delta(before, cluster_end_causes(cluster))  # counted as the pause's ends
        assert moved and not [k for k in moved if k[1] != "pause"], (mode, moved)
    rollout(cluster, reference, loaded)


# ----------------------------------------------------------------------------- health

# The gateway's probe timeout (sglang-router --health-check-timeout-secs, 5 s): a probe
# slower than that is a failed probe. Upstream's answer during a pause: 503 after its
# 20 s HEALTH_CHECK_TIMEOUT, and the server marked UnHealthy.
HEALTH_BOUND_S = 5.0
HEALTH_PATHS = ("/health_generate", "/health")


def probe(server, path):
    t0 = time.monotonic()
    status, body = http_get(f"{server.url}{path}", timeout=60)
    return status, time.monotonic() - t0


def assert_alive(cluster, what, log):
    for role in PD_ROLES:
        for path in HEALTH_PATHS:
            status, took = probe(cluster[role], path)
            log.append((what, role, path, status, round(took, 2)))
            assert status == 200 and took <= HEALTH_BOUND_S, log[-1]


def _back_to_running(cluster):
    """After a failed test: whatever it left paused or released serves again."""
    for role in PD_ROLES:
        call(cluster, role, "resume_memory_occupation", {})  # 409 when nothing is released
        call(cluster, role, "continue_generation", {})


def test_health_answers_at_once_during_pause_and_release(cluster, reference):
    """/health_generate and /health (the gateway's probe) answer 200 within the
    gateway's probe timeout on both servers in every state an RL step passes through:
    paused in each mode, released during a pause, resumed, released without a pause
    (colocated loop), weights resumed; afterwards the engine serves."""
    baseline = assert_idle(cluster, PD_ROLES)
    loaded = _loaded(cluster, reference)
    log = []
    try:
        for mode in ("abort", "in_place", "retract"):
            on_both(cluster, "pause_generation", {"mode": mode})
            assert_alive(cluster, f"paused ({mode})", log)
            on_both(cluster, "release_memory_occupation", {})
            assert_alive(cluster, f"released in pause ({mode})", log)
            on_both(cluster, "resume_memory_occupation", {})
            assert_alive(cluster, f"resumed in pause ({mode})", log)
            on_both(cluster, "continue_generation", {})
        on_both(cluster, "release_memory_occupation", {})
        assert_alive(cluster, "released without a pause", log)
        on_both(cluster, "resume_memory_occupation", {"tags": ["weights"]})
        assert_alive(cluster, "weights resumed", log)
        on_both(cluster, "resume_memory_occupation", {"tags": ["kv_cache"]})
        assert_alive(cluster, "running", log)
    except BaseException:
        _back_to_running(cluster)
        raise
    assert_idle(cluster, PD_ROLES, baseline=baseline)
    rollout(cluster, reference, loaded)
    print("health probes (state, role, path, status, s):", log)


def _scheduler(server):
    import psutil

    for pid in server.pids():
        try:
            if "sglang::scheduler" in " ".join(psutil.Process(pid).cmdline()):
                return psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no scheduler process in {server.role}'s tree")


def test_health_probe_waiting_when_the_pause_begins_answers(cluster, reference):
    """A probe whose one-token generation already went to the scheduler when the
    engine is paused (in_place: the generation is held, nothing comes back) answers 200
    within about a second of the pause, not 503 after upstream's 20 s. The scheduler
    is stopped while the probe and the pause reach it, so both certainly queue there
    in that order; the probe is seen unanswered before the pause is sent."""
    baseline = assert_idle(cluster, PD_ROLES)
    loaded = _loaded(cluster, reference)
    prefill = cluster["prefill"]
    scheduler = _scheduler(prefill)
    host, port = prefill.url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    scheduler.send_signal(signal.SIGSTOP)
    try:
        conn.request("GET", "/health_generate")
        # Nothing can answer it while the scheduler is stopped (upstream: its 20 s
        # timeout); seen unanswered for 2 s it is certainly in the route's wait loop.
        readable, _, _ = select.select([conn.sock], [], [], 2.0)
        assert not readable, "the probe was answered before the pause"
        status, reply, _ = call(cluster, "prefill", "pause_generation", {"mode": "in_place"})
        assert status == 200, reply
        t_pause = time.monotonic()
        response = conn.getresponse()
        answered_after = time.monotonic() - t_pause
    finally:
        scheduler.send_signal(signal.SIGCONT)
        conn.close()
        status, reply, _ = call(cluster, "prefill", "continue_generation", {})
    assert status == 200, reply
    assert response.status == 200 and answered_after <= HEALTH_BOUND_S, (response.status, answered_after)
    assert_alive(cluster, "after the cycle", [])
    assert_idle(cluster, PD_ROLES, baseline=baseline)
    rollout(cluster, reference, loaded)


PROBE_SEEN_S = 0.2  # a probe unanswered this long is in the route's 1 s wait (a busy scheduler dropped it)


def test_abort_pause_on_a_busy_engine_does_not_wait_for_a_health_probe(cluster, reference):
    """The gateway's /health on a busy decode: upstream's scheduler drops the probe (the running requests
    carry health) and the route holds it, and the tokenizer's model-update reader, until its 1 s sleep ends.
    An abort-mode pause sent meanwhile answers once the running requests' answers are decided, while the
    probe is still unanswered (it waited for the probe: up to 1 s per pause behind the gateway, which probes
    every 2 s); every request gets the pause's abort answer, and serving continues."""
    baseline = assert_idle(cluster, PD_ROLES)
    loaded = _loaded(cluster, reference)
    texts = list(reference[loaded])
    results = {}

    def run():  # each would run to its 900th token (seconds): all running when the pause comes
        results["out"] = generate_concurrently(cluster.url, texts, max_new_tokens=BUSY_NEW_TOKENS,
                                               sampling={"ignore_eos": True}, timeout=REQUEST_DEADLINE_S)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    wait_until(lambda: held(cluster.resources("decode"))["queue.running"] == len(texts), 30,
               "every request running on decode")
    host, port = cluster["decode"].url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("GET", "/health")
        readable, _, _ = select.select([conn.sock], [], [], PROBE_SEEN_S)
        assert not readable, "the probe was answered at once: decode's scheduler was not busy"
        status, reply, took = call(cluster, "decode", "pause_generation", {})
        probe_answered_first = bool(select.select([conn.sock], [], [], 0)[0])
        probe = conn.getresponse()
    finally:
        conn.close()
        resumed = call(cluster, "decode", "continue_generation", {})
    t.join(REQUEST_DEADLINE_S)
    assert not t.is_alive()
    assert status == 200 and resumed[0] == 200, (status, reply, resumed)
    assert not probe_answered_first, f"the pause ({took:.2f} s) answered only after the health probe"
    assert took < 1.0 - PROBE_SEEN_S and probe.status == 200, (took, probe.status)
    for r in results["out"]:
        reason = r["meta"]["finish_reason"]
        assert r["status"] == 200 and reason["type"] == "abort" and "pause_generation(mode=abort)" in \
            reason["message"], r
    assert_idle(cluster, PD_ROLES, baseline=baseline)
    rollout(cluster, reference, loaded)


# ----------------------------------------------------------------------------- pause aborts

PAUSE_ANSWER_S = 15.0  # every aborted leg answered within this of the pause (2 loaded cores)
OTHER_CAUSES = ("client_abort", "timeout", "transport", "peer_failure")


def _pairs(cluster, n, tag, max_new_tokens):
    """n PD requests sent leg by leg (the test plays the load balancer), so both
    servers' answers are seen."""
    bodies = []
    for i in range(n):
        room = random.getrandbits(62)
        body = leg_body(cluster, room, f"{tag} {i}: tell me a long story", max_new_tokens,
                        rid=f"{tag}-{i}-{room}")
        body["sampling_params"]["ignore_eos"] = True
        bodies.append(body)
    legs = []
    for body in bodies:
        legs += [Leg(cluster["prefill"].url, body), Leg(cluster["decode"].url, dict(body))]
    for leg in legs:
        leg.start()
    return legs


def _pause_abort_answer(leg) -> bool:
    body = leg.response
    reason = body.get("meta_info", {}).get("finish_reason", {}) if isinstance(body, dict) else {}
    return (leg.status == 200 and reason.get("type") == "abort" and reason.get("status_code") is None
            and "pause_generation(mode=abort)" in reason.get("message", ""))


def test_abort_pause_answers_name_the_pause_and_count_as_pause(cluster, reference):
    """pause_generation {} (abort) with PD requests running on decode and others just
    sent: every leg the pause ends, on prefill and on decode, is answered 200,
    finish_reason abort, no status, a message naming the pause (not the client-abort
    message), within PAUSE_ANSWER_S; the end-cause counter moves only under "pause";
    nothing is held; after continue the engine serves. Prefill is paused first: copies
    held at prefill's gate meanwhile are ended by decode's pause, whose ABORT carries the
    pause's message (upstream's names only the room), so prefill answers them as the
    pause's aborts and counts them under "pause" too, never "client_abort"."""
    baseline = assert_idle(cluster, PD_ROLES)
    loaded = _loaded(cluster, reference)
    before = cluster_end_causes(cluster)
    decode = cluster["decode"]
    running = _pairs(cluster, 6, "pa-run", 800)
    wait_until(lambda: held(decode.resources())["queue.running"] >= 6, 60, "6 requests running on decode")
    queued = _pairs(cluster, 6, "pa-new", 800)
    for role in PD_ROLES:
        status, reply, _ = call(cluster, role, "pause_generation", {})
        assert status == 200, (role, reply)
    t_paused = time.monotonic()
    try:
        for leg in running:
            leg.join(PAUSE_ANSWER_S)
        assert all(leg.done() for leg in running), [leg.out for leg in running if not leg.done()]
        late = [leg.ended_at - t_paused for leg in running if leg.ended_at > t_paused]
        assert max(late, default=0.0) <= PAUSE_ANSWER_S, late
        decode_legs = running[1::2]
        assert all(_pause_abort_answer(leg) for leg in decode_legs), [leg.out for leg in decode_legs]
        for leg in running[0::2]:  # prefill's legs had finished their part before the pause
            assert leg.status == 200, leg.out
        answered = [leg for leg in queued if leg.done()]
        decode_answered = [leg for leg in queued[1::2] if leg.done()]  # prefill's: see below
        assert all(_pause_abort_answer(leg) for leg in decode_answered), [leg.out for leg in decode_answered]
    finally:
        continued = [call(cluster, role, "continue_generation", {})[0] for role in PD_ROLES]
    assert continued == [200, 200], continued
    for i, leg in enumerate(queued):  # held at a pause gate: served after continue
        leg.join(REQUEST_DEADLINE_S)
        assert leg.done() and leg.status == 200, leg.out
        reason = leg.response["meta_info"]["finish_reason"]
        # either leg: served after continue, or ended by a pause (prefill's copy of a
        # request decode's pause ended is told why with decode's ABORT)
        assert reason["type"] == "length" or _pause_abort_answer(leg), leg.out
    # decode's legs that were running when the pause ended them count there, under
    # "pause" at stage decode_running (the scheduler exports a moment after the answer)
    running_key = ("decode", "pause", "decode_running")
    wait_until(lambda: delta(before, cluster_end_causes(cluster)).get(running_key, 0) >= len(decode_legs),
               10, f"{len(decode_legs)} running decode requests counted under {running_key}",
               on_timeout=lambda: str(delta(before, cluster_end_causes(cluster))))
    moved = delta(before, cluster_end_causes(cluster))
    print("end causes moved:", moved, "answered during the pause:", len(answered))
    assert not [k for k in moved if k[1] in OTHER_CAUSES], moved
    assert sum(v for k, v in moved.items() if k[1] == "pause") > 0, moved
    assert_idle(cluster, PD_ROLES, baseline=baseline)
    rollout(cluster, reference, loaded)


CONCURRENT_CYCLES = 3


def test_concurrent_abort_pauses_name_the_pause_in_every_abort(cluster, reference):
    """pause_generation {} on prefill and decode at once (a framework pausing every
    engine concurrently), while PD requests run on decode and others keep arriving (so
    decode admits new ones as the pause lands), several cycles. Every leg ended during a
    pause, on either server, is answered 200, finish_reason abort, no status, with the
    pause's message -- never upstream's bare "Aborted" (a request decode had just
    admitted was ended by upstream's abort_all with no reason) -- within PAUSE_ANSWER_S;
    the end-cause counter moves only under "pause"; nothing is held; after continue the
    engine serves."""
    baseline = assert_idle(cluster, PD_ROLES)
    loaded = _loaded(cluster, reference)
    before = cluster_end_causes(cluster)
    decode = cluster["decode"]
    ended_by_pause, other = [], []
    for cycle in range(CONCURRENT_CYCLES):
        running = _pairs(cluster, 8, f"cp{cycle}-run", 800)
        wait_until(lambda: held(decode.resources())["queue.running"] >= 8, 60,
                   f"8 requests running on decode (cycle {cycle})")
        arriving = []
        for wave in range(4):  # decode admits these while the pauses land
            arriving += _pairs(cluster, 2, f"cp{cycle}-new{wave}", 800)
        results = {}

        def pause(role):
            results[role] = call(cluster, role, "pause_generation", {})

        threads = [threading.Thread(target=pause, args=(role,)) for role in PD_ROLES]
        for t in threads:
            t.start()
        for t in threads:
            t.join(CALL_TIMEOUT_S)
        t_paused = time.monotonic()
        try:
            assert [results[r][0] for r in PD_ROLES] == [200, 200], results
            for leg in running:
                leg.join(PAUSE_ANSWER_S)
            assert all(leg.done() for leg in running), [leg.out for leg in running if not leg.done()]
        finally:
            continued = [call(cluster, role, "continue_generation", {})[0] for role in PD_ROLES]
        assert continued == [200, 200], continued
        for leg in running + arriving:
            leg.join(REQUEST_DEADLINE_S)
            assert leg.done() and leg.status == 200, leg.out
            reason = leg.response["meta_info"]["finish_reason"]
            if reason["type"] == "abort":
                (ended_by_pause if _pause_abort_answer(leg) else other).append(leg)
            else:
                assert reason["type"] == "length", leg.out
        late = [leg.ended_at - t_paused for leg in running if leg.ended_at > t_paused]
        assert max(late, default=0.0) <= PAUSE_ANSWER_S, late
    print("aborts naming the pause:", len(ended_by_pause), "other aborts:", len(other))
    assert not other, [leg.out for leg in other]
    assert ended_by_pause, "no leg was ended by the pauses"
    moved = delta(before, cluster_end_causes(cluster))
    print("end causes moved:", moved)
    assert not [k for k in moved if k[1] in OTHER_CAUSES], moved
    assert sum(v for k, v in moved.items() if k[1] == "pause") > 0, moved
    assert_idle(cluster, PD_ROLES, baseline=baseline)
    rollout(cluster, reference, loaded)


# ----------------------------------------------------------------------------- weights from tensors


def _tensor_payload(checkpoint_dir):
    """The checkpoint's weights as upstream's /update_weights_from_tensor payload, built
    the way RL frameworks build it: MultiprocessingSerializer over (name, tensor) pairs,
    one entry per TP rank, base64. Returns (tensors, payload): the tensors must outlive
    the call. On CPU the tensors travel in shared memory; torch's default sharing
    strategy ('file_descriptor') hands descriptors over a connection authenticated with
    this process's multiprocessing authkey, which a server process does not share
    (AuthenticationError in its scheduler), so the sender uses 'file_system' (named
    shared memory), as any CPU client must."""
    from safetensors.torch import load_file

    from sglang.srt.utils.common import MultiprocessingSerializer

    named = sorted(load_file(f"{checkpoint_dir}/model.safetensors").items())
    return named, [MultiprocessingSerializer.serialize(named, output_str=True)]


@pytest.fixture
def file_system_sharing():
    import torch.multiprocessing

    old = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    yield
    torch.multiprocessing.set_sharing_strategy(old)


def test_colocated_loop_weights_from_tensor(cluster, checkpoints, reference, file_system_sharing):
    """The colocated loop with the weight update from tensors (upstream 0.5.23's API:
    begin_weight_update -> update_weights_from_tensor with weight_version ->
    end_weight_update), on both servers, swapping the checkpoints twice: every call
    200, both servers report the version, and the next rollout's outputs are the new
    checkpoint's on prefill and decode."""
    baseline = assert_idle(cluster, PD_ROLES)
    loaded = _loaded(cluster, reference)
    log = []
    for step in range(2):
        target = "B" if loaded == "A" else "A"
        for role in PD_ROLES:
            flush_until_ok(cluster, role)
        on_both(cluster, "release_memory_occupation", {}, log)
        on_both(cluster, "resume_memory_occupation", {"tags": ["weights"]}, log)
        on_both(cluster, "begin_weight_update", {}, log)
        tensors, payload = _tensor_payload(checkpoints[target])
        body = {"serialized_named_tensors": payload, "flush_cache": True,
                "weight_version": f"tensor-{step}"}
        results = on_both(cluster, "update_weights_from_tensor", body, log)
        del tensors
        for role, (_, reply, _) in results.items():
            assert reply["success"], (role, reply)
        on_both(cluster, "end_weight_update", {}, log)
        assert weight_versions(cluster) == {r: f"tensor-{step}" for r in PD_ROLES}
        on_both(cluster, "resume_memory_occupation", {"tags": ["kv_cache"]}, log)
        rollout(cluster, reference, target)
        loaded = target
    assert_idle(cluster, PD_ROLES, baseline=baseline)
    print("colocated loop with tensors (role, call, status, s):", log)


# ---- The framework's exact call sequence, through the production gateway ----
REPLAY_STEPS = 10
GATEWAY_HEALTH_S = 2  # the gateway health-checks each worker this often during the loop
LONG_NEW_TOKENS = 400  # rollout requests still running when the rollout is aborted


@pytest.fixture(scope="module")
def framework_gateway(cluster):
    """The Rust gateway as the framework runs it: workers self-registered (POST /workers),
    each health-checked every GATEWAY_HEALTH_S seconds."""
    with Gateway.fronting(cluster, args=("--health-check-interval-secs", str(GATEWAY_HEALTH_S))) as gw:
        yield gw


def _worker_urls(gateway) -> list:
    """The framework's list of engines: the urls the gateway's GET /workers gives."""
    urls = sorted(w["url"] for w in gateway.workers())
    assert len(urls) == 2, urls
    return urls


def _post(url, path, body, log):
    status, reply = http_post_json(f"{url}/{path}", body, timeout=CALL_TIMEOUT_S)
    log.append((url[-5:], path, status))
    assert status == 200, (url, path, status, reply)  # the framework raises on anything else
    return reply


def _flush_polled(url, log):
    """The framework's flush as its engine client polls it: once a second, at most 60 times."""
    flush_polled(url, interval=1.0)
    log.append((url[-5:], "flush_cache", 200))


def _load(url) -> int:
    """What GET /v1/loads reports as still running or queued on this engine."""
    status, body = http_get(f"{url}/v1/loads?include=core,disagg,queues", timeout=10)
    assert status == 200, (url, status, body)
    total = 0
    for load in json.loads(body)["loads"]:
        total += int(load.get("num_running_reqs", 0)) + int(load.get("num_waiting_reqs", 0))
        total += sum(int(v) for k, v in (load.get("disaggregation") or {}).items() if k.endswith("_queue_reqs"))
    return total


@pytest.mark.parametrize("pause_body", [{}, {"mode": "retract"}], ids=["default-pause", "retract-pause"])
def test_framework_sequence_through_the_gateway_10_steps(cluster, checkpoints, reference, framework_gateway,
                                                         pause_body):
    """Call for call as the framework drives its engines, behind the gateway with health checks every 2 s:
    a rollout (some requests long), the rollout abort (abort_all on every worker url, /v1/loads polled until
    idle), the offload (flush polled, release {}), the onload of weights, the update (pause, flush polled,
    update_weights_from_disk with weight_version, the version read from /get_weight_version and /model_info of
    every worker, continue), the onload of the KV cache; then the next rollout. Every call 200; every rollout
    request a completion of the loaded checkpoint or upstream's abort answer; weight_version in each answer's
    meta_info the step's; both workers still healthy at the gateway."""
    gateway = framework_gateway
    baseline = assert_idle(cluster, PD_ROLES)
    urls = _worker_urls(gateway)
    texts = list(reference["A"])
    log, loaded, version, t0, aborted = [], "A", None, time.monotonic(), 0
    # at least REPLAY_STEPS steps, and as many more as it takes to run through two gateway health checks (a quiet
    # box runs the 10 steps in under 4 s)
    for step in range(4 * REPLAY_STEPS):
        # the rollout: short requests judged against the loaded checkpoint, long ones the abort will end
        long_out = {}
        longs = [threading.Thread(target=lambda i=i: long_out.update({i: generate(
            gateway.url, f"{texts[i]} and on", LONG_NEW_TOKENS, timeout=REQUEST_DEADLINE_S)}), daemon=True)
            for i in range(3)]
        for t in longs:
            t.start()
        out = generate_concurrently(gateway.url, texts, max_new_tokens=MAX_NEW_TOKENS, timeout=REQUEST_DEADLINE_S)
        for text, r in zip(texts, out):
            assert r["status"] == 200 and r["meta"]["finish_reason"]["type"] in ("length", "stop"), (step, r)
            assert r["output_ids"] == reference[loaded][text], (step, loaded, text)
            if version is not None:
                assert r["meta"]["weight_version"] == version, (step, r["meta"])
        # the rollout abort: abort_all on every worker, then /v1/loads until nothing runs
        for url in urls:
            _post(url, "abort_request", {"abort_all": True}, log)
        wait_until(lambda: all(_load(url) == 0 for url in urls), 30, "every worker idle after abort_all")
        for t in longs:
            t.join(REQUEST_DEADLINE_S)
            assert not t.is_alive()
        for r in long_out.values():
            assert pd_checks.is_completion_or_abort_answer(r), (step, r)
            if r["meta"]["finish_reason"]["type"] == "abort":  # the client's abort, named as such
                reason = r["meta"]["finish_reason"]
                assert pd_checks.is_client_abort(reason) and "by the client" in reason["message"], (step, reason)
                aborted += 1
        # offload: flush polled, release {} (no pause)
        for url in urls:
            _flush_polled(url, log)
            _post(url, "release_memory_occupation", {}, log)
        # onload the weights, then update them
        for url in urls:
            _post(url, "resume_memory_occupation", {"tags": ["weights"]}, log)
        loaded, version = ("B" if loaded == "A" else "A"), f"replay-{step}"
        for url in urls:
            _post(url, "pause_generation", pause_body, log)
        for url in urls:
            _flush_polled(url, log)
        for url in urls:
            reply = _post(url, "update_weights_from_disk",
                          {"model_path": checkpoints[loaded], "weight_version": version}, log)
            assert reply["success"], reply
        for url in urls:
            status, body = http_get(f"{url}/get_weight_version")
            assert status == 200 and json.loads(body)["weight_version"] == version, (url, status, body)
            status, body = http_get(f"{url}/model_info")
            assert status == 200 and json.loads(body)["weight_version"] == version, (url, status, body)
        for url in urls:
            _post(url, "continue_generation", {}, log)
        for url in urls:
            _post(url, "resume_memory_occupation", {"tags": ["kv_cache"]}, log)
        healthy = {w["url"]: w.get("is_healthy", True) for w in gateway.workers()}
        assert all(healthy.values()), (step, healthy)
        if step + 1 >= REPLAY_STEPS and time.monotonic() - t0 > 2 * GATEWAY_HEALTH_S:
            break
    else:
        pytest.fail(f"{4 * REPLAY_STEPS} steps did not span two gateway health checks")
    rollout(cluster, reference, loaded)
    assert all(status == 200 for _, _, status in log)
    assert aborted >= REPLAY_STEPS, f"only {aborted} rollout requests were still running at the rollout abort"
    # handed back serving A
    if loaded != "A":
        update(cluster, checkpoints, "A", "A", [])
    assert_idle(cluster, PD_ROLES, baseline=baseline)
    print(f"framework replay ({pause_body}): {step + 1} steps in {time.monotonic() - t0:.1f} s, {len(log)} calls, "
          f"{aborted} of {3 * (step + 1)} long requests aborted")
