"""The tokenizer side of pause/release/resume/continue (the HTTP process's event loop).

Which call the engine accepts in which state: every sequence upstream answers 200 on an
idle engine is accepted with upstream's effect; a call upstream cannot survive is answered
409 naming the state and the call to make, and changes nothing (docs/pause-release-resume.md).
The pause gate: a request aborted while it waits there leaves at once with upstream's abort
answer (200, finish_reason "abort", a message naming the client or abort_all and the pause
or the release). Also /health while held, the abort-mode pause's wait for its aborted
requests. Who calls: hooks in fork_plugin.HOOKS, the tokenizer_manager patch (`gate_open`,
`gate_aborted`, `gate_abort_answers`) and the http_server patches. The scheduler side is
`pd_pause`.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from http import HTTPStatus
from typing import Any, Callable, Dict, List, Optional

from fastapi import HTTPException

from sglang.srt.disaggregation import room_ledger
from sglang.srt.managers import fork_touch

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "in_place", "retract")
# upstream's GPU_MEMORY_ALL_TYPES (sglang.srt.constants), in its order
KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
ALL_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)
# Released cuda graphs go back with the KV cache when the caller resumes kv_cache alone
# (the loop weights -> kv_cache after a release of everything): serving with graphs
# released would fault on a GPU. A later resume of cuda_graph is then a no-op.
RESUMED_WITH_KV = (CUDA_GRAPH,)

RUNNING, PAUSED, RELEASED, RESUMED = "running", "paused", "released", "resumed"

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

    def _reject(self, op: str, why: str, hint: Optional[str] = None) -> None:
        mode = f" (pause mode {self.mode})" if self.mode else ""
        tags = f" (released: {self.released})" if self.released else ""
        raise PauseStateError(
            f"{op} rejected: {why}; engine state is {self.state!r}{mode}{tags}; "
            f"{hint or _HINT[self.state]}"
        )

    def check(self, op: str, mode: Optional[str] = None, tags: Optional[List[str]] = None,
              in_flight: int = 0) -> None:
        """Raise PauseStateError (409) if `op` is not accepted now; change nothing."""
        if self.busy is not None:
            raise PauseStateError(
                f"{op} rejected: {self.busy} is in progress (engine state: {self.state})"
            )
        if op == "pause_generation":
            if mode not in PAUSE_MODES:
                self._reject(op, f"unknown mode {mode!r}, expected one of {list(PAUSE_MODES)}")
            if self.mode is not None and mode != self.mode:
                self._reject(op, f"already paused in mode {self.mode!r}",
                             "call continue_generation before pausing in another mode")
        elif op == "release_memory_occupation":
            again = [t for t in tags_of_list(tags) if t in self.released]
            if again:
                self._reject(op, f"{again} already released")
            if self.mode is None and in_flight:
                self._reject(
                    op,
                    f"{in_flight} request(s) in flight and no pause (upstream's scheduler "
                    "asserts it is idle)",
                    "call pause_generation first, or wait until they finish",
                )
        elif op == "resume_memory_occupation":
            named = self.resume_named(tags)
            unknown = [t for t in named
                       if t not in self.released and t not in self.auto_resumed]
            if not named:
                self._reject(op, "nothing is released")
            if unknown:
                self._reject(op, f"{unknown} not released",
                             f"resume only released tags {self.released}")
        elif op == "continue_generation":
            if self.released:
                self._reject(op, "memory is released")

    def resume_named(self, tags: Optional[List[str]]) -> List[str]:
        """A resume without tags resumes whatever is released (upstream would try
        every tag and fail on the first one not released)."""
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
        elif op == "release_memory_occupation":
            self.released += [t for t in tags_of_list(tags) if t not in self.released]
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
        return {"state": self.state, "mode": self.mode, "released": list(self.released),
                "busy": self.busy}


def tags_of_list(tags: Optional[List[str]]) -> List[str]:
    """The tags a release/resume call names; none means all (upstream's default)."""
    return list(tags) if tags else list(ALL_TAGS)


def _state_of(tokenizer_manager) -> EnginePauseState:
    state = getattr(tokenizer_manager, "_fork_pause_state", None)
    if state is None:
        state = tokenizer_manager._fork_pause_state = EnginePauseState()
    return state


async def _set_gate(tokenizer_manager, closed: bool) -> None:
    async with tokenizer_manager.is_pause_cond:
        tokenizer_manager.is_pause = closed
        if not closed:
            tokenizer_manager.is_pause_cond.notify_all()


def _guarded(op: str, mode_of: Callable[[Any], Optional[str]] = lambda obj: None):
    async def around(original, tokenizer_manager, obj, *args, **kwargs):
        state = _state_of(tokenizer_manager)
        mode = mode_of(obj)
        tags = getattr(obj, "tags", None)
        if op == "continue_generation" and state.mode is None and not state.released:
            return None  # not paused: nothing to continue (upstream: a no-op too)
        if op == "pause_generation" and state.mode is not None and mode == state.mode:
            return None  # already paused in this mode: a no-op
        if op == "release_memory_occupation" and state.mode is None:
            # No pause: hold new requests at the pause gate first, then check (no
            # await between) that nothing is in flight.
            closing = not state.gate_closed_by_release
            if closing:
                tokenizer_manager.is_pause = True
            try:
                state.check(op, mode, tags, len(tokenizer_manager.rid_to_state))
            except PauseStateError:
                if closing:
                    await _set_gate(tokenizer_manager, False)
                raise
            state.gate_closed_by_release = True
        else:
            state.check(op, mode, tags)
        if op == "resume_memory_occupation":
            obj.tags = state.to_resume(state.resume_named(tags))
        state.busy, state.busy_mode = op, mode
        try:
            if op != "resume_memory_occupation" or obj.tags:
                pausing = _ABORT_PAUSE.set(tokenizer_manager if op == "pause_generation" else None)
                try:
                    result = await original(tokenizer_manager, obj, *args, **kwargs)
                finally:
                    _ABORT_PAUSE.reset(pausing)
            else:
                result = None  # only tags already resumed with kv_cache: a no-op
            if op == "pause_generation" and mode == "abort":
                # Upstream ends every request in the tokenizer and never tells the
                # scheduler; tell it now, so it pauses (and its clock stops) too.
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
            # Everything resumed after a release without a pause: serve again. The
            # scheduler is told too (a no-op unless release had to retract).
            state.gate_closed_by_release = False
            from sglang.srt.managers.io_struct import ContinueGenerationReqInput

            await tokenizer_manager._async_dispatch_to_scheduler(ContinueGenerationReqInput(torch_empty_cache=False))
            await _set_gate(tokenizer_manager, False)
        return result

    return around


def tm_pause_abort_first(tokenizer_manager, rid: str = "", abort_all: bool = False, *args, **kwargs):
    """BEFORE TokenizerManager.abort_request: the abort_all that upstream's abort-mode
    pause_generation repeats carries no reason, so the scheduler would end what runs
    as a client abort ("Aborted", end cause client_abort). The pause's own abort_all
    goes first: what it reaches ends with the pause's message and end cause "pause";
    upstream's then finds it aborted already."""
    state = _state_of(tokenizer_manager)
    if not abort_all or state.busy != "pause_generation" or state.busy_mode != "abort":
        return None
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.pd_pause import pause_finish_reason

    tokenizer_manager._dispatch_to_scheduler(
        AbortReq(abort_all=True, finished_reason=pause_finish_reason())
    )
    return None


tm_pause_generation = _guarded("pause_generation", lambda obj: obj.mode)
tm_continue_generation = _guarded("continue_generation")
tm_release_memory_occupation = _guarded("release_memory_occupation")
tm_resume_memory_occupation = _guarded("resume_memory_occupation")


def pause_reason(tokenizer_manager) -> Optional[str]:
    """Why the pause gate is closed now: 'pause' or 'release' (None: open)."""
    state = _state_of(tokenizer_manager)
    if state.mode is not None or state.busy == "pause_generation":
        return "pause"
    if state.released or state.gate_closed_by_release:
        return "release"
    return None


def alive_while_held(tokenizer_manager) -> bool:
    """/health and /health_generate answer 200 at once while the engine holds requests on
    purpose (a pause or a release; docs/pause-release-resume.md, "Health during a pause or
    a release"). Called by the http_server patch (the health route and its wait loop)."""
    return bool(tokenizer_manager.is_pause) or pause_reason(tokenizer_manager) is not None


def name_state_if_pause_call(route_path: str, message: str, global_state: Any) -> str:
    """The 400 for an invalid pause_generation body (rejected by request validation) names
    the engine state too, like the 409s. Called from upstream's validation error handler (a patch)."""
    tokenizer_manager = getattr(global_state, "tokenizer_manager", None)
    if route_path != "/pause_generation" or tokenizer_manager is None:
        return message
    state = _state_of(tokenizer_manager)
    mode = f" (pause mode {state.mode})" if state.mode else ""
    return (
        f"pause_generation rejected: engine state is {state.state!r}{mode}; expected "
        f"mode one of {list(PAUSE_MODES)}; nothing changed. {message}"
    )


# The abort-mode pause returns as soon as the answer of every request it ended is decided:
# upstream's loop (abort_all, `model_update_lock.is_locked()`, sleep 1 s) gets False on its
# first check once no request past the pause gate is left in the tokenizer's table (a
# finished request leaves it, its answer handed to its HTTP handler, before that handler
# wakes), or once the lock is free, as this hook waits up to DRAIN_WAIT_S for either. The
# handlers still writing their answers hold the reader lock a moment longer; nothing they
# do reads the weights (why that is safe for RL clients: bench/README.md). A request past
# the gate whose answer is not decided (still tokenizing, or sent after the abort_all)
# keeps the pause waiting, as upstream's lock check does. Upstream calls is_locked only
# from the abort-mode pause loops of tokenizer_manager and multi_tokenizer_mixin.
# 3 s, not under upstream's 1 s: a drain of 0.9-1.9 s would otherwise pay the full sleep on top.
DRAIN_WAIT_S = 3.0
# The tokenizer manager whose pause_generation runs in this task (None elsewhere).
_ABORT_PAUSE: contextvars.ContextVar = contextvars.ContextVar("fork_abort_pause", default=None)


def _lock_held(lock) -> bool:
    """upstream's is_locked condition, read under the lock's own asyncio lock."""
    return bool(fork_touch.upstream(lock, "_writer_active") or fork_touch.upstream(lock, "_readers") > 0)


async def _lock_free(lock) -> None:
    cond = fork_touch.upstream(lock, "_cond")
    async with cond:
        await cond.wait_for(lambda: not _lock_held(lock))


def _undecided(tokenizer_manager) -> List[Any]:
    """The request states past the pause gate still waiting for their answer. One that has
    not reached the gate yet (no mark: e.g. arrived during the pause, waiting for the
    gate's lock the pause holds) can only pass it after continue, or answered at it."""
    return [s for s in list(tokenizer_manager.rid_to_state.values()) if s.__dict__.get(_AT_GATE) is False]


async def _answers_decided(tokenizer_manager, lock_free, timeout: float) -> bool:
    """Wait until the lock is free (False) or every answer is decided (True), at most
    `timeout`. Woken by the requests' own output events; a state with an output not yet
    consumed (a stream's chunk) leaves the lock as the only criterion."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not lock_free.done():
        pending = _undecided(tokenizer_manager) if tokenizer_manager is not None else None
        if pending == []:
            return True
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        events = [fork_touch.upstream(s, "event") for s in pending or ()]
        if pending is None or any(e.is_set() for e in events):
            await asyncio.wait([lock_free], timeout=remaining)
            return False
        outputs = asyncio.gather(*(e.wait() for e in events))
        try:
            await asyncio.wait([lock_free, outputs], timeout=remaining,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            outputs.cancel()
    return False


async def around_is_locked(original, lock, *args, **kwargs):
    """AROUND sglang.srt.utils.aio_rwlock.RWLock.is_locked."""
    if not await original(lock, *args, **kwargs):
        return False
    lock_free = asyncio.ensure_future(_lock_free(lock))
    try:
        if await _answers_decided(_ABORT_PAUSE.get(), lock_free, DRAIN_WAIT_S):
            return False
    finally:
        lock_free.cancel()
    return await original(lock, *args, **kwargs)


# ----------------------------------------------------------------------------- the pause gate

_MARK = "_fork_gate_abort"  # on a ReqState: the abort's message
_AT_GATE = "_fork_at_gate"  # on a ReqState: waiting at the pause gate now


def tm_abort_request(result, tokenizer_manager, rid: str = "", abort_all: bool = False):
    """AFTER TokenizerManager.abort_request: requests held at the pause gate are
    answered now, not after continue_generation. Not for the abort_all an abort-mode
    pause_generation repeats: as upstream, what waits at the gate is served after
    continue (answering one server's copy of a PD request would leave the other's going)."""
    if not tokenizer_manager.is_pause or (
        abort_all and _state_of(tokenizer_manager).busy == "pause_generation"
    ):
        return result
    where = ("while the engine memory was released" if pause_reason(tokenizer_manager) == "release"
             else "while the engine was paused")
    why = f"Aborted by {'abort_all' if abort_all else 'the client'} {where} (rid={{rid}})."
    hit = False
    for state_rid, state in list(tokenizer_manager.rid_to_state.items()):
        if (abort_all or state_rid == rid) and getattr(state, _MARK, None) is None:
            setattr(state, _MARK, why.format(rid=state_rid))
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
    """The pause gate of generate_request: open when not paused, or for an aborted
    request. Each evaluation notes whether the request waits at the gate."""
    is_open = not tokenizer_manager.is_pause or gate_aborted(request_states)
    for state in request_states.values():
        state.__dict__[_AT_GATE] = not is_open
    return is_open


async def tm_internal_state(original, tokenizer_manager, *args, **kwargs):
    """AROUND TokenizerControlMixin.get_internal_state: each scheduler's resource
    report also says how many requests wait at this tokenizer's pause gate."""
    states = await original(tokenizer_manager, *args, **kwargs)
    held = sum(1 for state in list(tokenizer_manager.rid_to_state.values()) if state.__dict__.get(_AT_GATE))
    for state in states:
        report = state.get("fork_pd_resources") if isinstance(state, dict) else None
        if isinstance(report, dict):
            report["pause_gate_held"] = held
    return states


def gate_aborted(request_states: Dict[str, Any]) -> bool:
    return any(getattr(s, _MARK, None) is not None for s in request_states.values())


def abort_output(rid: str, message: str) -> Dict[str, Any]:
    """Upstream's answer to an aborted request that produced nothing."""
    return {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "abort", "message": message, "status_code": None},
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "e2e_latency": 0.0,
        },
    }


def gate_abort_answers(tokenizer_manager, obj: Any, request_states: Dict[str, Any]) -> List[Any]:
    """What generate_request yields for a request aborted at the gate (its states are
    dropped: nothing was sent to the scheduler). A batch ends whole: sub-requests not
    aborted by name are answered with the same abort."""
    first = next(getattr(s, _MARK) for s in request_states.values()
                 if getattr(s, _MARK, None) is not None)
    outs = []
    for index, (rid, state) in enumerate(request_states.items()):
        if tokenizer_manager.rid_to_state.get(rid) is state:
            del tokenizer_manager.rid_to_state[rid]
        out = abort_output(rid, getattr(state, _MARK, None) or first)
        if not obj.is_single:
            out["index"] = index
        outs.append(out)
    # Decode's copy ends here; its prefill copy must not wait for a handshake.
    room_ledger.ended_at_gate(tokenizer_manager.disaggregation_mode, obj, first)
    if obj.is_single or getattr(obj, "stream", False):
        return outs
    return [outs]
