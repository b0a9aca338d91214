"""One scheduler rank of a running TP 2 server frozen (SIGSTOP) under closed-loop load: the server goes down as a
whole within the gloo bound, and everything around it ends as when the server is killed. Prefill and decode at
TP 2, float32, the mini load balancer in front, the deployment's gloo timeout short (SGLANG_FORK_GLOO_TIMEOUT).

The frozen rank never joins the next collective; its other rank waits in it until the gloo timeout, raises, and
upstream's scheduler then signals its parent, which kills the whole process tree (the frozen rank included:
SIGKILL ends a stopped process). Asserted, for a frozen prefill rank and a frozen decode rank:
- the other rank fails out of its collective on the gloo timeout (its log names it), and every process of the
  server is gone within the gloo timeout + FAIL_MARGIN_S of the freeze, none left behind;
- every client request ends within ANSWER_BOUND_S: a completion, or the mini LB's 500 (it gives up a request when
  one leg's connection breaks and drops the other leg, which the surviving server then ends as a client abort);
- the surviving server declares the lost server's ranks lost (one loss per rank of its own), answers each leg it
  held for the lost server with a 5xx naming it (502 "PD peer lost", or 500 naming the write that failed to it)
  within DETECT_BOUND_S of the loss, counts each end once by the cause it answered, and holds nothing after;
- restarted on the same ports (the restart a supervisor does), the server is served again, both sides idle.

The legs the surviving server holds for the lost one are sent by the test itself (it plays the balancer for them),
so that each leg's own answer is visible: decode's legs first, handshaken with both prefill ranks and waiting for
the KV; for a frozen decode rank, prefill's legs of the same rooms right after the freeze (their KV write to the
frozen decode rank cannot complete).
"""

from __future__ import annotations

import json
import random
import time

import psutil
import pytest

from testing.pd_checks import (
    ClosedLoop,
    assert_idle,
    assert_named_5xx,
    assert_serves,
    delta,
    end_causes,
    leg_body,
    lost_by_cause,
    start_legs,
)
from testing.pd_cluster import exited, metric_sum, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.tp]

PD_ROLES = ("prefill", "decode")
FP32 = ("--dtype", "float32")
GLOO_TIMEOUT_S = 10.0
HEARTBEAT_S = 2.0  # upstream's floor
ENV = {
    "SGLANG_FORK_GLOO_TIMEOUT": str(GLOO_TIMEOUT_S),
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": str(HEARTBEAT_S),
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
    # far past the freeze window: the requests end by the lost peer, not by their deadline
    "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": "90",
}
# freeze -> every process gone: the other rank's next collective (a scheduler tick: it calls one every iteration,
# idle or not), the gloo timeout, its traceback and the parent's SIGQUIT handler killing the tree (a TP 2 server's
# teardown took 2-12 s on the loaded 2-core machine, docs/multi-rank.md)
FAIL_MARGIN_S = 25.0
FAIL_BOUND_S = GLOO_TIMEOUT_S + FAIL_MARGIN_S
# the lost server gone -> the survivor's answer: two silent heartbeats + a scheduler tick, generously
DETECT_BOUND_S = HEARTBEAT_S + 6.0
# a client's request, sent at the latest right before the freeze: answered once the server is gone (the balancer
# sees the broken connection) or once the survivor knows
ANSWER_BOUND_S = FAIL_BOUND_S + DETECT_BOUND_S
CLIENTS = 4
N_LEGS = 4
N_AFTER = 8
LOSSES = "sglang:pd_peer_losses_total"
RECOVERIES = "sglang:pd_peer_recoveries_total"
GLOO_TIMED_OUT = f"Timed out waiting {int(GLOO_TIMEOUT_S * 1000)}ms"  # gloo's message for a collective past its timeout
BALANCER_GAVE_UP = "Internal Server Error"  # the mini LB's answer when one leg's connection breaks
# how the survivor may end a request it held for the lost server: the loss (502), the write that revealed it (500),
# the balancer dropping its leg (client abort)
LOSS_CAUSES = {"peer_failure", "transport", "client_abort"}


@pytest.fixture(scope="module")
def cluster(deployments):
    return deployments.pd(tp=2, prefill_args=FP32, decode_args=FP32, prefill_env=ENV, decode_env=ENV)


@pytest.fixture(autouse=True)
def restart_a_lost_server(cluster):
    """A test that failed with a server down (or a rank still frozen) leaves both servers running for the next."""
    yield
    for role in PD_ROLES:
        server = cluster[role]
        if server.is_alive() and all(p.status() != psutil.STATUS_STOPPED for p in server.processes()):
            continue
        server.restart()


def _count(server, name: str) -> float:
    return metric_sum(server.metrics(), name)


def _judge_client_answers(results, t_freeze: float) -> None:
    """Every closed-loop answer: a completion run to max_new_tokens, or the balancer's 500 for a request that was
    open at the freeze or sent after it; none later than ANSWER_BOUND_S."""
    for r in results:
        assert r["latency"] <= ANSWER_BOUND_S, (r["latency"], r["status"], str(r["error"])[:300])
        if r["status"] == 200:
            assert r["finish"] == "length", r
            continue
        assert r["status"] == 500 and r["error"] == BALANCER_GAVE_UP, (r["status"], str(r["error"])[:300])
        assert r["t"] >= t_freeze, ("a request failed before the freeze", r)


@pytest.mark.parametrize("victim", PD_ROLES)
def test_a_frozen_rank_takes_its_server_down_within_the_gloo_bound(cluster, victim):
    survivor = "decode" if victim == "prefill" else "prefill"
    server, peer = cluster[victim], cluster[survivor]
    baseline = assert_idle(cluster, PD_ROLES)
    losses, recoveries, causes = _count(peer, LOSSES), _count(peer, RECOVERIES), end_causes(peer.metrics())

    rooms = random.sample(range(1, 2**62), N_LEGS)
    bodies = [leg_body(cluster, room, f"frozen {victim} rank {i}: " + "the quick brown fox " * 8)
              for i, room in enumerate(rooms)]
    decode_legs = start_legs(cluster["decode"].url, bodies)
    wait_until(lambda: cluster.resources("decode")["queues"]["decode_transfer"] == N_LEGS, 60,
               "decode's legs handshaken with prefill, waiting for the KV")
    loop = ClosedLoop(cluster.url, CLIENTS, max_new_tokens=16, timeout=ANSWER_BOUND_S + 30, ignore_eos=True).start()
    try:
        wait_until(lambda: loop.completed() >= 2 * CLIENTS, 60, "closed-loop completions before the freeze")
        tree = server.processes()
        frozen = server.scheduler(1)
        t_freeze = time.monotonic()
        frozen.suspend()
        wait_until(lambda: frozen.status() == psutil.STATUS_STOPPED, 10, f"{victim} rank 1 stopped", interval=0.02)
        prefill_legs = start_legs(cluster["prefill"].url, bodies) if victim == "decode" else []
        wait_until(lambda: all(exited(p) for p in tree), FAIL_BOUND_S, f"every process of {victim} to exit",
                   interval=0.1, on_timeout=lambda: str([(p.pid, p.name()) for p in tree if not exited(p)]))
        t_gone = time.monotonic()
    finally:
        loop.stop()
    went_down_s = t_gone - t_freeze
    survivor_legs = decode_legs if victim == "prefill" else prefill_legs
    victim_legs = prefill_legs if victim == "prefill" else decode_legs
    for leg in survivor_legs + victim_legs:
        leg.join(max(1.0, t_gone + DETECT_BOUND_S + 10 - time.monotonic()))
    print(f"\nfrozen {victim} rank 1: {victim} gone {went_down_s:.1f}s after the freeze (exit {server.popen.poll()}); "
          f"clients {dict(loop.summary())}; {survivor}'s legs {[(leg.status, round(leg.out.get('seconds', -1), 1)) for leg in survivor_legs]}")

    # the other rank failed out of its collective on the gloo timeout, and the server went down as a whole
    log = server.tail(400)
    assert "Scheduler hit an exception" in log and GLOO_TIMED_OUT in log, log[-3000:]
    assert GLOO_TIMEOUT_S - 0.5 <= went_down_s <= FAIL_BOUND_S, went_down_s
    assert exited(frozen) and server.popen.poll() is not None
    # every client request ended, each a completion or the balancer's answer for a broken leg
    _judge_client_answers(loop.results, t_freeze)
    assert any(r["status"] != 200 for r in loop.results), "no client request was bound to the frozen server"
    # the survivor answered each leg it held with a 5xx naming the lost server, within the detection bound
    assert not [leg for leg in survivor_legs + victim_legs if leg.is_alive()], "a leg hangs"
    assert_named_5xx(survivor_legs, victim, t_gone, DETECT_BOUND_S, multi_rank=True)
    if victim == "prefill":
        assert f"prefill peer 127.0.0.1:{cluster.bootstrap_port} lost" in json.dumps(survivor_legs[0].response)
    # ... declared the lost server lost on each of its ranks, holds nothing, and counted each end once by its cause
    wait_until(lambda: _count(peer, LOSSES) >= losses + cluster.tp[survivor], DETECT_BOUND_S,
               f"{survivor} to declare {victim} lost on every rank")
    assert_idle(cluster, (survivor,), baseline, timeout=DETECT_BOUND_S + 20)
    assert _count(peer, LOSSES) == losses + cluster.tp[survivor]
    moved = delta(causes, end_causes(peer.metrics()))
    assert {cause for (_, cause, _) in moved} <= LOSS_CAUSES and all(r == survivor for (r, _, _) in moved), moved
    for cause, n in lost_by_cause(survivor_legs).items():
        assert sum(v for (_, c, _), v in moved.items() if c == cause) >= n, (cause, n, moved)

    # restarted on the same ports, it is served again; nothing held on either side, the peer known again
    server.restart()
    assert_serves(cluster.url, N_AFTER)
    assert_idle(cluster, PD_ROLES, baseline)
    wait_until(lambda: _count(peer, RECOVERIES) == recoveries + cluster.tp[survivor], DETECT_BOUND_S,
               f"{survivor} to count {victim}'s recovery on every rank")
