"""The lost-decode handshake rule (fork_peers.lost_handshake), its pure parts (no servers): which bootstrap-queue
requests are orphans of a lost decode, the message (answered 502 as a peer loss). Its knob: test_knobs.py."""

from __future__ import annotations

import functools
import threading
from http import HTTPStatus
from types import SimpleNamespace

import pytest

from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification
from sglang.srt.disaggregation.fork_peers import lost_handshake as ldh
from sglang.srt.disaggregation.fork_peers.peer_monitor import CLAIM_TAG, abort_status, claim_frames
from sglang.srt.disaggregation.fork_peers.prefill_side_monitor import PrefillSideMonitor, _handle_claim

pytestmark = pytest.mark.unit


def _req(room):
    return SimpleNamespace(rid=f"rid-{room}", bootstrap_room=room)


def test_a_request_is_an_orphan_only_after_waiting_longer_than_the_timeout():
    reqs = [_req(1), _req(2), _req(3)]
    shaken = {2}
    assert ldh.orphans(reqs, shaken.__contains__, now=100.0, timeout=5.0) == []  # stamped
    assert ldh.orphans(reqs, shaken.__contains__, now=104.0, timeout=5.0) == []
    late = ldh.orphans(reqs, shaken.__contains__, now=105.5, timeout=5.0)
    assert [(r.bootstrap_room, w) for r, w in late] == [(1, 5.5), (3, 5.5)]
    shaken.add(3)  # its handshake came: no longer an orphan
    assert [r.bootstrap_room for r, _ in ldh.orphans(reqs, shaken.__contains__, 106.0, 5.0)] == [1]


def test_lost_decodes_lists_the_unreplaced_ones():
    monitor = SimpleNamespace(lock=threading.Lock(), lost={"127.0.0.1": ["127.0.0.1:4000"]})
    assert ldh.lost_decodes(monitor) == ["127.0.0.1:4000"]
    assert ldh.lost_decodes(None) == []
    monitor.lost.clear()  # a new incarnation registered on that host
    assert ldh.lost_decodes(monitor) == []


def test_the_message_is_answered_as_a_peer_loss():
    text = ldh.orphan_message(_req(7), 5.2, ["127.0.0.1:4000"], 5.0)
    assert "127.0.0.1:4000" in text and "bootstrap_room=7" in text and ldh.HANDSHAKE_ENV in text
    assert abort_status(text, HTTPStatus.INTERNAL_SERVER_ERROR) == HTTPStatus.BAD_GATEWAY


def test_the_rule_leaves_a_request_a_live_decode_claimed_and_ends_one_the_lost_decode_claimed():
    """waits_for_live_decode, in every order of events: handshaken -> waits (a lost decode's handshaken rooms end at
    its loss); claimed by a live decode -> waits for its preallocation; claimed by the lost one, or by nobody ->
    bound to the lost decode as far as prefill can tell -> ends after the timeout."""
    lost = ["127.0.0.1:4000"]
    shaken, claims = {1}, {2: "127.0.0.1:5000", 3: "127.0.0.1:4000"}
    waits = functools.partial(ldh.waits_for_live_decode, handshaken=shaken.__contains__, claimed_by=claims.get,
                              lost=lost)
    assert [room for room in (1, 2, 3, 4) if waits(room)] == [1, 2]
    reqs = [_req(room) for room in (1, 2, 3, 4)]
    assert ldh.orphans(reqs, waits, now=100.0, timeout=5.0) == []
    assert [r.bootstrap_room for r, _ in ldh.orphans(reqs, waits, now=105.5, timeout=5.0)] == [3, 4]
    # the live claimer is lost later: its request's wait starts then (stamped at the first scan that sees it)
    lost.append("127.0.0.1:5000")
    reqs = [_req(2)]
    assert ldh.orphans(reqs, waits, now=110.0, timeout=5.0) == []
    assert [r.bootstrap_room for r, _ in ldh.orphans(reqs, waits, now=115.5, timeout=5.0)] == [2]
    # a claim that comes before the request (decode was quicker than prefill) counts the same
    claims[9] = "127.0.0.1:6000"
    assert waits(9)


def test_a_claim_is_read_on_prefill_s_bootstrap_thread_and_nothing_else_is_taken():
    monitor = SimpleNamespace(lock=threading.Lock(), claims={})
    monitor.claim = functools.partial(PrefillSideMonitor.claim, monitor)
    passed = []
    handle = lambda msg: passed.append(msg) or False  # noqa: E731 (upstream's ABORT handler: not its message)
    assert _handle_claim(monitor, handle, claim_frames(42, "10.0.0.2", 17001)) is True
    assert {room: peer for room, (peer, _) in monitor.claims.items()} == {42: "10.0.0.2:17001"}
    assert _handle_claim(monitor, handle, [ABORT_TAG, CLAIM_TAG, b"x"]) is True  # malformed: dropped, logged
    abort = AbortNotification(room=5, decode_ip="10.0.0.2", decode_port=17001, generation=3).to_zmq()
    assert _handle_claim(monitor, handle, abort) is False and passed == [abort]  # upstream's ABORT: not ours
    passed.clear()
    assert _handle_claim(monitor, handle, [b"123", b"10.0.0.2"]) is False and passed == [[b"123", b"10.0.0.2"]]


def test_a_stock_prefill_takes_a_claim_for_a_malformed_abort():
    """A fork decode in front of a stock prefill (a rolling upgrade): upstream's bootstrap thread first offers every
    message to its ABORT handler, which parses it with `AbortNotification.from_zmq`; a claim is an ABORT whose room
    does not parse (None: a warning, the message taken), so it never reaches the handshake parse, which would raise
    on it and end the thread."""
    assert AbortNotification.from_zmq(claim_frames(42, "10.0.0.2", 17001)) is None


def test_the_message_names_the_lost_decode_that_took_the_request():
    text = ldh.orphan_message(_req(7), 5.2, ["127.0.0.1:4000"], 5.0, holder="127.0.0.1:4000")
    assert "decode peer 127.0.0.1:4000, which took request rid-7" in text
    assert abort_status(text, HTTPStatus.INTERNAL_SERVER_ERROR) == HTTPStatus.BAD_GATEWAY
