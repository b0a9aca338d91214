"""The prefill waiting-stage deadline on real servers (1P1D, mooncake over TCP).

A request is held in prefill's waiting queue (bootstrapped: decode's handshake arrived;
waiting for prefill compute) by prefill work that is not itself bounded by the deadline:
prefill runs one request at a time (`--max-running-requests 1`) in chunks of 2 tokens,
and one fake-transfer request (upstream's FAKE_BOOTSTRAP_HOST: no decode, nothing to
transfer) with a 4,000-token prompt occupies it for 2,000 forward passes (seconds even
on an idle machine: the occupation does not depend on a race). One: a second one queued
would keep the waiting request in the bootstrap queue (prefill pops bootstrapped
requests only as far as request slots allow). The test checks that the occupation
outlasted the deadline (else it proves nothing and fails), then aborts it.
Prefill's deadline is 3 s; decode's is 60 s here, so the waiting request's decode leg
(waiting in decode_transfer since before prefill's waiting stage began) ends because
prefill's deadline did, not its own.
"""

from __future__ import annotations

import json
import random
import time

import pytest

from conftest import TP2, TP2_DECODE_TP1, topology_params, topology_pd
from testing.pd_checks import (
    PD_ROLES,
    Leg,
    assert_idle,
    assert_serves,
    call,
    cluster_end_causes,
    leg_body,
    wait_end_causes,
)
from testing.pd_cluster import metric_sum, wait_until

pytestmark = pytest.mark.e2e

DEADLINE = 3.0
MARGIN = 1.5  # the stage scan interval and a few scheduler ticks, on a loaded 2-core box
STAGE = "prefill_waiting"
COUNTER = "sglang:pd_transfer_timeouts_total"
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
OCCUPIER_TOKENS = 4000


@pytest.fixture(scope="module", params=topology_params(TP2, TP2_DECODE_TP1))
def cluster(deployments, request):
    """TP=1, TP 2 on both servers, and prefill TP 2 with decode TP 1 (the module plays the load balancer)."""
    yield from topology_pd(
        deployments, request.param,
        prefill_env={"SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": str(DEADLINE),
                     "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"},
        decode_env={"SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": "60"},
        prefill_args=["--max-running-requests", "1", "--chunked-prefill-size", "2",
                      "--context-length", "8192"],
    )


def _stage_count(metrics: dict) -> float:
    return metric_sum(metrics, COUNTER, stage=STAGE)


def _occupier(prefill, seed: int = 0) -> Leg:
    rng = random.Random(seed)
    return Leg(prefill.url, {
        "input_ids": [rng.randint(3, 200) for _ in range(OCCUPIER_TOKENS)],
        "bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": 0,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 1},
    })


def test_request_waiting_for_prefill_compute_gets_504_at_the_deadline(cluster):
    baseline = assert_idle(cluster, PD_ROLES)
    prefill, decode = cluster["prefill"], cluster["decode"]
    before = _stage_count(prefill.metrics())
    causes = cluster_end_causes(cluster)

    occupier = _occupier(prefill)
    occupier.start()
    wait_until(lambda: prefill.resources()["queues"].get("prefill_pending_chunks") == 1, 30,
               "prefill running a chunked prefill")
    # the waiting request: decode's leg first (its handshake reaches prefill), then prefill's
    room = random.randint(1, 2**62)
    body = leg_body(cluster, room, "the waiting request " * 8)
    decode_leg = Leg(decode.url, body)
    decode_leg.start()
    wait_until(lambda: decode.resources()["queues"]["decode_transfer"] == 1, 30, "decode handshake")
    prefill_leg = Leg(prefill.url, body)
    t_stage = time.monotonic()
    prefill_leg.start()
    wait_until(lambda: prefill.resources()["queues"]["waiting"] >= 1, 10, "the leg in prefill's waiting queue")
    wait_until(prefill_leg.done, DEADLINE + 30, "prefill's answer")
    # the occupation outlasted the deadline: prefill was still busy when it answered
    assert not occupier.done(), occupier.out
    assert prefill.resources()["queues"]["prefill_pending_chunks"] == 1

    assert prefill_leg.status == 504, prefill_leg.out
    detail = json.dumps(prefill_leg.response)
    for part in (STAGE, f"bootstrap_room={room}", "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT"):
        assert part in detail, f"{part} not in {detail}"
    assert prefill_leg.out["seconds"] >= DEADLINE, prefill_leg.out["seconds"]
    assert prefill_leg.ended_at - t_stage <= DEADLINE + MARGIN, prefill_leg.ended_at - t_stage
    # decode heard of it (prefill's Failed status): its leg ends 504 naming prefill's stage
    wait_until(decode_leg.done, 10, "decode's answer")
    assert decode_leg.status == 504, decode_leg.out
    assert STAGE in json.dumps(decode_leg.response), decode_leg.out
    assert decode_leg.ended_at - t_stage <= DEADLINE + MARGIN + 2, decode_leg.ended_at - t_stage
    assert _stage_count(prefill.metrics()) == before + 1
    print(f"prefill 504 after {prefill_leg.ended_at - t_stage:.2f}s, decode after "
          f"{decode_leg.ended_at - t_stage:.2f}s")

    # end the occupation (client aborts), then nothing is held and serving continues
    status, _, _ = call(cluster, "prefill", "abort_request", {"abort_all": True})
    assert status == 200
    occupier.join(30)
    assert occupier.done() and occupier.status == 200, occupier.out
    assert_idle(cluster, PD_ROLES, baseline, timeout=30)
    # decode counts a timeout (in its own stage): prefill's deadline ended it; the
    # occupier's abort is a client abort while running
    wait_end_causes(cluster, causes, {
        ("prefill", "timeout", STAGE): 1,
        ("decode", "timeout", "decode_transfer"): 1,
        ("prefill", "client_abort", "prefill_running"): 1,
    })
    assert_serves(cluster.url, 3)
    assert_idle(cluster, PD_ROLES, baseline)


def test_unreachable_prefill_is_a_lost_peer_while_decode_serves(cluster):
    """A decode leg naming a bootstrap server nobody listens on: decode's fetches of its
    info fail (off the scheduler thread now); after upstream's 15 attempts, 1 s apart,
    upstream's own failure path ends the request (decode's deadline here is 60 s, so it
    is not the deadline that ends it), answered as a lost peer: 502 naming the
    unreachable prefill, end cause peer_failure (upstream's own reason, "Aborted by
    AbortReq.", read as a client abort: an abort is never what a failure answers).
    Decode serves other requests meanwhile; nothing is held afterwards."""
    from testing.pd_cluster import free_ports

    baseline = assert_idle(cluster, PD_ROLES)
    causes = cluster_end_causes(cluster)
    decode = cluster["decode"]
    (nobody,) = free_ports(1)  # reserved, never bound: connections are refused
    body = {**leg_body(cluster, random.randint(1, 2**62), "nobody answers"), "bootstrap_port": nobody}
    leg = Leg(decode.url, body)
    leg.start()
    wait_until(lambda: (decode.resources()["bootstrap_fetch"] or {}).get("info_failed", 0) >= 1, 10,
               "a failed fetch")
    other = Leg(decode.url, {
        "text": "decode keeps serving", "bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": 0,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
    })
    other.start()
    wait_until(other.done, 10, "decode serving meanwhile")
    assert other.status == 200 and not leg.done(), (other.out, leg.out)
    wait_until(leg.done, 60, "decode's answer")
    print("unreachable prefill:", leg.status, json.dumps(leg.response)[:400], f"{leg.out['seconds']:.1f}s",
          decode.resources()["bootstrap_fetch"])
    assert leg.status == 502, leg.out
    detail = json.dumps(leg.response)
    for part in ("PD peer lost", f":{nobody} unreachable", "after 15 attempts"):
        assert part in detail, (part, detail)
    assert leg.out["seconds"] >= 14, leg.out  # upstream's 15 attempts, 1 s apart
    wait_end_causes(cluster, causes, {("decode", "peer_failure", "decode_prealloc"): 1}, roles=("decode",))
    fetch = decode.resources()["bootstrap_fetch"]
    assert fetch["running"] == 0 and fetch["info_failed"] >= 15, fetch
    assert_idle(cluster, PD_ROLES, baseline)
