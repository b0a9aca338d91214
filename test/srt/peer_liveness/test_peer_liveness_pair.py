"""Peer crash and restart over real mooncake TCP between two processes (the queue
harness on each side, upstream's managers, engine and bootstrap server): the survivor
notices the SIGKILLed peer within one heartbeat, ends every request bound to it with
502 naming it, holds nothing afterwards and forgets the dead incarnation; the peer
started again (new process, new buffers, new transfer session) is served at once, and
the loss and the recovery are counted. A decode lost while merely frozen (SIGSTOP) is
held out, not forgotten: once it runs again it is served again, without a restart.
Fast counterpart of test_peer_liveness_e2e.py.
"""

import os
import signal
import time

import pytest

from testing.pd_checks import assert_pair_serves, pair_fixture, pair_new_causes, pair_snapshots, stable_peer_tables

pytestmark = pytest.mark.pair

HEARTBEAT = 2.0
ENV = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": str(HEARTBEAT),
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
    "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": "60",
}
# one heartbeat + ticks, generously (busy 2-core machine)
DETECT_BOUND = HEARTBEAT + 6.0
N = 6
# where prefill's rooms can be when the decode they are bound to dies
STAGES = ("prefill_bootstrap", "prefill_waiting", "prefill_inflight")

SIZES = dict(kv_tokens=2048, req_slots=N + 4, metadata_slots=N + 4, max_context_len=64)


pair = pair_fixture(scope="function", prefill_env=ENV, decode_env=ENV, **SIZES)

# chunk_failures' SGLANG_FORK_SESSION_PROBE_TIMEOUT default: a probe of a frozen peer
# gets no answer within it (mooncake's own wait is 60 s)
PROBE_TIMEOUT = 5.0
# a failed room's decode pages wait for prefill's drain ack or this (30 s by default)
FROZEN_ENV = {**ENV, "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "3"}
frozen_pair = pair_fixture(scope="function", prefill_env=FROZEN_ENV, decode_env=FROZEN_ENV, **SIZES)


# a session blacklisted while its decode answers: neither the monitor (it declares a session lost once it sees it
# blacklisted at two ticks: a whole interval) nor upstream's probe loop (off) acts within the test
QUIET_HEARTBEAT = 60.0
BLACKLIST_ENV = {**FROZEN_ENV, "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": str(QUIET_HEARTBEAT),
                 "SGLANG_ENABLE_FAILED_SESSION_PROBE": "false"}
blacklist_pair = pair_fixture(scope="function", prefill_env=BLACKLIST_ENV, decode_env=BLACKLIST_ENV, **SIZES)


def _decode_handshakes(pair, n: int) -> list:
    """n requests added on decode only: decode preallocates and hands prefill its pages
    (prefill's rooms are bound to this decode), then waits for the KV."""
    rooms = [pair.new_room() for _ in range(n)]
    for room in rooms:
        pair.decode.call("add", room, 12, None)
    deadline = time.monotonic() + 60
    while pair.decode.call("snapshot")["queues"]["transfer"] < n:
        assert time.monotonic() < deadline, pair.decode.call("snapshot")
        pair.decode.call("tick")
    return rooms


def _room_entries(side, room) -> list:
    """Per-room state left for `room` (every table, the end-cause tag included)."""
    return side.call("room_entries", room)


def _wait_equal(read, expected, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (now := read()) != expected:
        assert time.monotonic() < deadline, (now, expected)
        time.sleep(0.2)


def _tick_until_all_ended(side, rooms, timeout: float) -> float:
    t0 = time.monotonic()
    while any(side.call("status", room) is None for room in rooms):
        assert time.monotonic() - t0 < timeout, [side.call("status", r) for r in rooms]
        side.call("tick")
    return time.monotonic() - t0


def _serve_new_requests(pair, n: int = 3) -> None:
    assert_pair_serves(pair, [pair.submit() for _ in range(n)])


def test_decode_killed_prefill_fails_bound_rooms_and_accepts_restart(pair):
    _serve_new_requests(pair)  # a decode session registered and served
    idle = pair.prefill.call("snapshot")
    peers = pair.prefill.call("peers")
    assert peers["decode_kv_args_table"] == 1, peers
    causes = pair.prefill.call("end_causes")

    rooms = _decode_handshakes(pair, N)
    t_kill = time.monotonic()
    pair.decode.kill()
    for room in rooms:  # the prefill legs
        pair.prefill.call("add", room, 12, None)
    _tick_until_all_ended(pair.prefill, rooms, DETECT_BOUND)
    assert time.monotonic() - t_kill <= DETECT_BOUND
    # 502 naming the lost decode; or 500 naming it for a room whose own write failed
    # before the loss was known (the write that revealed it)
    statuses = {room: pair.prefill.call("status", room) for room in rooms}
    reasons = {room: pair.prefill.call("reason", room) for room in rooms}
    lost = [r for r in rooms if statuses[r] == 502]
    assert lost, reasons
    peer = reasons[lost[0]].split("decode peer ")[1].split(" ")[0].rstrip(",")  # the loss, or the lost-handshake rule naming the claim holder
    for room in rooms:
        if statuses[room] == 502:
            # the monitor's loss; or, for a room whose handshake the kill cut off on its way to prefill, the
            # lost-handshake rule's (the decode that took the request is lost)
            assert (f"PD peer lost: decode peer {peer} lost (" in reasons[room]
                    or f"PD peer lost: decode peer {peer}, which took request " in reasons[room]), reasons[room]
        else:
            assert statuses[room] == 500 and reasons[room].endswith(f"Failed to send kv chunk of {room} to {peer}"), reasons[room]
    # the loss is declared within a heartbeat (the monitor's next pass), counted under the peer's host:port
    while pair.prefill.call("peer_counts") != {f"loss/prefill/{peer}": 1}:
        assert time.monotonic() - t_kill <= DETECT_BOUND, pair.prefill.call("peer_counts")
        time.sleep(0.1)
    # the transfer workers finish with the rooms (a chunk queued behind a write to the
    # dead peer is dropped when dequeued) within a few ticks
    while any(_room_entries(pair.prefill, room) for room in rooms) or pair.prefill.call("snapshot") != idle:
        assert time.monotonic() - t_kill <= DETECT_BOUND + 5, (
            {room: _room_entries(pair.prefill, room) for room in rooms}, pair.prefill.call("snapshot"), idle)
        pair.prefill.call("tick")
    after = pair.prefill.call("peers")
    assert after["decode_kv_args_table"] == 0 and after["failed_sessions"] == 0, after
    # each room counted once: a 502 as a peer failure, a 500 as the transport failure
    # it was, in the stage it ended in
    ended = pair_new_causes(pair.prefill, causes)
    by_cause = {}
    for key, n in ended.items():
        role, cause, stage = key.split("/")
        assert role == "prefill" and stage in STAGES, ended
        by_cause[cause] = by_cause.get(cause, 0) + n
    want = {}
    for room in rooms:
        cause = {502: "peer_failure", 500: "transport"}[statuses[room]]
        want[cause] = want.get(cause, 0) + 1
    assert by_cause == want, (ended, statuses)

    pair.restart("decode")
    _serve_new_requests(pair)
    assert pair.prefill.call("snapshot") == idle
    _wait_equal(lambda: stable_peer_tables(pair.prefill.call("peers")), stable_peer_tables(peers), HEARTBEAT + 5)
    # the new incarnation's registration recovers the lost one: counted under the lost one's host:port
    assert pair.prefill.call("peer_counts") == {f"loss/prefill/{peer}": 1, f"recovery/prefill/{peer}": 1}
    assert pair_new_causes(pair.prefill, causes) == ended  # the served requests ended nothing


def test_prefill_killed_decode_fails_bound_rooms_and_accepts_restart(pair):
    _serve_new_requests(pair)
    idle = pair.decode.call("snapshot")
    peers = pair.decode.call("peers")
    assert peers["prefill_info_table"] == 1, peers
    addr = f"127.0.0.1:{pair.bootstrap_port}"
    causes = pair.decode.call("end_causes")

    rooms = _decode_handshakes(pair, N)
    t_kill = time.monotonic()
    pair.prefill.kill()
    _tick_until_all_ended(pair.decode, rooms, DETECT_BOUND)
    assert time.monotonic() - t_kill <= DETECT_BOUND
    for room in rooms:
        assert pair.decode.call("status", room) == 502, pair.decode.call("final_reason", room)
        assert f"PD peer lost: prefill peer {addr} lost" in pair.decode.call("reason", room)
    # decode frees what the rooms held (after the deferred-release wait, if any)
    deadline = time.monotonic() + 40
    while pair.decode.call("snapshot") != idle:
        assert time.monotonic() < deadline, (pair.decode.call("snapshot"), idle)
        pair.decode.call("tick")
    for room in rooms:
        assert _room_entries(pair.decode, room) == []
    after = pair.decode.call("peers")
    assert after["prefill_info_table"] == 0 and after["connection_pool"] == 0, after
    assert pair.decode.call("peer_counts") == {f"loss/decode/{addr}": 1}
    assert pair_new_causes(pair.decode, causes) == {"decode/peer_failure/decode_transfer": N}

    pair.restart("prefill")
    _serve_new_requests(pair)
    # as before the crash once upstream's heartbeat has run again (it fills its
    # session pool and miss count per prefill)
    _wait_equal(lambda: stable_peer_tables(pair.decode.call("peers")), stable_peer_tables(peers), HEARTBEAT + 5)
    assert pair.decode.call("peer_counts") == {f"loss/decode/{addr}": 1, f"recovery/decode/{addr}": 1}
    assert pair_new_causes(pair.decode, causes) == {"decode/peer_failure/decode_transfer": N}


def _wait_blacklist(pair, want: list, timeout: float) -> float:
    """Seconds until prefill's session blacklist, with no nomination probe in flight,
    equals `want`."""
    t0 = time.monotonic()
    while pair.prefill.call("failed_sessions") != want:
        assert time.monotonic() - t0 < timeout, pair.prefill.call("failed_sessions")
        time.sleep(0.1)
    return time.monotonic() - t0


def test_decode_lost_while_frozen_is_served_again_once_it_runs(frozen_pair):
    """A frozen decode whose session does not answer a probe is declared lost: its rooms
    end at once, 502 naming it, and prefill holds nothing of them; its identity is kept
    (registration, session held out). Resumed -- not restarted -- it answers the
    monitor's probe within a heartbeat and is served again; the loss and the recovery
    are counted once; decode ends its rooms too (it was told) and holds nothing."""
    pair = frozen_pair
    _serve_new_requests(pair)
    p_idle, d_idle = pair.prefill.call("snapshot"), pair.decode.call("snapshot")
    peers = pair.prefill.call("peers")
    assert peers["decode_kv_args_table"] == 1, peers
    p_causes, d_causes = pair.prefill.call("end_causes"), pair.decode.call("end_causes")
    session = pair.decode.call("session_id")
    rooms = _decode_handshakes(pair, N)

    os.kill(pair.decode.proc.pid, signal.SIGSTOP)
    try:
        # what the transfer worker does after a failed write to it: the probe gets no
        # answer within its bound (not mooncake's 60 s), so the session is taken out
        pair.prefill.call("nominate_failed_session", session)
        assert _wait_blacklist(pair, [session], PROBE_TIMEOUT + 5) <= PROBE_TIMEOUT + 3
        # still out at the next heartbeat: lost
        t_out = time.monotonic()
        while not (counts := pair.prefill.call("peer_counts")):
            assert time.monotonic() - t_out <= 2 * HEARTBEAT + 6, counts
            time.sleep(0.1)
        [(loss, n)] = counts.items()
        assert loss.startswith("loss/prefill/") and n == 1, counts
        lost_peer = loss.split("/")[2]  # host:port, as on decode
        # every room bound to it ends at once, 502 naming it
        for room in rooms:
            pair.prefill.call("add", room, 12, None)
        _tick_until_all_ended(pair.prefill, rooms, 10)
        reasons = {room: pair.prefill.call("reason", room) for room in rooms}
        peer = reasons[rooms[0]].split("decode peer ")[1].split(" ")[0].rstrip(",")  # the loss, or the lost-handshake rule naming the claim holder
        assert peer == lost_peer, (peer, lost_peer)
        for room in rooms:
            assert pair.prefill.call("status", room) == 502, reasons[room]
            assert (f"PD peer lost: decode peer {peer} lost (a KV write failed and its transfer session "
                    f"does not answer a probe; mooncake session {session})") in reasons[room], reasons[room]
        # prefill holds nothing of them; the peer's identity is kept, its session held out
        while any(_room_entries(pair.prefill, room) for room in rooms) or pair.prefill.call("snapshot") != p_idle:
            assert time.monotonic() - t_out <= 30, pair.prefill.call("snapshot")
            pair.prefill.call("tick")
        held = pair.prefill.call("peers")
        assert (held["decode_kv_args_table"], held["failed_sessions"], held["monitor_held_out"]) == (1, 1, 1), held
        ended = pair_new_causes(pair.prefill, p_causes)  # each room once, as a peer failure
        assert {k.rsplit("/", 1)[0] for k in ended} == {"prefill/peer_failure"}, ended
        assert all(k.rsplit("/", 1)[1] in STAGES for k in ended) and sum(ended.values()) == N, ended
        # no answer, no recovery: still out a heartbeat later
        time_left = time.monotonic() + HEARTBEAT + 1
        while time.monotonic() < time_left:
            assert pair.prefill.call("failed_sessions") == [session]
            time.sleep(0.2)
    finally:
        os.kill(pair.decode.proc.pid, signal.SIGCONT)

    # it runs again: the monitor's probe finds it answering within a heartbeat (upstream's
    # own probe loop waits 30 s here), it is let back in and the recovery is counted
    t_resume = time.monotonic()
    _wait_blacklist(pair, [], HEARTBEAT + PROBE_TIMEOUT + 10)
    # the monitor counts the recovery before it lets the session back in; upstream's own probe loop (every 30 s)
    # may let it in first, and the monitor's probe then counts it within a heartbeat
    want = {f"loss/prefill/{lost_peer}": 1, f"recovery/prefill/{lost_peer}": 1}
    _wait_equal(lambda: pair.prefill.call("peer_counts"), want, HEARTBEAT + PROBE_TIMEOUT + 10)
    assert time.monotonic() - t_resume <= HEARTBEAT + PROBE_TIMEOUT + 5
    # decode was told while frozen: its rooms end, 502 naming itself as the lost peer
    _tick_until_all_ended(pair.decode, rooms, 30)
    for room in rooms:
        assert pair.decode.call("status", room) == 502, pair.decode.call("final_reason", room)
        assert f"PD peer lost: decode peer {peer} lost" in pair.decode.call("reason", room)
        assert pair.decode.call("told", room) == "LOST_PEER"  # a field, not read from the text
    # served again, without a restart, and neither side keeps anything of the loss
    _serve_new_requests(pair)
    pair.run_until(lambda: pair_snapshots(pair) == (p_idle, d_idle), timeout=20)
    for room in rooms:
        assert _room_entries(pair.decode, room) == [] and _room_entries(pair.prefill, room) == []
    _wait_equal(lambda: stable_peer_tables(pair.prefill.call("peers")), stable_peer_tables(peers), HEARTBEAT + 5)
    assert pair.decode.call("session_id") == session  # the same process and session
    assert pair_new_causes(pair.decode, d_causes) == {"decode/peer_failure/decode_transfer": N}
    assert pair_new_causes(pair.prefill, p_causes) == ended  # the served requests ended nothing


def test_write_to_blacklisted_session_tells_decode_its_peer_lost(blacklist_pair):
    """A chunk bound to a decode session upstream has blacklisted (a failed write whose probe got no answer) fails
    its room with upstream's dead-session reason, which prefill rewords to name the lost peer; decode is told the
    cause as a field (LOST_PEER, not read from the text) and answers the same 502 as prefill. Both sides count a
    peer failure, hold nothing afterwards, and serve once the session is back."""
    pair = blacklist_pair
    _serve_new_requests(pair)
    p_idle, d_idle = pair.prefill.call("snapshot"), pair.decode.call("snapshot")
    p_causes, d_causes = pair.prefill.call("end_causes"), pair.decode.call("end_causes")
    session = pair.decode.call("session_id")
    rooms = _decode_handshakes(pair, N)

    pair.prefill.call("blacklist_session", session)
    t0 = time.monotonic()
    try:
        for room in rooms:
            pair.prefill.call("add", room, 12, None)
        # the transfer worker meets the blacklisted session at the room's first chunk (a few ticks; a loaded box)
        assert _tick_until_all_ended(pair.prefill, rooms, 20) <= 20
        reasons = {room: pair.prefill.call("reason", room) for room in rooms}
        peer = reasons[rooms[0]].split("decode peer ")[1].split(" ")[0].rstrip(",")  # the loss, or the lost-handshake rule naming the claim holder
        lost = (f"PD peer lost: decode peer {peer} lost (a KV write failed and its transfer session {session} does "
                "not answer a probe)")
        for room in rooms:
            assert pair.prefill.call("status", room) == 502, reasons[room]
            assert lost in reasons[room], reasons[room]
        # decode: the status prefill sent after the cause; the same answer, the cause read from the field
        _tick_until_all_ended(pair.decode, rooms, 20)
        for room in rooms:
            assert pair.decode.call("status", room) == 502, pair.decode.call("final_reason", room)
            assert lost in pair.decode.call("reason", room), pair.decode.call("reason", room)
        assert [pair.decode.call("told", room) for room in rooms] == ["LOST_PEER"] * N  # a field, not the text
        assert [pair.prefill.call("told", room) for room in rooms] == ["LOST_PEER"] * N  # kept with the record
        # the write path ended them, not the monitor (no loss declared)
        assert pair.prefill.call("peer_counts") == {} and time.monotonic() - t0 < QUIET_HEARTBEAT
    finally:
        pair.prefill.call("blacklist_session", session, False)

    ended = pair_new_causes(pair.prefill, p_causes)
    assert {k.rsplit("/", 1)[0] for k in ended} == {"prefill/peer_failure"}, ended
    assert all(k.rsplit("/", 1)[1] in STAGES for k in ended) and sum(ended.values()) == N, ended
    assert pair_new_causes(pair.decode, d_causes) == {"decode/peer_failure/decode_transfer": N}
    # nothing held on either side (decode's pages: prefill's drain ack or the 3 s deferred release)
    pair.run_until(lambda: pair_snapshots(pair) == (p_idle, d_idle), timeout=30)
    for room in rooms:
        assert _room_entries(pair.decode, room) == [] and _room_entries(pair.prefill, room) == []
    _serve_new_requests(pair)
    assert pair_new_causes(pair.prefill, p_causes) == ended  # the served requests ended nothing
