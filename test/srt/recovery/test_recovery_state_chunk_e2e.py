"""A failed extra-state chunk, end to end on real CPU servers: 1P1D of a tiny hybrid sliding-window model
(testing.tiny_model's `hybrid_swa`: upstream's Mellum, one sliding-window layer and one full-attention layer, float32),
mooncake over TCP, greedy, behind the mini load balancer and behind the Rust gateway (sglang-router, its defaults, the
engines registered with POST /workers), recovery on (one attempt); TP 1 in `make test`, TP 2 on both servers in
`make test-tp`. Served with a sliding-window memory pool, prefill sends each request's window state as
a state chunk after its KV; the fault switch (SGLANG_TEST_DISAGG_FAIL_CHUNKS on prefill, picked by rid) fails that
write:
- on the first attempt only (`state+first`): decode's tokenizer re-runs the request under a new room (docs/recovery.md,
  cause `chunk_failure`, as a failed KV or aux chunk): 200 with the text of a calm request of the same prompt, a
  stream with exactly one finish and no abort or error event, `meta_info` saying it was recovered;
- behind the gateway, prefill answers its leg of the failed room as handed over to decode's recovery (200, an
  abort), so the gateway keeps decode's recovered answer: no retry, no circuit charged (stock upstream 0.5.23, as for
  a failed KV chunk: the gateway retries the 500, charging both circuits each time);
- on every attempt (`state`): the chunk failure's own answer, once: 500 naming the state components.
Each case asserts that the state write really was made and failed (prefill's `sglang:pd_transfer_chunk_failures_total`
under kind="state"), that prefill counted the failed room once, that both servers hold nothing after, and that the
prompt is served again. The fork with SGLANG_FORK_RECOVERY_ATTEMPTS=0, as stock upstream 0.5.23 (no recovery), answers
the first case as the second: measured, non-streaming 500 naming the failed state components; 3 of 3 streams 200 with
finish_reason abort carrying that 500.

Only the sliding-window state runs on CPU: the other state kinds (mamba, DSA) need GPU kernels (docs/recovery.md)."""

from __future__ import annotations

import json
import time

import pytest

from testing.pd_checks import PD_ROLES, assert_idle, cluster_end_causes, recovered_stream, wait_end_causes
from testing.pd_cluster import Gateway, PDCluster, generate, metric_sum, prompts
from testing.tiny_model import ensure_tiny_model

from conftest import FP32, REPO_ROOT, TP2, topology_params

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 12
ONCE, ALWAYS = "rec-state-once-", "rec-state-always-"
FAULTS = f"state+first:rid={ONCE},state:rid={ALWAYS}"
BUDGET_S = 20.0
# decode's hold of a failed room's pages until prefill's drain ack (upstream's default: 30 s), as test_recovery_e2e
RELEASE_ENV = {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "3"}
RECOVERY_ENV = {"SGLANG_FORK_RECOVERY_ATTEMPTS": "1", "SGLANG_FORK_RECOVERY_BUDGET": str(BUDGET_S), **RELEASE_ENV}
# a full window pool beside the full-attention one (upstream's default ratio 0.8 sizes it below the KV pool's)
SWA_ARGS = (*FP32, "--swa-full-tokens-ratio", "1.0")
# a recovered request: its failed attempt (a scheduler tick or two on each side) plus a calm one
RECOVERED_WITHIN_S = 30.0
CHUNK_FAILURES = "sglang:pd_transfer_chunk_failures_total"
CAUSE = "chunk_failure"  # recovery's cause for a failed chunk write (meta_info.recovery)
SWA_POOL_LOGGED = "SWA KV Cache is allocated"  # upstream's start-up line for a sliding-window pool
PREFILL_FAILED_ONCE = {("prefill", "transport", "prefill_inflight"): 1}


@pytest.fixture(scope="module", params=topology_params(TP2))
def cluster(deployments, request):
    """The hybrid sliding-window 1P1D behind the mini LB: TP 1; TP 2 on both servers in `make test-tp`."""
    model = ensure_tiny_model(REPO_ROOT / ".cache" / "tiny-swa", hybrid_swa=True)
    kwargs = {"prefill_env": {"SGLANG_TEST_DISAGG_FAIL_CHUNKS": FAULTS, **RECOVERY_ENV}, "decode_env": RECOVERY_ENV,
              "prefill_args": SWA_ARGS, "decode_args": SWA_ARGS}
    cluster = PDCluster(str(model), **request.param.pd_kwargs(**kwargs))
    with deployments.scoped(cluster):
        yield cluster


@pytest.fixture(scope="module")
def gateway(cluster):
    """The Rust gateway (its defaults: retries, circuit breaker) in front of the same engines."""
    with Gateway.fronting(cluster) as gw:
        yield gw


def _state_failures(cluster) -> float:
    return metric_sum(cluster.metrics("prefill"), CHUNK_FAILURES, kind="state")


def _calm(cluster, text: str) -> dict:
    calm = generate(cluster.url, text, max_new_tokens=MAX_NEW_TOKENS)
    assert calm["status"] == 200 and "recovery" not in calm["meta"], calm
    return calm


def _failed_once(cluster, before_failures: float, before_ends: dict) -> None:
    """The state write was made and failed once (one attempt; each prefill rank counts its own), and prefill counted
    its room's request once."""
    assert _state_failures(cluster) - before_failures == cluster.tp["prefill"]
    wait_end_causes(cluster, before_ends, PREFILL_FAILED_ONCE, roles=("prefill",))


def _after(cluster, baseline: dict, text: str, calm: dict, rid: str) -> None:
    assert_idle(cluster, PD_ROLES, baseline=baseline, timeout=60)
    again = generate(cluster.url, text, max_new_tokens=MAX_NEW_TOKENS, rid=rid)
    assert again["status"] == 200 and again["output_ids"] == calm["output_ids"], again


def test_the_model_sends_a_state_chunk(cluster):
    """The deployment is what this module tests: prefill and decode hold a sliding-window pool beside the KV pool
    (upstream logs it at start), and a calm request answers the same tokens twice."""
    for role in PD_ROLES:
        assert SWA_POOL_LOGGED in cluster[role].log_path.read_text(errors="replace"), role
    text = prompts(8)[0]
    first, second = _calm(cluster, text), _calm(cluster, text)
    assert first["output_ids"] == second["output_ids"] and len(first["output_ids"]) == MAX_NEW_TOKENS


def test_a_failed_state_chunk_is_recovered_non_streaming(cluster):
    baseline = assert_idle(cluster, PD_ROLES)
    text = prompts(8)[1]
    calm = _calm(cluster, text)
    failures, ends = _state_failures(cluster), cluster_end_causes(cluster, ("prefill",))
    t0 = time.monotonic()
    got = generate(cluster.url, text, max_new_tokens=MAX_NEW_TOKENS, rid=f"{ONCE}ns-1")
    took = time.monotonic() - t0
    assert got["status"] == 200, got
    assert got["text"] == calm["text"] and got["output_ids"] == calm["output_ids"], (got, calm)
    assert got["meta"]["recovery"] == {"attempts": 1, "cause": CAUSE}, got["meta"]
    assert took < RECOVERED_WITHIN_S, took
    _failed_once(cluster, failures, ends)
    _after(cluster, baseline, text, calm, "calm-after-state-ns")


def test_a_failed_state_chunk_is_recovered_streaming(cluster):
    baseline = assert_idle(cluster, PD_ROLES)
    text = prompts(8)[2]
    calm = _calm(cluster, text)
    failures, ends = _state_failures(cluster), cluster_end_causes(cluster, ("prefill",))
    took = recovered_stream(cluster.url, text, f"{ONCE}s-1", calm["text"], CAUSE, MAX_NEW_TOKENS)
    assert took < RECOVERED_WITHIN_S, took
    _failed_once(cluster, failures, ends)
    _after(cluster, baseline, text, calm, "calm-after-state-s")


def test_a_state_chunk_failing_on_every_attempt_answers_its_500_once(cluster):
    """Every attempt's state write fails: the chunk failure's 500 naming the state components, once (no third
    attempt), within the budget; two failed writes, one per attempt (on each prefill rank)."""
    baseline = assert_idle(cluster, PD_ROLES)
    text = prompts(8)[3]
    calm = _calm(cluster, text)
    failures = _state_failures(cluster)
    t0 = time.monotonic()
    got = generate(cluster.url, text, max_new_tokens=MAX_NEW_TOKENS, rid=f"{ALWAYS}ns-1")
    took = time.monotonic() - t0
    assert got["status"] == 500, got
    assert "Failed to send state components" in json.dumps(got), got
    assert took < BUDGET_S + 10, took
    assert _state_failures(cluster) - failures == 2 * cluster.tp["prefill"]
    _after(cluster, baseline, text, calm, "calm-after-state-always")


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_behind_the_gateway_a_recovered_request_answers_decode_s_text(cluster, gateway, stream):
    baseline = assert_idle(cluster, PD_ROLES)
    text = prompts(8)[5 if stream else 4]
    calm = _calm(cluster, text)
    before, failures, ends = gateway.charged(), _state_failures(cluster), cluster_end_causes(cluster, ("prefill",))
    rid = f"{ONCE}gw-{'s' if stream else 'ns'}-1"
    if stream:
        recovered_stream(gateway.url, text, rid, calm["text"], CAUSE, MAX_NEW_TOKENS)
    else:
        got = generate(gateway.url, text, max_new_tokens=MAX_NEW_TOKENS, rid=rid)
        assert got["status"] == 200 and got["output_ids"] == calm["output_ids"], (got, calm)
        assert got["meta"]["recovery"] == {"attempts": 1, "cause": CAUSE}, got["meta"]
    assert gateway.charged() == before, (before, gateway.charged())  # answered by the first room's decode: no retry
    _failed_once(cluster, failures, ends)
    _after(cluster, baseline, text, calm, f"calm-after-state-{rid}")
    assert gateway.charged() == before, (before, gateway.charged())
