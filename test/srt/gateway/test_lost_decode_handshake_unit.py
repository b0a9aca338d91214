"""peer_liveness' lost-decode handshake rule, its pure parts (no servers): which bootstrap-queue requests are
orphans of a lost decode, the message (answered 502 as a peer loss). Its knob: test_knobs.py."""

from __future__ import annotations

import threading
from http import HTTPStatus
from types import SimpleNamespace

import pytest

from sglang.srt.disaggregation.fork_peers import peer_liveness as ldh
from sglang.srt.disaggregation.fork_peers.peer_liveness import abort_status

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
