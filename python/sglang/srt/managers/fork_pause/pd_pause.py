"""Pause/release/resume/continue with PD requests in flight (docs/pause-release-resume.md). The scheduler side
(scheduler thread): what each pause mode ends or keeps at release, the engine clock, aborts while paused. The tokenizer
side (the HTTP process's event loop): the pause state (409s) and the pause gate."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Dict, List, Optional, Tuple

from fastapi import HTTPException

from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX
from sglang.srt.disaggregation.fork_ending import pd_queues, room_ledger, verdict
from sglang.srt.disaggregation.fork_ending.verdict import (  # the pause's messages and answer: the verdict's
    PAUSE_ABORT_MESSAGE, RELEASE_ABORT_MESSAGE, RELEASE_NO_PAUSE_MESSAGE, pause_finish_reason)
from sglang.srt.disaggregation.fork_ending.room_ledger import engine_clock
from sglang.srt.managers.fork_core import fork_touch
from sglang.srt.managers.fork_core.rank_agreement import any_rank
from sglang.srt.managers.io_struct import AbortReq, ContinueGenerationReqInput, PauseGenerationReqInput
from sglang.srt.managers.schedule_batch import FINISH_ABORT

logger = logging.getLogger(__name__)

DRAIN_DEADLINE_S = 10.0
ABORT_PUMP_WINDOW_S = 5.0  # after an abort while paused, the paused loop keeps retiring what concludes late
# A paused PD scheduler with nothing to pump waits this long on upstream's idle sleeper (woken by any input),
# where upstream's paused loop polls without blocking and spins a core (bench/README.md)
PAUSED_INPUT_WAIT_MS = 50

# Start times (time.time()) of upstream's bootstrap and waiting timeouts on transfer senders/receivers
UPSTREAM_TIMER_ATTRS = ("init_time", "_prefill_complete_time", "_prefill_wait_start")


@dataclass
class _SchedulerPause:
    mode: Optional[str] = None
    pumping: bool = False
    draining: bool = False  # inside _abort_all_and_drain
    released: bool = False  # PD queues released (KV buffers deregistered)
    pump_until: float = 0.0  # keep pumping the paused loop until (monotonic)


def scheduler_pause(scheduler) -> _SchedulerPause:
    return scheduler.__dict__.setdefault("_fork_pd_pause", _SchedulerPause())


def scheduler_pause_generation(original, scheduler, recv_req):
    """AROUND Scheduler.pause_generation: accept mode 'abort' and stop the clock."""
    sp = scheduler_pause(scheduler)
    if recv_req.mode == "abort":
        # The tokenizer already ended every request: hold as upstream's in_place pause does, end stragglers.
        original(scheduler, PauseGenerationReqInput(mode="in_place"))
        _settle_answered_forward(scheduler)
        _abort_all_and_drain(scheduler, PAUSE_ABORT_MESSAGE)
        for batch in (scheduler.running_batch, scheduler.last_batch):
            # all finished: emptied as upstream's next-batch filter would (a weight update's flush finds it busy)
            if batch is not None and batch.reqs and all(req.finished() for req in batch.reqs):
                batch.filter_batch()
    else:
        original(scheduler, recv_req)
    if sp.mode is None or recv_req.mode == "retract":
        sp.mode = recv_req.mode
    engine_clock.pause()


def _settle_answered_forward(scheduler) -> None:
    """Abort mode, overlap scheduler: a forward of only finished requests left in upstream's result queue is
    processed now, as the loop's next pass would (docs/pause-release-resume.md, "What release does")."""
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
    if role != "decode":  # prefill: bootstrap, waiting and inflight queues, chunked request
        return role is None or not pd_queues.queued_reqs(scheduler)
    transfer = scheduler.disagg_decode_transfer_queue  # aborted transfers hold their KV until prefill acks the drain
    return not (scheduler.disagg_decode_prealloc_queue.queue or transfer.queue
                or any(r.kv.holds_kv for r in scheduler.waiting_queue) or transfer.has_pending_deferred_releases())


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
        sp.pumping = False


def _abort_all_and_drain(scheduler, message: str) -> None:
    """Abort everything in the PD queues and pump until upstream has retired it (every rank leaves at the same
    pass: when no rank holds anything, or when any rank's deadline passed)."""
    deadline = time.monotonic() + DRAIN_DEADLINE_S
    sp = scheduler_pause(scheduler)
    sp.draining = True
    ended: Dict[int, Any] = {}
    try:
        while True:
            for req in pd_queues.queued_reqs(scheduler):
                verdict.of(req).pause = message
                ended[id(req)] = req
            scheduler.abort_request(AbortReq(abort_all=True, finished_reason=pause_finish_reason(message)))
            pump_pd_queues(scheduler)
            held, overdue = any_rank(scheduler, not _pd_queues_empty(scheduler), time.monotonic() > deadline)
            if not held or overdue:
                break
            time.sleep(0.005)
    finally:
        sp.draining = False
    if pd_queues.role(scheduler) == "prefill":
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
        room_ledger.end_room(mgr, room, None, reason.format(room=room), fail=False, tell=False, remember=True,
                             cancel=True, clear=sender)


def end_in_flight(scheduler) -> None:
    """Before releasing memory: retract what runs (decode re-bootstraps it), abort what sits in the PD queues."""
    if pd_queues.role(scheduler) is None:
        return
    sp = scheduler_pause(scheduler)
    paused = sp.mode is not None
    if not fork_touch.upstream(scheduler, "_engine_paused"):
        # Release without a pause (the colocated RL loop; the tokenizer let it through idle and holds new
        # requests at its gate): settle what the queues still hold (decode's pending drain acks); anything
        # that slipped in is retracted/aborted as in a pause, never asserted on.
        busy, held = any_rank(scheduler, not scheduler.is_fully_idle(ignore_waiting=False),  # upstream's check
                              not _pd_queues_empty(scheduler))
        if not (busy or held):
            return
        logger.warning("pd_pause: release without a pause, not idle: %s", not_idle_reasons(scheduler))
        if not busy:
            _abort_all_and_drain(scheduler, RELEASE_NO_PAUSE_MESSAGE)
            return
    if (not scheduler.running_batch.is_empty() or scheduler.last_batch is not None
            or (pd_queues.role(scheduler) == "decode" and scheduler.waiting_queue)):
        # Upstream's retract: frees KV of running requests; decode re-bootstraps them.
        scheduler.pause_generation(PauseGenerationReqInput(mode="retract"))
    _abort_all_and_drain(scheduler, RELEASE_ABORT_MESSAGE.format(mode=sp.mode) if paused else RELEASE_NO_PAUSE_MESSAGE)


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


def weight_updater_release(original, weight_updater, recv_req, *args, **kwargs):
    """AROUND WeightUpdater.release_memory_occupation."""
    scheduler = weight_updater.scheduler
    if scheduler is not None:
        end_in_flight(scheduler)
        if not weight_updater.is_fully_idle(ignore_waiting=fork_touch.upstream(scheduler, "_engine_paused")):
            logger.error("pd_pause: not idle before release: %s", not_idle_reasons(scheduler))
    return original(weight_updater, recv_req, *args, **kwargs)


def report(scheduler) -> Dict[str, Any]:
    return {"paused": bool(fork_touch.upstream(scheduler, "_engine_paused")),
            "mode": scheduler_pause(scheduler).mode, "clock_paused": engine_clock.paused}


def poll_transfers_while_retracted(scheduler) -> list:
    """Decode's concluded transfers, popped (the patch: also while retracted requests stop new allocation)."""
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
            keep_abort_verdict(scheduler, recv_req)
        return result
    places = {stage for stage, r in pd_queues.walk(scheduler) if _matches(recv_req, r.rid)}
    places |= {"parked" for r in pd_queues.parked_reqs(scheduler) if _matches(recv_req, r.rid)}
    matched = [r for r in pd_queues.held_reqs(scheduler) if _matches(recv_req, r.rid)]
    logger.info("pd_pause: abort while paused (rid=%r, all=%s) found in %s",
                recv_req.rid, recv_req.abort_all, sorted(places))
    result = original(scheduler, recv_req, *args, **kwargs)
    sp.pump_until = time.monotonic() + ABORT_PUMP_WINDOW_S
    if _holds_in_batch(scheduler, recv_req):
        # a paused batch is answered after the next pass: upstream's retract settles it now ("Aborts while paused")
        mode = sp.mode
        scheduler.pause_generation(PauseGenerationReqInput(mode="retract"))
        sp.mode = mode
    if role == "decode":
        _abort_held_rebootstrap(scheduler, recv_req)
    keep_abort_verdict(scheduler, recv_req)
    pump_pd_queues(scheduler)
    if role == "prefill":
        end_prefill_rooms(scheduler, matched, verdict.PAUSED_ABORT_REASON)
    return result


def keep_abort_verdict(scheduler, recv_req) -> None:
    """A running request an abort reached answers the verdict it was marked with (room_ledger.before_abort_request),
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


def paused_loop_tick(result, scheduler, *args, **kwargs):
    """AFTER Scheduler._record_scheduler_state_for_paused_engine (each paused loop iteration): for a while after
    an abort keep retiring what it failed (late drain acks); otherwise answer prefill's legs whose transfer
    concluded, then wait for input instead of spinning."""
    from sglang.srt.managers.scheduler_components.idle_sleeper import IdleSleeper

    sp = scheduler_pause(scheduler)
    role = pd_queues.role(scheduler)
    if role is None:
        return result
    if any_rank(scheduler, not sp.released and bool(sp.pump_until) and time.monotonic() < sp.pump_until)[0]:
        pump_pd_queues(scheduler)  # on every rank, or on none: a pump runs the queues' poll collectives
        return result
    sp.pump_until = 0.0
    if role == pd_queues.PREFILL and not sp.released and scheduler.disagg_prefill_inflight_queue:
        # decode may re-send it under the same rid (docs/pause-release-resume.md, "Legs a paused prefill has sent")
        scheduler.process_disagg_prefill_inflight_queue()
    sleeper = fork_touch.upstream(scheduler, "idle_sleeper")
    if isinstance(sleeper, IdleSleeper):  # zmq sockets (not the Rust server's ring; without one the loop spins)
        fork_touch.upstream(sleeper, "poller").poll(PAUSED_INPUT_WAIT_MS)
    return result


def _holds_in_batch(scheduler, recv_req) -> bool:
    """The abort hits what only the next pass would retire: decode's batches, prefill's unprocessed last batch."""
    last = list(scheduler.last_batch.reqs) if scheduler.last_batch is not None else []
    if pd_queues.role(scheduler) == "prefill":
        reqs = last if scheduler.enable_overlap and scheduler.result_queue else []
    else:
        reqs = list(scheduler.running_batch.reqs) + last
    return any(_matches(recv_req, r.rid) for r in reqs)


def _matches(recv_req, rid: str) -> bool:
    return recv_req.abort_all or rid.startswith(recv_req.rid)


def _abort_held_rebootstrap(scheduler, recv_req) -> None:
    """Requests a retract pause holds for re-bootstrap own no KV; answer them."""
    from sglang.srt.disaggregation.utils import prepare_abort
    from sglang.srt.managers.scheduler import _make_abort_req

    prealloc = scheduler.disagg_decode_prealloc_queue
    matched = [r for r in prealloc.held_rebootstrap_reqs if _matches(recv_req, r.rid)]
    prealloc.held_rebootstrap_reqs = [r for r in prealloc.held_rebootstrap_reqs if r not in matched]
    for req in matched:
        prepare_abort(req, verdict.UPSTREAM_ABORT_MESSAGE)
        scheduler.send_abort_output(_make_abort_req(req, finished_reason=recv_req.finished_reason), req)


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
    message = verdict.pause_message(getattr(recv_req, "finished_reason", None))
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


# ----------------------------------------------------------------------------- the PD queues' buffers

def queue_resume(original, queue, *args, **kwargs):
    """AROUND {PrefillBootstrapQueue,DecodePreallocQueue}.resume_memory_occupation: the KV and metadata buffer
    addresses (moved while released?) re-read into kv_args first."""
    from sglang.srt.disaggregation.utils import get_kv_transfer_buf_infos

    kv_args = queue.kv_manager.kv_args
    draft = fork_touch.upstream(queue, "draft_token_to_kv_pool")
    ptrs: List[int] = list(get_kv_transfer_buf_infos(queue.token_to_kv_pool)[0])
    if draft is not None:
        ptrs += list(draft.get_contiguous_buf_infos()[0])
    aux = list(queue.metadata_buffers.get_buf_infos()[0])
    for name, now in (("kv_data_ptrs", ptrs), ("aux_data_ptrs", aux)):
        if len(now) == len(getattr(kv_args, name)) and now != list(getattr(kv_args, name)):
            setattr(kv_args, name, now)
            logger.info("pd_pause: %s changed across release; re-registering", name)
    # room state the peer re-created while this side was released belongs to no live request
    forget_orphan_rooms(queue.scheduler, queue.kv_manager)
    result = original(queue, *args, **kwargs)
    queue.kv_manager._fork_released = False  # registration_report
    scheduler_pause(queue.scheduler).released = False
    return result


def queue_release(original, queue, *args, **kwargs):
    """AROUND {PrefillBootstrapQueue,DecodePreallocQueue}.release_memory_occupation."""
    forget_orphan_rooms(queue.scheduler, queue.kv_manager)
    result = original(queue, *args, **kwargs)
    queue.kv_manager._fork_released = True  # registration_report
    scheduler_pause(queue.scheduler).released = True
    return result


def forget_orphan_rooms(scheduler, kv_manager) -> None:
    """Drop room state no live request owns (no transfer can run at release or resume)."""
    reqs = pd_queues.queued_reqs(scheduler) + list(scheduler.running_batch.reqs) + pd_queues.parked_reqs(scheduler)
    live = {fork_touch.upstream(r, "bootstrap_room") for r in reqs}
    tables = [t for name in pd_queues.ROOM_TABLES if isinstance(t := getattr(kv_manager, name, None), dict)]
    orphans = [(table, room) for table in tables for room in list(table) if room not in live]
    for table, room in orphans:
        table.pop(room, None)
    if orphans:
        logger.info("pd_pause: dropped %d room-table entries of ended requests", len(orphans))


def registration_report(kv_manager) -> Dict[str, Any]:
    """Regions this kv_manager has registered with the transfer engine right now (all but while released)."""
    regions = getattr(kv_manager, "_registerable_regions", None)  # mooncake's; none on fake
    n = 0 if regions is None or getattr(kv_manager, "_fork_released", False) else len(regions())
    return {"registered_regions": n, "kv_data_ptrs": list(kv_manager.kv_args.kv_data_ptrs)}


# ============================================================================= the tokenizer side

PAUSE_MODES = ("abort", "in_place", "retract")
# upstream's GPU_MEMORY_ALL_TYPES (sglang.srt.constants), in its order
KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
ALL_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)
# resumed with kv_cache alone: serving with graphs released would fault on a GPU (docs/pause-release-resume.md)
RESUMED_WITH_KV = (CUDA_GRAPH,)

RUNNING, PAUSED, RELEASED, RESUMED = "running", "paused", "released", "resumed"

_HINT = {
    RUNNING: "call pause_generation first",
    PAUSED: "call release_memory_occupation or continue_generation",
    RELEASED: "call resume_memory_occupation first",
    RESUMED: "call continue_generation",
}


class PauseStateError(HTTPException):
    """An out-of-order pause/release/resume/continue call (nothing changed): upstream's handlers answer 409."""

    def __init__(self, message: str):
        super().__init__(status_code=HTTPStatus.CONFLICT, detail=message)

    def __str__(self) -> str:
        return self.detail


class EnginePauseState:
    """The engine's pause state as the HTTP-facing process sees it (one per server)."""

    def __init__(self):
        self.mode: Optional[str] = None  # the active pause_generation's mode
        self.released: List[str] = []  # memory tags released, in release order
        self.auto_resumed: List[str] = []  # resumed with kv_cache, not by name
        self.released_in_pause = False  # a release happened during this pause
        self.gate_closed_by_release = False  # release without a pause closed the gate
        self.busy: Optional[str] = None  # operation in progress
        self.busy_mode: Optional[str] = None  # its pause mode

    @property
    def state(self) -> str:
        if self.released:
            return RELEASED
        if self.mode is not None:
            return RESUMED if self.released_in_pause else PAUSED
        return RUNNING

    def serving(self) -> bool:
        return self.mode is None and not self.released

    def named(self) -> str:
        return f"engine state is {self.state!r}" + (f" (pause mode {self.mode})" if self.mode else "")

    def _reject(self, op: str, why: str, hint: Optional[str] = None) -> None:
        tags = f" (released: {self.released})" if self.released else ""
        raise PauseStateError(f"{op} rejected: {why}; {self.named()}{tags}; {hint or _HINT[self.state]}")

    def check(self, op: str, mode: Optional[str] = None, tags: Optional[List[str]] = None,
              in_flight: "int | List[str]" = 0) -> None:
        """Raise PauseStateError (409) if `op` is not accepted now; change nothing."""
        if self.busy is not None:
            raise PauseStateError(f"{op} rejected: {self.busy} is in progress (engine state: {self.state})")
        if op == "pause_generation":
            if mode not in PAUSE_MODES:
                self._reject(op, f"unknown mode {mode!r}, expected one of {list(PAUSE_MODES)}")
            if self.mode is not None and mode != self.mode:
                self._reject(op, f"already paused in mode {self.mode!r}",
                             "call continue_generation before pausing in another mode")
        elif op == "release_memory_occupation":
            again = [t for t in tags or ALL_TAGS if t in self.released]
            if again:
                self._reject(op, f"{again} already released")
            if self.mode is None and in_flight:
                count, named = (in_flight, "") if isinstance(in_flight, int) else (
                    len(in_flight), f" ({', '.join(map(str, in_flight[:4]))}{', ...' if len(in_flight) > 4 else ''})")
                self._reject(op, f"{count} request(s) in flight{named} and no pause (upstream's scheduler asserts "
                             "it is idle)", "call pause_generation first, or wait until they finish")
        elif op == "resume_memory_occupation":
            named = self.resume_named(tags)
            unknown = [t for t in named if t not in self.released and t not in self.auto_resumed]
            if not named:
                self._reject(op, "nothing is released")
            if unknown:
                self._reject(op, f"{unknown} not released", f"resume only released tags {self.released}")

    def resume_named(self, tags: Optional[List[str]]) -> List[str]:
        """A resume without tags resumes whatever is released (upstream would fail on the first one not released)."""
        return list(tags) if tags else list(self.released)

    def to_resume(self, tags: List[str]) -> List[str]:
        """The tags upstream's resume must be given for a resume of `tags`."""
        out = [t for t in tags if t in self.released]
        if KV_CACHE in out:
            out += [t for t in RESUMED_WITH_KV if t in self.released and t not in out]
        return out

    def done(self, op: str, mode: Optional[str] = None, tags: Optional[List[str]] = None) -> None:
        if op == "pause_generation":
            self.mode = mode
        elif op == "continue_generation":
            self.mode = None
            self.released_in_pause = False
            # Memory still released: the pause ends, requests stay held until the resume that serves again (as
            # after a release without a pause; the scheduler continues then).
            self.gate_closed_by_release = bool(self.released)
        elif op == "release_memory_occupation":
            self.released += [t for t in tags or ALL_TAGS if t not in self.released]  # none: all (upstream's default)
            self.auto_resumed = [t for t in self.auto_resumed if t not in self.released]
            if self.mode is not None:
                self.released_in_pause = True
        elif op == "resume_memory_occupation":
            named = self.resume_named(tags)
            resumed = self.to_resume(named)
            self.auto_resumed = [t for t in self.auto_resumed if t not in named]
            self.auto_resumed += [t for t in resumed if t not in named]
            self.released = [t for t in self.released if t not in resumed]

    def as_dict(self) -> Dict[str, Any]:
        return {"state": self.state, "mode": self.mode, "released": list(self.released), "busy": self.busy}


def _state_of(tokenizer_manager) -> EnginePauseState:
    return tokenizer_manager.__dict__.setdefault("_fork_pause_state", EnginePauseState())


async def _set_gate(tokenizer_manager, closed: Optional[bool] = None) -> None:
    """Close or open the pause gate (None: leave it as it is) and wake its waiters to look again."""
    async with tokenizer_manager.is_pause_cond:
        if closed is not None:
            tokenizer_manager.is_pause = closed
        tokenizer_manager.is_pause_cond.notify_all()


def _guarded(op: str):
    async def around(original, tokenizer_manager, obj, *args, **kwargs):
        state = _state_of(tokenizer_manager)
        mode = obj.mode if op == "pause_generation" else None
        tags = getattr(obj, "tags", None)
        if op == "continue_generation" and state.serving():
            return None  # not paused: nothing to continue (upstream: a no-op too)
        if op == "pause_generation" and state.mode is not None and mode == state.mode:
            return None  # already paused in this mode: a no-op
        state.check(op, mode, tags)
        if op == "release_memory_occupation" and state.mode is None:
            # Only a release without a pause counts what is in flight; checked again after the wait (busy may change)
            state.check(op, mode, tags, await client_requests_settled(tokenizer_manager, RELEASE_SETTLE_S))
            tokenizer_manager.is_pause = state.gate_closed_by_release = True  # hold new requests (no await since check)
        if op == "resume_memory_occupation":
            obj.tags = state.to_resume(state.resume_named(tags))
        if op == "continue_generation" and state.released:
            state.done(op)  # the scheduler stays paused (its memory is released) until that resume
            return None
        state.busy, state.busy_mode = op, mode
        try:
            result = None  # a resume of tags already resumed with kv_cache only is a no-op
            if op != "resume_memory_occupation" or obj.tags:
                pausing = _ABORT_PAUSE.set(tokenizer_manager if op == "pause_generation" else None)
                try:
                    result = await original(tokenizer_manager, obj, *args, **kwargs)
                finally:
                    _ABORT_PAUSE.reset(pausing)
            if op == "pause_generation" and mode == "abort":
                # Upstream ends every request in the tokenizer only: tell the scheduler, so it pauses too.
                await tokenizer_manager._async_dispatch_to_scheduler(obj)
        except BaseException:
            if op == "release_memory_occupation" and not state.released and state.mode is None:
                state.gate_closed_by_release = False
                await _set_gate(tokenizer_manager, False)
            raise
        finally:
            state.busy = state.busy_mode = None
        state.done(op, mode, tags)
        if op == "pause_generation":
            state.gate_closed_by_release = False  # the pause owns the gate now
        if state.gate_closed_by_release and state.serving():
            # Everything resumed after a release without a pause: serve again (scheduler: a no-op unless retracted).
            state.gate_closed_by_release = False
            await tokenizer_manager._async_dispatch_to_scheduler(ContinueGenerationReqInput(torch_empty_cache=False))
            await _set_gate(tokenizer_manager, False)
        return result

    return around


tm_pause_generation = _guarded("pause_generation")
tm_continue_generation = _guarded("continue_generation")
tm_release_memory_occupation = _guarded("release_memory_occupation")
tm_resume_memory_occupation = _guarded("resume_memory_occupation")


# A release without a pause waits this long for client requests whose answer is decided but not yet read by the
# tokenizer (a flush answered 200 means the scheduler is idle; its last outputs may still be on their way).
RELEASE_SETTLE_S = 1.0


def _client_states(tokenizer_manager) -> List[Tuple[str, Any]]:
    """(rid, state) of the requests in the tokenizer that a client sent: health probes aside (`/health`,
    `/health_generate` put one in rid_to_state for about a second)."""
    return [(rid, s) for rid, s in list(tokenizer_manager.rid_to_state.items())
            if not str(rid).startswith(HEALTH_CHECK_RID_PREFIX)]


def client_requests_running(tokenizer_manager) -> List[str]:
    """Rids of requests a client sent that are still running: not a health probe (the scheduler ends one on
    release), not answered, not held at the pause gate (nothing of it reached the scheduler)."""
    return [rid for rid, s in _client_states(tokenizer_manager) if not s.finished and not s.__dict__.get(_AT_GATE)]


async def client_requests_settled(tokenizer_manager, timeout: float) -> List[str]:
    """Client requests still running after waiting up to `timeout` for them to end (bounded poll)."""
    deadline = time.monotonic() + timeout
    while True:
        running = client_requests_running(tokenizer_manager)
        if not running or time.monotonic() >= deadline:
            return running
        await asyncio.sleep(0.01)


def pause_reason(tokenizer_manager) -> Optional[str]:
    """Why the pause gate is closed now: 'pause' or 'release' (None: open)."""
    state = _state_of(tokenizer_manager)
    if state.mode is not None or state.busy == "pause_generation":
        return "pause"
    if state.released or state.gate_closed_by_release:
        return "release"
    return None


def alive_while_held(tokenizer_manager) -> bool:
    """/health and /health_generate answer 200 at once while the engine holds requests on purpose (a pause or a
    release; docs/pause-release-resume.md). Called by the http_server patch (the health route and its wait loop)."""
    return bool(tokenizer_manager.is_pause) or pause_reason(tokenizer_manager) is not None


def name_state_if_pause_call(route_path: str, message: str, global_state: Any) -> str:
    """The 400 for an invalid pause_generation body names the engine state too, like the 409s (http_server patch)."""
    tokenizer_manager = getattr(global_state, "tokenizer_manager", None)
    if route_path != "/pause_generation" or tokenizer_manager is None:
        return message
    return (f"pause_generation rejected: {_state_of(tokenizer_manager).named()}; expected mode one of "
            f"{list(PAUSE_MODES)}; nothing changed. {message}")


# around_is_locked waits this long for every answer decided or the lock free (docs/pause-release-resume.md), not
# upstream's loop's 1 s sleep: a drain of 0.9-1.9 s would pay the full sleep on top.
DRAIN_WAIT_S = 3.0
# The tokenizer manager whose pause_generation runs in this task (None elsewhere).
_ABORT_PAUSE: contextvars.ContextVar = contextvars.ContextVar("fork_abort_pause", default=None)


async def _lock_free(lock) -> None:
    cond, upstream = fork_touch.upstream(lock, "_cond"), fork_touch.upstream
    async with cond:  # upstream's is_locked condition, read under the lock's own asyncio lock
        await cond.wait_for(lambda: not (upstream(lock, "_writer_active") or upstream(lock, "_readers") > 0))


def _undecided_client_requests(tokenizer_manager) -> List[Any]:
    """States of requests past the pause gate whose answer is not decided, health probes aside: a busy scheduler
    drops a probe (upstream: "ongoing requests already carry health info"), so it is never answered; its
    /health(_generate) handler holds it, and the model-update reader lock, until its 1 s sleep ends, and the
    abort_all sent before the pause's answer ends it too if it did reach the scheduler."""
    return [s for _, s in _client_states(tokenizer_manager) if s.__dict__.get(_AT_GATE) is False]


def _retrieved(future: "asyncio.Future") -> None:
    """Done callback of a gather the wait cancels: its CancelledError is read, not logged as never retrieved."""
    if not future.cancelled():
        future.exception()


async def _answers_decided(tokenizer_manager, lock_free, timeout: float) -> bool:
    """Wait at most `timeout` until the lock is free (False) or every client request past the gate has its answer
    decided (True; one arriving during the pause passes the gate only after continue; health probes never count:
    `_undecided_client_requests`), woken by the requests' output events; a state with an output not yet consumed
    (a stream's chunk) leaves the lock as the only criterion."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not lock_free.done():
        pending = None if tokenizer_manager is None else _undecided_client_requests(tokenizer_manager)
        if pending == []:
            return True
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            return False
        events = [fork_touch.upstream(s, "event") for s in pending or ()]
        if pending is None or any(e.is_set() for e in events):
            await asyncio.wait([lock_free], timeout=remaining)
            return False
        outputs = asyncio.gather(*(e.wait() for e in events))
        try:
            await asyncio.wait([lock_free, outputs], timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        finally:
            outputs.add_done_callback(_retrieved)
            outputs.cancel()
    return False


async def around_is_locked(original, lock, *args, **kwargs):
    """AROUND sglang.srt.utils.aio_rwlock.RWLock.is_locked: True only if still locked and answers undecided."""
    if not await original(lock, *args, **kwargs):
        return False
    lock_free = asyncio.ensure_future(_lock_free(lock))
    try:
        if await _answers_decided(_ABORT_PAUSE.get(), lock_free, DRAIN_WAIT_S):
            return False
    finally:
        lock_free.cancel()
    return await original(lock, *args, **kwargs)


# ----------------------------------------------------------------------------- a retract's re-send (prefill)

# A re-send of a first leg this tokenizer still holds waits for its end at most this long (upstream: 400 "Duplicate
# request ID detected"; docs/pause-release-resume.md, "Legs a paused prefill has sent")
REBOOTSTRAP_WAIT_S = 30.0
_REBOOTSTRAP_WAITING = "_fork_rebootstrap_waiting"  # on the tokenizer manager: re-sends waiting now


def tm_generate_request(original, tokenizer_manager, obj, *args, **kwargs):
    """AROUND TokenizerManager.generate_request: a prefill's re-send of a room whose first leg it still holds waits
    for that leg (every other request gets upstream's generator itself)."""
    rid, room = getattr(obj, "rid", None), getattr(obj, "bootstrap_room", None)
    first = tokenizer_manager.rid_to_state.get(rid) if isinstance(rid, str) and room is not None else None
    if first is None or getattr(first.obj, "bootstrap_room", None) != room or \
            str(tokenizer_manager.disaggregation_mode.value) != pd_queues.PREFILL:
        return original(tokenizer_manager, obj, *args, **kwargs)
    return _after_first_leg(original, tokenizer_manager, obj, first, *args, **kwargs)


async def _after_first_leg(original, tokenizer_manager, obj, first, *args, **kwargs):
    loop, states = asyncio.get_running_loop(), tokenizer_manager.rid_to_state
    event = fork_touch.upstream(first, "event")
    deadline = loop.time() + REBOOTSTRAP_WAIT_S
    tokenizer_manager.__dict__[_REBOOTSTRAP_WAITING] = tokenizer_manager.__dict__.get(_REBOOTSTRAP_WAITING, 0) + 1
    logger.info("pd_pause: re-send of rid=%s (room %s) waits for its first leg", obj.rid, obj.bootstrap_room)
    try:
        while states.get(obj.rid) is first and (remaining := deadline - loop.time()) > 0:
            if event.is_set():  # an output its own handler has not taken yet
                await asyncio.sleep(min(0.01, remaining))
            else:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)
    finally:
        tokenizer_manager.__dict__[_REBOOTSTRAP_WAITING] -= 1
    generator = original(tokenizer_manager, obj, *args, **kwargs)
    try:
        async for out in generator:
            yield out
    finally:
        await generator.aclose()


def fresh_connection_per_resend(session, mgr, *args, **kwargs):
    """AFTER CommonKVManager._get_prefill_recompute_session (decode's re-bootstrap pool): each re-send opens its own
    connection, never a pooled one prefill's server is closing as idle (uvicorn's keep-alive: reset, 500)."""
    session.headers["Connection"] = "close"
    return session


# ----------------------------------------------------------------------------- the pause gate

_MARK = "_fork_gate_abort"  # on a ReqState: the abort's message
_AT_GATE = "_fork_at_gate"  # on a ReqState: waiting at the pause gate now


def tm_abort_request(original, tokenizer_manager, rid: str = "", abort_all: bool = False, *args, **kwargs):
    """AROUND TokenizerManager.abort_request: requests held at the pause gate are answered now, except by the
    abort_all a pause_generation repeats (as upstream: served after continue). The abort_all an abort-mode pause
    repeats goes out named (the pause's message, end cause pause) instead of upstream's bare one, so a bare
    abort_all is always a client's: the scheduler answers what it reaches as the client's (keep_abort_verdict)."""
    state = _state_of(tokenizer_manager)
    pausing = abort_all and state.busy == "pause_generation"
    if pausing and state.busy_mode == "abort":
        tokenizer_manager._dispatch_to_scheduler(AbortReq(abort_all=True, finished_reason=pause_finish_reason()))
        return None
    result = original(tokenizer_manager, rid, abort_all, *args, **kwargs)
    if not tokenizer_manager.is_pause or pausing:
        return result
    where = ("while the engine memory was released" if pause_reason(tokenizer_manager) == "release"
             else "while the engine was paused")
    why = f"Aborted by {'abort_all' if abort_all else 'the client'} {where} (rid={{rid}})."
    hits = {state_rid: s for state_rid, s in list(tokenizer_manager.rid_to_state.items())
            if (abort_all or state_rid == rid) and getattr(s, _MARK, None) is None}
    for state_rid, s in hits.items():
        setattr(s, _MARK, why.format(rid=state_rid))
    logger.info("pd_pause: abort while paused (rid=%r, all=%s): %s", rid, abort_all,
                "waking the pause gate" if hits else "no request state")
    if hits:
        asyncio.get_running_loop().create_task(_set_gate(tokenizer_manager))
    return result


def gate_open(tokenizer_manager, request_states: Dict[str, Any]) -> bool:
    """The pause gate of generate_request: open when not paused, or for an aborted request (notes who waits)."""
    is_open = not tokenizer_manager.is_pause or gate_aborted(request_states)
    for state in request_states.values():
        state.__dict__[_AT_GATE] = not is_open
    return is_open


async def tm_internal_state(original, tokenizer_manager, *args, **kwargs):
    """AROUND TokenizerControlMixin.get_internal_state: each resource report counts the requests at the gate."""
    states = await original(tokenizer_manager, *args, **kwargs)
    held = sum(1 for state in list(tokenizer_manager.rid_to_state.values()) if state.__dict__.get(_AT_GATE))
    for state in states:
        report = state.get("fork_pd_resources") if isinstance(state, dict) else None
        if isinstance(report, dict):
            report["pause_gate_held"] = held
            report["engine_state"] = _state_of(tokenizer_manager).as_dict()  # the HTTP side's pause state
            report["rebootstrap_waiting"] = tokenizer_manager.__dict__.get(_REBOOTSTRAP_WAITING, 0)
    return states


def gate_aborted(request_states: Dict[str, Any]) -> bool:
    return any(getattr(s, _MARK, None) is not None for s in request_states.values())


def gate_abort_answers(tokenizer_manager, obj: Any, request_states: Dict[str, Any]) -> List[Any]:
    """What generate_request yields for a request aborted at the gate (its states are dropped: nothing was sent to
    the scheduler). A batch ends whole: sub-requests not aborted by name get the same abort."""
    first = next(getattr(s, _MARK) for s in request_states.values() if getattr(s, _MARK, None) is not None)
    outs = []
    for index, (rid, state) in enumerate(request_states.items()):
        if tokenizer_manager.rid_to_state.get(rid) is state:
            del tokenizer_manager.rid_to_state[rid]
        reason = {"type": "abort", "message": getattr(state, _MARK, None) or first, "status_code": None}
        meta = {"id": rid, "finish_reason": reason, "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
                "e2e_latency": 0.0}
        out = {"text": "", "output_ids": [], "meta_info": meta}  # upstream's answer to an abort that produced nothing
        if not obj.is_single:
            out["index"] = index
        outs.append(out)
    # Decode's copy ends here; its prefill copy must not wait for a handshake.
    room_ledger.ended_at_gate(tokenizer_manager.disaggregation_mode, obj, first)
    return outs if obj.is_single or getattr(obj, "stream", False) else [outs]
