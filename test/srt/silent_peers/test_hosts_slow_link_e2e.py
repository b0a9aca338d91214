"""A slow link between prefill and decode on separate test hosts (testing/hosts.py), with the wide-KV tiny model
(32 KiB of KV a token): a token bucket (tbf) on what the switch forwards from prefill to decode.

- Shaping (burst well above veth's 64 KiB segments): a large KV transfer completes, at the link's rate.
- A link that drops every full-size packet (a burst below the MTU; acks and small messages pass) stalls mooncake's
  TCP transport: once it has made no progress for MC_TCP_PROGRESS_TIMEOUT_SEC it gives up, and the request gets
  the clear 500 ("Failed to send kv chunk", naming decode) on both legs, nothing is held, and once the link is
  good again the next request is served. docs/peer-liveness.md ("Slow links").
"""

from __future__ import annotations

import json
import time

import pytest

from testing.pd_checks import PD_ROLES, assert_idle, cluster_end_causes, delta
from testing.pd_cluster import PDCluster, generate
from testing.tiny_model import WIDE_KV_BYTES_PER_TOKEN, ensure_tiny_model

pytestmark = pytest.mark.e2e

PROGRESS_TIMEOUT = 5  # MC_TCP_PROGRESS_TIMEOUT_SEC on prefill (mooncake's default: 30 s)
DEADLINE = 60.0
ENV = {"SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": str(DEADLINE), "MC_TCP_PROGRESS_TIMEOUT_SEC": str(PROGRESS_TIMEOUT)}
ARGS = ("--max-total-tokens", "8192", "--max-running-requests", "4")
RATE = 200_000_000  # bit/s on the shaped link
PROMPT = "the quick brown fox jumps over the lazy dog " * 100  # ~900 tokens: ~28 MiB of KV
MARGIN = 4.0  # a busy 2-core machine


@pytest.fixture(scope="module")
def cluster(pd_hosts, deployments, tiny_model):
    wide = ensure_tiny_model(tiny_model.parent / "tiny-llama-wide-kv", wide_kv=True)
    c = PDCluster(str(wide), hosts=pd_hosts.hosts, prefill_env=ENV, decode_env=ENV, prefill_args=ARGS, decode_args=ARGS)
    deployments._start(c)
    yield c
    pd_hosts.unshape("decode")


def _kv_bytes(out) -> int:
    return out["meta"]["prompt_tokens"] * WIDE_KV_BYTES_PER_TOKEN


def test_shaped_link_moves_kv_at_its_rate(cluster, pd_hosts):
    baseline = assert_idle(cluster, PD_ROLES)
    # unshaped: compute and a veth-speed transfer; twice, the first one warms up
    for _ in range(2):
        fast = generate(cluster.url, PROMPT, 1, timeout=120)
        assert fast["status"] == 200, fast["error"]
    pd_hosts.shape("decode", RATE, src="prefill")
    try:
        slow = generate(cluster.url, PROMPT, 1, timeout=120)
    finally:
        pd_hosts.unshape("decode")
    assert slow["status"] == 200, slow["error"]
    kv = _kv_bytes(slow)
    at_rate = kv * 8 / RATE
    extra = slow["latency"] - fast["latency"]
    print(f"\nslow link: {kv / 2**20:.1f} MiB of KV; unshaped {fast['latency']:.2f} s, at {RATE / 1e6:.0f} Mbit/s "
          f"{slow['latency']:.2f} s (+{extra:.2f} s; the link alone: {at_rate:.2f} s)")
    assert kv >= 20 * 2**20, kv
    # it went through the shaped link, and at (close to) its rate: the transfer added about bytes / rate
    assert 0.7 * at_rate <= extra <= 1.3 * at_rate + MARGIN, (extra, at_rate)
    assert_idle(cluster, PD_ROLES, baseline)


def test_stalled_transfer_gives_up_with_a_clear_500(cluster, pd_hosts):
    baseline = assert_idle(cluster, PD_ROLES)
    causes = cluster_end_causes(cluster)
    pd_hosts.shape("decode", RATE, burst_bytes=1000, drop_large=True, src="prefill")
    try:
        t0 = time.monotonic()
        out = generate(cluster.url, PROMPT, 1, timeout=DEADLINE + 60)
        took = time.monotonic() - t0
    finally:
        pd_hosts.unshape("decode")
    detail = json.dumps(out["error"])
    print(f"\nstalled link: {out['status']} after {took:.2f} s: {detail[:300]}; end causes {delta(causes, cluster_end_causes(cluster))}")
    assert out["status"] == 500 and "Failed to send kv chunk" in detail, (out["status"], detail)
    assert cluster["decode"].address in detail, detail
    assert PROGRESS_TIMEOUT <= took <= PROGRESS_TIMEOUT + 10 + MARGIN, took  # mooncake's bound, not the deadline
    assert_idle(cluster, PD_ROLES, baseline)
    moved = delta(causes, cluster_end_causes(cluster))
    assert ("prefill", "transport") in {(role, cause) for (role, cause, _) in moved}, moved
    # the link is good again: served (the probe of the failed session took mooncake's reconnect)
    again = generate(cluster.url, PROMPT, 1, timeout=120)
    assert again["status"] == 200, again["error"]
    assert_idle(cluster, PD_ROLES, baseline)
