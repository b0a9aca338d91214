"""2P1D on separate hosts (testing/hosts.py): two prefill servers, one decode and the mini load balancer each in a
network namespace of its own on one switch. Under closed-loop load the switch stops forwarding between the second
prefill and decode (silent: nothing refused, nothing reset), while the balancer, the first prefill and this test
still reach every host. The balancer keeps picking either prefill at random, so about half the requests are bound
to the silent pair. Asserted: prefill2 and decode each declare the other lost within two heartbeats, and nobody
else is declared lost; every server gives everything back; once the link heals both count the recovery within a
heartbeat and prefill2 serves again, with no restart and no manual step. docs/peer-liveness.md ("Silent peers").
TP 1 in `make test`; every server at TP 2 in `make test-tp` (each rank counts the loss and the recovery).

Recovery is on on both prefills and decode (PARTITION_ENV, one attempt): every request bound to the silent pair is
re-run on the first prefill (docs/recovery.md, "A partition between prefill and decode"), cause `lost_prefill`: those
in flight at the cut once decode declares prefill2 lost, the ones sent to it after that once decode's fetch of its
info fails. So every request answers 200, run to max_new_tokens, with the text a calm run of its prompt gives, and
says in its meta_info that it was recovered; every recovery started ended recovered (judge_partition_recoveries).
With recovery off (and in stock upstream 0.5.23, which has no recovery) the same cut answers 502 naming the lost
peer for the requests in flight and 504 at decode's deadline for the ones sent to prefill2 during the cut
(docs/peer-liveness.md's run: 4 x 502, 8 x 504, 13 completions).

The same cut behind the Rust gateway (sglang-router, started on the balancer's host in front of the same engines,
each registered with POST /workers): prefill2 answers its leg of each request it lost decode for as handed over to
decode's recovery (200, the verdict's row "lost decode handed to decode's recovery"), so the gateway keeps decode's
recovered answer: every request answers 200, the gateway retries none and charges no circuit. Before this release
prefill2's leg answered 502 naming the lost decode, which the gateway answered (and retried) in place of decode's.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest

from testing.pd_checks import (PEER_LOSSES, PEER_RECOVERIES, ClosedLoop, Leg, assert_idle, delta, end_causes,
                               judge_completed_stream, judge_partition_recoveries, leg_body, request_recoveries,
                               start_legs, waiting_for_peer, wait_counter_rises)
from testing.pd_checks import (PARTITION_ANSWER_BOUND as ANSWER_BOUND, PARTITION_DEADLINE as DEADLINE,
                               PARTITION_DETECT_BOUND as DETECT_BOUND, PARTITION_ENV as ENV,
                               PARTITION_RECOVER_BOUND as RECOVER_BOUND)
from testing.deployments import Gateway
from testing.http_client import post_stream, prompts, stream_events
from testing.pd_cluster import generate, metric_sum, wait_until

from conftest import TP2, topology_params, topology_pd

pytestmark = pytest.mark.e2e  # its own 4 servers (the gateway besides): about 150 s on the 2-core box

HOST_ROLES = ("prefill", "prefill2", "decode", "lb")  # the pd_hosts fixture makes these hosts
ROLES = ("prefill", "prefill2", "decode")
CLIENTS = 4
PROMPT_TOKENS = "sglang:prompt_tokens_total"
LOST = "lost_prefill"  # recovery's cause for a request whose prefill decode declared lost


@pytest.fixture(scope="module", params=topology_params(TP2))
def cluster(pd_hosts, deployments, request):
    """2P1D + mini LB, each on its own host (torn down before the hosts); every server at TP 2 in `make test-tp`."""
    try:
        yield from topology_pd(deployments, request.param, hosts=pd_hosts.hosts, prefills=2, prefill_env=ENV,
                               decode_env=ENV)
    finally:
        pd_hosts.heal()


def _counts(cluster, name: str) -> dict:
    return {role: metric_sum(cluster[role].metrics(), name) for role in ROLES}


def _causes(cluster) -> dict:
    """End causes per server (both prefills label their ends role="prefill")."""
    return {(server,) + key: n for server in ROLES for key, n in end_causes(cluster[server].metrics()).items()}


class _Streams(threading.Thread):
    """Streaming /generate requests one after another through `url` until `stop`, each recorded as ClosedLoop records
    its answers (status, latency, finish, meta and text of the last event, prompt, t) with its body kept for
    `judge_completed_stream`."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.results, self._halt = url, [], threading.Event()

    def run(self) -> None:
        texts = prompts(64)
        k = 0
        while not self._halt.is_set():
            prompt = texts[(5 * k + 3) % len(texts)]
            payload = {"text": prompt, "stream": True,
                       "sampling_params": {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}}
            t0 = time.monotonic()
            status, body = post_stream(self.url + "/generate", payload, timeout=DEADLINE + 30)
            try:
                last = stream_events(body)[0][-1]
            except (ValueError, IndexError):
                last = {}
            meta = last.get("meta_info") or {}
            self.results.append({"status": status, "body": body, "prompt": prompt, "meta": meta,
                                 "text": last.get("text"), "finish": (meta.get("finish_reason") or {}).get("type"),
                                 "latency": time.monotonic() - t0, "t": time.monotonic()})
            k += 1

    def stop(self) -> None:
        self._halt.set()
        self.join(DEADLINE + 40)
        assert not self.is_alive(), "a stream is still waiting"


def _partition_of_prefill2(cluster, pd_hosts, url: str, min_reruns: int) -> list:
    """Cut prefill2 from decode under closed-loop load through `url` until at least `min_reruns` requests bound to
    the silent pair were re-run on the first prefill (some of them sent after decode declared prefill2 lost, a
    stream among them: streams are sent one after another from then on), then heal; asserts every answer, the
    re-runs' texts, the bounds, the counters and that every server is idle. Returns the answers."""
    baseline = assert_idle(cluster, ROLES)
    losses, recoveries = _counts(cluster, PEER_LOSSES), _counts(cluster, PEER_RECOVERIES)
    causes = _causes(cluster)
    assert all(cluster[role].env.get("SGLANG_FORK_RECOVERY_ATTEMPTS") == "1" for role in ROLES)
    recoveries_before = request_recoveries(cluster["decode"].metrics())

    def rerun(outcome: str) -> float:
        return delta(recoveries_before, request_recoveries(cluster["decode"].metrics())).get((LOST, outcome), 0)

    loop = ClosedLoop(url, CLIENTS, max_new_tokens=16, timeout=DEADLINE + 30, ignore_eos=True).start()
    try:
        wait_until(lambda: loop.completed() >= 2 * CLIENTS, 90, "closed-loop completions before the cut")
        t_cut = time.monotonic()
        pd_hosts.cut("prefill2", "decode")
        detected = wait_counter_rises(cluster, ("prefill2", "decode"), PEER_LOSSES, losses, t_cut, DETECT_BOUND + 5,
                                      "prefill2 and decode to declare each other lost")
        t_lost = time.monotonic()
        streams = _Streams(url)
        streams.start()
        # the cut lasts until requests bound to the silent pair have been re-run on the first prefill, among them
        # ones the balancer sent to prefill2 after decode declared it lost (a stream among them), and the others were
        # served meanwhile
        wait_until(lambda: rerun("recovered") >= min_reruns
                   and any(r["meta"].get("recovery") for r in streams.results)
                   and any((r.get("meta") or {}).get("recovery")
                           for r in loop.results if r["t"] - r["latency"] >= t_lost)
                   and sum(r["status"] == 200 for r in loop.results if r["t"] - r["latency"] >= t_cut) >= 2 * CLIENTS,
                   ANSWER_BOUND + 30, "requests bound to the silent pair re-run, the others served",
                   on_timeout=lambda: f"{loop.summary()}; recoveries {rerun('started')} started, "
                                      f"{rerun('recovered')} recovered; "
                                      f"streams {[r['status'] for r in streams.results]}")
        streams.stop()
        during = [r for r in loop.results + streams.results if r["t"] >= t_cut]
        t_heal = time.monotonic()
        pd_hosts.heal()
        # a KV write prefill2 had in flight at the cut makes mooncake reconnect to decode during the cut; every
        # transfer to decode (its probe's read too) waits for that connect's next SYN, up to about the cut's length
        # after the heal (the SYN timer doubles while cut; docs/peer-liveness.md). Decode counts prefill2 back at its
        # first fetch of prefill2's info that is answered, which may wait for that too (measured once: prefill2 ran no
        # batch and ended no room for 7 s after the heal, then answered decode's fetch in that same second)
        cut_seconds = t_heal - t_cut
        bounds = {"decode": RECOVER_BOUND + cut_seconds, "prefill2": RECOVER_BOUND + cut_seconds}
        recovered = wait_counter_rises(cluster, ("prefill2", "decode"), PEER_RECOVERIES, recoveries, t_heal,
                                       max(bounds.values()) + 10, "prefill2 and decode to count the recovery")
        t_back = time.monotonic()
        served_by_prefill2 = metric_sum(cluster["prefill2"].metrics(), PROMPT_TOKENS)
        # requests sent from now on: each one served, prefill2's share among them
        wait_until(lambda: metric_sum(cluster["prefill2"].metrics(), PROMPT_TOKENS) > served_by_prefill2
                   and sum(r["status"] == 200 for r in loop.results if r["t"] - r["latency"] >= t_back) >= 2 * CLIENTS,
                   60, "prefill2 serving again after the heal")
    finally:
        loop.stop()
        if "streams" in locals():
            streams.stop()
        pd_hosts.heal()
    rerun_during = [r for r in during if (r.get("meta") or {}).get("recovery")]
    print(f"\n2P1D silent partition of prefill2: declared lost after {detected} s; recovery counted {recovered} s "
          f"after the heal; during the cut {dict(Counter(r['status'] for r in during))}, {len(rerun_during)} re-run "
          f"on the first prefill (latency {sorted(round(r['latency'], 1) for r in rerun_during)} s); "
          f"all {dict(loop.summary())}; streams {len(streams.results)}, "
          f"{sum(bool(r['meta'].get('recovery')) for r in streams.results)} re-run")
    # every answer a completion: the requests bound to the silent pair re-run on the first prefill; a stream with
    # one finish, no abort or error event
    assert all(r["status"] == 200 and r["finish"] == "length" for r in loop.results), loop.summary()
    for r in streams.results:
        judge_completed_stream(r["status"], r["body"])
        assert r["finish"] == "length", r["meta"]
    for r in loop.results + streams.results:
        assert r["latency"] <= ANSWER_BOUND, (r["latency"], r["meta"])
    reruns = judge_partition_recoveries(recoveries_before, request_recoveries(cluster["decode"].metrics()),
                                        loop.results + streams.results)
    print(f"request recoveries (cause, outcome): {reruns}")
    assert all(r["meta"]["recovery"] == {"attempts": 1, "cause": LOST} for r in rerun_during), rerun_during
    assert reruns.get((LOST, "recovered"), 0) == reruns.get((LOST, "started"), 0) >= min_reruns, reruns
    # each re-run answers the text a calm run of its prompt gives (greedy, float32), one at a time (streams first)
    for r in sorted(rerun_during, key=lambda r: "body" not in r)[:CLIENTS]:
        calm = generate(url, r["prompt"], 16, sampling={"ignore_eos": True})
        assert calm["status"] == 200 and calm["text"] == r["text"], (calm, r)
    for role, seconds in detected.items():
        assert seconds <= DETECT_BOUND, (role, seconds)
    for role, seconds in recovered.items():
        assert seconds <= bounds[role], (role, seconds, bounds[role])
    assert_idle(cluster, ROLES, baseline)
    # the silent pair counted the loss and the recovery once each, on every rank; the first prefill lost nobody
    once = {"prefill2": cluster.tp["prefill"], "decode": cluster.tp["decode"]}
    assert delta(losses, _counts(cluster, PEER_LOSSES)) == once
    wait_until(lambda: delta(recoveries, _counts(cluster, PEER_RECOVERIES)) == once, 10,
               "both recoveries counted", on_timeout=lambda: str(delta(recoveries, _counts(cluster, PEER_RECOVERIES))))
    moved = delta(causes, _causes(cluster))
    assert any(cause == "peer_failure" for (_, _, cause, _) in moved), moved
    assert not any(server == "prefill" for (server, _, _, _) in moved), moved  # nothing ended on the first prefill
    return loop.results + streams.results


def test_silent_partition_of_one_prefill_the_other_serves_its_requests(cluster, pd_hosts):
    _partition_of_prefill2(cluster, pd_hosts, cluster.url, CLIENTS)


def test_behind_the_gateway_decode_recovered_answer_is_kept(cluster, pd_hosts):
    with Gateway.fronting(cluster, host=pd_hosts.hosts["lb"]) as gateway:
        before = gateway.metrics()
        _partition_of_prefill2(cluster, pd_hosts, gateway.url, 2)
        after = gateway.metrics()
    retries = metric_sum(after, "smg_worker_retries_total") - metric_sum(before, "smg_worker_retries_total")
    charged = {role: gateway.failures(after)[role] - gateway.failures(before)[role] for role in gateway.engines}
    print(f"gateway: retries {retries}, failures charged {charged}")
    assert retries == 0 and not any(charged.values()), (retries, charged)


def test_a_prefill_that_dies_is_not_re_run(cluster):
    """prefill2 killed while decode holds requests bound to it (decode legs the test sent, their prefill legs never
    sent: they wait for prefill2's KV), and one more sent after decode declared it lost: decode answers each 502
    naming the lost prefill at once, as without recovery. Decode's tokenizer knows the first prefill (a request
    through it just completed) and starts a recovery for each, but its probe finds prefill2's port refusing
    connections: a dead process, whose requests a balancer's own retry serves (the Rust gateway's: its prefill leg
    failed too), so the failure is answered, not re-run (docs/recovery.md, "What never is"). Runs last: prefill2
    stays dead. Stock upstream 0.5.23: no recovery; decode fails the rooms at its heartbeat's loss (502 through the
    gateway)."""
    baseline = {role: held for role, held in assert_idle(cluster, ROLES).items() if role != "prefill2"}
    before = request_recoveries(cluster["decode"].metrics())
    room = 7_000_000
    _serves_through(cluster, "prefill", room)  # decode's tokenizer has seen the first prefill serve
    legs = start_legs(cluster["decode"].url, [leg_body(cluster, room + i, f"bound to prefill2 {i}",
                                                       prefill="prefill2") for i in range(1, 4)])
    wait_until(lambda: waiting_for_peer(cluster["decode"]) >= len(legs), 30, "decode waiting for prefill2's KV")
    t_gone = time.monotonic()
    cluster["prefill2"].kill()
    wait_until(lambda: all(leg.done() for leg in legs), DETECT_BOUND + 10, "decode to answer the legs of prefill2")
    late = Leg(cluster["decode"].url, leg_body(cluster, room + 9, "sent after the loss", prefill="prefill2"))
    t_late = time.monotonic()
    late.start()
    late.join(DEADLINE + 10)
    print(f"\nprefill2 killed: legs answered {[round(leg.ended_at - t_gone, 1) for leg in legs]} s after the kill, "
          f"the late one {round(late.ended_at - t_late, 1)} s after it was sent; {[leg.status for leg in legs]}, "
          f"{late.status}")
    address = f"{cluster['prefill2'].address}:{cluster.bootstrap_ports['prefill2']}"
    for leg in legs + [late]:
        detail = json.dumps(leg.response)
        assert leg.status == 502 and "PD peer lost" in detail and address in detail, (leg.status, detail)
    assert all(leg.ended_at - t_gone <= DETECT_BOUND for leg in legs)
    assert late.ended_at - t_late <= DETECT_BOUND  # its fetch refused: no wait for upstream's retries or a deadline
    moved = delta(before, request_recoveries(cluster["decode"].metrics()))
    assert moved == {(LOST, "started"): len(legs) + 1, (LOST, "not_started"): len(legs) + 1}, moved
    assert_idle(cluster, ("prefill", "decode"), baseline)
    _serves_through(cluster, "prefill", room + 20)


def _serves_through(cluster, prefill: str, room: int) -> None:
    """One request through `prefill` and decode (the test sends both legs), answered 200 on both."""
    legs = [Leg(cluster[prefill].url, leg_body(cluster, room, "served on", prefill=prefill)),
            Leg(cluster["decode"].url, leg_body(cluster, room, "served on", prefill=prefill))]
    for leg in legs:
        leg.start()
    wait_until(lambda: all(leg.done() for leg in legs), 60, f"a request through {prefill}")
    assert [leg.status for leg in legs] == [200, 200], [leg.response for leg in legs]
