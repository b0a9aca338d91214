"""Aborts that reach a paused engine are answered during the pause.

While a PD scheduler is paused an abort is answered in the call that delivers it, wherever
the request sits, and what it held is returned; for `ABORT_PUMP_WINDOW_S` the paused loop
keeps retiring what concludes late. A request the pause or a release ended keeps that
abort's message, on both sides (decode's ABORT carries it to prefill). Scheduler thread:
hooks in fork_plugin.HOOKS (docs/pause-release-resume.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import List

from sglang.srt.disaggregation import pd_queues
from sglang.srt.managers import fork_touch, pd_pause

logger = logging.getLogger(__name__)

ABORT_PUMP_WINDOW_S = 5.0


def abort_while_paused(original, scheduler, recv_req, *args, **kwargs):
    """AROUND Scheduler.abort_request: while paused, answer the abort now, wherever
    the request sits, and return what it held."""
    sp = pd_pause.scheduler_pause(scheduler)
    role = pd_queues.role(scheduler)
    if role == "decode":
        note_why(scheduler, recv_req)
    if not getattr(scheduler, "_engine_paused", False) or role is None or sp.pumping or sp.draining:
        result = original(scheduler, recv_req, *args, **kwargs)
        if role is not None:
            keep_pause_verdict(scheduler, recv_req)
        return result
    places = {stage for stage, r in pd_queues.walk(scheduler) if _matches(recv_req, r.rid)}
    places |= {"parked" for r in pd_queues.parked_reqs(scheduler) if _matches(recv_req, r.rid)}
    matched = [r for r in pd_queues.held_reqs(scheduler) if _matches(recv_req, r.rid)]
    logger.info("pd_pause: abort while paused (rid=%r, all=%s) found in %s",
                recv_req.rid, recv_req.abort_all, sorted(places))
    result = original(scheduler, recv_req, *args, **kwargs)
    sp.pump_until = time.monotonic() + ABORT_PUMP_WINDOW_S
    if _holds_in_batch(scheduler, recv_req):
        # An in-place pause holds the last batch as it was: on decode the running
        # requests with their KV, on prefill the forward whose result is not processed
        # yet (overlap). Upstream would answer their abort only after the next pass.
        # Its retract path settles them now: decode's others re-bootstrap on continue,
        # prefill's pending result is processed (the aborted request is retired before
        # its KV is exposed, the others go on to the inflight queue).
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        mode = sp.mode
        scheduler.pause_generation(PauseGenerationReqInput(mode="retract"))
        sp.mode = mode
    if role == "decode":
        _abort_held_rebootstrap(scheduler, recv_req)
    keep_pause_verdict(scheduler, recv_req)
    pd_pause.pump_pd_queues(scheduler)
    if role == "prefill":
        pd_pause.end_prefill_rooms(
            scheduler, matched, "Aborted by AbortReq while prefill was paused (room {room})"
        )
    return result


def keep_pause_verdict(scheduler, recv_req=None) -> None:
    """A running request the pause or a release ended (its verdict,
    `room_ledger.REQUESTED_ABORT`, names it) ends with that message, not upstream's bare
    FINISH_ABORT() that each repeat of the abort-mode pause's abort_all sets again. A
    request in flight the verdict marking did not see (decode's last batch: admitted as
    the pause's abort landed) gets the verdict of `recv_req` when that is the pause's."""
    from sglang.srt.disaggregation import request_end_cause
    from sglang.srt.disaggregation.room_ledger import REQUESTED_ABORT
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    asked = _pause_message(recv_req)
    for req in scheduler.collect_inflight_reqs():
        verdict = getattr(req, REQUESTED_ABORT, None)
        pending = req.to_finish
        if not isinstance(pending, FINISH_ABORT):
            continue
        if verdict is None and asked is not None and pending.status_code is None and _matches(recv_req, req.rid):
            verdict = (asked, None)
            setattr(req, REQUESTED_ABORT, verdict)
            request_end_cause.tag_req(req, request_end_cause.PAUSE)
        if verdict is not None and pd_pause.names_pause(verdict[0]) and pending.message != verdict[0]:
            req.to_finish = FINISH_ABORT(verdict[0], verdict[1])


def _pause_message(recv_req) -> "str | None":
    """The message of an abort the pause or a release sent (no error status), or None."""
    reason = getattr(recv_req, "finished_reason", None) or {}
    message = reason.get("message")
    if reason.get("status_code") is None and pd_pause.names_pause(message):
        return message
    return None


def pause_answer_kept(scheduler, abort_req, req, *args, **kwargs) -> None:
    """BEFORE Scheduler.send_abort_output: upstream answers a queued request a later
    abort reaches with that abort's reason, none for the bare abort_all the abort-mode
    pause repeats (the tokenizer then says "Abort in waiting queue"). A request the
    pause or a release already ended keeps that message."""
    from sglang.srt.disaggregation.room_ledger import PAUSE_ABORT, REQUESTED_ABORT

    if abort_req.finished_reason is not None or pd_queues.role(scheduler) is None:
        return None
    verdict = getattr(req, REQUESTED_ABORT, None)
    message = verdict[0] if verdict is not None and verdict[1] is None else getattr(req, PAUSE_ABORT, None)
    if message is not None and pd_pause.names_pause(message):
        abort_req.finished_reason = pd_pause.pause_finish_reason(message)
    return None


def paused_loop_tick(result, scheduler, *args, **kwargs):
    """AFTER Scheduler._record_scheduler_state_for_paused_engine (every iteration of
    a paused event loop): for a while after an abort, keep retiring what it failed,
    so rooms that conclude a moment later (drain acks) are answered during the
    pause too; otherwise wait for input instead of spinning (`wait_for_input_while_paused`)."""
    sp = pd_pause.scheduler_pause(scheduler)
    if pd_queues.role(scheduler) is None:
        return result
    if not sp.released and sp.pump_until and time.monotonic() < sp.pump_until:
        pd_pause.pump_pd_queues(scheduler)
        return result
    sp.pump_until = 0.0
    wait_for_input_while_paused(scheduler)
    return result


# Upstream's paused loop polls its input sockets without blocking, so a paused PD
# scheduler spun a core for the whole pause (and in abort mode, which upstream never
# tells the scheduler, the fork's pause made it spin where upstream's slept): on 2
# shared cores the HTTP processes answering the paused requests, the peer server and
# the weight load waited for that core (bench/README.md). With nothing to pump, the
# paused loop now waits on the same sockets upstream's idle sleeper waits on (any
# request, continue_generation or an abort wakes it at once), at most this long.
PAUSED_INPUT_WAIT_MS = 50


def wait_for_input_while_paused(scheduler) -> None:
    """Block until the scheduler's input sockets have a request, at most
    PAUSED_INPUT_WAIT_MS, through upstream's idle sleeper (--sleep-on-idle; without it
    the loop spins as upstream's does)."""
    from sglang.srt.managers.scheduler_components.idle_sleeper import IdleSleeper

    sleeper = fork_touch.upstream(scheduler, "idle_sleeper")
    if isinstance(sleeper, IdleSleeper):  # zmq sockets (not the Rust server's ring)
        fork_touch.upstream(sleeper, "poller").poll(PAUSED_INPUT_WAIT_MS)


def _holds_in_batch(scheduler, recv_req) -> bool:
    """The abort hits a request only the next forward pass would retire: decode's
    running batch, or prefill's last batch while its result is still unprocessed."""
    if pd_queues.role(scheduler) == "prefill":
        batch = scheduler.last_batch
        if batch is None or not scheduler.enable_overlap or not scheduler.result_queue:
            return False
        reqs = list(batch.reqs)
    else:
        reqs = list(scheduler.running_batch.reqs)
        if scheduler.last_batch is not None:
            reqs += list(scheduler.last_batch.reqs)
    return any(_matches(recv_req, r.rid) for r in reqs)


def _matches(recv_req, rid: str) -> bool:
    return recv_req.abort_all or rid.startswith(recv_req.rid)


def _abort_held_rebootstrap(scheduler, recv_req) -> None:
    """Requests a retract pause holds for re-bootstrap own no KV; answer them."""
    from sglang.srt.disaggregation.utils import prepare_abort
    from sglang.srt.managers.scheduler import _make_abort_req

    prealloc = scheduler.disagg_decode_prealloc_queue
    kept = []
    for req in prealloc.held_rebootstrap_reqs:
        if _matches(recv_req, req.rid):
            prepare_abort(req, "Aborted by AbortReq.")
            scheduler.send_abort_output(
                _make_abort_req(req, finished_reason=recv_req.finished_reason), req
            )
        else:
            kept.append(req)
    prealloc.held_rebootstrap_reqs = kept


# ----------------------------------------------------------------------------- why, to prefill

# Decode appends [room_ledger.WHY_FRAME, message] to the ABORT of a room its pause or a
# release ended (upstream's names only the room); prefill's ABORT handler strips them. room
# -> (message, until): set by the scheduler, read by whichever thread sends the ABORT; bounded,
# and only for WHY_TTL_S (a room re-bootstrapped after a retract pause and aborted later by
# its client must not carry the pause's message).
MAX_WHY_ROOMS = 4096
WHY_TTL_S = 30.0
_why: "OrderedDict[int, tuple]" = OrderedDict()
_why_lock = threading.Lock()


def note_why(scheduler, recv_req) -> None:
    """Decode, before upstream handles an abort that names the pause or a release: the
    ABORT of each room it reaches in the PD queues will carry the abort's message."""
    message = _pause_message(recv_req)
    if message is None:
        return
    prealloc = scheduler.disagg_decode_prealloc_queue
    transfer = scheduler.disagg_decode_transfer_queue
    until = time.monotonic() + WHY_TTL_S
    with _why_lock:
        for entry in list(prealloc.queue) + list(transfer.queue):
            room = entry.req.bootstrap_room
            if room is not None and _matches(recv_req, entry.req.rid):
                _why.pop(room, None)
                _why[room] = (message, until)
        while len(_why) > MAX_WHY_ROOMS:
            _why.popitem(last=False)


def abort_notification_with_why(original, note, *args, **kwargs):
    """AROUND AbortNotification.to_zmq (decode's ABORT to prefill): append the message
    of the pause or release that ended the room, if one did."""
    frames = original(note, *args, **kwargs)
    if not _why:
        return frames
    with _why_lock:
        message, until = _why.get(note.room, (None, 0.0))
    if message is None or time.monotonic() > until:
        return frames
    from sglang.srt.disaggregation.room_ledger import WHY_FRAME

    return list(frames) + [WHY_FRAME, message.encode("utf-8")]
