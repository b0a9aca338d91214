"""How the pause and a release answer what they end (docs/pause-release-resume.md): their messages, the verdict a
request an abort reached keeps, decode's "why" for prefill, the rooms prefill ends. The pause's components import
this module: `scheduler_pause`, `queue_buffers` (scheduler thread), `engine_pause_state`, `pause_gate`,
`tokenizer_pause`, `resend_wait` (the tokenizer's event loop); docs/layout.md lists each with its thread and lock.

Its one per-room table, `_why` (decode: room -> the pause's or release's message its ABORT carries, and until when),
is this module's, not the room ledger's: it is written by the scheduler's abort (`note_why`, which alone knows the
pause's message) and read by the AROUND hook on upstream's `AbortNotification.to_zmq` (`abort_notification_with_why`,
on the thread sending the ABORT), which holds the room number but no kv manager, so no ledger to look in (a lookup by
room across the process's decode ledgers would pick the wrong one with two decode managers in a process). Lock:
`_why_lock`, a leaf; clock: the engine clock, as the ledger's (a pause does not count); bounded by `MAX_WHY_ROOMS`
and shown in the resource report (`why_table`, `fork_tables.pause_why`)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Dict, List

from sglang.srt.disaggregation.fork_ending import pd_queues, room_frames, room_ledger, verdict
from sglang.srt.disaggregation.fork_ending.room_transitions import Transition
from sglang.srt.disaggregation.fork_ending.engine_clock import engine_clock
# the pause's messages and answer: the verdict's
from sglang.srt.disaggregation.fork_ending.verdict import pause_finish_reason
from sglang.srt.disaggregation.fork_ending.verdict_wording import (PAUSE_ABORT_MESSAGE, RELEASE_ABORT_MESSAGE,
                                                                   RELEASE_NO_PAUSE_MESSAGE)
from sglang.srt.managers.fork_core import fork_touch
from sglang.srt.managers.fork_core.bounded import Cap, entry
from sglang.srt.managers.schedule_batch import FINISH_ABORT

logger = logging.getLogger(__name__)


def end_prefill_rooms(scheduler, reqs: List[Any], reason: str) -> None:
    """Prefill requests the pause path ended (held nowhere now): their room is cleared (upstream's retire paths
    leave it) and remembered as ended, so decode's late handshake or re-bootstrap of it is Failed with `reason`."""
    held = {id(r) for r in pd_queues.held_reqs(scheduler)}
    mgr = scheduler.disagg_prefill_bootstrap_queue.kv_manager
    for req in reqs:
        sender = fork_touch.upstream(req, "disagg_kv_sender")
        room = req.bootstrap_room
        if sender is None or id(req) in held or room is None:
            continue
        room_ledger.end_room(mgr, Transition.RETIRE_HELD, room, reason.format(room=room), sender=sender,
                             told=verdict.told_for_ended_room(reason))


def keep_abort_verdict(scheduler, recv_req) -> None:
    """A running request an abort reached answers the verdict it was marked with (room_scheduler_hooks.
    before_abort_request),
    not upstream's bare FINISH_ABORT() ("Aborted"): the pause's or a release's message (each repeat of the
    abort-mode pause's abort_all sets the bare one again), or the client's ("Aborted by the client.", docs/aborts.md).
    Which answer: verdict.abort_answer."""
    for req in scheduler.collect_inflight_reqs():
        if isinstance(req.to_finish, FINISH_ABORT):
            answer = verdict.abort_answer(req, recv_req, _matches(recv_req, req.rid))
            if answer is not None:
                req.to_finish = FINISH_ABORT(*answer)


def pause_answer_kept(scheduler, abort_req, req, *args, **kwargs) -> None:
    """BEFORE Scheduler.send_abort_output: a queued request the pause or a release already ended keeps that
    message when a later bare abort_all (the abort-mode pause repeats it) answers it."""
    if abort_req.finished_reason is not None or pd_queues.role(scheduler) is None:
        return
    message = verdict.kept_pause_answer(req)
    if message is not None:
        abort_req.finished_reason = pause_finish_reason(message)


def _matches(recv_req, rid: str) -> bool:
    return recv_req.abort_all or rid.startswith(recv_req.rid)


# ----------------------------------------------------------------------------- why, to prefill

# room -> (message, until) decode's ABORT of a room its pause or a release ended carries (room_frames.abort_frames)
# (docs/pause-release-resume.md): set by the scheduler, read by the thread sending the ABORT; only for WHY_TTL_S on
# the engine clock (a room re-bootstrapped after a retract pause and aborted later by its client must not carry it;
# a pause does not count), then dropped (at the next note or report).
WHY_TTL_S = 30.0
MAX_WHY_ROOMS = Cap(4096, f"the rooms one pause or release ends within {WHY_TTL_S:g} s: far above a server's queues")
_why: "OrderedDict[int, tuple]" = OrderedDict()
_why_lock = threading.Lock()


def note_why(scheduler, recv_req) -> None:
    """Decode: the ABORT of each queued room an abort naming the pause or a release reaches carries its message."""
    message = verdict.pause_message(getattr(recv_req, "finished_reason", None))
    if message is None:
        return
    until = engine_clock.now() + WHY_TTL_S
    with _why_lock:
        _expire_why()
        for stage, req in pd_queues.walk(scheduler):  # prealloc, transfer, then running (not queued)
            room = req.bootstrap_room
            if stage != pd_queues.DECODE_RUNNING and room is not None and _matches(recv_req, req.rid):
                _why.pop(room, None)
                _why[room] = (message, until)
        while len(_why) > MAX_WHY_ROOMS:
            _why.popitem(last=False)


def abort_notification_with_why(original, note, *args, **kwargs):
    """AROUND AbortNotification.to_zmq (decode's ABORT): the message of the pause that ended the room and the
    cause prefill answers by (room_frames.abort_frames: its pause, else an abort)."""
    frames = original(note, *args, **kwargs)
    with _why_lock:
        message, until = _why.get(note.room, (None, 0.0))
    return room_frames.abort_frames(frames, message if message is not None and engine_clock.now() <= until else None)


def _expire_why() -> None:
    """Drop the messages past their time (caller holds `_why_lock`; `until` grows in insertion order)."""
    now = engine_clock.now()
    while _why and next(iter(_why.values()))[1] < now:
        _why.popitem(last=False)


def why_table() -> Dict[str, Any]:
    """The resource report's view of `_why` (`fork_tables`)."""
    with _why_lock:
        _expire_why()
        return entry(len(_why), MAX_WHY_ROOMS,
                     f"rooms a pause or release ended whose ABORT carries its message ({WHY_TTL_S:g} s, engine clock)",
                     memory=True)
