"""Pause, release and resume of a PD engine with requests in flight.

Invariant: a pause/release/resume/continue cycle may run at any moment. Every request
the engine holds ends in a completion, a clear abort status, or (retract pause) is kept
for re-bootstrap; whatever it held (KV, metadata slot, room state) is returned before
the KV buffers are deregistered from the transfer engine, and they are re-registered
at their current addresses on resume. Paused time counts against no timer. Calls out
of order get HTTP 409 naming the state and change nothing.

Two halves, one per process kind:
- tokenizer side: `EnginePauseState` (running -> paused -> released -> resumed ->
  running) around TokenizerManager's pause/release/resume/continue handlers;
- scheduler side: `on_pause`, `end_in_flight` (before release), `refresh_addresses`
  (before a queue re-registers), `on_continue`, `after_abort` (aborts answered while
  paused) and `poll_transfers_while_retracted` (decode).
Hooks are listed in fork_plugin.HOOKS; two patches call in where no hook reaches.
"""

from __future__ import annotations

import asyncio
import logging
import time
from http import HTTPStatus
from typing import Any, Callable, Dict, List, Optional

from fastapi import HTTPException

from sglang.srt.managers.engine_clock import engine_clock

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "in_place", "retract")
RELEASE_ABORT_MESSAGE = "Aborted: engine memory released during pause (mode={mode})."
DRAIN_DEADLINE_S = 10.0
ABORT_PUMP_WINDOW_S = 5.0

# ---------------------------------------------------------------- tokenizer side

RUNNING, PAUSED, RELEASED, RESUMED = "running", "paused", "released", "resumed"

# operation -> (states it is allowed from, state after success)
_TRANSITIONS: Dict[str, tuple] = {
    "pause_generation": ((RUNNING,), PAUSED),
    "release_memory_occupation": ((PAUSED,), RELEASED),
    "resume_memory_occupation": ((RELEASED,), RESUMED),
    "continue_generation": ((PAUSED, RESUMED), RUNNING),
}
_HINT = {
    RUNNING: "call pause_generation first",
    PAUSED: "call release_memory_occupation or continue_generation",
    RELEASED: "call resume_memory_occupation first",
    RESUMED: "call continue_generation",
}


class PauseStateError(HTTPException):
    """An out-of-order pause/release/resume/continue call; nothing was changed.
    An HTTPException, so upstream's handlers answer it with its status (409)."""

    def __init__(self, message: str):
        super().__init__(status_code=HTTPStatus.CONFLICT, detail=message)

    def __str__(self) -> str:
        return self.detail


class EnginePauseState:
    """The engine's pause state as the HTTP-facing process sees it (one per server)."""

    def __init__(self):
        self.state = RUNNING
        self.mode: Optional[str] = None
        self.busy: Optional[str] = None  # operation in progress

    def check(self, op: str, mode: Optional[str] = None) -> None:
        allowed, _ = _TRANSITIONS[op]
        if self.busy is not None:
            raise PauseStateError(
                f"{op} rejected: {self.busy} is in progress (engine state: {self.state})"
            )
        if op == "pause_generation" and mode not in PAUSE_MODES:
            raise PauseStateError(
                f"{op} rejected: unknown mode {mode!r}, expected one of "
                f"{list(PAUSE_MODES)} (engine state: {self.state})"
            )
        if self.state not in allowed:
            raise PauseStateError(
                f"{op} rejected: engine state is {self.state!r}"
                f"{f' (pause mode {self.mode})' if self.mode else ''}; "
                f"{_HINT[self.state]}"
            )

    def done(self, op: str, mode: Optional[str] = None) -> None:
        self.state = _TRANSITIONS[op][1]
        if op == "pause_generation":
            self.mode = mode
        elif op == "continue_generation":
            self.mode = None

    def as_dict(self) -> Dict[str, Any]:
        return {"state": self.state, "mode": self.mode, "busy": self.busy}


def _state_of(tokenizer_manager) -> EnginePauseState:
    state = getattr(tokenizer_manager, "_fork_pause_state", None)
    if state is None:
        state = tokenizer_manager._fork_pause_state = EnginePauseState()
    return state


def _guarded(op: str, mode_of: Callable[[Any], Optional[str]] = lambda obj: None):
    async def around(original, tokenizer_manager, obj, *args, **kwargs):
        state = _state_of(tokenizer_manager)
        mode = mode_of(obj)
        state.check(op, mode)
        state.busy = op
        try:
            result = await original(tokenizer_manager, obj, *args, **kwargs)
            if op == "pause_generation" and mode == "abort":
                # Upstream ends every request in the tokenizer and never tells the
                # scheduler; tell it now, so it pauses (and its clock stops) too.
                await tokenizer_manager._async_dispatch_to_scheduler(obj)
        finally:
            state.busy = None
        state.done(op, mode)
        return result

    return around


tm_pause_generation = _guarded("pause_generation", lambda obj: obj.mode)
tm_continue_generation = _guarded("continue_generation")
tm_release_memory_occupation = _guarded("release_memory_occupation")
tm_resume_memory_occupation = _guarded("resume_memory_occupation")


class PauseGateAbort(ValueError):
    """A request aborted while it waited at the pause gate (never reached the
    scheduler). A ValueError with a status, as upstream's /generate expects."""

    status_code = 499  # client closed request

    def __init__(self, rid: str):
        super().__init__(f"Aborted by AbortReq while the engine was paused (rid={rid}).")


def tm_abort_request(result, tokenizer_manager, rid: str = "", abort_all: bool = False):
    """AFTER TokenizerManager.abort_request: requests held at the pause gate are
    answered now, not after continue_generation."""
    if not tokenizer_manager.is_pause:
        return result
    hit = False
    for state_rid, state in list(tokenizer_manager.rid_to_state.items()):
        if abort_all or state_rid == rid:
            state._fork_gate_abort = True
            hit = True
    logger.info("pd_pause: abort while paused (rid=%r, all=%s): %s", rid, abort_all,
                "waking the pause gate" if hit else "no request state")
    if hit:
        asyncio.get_running_loop().create_task(_wake_gate(tokenizer_manager))
    return result


async def _wake_gate(tokenizer_manager) -> None:
    async with tokenizer_manager.is_pause_cond:
        tokenizer_manager.is_pause_cond.notify_all()


def gate_open(tokenizer_manager, request_states: Dict[str, Any]) -> bool:
    """The pause gate of generate_request: open when not paused, or for an aborted request."""
    return not tokenizer_manager.is_pause or any(
        getattr(s, "_fork_gate_abort", False) for s in request_states.values()
    )


def raise_if_gate_aborted(request_states: Dict[str, Any]) -> None:
    for rid, state in request_states.items():
        if getattr(state, "_fork_gate_abort", False):
            raise PauseGateAbort(rid)


# ---------------------------------------------------------------- scheduler side

# Start times (time.time()) that upstream's transfer senders/receivers measure their
# bootstrap and waiting timeouts from (disaggregation/common/conn.py).
UPSTREAM_TIMER_ATTRS = ("init_time", "_prefill_complete_time", "_prefill_wait_start")


class _SchedulerPause:
    """Per-scheduler bookkeeping of the pause (one per scheduler process)."""

    def __init__(self):
        self.mode: Optional[str] = None
        self.paused_at_wall: Optional[float] = None
        self.pumping = False
        self.draining = False  # inside _abort_all_and_drain
        self.released = False  # PD queues released (KV buffers deregistered)
        self.pump_until = 0.0  # keep pumping the paused loop until (monotonic)


def _sp(scheduler) -> _SchedulerPause:
    sp = getattr(scheduler, "_fork_pd_pause", None)
    if sp is None:
        sp = scheduler._fork_pd_pause = _SchedulerPause()
    return sp


def _mode(scheduler):
    from sglang.srt.disaggregation.utils import DisaggregationMode

    mode = scheduler.disaggregation_mode
    return (
        "prefill"
        if mode == DisaggregationMode.PREFILL
        else "decode" if mode == DisaggregationMode.DECODE else None
    )


def scheduler_pause_generation(original, scheduler, recv_req):
    """AROUND Scheduler.pause_generation: accept mode 'abort' and stop the clock."""
    sp = _sp(scheduler)
    if recv_req.mode == "abort":
        # The tokenizer already ended every request; end stragglers, then hold.
        scheduler._engine_paused = True
        if scheduler._pause_started_at is None:
            scheduler._pause_started_at = time.monotonic()
        _abort_all_and_drain(scheduler, "Aborted by pause_generation(mode=abort).")
    else:
        original(scheduler, recv_req)
    if sp.mode is None or recv_req.mode == "retract":
        sp.mode = recv_req.mode
    if sp.paused_at_wall is None:
        sp.paused_at_wall = time.time()
    engine_clock.pause()


def scheduler_continue_generation(result, scheduler, recv_req, *args, **kwargs):
    """AFTER Scheduler.continue_generation: restart the clock, shift upstream timers."""
    sp = _sp(scheduler)
    if sp.paused_at_wall is not None:
        shift_upstream_timers(scheduler, time.time() - sp.paused_at_wall)
    sp.paused_at_wall = None
    sp.mode = None
    engine_clock.resume()
    return result


def _transfer_endpoints(scheduler) -> List[Any]:
    """Live KV senders/receivers of every request in this scheduler's PD queues."""
    out = []
    role = _mode(scheduler)
    if role == "prefill":
        reqs = list(scheduler.disagg_prefill_bootstrap_queue.queue)
        reqs += list(scheduler.disagg_prefill_inflight_queue)
        reqs += list(scheduler.waiting_queue)
        out = [getattr(r, "disagg_kv_sender", None) for r in reqs]
    elif role == "decode":
        entries = list(scheduler.disagg_decode_prealloc_queue.queue)
        entries += list(scheduler.disagg_decode_transfer_queue.queue)
        out = [getattr(e, "kv_receiver", None) for e in entries]
    return [x for x in out if x is not None]


def shift_upstream_timers(scheduler, paused_seconds: float) -> int:
    """Move upstream's recorded start times forward by the paused duration, so the
    bootstrap/waiting timeouts of every live transfer exclude the pause."""
    shifted = 0
    if paused_seconds <= 0:
        return shifted
    for endpoint in _transfer_endpoints(scheduler):
        for attr in UPSTREAM_TIMER_ATTRS:
            value = getattr(endpoint, attr, None)
            if isinstance(value, (int, float)):
                setattr(endpoint, attr, value + paused_seconds)
                shifted += 1
    return shifted


def _pd_queues_empty(scheduler) -> bool:
    role = _mode(scheduler)
    if role == "prefill":
        return (
            not scheduler.disagg_prefill_bootstrap_queue.queue
            and not scheduler.disagg_prefill_inflight_queue
            and not scheduler.waiting_queue
            and scheduler.chunked_req is None
        )
    if role == "decode":
        return (
            not scheduler.disagg_decode_prealloc_queue.queue
            and not scheduler.disagg_decode_transfer_queue.queue
            and not any(r.kv.holds_kv for r in scheduler.waiting_queue)
            # Aborted transfers hold their KV until prefill acks the drain.
            and not scheduler.disagg_decode_transfer_queue.has_pending_deferred_releases()
        )
    return True


def pump_pd_queues(scheduler) -> None:
    """One pass of upstream's own PD queue processing while the event loop is held:
    failed (aborted) rooms are retired with their resources by upstream's code paths,
    finished transfers move on. Idempotent; safe to call while paused."""
    sp = _sp(scheduler)
    if sp.pumping:
        return
    sp.pumping = True
    try:
        role = _mode(scheduler)
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
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    reason = FINISH_ABORT(message, HTTPStatus.SERVICE_UNAVAILABLE).to_json()
    deadline = time.monotonic() + DRAIN_DEADLINE_S
    sp = _sp(scheduler)
    sp.draining = True
    try:
        while True:
            for req in _queued_reqs(scheduler):
                req._fork_pause_abort = message
            scheduler.abort_request(AbortReq(abort_all=True, finished_reason=reason))
            pump_pd_queues(scheduler)
            if _pd_queues_empty(scheduler) or time.monotonic() > deadline:
                break
            time.sleep(0.005)
    finally:
        sp.draining = False
    if not _pd_queues_empty(scheduler):
        logger.warning(
            "pd_pause: PD queues not empty %.0fs after abort_all: %s",
            DRAIN_DEADLINE_S,
            _queue_lengths(scheduler),
        )


def _queued_reqs(scheduler) -> List[Any]:
    """Requests in this scheduler's PD queues (not the running batch)."""
    role = _mode(scheduler)
    reqs = list(scheduler.waiting_queue)
    if role == "prefill":
        reqs += list(scheduler.disagg_prefill_bootstrap_queue.queue)
        reqs += list(scheduler.disagg_prefill_inflight_queue)
        if scheduler.chunked_req is not None:
            reqs.append(scheduler.chunked_req)
    elif role == "decode":
        reqs += [e.req for e in scheduler.disagg_decode_prealloc_queue.queue]
        reqs += [e.req for e in scheduler.disagg_decode_transfer_queue.queue]
    return reqs


def pause_abort_status(original, req, error_message, status_code=None, *args, **kwargs):
    """AROUND disaggregation.utils.prepare_abort: a request the pause path ended
    reports why (503, retry later), not the transfer failure it caused."""
    message = getattr(req, "_fork_pause_abort", None)
    if message is not None:
        error_message, status_code = message, HTTPStatus.SERVICE_UNAVAILABLE
    return original(req, error_message, status_code, *args, **kwargs)


def _queue_lengths(scheduler) -> Dict[str, int]:
    from sglang.srt.managers.pd_resource_report import _queues

    return _queues(scheduler)


def end_in_flight(scheduler) -> None:
    """Before releasing memory: retract what runs (kept for re-bootstrap on decode),
    abort what sits in the PD queues, and wait until upstream has retired it."""
    from sglang.srt.managers.io_struct import PauseGenerationReqInput

    if _mode(scheduler) is None:
        return
    sp = _sp(scheduler)
    if not getattr(scheduler, "_engine_paused", False):
        return  # upstream's idle assertion decides, as before
    mode = sp.mode or "unknown"
    if (
        not scheduler.running_batch.is_empty()
        or scheduler.last_batch is not None
        or (_mode(scheduler) == "decode" and scheduler.waiting_queue)
    ):
        # Upstream's retract: frees KV of running requests; decode re-bootstraps them.
        scheduler.pause_generation(PauseGenerationReqInput(mode="retract"))
    _abort_all_and_drain(
        scheduler, RELEASE_ABORT_MESSAGE.format(mode=mode)
    )


def not_idle_reasons(scheduler) -> List[str]:
    """Which of upstream's is_fully_idle conditions fail (for the log)."""
    checks = {
        "running_batch": not scheduler.running_batch.is_empty(),
        "chunked_req": scheduler.chunked_req is not None,
        "last_batch": scheduler.last_batch is not None
        and not scheduler.last_batch.is_empty(),
        "result_queue": bool(getattr(scheduler, "result_queue", None)),
        "waiting_with_kv": any(r.kv.holds_kv for r in scheduler.waiting_queue),
        "grammar_queue": bool(scheduler.grammar_manager.grammar_queue),
        "deferred_kv_releases": _mode(scheduler) == "decode"
        and scheduler.disagg_decode_transfer_queue.has_pending_deferred_releases(),
    }
    reasons = [k for k, v in checks.items() if v]
    reasons += [f"queue.{k}={v}" for k, v in _queue_lengths(scheduler).items()
                if v and k not in ("waiting", "running")]
    return reasons


def weight_updater_release(original, weight_updater, recv_req, *args, **kwargs):
    """AROUND WeightUpdater.release_memory_occupation."""
    scheduler = weight_updater.scheduler
    if scheduler is not None:
        end_in_flight(scheduler)
        paused = getattr(scheduler, "_engine_paused", False)
        if not weight_updater.is_fully_idle(ignore_waiting=paused):
            logger.error("pd_pause: not idle before release: %s", not_idle_reasons(scheduler))
    return original(weight_updater, recv_req, *args, **kwargs)


def after_abort(result, scheduler, recv_req, *args, **kwargs):
    """AFTER Scheduler.abort_request: while paused, answer the abort now."""
    sp = _sp(scheduler)
    if not getattr(scheduler, "_engine_paused", False) or _mode(scheduler) is None:
        return result
    if sp.pumping or sp.draining:
        return result
    sp.pump_until = time.monotonic() + ABORT_PUMP_WINDOW_S
    if _mode(scheduler) == "decode":
        if any(_matches(recv_req, r.rid) for r in scheduler.running_batch.reqs):
            # An in-place pause holds running requests with their KV; upstream would
            # answer their abort only after a forward pass. Retract the batch now
            # (upstream's path: the others re-bootstrap on continue) and answer.
            from sglang.srt.managers.io_struct import PauseGenerationReqInput

            scheduler.pause_generation(PauseGenerationReqInput(mode="retract"))
        _abort_held_rebootstrap(scheduler, recv_req)
    pump_pd_queues(scheduler)
    return result


def paused_loop_tick(result, scheduler, *args, **kwargs):
    """AFTER Scheduler._record_scheduler_state_for_paused_engine (every iteration of
    a paused event loop): for a while after an abort, keep retiring what it failed,
    so rooms that conclude a moment later (drain acks) are answered during the
    pause too."""
    sp = _sp(scheduler)
    if sp.released or _mode(scheduler) is None:
        return result
    if sp.pump_until and time.monotonic() < sp.pump_until:
        pump_pd_queues(scheduler)
    else:
        sp.pump_until = 0.0
    return result


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


# -------------------------------------------------- transfer-engine registration


def refresh_addresses(queue) -> bool:
    """BEFORE a PD queue's resume_memory_occupation: re-read the KV and metadata
    buffer addresses (they may have moved while released) into the kv_manager's
    kv_args, so the re-registration and the next handshake use them."""
    from sglang.srt.disaggregation.utils import get_kv_transfer_buf_infos

    kv_args = queue.kv_manager.kv_args
    changed = False
    pools = [queue.token_to_kv_pool]
    draft = getattr(queue, "draft_token_to_kv_pool", None)
    ptrs: List[int] = list(get_kv_transfer_buf_infos(queue.token_to_kv_pool)[0])
    if draft is not None:
        ptrs += list(draft.get_contiguous_buf_infos()[0])
        pools.append(draft)
    if len(ptrs) == len(kv_args.kv_data_ptrs) and ptrs != list(kv_args.kv_data_ptrs):
        kv_args.kv_data_ptrs = ptrs
        changed = True
    aux = list(queue.metadata_buffers.get_buf_infos()[0])
    if len(aux) == len(kv_args.aux_data_ptrs) and aux != list(kv_args.aux_data_ptrs):
        kv_args.aux_data_ptrs = aux
        changed = True
    if changed:
        logger.info("pd_pause: KV buffer addresses changed across release; re-registering")
    return changed


def queue_resume(original, queue, *args, **kwargs):
    """AROUND {PrefillBootstrapQueue,DecodePreallocQueue}.resume_memory_occupation."""
    refresh_addresses(queue)
    # Room state the peer re-created while this side was released (its own teardown
    # messages, late handshakes of requests it ended) belongs to no live request.
    forget_orphan_rooms(queue.scheduler, queue.kv_manager)
    result = original(queue, *args, **kwargs)
    _note_registration(queue.kv_manager, registered=True)
    _sp(queue.scheduler).released = False
    return result


def queue_release(original, queue, *args, **kwargs):
    """AROUND {PrefillBootstrapQueue,DecodePreallocQueue}.release_memory_occupation."""
    forget_orphan_rooms(queue.scheduler, queue.kv_manager)
    result = original(queue, *args, **kwargs)
    _note_registration(queue.kv_manager, registered=False)
    _sp(queue.scheduler).released = True
    return result


# kv_manager tables keyed by bootstrap room that a concluded room leaves behind.
ROOM_TABLES = (
    "request_status",
    "failure_records",
    "transfer_infos",
    "req_to_decode_prefix_len",
    "_staging_outstanding",
)


def _live_rooms(scheduler) -> set:
    reqs = _queued_reqs(scheduler) + list(scheduler.running_batch.reqs)
    if _mode(scheduler) == "decode":
        reqs += list(scheduler.disagg_decode_prealloc_queue.held_rebootstrap_reqs)
        reqs += list(scheduler.disagg_decode_prealloc_queue.retracted_queue)
    return {getattr(r, "bootstrap_room", None) for r in reqs}


def forget_orphan_rooms(scheduler, kv_manager) -> int:
    """At release no transfer can run (the buffers are about to be deregistered):
    room state that no live request owns is dropped, not carried across the cycle."""
    live = _live_rooms(scheduler)
    dropped = 0
    for name in ROOM_TABLES:
        table = getattr(kv_manager, name, None)
        if not isinstance(table, dict):
            continue
        for room in [r for r in list(table) if r not in live]:
            table.pop(room, None)
            dropped += 1
    if dropped:
        logger.info("pd_pause: dropped %d room-table entries of ended requests", dropped)
    return dropped


def _note_registration(kv_manager, registered: bool) -> None:
    regions = getattr(kv_manager, "_registerable_regions", None)
    n = len(regions()) if (registered and regions is not None) else 0
    kv_manager._fork_registered_regions = n


def registration_report(kv_manager) -> Dict[str, Any]:
    """Regions this kv_manager has registered with the transfer engine right now."""
    regions = getattr(kv_manager, "_registerable_regions", None)
    n = getattr(kv_manager, "_fork_registered_regions", None)
    if n is None:  # never released: upstream registered everything at start-up
        n = len(regions()) if regions is not None else 0
    return {
        "registered_regions": n,
        "kv_data_ptrs": list(kv_manager.kv_args.kv_data_ptrs),
    }


def report(scheduler) -> Dict[str, Any]:
    sp = _sp(scheduler)
    return {
        "paused": bool(getattr(scheduler, "_engine_paused", False)),
        "mode": sp.mode,
        "clock_paused": engine_clock.paused,
    }


# -------------------------------------------------------------------- decode


def poll_transfers_while_retracted(scheduler) -> list:
    """Decode with retracted requests allocates nothing new, but still retires the
    transfers in flight (finished ones move on, failed/timed-out ones are seen)."""
    transfer = scheduler.disagg_decode_transfer_queue
    if not transfer.queue:
        return []
    return transfer.pop_transferred()
