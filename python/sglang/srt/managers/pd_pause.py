"""The scheduler side of pause/release/resume with PD requests in flight (scheduler thread: hooks in
fork_plugin.HOOKS and the decode patch's `poll_transfers_while_retracted`).

At release what runs is retracted and what sits in the PD queues is aborted through upstream's own retire paths
until the queues are empty, before `queue_memory` deregisters their buffers; paused time counts against no timer
(`engine_clock`). An abort that reaches a paused engine is answered in the call that delivers it, wherever the
request sits; a request the pause or a release ended keeps that abort's message, on both sides.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional

from sglang.srt.disaggregation import pd_queues, room_ledger
from sglang.srt.managers import fork_touch
from sglang.srt.managers.engine_clock import engine_clock

logger = logging.getLogger(__name__)

RELEASE_ABORT_MESSAGE = "Aborted: engine memory released during pause (mode={mode})."
RELEASE_NO_PAUSE_MESSAGE = "Aborted: engine memory released without a pause."
PAUSE_ABORT_MESSAGE = "Aborted by pause_generation(mode=abort)."
DRAIN_DEADLINE_S = 10.0
ABORT_PUMP_WINDOW_S = 5.0  # after an abort while paused, the paused loop keeps retiring what concludes late

# Start times (time.time()) that upstream's transfer senders/receivers measure their
# bootstrap and waiting timeouts from (disaggregation/common/conn.py).
UPSTREAM_TIMER_ATTRS = ("init_time", "_prefill_complete_time", "_prefill_wait_start")


def names_pause(message) -> bool:
    """Whether an abort's message says a pause or a release ended the request (end cause "pause")."""
    return any(m in str(message or "") for m in room_ledger.PAUSE_MARKERS)


def pause_finish_reason(message: str = PAUSE_ABORT_MESSAGE) -> Dict[str, Any]:
    """Upstream's abort answer (200, finish_reason abort with the message, no status) for an end the pause decides."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return FINISH_ABORT(message, None).to_json()


class _SchedulerPause:
    """Per-scheduler bookkeeping of the pause (one per scheduler process)."""

    def __init__(self):
        self.mode: Optional[str] = None
        self.pumping = False
        self.draining = False  # inside _abort_all_and_drain
        self.released = False  # PD queues released (KV buffers deregistered)
        self.pump_until = 0.0  # keep pumping the paused loop until (monotonic)


def scheduler_pause(scheduler) -> _SchedulerPause:
    if not hasattr(scheduler, "_fork_pd_pause"):
        scheduler._fork_pd_pause = _SchedulerPause()
    return scheduler._fork_pd_pause


def scheduler_pause_generation(original, scheduler, recv_req):
    """AROUND Scheduler.pause_generation: accept mode 'abort' and stop the clock."""
    sp = scheduler_pause(scheduler)
    if recv_req.mode == "abort":
        # The tokenizer already ended every request; end stragglers, then hold.
        scheduler._engine_paused = True
        if scheduler._pause_started_at is None:
            scheduler._pause_started_at = time.monotonic()
        _abort_all_and_drain(scheduler, PAUSE_ABORT_MESSAGE)
        _drop_finished_batches(scheduler)
    else:
        original(scheduler, recv_req)
    if sp.mode is None or recv_req.mode == "retract":
        sp.mode = recv_req.mode
    engine_clock.pause()


def _drop_finished_batches(scheduler) -> None:
    """Empty the running / last batch if all its requests finished (as upstream's filter does when it builds
    its next batch, which a paused scheduler never does): a weight update's cache flush would find it busy."""
    for batch in (scheduler.running_batch, scheduler.last_batch):
        if batch is not None and batch.reqs and all(req.finished() for req in batch.reqs):
            batch.filter_batch()


def scheduler_continue_generation(result, scheduler, recv_req, *args, **kwargs):
    """AFTER Scheduler.continue_generation: restart the clock, shift upstream timers by the paused time."""
    scheduler_pause(scheduler).mode = None
    shift_upstream_timers(scheduler, engine_clock.resume())


def shift_upstream_timers(scheduler, paused_seconds: float) -> int:
    """Move upstream's start times forward by the paused time: live transfers' bootstrap/waiting timeouts skip it."""
    shifted = 0
    if paused_seconds <= 0:
        return shifted
    for endpoint in pd_queues.transfer_endpoints(scheduler):
        for attr in UPSTREAM_TIMER_ATTRS:
            value = getattr(endpoint, attr, None)
            if isinstance(value, (int, float)):
                setattr(endpoint, attr, value + paused_seconds)
                shifted += 1
    return shifted


def _pd_queues_empty(scheduler) -> bool:
    role = pd_queues.role(scheduler)
    if role == "decode":
        transfer = scheduler.disagg_decode_transfer_queue
        return (
            not scheduler.disagg_decode_prealloc_queue.queue
            and not transfer.queue
            and not any(r.kv.holds_kv for r in scheduler.waiting_queue)
            # Aborted transfers hold their KV until prefill acks the drain.
            and not transfer.has_pending_deferred_releases()
        )
    # prefill: bootstrap, waiting and inflight queues, chunked request
    return role is None or not pd_queues.queued_reqs(scheduler)


def pump_pd_queues(scheduler) -> None:
    """One pass of upstream's own PD queue processing while the event loop is held: failed (aborted) rooms are
    retired with their resources, finished transfers move on. Idempotent; safe to call while paused."""
    sp = scheduler_pause(scheduler)
    if sp.pumping:
        return
    sp.pumping = True
    try:
        role = pd_queues.role(scheduler)
        if role == "prefill":
            scheduler.process_pending_chunked_abort()
            bootstrapped = scheduler.disagg_prefill_bootstrap_queue.pop_bootstrapped()
            scheduler.waiting_queue.extend(bootstrapped)
            if scheduler.disagg_prefill_inflight_queue:
                scheduler.process_disagg_prefill_inflight_queue()
        elif role == "decode":
            prealloc = scheduler.disagg_decode_prealloc_queue
            transfer = scheduler.disagg_decode_transfer_queue
            if prealloc.queue and not prealloc.retracted_queue:
                req_conns, _ = prealloc.pop_preallocated()
                transfer.extend(req_conns)
            if transfer.queue:
                scheduler.waiting_queue.extend(transfer.pop_transferred())
            transfer.resolve_deferred_releases()
    finally:
        sp.pumping = False


def _abort_all_and_drain(scheduler, message: str) -> None:
    """Abort everything in the PD queues and pump until upstream has retired it."""
    from sglang.srt.managers.io_struct import AbortReq

    reason = pause_finish_reason(message)
    deadline = time.monotonic() + DRAIN_DEADLINE_S
    sp = scheduler_pause(scheduler)
    sp.draining = True
    ended: Dict[int, Any] = {}
    try:
        while True:
            for req in pd_queues.queued_reqs(scheduler):
                setattr(req, room_ledger.PAUSE_ABORT, message)
                ended[id(req)] = req
            scheduler.abort_request(AbortReq(abort_all=True, finished_reason=reason))
            pump_pd_queues(scheduler)
            if _pd_queues_empty(scheduler) or time.monotonic() > deadline:
                break
            time.sleep(0.005)
    finally:
        sp.draining = False
    if pd_queues.role(scheduler) == "prefill":
        # Remembered as ended: decode's copy may still wait at decode's pause gate
        # (the router delivered it late) and handshake after continue. A re-bootstrap
        # of such a room (same room) then ends on both sides as the release's abort.
        end_prefill_rooms(scheduler, list(ended.values()), message + " (room {room})")
    if not _pd_queues_empty(scheduler):
        logger.warning("pd_pause: PD queues not empty %.0fs after abort_all: %s", DRAIN_DEADLINE_S,
                       pd_queues.lengths(scheduler))


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


def end_in_flight(scheduler) -> None:
    """Before releasing memory: retract what runs (decode re-bootstraps it), abort what sits in the PD queues."""
    from sglang.srt.managers.io_struct import PauseGenerationReqInput

    if pd_queues.role(scheduler) is None:
        return
    sp = scheduler_pause(scheduler)
    paused = sp.mode is not None
    if not fork_touch.upstream(scheduler, "_engine_paused"):
        # Release without a pause (the colocated RL loop; the tokenizer let it through idle and holds new
        # requests at its gate): settle what the queues still hold (decode's pending drain acks); anything
        # that slipped in is retracted/aborted as in a pause, never asserted on.
        idle = scheduler.is_fully_idle(ignore_waiting=False)  # upstream's own idle check
        if idle and _pd_queues_empty(scheduler):
            return
        logger.warning("pd_pause: release without a pause, not idle: %s",
                       not_idle_reasons(scheduler))
        if idle:
            _abort_all_and_drain(scheduler, RELEASE_NO_PAUSE_MESSAGE)
            return
    if (
        not scheduler.running_batch.is_empty()
        or scheduler.last_batch is not None
        or (pd_queues.role(scheduler) == "decode" and scheduler.waiting_queue)
    ):
        # Upstream's retract: frees KV of running requests; decode re-bootstraps them.
        scheduler.pause_generation(PauseGenerationReqInput(mode="retract"))
    _abort_all_and_drain(
        scheduler,
        RELEASE_ABORT_MESSAGE.format(mode=sp.mode) if paused else RELEASE_NO_PAUSE_MESSAGE,
    )


def not_idle_reasons(scheduler) -> List[str]:
    """Which of upstream's is_fully_idle conditions fail (for the log)."""
    checks = {
        "running_batch": not scheduler.running_batch.is_empty(),
        "chunked_req": scheduler.chunked_req is not None,
        "last_batch": scheduler.last_batch is not None
        and not scheduler.last_batch.is_empty(),
        "result_queue": bool(fork_touch.upstream(scheduler, "result_queue")),
        "waiting_with_kv": any(r.kv.holds_kv for r in scheduler.waiting_queue),
        "grammar_queue": bool(scheduler.grammar_manager.grammar_queue),
        "deferred_kv_releases": pd_queues.role(scheduler) == "decode"
        and scheduler.disagg_decode_transfer_queue.has_pending_deferred_releases(),
    }
    reasons = [k for k, v in checks.items() if v]
    reasons += [f"queue.{k}={v}" for k, v in pd_queues.lengths(scheduler).items()
                if v and k not in ("waiting", "running")]
    return reasons


def weight_updater_release(original, weight_updater, recv_req, *args, **kwargs):
    """AROUND WeightUpdater.release_memory_occupation."""
    scheduler = weight_updater.scheduler
    if scheduler is not None:
        end_in_flight(scheduler)
        paused = fork_touch.upstream(scheduler, "_engine_paused")
        if not weight_updater.is_fully_idle(ignore_waiting=paused):
            logger.error("pd_pause: not idle before release: %s", not_idle_reasons(scheduler))
    return original(weight_updater, recv_req, *args, **kwargs)


def report(scheduler) -> Dict[str, Any]:
    return {"paused": bool(fork_touch.upstream(scheduler, "_engine_paused")),
            "mode": scheduler_pause(scheduler).mode, "clock_paused": engine_clock.paused}


def poll_transfers_while_retracted(scheduler) -> list:
    """Decode with retracted requests allocates nothing new, but still retires the transfers in flight
    (finished ones move on, failed/timed-out ones are seen)."""
    transfer = scheduler.disagg_decode_transfer_queue
    return transfer.pop_transferred() if transfer.queue else []


# ----------------------------------------------------------------------------- aborts while paused

def abort_while_paused(original, scheduler, recv_req, *args, **kwargs):
    """AROUND Scheduler.abort_request: while paused, answer the abort now, wherever the request sits."""
    sp = scheduler_pause(scheduler)
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
        # An in-place pause holds the last batch as it was (decode: running requests with their KV;
        # prefill: a forward whose result is unprocessed), answered only after the next pass. Upstream's
        # retract settles it now: decode's others re-bootstrap on continue, prefill's result is processed.
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        mode = sp.mode
        scheduler.pause_generation(PauseGenerationReqInput(mode="retract"))
        sp.mode = mode
    if role == "decode":
        _abort_held_rebootstrap(scheduler, recv_req)
    keep_pause_verdict(scheduler, recv_req)
    pump_pd_queues(scheduler)
    if role == "prefill":
        end_prefill_rooms(scheduler, matched, "Aborted by AbortReq while prefill was paused (room {room})")
    return result


def keep_pause_verdict(scheduler, recv_req=None) -> None:
    """A running request the pause or a release ended (its verdict,
    `room_ledger.REQUESTED_ABORT`, names it) ends with that message, not upstream's bare
    FINISH_ABORT() that each repeat of the abort-mode pause's abort_all sets again. A
    request in flight the verdict marking did not see (decode's last batch: admitted as
    the pause's abort landed) gets the verdict of `recv_req` when that is the pause's."""
    from sglang.srt.disaggregation import request_end_cause
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    asked = _pause_message(recv_req)
    for req in scheduler.collect_inflight_reqs():
        verdict = getattr(req, room_ledger.REQUESTED_ABORT, None)
        pending = req.to_finish
        if not isinstance(pending, FINISH_ABORT):
            continue
        if verdict is None and asked is not None and pending.status_code is None and _matches(recv_req, req.rid):
            verdict = (asked, None)
            setattr(req, room_ledger.REQUESTED_ABORT, verdict)
            request_end_cause.tag_req(req, request_end_cause.PAUSE)
        if verdict is not None and names_pause(verdict[0]) and pending.message != verdict[0]:
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


def paused_loop_tick(result, scheduler, *args, **kwargs):
    """AFTER Scheduler._record_scheduler_state_for_paused_engine (every iteration of
    a paused event loop): for a while after an abort, keep retiring what it failed,
    so rooms that conclude a moment later (drain acks) are answered during the
    pause too; otherwise wait for input instead of spinning (`wait_for_input_while_paused`)."""
    sp = scheduler_pause(scheduler)
    if pd_queues.role(scheduler) is None:
        return result
    if not sp.released and sp.pump_until and time.monotonic() < sp.pump_until:
        pump_pd_queues(scheduler)
        return result
    sp.pump_until = 0.0
    wait_for_input_while_paused(scheduler)
    return result


# Upstream's paused loop polls its input sockets without blocking: a paused PD scheduler spun a core that the
# HTTP processes, the peer and the weight load waited for (bench/README.md). With nothing to pump it now waits
# on the sockets upstream's idle sleeper waits on (a request, continue or an abort wakes it), at most this long.
PAUSED_INPUT_WAIT_MS = 50


def wait_for_input_while_paused(scheduler) -> None:
    """Wait for input at most PAUSED_INPUT_WAIT_MS on upstream's idle sleeper (without one the loop spins)."""
    from sglang.srt.managers.scheduler_components.idle_sleeper import IdleSleeper

    sleeper = fork_touch.upstream(scheduler, "idle_sleeper")
    if isinstance(sleeper, IdleSleeper):  # zmq sockets (not the Rust server's ring)
        fork_touch.upstream(sleeper, "poller").poll(PAUSED_INPUT_WAIT_MS)


def _holds_in_batch(scheduler, recv_req) -> bool:
    """The abort hits what only the next pass would retire: decode's batches, prefill's unprocessed last batch."""
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
            scheduler.send_abort_output(_make_abort_req(req, finished_reason=recv_req.finished_reason), req)
        else:
            kept.append(req)
    prealloc.held_rebootstrap_reqs = kept


# ----------------------------------------------------------------------------- why, to prefill

# Decode appends [room_ledger.WHY_FRAME, message] to the ABORT of a room its pause or a release ended (upstream's
# names only the room); prefill's ABORT handler strips them. room -> (message, until): set by the scheduler, read
# by the thread sending the ABORT; bounded, and only for WHY_TTL_S (a room re-bootstrapped after a retract pause
# and aborted later by its client must not carry the pause's message).
MAX_WHY_ROOMS = 4096
WHY_TTL_S = 30.0
_why: "OrderedDict[int, tuple]" = OrderedDict()
_why_lock = threading.Lock()


def note_why(scheduler, recv_req) -> None:
    """Decode: the ABORT of each queued room an abort naming the pause or a release reaches carries its message."""
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
    """AROUND AbortNotification.to_zmq (decode's ABORT): append the message of the pause that ended the room."""
    frames = original(note, *args, **kwargs)
    if not _why:
        return frames
    with _why_lock:
        message, until = _why.get(note.room, (None, 0.0))
    if message is None or time.monotonic() > until:
        return frames
    return list(frames) + [room_ledger.WHY_FRAME, message.encode("utf-8")]
