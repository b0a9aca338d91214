"""The room ledger's hooks on upstream's kv manager, sender and receiver: a manager's ledger and prefill's ABORT
handler (`on_manager_init`, `handle_abort`), a sender claiming a cancelled room, a cleared sender or receiver
(`after_receiver_clear`), a late handshake for an ended room (`around_update_status`), the cause kept with each
failure record (`around_record_failure`), the cause prefill announces before a Failed status (decode:
`around_parse_kv_status_message`, `around_apply_prefill_status`), a retract's failed re-send, decode's early telling
and drains (`after_ensure_abort_notified`).

Threads: the bootstrap thread (ABORTs, handshakes, status messages), the transfer workers (`record_failure`,
`update_status` inside `conclude_transfer`), the scheduler (sender creation and clear, receiver clear,
`ensure_abort_notified`), the re-bootstrap pool (`_fail_prefill_recompute`). Locks: the ledger's and upstream's
`failure_lock` (ledger inside it), never ours around a call into upstream. Invariant: every end these hooks make is a
named transition of the ledger (`RoomLedger.make`); a failure record and the cause kept with it change together,
under `failure_lock` (the record an ABORT brings is written by the ledger, `room_ledger.write_failure`)."""

from __future__ import annotations

import logging
from typing import Any, List, Optional

from sglang.srt.disaggregation.fork_ending import request_end_cause as end_cause, verdict as table, verdict_wording
from sglang.srt.disaggregation.fork_ending.room_frames import parsed_cause, split_abort
from sglang.srt.disaggregation.fork_ending import room_ledger  # drop_unowned_room through it: a pair test gates it
from sglang.srt.disaggregation.fork_ending.room_ledger import (ATTR, DECODE_LEDGERS, RoomLedger, has_room_tables,
                                                               ledger_for, ledger_of)
from sglang.srt.disaggregation.fork_ending.room_reads import handles_aborts
from sglang.srt.disaggregation.fork_ending.room_threads import attached, attaching, concluded, recompute_failing, \
    recomputing
from sglang.srt.disaggregation.fork_ending.room_transitions import Transition
from sglang.srt.disaggregation.fork_ending.teller import ENDED_ON_PREFILL, tell_prefill, told_in
from sglang.srt.disaggregation.fork_ending.verdict import with_why
from sglang.srt.disaggregation.fork_ending.verdict_rows import Told
from sglang.srt.disaggregation.fork_ending.verdict_wording import DECODE_ABORT_REASON
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.managers.fork_core import fork_touch
from sglang.srt.managers.fork_core.fork_touch import upstream

logger = logging.getLogger(__name__)


def on_manager_init(mgr: Any, queue_: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER each PD queue's `_init_kv_manager`: the ledger; prefill: its ABORT handler (SWAPS)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    ledger = mgr.__dict__[ATTR] = RoomLedger(mgr)  # a new manager each call (upstream's role switch too)
    if has_room_tables(mgr) and upstream(mgr, "disaggregation_mode") == DisaggregationMode.PREFILL:
        fork_touch.swap(mgr, "_handle_abort_notification",
                        lambda original: lambda msg: handle_abort(ledger, original, msg), by=__name__)
    elif has_room_tables(mgr):
        DECODE_LEDGERS.add(ledger)


def handle_abort(ledger: RoomLedger, original: Any, msg: List[bytes]) -> bool:
    """Decode's ABORT (bootstrap thread), before upstream's: cancels a room not created yet, else records why."""
    from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification

    mgr = ledger.mgr
    if msg and msg[0] == ABORT_TAG and len(msg) >= 4 and msg[2] == ENDED_ON_PREFILL:
        _ended_on_prefill(ledger, int(msg[1].decode("ascii")), msg[3].decode("utf-8", "replace"), told_in(msg, 4))
        return True
    why = told = None
    if msg and msg[0] == ABORT_TAG:
        msg, why, told = split_abort(msg)
    note = AbortNotification.from_zmq(msg) if msg and msg[0] == ABORT_TAG else None
    kept = False
    if note is not None:
        room = note.room
        peer = f"{note.decode_ip}:{note.decode_port}" if note.decode_ip else "(unknown)"
        kept = ledger.note_abort(room, peer, why, told)
        if kept:  # decode's handshake may have created it, though no sender owns it
            room_ledger.drop_unowned_room(mgr, room)
        if mgr.request_status.get(room) not in (None, KVPoll.Success):
            # re-checked under the failure lock: a room cleared meanwhile gets no record back, a recorded one keeps it
            room_ledger.write_failure(mgr, room, with_why(DECODE_ABORT_REASON.format(room=room), why), told,
                                      replace=False)
    handled = original(msg)
    if kept and note.room in mgr.request_status:
        ledger.drop_cancel(note.room)  # the sender appeared meanwhile; upstream failed it
    return handled


def on_prefill_create_sender(result: Any, queue_: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER `PrefillBootstrapQueue.create_sender`: a room decode already ended fails at once."""
    mgr, ledger = queue_.kv_manager, ledger_of(queue_.kv_manager)
    if not result or ledger is None or req.bootstrap_room is None or not handles_aborts(mgr):
        return
    claimed = ledger.claim(req.bootstrap_room, req.disagg_kv_sender)
    if claimed is not None:
        reason, told = claimed
        logger.info("room_ledger: %s (rid=%s)", reason, req.rid)
        # the ABORT handler may have dropped the room the sender had just opened
        mgr.request_status.setdefault(req.bootstrap_room, KVPoll.Bootstrapping)
        ledger.make(Transition.FAIL_UNTOLD, req.bootstrap_room, reason, told=told)


def on_sender_clear(result: Any, sender: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `CommonKVSender.clear`: a room this prefill failed is remembered as ended."""
    ledger_of(sender.kv_mgr).disown(sender.bootstrap_room, sender, sender.conclude_state == KVPoll.Failed)


def after_receiver_clear(result: Any, receiver: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `CommonKVReceiver.clear` (decode's scheduler): a room whose request concluded Success has no reader for a
    failure record any more (only `failure_exception` pops one). A Failed status prefill sent after its Success (an
    abort on prefill as the transfer ended) can be written between decode's poll seeing Success and this clear: it
    goes with the room. One written after the clear `around_record_failure` drops."""
    if receiver.conclude_state == KVPoll.Success and has_room_tables(receiver.kv_mgr):
        room_ledger.forget_failure_if_cleared(receiver.kv_mgr, receiver.bootstrap_room)


def around_update_status(original, mgr, bootstrap_room, status, *args, **kwargs):
    """AROUND CommonKVManager.update_status: a late handshake for an ended room is answered Failed; a room a
    `concluding` conclusion fails has the cause kept with its record told first (its Failed status follows)."""
    ledger, current = ledger_of(mgr), mgr.request_status.get(bootstrap_room)
    if status == KVPoll.Failed and ledger is not None and concluded.room == bootstrap_room:
        told, targets = ledger.told_with(bootstrap_room), concluded.targets
        concluded.room = None  # once
        if told is not None:
            ledger.tell_cause(mgr._room_notify_targets(bootstrap_room) if targets is None else targets,
                              bootstrap_room, told)
    late = status == KVPoll.WaitingForInput and ledger is not None and ledger.ended and current in (None, KVPoll.Failed)
    answer = ledger.late(bootstrap_room, pop=current is None) if late else None
    if answer is None:
        return original(mgr, bootstrap_room, status, *args, **kwargs)
    reason, told = answer
    targets = mgr._room_notify_targets(bootstrap_room)
    result = None if current is None else original(mgr, bootstrap_room, status, *args, **kwargs)
    if current is None:
        mgr.transfer_infos.pop(bootstrap_room, None)
        mgr.req_to_decode_prefix_len.pop(bootstrap_room, None)
    ledger.make(Transition.ANSWER_LATE, bootstrap_room, reason, targets=targets, told=told)
    return result


def around_record_failure(original, mgr, bootstrap_room, failure_reason, *args, **kwargs):
    """AROUND CommonKVManager.record_failure: none for a cleared room (decode), over a peer loss, over a reason that
    came with its cause when this one comes without, or, as upstream's bare abort reason, over any reason
    (`verdict.kept_over`); tags our loss. On decode a record written while the scheduler cleared the room (checked
    without the failure lock, as upstream's `apply_prefill_status` does) is dropped again
    (`room_ledger.forget_failure_if_cleared`)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    decode = upstream(mgr, "disaggregation_mode") == DisaggregationMode.DECODE
    if decode:
        if bootstrap_room not in mgr.request_status:
            logger.debug("room_ledger: dropping failure for ended room %s: %s", bootstrap_room, failure_reason)
            return None
        if verdict_wording.is_lost_peer(failure_reason):
            end_cause.tag(mgr, bootstrap_room, end_cause.PEER_FAILURE)
    new, ledger, current = failure_reason or "", ledger_of(mgr), mgr.failure_records.get(bootstrap_room)
    current_told = bool(current) and ledger is not None and ledger.told_with(bootstrap_room) is not None
    if table.kept_over(current, new, current_told, attached.told is not None):
        return None
    if verdict_wording.is_bare_abort(new) and recomputing.reason:
        failure_reason = recomputing.reason  # the re-send's failure, not a client's abort
    if ledger is None:
        result = original(mgr, bootstrap_room, failure_reason, *args, **kwargs)
    else:
        # upstream's record_failure takes the failure lock itself: the old record's cause goes first (a reader
        # meanwhile finds none and reads the text), the new record's cause is kept once it is written
        with mgr.failure_lock:
            ledger.keep_told(bootstrap_room, None)
        result = original(mgr, bootstrap_room, failure_reason, *args, **kwargs)
        with mgr.failure_lock:
            if mgr.failure_records.get(bootstrap_room) == failure_reason:
                ledger.keep_told(bootstrap_room, attached.told, failure_reason)
    if decode:
        room_ledger.forget_failure_if_cleared(mgr, bootstrap_room)
    return result


def around_parse_kv_status_message(original, mgr, msg, *args, **kwargs):
    """AROUND CommonKVManager.parse_kv_status_message (decode's bootstrap thread): prefill's `PEER_CAUSE` message is
    the fork's, announcing the cause of that rank's next Failed status of the room; anything else is upstream's."""
    cause = parsed_cause(msg)
    if cause is None:
        return original(mgr, msg, *args, **kwargs)
    room, rank, told = cause
    ledger = ledger_of(mgr)
    if room is not None and ledger is not None:
        ledger.announce(room, rank, told)
    return None


def around_apply_prefill_status(original, mgr, *args, bootstrap_room=None, status=None, prefill_rank=None, **kwargs):
    """AROUND CommonKVManager.apply_prefill_status (decode's bootstrap thread): the cause prefill announced for this
    Failed status is kept with the failure record it writes (around_record_failure); without one (a prefill of an
    older build, stock upstream) the record's text is what the verdict reads."""
    ledger = ledger_of(mgr)
    told = ledger.announced_for(bootstrap_room, prefill_rank) if ledger is not None else None
    with attaching(told if status == KVPoll.Failed else None):
        return original(mgr, *args, bootstrap_room=bootstrap_room, status=status, prefill_rank=prefill_rank, **kwargs)


def around_fail_prefill_recompute(original, mgr, kv_receiver, reason, *args, **kwargs):
    """AROUND CommonKVManager._fail_prefill_recompute (decode: a retract's re-send to prefill failed): the abort's
    record is `reason` from the start, never a client abort (why: docs/pause-release-resume.md)."""
    with recompute_failing(reason):
        return original(mgr, kv_receiver, reason, *args, **kwargs)


def _ended_on_prefill(ledger: "RoomLedger", room: int, reason: str, told: Optional[Told]) -> None:
    """Bootstrap thread: answer decode's handshake for a room prefill ended, now or when it lands, with `reason` and
    its cause `told` (the ENDED_ON_PREFILL frames')."""
    with ledger.lock:
        if ledger.owns(room):  # a live sender owns the number: not this request's room
            return
    targets = ledger.mgr._room_notify_targets(room)
    if targets:
        ledger.make(Transition.CANCEL_AND_TELL, room, reason, targets=targets, told=told)
    else:
        ledger.make(Transition.CANCEL_BEFORE_CREATE, room, reason, told=told)
    if targets:
        room_ledger.drop_unowned_room(ledger.mgr, room)
    logger.info("room_ledger: room %s ended on prefill before its scheduler saw it (%s); decode %s",
                room, reason, "told" if targets else "will be told at its handshake")


def after_ensure_abort_notified(result: Any, receiver: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `CommonKVReceiver.ensure_abort_notified` (decode): prefill is told of a room ended before its rank
    endpoints were known (once); a drain ack armed for the room is owed by that prefill (its loss settles it)."""
    addr = upstream(receiver, "bootstrap_addr")
    mgr = receiver.kv_mgr
    ledger = ledger_for(mgr)
    if not (receiver.abort_notified or getattr(receiver, "bootstrap_infos", None) is not None  # set lazily
            or not upstream(receiver, "_owns_bootstrap_room")) and ledger.told_prefill_early(receiver):
        host, _, port = str(addr).rpartition(":")
        tell_prefill(host.strip("[]"), int(port), receiver.bootstrap_room,
                     "ended on decode before prefill's info was fetched")
        return
    lost = ledger.peer_lost  # decode_side_monitor (RoomLedger.watch_peers)
    generation, room = upstream(receiver, "_abort_generation"), receiver.bootstrap_room
    if lost is None or generation is None or room not in mgr._deferred_abort_ack_tracker:
        return
    ledger.note_drain(room, addr, generation, len(receiver.bootstrap_infos or ()))
    if lost(addr):  # lost already, or meanwhile (settle_peer may have run)
        ledger.settle_peer(addr)
