"""What the fork's tests assert, written once: nothing held (a server's resource report
back to its baseline), serving goes on, a client abort's answer, a leg of a PD request
sent by the test itself, a control call on one or both servers, closed-loop clients, the
end-cause counter by role/cause/stage, the answers of a partition test, a mooncake
pair back to idle, and the metrics the dashboard and the alert rules read (promtool).

The one home of these helpers: test/srt imports them from here (never through conftest).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple

from testing.harness_snapshot import fork_tables_held
from testing.http_client import post_stream, stream_events
from testing.pd_cluster import HOST, PD_ROLES, generate, http_get, http_post_json, metric_sum, prompts, wait_until

IDLE_TIMEOUT = 60.0
# The fork's metrics (request_end_cause.COUNTERS / GAUGES, docs/metrics.md)
END_CAUSES = "sglang:pd_request_end_causes_total"
PEER_LOSSES = "sglang:pd_peer_losses_total"
PEER_RECOVERIES = "sglang:pd_peer_recoveries_total"
REQUEST_RECOVERIES = "sglang:pd_request_recoveries_total"  # recovery's counter (decode; docs/recovery.md)
TRANSFER_TIMEOUTS = "sglang:pd_transfer_timeouts_total"
CHUNK_FAILURES = "sglang:pd_transfer_chunk_failures_total"
PEERS_LOST = "sglang:pd_peers_lost"
PAUSED = "sglang:pd_paused"

# ----------------------------------------------------------------------------- nothing held


def held(report: dict) -> dict:
    """The parts of a fork_pd_resources report that must return to baseline when idle.

    KV tokens kept as evictable prefix cache are not held: only `held`/`protected`
    count. Everything else is a count of slots or entries owned by live requests.
    """
    out = {
        "kv_held": report["kv_tokens"]["held"],
        "kv_protected": report["kv_tokens"]["protected"],
        "req_slots_in_use": report["req_slots"]["total"] - report["req_slots"]["free"],
    }
    if report["metadata_slots"] is not None:
        slots = report["metadata_slots"]
        out["metadata_slots_in_use"] = slots["total"] - slots["free"]
    # requests waiting at the tokenizer's pause gate (servers only; harness reports lack it)
    out["pause_gate_held"] = report.get("pause_gate_held", 0)
    # requests decode's tokenizer holds between recovery attempts (in no scheduler; servers only)
    out["recovery_held"] = report.get("recovery_held", 0)
    out.update({f"queue.{k}": v for k, v in report["queues"].items()})
    out.update({f"rooms.{k}": v for k, v in (report["transfer_rooms"] or {}).items()})
    out.update(fork_tables_held(report.get("fork_tables")))
    for i, other in enumerate(report.get("other_ranks") or (), start=1):  # tensor parallel: the other ranks' own
        out.update({f"rank{i}.{k}": v for k, v in held({**other, "pause_gate_held": 0}).items()
                    if k not in ("pause_gate_held", "recovery_held")})
    return out


def requests_held(deployment, roles=("prefill", "decode")) -> int:
    """Requests held in the queues and running batches of these servers."""
    return sum(v for r in roles for k, v in held(deployment.resources(r)).items() if k.startswith("queue."))


def assert_idle(deployment, roles, baseline: dict | None = None, timeout: float = IDLE_TIMEOUT) -> dict:
    """Poll until every role holds what it held at baseline (default: nothing)."""
    expected = {
        role: (held(baseline[role]) if baseline else None) for role in roles
    }
    last = {}

    def idle():
        # every role read on every poll: a timeout describes each one as it was
        done = True
        for role in roles:
            now = held(deployment.resources(role))
            last[role] = now
            done = done and now == (expected[role] or {k: 0 for k in now})
        return done

    def describe():
        lines = []
        for role in roles:
            if role not in last:
                lines.append(f"{role}: never read")
                continue
            want = expected[role] or {k: 0 for k in last[role]}
            diff = {k: (v, want.get(k)) for k, v in last[role].items() if v != want.get(k)}
            lines.append(f"{role}: (now, expected) {diff}")
        return "\n".join(lines)

    wait_until(idle, timeout, "servers to release everything", on_timeout=describe)
    return {role: deployment.resources(role) for role in roles}


# Per-peer tables (fork_pd_resources.peers / mooncake_pair "peers"): entries upstream's
# decode heartbeat adds per prefill on its own schedule (0 or 1 each between two
# beats) are bounded by the prefills known, and compared as such.
HEARTBEAT_TABLES = ("heartbeat_failures", "session_pool")
# Per-peer entries kept for a while after a peer's loss and aged out `monitor_departed_after_s` later
# (prefill_side_monitor: the names of lost decodes, so nothing is pushed to them): not compared across a restart.
AGING_TABLES = ("monitor_gone",)


def stable_peer_tables(peers: dict) -> dict:
    out = {k: v for k, v in peers.items() if k not in HEARTBEAT_TABLES + AGING_TABLES}
    for k in HEARTBEAT_TABLES:
        if k in peers:
            out[k + "<=prefills"] = peers[k] <= peers.get("prefill_info_table", 0)
    return out


# ----------------------------------------------------------------------------- answers


def is_client_abort(finish_reason: Optional[Mapping[str, Any]]) -> bool:
    """Upstream's answer to a client abort: finish_reason type "abort", no error status."""
    return (
        finish_reason is not None
        and finish_reason.get("type") == "abort"
        and finish_reason.get("status_code") is None
    )


def http_client_abort(out: Mapping[str, Any]) -> bool:
    """An HTTP /generate answer ({status, body}) that is upstream's client abort (200)."""
    body = out.get("body")
    reason = body.get("meta_info", {}).get("finish_reason") if isinstance(body, dict) else None
    return out.get("status") == 200 and is_client_abort(reason)


def leg_body(cluster, room: int, text: str, max_new_tokens: int = 8, rid: Optional[str] = None,
             prefill: Optional[str] = None, **sampling) -> dict:
    """One leg of a PD request the test sends itself (it plays the load balancer); `prefill`: the prefill role it
    is bound to, at that server's address and bootstrap port (default: the first prefill, on this host)."""
    body = {
        "text": text,
        "bootstrap_host": HOST if prefill is None else cluster[prefill].address,
        "bootstrap_port": cluster.bootstrap_port if prefill is None else cluster.bootstrap_ports[prefill],
        "bootstrap_room": room,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, **sampling},
    }
    if rid is not None:
        body["rid"] = rid
    return body


class Leg(threading.Thread):
    """One leg's request (default /generate) in a thread: `out` gets status, body,
    seconds and `ended` (monotonic) once it is answered; a connection reset (the
    server was killed) is an answer with status None."""

    def __init__(self, url: str, body: dict, path: str = "/generate", timeout: float = 120.0):
        super().__init__(daemon=True)
        self.url, self.body, self.path, self.timeout = url, body, path, timeout
        self.out: Dict[str, Any] = {}

    def run(self):
        t0 = time.monotonic()
        try:
            status, body = http_post_json(self.url + self.path, self.body, timeout=self.timeout)
        except Exception as e:
            status, body = None, repr(e)
        self.out.update(status=status, body=body, seconds=time.monotonic() - t0, ended=time.monotonic())

    def done(self) -> bool:
        return "status" in self.out

    @property
    def status(self):
        return self.out.get("status")

    @property
    def response(self):
        return self.out.get("body")

    @property
    def ended_at(self):
        return self.out.get("ended")


def assert_named_5xx(legs, lost_role: str, t_gone: float, bound: float, multi_rank: bool = False) -> None:
    """Every leg (Leg) a 5xx naming the lost peer, answered within `bound` seconds of the peer being gone
    (`t_gone`, monotonic): 502 "PD peer lost: <role> peer <address> lost", or 500 naming the failed write to it.
    With tensor parallelism each rank of the lost peer has its own transfer session (its own address): a 500 names
    the session its write failed to, which may be another rank's than the one a 502 names."""
    lost = [leg for leg in legs if leg.status == 502]
    assert lost, [(leg.status, leg.response) for leg in legs]
    marker = f"{lost_role} peer {HOST}:"
    detail = json.dumps(lost[0].response)
    assert marker in detail, detail
    peer = detail[detail.index(marker) + len(marker) - len(f"{HOST}:"):].split(" ")[0]
    written_to = f"to {HOST}:" if multi_rank else f"to {peer}"
    for leg in legs:
        detail = json.dumps(leg.response)
        if leg.status == 502:
            assert f"PD peer lost: {lost_role} peer {peer} lost" in detail, detail
        else:
            assert leg.status == 500 and "Failed to send kv chunk" in detail and written_to in detail, (leg.status, detail)
        assert leg.ended_at - t_gone <= bound, leg.ended_at - t_gone


def lost_by_cause(legs) -> Dict[str, int]:
    """What the end-cause counter must have counted for legs judged by `assert_named_5xx`: a 502 is a peer
    failure, a 500 (the write that revealed the loss) a transport failure."""
    out: Dict[str, int] = {}
    for leg in legs:
        cause = {502: "peer_failure", 500: "transport"}[leg.status]
        out[cause] = out.get(cause, 0) + 1
    return out


def start_legs(url: str, bodies) -> list:
    legs = [Leg(url, b) for b in bodies]
    for leg in legs:
        leg.start()
    return legs


def assert_serves(url: str, n: int, max_new_tokens: int = 8) -> list:
    """Serving goes on: `n` greedy requests (`prompts(n)`) sent to `url` one after another
    (a burst on two loaded cores can itself be slow), each answered 200. Returns the
    answers (generate's dicts) for the caller's further checks."""
    results = [generate(url, p, max_new_tokens=max_new_tokens) for p in prompts(n)]
    assert [r["status"] for r in results] == [200] * n, [r["error"] for r in results if r["status"] != 200]
    return results


# ----------------------------------------------------------------------------- control calls


def post(server, endpoint: str, body=None, timeout: float = 60.0) -> Tuple[int, Any, float]:
    """POST /endpoint (a control call: pause, release, update...) on one server:
    (status, reply, seconds it took)."""
    t0 = time.monotonic()
    status, reply = http_post_json(f"{server.url}/{endpoint}", body if body is not None else {}, timeout=timeout)
    return status, reply, time.monotonic() - t0


def call(cluster, role: str, endpoint: str, body=None, timeout: float = 60.0) -> Tuple[int, Any, float]:
    """`post` on the cluster's server of that role."""
    return post(cluster[role], endpoint, body, timeout)


def on_both(cluster, endpoint: str, body=None, log: Optional[list] = None, timeout: float = 60.0,
            at_once: bool = True) -> Dict[str, Tuple[int, Any, float]]:
    """The call on prefill and decode, at once (as a framework's ray.get over engines)
    or one after the other (`at_once=False`); each must answer 200. `log` gets
    (role, endpoint, status, seconds) per call."""
    def one(role):
        return call(cluster, role, endpoint, body, timeout)

    if at_once:
        with ThreadPoolExecutor(len(PD_ROLES)) as pool:
            results = dict(zip(PD_ROLES, pool.map(one, PD_ROLES)))
        checked = results.items()
    else:
        results = {}

        def checked_in_turn():
            for role in PD_ROLES:
                results[role] = one(role)
                yield role, results[role]

        checked = checked_in_turn()
    for role, (status, reply, took) in checked:
        if log is not None:
            log.append((role, endpoint, status, round(took, 2)))
        assert status == 200, (role, endpoint, body, status, reply)
    return results


def weight_versions(cluster) -> Dict[str, str]:
    """{role: weight_version} of both servers from GET /model_info, each checked against
    GET /get_weight_version (where RL engine clients written for earlier sglang releases
    read it)."""
    out = {}
    for role in PD_ROLES:
        status, body = http_get(f"{cluster[role].url}/model_info")
        assert status == 200, (role, body)
        out[role] = json.loads(body)["weight_version"]
        status, body = http_get(f"{cluster[role].url}/get_weight_version")
        assert status == 200 and json.loads(body) == {"weight_version": out[role]}, (role, status, body)
    return out


# ----------------------------------------------------------------------------- closed-loop clients


class ClosedLoop:
    """n clients, each sending its next greedy request as soon as the last one is
    answered, until stop(); every answer is recorded (status, latency, finish type, prompt).
    `ignore_eos`: every completion runs to max_new_tokens (finish "length"); the tiny random
    model's greedy argmax can land on EOS depending on the batch a request shares, so a test
    that tells completions by "length" must not depend on it."""

    def __init__(self, url: str, n: int, max_new_tokens: int = 24, timeout: float = 120.0,
                 ignore_eos: bool = False):
        self.url, self.n, self.max_new_tokens, self.timeout = url, n, max_new_tokens, timeout
        self.sampling = {"ignore_eos": ignore_eos}  # over generate's greedy defaults
        self.results = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def _run(self, i: int) -> None:
        texts = prompts(64)
        k = 0
        while not self._stop.is_set() and k < 10_000:
            prompt = texts[(i * 7 + k) % len(texts)]
            r = generate(self.url, prompt, self.max_new_tokens, timeout=self.timeout, sampling=self.sampling)
            r["prompt"] = prompt
            r["finish"] = (r["meta"] or {}).get("finish_reason", {}).get("type") if r["meta"] else None
            r["t"] = time.monotonic()
            self.results.append(r)
            k += 1

    def start(self) -> "ClosedLoop":
        for t in self._threads:
            t.start()
        return self

    def completed(self) -> int:
        return sum(r["status"] == 200 and r["finish"] == "length" for r in self.results)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 10)
        assert not any(t.is_alive() for t in self._threads), "a client is still waiting"

    def summary(self) -> Counter:
        return Counter((r["status"], r["finish"] or str(r["error"])[:90]) for r in self.results)


def judge_completed_stream(status: int, body: str, text: Optional[str] = None) -> Dict[str, Any]:
    """A /generate stream answered as a completion: 200, ended with [DONE], exactly one finish and it no abort, no
    error event; its text `text` when given (/generate streams the text so far). Returns the last event."""
    assert status == 200, body
    events, done = stream_events(body)
    assert done, body
    finishes = [e["meta_info"]["finish_reason"] for e in events if e["meta_info"].get("finish_reason")]
    assert len(finishes) == 1 and finishes[0]["type"] != "abort", finishes
    assert not any("error" in e for e in events), body
    if text is not None:
        assert events[-1]["text"] == text, (events[-1], text)
    return events[-1]


def recovered_stream(url: str, text: str, rid: str, calm_text: str, cause: str, max_new_tokens: int) -> float:
    """Stream `text` greedily under `rid` from `url` and check the recovered stream: a completed stream
    (`judge_completed_stream`) of the calm control's text, its `meta_info.recovery` one attempt for `cause`; the seconds
    it took."""
    payload = {"text": text, "rid": rid, "stream": True,
               "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}}
    t0 = time.monotonic()
    status, body = post_stream(url + "/generate", payload)
    took = time.monotonic() - t0
    last = judge_completed_stream(status, body, calm_text)
    assert last["meta_info"]["recovery"] == {"attempts": 1, "cause": cause}, last["meta_info"]
    return took


# The test-hosts partition tests' deployment and bounds (each bound is what its mechanism allows plus MARGIN).
PARTITION_HEARTBEAT = 2.0  # upstream's floor
PARTITION_MAX_FAILURE = 2
PARTITION_DEADLINE = 15.0  # the transfer deadline: what cannot be observed ends by then (504)
PARTITION_ENV = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": str(PARTITION_HEARTBEAT),
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": str(PARTITION_MAX_FAILURE),
    "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": str(PARTITION_DEADLINE),
    # as docs/peer-liveness.md advises where partitions are a concern: a KV write in flight at the cut is dropped
    # once it has made no progress for about the loss detection time, instead of holding mooncake's connection to
    # the decode past the heal (30 s by default)
    "MC_TCP_PROGRESS_TIMEOUT_SEC": str(int(PARTITION_MAX_FAILURE * PARTITION_HEARTBEAT + 1)),
    # recovery on, on both servers (docs/recovery.md, "A partition between prefill and decode"): the partition's
    # answers are those of recovery off; what recovery meets around it is judged by judge_partition_recoveries
    "SGLANG_FORK_RECOVERY_ATTEMPTS": "1",
}
PARTITION_CONNECT_TIMEOUT = 1.0  # peer_monitor.CONNECT_TIMEOUT: what a silent heartbeat costs
PARTITION_MARGIN = 3.0  # a busy 2-core machine: scheduler ticks, metric export
# declared lost on the MAX_FAILURE-th silent heartbeat, the first within one interval of the cut
PARTITION_DETECT_BOUND = PARTITION_MAX_FAILURE * PARTITION_HEARTBEAT + PARTITION_CONNECT_TIMEOUT + PARTITION_MARGIN
PARTITION_PROBE_READ_RETRY = 1.2  # chunk_failures.probe_session: a read refused once is retried after a 1 s cooldown
# served again: the first tick after the heal sees the link answer (within an interval, after at most one silent
# connect), and the transfer engine probe it starts then (a new one: not one started during the cut) lets it in
PARTITION_RECOVER_BOUND = (PARTITION_HEARTBEAT + PARTITION_CONNECT_TIMEOUT + PARTITION_PROBE_READ_RETRY
                           + PARTITION_MARGIN)
# no client waits past its deadline: one per stage (docs/transfer-deadline.md), and a request waits in at most two
# (decode's handshake and preallocation, then its transfer)
PARTITION_ANSWER_BOUND = 2 * PARTITION_DEADLINE + PARTITION_MARGIN


def judge_partition_answers(results, peers: Mapping[str, str], answer_bound: float) -> None:
    """Every answer of a partition test (ClosedLoop results, ignore_eos; or generate's with "finish" set): a
    completion run to max_new_tokens, a 502 "PD peer lost" naming one of `peers` (role -> address), a 504 (its
    deadline came first), or a 500 naming a KV write to one of `peers` that failed (a request handshaken around the
    heal, by a decode that counted the recovery before prefill's mooncake session to it reconnected:
    docs/peer-liveness.md); none later than `answer_bound` seconds. Called by the test-hosts partition tests."""
    for r in results:
        assert r["latency"] <= answer_bound, (r["latency"], r["status"], str(r["error"])[:300])
        if r["status"] == 200:
            assert r["finish"] == "length", r
            continue
        detail = json.dumps(r["error"])
        if r["status"] == 502:
            assert "PD peer lost" in detail and any(p in detail for p in peers.values()), detail
        elif r["status"] == 500:
            assert "Failed to send kv chunk" in detail and any(p in detail for p in peers.values()), detail
        else:
            assert r["status"] == 504, (r["status"], detail)


RECOVERY_ENDS = ("recovered", "failed", "not_started")  # how a recovery started around a partition may end


def judge_partition_recoveries(before: Mapping, after: Mapping, results) -> dict:
    """What recovery (on in PARTITION_ENV) did in a partition test: `before` and `after` are decode's
    `request_recoveries`, `results` every answer the test got (ClosedLoop's and its own, each with "meta"). Each
    recovery started ended (recovered, failed or not started: none left held, none aborted, no weight version
    changed), and as many answers say in their meta_info that they were recovered as the counter counts, each a
    completion. The partition's own answers (502 naming the lost peer, a 504 at decode's handshake deadline) are not
    recoverable causes: judge_partition_answers judges them as with recovery off. Returns the counter's delta."""
    moved = delta(before, after)
    assert all(outcome == "started" or outcome in RECOVERY_ENDS for (_, outcome) in moved), moved
    for cause in {c for (c, _) in moved}:
        assert moved.get((cause, "started"), 0) == sum(moved.get((cause, o), 0) for o in RECOVERY_ENDS), moved
    recovered = [r for r in results if ((r.get("meta") or {}).get("recovery"))]
    assert len(recovered) == sum(n for (_, outcome), n in moved.items() if outcome == "recovered"), (moved, recovered)
    assert all(r["status"] == 200 and r["finish"] == "length" for r in recovered), recovered
    return moved


def wait_counter_rises(cluster, roles, name: str, before: Mapping[str, float], since: float, timeout: float,
                       what: str) -> Dict[str, float]:
    """Wait until the Prometheus counter `name` grew past `before[role]` on every one of `roles`; returns
    {role: seconds after `since` it was first seen grown} (polled every 0.1 s). The partition tests' loss and
    recovery timings."""
    seen: Dict[str, float] = {}

    def all_seen() -> bool:
        for role in roles:
            if role not in seen and metric_sum(cluster[role].metrics(), name) > before[role]:
                seen[role] = time.monotonic() - since
        return len(seen) == len(roles)

    wait_until(all_seen, timeout, what, interval=0.1)
    return seen


# ----------------------------------------------------------------------------- counters


def request_recoveries(metrics: Mapping[str, float]) -> Dict[Tuple[str, str], float]:
    """`sglang:pd_request_recoveries_total` samples as {(cause, outcome): n} (decode's tokenizer exports them)."""
    out: Dict[Tuple[str, str], float] = {}
    for labels, value in samples(metrics, REQUEST_RECOVERIES):
        k = (labels["cause"], labels["outcome"])
        out[k] = out.get(k, 0.0) + value
    return out


def end_cause_samples(metrics: Mapping[str, float]) -> Iterator[Tuple[Dict[str, str], float]]:
    """Each `sglang:pd_request_end_causes_total` sample as (its labels {name: value}, its value)."""
    for key, value in metrics.items():
        if key.startswith(END_CAUSES + "{"):
            labels = dict(p.split("=", 1) for p in key[len(END_CAUSES) + 1 : -1].split(","))
            yield {k: v.strip('"') for k, v in labels.items()}, value


def end_causes(metrics: Mapping[str, float]) -> Dict[Tuple[str, str, str], float]:
    """`sglang:pd_request_end_causes_total` samples as {(role, cause, stage): n}, summed over the other
    labels (with tensor parallelism each rank exports its own `tp_rank`: an end counted on two ranks counts 2)."""
    out: Dict[Tuple[str, str, str], float] = {}
    for labels, value in end_cause_samples(metrics):
        k = (labels["role"], labels["cause"], labels["stage"])
        out[k] = out.get(k, 0.0) + value
    return out


def delta(before: Mapping, after: Mapping) -> dict:
    """What changed between two counter snapshots (keys that did not change omitted)."""
    keys = set(before) | set(after)
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys if after.get(k, 0) != before.get(k, 0)}


def cluster_end_causes(cluster, roles=("prefill", "decode")) -> Dict[Tuple[str, str, str], float]:
    out = {}
    for role in roles:
        out.update(end_causes(cluster.metrics(role)))
    return out


def wait_end_causes(cluster, before: Mapping, expected: Mapping, timeout: float = 10.0,
                    roles=("prefill", "decode")) -> dict:
    """Poll until the end-cause counter moved by exactly `expected` since `before`
    (metrics are exported by the scheduler a moment after the answer)."""
    last = {}
    before = {k: v for k, v in before.items() if k[0] in roles}

    def moved():
        last["d"] = delta(before, cluster_end_causes(cluster, roles))
        return last["d"] == dict(expected)

    wait_until(moved, timeout, "the end-cause counter to move",
               on_timeout=lambda: f"delta {last.get('d')} != expected {dict(expected)}")
    return last["d"]


# ----------------------------------------------------------------------------- mooncake pair


def pair_snapshots(pair) -> tuple:
    return pair.prefill.call("snapshot"), pair.decode.call("snapshot")


def pair_is_idle(pair) -> bool:
    """Both sides hold what they held when the pair fixture took `pair.idle`."""
    return pair_snapshots(pair) == pair.idle


def assert_pair_idle(pair) -> None:
    assert pair_snapshots(pair) == pair.idle


def wait_pair_idle(pair, timeout: float = 30.0) -> float:
    """Tick both sides until both are back to the idle snapshot; returns seconds."""
    return pair.run_until(lambda: pair_is_idle(pair), timeout=timeout)


def pair_new_causes(side, before: Mapping[str, float]) -> Dict[str, float]:
    """The end-cause counts (role/cause/stage) that moved on a pair's `side` since
    `before` (its `end_causes` then)."""
    return {k: v - before.get(k, 0) for k, v in side.call("end_causes").items() if v != before.get(k, 0)}


def pair_fixture(scope: str = "module", prepare: Optional[Callable[[Any], None]] = None, **kwargs):
    """A pytest fixture yielding a MooncakePair(**kwargs) with `pair.idle`, both
    sides' snapshot as started (taken before `prepare(pair)`, when given, runs)."""
    import pytest

    from testing.mooncake_pair import MooncakePair

    @pytest.fixture(scope=scope)
    def pair():
        with MooncakePair(**kwargs) as p:
            p.idle = pair_snapshots(p)
            if prepare is not None:
                prepare(p)
            yield p

    return pair


# ----------------------------------------------------------------------------- skewed pause windows


def is_completion_or_abort_answer(r: Mapping[str, Any]) -> bool:
    """What an RL client may get from a pause cycle (pd_cluster.generate's result): a
    completion, or upstream's abort answer (HTTP 200, finish_reason abort)."""
    return r["status"] == 200 and r["meta"]["finish_reason"]["type"] in ("length", "stop", "abort")


def bootstrap_queue(prefill) -> int:
    return prefill.resources()["queues"]["prefill_bootstrap"]


def waiting_for_peer(server) -> int:
    """Copies `server` holds in the PD queues where they wait for the other server."""
    q = server.resources()["queues"]
    if server.role == "prefill":
        return q["prefill_bootstrap"]
    return q["decode_prealloc"] + q["decode_transfer"]


def at_gate(server) -> int:
    """Requests `server`'s tokenizer holds at its pause gate right now."""
    return server.resources()["pause_gate_held"]


def abort_gate_until_let_go(running, paused, timeout: float, what: str) -> float:
    """`paused` aborts everything at its pause gate (`abort_all`, what a client or
    gateway giving up does) while `running` holds those requests' copies waiting for it;
    polls until `running` let go of them all. Returns the seconds from the abort call."""
    t_end = time.monotonic()
    status, reply, _ = post(paused, "abort_request", {"abort_all": True})
    assert status == 200, (paused.role, status, reply)
    wait_until(lambda: waiting_for_peer(running) == 0, timeout, what,
               interval=0.05, on_timeout=lambda: str(running.resources()["queues"]))
    return time.monotonic() - t_end


def skewed_abort_pause_cycles(prefill, decode, url: str, cycles: int, clients: int,
                              unanswered_s: float = 10.0, emptied_s: float = 1.5,
                              first: str = "prefill") -> list:
    """Hole 1 of issue 13 (and its mirror), driven `cycles` times under `clients`
    closed-loop clients sending to `url` (a balancer in front of `prefill` and
    `decode`): both servers paused in abort mode, released, resumed; then `first` is
    continued before the other. With first="prefill", new requests reach prefill and
    wait in its bootstrap queue for decode's handshake while decode's copies wait at its
    pause gate; with first="decode", they wait in decode's decode_prealloc /
    decode_transfer queues for prefill's KV while prefill's copies wait at its gate.
    Then the still-paused server aborts them at its gate (`abort_all`, what a client or
    gateway giving up does) and continues.

    Asserts per cycle: the running server's waiting queue empties within `emptied_s`
    of the other's end, no request open longer than `unanswered_s`. Returns every
    answer (generate()'s dicts with `latency_s`); the caller asserts what they must be."""
    from testing.pd_cluster import generate

    assert first in ("prefill", "decode"), first
    running, paused = (prefill, decode) if first == "prefill" else (decode, prefill)

    def ok(server, endpoint, body=None):
        status, reply, _ = post(server, endpoint, body)
        assert status == 200, (server.role, endpoint, status, reply)

    halt, go = threading.Event(), threading.Event()
    go.set()
    results, lock = [], threading.Lock()
    open_since: dict = {}

    def client(k):
        i = 0
        while not halt.is_set():
            go.wait()
            if halt.is_set():
                return
            rid = f"skew-{k}-{i}-{time.monotonic_ns()}"
            with lock:
                open_since[rid] = time.monotonic()
            r = generate(url, f"closed loop {k} {i}: hello world", max_new_tokens=16, timeout=120, rid=rid)
            with lock:
                r["latency_s"] = time.monotonic() - open_since.pop(rid)
                results.append(r)
            i += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    try:
        def completions():
            with lock:
                return sum(r["status"] == 200 and r["meta"]["finish_reason"]["type"] != "abort" for r in results)

        for cycle in range(cycles):
            served = completions()
            # serving again before each cycle: completions, not the last cycle's aborts
            wait_until(lambda: completions() >= served + 2, 60, f"completions before cycle {cycle}")
            # `first` is paused first too: a request arriving between the two pauses
            # has one copy ended by the second pause and the other held at `first`'s
            # gate, which `first`'s continue (before the wait below) settles
            for endpoint, body in (("pause_generation", {"mode": "abort"}), ("release_memory_occupation", None),
                                   ("resume_memory_occupation", None)):
                ok(running, endpoint, body)
                ok(paused, endpoint, body)
            ok(running, "continue_generation")
            wait_until(lambda: waiting_for_peer(running) > 0, 30, f"{first} copies waiting (cycle {cycle})")
            # no new request from here to the other's continue: the ones open now are
            # exactly the copies `running` holds for the paused server (pacing, not a sleep)
            go.clear()

            def open_rids():
                with lock:
                    return sorted(open_since)

            seen_waiting = []  # `running`'s count at each poll where every open request had a copy at the gate

            def all_open_at_running():
                with lock:
                    n_open = len(open_since)
                waiting = waiting_for_peer(running)
                if n_open == 0 or waiting == 0:
                    # the ones counted ended before the abort (e.g. copies whose peer
                    # ended at its pause): let clients send again until some wait
                    go.set()
                    seen_waiting.clear()
                    return False
                go.clear()
                # and the paused server's tokenizer holds each one's other copy (the
                # balancer may still be sending it): the abort below must meet them all
                if at_gate(paused) < n_open:
                    seen_waiting.clear()
                    return False
                seen_waiting.append(waiting)
                # Every open request has a copy at `running` too, or `running` ended some
                # copies at its own abort-mode pause while their other copies reached the
                # paused gate after that server's pause (no client can send more then):
                # the same count three polls running means no copy is still on its way
                return waiting == n_open or seen_waiting[-3:] == [waiting] * 3

            wait_until(all_open_at_running, 30, f"every open request waiting at {first} and its gate (cycle {cycle})",
                       on_timeout=lambda: f"{running.resources()['queues']}, at the gate: {at_gate(paused)}, "
                                          f"open: {open_rids()}")
            emptied = abort_gate_until_let_go(running, paused, 5, f"{first}'s waiting queue to empty (cycle {cycle})")
            assert emptied <= emptied_s, (cycle, first, emptied)
            ok(paused, "continue_generation")
            go.set()
            with lock:
                stuck = [rid for rid, t0 in open_since.items() if time.monotonic() - t0 > unanswered_s]
            assert not stuck, f"unanswered after {unanswered_s}s: {stuck}"
    finally:
        halt.set()
        go.set()
        for t in threads:
            t.join(unanswered_s + 30)
        for server in (prefill, decode):  # never leave a shared deployment paused
            http_post_json(f"{server.url}/continue_generation", {}, timeout=60)
    assert not [t for t in threads if t.is_alive()], "a request hangs"
    assert max(r["latency_s"] for r in results) <= unanswered_s, sorted(r["latency_s"] for r in results)[-5:]
    return results


def assert_pair_serves(pair, rooms) -> None:
    """Submitted rooms transfer intact and end 200 on both sides of a mooncake pair."""
    pair.run_until(
        lambda: all(pair.decode.call("transferred", r) and pair.prefill.call("status", r) == 200 for r in rooms),
        timeout=60,
    )
    for r in rooms:
        assert pair.decode.call("kv_bytes", r) == pair.prefill.call("kv_sent", r)
        pair.decode.call("finish", r)


# ----------------------------------------------------------------------------- dashboard and alert rules

DOCS = Path(__file__).resolve().parents[1] / "docs"
RULES = DOCS / "prometheus" / "pd-fork-rules.yml"
RULES_TESTS = DOCS / "prometheus" / "pd-fork-rules.test.yml"
DASHBOARD = DOCS / "grafana" / "pd-fork.json"
_METRIC_NAME = re.compile(r"\bsglang:[A-Za-z0-9_:]+")


def dashboard_exprs() -> Dict[str, str]:
    """Each PromQL expression of the Grafana dashboard (panel targets and template queries): {where: expr}."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", ()):
            out[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            out[f"variable {var['name']}"] = var["definition"]
    return out


def rule_exprs() -> Dict[str, str]:
    """Each alert rule's expression: {alert name: expr}."""
    import yaml

    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}


def referenced_metrics() -> Dict[str, set]:
    """Every metric name the dashboard and the alert rules read: {name: {where}}."""
    out: Dict[str, set] = {}
    for where, expr in {**dashboard_exprs(), **{f"alert {k}": v for k, v in rule_exprs().items()}}.items():
        for name in _METRIC_NAME.findall(expr):
            out.setdefault(name, set()).add(where)
    return out


def exported_names(metrics: Mapping[str, float]) -> set:
    """The metric (sample) names of a /metrics scrape (testing.pd_cluster's {name{labels}: value})."""
    return {key.partition("{")[0] for key in metrics}


def samples(metrics: Mapping[str, float], name: str) -> list:
    """Each sample of `name` in a scrape as (its labels {name: value}, its value)."""
    out = []
    for key, value in metrics.items():
        if key.startswith(name + "{"):
            pairs = re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', key[len(name):])
            out.append((dict(pairs), value))
        elif key == name:
            out.append(({}, value))
    return out


def promtool() -> str:
    """Path of promtool (Debian's `prometheus` package; `make system-deps` installs it). Missing, the test
    fails (it does not skip): CI installs it."""
    path = shutil.which("promtool")
    assert path is not None, "promtool not found: run `make system-deps` (as root it installs Debian's prometheus)"
    return path


def run_promtool(*args: str, cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """promtool with `args`; its output on failure."""
    done = subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"promtool {' '.join(args)} -> {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done
