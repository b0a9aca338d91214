"""The scheduler side of pause/release/resume with PD requests in flight.

While paused nothing is computed, yet every request is accounted for: at release what runs
is retracted (decode re-bootstraps it on continue) and what sits in the PD queues is
aborted through upstream's own retire paths until the queues are empty, before they
deregister their buffers (`queue_memory`); paused time counts against no timer
(`engine_clock`). Scheduler thread: hooks in fork_plugin.HOOKS and the decode patch
(`poll_transfers_while_retracted`). Aborts that arrive while paused: `pd_pause_aborts`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional

from sglang.srt.disaggregation import pd_queues, room_ledger
from sglang.srt.managers import fork_touch
from sglang.srt.managers.engine_clock import engine_clock

logger = logging.getLogger(__name__)

RELEASE_ABORT_MESSAGE = "Aborted: engine memory released during pause (mode={mode})."
RELEASE_NO_PAUSE_MESSAGE = "Aborted: engine memory released without a pause."
PAUSE_ABORT_MESSAGE = "Aborted by pause_generation(mode=abort)."
DRAIN_DEADLINE_S = 10.0

# Start times (time.time()) that upstream's transfer senders/receivers measure their
# bootstrap and waiting timeouts from (disaggregation/common/conn.py).
UPSTREAM_TIMER_ATTRS = ("init_time", "_prefill_complete_time", "_prefill_wait_start")


def names_pause(message) -> bool:
    """Whether an abort's message says a pause or a release ended the request (end cause
    "pause", never a client abort or a failure)."""
    return any(m in str(message or "") for m in room_ledger.PAUSE_MARKERS)


def pause_finish_reason(message: str = PAUSE_ABORT_MESSAGE) -> Dict[str, Any]:
    """The finish reason of an abort the pause path decides: upstream's abort answer (HTTP
    200, finish_reason "abort" with the message, no status), which RL clients recycle."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return FINISH_ABORT(message, None).to_json()


class _SchedulerPause:
    """Per-scheduler bookkeeping of the pause (one per scheduler process)."""

    def __init__(self):
        self.mode: Optional[str] = None
        self.paused_at_wall: Optional[float] = None
        self.pumping = False
        self.draining = False  # inside _abort_all_and_drain
        self.released = False  # PD queues released (KV buffers deregistered)
        self.pump_until = 0.0  # keep pumping the paused loop until (monotonic)


def scheduler_pause(scheduler) -> _SchedulerPause:
    sp = getattr(scheduler, "_fork_pd_pause", None)
    if sp is None:
        sp = scheduler._fork_pd_pause = _SchedulerPause()
    return sp


def scheduler_pause_generation(original, scheduler, recv_req):
    """AROUND Scheduler.pause_generation: accept mode 'abort' and stop the clock."""
    sp = scheduler_pause(scheduler)
    if recv_req.mode == "abort":
        # The tokenizer already ended every request; end stragglers, then hold.
        scheduler._engine_paused = True
        if scheduler._pause_started_at is None:
            scheduler._pause_started_at = time.monotonic()
        _settle_answered_forward(scheduler)
        _abort_all_and_drain(scheduler, PAUSE_ABORT_MESSAGE)
        _drop_finished_batches(scheduler)
    else:
        original(scheduler, recv_req)
    if sp.mode is None or recv_req.mode == "retract":
        sp.mode = recv_req.mode
    if sp.paused_at_wall is None:
        sp.paused_at_wall = time.time()
    engine_clock.pause()


def _settle_answered_forward(scheduler) -> None:
    """Abort mode with the overlap scheduler: the tokenizer pauses the scheduler once the
    abort answered every request, which happens while processing a forward's result; the
    next forward, launched with the same requests, is still in upstream's result queue
    when the pause can land before the loop's next pass, and a paused loop never
    processes it. The weight update's flush then found the engine busy (400 "Cache not
    flushed because there are pending requests. #queue-req: 0, #running-req: 0";
    `result_queue` in not_idle_reasons). When that forward holds only finished requests,
    process it now, as the loop's next pass would, and forget it as the last batch."""
    results = fork_touch.upstream(scheduler, "result_queue")
    if not scheduler.enable_overlap or not results or scheduler.last_batch is None:
        return
    pending, _ = results[0]
    if len(results) != 1 or not all(req.finished() for req in pending.reqs):
        return  # a live request: the loop settles it after continue, as upstream's would
    batch, result = results.popleft()
    scheduler.process_batch_result(batch, result)
    scheduler.last_batch = None
    logger.info("pd_pause: abort-mode pause settled the forward in flight (%d finished requests)",
                len(batch.reqs))


def _drop_finished_batches(scheduler) -> None:
    """Requests the abort finished (answered, KV freed) can still be listed in the
    running / last batch: upstream drops them when it builds its next batch, which a
    paused scheduler never does, so a weight update's cache flush found the engine busy
    (400 "requests are still running or queued"). A batch whose requests all finished
    is emptied as upstream's own filter does; one with a live request is left alone."""
    for batch in (scheduler.running_batch, scheduler.last_batch):
        if batch is not None and batch.reqs and all(req.finished() for req in batch.reqs):
            batch.filter_batch()


def scheduler_continue_generation(result, scheduler, recv_req, *args, **kwargs):
    """AFTER Scheduler.continue_generation: restart the clock, shift upstream timers."""
    sp = scheduler_pause(scheduler)
    if sp.paused_at_wall is not None:
        shift_upstream_timers(scheduler, time.time() - sp.paused_at_wall)
    sp.paused_at_wall = None
    sp.mode = None
    engine_clock.resume()
    return result


def shift_upstream_timers(scheduler, paused_seconds: float) -> int:
    """Move upstream's recorded start times forward by the paused duration, so the
    bootstrap/waiting timeouts of every live transfer exclude the pause."""
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
    """One pass of upstream's own PD queue processing while the event loop is held:
    failed (aborted) rooms are retired with their resources by upstream's code paths,
    finished transfers move on. Idempotent; safe to call while paused."""
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
        logger.warning(
            "pd_pause: PD queues not empty %.0fs after abort_all: %s",
            DRAIN_DEADLINE_S,
            pd_queues.lengths(scheduler),
        )


def end_prefill_rooms(scheduler, reqs: List[Any], reason: str) -> None:
    """Prefill requests the pause path ended (no longer held anywhere): their room is
    cleared (upstream's waiting-queue and result-retire paths abort the sender but leave
    it) and remembered as ended through the ledger, so decode's handshake still on the
    wire, or its re-bootstrap of the room, is answered Failed with `reason`."""
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
    """Before releasing memory: retract what runs (kept for re-bootstrap on decode),
    abort what sits in the PD queues, and wait until upstream has retired it."""
    from sglang.srt.managers.io_struct import PauseGenerationReqInput

    if pd_queues.role(scheduler) is None:
        return
    sp = scheduler_pause(scheduler)
    paused = sp.mode is not None
    if not fork_touch.upstream(scheduler, "_engine_paused"):
        # Release without a pause (upstream's colocated RL loop): the tokenizer let it
        # through only with nothing in flight, and holds new requests at its gate.
        # Settle what the queues still hold (decode's pending drain acks); anything
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
    sp = scheduler_pause(scheduler)
    return {
        "paused": bool(fork_touch.upstream(scheduler, "_engine_paused")),
        "mode": sp.mode,
        "clock_paused": engine_clock.paused,
    }


def poll_transfers_while_retracted(scheduler) -> list:
    """Decode with retracted requests allocates nothing new, but still retires the
    transfers in flight (finished ones move on, failed/timed-out ones are seen)."""
    transfer = scheduler.disagg_decode_transfer_queue
    if not transfer.queue:
        return []
    return transfer.pop_transferred()
