"""The scheduler's pause (docs/pause-release-resume.md): what each pause mode holds or ends, the drain after an
abort_all, the pump window after an abort while paused, the paused loop's tick, the engine clock's pause.

Invariant: every decision that changes which collectives a rank calls next (one more drain pass, one more pump of
the paused loop) is taken by `any_rank` at the same point on every rank (docs/layout.md, "More than one rank per
server"). Scheduler thread only (its hooks on upstream's Scheduler); no lock. One `SchedulerPause` per scheduler,
reached through `pause_of(scheduler)`."""

from __future__ import annotations

import enum
import logging
import time
from typing import Any, Dict, List

from sglang.srt.disaggregation.fork_ending import pd_queues, verdict, verdict_wording
from sglang.srt.disaggregation.fork_ending.engine_clock import engine_clock
from sglang.srt.managers.fork_core import fork_touch
from sglang.srt.managers.fork_core.rank_agreement import any_rank
from sglang.srt.managers.fork_pause import pd_pause
from sglang.srt.managers.io_struct import AbortReq, PauseGenerationReqInput

logger = logging.getLogger(__name__)

DRAIN_DEADLINE_S = 10.0
ABORT_PUMP_WINDOW_S = 5.0  # after an abort while paused, the paused loop keeps retiring what concludes late
# A paused PD scheduler with nothing to pump waits this long on upstream's idle sleeper (woken by any input),
# where upstream's paused loop polls without blocking and spins a core (bench/README.md)
PAUSED_INPUT_WAIT_MS = 50

# Start times (time.time()) of upstream's bootstrap and waiting timeouts on transfer senders/receivers
UPSTREAM_TIMER_ATTRS = ("init_time", "_prefill_complete_time", "_prefill_wait_start")

ATTR = "fork_pause"  # on the scheduler: its SchedulerPause


class PauseState(str, enum.Enum):
    """Where the scheduler's pause is, as upstream's `KVPoll` names a room's (transitions: `SchedulerPause`)."""

    SERVING = "serving"  # no pause; the PD queues' buffers registered
    PAUSED = "paused"  # pause_generation holds the loop; `mode` says how (abort, in_place, retract)
    RELEASED = "released"  # the PD queues' buffers deregistered, in a pause (`mode` kept) or without one


class Work(str, enum.Enum):
    """What the pause is doing inside the event loop right now (each is entered and left on the same pass)."""

    IDLE = "idle"
    DRAINING = "draining"  # abort_all_and_drain: aborting and pumping until no rank holds anything
    PUMPING = "pumping"  # one pass of upstream's PD queue processing (never re-entered)


class SchedulerPause:
    """One per scheduler (scheduler thread only, no lock). Named transitions:

    | transition | from -> to | called by |
    |---|---|---|
    | `pause(mode)` | SERVING -> PAUSED; PAUSED, RELEASED stay (mode: the first, or retract) | pause_generation |
    | `continue_()` | PAUSED -> SERVING; RELEASED stays (mode cleared) | the continue_generation hook |
    | `release()` | any -> RELEASED | `queue_buffers` (the PD queue's release) |
    | `resume()` | RELEASED -> PAUSED (a mode) or SERVING | `queue_buffers` (the PD queue's resume) |
    | `open_pump_window()` | the pump window opens for ABORT_PUMP_WINDOW_S | an abort while paused |
    | `close_pump_window()` | the pump window closes | the paused loop, once no rank is in it |

    Its abort hook passes an abort through untouched while `work` is not IDLE (the pause's own abort_all)."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self.state = PauseState.SERVING
        self.mode: "str | None" = None
        self.work = Work.IDLE
        self.pump_until = 0.0  # the pump window: the paused loop keeps pumping until then (monotonic; 0: closed)

    # -- transitions of the state
    @property
    def released(self) -> bool:
        return self.state is PauseState.RELEASED

    def pause(self, mode: str) -> None:
        if self.mode is None or mode == "retract":
            self.mode = mode
        if self.state is PauseState.SERVING:
            self.state = PauseState.PAUSED

    def continue_(self) -> None:
        self.mode = None
        if self.state is PauseState.PAUSED:
            self.state = PauseState.SERVING

    def release(self) -> None:
        self.state = PauseState.RELEASED

    def resume(self) -> None:
        self.state = PauseState.SERVING if self.mode is None else PauseState.PAUSED

    # -- the pump window
    def open_pump_window(self) -> None:
        self.pump_until = time.monotonic() + ABORT_PUMP_WINDOW_S

    def close_pump_window(self) -> None:
        self.pump_until = 0.0

    def in_pump_window(self) -> bool:
        """This rank's view only: the caller agrees it across ranks (`any_rank`) before pumping."""
        return not self.released and bool(self.pump_until) and time.monotonic() < self.pump_until

    # -- work inside the loop
    def pump(self) -> None:
        """One pass of upstream's own PD queue processing while the event loop is held: failed (aborted) rooms are
        retired with their resources, finished transfers move on. Idempotent; safe to call while paused."""
        if self.work is Work.PUMPING:
            return
        scheduler, before = self.scheduler, self.work
        self.work = Work.PUMPING
        try:
            role = pd_queues.role(scheduler)
            if role == "prefill":
                scheduler.process_pending_chunked_abort()
                scheduler.waiting_queue.extend(scheduler.disagg_prefill_bootstrap_queue.pop_bootstrapped())
                if scheduler.disagg_prefill_inflight_queue:
                    scheduler.process_disagg_prefill_inflight_queue()
            elif role == "decode":
                prealloc = scheduler.disagg_decode_prealloc_queue
                if prealloc.queue and not prealloc.retracted_queue:
                    scheduler.disagg_decode_transfer_queue.extend(prealloc.pop_preallocated()[0])
                scheduler.waiting_queue.extend(poll_transfers_while_retracted(scheduler))
                scheduler.disagg_decode_transfer_queue.resolve_deferred_releases()
        finally:
            self.work = before

    def abort_all_and_drain(self, message: str) -> None:
        """Abort everything in the PD queues and pump until upstream has retired it (every rank leaves at the same
        pass: when no rank holds anything, or when any rank's deadline passed)."""
        scheduler = self.scheduler
        deadline = time.monotonic() + DRAIN_DEADLINE_S
        ended: Dict[int, Any] = {}
        self.work = Work.DRAINING
        try:
            while True:
                for req in pd_queues.queued_reqs(scheduler):
                    verdict.of(req).pause = message
                    ended[id(req)] = req
                reason = pd_pause.pause_finish_reason(message)
                scheduler.abort_request(AbortReq(abort_all=True, finished_reason=reason))
                self.pump()
                held, overdue = any_rank(scheduler, not pd_queues_empty(scheduler), time.monotonic() > deadline)
                if not held or overdue:
                    break
                time.sleep(0.005)
        finally:
            self.work = Work.IDLE
        if pd_queues.role(scheduler) == "prefill":
            pd_pause.end_prefill_rooms(scheduler, list(ended.values()), message + " (room {room})")
        if not pd_queues_empty(scheduler):
            logger.warning("pd_pause: PD queues not empty %.0fs after abort_all: %s", DRAIN_DEADLINE_S,
                           pd_queues.lengths(scheduler))

    def end_in_flight(self) -> None:
        """Before releasing memory: retract what runs (decode re-bootstraps it), abort what sits in the PD queues."""
        scheduler = self.scheduler
        if pd_queues.role(scheduler) is None:
            return
        paused = self.mode is not None
        if not fork_touch.upstream(scheduler, "_engine_paused"):
            # Release without a pause (the colocated RL loop; the tokenizer let it through idle and holds new
            # requests at its gate): settle what the queues still hold (decode's pending drain acks); anything
            # that slipped in is retracted/aborted as in a pause, never asserted on.
            busy, held = any_rank(scheduler, not scheduler.is_fully_idle(ignore_waiting=False),  # upstream's check
                                  not pd_queues_empty(scheduler))
            if not (busy or held):
                return
            logger.warning("pd_pause: release without a pause, not idle: %s", not_idle_reasons(scheduler))
            if not busy:
                self.abort_all_and_drain(pd_pause.RELEASE_NO_PAUSE_MESSAGE)
                return
        if (not scheduler.running_batch.is_empty() or scheduler.last_batch is not None
                or (pd_queues.role(scheduler) == "decode" and scheduler.waiting_queue)):
            # Upstream's retract: frees KV of running requests; decode re-bootstraps them.
            scheduler.pause_generation(PauseGenerationReqInput(mode="retract"))
        self.abort_all_and_drain(pd_pause.RELEASE_ABORT_MESSAGE.format(mode=self.mode) if paused
                                 else pd_pause.RELEASE_NO_PAUSE_MESSAGE)

    def settle_answered_forward(self) -> None:
        """Abort mode, overlap scheduler: a forward of only finished requests left in upstream's result queue is
        processed now, as the loop's next pass would (docs/pause-release-resume.md, "What release does")."""
        scheduler = self.scheduler
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

    def retract_held_batch(self) -> None:
        """An abort while paused hits a paused batch, which is answered after the next pass: upstream's retract
        settles it now ("Aborts while paused"); the pause's mode and state stay what they were."""
        mode, state = self.mode, self.state
        self.scheduler.pause_generation(PauseGenerationReqInput(mode="retract"))
        self.mode, self.state = mode, state

    def report(self) -> Dict[str, Any]:
        return {"paused": bool(fork_touch.upstream(self.scheduler, "_engine_paused")),
                "mode": self.mode, "clock_paused": engine_clock.paused}


def pause_of(scheduler) -> SchedulerPause:
    """The scheduler's pause (made at first use)."""
    pause = scheduler.__dict__.get(ATTR)
    if pause is None:
        pause = scheduler.__dict__[ATTR] = SchedulerPause(scheduler)
    return pause


# ----------------------------------------------------------------------------- hooks (scheduler thread)

def scheduler_pause_generation(original, scheduler, recv_req):
    """AROUND Scheduler.pause_generation: accept mode 'abort' and stop the clock."""
    sp = pause_of(scheduler)
    if recv_req.mode == "abort":
        # The tokenizer already ended every request: hold as upstream's in_place pause does, end stragglers.
        original(scheduler, PauseGenerationReqInput(mode="in_place"))
        sp.settle_answered_forward()
        sp.abort_all_and_drain(pd_pause.PAUSE_ABORT_MESSAGE)
        for batch in (scheduler.running_batch, scheduler.last_batch):
            # all finished: emptied as upstream's next-batch filter would (a weight update's flush finds it busy)
            if batch is not None and batch.reqs and all(req.finished() for req in batch.reqs):
                batch.filter_batch()
    else:
        original(scheduler, recv_req)
    sp.pause(recv_req.mode)
    engine_clock.pause()


def scheduler_continue_generation(result, scheduler, recv_req, *args, **kwargs):
    """AFTER Scheduler.continue_generation: restart the clock, shift upstream timers by the paused time."""
    pause_of(scheduler).continue_()
    shift_upstream_timers(scheduler, engine_clock.resume())


def abort_while_paused(original, scheduler, recv_req, *args, **kwargs):
    """AROUND Scheduler.abort_request: while paused, answer the abort now, wherever the request sits."""
    sp = pause_of(scheduler)
    role = pd_queues.role(scheduler)
    if role == "decode":
        pd_pause.note_why(scheduler, recv_req)
    if not getattr(scheduler, "_engine_paused", False) or role is None or sp.work is not Work.IDLE:
        result = original(scheduler, recv_req, *args, **kwargs)
        if role is not None:
            pd_pause.keep_abort_verdict(scheduler, recv_req)
        return result
    places = {stage for stage, r in pd_queues.walk(scheduler) if pd_pause._matches(recv_req, r.rid)}
    places |= {"parked" for r in pd_queues.parked_reqs(scheduler) if pd_pause._matches(recv_req, r.rid)}
    matched = [r for r in pd_queues.held_reqs(scheduler) if pd_pause._matches(recv_req, r.rid)]
    logger.info("pd_pause: abort while paused (rid=%r, all=%s) found in %s",
                recv_req.rid, recv_req.abort_all, sorted(places))
    result = original(scheduler, recv_req, *args, **kwargs)
    sp.open_pump_window()
    if _holds_in_batch(scheduler, recv_req):
        sp.retract_held_batch()
    if role == "decode":
        _abort_held_rebootstrap(scheduler, recv_req)
    pd_pause.keep_abort_verdict(scheduler, recv_req)
    sp.pump()
    if role == "prefill":
        pd_pause.end_prefill_rooms(scheduler, matched, verdict_wording.PAUSED_ABORT_REASON)
    return result


def paused_loop_tick(result, scheduler, *args, **kwargs):
    """AFTER Scheduler._record_scheduler_state_for_paused_engine (each paused loop iteration): for a while after
    an abort keep retiring what it failed (late drain acks); otherwise answer prefill's legs whose transfer
    concluded, then wait for input instead of spinning."""
    from sglang.srt.managers.scheduler_components.idle_sleeper import IdleSleeper

    sp = pause_of(scheduler)
    role = pd_queues.role(scheduler)
    if role is None:
        return result
    if any_rank(scheduler, sp.in_pump_window())[0]:
        sp.pump()  # on every rank, or on none: a pump runs the queues' poll collectives
        return result
    sp.close_pump_window()
    if role == pd_queues.PREFILL and not sp.released and scheduler.disagg_prefill_inflight_queue:
        # decode may re-send it under the same rid (docs/pause-release-resume.md, "Legs a paused prefill has sent")
        scheduler.process_disagg_prefill_inflight_queue()
    sleeper = fork_touch.upstream(scheduler, "idle_sleeper")
    if isinstance(sleeper, IdleSleeper):  # zmq sockets (not the Rust server's ring; without one the loop spins)
        fork_touch.upstream(sleeper, "poller").poll(PAUSED_INPUT_WAIT_MS)
    return result


def poll_transfers_while_retracted(scheduler) -> list:
    """Decode's concluded transfers, popped (the patch: also while retracted requests stop new allocation)."""
    transfer = scheduler.disagg_decode_transfer_queue
    return transfer.pop_transferred() if transfer.queue else []


# ----------------------------------------------------------------------------- what the pause reads

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


def pd_queues_empty(scheduler) -> bool:
    role = pd_queues.role(scheduler)
    if role != "decode":  # prefill: bootstrap, waiting and inflight queues, chunked request
        return role is None or not pd_queues.queued_reqs(scheduler)
    transfer = scheduler.disagg_decode_transfer_queue  # aborted transfers hold their KV until prefill acks the drain
    return not (scheduler.disagg_decode_prealloc_queue.queue or transfer.queue
                or any(r.kv.holds_kv for r in scheduler.waiting_queue) or transfer.has_pending_deferred_releases())


def not_idle_reasons(scheduler) -> List[str]:
    """Which of upstream's is_fully_idle conditions fail (for the log)."""
    checks = {
        "running_batch": not scheduler.running_batch.is_empty(),
        "chunked_req": scheduler.chunked_req is not None,
        "last_batch": scheduler.last_batch is not None and not scheduler.last_batch.is_empty(),
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


def report(scheduler) -> Dict[str, Any]:
    """The resource report's `pause`."""
    return pause_of(scheduler).report()


def _holds_in_batch(scheduler, recv_req) -> bool:
    """The abort hits what only the next pass would retire: decode's batches, prefill's unprocessed last batch."""
    last = list(scheduler.last_batch.reqs) if scheduler.last_batch is not None else []
    if pd_queues.role(scheduler) == "prefill":
        reqs = last if scheduler.enable_overlap and scheduler.result_queue else []
    else:
        reqs = list(scheduler.running_batch.reqs) + last
    return any(pd_pause._matches(recv_req, r.rid) for r in reqs)


def _abort_held_rebootstrap(scheduler, recv_req) -> None:
    """Requests a retract pause holds for re-bootstrap own no KV; answer them."""
    from sglang.srt.disaggregation.utils import prepare_abort
    from sglang.srt.managers.scheduler import _make_abort_req

    prealloc = scheduler.disagg_decode_prealloc_queue
    matched = [r for r in prealloc.held_rebootstrap_reqs if pd_pause._matches(recv_req, r.rid)]
    prealloc.held_rebootstrap_reqs = [r for r in prealloc.held_rebootstrap_reqs if r not in matched]
    for req in matched:
        prepare_abort(req, verdict_wording.UPSTREAM_ABORT_MESSAGE)
        scheduler.send_abort_output(_make_abort_req(req, finished_reason=recv_req.finished_reason), req)
