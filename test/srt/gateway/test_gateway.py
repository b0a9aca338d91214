"""1P1D behind the production Rust gateway (sglang-router, `launch_router
--pd-disaggregation` without `--mini-lb`, its default retries / circuit breaker /
health checks), engines self-registered with `POST /workers` as RL frameworks do.

One deployment for the module (conftest.gateway_deployment: the gateway cluster, a
mini LB over the same engines, a plain control server); each test starts by checking
the deployment is idle.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from testing.pd_checks import PD_ROLES, ClosedLoop, assert_idle, held
from testing.pd_cluster import (
    generate_concurrently,
    http_post_json,
    metric_sum,
    prompts,
    wait_until,
)

pytestmark = pytest.mark.e2e

N_REQUESTS = 20
MAX_NEW_TOKENS = 32
BURST_DEADLINE_S = 90.0  # generous for a loaded 2-core machine (measured: 2-12 s)


# A client request through the gateway is answered within this, whatever happens to
# the engines (the gateway's 5 attempts, each ended by the engines within seconds).
ANSWER_BOUND_S = 30.0
SERVING_AFTER_REGISTRATION_S = 15.0


def test_engines_registered_themselves(gateway_deployment):
    cluster, _, _ = gateway_deployment
    workers = {w["worker_type"]: w for w in cluster.gateway.workers()}
    assert set(workers) == set(PD_ROLES), workers
    for role in PD_ROLES:
        assert workers[role]["url"] == cluster[role].url
        assert workers[role]["is_healthy"] is True
    assert workers["prefill"]["bootstrap_port"] == cluster.bootstrap_port


def test_burst_through_gateway_matches_mini_lb_and_single_server(gateway_deployment):
    cluster, mini, single = gateway_deployment
    baseline = assert_idle(cluster, PD_ROLES)
    texts = prompts(N_REQUESTS)

    t0 = time.monotonic()
    via_gateway = generate_concurrently(cluster.url, texts, max_new_tokens=MAX_NEW_TOKENS)
    burst_s = time.monotonic() - t0
    via_mini = generate_concurrently(mini.url, texts, max_new_tokens=MAX_NEW_TOKENS)
    reference = generate_concurrently(single.url, texts, max_new_tokens=MAX_NEW_TOKENS)

    # What the client saw: the same token ids on all three paths.
    for name, results in (("gateway", via_gateway), ("mini", via_mini), ("single", reference)):
        failed = [(i, r["status"], r["error"]) for i, r in enumerate(results) if r["status"] != 200]
        assert not failed, (name, failed)
    for i, (gw, mn, ref) in enumerate(zip(via_gateway, via_mini, reference)):
        assert gw["output_ids"], i
        assert gw["output_ids"] == mn["output_ids"] == ref["output_ids"], (i, texts[i])
        assert gw["meta"]["finish_reason"] == ref["meta"]["finish_reason"], i

    # How long it took.
    assert burst_s < BURST_DEADLINE_S, burst_s

    # What is left held: nothing beyond the idle baseline on either engine.
    after = assert_idle(cluster, PD_ROLES, baseline=baseline)
    for role in PD_ROLES:
        assert held(after[role]) == held(baseline[role]), role

    # What was counted: the gateway saw no failure and kept every circuit closed.
    metrics = cluster.gateway.metrics()
    assert metric_sum(metrics, "smg_worker_retries_exhausted_total") == 0
    assert cluster.gateway.circuit_states() == {"prefill": 0.0, "decode": 0.0}
    failures = cluster.gateway.failures(metrics)
    for role in PD_ROLES:
        assert failures[role] == 0.0, role


def test_decode_killed_removed_restarted_registered_serves_within_15s(gateway_deployment):
    """The RL framework's supervision of a crashed decode, behind the gateway with its
    defaults, right after an abort-mode RL step (pause_generation {} on both engines ->
    continue_generation: the prefill answers the pause's aborts, as in the case seen
    once where every request then got 503 "No available prefill workers"): kill ->
    DELETE /workers/{id} -> restart on the same port -> POST /workers. Requests in
    flight and the gateway's retries end within seconds (the retries that reached
    prefill while the dead decode was still listed: lost_handshake.before_pop_bootstrapped), the
    prefill's circuit never opens, and within 15 s of the registration the deployment
    serves again."""
    cluster, _, _ = gateway_deployment
    assert_idle(cluster, PD_ROLES)
    prefill_opened = cluster.gateway.circuit_opens()["prefill"]
    loop = ClosedLoop(cluster.url, 4).start()
    try:
        wait_until(lambda: loop.completed() >= 8, 120, "8 completions before the RL step")
        for path in ("/pause_generation", "/continue_generation"):
            for role in PD_ROLES:
                status, body = http_post_json(cluster[role].url + path, {}, timeout=60)
                assert status == 200, (role, path, body)
        aborts = sum(r["finish"] == "abort" for r in loop.results)
        done = loop.completed()
        wait_until(lambda: loop.completed() >= done + 4, 120, "4 completions after the RL step")
        cluster["decode"].kill()
        t_kill = time.monotonic()
        # The supervisor notices the crash later than the gateway retries: a retry
        # reaches prefill with a decode leg the dead decode refused (an orphan waiting
        # for a handshake that never comes) before the dead decode is removed.
        wait_until(lambda: held(cluster.resources("prefill"))["queue.prefill_bootstrap"] >= 1, 30,
                   "a gateway retry to wait on prefill for the dead decode")
        cluster.gateway.deregister_worker("decode")
        cluster["decode"].start()
        cluster["decode"].wait_healthy()
        cluster.gateway.register_worker("decode")
        t_reg = time.monotonic()

        def serving():
            burst = generate_concurrently(cluster.url, prompts(4), max_new_tokens=8, timeout=15)
            return all(r["status"] == 200 for r in burst)

        wait_until(serving, SERVING_AFTER_REGISTRATION_S, "the deployment to serve after registration",
                   interval=0.5, on_timeout=lambda: str(cluster.gateway.circuit_states()))
        serving_s = time.monotonic() - t_reg
        n_before = len(loop.results)
        wait_until(lambda: sum(r["status"] == 200 for r in loop.results[n_before:]) >= 4, 60,
                   "the closed-loop clients to complete again")
    finally:
        loop.stop()
    failures = cluster.gateway.failures()
    print(f"abort answers of the RL step {aborts}; "
          f"kill->registration {t_reg - t_kill:.1f}s, serving {serving_s:.1f}s after registration; "
          f"{dict(loop.summary())}; gateway failures {failures}")

    # What the clients saw: completions, and during the outage the gateway's answers
    # for a lost decode (502) or no decode (503) -- each within the bound, none hanging.
    slow = [(r["status"], round(r["latency"], 1), str(r["error"])[:120])
            for r in loop.results if r["latency"] > ANSWER_BOUND_S or r["status"] is None]
    assert not slow, slow
    assert {r["status"] for r in loop.results} <= {200, 502, 503}, loop.summary()
    # How long: serving again within 15 s of the registration (asserted by wait_until).
    assert serving_s <= SERVING_AFTER_REGISTRATION_S
    # What was counted: the prefill's circuit never opened; both circuits closed now.
    assert cluster.gateway.circuit_opens()["prefill"] == prefill_opened
    assert cluster.gateway.circuit_states() == {"prefill": 0.0, "decode": 0.0}
    # What is left held: nothing, on either engine.
    assert_idle(cluster, PD_ROLES)


def _charged(gateway) -> tuple:
    """What the gateway has counted against each engine, from one metrics read:
    (failures, circuit opens), each by role."""
    metrics = gateway.metrics()
    return gateway.failures(metrics), gateway.circuit_opens(metrics)


def _assert_nothing_charged(gateway, before: tuple) -> None:
    """Since `before` (`_charged` then): no failure counted against either engine, no
    circuit opened; both circuits closed now."""
    failures, opens = _charged(gateway)
    for role in PD_ROLES:
        assert failures[role] == before[0][role], role
        assert opens[role] == before[1][role], role
    assert gateway.circuit_states() == {"prefill": 0.0, "decode": 0.0}


PAUSE_CYCLES = 3
PAUSE_CLIENTS = 8
# An RL client waits on each answer: none may take longer, pause or not.
PAUSE_ANSWER_BOUND_S = 10.0


def test_rl_pause_cycles_never_open_a_circuit(gateway_deployment, tiny_model):
    """Partial rollout behind the gateway with its defaults: 8 closed-loop clients while
    both engines go through pause_generation {} (upstream's default, abort) ->
    update_weights_from_disk -> continue_generation, several times. Every request is
    answered as a completion or upstream's abort answer (200, finish_reason abort) in
    under 10 s, and the gateway never counts a failure against either engine."""
    cluster, _, _ = gateway_deployment
    assert_idle(cluster, PD_ROLES)
    charged = _charged(cluster.gateway)
    calls = []
    loop = ClosedLoop(cluster.url, PAUSE_CLIENTS, timeout=60, ignore_eos=True).start()
    try:
        for cycle in range(PAUSE_CYCLES):
            done = loop.completed()
            wait_until(lambda: loop.completed() >= done + PAUSE_CLIENTS, 120,
                       f"completions before pause cycle {cycle}")
            for path, payload in (("/pause_generation", {}),
                                  ("/update_weights_from_disk", {"model_path": str(tiny_model)}),
                                  ("/continue_generation", {})):
                for role in PD_ROLES:
                    t0 = time.monotonic()
                    status, body = http_post_json(cluster[role].url + path, payload, timeout=60)
                    calls.append((cycle, role, path, status, round(time.monotonic() - t0, 2)))
                    assert status == 200, (cycle, role, path, body)
                    if path == "/update_weights_from_disk":
                        assert body["success"] is True, (cycle, role, body)
        done = loop.completed()
        wait_until(lambda: loop.completed() >= done + PAUSE_CLIENTS, 120, "completions after the last cycle")
    finally:
        loop.stop()
    print(f"calls {calls}; answers {dict(loop.summary())}")

    # What the clients saw: completions and abort answers only, each within the bound.
    wrong = [(r["status"], r["finish"], str(r["error"])[:150]) for r in loop.results
             if not (r["status"] == 200 and r["finish"] in ("length", "abort"))]
    assert not wrong, wrong
    slow = [round(r["latency"], 1) for r in loop.results if r["latency"] > PAUSE_ANSWER_BOUND_S]
    assert not slow, slow
    # What was counted: no failure against either engine, no circuit opened.
    _assert_nothing_charged(cluster.gateway, charged)
    # What is left held: nothing.
    assert_idle(cluster, PD_ROLES)


SKEW_CYCLES = 3
SKEW_CLIENTS = 6


@pytest.mark.parametrize("first", PD_ROLES)
def test_skewed_pause_windows_through_the_gateway_leave_nothing_waiting(gateway_deployment, first):
    """Issue 13's hole 1 behind the Rust gateway, both ways: abort-mode pause cycles in
    which `first` is continued before the other server, which then aborts the requests
    held at its gate (prefill first: decode's gate, prefill's bootstrap copies; decode
    first: prefill's gate, decode's prealloc/transfer copies). The running server's
    copies end within a second of the other's end, nothing is unanswered after 10 s,
    every answer is a completion or upstream's abort answer, and the gateway counts no
    failure against either engine."""
    from testing.pd_checks import is_completion_or_abort_answer, skewed_abort_pause_cycles

    cluster, _, _ = gateway_deployment
    baseline = assert_idle(cluster, PD_ROLES)
    charged = _charged(cluster.gateway)
    results = skewed_abort_pause_cycles(cluster["prefill"], cluster["decode"], cluster.url,
                                        SKEW_CYCLES, SKEW_CLIENTS, first=first)
    wrong = [(r["status"], str(r["error"])[:150]) for r in results if not is_completion_or_abort_answer(r)]
    assert not wrong, wrong
    finishes = Counter(r["meta"]["finish_reason"]["type"] for r in results)
    assert finishes["abort"] >= SKEW_CYCLES and sum(finishes.values()) - finishes["abort"] >= SKEW_CYCLES, finishes
    _assert_nothing_charged(cluster.gateway, charged)
    assert_idle(cluster, PD_ROLES, baseline)


# ----------------------------------------------------------------------------- mixed faults

SOAK_ROUNDS = 4  # 32 faults: ~30 s on the module's deployment (2 rounds: 15 s)
SOAK_CLIENTS = 6


def test_closed_loop_soak_mixing_faults_through_the_gateway(gateway_deployment):
    """test_room_ledger_e2e's soak (testing/soak.py) behind the Rust gateway with its
    defaults: closed-loop clients through the gateway while pause cycles in every mode
    (servers paused and continued in either order), aborts by rid on both servers,
    abort_all, aborts at one paused server's gate and short freezes of either server
    follow one another. Every answer is a completion equal to its reference (divergence
    only after a retract pause) or an abort answer that an aborting fault explains; none
    of these faults calls for an error status, so any other answer is wrong; none open
    after 30 s. The gateway charges a failure for every 5xx attempt to both engines
    (docs/gateway.md): none of these faults may cost either engine one, or open a
    circuit. Nothing held afterwards and serving goes on."""
    from testing.pd_checks import cluster_end_causes, delta
    from testing.soak import Soak, schedule

    cluster, _, _ = gateway_deployment
    gateway = cluster.gateway
    warm = generate_concurrently(cluster.url, ["warm up"], max_new_tokens=4)[0]
    assert warm["status"] == 200, warm
    baseline = assert_idle(cluster, PD_ROLES)
    before = cluster_end_causes(cluster)
    metrics = gateway.metrics()
    failures_before, opened = gateway.failures(metrics), gateway.circuit_opens(metrics)
    exhausted_before = metric_sum(metrics, "smg_worker_retries_exhausted_total")
    soak = Soak(cluster, clients=SOAK_CLIENTS, seed=17)
    report = soak.run(schedule(SOAK_ROUNDS, seed=17))
    rid_aborted = sum(a.finish == "abort" and any(a.rid in w.rids for w in report.windows) for a in report.answers)
    print("soak", report.summary(), "diverged after retract:", report.diverged_after_retract,
          "aborted by rid:", rid_aborted, "gateway failures", gateway.failures())

    # What the clients saw: every answer judged against the faults it overlapped.
    assert not report.wrong, report.wrong[:10]
    summary = report.summary()
    assert summary.get("200/length", 0) >= len(report.windows), summary  # it served throughout
    # What was counted: the gateway charged neither engine, opened no circuit, gave up
    # on no request; no end was counted as a deadline, a lost peer or a failed transfer.
    metrics = gateway.metrics()
    assert gateway.failures(metrics) == failures_before, metrics
    assert gateway.circuit_opens(metrics) == opened
    assert gateway.circuit_states(metrics) == {"prefill": 0.0, "decode": 0.0}
    assert metric_sum(metrics, "smg_worker_retries_exhausted_total") == exhausted_before
    moved = delta(before, cluster_end_causes(cluster))
    errors = {k: v for k, v in moved.items() if k[1] in ("timeout", "peer_failure", "transport")}
    assert not errors, moved
    # What is left held: nothing; and serving goes on.
    assert_idle(cluster, PD_ROLES, baseline)
    results = generate_concurrently(cluster.url, prompts(4), max_new_tokens=8)
    assert [r["status"] for r in results] == [200] * 4, [r["error"] for r in results]
