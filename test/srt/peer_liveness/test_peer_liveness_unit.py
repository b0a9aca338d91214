"""The peer monitors' pure parts (fork_peers.peer_monitor): the TCP probe's verdicts, the 502 mapping, and the
heartbeat knobs' validation (a bad value stops the kv manager, i.e. the server, at
start-up)."""

import socket
from http import HTTPStatus

import pytest

from sglang.srt.disaggregation.fork_peers import peer_monitor as pl

pytestmark = pytest.mark.unit


def test_probe_tells_alive_from_refused():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        assert pl.probe("127.0.0.1", port) == pl.ALIVE
    # nothing listens there any more: the kernel refuses at once
    assert pl.probe("127.0.0.1", port) == pl.REFUSED


def test_peer_loss_answers_502_and_nothing_else_changes():
    ours = pl.loss_message("decode", "127.0.0.1:4000", "connection refused")
    assert ours.startswith("PD peer lost: decode peer 127.0.0.1:4000 lost (")
    assert pl.abort_status(f"Prefill transfer failed ...: {ours}", HTTPStatus.INTERNAL_SERVER_ERROR) == HTTPStatus.BAD_GATEWAY
    upstream = "Lost connection with prefill instance (bootstrap_addr: 127.0.0.1:8998)"
    assert pl.abort_status(upstream, HTTPStatus.INTERNAL_SERVER_ERROR) == HTTPStatus.BAD_GATEWAY
    for other in ("Failed to send kv chunk of 1 to 127.0.0.1:4000", "Aborted by AbortReq.", ""):
        assert pl.abort_status(other, HTTPStatus.INTERNAL_SERVER_ERROR) == HTTPStatus.INTERNAL_SERVER_ERROR


@pytest.mark.parametrize(
    "interval,failures,expected",
    [("5", "2", (5.0, 2)), ("0.5", "1", (2.0, 1)), ("-1", "2", ValueError), ("3", "0", ValueError)],
)
def test_heartbeat_knobs(monkeypatch, interval, failures, expected):
    monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", interval)
    monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", failures)
    if expected is ValueError:
        with pytest.raises(ValueError, match="SGLANG_DISAGGREGATION_HEARTBEAT"):
            pl.heartbeat_settings()
    else:
        assert pl.heartbeat_settings() == expected


def test_a_probe_started_while_the_link_was_cut_is_not_joined_after_the_heal():
    """chunk_failures.bounded_probe: a transfer engine probe started during a silent cut hangs in the transport's
    connect retries past the heal. A caller that asks for a probe started after `since` (held_decodes, once the
    peer answers again) gets a new one, answered at once; a caller without `since` joins the one running."""
    import threading
    import time
    from types import SimpleNamespace

    from sglang.srt.disaggregation.fork_transfer import chunk_failures

    link_back = threading.Event()
    calls = []

    def send_probe(session_id):  # the transport: the first probe went out while the link was cut
        calls.append(time.monotonic())
        if len(calls) == 1:
            link_back.wait(30)
            return -1
        return 0

    mgr = SimpleNamespace(session_lock=threading.Lock(), decode_kv_args_table={})
    probe = chunk_failures.bounded_probe(mgr, send_probe, timeout=0.5)
    try:
        assert probe("decode:1") == -1  # cut: no answer within the bound, the probe keeps hanging
        assert probe("decode:1") == -1  # joined it: still no answer, no second probe sent
        assert len(calls) == 1
        healed = time.monotonic()
        t0 = time.monotonic()
        assert probe("decode:1", since=healed) == 0  # a new probe, answered at once
        assert time.monotonic() - t0 < 0.4 and len(calls) == 2
    finally:
        link_back.set()
