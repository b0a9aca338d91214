"""Which prefill decode's tokenizer re-runs a request on when the prefill it was bound to is lost
(`fork_recovery.known_prefills`, docs/recovery.md "A partition between prefill and decode"): one that served a
request through this decode after its own last loss, recently; never the lost one; none in a 1P1D deployment (the
lost prefill's 502 is answered as without recovery). Fast; starts no server. The end-to-end run: the test-hosts
2P1D partition test (test_hosts_2p1d_partition_e2e).

Stock upstream 0.5.23 re-runs nothing: every request bound to a lost prefill fails."""

from __future__ import annotations

import types

import pytest

from sglang.srt.disaggregation.fork_recovery import known_prefills
from sglang.srt.disaggregation.fork_recovery.known_prefills import CAP, FRESH_S, KnownPrefills

pytestmark = pytest.mark.unit

P1, P2, P3 = ("10.0.0.1", 8998), ("10.0.0.2", 8998), ("10.0.0.3", 8998)


def test_one_prefill_has_no_other():
    known = KnownPrefills()
    known.saw_served(P1, at=100.0)
    known.saw_lost(P1, at=101.0)
    assert known.other_than(P1, now=102.0) is None


def test_the_other_prefill_that_served_most_recently():
    known = KnownPrefills()
    known.saw_served(P2, at=100.0)
    known.saw_served(P3, at=105.0)
    known.saw_served(P1, at=106.0)
    assert known.other_than(P1, now=107.0) == P3
    known.saw_lost(P3, at=108.0)  # lost since it served: not a place to run
    assert known.other_than(P1, now=109.0) == P2
    known.saw_served(P3, at=110.0)  # served again after the heal
    assert known.other_than(P1, now=111.0) == P3


def test_a_prefill_silent_for_longer_than_fresh_is_not_chosen():
    known = KnownPrefills()
    known.saw_served(P2, at=100.0)
    assert known.other_than(P1, now=100.0 + FRESH_S) == P2
    assert known.other_than(P1, now=100.0 + FRESH_S + 1) is None


def test_bounded_the_oldest_forgotten_first():
    known = KnownPrefills()
    for i in range(CAP + 5):
        known.saw_served((f"10.1.0.{i}", 1), at=float(i))
        known.saw_lost((f"10.1.0.{i}", 1), at=float(i))
    assert known.sizes() == {"served": CAP, "lost": CAP}
    assert ("10.1.0.0", 1) not in known.served and (f"10.1.0.{CAP + 4}", 1) in known.served


def test_a_request_without_a_bootstrap_address_is_not_recorded():
    known = KnownPrefills()
    obj = types.SimpleNamespace(bootstrap_host=None, bootstrap_port=None)
    known.saw_served(known_prefills.address(obj))
    assert known.sizes() == {"served": 0, "lost": 0}
    assert known_prefills.address(types.SimpleNamespace(bootstrap_host="h", bootstrap_port="8998")) == ("h", 8998)
    # a batch's lists (per request after the tokenizer splits it, but never trusted): not one address
    assert known_prefills.address(types.SimpleNamespace(bootstrap_host=["h", "g"], bootstrap_port=[1, 2])) is None
    assert known_prefills.address(types.SimpleNamespace(bootstrap_host="h", bootstrap_port="x")) is None
