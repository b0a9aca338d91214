"""Real CPU servers (1P1D, mooncake over TCP, greedy; TP 1 in `make test`, TP 2 float32 in `make test-tp`), one
deployment for every recoverable cause, behind the mini load balancer and (a failed KV chunk write, a stalled transfer)
behind the Rust gateway (sglang-router 0.3.2, its defaults, the engines registered with POST /workers): a transfer
that fails while prefill is alive, before decode's first token, is recovered: decode's tokenizer re-runs the request
under a new bootstrap room (docs/recovery.md), and prefill answers its leg of a failed chunk write's room, or of a room
its own deadline ended, as an abort handed to that recovery (a room decode's deadline ended: as decode's abort).
The client gets 200 with the calm control's text, a stream has exactly one finish and no abort or error event,
`meta_info` says it was recovered and why, the gateway neither retries nor charges a circuit, both servers are idle
after (every rank) and keep serving. A fault on every attempt is answered as without recovery, once, within the
budget. The causes (the fault switch SGLANG_TEST_DISAGG_FAIL_CHUNKS on prefill picks the request by rid):
- `kv`: the first KV chunk write fails on prefill (`kv+first`). Stock upstream 0.5.23 (and the fork with
  SGLANG_FORK_RECOVERY_ATTEMPTS=0): 500 naming the failed KV chunk (non-streaming); a stream ends with finish_reason
  abort carrying the 500 (measured: 6 of 6 streams); behind the gateway a non-streaming one is retried on a new
  room (5 attempts, both circuits charged each time).
- `aux`: the aux (metadata) write fails on prefill (`aux+first`). Upstream and the fork without recovery: 500 naming
  the aux write ("Failed to send aux data"), as test_chunk_failures_e2e answers it.
- `stall`: prefill's transfer worker reports the first KV write STALL_S late (`kv+delay=S+first`: prefill stays alive
  and keeps serving), past the DEADLINE_S transfer deadline of both servers. Whichever deadline ends the room first
  (decode's in decode_transfer, handed to recovery; or prefill's in prefill_inflight, told to decode), decode's
  tokenizer re-runs it; the new attempt has its own deadline and meets the worker free again. The fork without
  recovery: 504 on both legs at the deadline (test_transfer_deadline_e2e). Stock upstream 0.5.23 has no deadline in
  these stages (decode_transfer / prefill_inflight unbounded, docs/transfer-deadline.md): it answers 200 once the
  stalled worker reports, here after STALL_S; a worker stalled for good holds the request forever.

An extra-state write (`state`) never happens with this model: a dense llama has no state pool, so prefill sends no
state chunk; test_recovery_state_chunk_e2e fails one with a hybrid sliding-window model (the same cause as `kv` and
`aux`, `chunk_failure`). The `+first` option fires on a request's first attempt only."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from conftest import FP32, TP2, topology_params
from testing.pd_checks import (PD_ROLES, assert_idle, cluster_end_causes, delta, recovered_stream,
                               wait_end_causes)
from testing.polling import wait_until
from testing.pd_cluster import Gateway, PDCluster, SingleServer, generate, metric_sum, prompts

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 12
RELEASE_ENV = {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "3"}
# Both servers' transfer deadline; the stall outlasts it but ends before a second attempt's own deadline would (that
# attempt's KV waits behind the stalled worker: one transfer queue per decode session).
DEADLINE_S = 5.0
STALL_S = 7.0
DEADLINE_ENV = {"SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": str(DEADLINE_S)}
FAULTS = ",".join(("kv+first:rid=rec-once-", "kv:rid=rec-always-",
                   "aux+first:rid=rec-aux-once-", "aux:rid=rec-aux-always-",
                   f"kv+delay={STALL_S:g}+first:rid=rec-stall-once-", f"kv+delay={STALL_S:g}:rid=rec-stall-always-"))
BUDGET_S = 20.0
RECOVERY_ENV = {"SGLANG_FORK_RECOVERY_ATTEMPTS": "1", "SGLANG_FORK_RECOVERY_BUDGET": str(BUDGET_S)}
# a recovered request: its failed attempt (a scheduler tick or two on each side, or the deadline) plus a calm one
RECOVERED_WITHIN_S = 30.0
TIMEOUTS = "sglang:pd_transfer_timeouts_total"


@dataclass(frozen=True)
class Cause:
    once: str  # rid prefix of a request whose first attempt fails
    always: str  # ... whose every attempt fails
    cause: str  # meta_info["recovery"]["cause"]
    status: int  # the failure's own answer (without recovery, or when every attempt fails)
    names: str  # what that answer's message says
    earliest: float = 0.0  # a recovered answer comes no earlier (the deadline's)


CAUSES = {
    "kv": Cause("rec-once-", "rec-always-", "chunk_failure", 500, "Failed to send kv chunk"),
    "aux": Cause("rec-aux-once-", "rec-aux-always-", "chunk_failure", 500, "Failed to send aux data"),
    "stall": Cause("rec-stall-once-", "rec-stall-always-", "transfer_deadline", 504, "PD transfer deadline exceeded",
                   earliest=DEADLINE_S),
}
PROMPT = {"kv": 1, "aux": 5, "stall": 7}  # each case its own prompt (testing.pd_cluster.prompts)


# the gateway's own retries (sglang-router 0.3.2 defaults: 5 attempts in all, 50-169 ms apart)
GATEWAY_ATTEMPTS = 5
# prefill counts the failed room's request as before (the verdict's row tags it transport), once: no gateway retry
PREFILL_FAILED_ONCE = {("prefill", "transport", "prefill_inflight"): 1}
# Behind the gateway, each case by the fault that makes it: a failed chunk write (`kv`); a stall whichever deadline
# ends its room first (`stall`: with one deadline on both servers, measured: decode's, in decode_transfer, handed to
# recovery and told to prefill by decode's abort); a stall whose room prefill's own deadline ends (`stall_prefill`:
# decode frozen across prefill's prefill_inflight deadline, as a decode too busy to scan would be).
GATEWAY_KINDS = {"kv": "kv", "aux": "aux", "stall": "stall", "stall_prefill": "stall"}
GATEWAY_PROMPTS = {"kv": prompts(16)[3:5], "aux": prompts(18)[16:18], "stall": prompts(16)[12:14],
                   "stall_prefill": prompts(16)[14:16]}
# ... and how prefill counts the failed room's request, once (no gateway retry): a chunk failure as a transport
# failure; a stall as the deadline that ended its room (prefill's own, counted as the deadline it is), or as the
# peer's abort (decode's deadline, told by decode's abort)
PREFILL_ENDS = {
    "kv": (PREFILL_FAILED_ONCE,),
    "aux": (PREFILL_FAILED_ONCE,),
    "stall": ({("prefill", "timeout", "prefill_inflight"): 1}, {("prefill", "client_abort", "prefill_inflight"): 1}),
    "stall_prefill": ({("prefill", "timeout", "prefill_inflight"): 1},),
}
# Recovery is one knob for both servers: decode re-runs the request, prefill answers its leg as handed over.
ENVS = {"prefill_env": {"SGLANG_TEST_DISAGG_FAIL_CHUNKS": FAULTS, **RELEASE_ENV, **DEADLINE_ENV, **RECOVERY_ENV},
        "decode_env": {**RELEASE_ENV, **DEADLINE_ENV, **RECOVERY_ENV}}


@pytest.fixture(scope="module", params=topology_params(TP2))
def deployment(deployments, shared_single, request):
    """(the 1P1D behind its mini LB, a plain control server): TP 1 beside the shared control; TP 2 on both servers
    (float32) beside its own float32 control (`make test-tp`)."""
    if request.param.multi_rank:
        cluster = PDCluster(deployments.model, **request.param.pd_kwargs(**ENVS))
        single = SingleServer(deployments.model, args=FP32)
        with deployments.scoped(cluster, single):
            yield cluster, single
        return
    cluster, single = deployments.pd_and_single(shared_single, **ENVS)
    try:
        yield cluster, single
    finally:
        deployments.discard(cluster)


@pytest.fixture(scope="module")
def gateway(deployment):
    """The Rust gateway (its defaults: retries, circuit breaker) in front of the same engines, each registered with
    POST /workers."""
    with Gateway.fronting(deployment[0]) as gw:
        yield gw


def _calm(single, text):
    calm = generate(single.url, text, max_new_tokens=MAX_NEW_TOKENS)
    assert calm["status"] == 200, calm
    return calm


def _timed(cluster, text, rid):
    """(the PD deployment's answer to `text` under `rid`, the seconds it took)."""
    t0 = time.monotonic()
    got = generate(cluster.url, text, max_new_tokens=MAX_NEW_TOKENS, rid=rid)
    return got, time.monotonic() - t0


def _timeouts(cluster) -> float:
    """Transfer deadlines that fired, on both servers."""
    return sum(metric_sum(cluster.metrics(role), TIMEOUTS) for role in PD_ROLES)


def _deadline_fired(kind: str, cluster, before: float) -> None:
    """A stall's room was ended by a deadline (decode's, prefill's, or both at once), a chunk failure's by none."""
    fired = _timeouts(cluster) - before
    assert (1 <= fired <= 2) if kind == "stall" else fired == 0, (kind, fired)


def _serves(cluster, text, calm, rid) -> None:
    again = generate(cluster.url, text, max_new_tokens=MAX_NEW_TOKENS, rid=rid)
    assert again["status"] == 200 and again["text"] == calm["text"] and "recovery" not in again["meta"], again


def _prefill_ended_once(cluster, before, kind: str) -> None:
    """Prefill counted the failed room's request once, as `PREFILL_ENDS[kind]` says (no gateway retry)."""
    last = {}

    def once():
        last["d"] = delta(before, cluster_end_causes(cluster, ("prefill",)))
        return last["d"] in PREFILL_ENDS[kind]

    wait_until(once, 10.0, "prefill's end-cause counter to move once",
               on_timeout=lambda: f"delta {last.get('d')} not one of {PREFILL_ENDS[kind]}")


def _prefill_deadlines(cluster) -> float:
    return metric_sum(cluster.metrics("prefill"), TIMEOUTS, stage="prefill_inflight")


def _through(cluster, kind: str, call):
    """`call()`'s result; for `stall_prefill`, decode is frozen from when it waits for the KV (its request in
    decode_transfer) until prefill's own deadline has ended the room (prefill_inflight), then resumed: prefill's
    deadline comes first, as for a decode whose loop is too busy to scan (decode's own fires after, or decode hears
    prefill's first; either way its tokenizer re-runs the request)."""
    if kind != "stall_prefill":
        return call()
    decode, before, out = cluster["decode"], _prefill_deadlines(cluster), {}
    worker = threading.Thread(target=lambda: out.update(result=call()), daemon=True)
    worker.start()
    wait_until(lambda: decode.resources()["queues"]["decode_transfer"] == 1, 30, "decode to wait for the KV")
    decode.freeze()
    try:
        wait_until(lambda: _prefill_deadlines(cluster) > before, 3 * DEADLINE_S, "prefill's own deadline")
    finally:
        decode.resume()
    worker.join(RECOVERED_WITHIN_S + 30)
    assert not worker.is_alive() and "result" in out, out
    return out["result"]


@pytest.mark.parametrize("kind", list(CAUSES))
def test_a_transfer_failed_before_the_first_token_is_recovered_non_streaming(deployment, kind):
    cluster, single = deployment
    cause = CAUSES[kind]
    baseline = assert_idle(cluster, PD_ROLES)
    text = prompts(12)[PROMPT[kind]]
    calm = _calm(single, text)
    timeouts = _timeouts(cluster)
    got, took = _timed(cluster, text, f"{cause.once}ns-1")
    assert got["status"] == 200, got
    assert got["text"] == calm["text"] and got["output_ids"] == calm["output_ids"], (got, calm)
    assert got["meta"]["recovery"] == {"attempts": 1, "cause": cause.cause}, got["meta"]
    assert cause.earliest <= took < RECOVERED_WITHIN_S, took
    _deadline_fired(kind, cluster, timeouts)
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    _serves(cluster, text, calm, f"calm-after-ns-{kind}")


@pytest.mark.parametrize("kind", list(CAUSES))
def test_a_transfer_failed_before_the_first_token_is_recovered_streaming(deployment, kind):
    cluster, single = deployment
    cause = CAUSES[kind]
    baseline = assert_idle(cluster, PD_ROLES)
    text = prompts(12)[PROMPT[kind] + 1]
    calm = _calm(single, text)
    timeouts = _timeouts(cluster)
    took = recovered_stream(cluster.url, text, f"{cause.once}s-1", calm["text"], cause.cause, MAX_NEW_TOKENS)
    assert cause.earliest <= took < RECOVERED_WITHIN_S, took
    _deadline_fired(kind, cluster, timeouts)
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    _serves(cluster, text, calm, f"calm-after-s-{kind}")


@pytest.mark.parametrize("kind", ["kv", "stall"])
def test_a_fault_on_every_attempt_answers_the_failure_once_within_the_budget(deployment, kind):
    """Every attempt fails (the fault without `+first`): the failure's own answer (500 naming the chunk; the stall:
    the deadline's 504, from the second attempt's own deadline), once, within the budget and the last attempt's own
    deadline."""
    cluster, single = deployment
    cause = CAUSES[kind]
    baseline = assert_idle(cluster, PD_ROLES)
    text = prompts(12)[10 if kind == "kv" else 11]
    calm = _calm(single, text)
    got, took = _timed(cluster, text, f"{cause.always}ns-1")
    assert got["status"] == cause.status and cause.names in str(got["error"]), got
    assert took < BUDGET_S + DEADLINE_S + 10, took
    # the stalled worker holds prefill's transfer queue for the second attempt's stall too
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    again = generate(cluster.url, text, max_new_tokens=MAX_NEW_TOKENS, rid=f"calm-after-always-{kind}")
    assert again["status"] == 200 and again["text"] == calm["text"], again


# ----------------------------------------------------------------------------- behind the Rust gateway
#
# sglang-router 0.3.2 (docs/gateway.md) sends the same request to both servers and waits for both; it keeps decode's
# body only if prefill's leg answers 2xx, else it answers prefill's status and retries a 5xx on a new room, charging
# both circuits. A stream's prefill leg answers its 200 before any output (its failure rides inside its own stream,
# which the gateway reads and drops), so only a non-streaming request ever saw prefill's 500.


@pytest.mark.parametrize("kind", list(GATEWAY_KINDS))
def test_behind_the_gateway_a_recovered_request_answers_decode_s_text_non_streaming(deployment, gateway, kind):
    """Prefill's leg of the failed room answers 200, finish_reason abort, so the gateway keeps decode's recovered
    body: one answer, no retry, no failure charged.
    `kv`: prefill's leg answers as handed over instead of the chunk's 500. The fork before prefill handed the room
    over: prefill's leg answered 500, the gateway answered "Prefill server error (500 ...)" or retried on a new room
    (where the first-attempt fault fired again), charging both circuits. Stock upstream 0.5.23: no recovery; the
    gateway retries the 500 (5 attempts, both circuits charged each). `aux`: the same for a failed aux chunk write.
    `stall`: decode's own deadline ends the room (handed to recovery) and tells prefill by its abort, which prefill's
    leg answers as the peer's abort (200): this held before prefill handed a deadline's room over too.
    `stall_prefill`: prefill's own deadline (prefill_inflight) ends the room; its leg answers as handed over instead
    of the deadline's 504. The fork before: prefill's leg answered 504 and the gateway answered it ("Prefill server
    error (504 ...)") or retried it, discarding decode's recovery. Stock upstream 0.5.23 (both stalls): no deadline in
    these stages; 200 once the stalled worker reports (here after STALL_S; a worker stalled for good: never)."""
    cluster, single = deployment
    cause = CAUSES[GATEWAY_KINDS[kind]]
    baseline = assert_idle(cluster, PD_ROLES)
    text = GATEWAY_PROMPTS[kind][0]
    calm = _calm(single, text)
    before, ended, timeouts = gateway.charged(), cluster_end_causes(cluster, ("prefill",)), _timeouts(cluster)
    got, took = _through(cluster, kind, lambda: _timed(gateway, text, f"{cause.once}gw-ns-{kind}"))
    assert got["status"] == 200, got
    assert got["text"] == calm["text"] and got["output_ids"] == calm["output_ids"], (got, calm)
    assert got["meta"]["recovery"] == {"attempts": 1, "cause": cause.cause}, got["meta"]
    assert gateway.charged() == before, (before, gateway.charged())  # answered by the first room's decode: no retry
    assert cause.earliest <= took < RECOVERED_WITHIN_S, took
    _deadline_fired(GATEWAY_KINDS[kind], cluster, timeouts)
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    _prefill_ended_once(cluster, ended, kind)
    again = generate(gateway.url, text, max_new_tokens=MAX_NEW_TOKENS, rid=f"calm-after-gw-ns-{kind}")
    assert again["status"] == 200 and again["text"] == calm["text"] and "recovery" not in again["meta"], again
    assert gateway.charged() == before, (before, gateway.charged())


@pytest.mark.parametrize("kind", list(GATEWAY_KINDS))
def test_behind_the_gateway_a_recovered_stream_has_one_finish_and_no_abort(deployment, gateway, kind):
    """The same as a stream: one stream, the calm text, exactly one finish, no abort or error event; no retry, no
    failure charged. (The gateway never saw prefill's failure for a stream: this holds before prefill handed rooms
    over too, and guards the streamed recovery behind the gateway.)"""
    cluster, single = deployment
    cause = CAUSES[GATEWAY_KINDS[kind]]
    baseline = assert_idle(cluster, PD_ROLES)
    text = GATEWAY_PROMPTS[kind][1]
    calm = _calm(single, text)
    before, ended, timeouts = gateway.charged(), cluster_end_causes(cluster, ("prefill",)), _timeouts(cluster)
    took = _through(cluster, kind, lambda: recovered_stream(gateway.url, text, f"{cause.once}gw-s-{kind}", calm["text"],
                                                            cause.cause, MAX_NEW_TOKENS))
    assert gateway.charged() == before, (before, gateway.charged())
    assert cause.earliest <= took < RECOVERED_WITHIN_S, took
    _deadline_fired(GATEWAY_KINDS[kind], cluster, timeouts)
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    _prefill_ended_once(cluster, ended, kind)
    again = generate(gateway.url, text, max_new_tokens=MAX_NEW_TOKENS, rid=f"calm-after-gw-s-{kind}")
    assert again["status"] == 200 and again["text"] == calm["text"], again
    assert gateway.charged() == before, (before, gateway.charged())


def test_behind_the_gateway_a_fault_on_every_attempt_answers_the_failure_once(deployment, gateway):
    """A fault on every attempt: prefill's leg of the first room answers as handed over, the recovery attempt's room
    fails too (its leg, the last attempt the knob allows, answers the chunk's 500 to decode), and decode answers the
    failure, 500 naming the chunk, as without recovery. The gateway sees decode's 500 and does what it does with any
    500 (as before recovery, and as for stock upstream's): retries it on a new room until its attempts are spent,
    charging both circuits each time; the client gets one answer, that 500 (the gateway's "decode_internal_error"
    carrying decode's message), within the budget (each attempt fails at once). Neither circuit opens (5 of the 10
    consecutive failures that open one)."""
    cluster, single = deployment
    baseline = assert_idle(cluster, PD_ROLES)
    text = prompts(12)[9]
    calm = _calm(single, text)
    _, exhausted, charged = gateway.charged()
    got, took = _timed(gateway, text, "rec-always-gw-1")
    assert got["status"] == 500 and CAUSES["kv"].names in str(got["error"]), got
    assert took < 2 * BUDGET_S, took  # measured 0.6-4.6 s for the gateway's 5 attempts (TP 1, TP 2)
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    metrics = gateway.metrics()
    assert gateway.failures(metrics) == {role: n + GATEWAY_ATTEMPTS for role, n in charged.items()}, metrics
    assert metric_sum(metrics, "smg_worker_retries_exhausted_total") > exhausted, metrics
    assert gateway.circuit_opens(metrics) == {role: 0 for role in PD_ROLES}, metrics
    again = generate(gateway.url, text, max_new_tokens=MAX_NEW_TOKENS, rid="calm-after-gw-always")
    assert again["status"] == 200 and again["text"] == calm["text"], again
