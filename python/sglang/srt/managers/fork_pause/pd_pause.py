"""How the pause and a release answer what they end (docs/pause-release-resume.md): their messages, the verdict a
request an abort reached keeps, decode's "why" for prefill, the rooms prefill ends. The pause's components import
this module: `scheduler_pause`, `queue_buffers` (scheduler thread), `engine_pause_state`, `pause_gate`,
`tokenizer_pause`, `resend_wait` (the tokenizer's event loop); docs/layout.md lists each with its thread and lock."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Dict, List

from sglang.srt.disaggregation.fork_ending import pd_queues, request_end_cause, room_ledger
from sglang.srt.managers.fork_core import fork_touch
from sglang.srt.managers.schedule_batch import FINISH_ABORT

logger = logging.getLogger(__name__)

RELEASE_ABORT_MESSAGE = "Aborted: engine memory released during pause (mode={mode})."
RELEASE_NO_PAUSE_MESSAGE = "Aborted: engine memory released without a pause."
PAUSE_ABORT_MESSAGE = "Aborted by pause_generation(mode=abort)."


def names_pause(message) -> bool:
    """Whether an abort's message says a pause or a release ended the request (end cause "pause")."""
    return any(m in str(message or "") for m in room_ledger.PAUSE_MARKERS)


def pause_finish_reason(message: str = PAUSE_ABORT_MESSAGE) -> Dict[str, Any]:
    """Upstream's abort answer (200, finish_reason abort with the message, no status) for an end the pause decides."""
    return FINISH_ABORT(message, None).to_json()


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
        if room in mgr.request_status:
            sender.clear()
            mgr.failure_records.pop(room, None)  # one dict op: atomic
        room_ledger.end_room(mgr, room, None, reason.format(room=room),
                             fail=False, tell=False, remember=True, cancel=True)


# Upstream's FINISH_ABORT() for a running request an AbortReq reached: it names no cause.
BARE_ABORT_MESSAGE = FINISH_ABORT().message


def keep_abort_verdict(scheduler, recv_req) -> None:
    """A running request an abort reached answers the verdict it was marked with (room_ledger.before_abort_request),
    not upstream's bare FINISH_ABORT() ("Aborted"): the pause's or a release's message (each repeat of the
    abort-mode pause's abort_all sets the bare one again), or the client's ("Aborted by the client.", docs/aborts.md).
    One the verdict marking did not see (decode's last batch, admitted as the abort landed) gets `recv_req`'s: the
    pause's, or a client's (by rid, or a bare abort_all: the pause's own are named, tm_abort_request)."""
    asked = _pause_message(recv_req)
    for req in scheduler.collect_inflight_reqs():
        verdict = getattr(req, room_ledger.REQUESTED_ABORT, None)
        pending = req.to_finish
        if not isinstance(pending, FINISH_ABORT):
            continue
        if verdict is None and pending.status_code is None and _matches(recv_req, req.rid):
            if asked is not None:
                verdict, cause = (asked, None), request_end_cause.PAUSE
            elif pending.message == BARE_ABORT_MESSAGE:
                message, status, cause = room_ledger.requested_verdict(recv_req)
                verdict = (message, status)
            if verdict is not None:
                setattr(req, room_ledger.REQUESTED_ABORT, verdict)
                request_end_cause.tag_req(req, cause)
        if verdict is None or pending.message == verdict[0]:
            continue
        if names_pause(verdict[0]) or (pending.message == BARE_ABORT_MESSAGE and pending.status_code is None
                                       and verdict[1] is None):
            req.to_finish = FINISH_ABORT(verdict[0], verdict[1])


def _pause_message(recv_req) -> "str | None":
    """The message of an abort the pause or a release sent (no error status), or None."""
    reason = getattr(recv_req, "finished_reason", None) or {}
    message = reason.get("message")
    return message if reason.get("status_code") is None and names_pause(message) else None


def pause_answer_kept(scheduler, abort_req, req, *args, **kwargs) -> None:
    """BEFORE Scheduler.send_abort_output: a queued request the pause or a release already ended keeps that
    message when a later bare abort_all (the abort-mode pause repeats it) answers it."""
    if abort_req.finished_reason is not None or pd_queues.role(scheduler) is None:
        return
    verdict = getattr(req, room_ledger.REQUESTED_ABORT, None)
    message = verdict[0] if verdict is not None and verdict[1] is None else getattr(req, room_ledger.PAUSE_ABORT, None)
    if message is not None and names_pause(message):
        abort_req.finished_reason = pause_finish_reason(message)


def _matches(recv_req, rid: str) -> bool:
    return recv_req.abort_all or rid.startswith(recv_req.rid)


# ----------------------------------------------------------------------------- why, to prefill

# room -> (message, until) decode's ABORT of a room its pause or a release ended carries after room_ledger.WHY_FRAME
# (docs/pause-release-resume.md): set by the scheduler, read by the thread sending the ABORT; only for WHY_TTL_S (a
# room re-bootstrapped after a retract pause and aborted later by its client must not carry it).
MAX_WHY_ROOMS = 4096
WHY_TTL_S = 30.0
_why: "OrderedDict[int, tuple]" = OrderedDict()
_why_lock = threading.Lock()


def note_why(scheduler, recv_req) -> None:
    """Decode: the ABORT of each queued room an abort naming the pause or a release reaches carries its message."""
    message = _pause_message(recv_req)
    if message is None:
        return
    until = time.monotonic() + WHY_TTL_S
    with _why_lock:
        for stage, req in pd_queues.walk(scheduler):  # prealloc, transfer, then running (not queued)
            room = req.bootstrap_room
            if stage != pd_queues.DECODE_RUNNING and room is not None and _matches(recv_req, req.rid):
                _why.pop(room, None)
                _why[room] = (message, until)
        while len(_why) > MAX_WHY_ROOMS:
            _why.popitem(last=False)


def abort_notification_with_why(original, note, *args, **kwargs):
    """AROUND AbortNotification.to_zmq (decode's ABORT): append the message of the pause that ended the room."""
    frames = original(note, *args, **kwargs)
    with _why_lock:
        message, until = _why.get(note.room, (None, 0.0))
    if message is None or time.monotonic() > until:
        return frames
    return list(frames) + [room_ledger.WHY_FRAME, message.encode("utf-8")]
