"""One server paused, released, resumed and continued while requests wait at its pause gate (1P1D, real servers,
behind the mini LB and behind the Rust gateway).

One engine's RL step runs ahead of the other's (asynchronous RL frameworks do this): one server alone is paused
(any mode) while the other serves. Requests sent meanwhile wait at the paused server's pause gate while their
other copy goes on on the serving side: with prefill paused, decode preallocates each one and sends prefill its
handshake; with decode paused, prefill's copies wait in its bootstrap queue. Then the paused server gets
`release_memory_occupation {}` -> `resume_memory_occupation {}` -> `continue_generation {}` (or the trainer's tag
order: release `["kv_cache"]`, release `["weights"]`, resume `["weights"]`, resume `["kv_cache"]`, continue).

Every request completes after the continue, with the text a calm control request got (greedy), within
ANSWER_BOUND_S; in abort mode too (the abort-mode pause's own `abort_all` leaves requests at the gate alone, as
upstream's does: they are served after continue). Nothing is counted as an end or a failure, nothing is held on
either side afterwards, and serving goes on.

Upstream 0.5.23, the same calls (prefill first, 1P1D behind the mini LB, 4 requests per mode): 12 of 12 completed
within 25 s of the continue. The fork before this fix: 12 of 12 ended 504 at the transfer deadline (600 s by
default): its release dropped the handshakes decode had sent for requests still at prefill's gate
(`queue_buffers.forget_orphan_rooms`), and prefill's senders then waited for handshakes that never came again.
Decode first: the same completions on both (nothing of those requests is on decode before its receiver exists).
"""

from __future__ import annotations

import threading
import time

import pytest

from conftest import TP2, topology_params, topology_pd
from testing.pd_checks import (
    PD_ROLES,
    assert_idle,
    assert_serves,
    at_gate,
    call,
    cluster_end_causes,
    delta,
    waiting_for_peer,
)
from testing.pd_cluster import Gateway, generate, metric_sum, prompts, wait_until

pytestmark = pytest.mark.e2e

MODES = ("in_place", "retract", "abort")
REQUESTS = 4
MAX_NEW_TOKENS = 16
# From the continue's answer to the last request's: the fork measured 0.1-0.5 s on the loaded 2-core box (every
# case, TP 1); upstream 0.5.23: within 25 s. Before the fix (prefill paused): the transfer deadline (600 s).
ANSWER_BOUND_S = 20.0
HELD_S = 60.0  # the requests reach the gate and their other copies wait for the paused server
FAILURES = ("sglang:num_bootstrap_failed_reqs_total", "sglang:num_transfer_failed_reqs_total")
CALLS = {
    "all": (("release_memory_occupation", {}), ("resume_memory_occupation", {}), ("continue_generation", {})),
    # the trainer's order: weights back first, the KV cache later (docs/pause-release-resume.md)
    "tags": (("release_memory_occupation", {"tags": ["kv_cache"]}),
             ("release_memory_occupation", {"tags": ["weights"]}),
             ("resume_memory_occupation", {"tags": ["weights"]}),
             ("resume_memory_occupation", {"tags": ["kv_cache"]}),
             ("continue_generation", {})),
}


@pytest.fixture(scope="module", params=topology_params(TP2))
def cluster(shared_pd, deployments, request):
    """TP 1: the shared default 1P1D (its mini LB). TP 2 on both servers: the module's own (`make test-tp`)."""
    if request.param.multi_rank:
        yield from topology_pd(deployments, request.param)
    else:
        yield shared_pd.deployment


@pytest.fixture(scope="module")
def gateway(cluster):
    """The Rust gateway in front of the same engines, each registered with POST /workers."""
    with Gateway.fronting(cluster) as gw:
        yield gw


@pytest.fixture(scope="module")
def control(cluster):
    """Each prompt's greedy answer on the calm cluster, one at a time: (output ids, text)."""
    assert_idle(cluster, PD_ROLES)
    out = {}
    for text in prompts(REQUESTS):
        r = generate(cluster.url, text, max_new_tokens=MAX_NEW_TOKENS)
        assert r["status"] == 200 and r["meta"]["finish_reason"]["type"] == "length", r
        out[text] = (r["output_ids"], r["text"])
    return out


def handshakes_on_prefill(cluster) -> int:
    """Decode handshakes prefill's kv manager stores (`transfer_infos`), rank 0."""
    return cluster.resources("prefill")["transfer_rooms"]["transfer_infos"]


def failures(cluster) -> dict:
    return {(role, name): metric_sum(cluster.metrics(role), name) for role in PD_ROLES for name in FAILURES}


def held_at_gate(cluster, paused: str, n: int) -> bool:
    """`n` requests wait at `paused`'s gate and their copies wait for it on the other server (with prefill paused:
    decode preallocated them and prefill stores their handshakes)."""
    other = "decode" if paused == "prefill" else "prefill"
    if at_gate(cluster[paused]) < n or waiting_for_peer(cluster[other]) < n:
        return False
    return paused != "prefill" or handshakes_on_prefill(cluster) >= n


def one_server_cycle(cluster, control, url: str, paused: str, mode: str, calls: str) -> None:
    baseline = assert_idle(cluster, PD_ROLES)
    causes, failed = cluster_end_causes(cluster), failures(cluster)
    texts = list(control)
    results = [None] * len(texts)

    def send(i):
        results[i] = generate(url, texts[i], max_new_tokens=MAX_NEW_TOKENS, timeout=ANSWER_BOUND_S + HELD_S + 60)

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(texts))]
    released = False
    try:
        assert call(cluster, paused, "pause_generation", {"mode": mode})[0] == 200
        for t in threads:
            t.start()
        wait_until(lambda: held_at_gate(cluster, paused, len(texts)), HELD_S,
                   f"{len(texts)} requests at {paused}'s gate, their copies waiting for it",
                   on_timeout=lambda: f"gate {at_gate(cluster[paused])}, "
                                      f"{cluster.resources('prefill')['transfer_rooms']}, "
                                      f"{cluster.resources('decode')['queues']}")
        released = True  # from here until the sequence's last call answered
        for endpoint, body in CALLS[calls]:
            status, reply, _ = call(cluster, paused, endpoint, body)
            assert status == 200, (endpoint, body, status, reply)
        t_continue = time.monotonic()
        released = False
        deadline = t_continue + ANSWER_BOUND_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        took = time.monotonic() - t_continue
        open_ = [texts[i] for i, t in enumerate(threads) if t.is_alive()]
        assert not open_, f"{len(open_)} of {len(texts)} unanswered {ANSWER_BOUND_S} s after the continue"
        for text, r in zip(texts, results):
            assert r["status"] == 200, (text, r)
            assert r["meta"]["finish_reason"]["type"] == "length", (text, r["meta"]["finish_reason"])
            assert (r["output_ids"], r["text"]) == control[text], (text, r["text"], control[text][1])
        # a completion: no end and no failure counted on either server
        assert delta(causes, cluster_end_causes(cluster)) == {}
        assert failures(cluster) == failed
        assert_idle(cluster, PD_ROLES, baseline=baseline)
        for role in PD_ROLES:
            pause = cluster.resources(role)["pause"]
            assert pause == {"paused": False, "mode": None, "clock_paused": False}, (role, pause)
            assert cluster.resources(role)["te_registration"] == baseline[role]["te_registration"], role
        assert_serves(url, 2, max_new_tokens=8)
        print(f"{paused} paused ({mode}, {calls}): {len(texts)} completed {took:.1f} s after the continue")
    finally:  # leave the cluster serving whatever happened
        if released:  # whatever is still released (409 when nothing is)
            call(cluster, paused, "resume_memory_occupation", {})
        for role in PD_ROLES:
            call(cluster, role, "continue_generation")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("paused", PD_ROLES)
@pytest.mark.parametrize("balancer", ("mini", "router"))
def test_requests_at_one_paused_servers_gate_complete_after_its_release_resume_continue(
        cluster, control, balancer, paused, mode, request):
    """`paused` alone paused in `mode`; four requests through the balancer wait at its gate (their other copies
    waiting for it on the serving server); release {} -> resume {} -> continue on `paused`: each completes with the
    control's text within ANSWER_BOUND_S (upstream 0.5.23, prefill first: 12 of 12 within 25 s; the fork before
    the fix, prefill first: 504 at the transfer deadline)."""
    url = request.getfixturevalue("gateway").url if balancer == "router" else cluster.url
    one_server_cycle(cluster, control, url, paused, mode, "all")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("paused", PD_ROLES)
def test_requests_at_the_gate_complete_when_the_trainer_resumes_weights_before_kv(cluster, control, paused, mode):
    """The same, the paused server released and resumed by tag as a trainer does: release ["kv_cache"], release
    ["weights"], resume ["weights"], resume ["kv_cache"], continue (behind the mini LB)."""
    one_server_cycle(cluster, control, cluster.url, paused, mode, "tags")
