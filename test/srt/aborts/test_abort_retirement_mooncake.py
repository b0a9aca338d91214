"""Aborts over real mooncake (TCP, two processes, queue harness on each side): each
side tells the other at once, a late handshake does not resurrect an aborted room,
an abort on both sides ends the request exactly once, nothing is counted as a
failure, and both sides give everything back.

"At once", counted: the aborting side tells its peer within TELL_TICKS of its own
scheduler ticks (the message then crosses loopback on the peer's background thread,
bounded by TRANSIT_S of wall time, no tick involved), and the peer ends its request
within END_TICKS of its own ticks after hearing. Without the fork the peer learns
nothing and its request waits for upstream's 300 s bootstrap/waiting timers.
"""

import time

import pytest

from sglang.srt.disaggregation.fork_ending import room_ledger as ar
from sglang.srt.disaggregation.fork_ending import verdict_wording
from testing.pd_checks import is_client_abort, pair_fixture, pair_is_idle, pair_new_causes, wait_pair_idle
from testing.pd_cluster import wait_until

pytestmark = pytest.mark.pair

FAILURE_COUNTERS = ("increment_bootstrap_failed_reqs", "increment_transfer_failed_reqs")
# Bounded memories of ended rooms (not transfer state): prefill's rooms it ended
# (answers a late handshake) and rooms decode aborted (ends a late prefill leg).
TOMBSTONES = {"fork_expired_rooms"}
# The abort is sent when the aborting queue retires the request (its first tick).
TELL_TICKS = 1
# Loopback message to the peer's background thread; milliseconds on an idle machine,
# far under upstream's 300 s timers, generous for two loaded cores.
TRANSIT_S = 5.0
# The peer's queue reads the room's Failed status on its next poll.
END_TICKS = 2

pair = pair_fixture()


@pytest.fixture
def before(pair):
    assert _idle(pair)
    return {
        side: ({n: getattr(pair, side).call("counter", n) for n in FAILURE_COUNTERS},
               getattr(pair, side).call("end_causes"))
        for side in ("prefill", "decode")
    }


_idle = pair_is_idle


def _client_abort(side, room):
    return is_client_abort(side.call("final_reason", room))


def _ended(side, room):
    return side.call("final_reason", room) is not None


def _told_at_once(pair, teller, peer, room) -> int:
    """`teller` has just aborted `room`: after TELL_TICKS of its ticks the peer's kv
    manager has the room Failed (heard over loopback, no peer tick), and the peer's
    queue ends its request within END_TICKS ticks. Returns the peer's ticks."""
    for _ in range(TELL_TICKS):
        teller.call("tick")
    wait_until(lambda: peer.call("kv_status", room) == "Failed", TRANSIT_S,
               f"{peer.role} to hear of room {room}", interval=0.01,
               on_timeout=lambda: f"{peer.role} kv status {peer.call('kv_status', room)}")
    return pair.ticks_until(peer, lambda: _ended(peer, room), END_TICKS)


def _assert_no_failure_counted(pair, before):
    for name in ("prefill", "decode"):
        side = getattr(pair, name)
        assert {n: side.call("counter", n) for n in FAILURE_COUNTERS} == before[name][0], name


def _tick_decode_into_transfer(pair) -> None:
    """Tick decode until its room preallocated and sent its metadata (transfer queue)."""
    t0 = time.monotonic()
    while pair.decode.call("snapshot")["queues"]["transfer"] != 1:
        assert time.monotonic() - t0 < 30
        pair.decode.call("tick")


def _both_legs_in_transfer(pair) -> int:
    """The same request on both sides (`pair.submit`), decode ticked into its transfer
    queue (its metadata sent); prefill has not run it yet. Returns the room."""
    room = pair.submit(prompt_len=12)
    _tick_decode_into_transfer(pair)
    return room


def _wait_idle_and_clean(pair, room):
    wait_pair_idle(pair)
    assert set(pair.prefill.call("room_entries", room)) <= TOMBSTONES
    assert pair.decode.call("room_entries", room) == []


def _assert_each_side_ended_once(pair, before, room, cause: str) -> None:
    """Each side answered the room once and counted it once under `cause` (prefill in
    its bootstrap queue, decode in its transfer queue), no failure counted; both idle,
    the room gone."""
    assert pair.prefill.call("finals", room) == pair.decode.call("finals", room) == 1
    _assert_no_failure_counted(pair, before)
    assert pair_new_causes(pair.prefill, before["prefill"][1]) == {f"prefill/{cause}/prefill_bootstrap": 1}
    assert pair_new_causes(pair.decode, before["decode"][1]) == {f"decode/{cause}/decode_transfer": 1}
    _wait_idle_and_clean(pair, room)


def test_prefill_abort_frees_decode_preallocation_at_once(pair, before):
    # decode preallocates and sends its metadata; prefill has not run the request yet
    room = _both_legs_in_transfer(pair)
    assert pair.decode.call("snapshot")["kv_held"] > 0
    pair.prefill.call("abort", room)
    _told_at_once(pair, pair.prefill, pair.decode, room)
    pair.run_until(lambda: _ended(pair.prefill, room), timeout=30)
    assert _client_abort(pair.prefill, room), pair.prefill.call("final_reason", room)
    assert _client_abort(pair.decode, room), pair.decode.call("final_reason", room)
    assert pair.decode.call("output_ids", room) == []  # no token generated
    _assert_each_side_ended_once(pair, before, room, "client_abort")


def test_decode_abort_frees_prefill_at_once(pair, before):
    room = _both_legs_in_transfer(pair)
    pair.decode.call("abort", room)
    _told_at_once(pair, pair.decode, pair.prefill, room)
    pair.run_until(lambda: _ended(pair.decode, room), timeout=30)
    assert _client_abort(pair.decode, room), pair.decode.call("final_reason", room)
    # prefill hears decode's ABORT: an abort there, not "failed for an unknown reason"
    assert _client_abort(pair.prefill, room), pair.prefill.call("final_reason", room)
    _assert_each_side_ended_once(pair, before, room, "client_abort")


def test_late_handshake_after_prefill_abort_is_refused(pair, before):
    room = pair.new_room()
    pair.prefill.call("add", room, 12)  # decode's leg is late
    pair.prefill.call("tick")
    pair.prefill.call("abort", room)
    t0 = time.monotonic()
    while pair.prefill.call("final_reason", room) is None:
        assert time.monotonic() - t0 < 10
        pair.prefill.call("tick")
    assert _client_abort(pair.prefill, room)
    # only the room ledger's bounded memory of ended rooms holds it
    assert pair.prefill.call("room_entries", room) == []
    assert verdict_wording.ABORT_TAG in pair.prefill.call("late_answer", room)

    pair.decode.call("add", room, 12)  # now decode hands prefill its pages
    # decode's handshake crosses to prefill's bootstrap thread, which answers Failed at
    # once (no prefill tick); decode then ends the request on its next polls
    wait_until(lambda: pair.decode.call("tick") or _ended(pair.decode, room)
               or pair.decode.call("kv_status", room) == "Failed",
               TRANSIT_S, "decode to be answered Failed", interval=0.01,
               on_timeout=lambda: str(pair.decode.call("kv_status", room)))
    pair.ticks_until(pair.decode, lambda: _ended(pair.decode, room), END_TICKS)
    assert _client_abort(pair.decode, room), pair.decode.call("final_reason", room)
    _assert_no_failure_counted(pair, before)
    # upstream: request_status/transfer_infos re-created on prefill and never cleared
    wait_pair_idle(pair)
    assert set(pair.prefill.call("room_entries", room)) <= TOMBSTONES
    assert pair.decode.call("room_entries", room) == []


def test_abort_on_both_sides_ends_once(pair, before):
    room = pair.submit(prompt_len=12)
    pair.decode.call("tick")
    pair.prefill.call("abort", room)
    pair.decode.call("abort", room)
    pair.run_until(lambda: pair.prefill.call("final_reason", room) is not None
                   and pair.decode.call("final_reason", room) is not None, timeout=30)
    wait_pair_idle(pair)
    pair.prefill.call("tick", 3)
    pair.decode.call("tick", 3)
    assert pair.prefill.call("finals", room) == pair.decode.call("finals", room) == 1
    assert _client_abort(pair.prefill, room) and _client_abort(pair.decode, room)
    assert sum(pair_new_causes(pair.prefill, before["prefill"][1]).values()) == 1
    assert sum(pair_new_causes(pair.decode, before["decode"][1]).values()) == 1
    _assert_no_failure_counted(pair, before)
    _wait_idle_and_clean(pair, room)

    # and the pair keeps serving
    ok = pair.submit(prompt_len=12)
    pair.run_until(lambda: pair.decode.call("transferred", ok), timeout=30)
    assert pair.decode.call("kv_bytes", ok) == pair.prefill.call("kv_sent", ok)
    pair.decode.call("finish", ok)
    wait_pair_idle(pair)


def test_prefill_leg_after_decode_abort_ends_at_once(pair, before):
    """Decode aborts before prefill's leg arrives: the leg, when it comes, ends as an
    abort without sending KV into pages decode already gave back."""
    room = pair.new_room()
    pair.decode.call("add", room, 12)
    _tick_decode_into_transfer(pair)
    pair.decode.call("abort", room)
    pair.run_until(lambda: pair.decode.call("final_reason", room) is not None, timeout=30)
    assert _client_abort(pair.decode, room)
    pair.run_until(lambda: pair.decode.call("snapshot") == pair.idle[1], timeout=30)
    # decode's ABORT reaches prefill's bootstrap thread (prefill has no request yet)
    wait_until(lambda: pair.prefill.call("cancelled_rooms") == 1
               or pair.prefill.call("kv_status", room) == "Failed", TRANSIT_S,
               "prefill to hear decode's abort", interval=0.01)
    pair.prefill.call("add", room, 12)  # the late leg
    # prefill remembers decode's ABORT: the leg ends on its first polls
    wait_until(lambda: pair.prefill.call("kv_status", room) == "Failed" or _ended(pair.prefill, room), TRANSIT_S,
               "prefill to hear of the room", interval=0.01)
    _late_prefill_leg_ends(pair, before, room, is_client_abort)
    assert set(pair.prefill.call("room_entries", room)) <= TOMBSTONES


def test_decode_abort_before_prefill_leg_registered(pair, before):
    """Decode aborts before prefill's leg exists at all (prefill's tokenizer is slower
    than decode's): prefill remembers the ABORT and ends the leg at once when it
    arrives, instead of waiting for a handshake that will never come."""
    room = pair.new_room()
    pair.decode.call("add", room, 12)
    pair.decode.call("abort", room)  # before decode even handshook
    pair.run_until(lambda: pair.decode.call("final_reason", room) is not None, timeout=30)
    assert _client_abort(pair.decode, room)
    pair.run_until(lambda: pair.decode.call("snapshot") == pair.idle[1], timeout=30)
    # decode's ABORT travels to prefill's bootstrap thread, which remembers the room
    wait_until(lambda: pair.prefill.call("cancelled_rooms") == 1, TRANSIT_S,
               "prefill to remember decode's abort", interval=0.01)
    pair.prefill.call("add", room, 12)
    _late_prefill_leg_ends(pair, before, room, is_client_abort)
    assert set(pair.prefill.call("room_entries", room)) <= TOMBSTONES


def _late_prefill_leg_ends(pair, before, room, answered) -> None:
    """Prefill's leg, added after decode ended the room, ends within END_TICKS of
    prefill's ticks, answered as `answered(final reason)` holds, having sent no KV; no
    failure counted; both idle, the room gone."""
    pair.ticks_until(pair.prefill, lambda: _ended(pair.prefill, room), END_TICKS)
    assert answered(pair.prefill.call("final_reason", room)), pair.prefill.call("final_reason", room)
    assert pair.prefill.call("sends", room) == 0
    _assert_no_failure_counted(pair, before)
    _wait_idle_and_clean(pair, room)


def _pause_answer(reason) -> bool:
    from sglang.srt.managers.fork_pause import pd_pause

    return (reason is not None and reason.get("type") == "abort" and reason.get("status_code") is None
            and reason.get("message") == pd_pause.PAUSE_ABORT_MESSAGE)


def test_decode_pause_abort_tells_prefill_why(pair, before):
    """Decode's abort-mode pause (its scheduler side: abort everything queued with the
    pause's message and drain) ends a room prefill is waiting on: decode's ABORT names
    the pause, so prefill's copy answers the pause's message and counts "pause", not a
    client abort -- over real mooncake, told at once."""
    from sglang.srt.managers.fork_pause import pd_pause

    room = _both_legs_in_transfer(pair)
    pair.decode.call("end_queued", pd_pause.PAUSE_ABORT_MESSAGE)
    assert _pause_answer(pair.decode.call("final_reason", room)), pair.decode.call("final_reason", room)
    wait_until(lambda: pair.prefill.call("kv_status", room) == "Failed", TRANSIT_S,
               "prefill to hear decode's ABORT", interval=0.01)
    pair.ticks_until(pair.prefill, lambda: _ended(pair.prefill, room), END_TICKS)
    assert _pause_answer(pair.prefill.call("final_reason", room)), pair.prefill.call("final_reason", room)
    _assert_each_side_ended_once(pair, before, room, "pause")


def test_decode_pause_abort_before_prefill_leg_tells_it_why(pair, before):
    """Decode's pause ends a room before prefill's leg exists (held at prefill's pause
    gate): prefill remembers the ABORT with the pause's message, and the leg, when it
    comes, answers that message and counts "pause"."""
    from sglang.srt.managers.fork_pause import pd_pause

    room = pair.new_room()
    pair.decode.call("add", room, 12)
    _tick_decode_into_transfer(pair)
    pair.decode.call("end_queued", pd_pause.PAUSE_ABORT_MESSAGE)
    assert _pause_answer(pair.decode.call("final_reason", room)), pair.decode.call("final_reason", room)
    pair.run_until(lambda: pair.decode.call("snapshot") == pair.idle[1], timeout=30)
    wait_until(lambda: pair.prefill.call("cancelled_rooms") == 1
               or pair.prefill.call("kv_status", room) == "Failed", TRANSIT_S,
               "prefill to hear decode's abort", interval=0.01)
    pair.prefill.call("add", room, 12)  # the leg, after prefill's gate opened
    _late_prefill_leg_ends(pair, before, room, _pause_answer)
    assert pair_new_causes(pair.prefill, before["prefill"][1]) == {"prefill/pause/prefill_bootstrap": 1}


def test_a_failed_retract_rebootstrap_ends_as_its_failure_never_as_a_client_abort(pair, before):
    """Upstream's failure path of a retract's re-send to prefill (`_fail_prefill_recompute`: the re-send's
    /generate answered >= 400 or errored) runs `abort()` -- the room Failed with "Aborted by AbortReq." -- and only
    then records its reason: a decode poll in between answered the request as a client abort (200 abort "Aborted
    by the client." where nobody aborted; the room-ledger soak in CI). The room turns Failed already naming the
    re-send; the client gets the error, prefill is told, nothing is counted as a client abort."""
    reason = "PD retract rebootstrap /generate failed for rid=x (status=400)."
    room = _both_legs_in_transfer(pair)
    assert pair.decode.call("fail_rebootstrap", room, reason) == reason  # what a poll at that moment reads
    pair.run_until(lambda: _ended(pair.decode, room), timeout=30)
    final = pair.decode.call("final_reason", room)
    assert not _client_abort(pair.decode, room), final
    assert "PD retract rebootstrap /generate failed" in str(final.get("message")), final
    assert pair.decode.call("status", room) == 500, final
    # prefill heard decode's ABORT (sent by the failure path itself) and ends its copy
    pair.ticks_until(pair.prefill, lambda: _ended(pair.prefill, room), END_TICKS)
    assert "decode/client_abort/decode_transfer" not in pair_new_causes(pair.decode, before["decode"][1])
    _wait_idle_and_clean(pair, room)


def test_a_fake_host_request_owns_no_room_on_a_real_manager(pair, before):
    """Upstream's server warmup (and any request naming upstream's fake bootstrap host) gets upstream's fake sender,
    paired with prefill's real mooncake kv manager. The ledger took it as a room's owner when it was created, but a
    fake sender's clear is not the one that disowns (`CommonKVSender.clear`), so its room stayed in
    `ledger_owned` for the server's life: every prefill server started with room 0 "owned" by its warmup (the leak
    first seen at test_abort_retirement_e2e's idle check, hidden since as an `open` table), and the room number
    counted as owned (decode's ABORT for a real request of that number was not kept as a cancellation). Now a sender
    owns a room only if its clear disowns it. Stock upstream 0.5.23 has no ledger: nothing to leak."""
    room = pair.new_room()
    pair.prefill.call("add_fake_host", room, 4)  # the warmup's request, prefill alone
    t0 = time.monotonic()
    while not _ended(pair.prefill, room):
        assert time.monotonic() - t0 < 30, pair.prefill.call("snapshot")
        pair.prefill.call("tick")
    assert pair.prefill.call("final_reason", room)["type"] == "length"  # completed as the warmup does
    assert pair.prefill.call("fork_tables")["ledger_owned"]["size"] == 0
    _assert_no_failure_counted(pair, before)
    wait_pair_idle(pair)
