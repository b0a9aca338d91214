"""Decode ends a request before prefill has created its room (over real mooncake TCP,
two processes): prefill remembers decode's ABORT and fails the room as soon as it
creates it, within a second instead of its 300 s bootstrap timeout, as an abort (decode
ended it); both sides give everything back and keep serving.

This is how a release during a retract pause ends a request whose prefill copy is
still held at prefill's pause gate (sglang.srt.disaggregation.cancelled_rooms).
"""

import pytest

from testing.polling import wait_until
from testing.pd_checks import assert_pair_idle, is_client_abort, pair_fixture

pytestmark = pytest.mark.pair

SIZES = dict(kv_tokens=1024, req_slots=8, metadata_slots=8, max_context_len=64)
ANSWER_S = 5.0  # generous on a loaded machine; without the fix: the bootstrap timeout


def _first_request(p) -> None:
    """One request first: decode learns prefill's info, as in a serving deployment."""
    room = p.submit(prompt_len=12)
    p.run_until(lambda: p.decode.call("transferred", room)
                and p.prefill.call("final_reason", room) is not None, timeout=60)
    p.decode.call("finish", room)


pair = pair_fixture(prepare=_first_request, **SIZES)


def _ended_as_abort(side, room) -> bool:
    """The client-abort answer (room_ledger's aborts): no error status."""
    return is_client_abort(side.call("final_reason", room))


def _served(pair) -> None:
    room = pair.submit(prompt_len=16)
    pair.run_until(lambda: pair.decode.call("transferred", room)
                   and pair.prefill.call("final_reason", room) is not None, timeout=60)
    assert pair.prefill.call("status", room) == 200
    assert pair.decode.call("kv_bytes", room) == pair.prefill.call("kv_sent", room)
    pair.decode.call("finish", room)


def _assert_released(pair, room) -> None:
    assert pair.prefill.call("room_entries", room) == []
    assert pair.decode.call("room_entries", room) == []
    assert_pair_idle(pair)
    assert pair.prefill.call("cancelled_rooms") == 0


def test_abort_before_prefill_has_the_room_fails_it_at_creation(pair):
    failed_before = pair.prefill.call("counter", "increment_bootstrap_failed_reqs")
    room = pair.new_room()
    pair.decode.call("add", room, 12, None)
    pair.decode.call("abort", room)
    pair.run_until(lambda: pair.decode.call("final_reason", room) is not None, timeout=30)
    assert pair.decode.call("final_reason", room)["type"] == "abort"
    # decode's ABORT reaches prefill's manager, which has no such room yet
    pair.run_until(lambda: pair.prefill.call("cancelled_rooms") == 1, timeout=30)

    pair.prefill.call("add", room, 12, None)  # prefill's copy arrives late
    took = pair.run_until(lambda: pair.prefill.call("final_reason", room) is not None, timeout=60)
    assert took < ANSWER_S, took
    # decode ended the request: prefill's leg ends as an abort, not a bootstrap failure
    assert _ended_as_abort(pair.prefill, room), pair.prefill.call("final_reason", room)
    assert pair.prefill.call("counter", "increment_bootstrap_failed_reqs") == failed_before
    _assert_released(pair, room)
    _served(pair)
    _assert_released(pair, room)


def test_abort_after_prefill_created_the_room_fails_it_at_once(pair):
    """The other order (upstream's own path): prefill's room exists, still waiting for
    decode's handshake, when decode's ABORT arrives."""
    room = pair.new_room()
    pair.prefill.call("add", room, 12, None)
    pair.prefill.call("tick")
    pair.decode.call("add", room, 12, None)
    pair.decode.call("abort", room)
    took = pair.run_until(lambda: pair.prefill.call("final_reason", room) is not None
                          and pair.decode.call("final_reason", room) is not None, timeout=60)
    assert took < ANSWER_S, took
    assert _ended_as_abort(pair.prefill, room), pair.prefill.call("final_reason", room)
    assert pair.decode.call("final_reason", room)["type"] == "abort"
    _assert_released(pair, room)
    _served(pair)


def test_abort_while_prefill_paused_then_late_handshake(pair):
    """Prefill, paused, answers an abort of a room still waiting for decode's
    handshake; decode's handshake arrives after that (prefill was paused, decode was
    not): it must not re-create the room on prefill, and decode hears Failed."""
    room = pair.new_room()
    pair.prefill.call("add", room, 12, None)
    pair.prefill.call("tick")
    pair.prefill.call("set_paused", True)
    try:
        pair.prefill.call("abort", room)
        assert pair.prefill.call("final_reason", room)["type"] == "abort"  # answered now
        pair.decode.call("add", room, 12, None)  # decode's handshake, late
        took = pair.run_until(lambda: pair.decode.call("final_reason", room) is not None, timeout=60)
    finally:
        pair.prefill.call("set_paused", False)
    assert took < ANSWER_S, took
    # prefill's client abort reaches decode's leg as an abort (room_ledger's aborts)
    assert _ended_as_abort(pair.decode, room), pair.decode.call("final_reason", room)
    # the fence stays until it expires (bounded) or a new prefill copy of the room
    # (a re-bootstrap) fails on it: here one comes
    pair.prefill.call("add", room, 12, None)
    pair.run_until(lambda: pair.prefill.call("final_reason", room) is not None, timeout=ANSWER_S)
    assert _ended_as_abort(pair.prefill, room), pair.prefill.call("final_reason", room)
    # decode keeps the pages until prefill acknowledges the drain (upstream's
    # deferred release): that takes a tick or two, not its 30 s fallback
    pair.run_until(lambda: pair.decode.call("room_entries", room) == []
                   and pair.decode.call("snapshot") == pair.idle[1], timeout=ANSWER_S)
    _assert_released(pair, room)
    _served(pair)


def _release_abort(side, room) -> bool:
    """Upstream's abort answer naming the release: finish_reason abort, no status."""
    reason = side.call("final_reason", room)
    return (side.call("status", room) is None and reason["type"] == "abort"
            and "released during pause" in reason["message"])


def test_room_ended_at_release_then_decode_handshakes(pair):
    """Prefill's release ends a queued room (an abort: 200, finish_reason abort, the
    release's message; was 503 before issue 14) while decode's copy of the request is
    still held (decode's pause gate, or a retracted request decode re-bootstraps under
    the same room): decode's handshake after continue is answered Failed at once with
    the release's abort instead of re-creating the room, and a new prefill copy of the
    room (decode's re-bootstrap) fails at creation. Nothing hangs, nothing is left."""
    message = "Aborted: engine memory released during pause (mode=in_place)."
    room = pair.new_room()
    pair.prefill.call("add", room, 12, "released-first")
    pair.prefill.call("tick")
    pair.prefill.call("set_paused", True)
    try:
        pair.prefill.call("end_queued", message)
    finally:
        pair.prefill.call("set_paused", False)
    assert _release_abort(pair.prefill, room)
    pair.decode.call("add", room, 12, "released-again")  # decode continues: handshake
    took = pair.run_until(lambda: pair.decode.call("final_reason", room) is not None, timeout=60)
    assert took < ANSWER_S, took
    assert _release_abort(pair.decode, room)
    assert "released during pause" in pair.decode.call("reason", room)
    pair.prefill.call("add", room, 12, "released-again")  # decode's re-bootstrap copy
    pair.run_until(lambda: pair.prefill.call("final_reason", room) is not None, timeout=ANSWER_S)
    assert _release_abort(pair.prefill, room)
    pair.run_until(lambda: pair.decode.call("room_entries", room) == []
                   and pair.decode.call("snapshot") == pair.idle[1], timeout=ANSWER_S)
    _assert_released(pair, room)
    _served(pair)


# Last in the module: it leaves one (expiring) cancellation behind by design.
def test_abort_of_a_room_only_decode_handshake_created(pair):
    """Decode handshakes (prefill's manager stores the room, WaitingForInput) but
    prefill's copy never reaches its scheduler (answered at prefill's pause gate);
    decode's abort then drops that ownerless room state on prefill, and a prefill copy
    that does arrive later fails at creation."""
    for prefill_copy_arrives in (False, True):
        kept = pair.prefill.call("cancelled_rooms")
        room = pair.new_room()
        pair.decode.call("add", room, 12, None)
        pair.run_until(lambda: room in pair.prefill.call("snapshot")["rooms"], timeout=30)
        pair.decode.call("abort", room)
        pair.run_until(lambda: pair.decode.call("final_reason", room) is not None
                       and room not in pair.prefill.call("snapshot")["rooms"], timeout=ANSWER_S)
        if prefill_copy_arrives:
            pair.prefill.call("add", room, 12, None)
            pair.run_until(lambda: pair.prefill.call("final_reason", room) is not None, timeout=ANSWER_S)
            assert _ended_as_abort(pair.prefill, room), pair.prefill.call("final_reason", room)
            assert pair.prefill.call("cancelled_rooms") == kept  # taken at creation
        else:
            # a copy that never comes: the cancellation stays until it expires
            # (bounded; prefill cannot know), but no room state does
            assert pair.prefill.call("cancelled_rooms") == kept + 1
        pair.run_until(lambda: pair.decode.call("room_entries", room) == []
                       and pair.decode.call("snapshot") == pair.idle[1], timeout=ANSWER_S)
        assert pair.prefill.call("room_entries", room) == []
        assert (pair.prefill.call("snapshot"), pair.decode.call("snapshot")) == pair.idle
    _served(pair)


# A failure reason that names the pause (a peer's pause, by its text) told with another cause: the field decides.
def _misleading(room):
    from sglang.srt.disaggregation.fork_ending import verdict, verdict_wording

    return verdict.peer_reason("r", room, "prefill", verdict_wording.PAUSE_ABORT_MESSAGE)


def _ended_by_prefill(pair, cause, told_again=False):
    """A request both sides hold, prefill's room waiting for its input; prefill ends it with `_misleading`'s reason
    and `cause` (None: no cause frame, as a prefill of an older build or stock upstream); (decode's answer, the
    seconds it took, decode's new end causes). `told_again`: a second Failed status for the room follows at once,
    without a cause (as a transfer worker's late conclusion of a write already on its way sends it)."""
    kept = pair.prefill.call("cancelled_rooms")  # an earlier test's cancellation stays until it expires
    room = pair.submit(prompt_len=12)
    # decode alone ticks: its handshake reaches prefill (WaitingForInput) while prefill's request stays in its
    # bootstrap queue, so no chunk is on its way when prefill ends the room (both ticking, a loaded machine could see
    # WaitingForInput with the transfer already queued, and decode would get Success first)
    wait_until(lambda: pair.prefill.call("kv_status", room) == "WaitingForInput" or pair.decode.call("tick"),
               timeout=60, what="prefill's room WaitingForInput", interval=0)
    assert pair.prefill.call("snapshot")["queues"]["bootstrap"] == 1  # not yet forwarded
    causes = pair.decode.call("end_causes")
    pair.prefill.call("end_room", room, _misleading(room), cause)
    if told_again:
        pair.prefill.call("end_room", room, _misleading(room), None)
    took = pair.run_until(lambda: pair.decode.call("final_reason", room) is not None
                          and pair.prefill.call("final_reason", room) is not None, timeout=60)
    after = pair.decode.call("end_causes")
    new = {k: v - causes.get(k, 0) for k, v in after.items() if v != causes.get(k, 0)}
    # decode keeps the pages until prefill acknowledges the drain of its ABORT (a tick or two)
    pair.run_until(lambda: pair.decode.call("room_entries", room) == []
                   and pair.decode.call("snapshot") == pair.idle[1], timeout=ANSWER_S)
    assert pair.prefill.call("room_entries", room) == [] and pair.decode.call("room_entries", room) == []
    assert_pair_idle(pair)
    assert pair.prefill.call("cancelled_rooms") == kept
    return room, pair.decode.call("final_reason", room), took, new


@pytest.mark.parametrize("told_again", [False, True], ids=["once", "then_again_without_a_cause"])
def test_the_told_cause_decides_over_the_reason_text(pair, told_again):
    """Prefill tells decode the cause as a field (its PEER_CAUSE message before the Failed status): a reason whose
    text reads as the peer's pause but whose cause is the peer's abort is answered as a client abort. A second
    Failed status without a cause (a late conclusion's) does not replace the first one's root cause."""
    room, answer, took, causes = _ended_by_prefill(pair, "PEER_ABORT", told_again)
    assert took < ANSWER_S, took
    assert pair.decode.call("status", room) is None and answer["type"] == "abort", answer
    assert answer["message"] == "Aborted by the client.", answer
    assert [k for k in causes if "/client_abort/" in f"/{k}/"], causes
    _served(pair)


def test_without_a_cause_frame_the_reason_text_is_read(pair):
    """A prefill that sends no cause (an older fork build, stock upstream): decode reads the reason's text as before,
    here the peer's pause."""
    room, answer, took, causes = _ended_by_prefill(pair, None)
    assert took < ANSWER_S, took
    assert pair.decode.call("status", room) is None and answer["type"] == "abort", answer
    assert answer["message"] == "Aborted by pause_generation(mode=abort).", answer
    assert [k for k in causes if "/pause/" in f"/{k}/"], causes
    _served(pair)


def test_abort_racing_the_sender_creation_is_answered_as_an_abort(pair):
    """Decode's ABORT reaches prefill's bootstrap thread for a room no sender owns yet (kept as a cancellation);
    before that thread drops the room's ownerless state, prefill's scheduler creates the room's sender, which the
    cancellation fails at once (the ledger's `claim`). The drop, coming after, must not take the live sender's room
    and failure record with it: the client gets the abort answer, not a 500 "Failed due to an unknown reason from
    another rank". The interleaving is forced: the drop waits (hold_unowned_drops) until the sender exists.
    Stock upstream 0.5.23 has no cancellation: its prefill copy waits out the bootstrap timeout (300 s), then 500."""
    kept = pair.prefill.call("cancelled_rooms")
    room = pair.new_room()
    pair.prefill.call("hold_unowned_drops")
    try:
        pair.decode.call("add", room, 12, None)
        pair.decode.call("abort", room)
        pair.run_until(lambda: pair.prefill.call("unowned_drop_reached"), timeout=30)
        pair.prefill.call("add", room, 12, None)  # create_sender, then the ledger fails the cancelled room
    finally:
        pair.prefill.call("release_unowned_drops")
    took = pair.run_until(lambda: pair.prefill.call("final_reason", room) is not None
                          and pair.decode.call("final_reason", room) is not None, timeout=60)
    assert took < ANSWER_S, took
    assert pair.prefill.call("status", room) is None, pair.prefill.call("final_reason", room)
    assert _ended_as_abort(pair.prefill, room), pair.prefill.call("final_reason", room)
    assert pair.decode.call("final_reason", room)["type"] == "abort"
    pair.run_until(lambda: pair.decode.call("room_entries", room) == []
                   and pair.decode.call("snapshot") == pair.idle[1]
                   and pair.prefill.call("snapshot") == pair.idle[0], timeout=ANSWER_S)
    assert pair.prefill.call("room_entries", room) == []
    assert pair.prefill.call("cancelled_rooms") == kept  # taken at creation
    _served(pair)
