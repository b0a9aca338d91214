"""A room's end as named transitions (docs/layout.md, "How a room ends"): every way a room ends is a row of
`room_transitions.TRANSITIONS`, `RoomLedger.make` takes a row's steps in the one order, and a call along no row
changes nothing (raises under pytest, logged at error in production). Real ledger over upstream's own
`record_failure` / `update_status` on a kv manager's room tables (no transfer engine). Fast; starts no server.

Stock upstream 0.5.23 has no ledger: its failure paths record and mark a room where they are (no remembered room, no
told cause); the statuses these transitions lead to are the verdict's (test_verdict.py), unchanged by this table."""

from __future__ import annotations

import logging
import threading

import pytest

from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.fork_ending import request_end_cause as end_cause, room_ledger, room_transitions
from sglang.srt.disaggregation.fork_ending.room_transitions import (DECODE, PREFILL, TRANSITIONS, IllegalTransition,
                                                                    Tell, Transition)

pytestmark = pytest.mark.unit

REASON = "PD transfer deadline exceeded: request r7 (bootstrap_room=7) spent 10.1s in stage prefill_bootstrap"


def _manager(role: str):
    """A kv manager's room tables and upstream's own record_failure / update_status over them."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode

    class Manager:
        record_failure = CommonKVManager.record_failure
        update_status = CommonKVManager.update_status
        disaggregation_mode = DisaggregationMode(role)

        def __init__(self):
            self.request_status, self.failure_records, self.transfer_infos = {}, {}, {}
            self.req_to_decode_prefix_len, self.deferred_bootstrap = {}, None
            self.failure_lock = threading.Lock()
            self.told = []  # Failed statuses sent to decode: (room, reason)

        def _room_notify_targets(self, room):
            return [("127.0.0.1", 7000)]

        def send_kv_status_message(self, targets, bootstrap_room, status, failure_reason=None):
            self.told.extend((bootstrap_room, failure_reason) for _ in targets)

    mgr = Manager()
    mgr.__dict__[room_ledger.ATTR] = room_ledger.RoomLedger(mgr)
    return mgr


def test_every_transition_has_a_row_whose_steps_agree():
    assert set(TRANSITIONS) == set(Transition)
    for transition, row in TRANSITIONS.items():
        assert row.sides and row.before and row.after and row.who, transition
        assert not row.mark or row.fail, f"{transition}: marks Failed without recording"
        assert row.tell is not Tell.ABORT or row.sides == {DECODE}, f"{transition}: only decode sends an ABORT"
        assert row.tell is not Tell.STATUS or DECODE not in row.sides, f"{transition}: only prefill sends a status"


def test_a_transition_takes_its_rows_steps():
    mgr = _manager(PREFILL)
    mgr.request_status[7] = KVPoll.Bootstrapping
    room_ledger.end_room(mgr, Transition.FAIL_TELL_REMEMBER, 7, REASON, cause=end_cause.TIMEOUT)
    assert mgr.request_status[7] == KVPoll.Failed and mgr.failure_records[7] == REASON
    assert mgr.told == [(7, REASON)]
    assert end_cause.room_tag(mgr, 7) is not None
    assert room_ledger.ledger_of(mgr).late(7) == (REASON, None)  # a late handshake is answered Failed
    # recorded only: the upstream path about to fail the room marks it and tells
    mgr.request_status[8] = KVPoll.Transferring
    room_ledger.end_room(mgr, Transition.RECORD_FOR_UPSTREAM, 8, REASON)
    assert mgr.request_status[8] == KVPoll.Transferring and mgr.failure_records[8] == REASON
    assert mgr.told == [(7, REASON)]


@pytest.mark.parametrize("role,transition,data", [
    (DECODE, Transition.FAIL_AND_TELL, {}),  # decode tells prefill by its receiver's ABORT, never a status
    (PREFILL, Transition.FAIL_AND_ABORT, {}),  # prefill has no receiver
    (PREFILL, Transition.RETIRE_HELD, {}),  # nothing to clear
    (PREFILL, Transition.FAIL_UNTOLD, {"targets": [("127.0.0.1", 7000)]}),  # tells nobody
    (PREFILL, Transition.CANCEL_AND_TELL, {"targets": []}),  # tells no endpoint
])
def test_an_illegal_transition_raises_in_tests_and_changes_nothing(role, transition, data):
    mgr = _manager(role)
    mgr.request_status[7] = KVPoll.Bootstrapping
    with pytest.raises(IllegalTransition):
        room_ledger.end_room(mgr, transition, 7, REASON, cause=end_cause.TIMEOUT, **data)
    assert mgr.request_status[7] == KVPoll.Bootstrapping and mgr.failure_records == {} and mgr.told == []
    assert end_cause.room_tag(mgr, 7) is None and not room_ledger.ledger_of(mgr).knows_of(7)


def test_an_illegal_transition_is_logged_in_production(monkeypatch, caplog):
    monkeypatch.setattr(room_transitions, "strict", lambda: False)
    mgr = _manager(DECODE)
    mgr.request_status[7] = KVPoll.Bootstrapping
    with caplog.at_level(logging.ERROR):
        room_ledger.end_room(mgr, Transition.FAIL_AND_TELL, 7, REASON)
    assert "illegal transition for room 7: fail_and_tell runs on prefill, not on decode" in caplog.text
    assert mgr.request_status[7] == KVPoll.Bootstrapping and mgr.failure_records == {} and mgr.told == []


def test_hand_to_recovery_fails_and_remembers_the_stalled_room_and_aborts_it_on_prefill_and_runs_on_decode_only():
    """Decode's own transfer deadline in a recoverable stage, recovery on (docs/recovery.md): the stalled room is
    failed with the deadline's reason (its request answers at its next poll: the tokenizer re-runs it under a new
    room, or answers the 504), remembered as ended (the request never goes on under this room), and prefill is told by
    the receiver's ABORT (its copy of the room ends). Stock upstream 0.5.23 has no deadline in decode_transfer (the
    request waits for the stalled transfer); the fork without recovery ends the room by `fail_and_abort` (504)."""
    mgr = _manager(DECODE)
    mgr.request_status[7] = KVPoll.Transferring

    class Receiver:
        aborts = 0

        def ensure_abort_notified(self):
            Receiver.aborts += 1

    room_ledger.end_room(mgr, Transition.HAND_TO_RECOVERY, 7, REASON, cause=end_cause.TIMEOUT, receiver=Receiver())
    assert Receiver.aborts == 1
    assert mgr.request_status[7] == KVPoll.Failed and mgr.failure_records[7] == REASON
    assert room_ledger.ledger_of(mgr).late(7) == (REASON, None)
    assert end_cause.room_tag(mgr, 7) is not None
    prefill = _manager(PREFILL)
    prefill.request_status[7] = KVPoll.Transferring
    with pytest.raises(IllegalTransition, match="hand_to_recovery runs on decode, not on prefill"):
        room_ledger.end_room(prefill, Transition.HAND_TO_RECOVERY, 7, "x")
    with pytest.raises(IllegalTransition, match="needs receiver"):
        room_ledger.end_room(mgr, Transition.HAND_TO_RECOVERY, 7, "x")


class _WatchedLock:
    """Upstream's failure lock (a plain lock), telling the test when another thread waits for it."""

    def __init__(self):
        self.lock, self.waited = threading.Lock(), threading.Event()

    def __enter__(self):
        if not self.lock.acquire(blocking=False):
            self.waited.set()
            self.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.lock.release()


def test_a_failure_written_on_decode_while_the_room_clears_is_not_left_behind():
    """A decode room's failure (prefill's Failed status, a lost peer) is checked against `request_status` without the
    failure lock, then written under it. The scheduler can clear the room in between (its receiver's `clear`, then
    `failure_exception` pops the record under the lock). The record written after that pop belongs to no request:
    it stayed for good, and a later request with that room number would take it as its own. Seen once as a soak's
    leftover (`rooms.failure_records` 1 on an idle decode). Stock upstream 0.5.23 checks the same way in
    `apply_prefill_status` and keeps such a record."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.fork_ending import room_kv_hooks

    mgr = _manager(DECODE)
    mgr.failure_lock = lock = _WatchedLock()
    mgr.request_status[7] = KVPoll.Transferring
    with lock.lock:  # the scheduler holds the lock: the bootstrap thread's write waits for it after its check
        writer = threading.Thread(target=room_kv_hooks.around_record_failure,
                                  args=(CommonKVManager.record_failure, mgr, 7, REASON), daemon=True)
        writer.start()
        assert lock.waited.wait(10), "the write never reached the failure lock"
        mgr.request_status.pop(7)  # the receiver's clear
        mgr.failure_records.pop(7, None)  # failure_exception's pop, under the lock
    writer.join(10)
    assert not writer.is_alive()
    assert mgr.failure_records == {} and room_ledger.ledger_of(mgr).told_with(7) is None
    # a live room keeps its record
    mgr.request_status[8] = KVPoll.Transferring
    room_kv_hooks.around_record_failure(CommonKVManager.record_failure, mgr, 8, REASON)
    assert mgr.failure_records == {8: REASON}


def test_a_failure_written_after_decode_saw_success_goes_with_the_rooms_clear():
    """Prefill can send a Failed status after its Success (an abort on prefill as the transfer ended). Decode's poll
    has seen Success; the record lands before the scheduler clears the receiver, and nothing pops it after a Success
    (only `failure_exception` does): upstream 0.5.23's own `clear` leaves it behind, as asserted below. The fork's
    hook after the clear drops it."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager, CommonKVReceiver
    from sglang.srt.disaggregation.fork_ending import room_kv_hooks

    mgr = _manager(DECODE)
    mgr.defer_decode_allocation = False
    mgr.required_prefill_response_num_table, mgr.prefill_response_tracker = {9: 1}, {9: {0}}
    mgr.addr_to_rooms_tracker = {"10.0.0.1:8998": {9}}
    receiver = object.__new__(CommonKVReceiver)  # upstream's clear over these fields only
    receiver.__dict__.update(kv_mgr=mgr, bootstrap_room=9, bootstrap_addr="10.0.0.1:8998", _owns_bootstrap_room=True,
                             _lifecycle_lock=threading.Lock(), conclude_state=KVPoll.Success, abort_notified=False)
    mgr.request_status[9] = KVPoll.Success  # what decode's poll saw
    room_kv_hooks.around_record_failure(CommonKVManager.record_failure, mgr, 9, REASON)  # prefill's late Failed
    CommonKVReceiver._clear(receiver)  # upstream's body of `clear` (the fork's hook wraps `clear`)
    assert 9 not in mgr.request_status and mgr.failure_records == {9: REASON}  # upstream leaves it
    room_kv_hooks.after_receiver_clear(None, receiver)
    assert mgr.failure_records == {} and room_ledger.ledger_of(mgr).told_with(9) is None
