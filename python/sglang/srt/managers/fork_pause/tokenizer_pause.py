"""The tokenizer's pause calls (docs/pause-release-resume.md): pause / release / resume / continue checked against
the engine pause state (409s), the pause gate closed and opened around them, the abort-mode pause's wait for the
answers it decided (`around_is_locked`), and the tokenizer's part of the resource report.

Invariant: a release or resume naming a tag upstream has no memory for is a 400 before anything else
(`memory_tags`); a call upstream would fail on never reaches upstream (`EnginePauseState.check`: a 409, nothing changed);
its change is recorded only once upstream answered. The tokenizer's event loop only (single-threaded, no lock); the
state is `engine_pause_state`'s, the gate `pause_gate`'s, the re-send count `resend_wait`'s."""

from __future__ import annotations

import asyncio
import contextvars

from sglang.srt.managers.fork_core import fork_touch
from sglang.srt.managers.fork_pause.engine_pause_state import (
    CONTINUE, PAUSE, RELEASE, RESUME, Effect, memory_tags, state_of,
)
from sglang.srt.managers.fork_pause.pause_gate import gate_of
from sglang.srt.managers.fork_pause.resend_wait import resend_wait_of
from sglang.srt.managers.io_struct import ContinueGenerationReqInput

# A release without a pause waits this long for client requests whose answer is decided but not yet read by the
# tokenizer (a flush answered 200 means the scheduler is idle; its last outputs may still be on their way).
RELEASE_SETTLE_S = 1.0


def _guarded(op: str):
    """AROUND the tokenizer manager's `op`: the engine pause state's row for it decides (a no-op answered at once,
    a 409 changing nothing, a local transition, or upstream's call and then the transition); the gate is closed by
    a release without a pause and opened by the resume that serves again."""

    async def around(original, tokenizer_manager, obj, *args, **kwargs):
        state, gate = state_of(tokenizer_manager), gate_of(tokenizer_manager)
        mode = obj.mode if op == PAUSE else None
        tags = None
        if op in (RELEASE, RESUME):
            obj.tags = tags = memory_tags(op, obj.tags)  # an unknown tag: a 400 before anything is checked or changed
        if state.is_noop(op, mode):
            return None  # continue while serving, a pause in the pause's mode (upstream: no-ops too)
        state.check(op, mode, tags)
        row = state.row(op, mode, tags)
        if row.counts_in_flight:
            # A release without a pause counts what is in flight; checked again after the wait (the state may move)
            state.check(op, mode, tags, await gate.client_requests_settled(RELEASE_SETTLE_S))
            tokenizer_manager.is_pause = True  # hold new requests (no await since the check)
        if op == RESUME:
            obj.tags = state.to_resume(state.resume_named(tags))
        if row.effect is Effect.LOCAL:
            state.done(op)  # continue while released: the scheduler stays paused until the resume that serves again
            return None
        state.begin(op, mode)
        try:
            result = None  # a resume of tags already resumed with kv_cache only is a no-op
            if op != RESUME or obj.tags:
                pausing = _ABORT_PAUSE.set(tokenizer_manager if op == PAUSE else None)
                try:
                    result = await original(tokenizer_manager, obj, *args, **kwargs)
                finally:
                    _ABORT_PAUSE.reset(pausing)
            if op == PAUSE and mode == "abort":
                # Upstream ends every request in the tokenizer only: tell the scheduler, so it pauses too.
                await tokenizer_manager._async_dispatch_to_scheduler(obj)
        except BaseException:
            if op == RELEASE and state.serving():  # nothing released, no pause: the gate this release closed opens
                await gate.set(False)
            raise
        finally:
            state.ended()
        if state.done(op, mode, tags).serves_again:
            # Everything resumed after a release without a pause: serve again (scheduler: a no-op unless retracted).
            await tokenizer_manager._async_dispatch_to_scheduler(ContinueGenerationReqInput(torch_empty_cache=False))
            await gate.set(False)
        return result

    return around


tm_pause_generation = _guarded(PAUSE)
tm_continue_generation = _guarded(CONTINUE)
tm_release_memory_occupation = _guarded(RELEASE)
tm_resume_memory_occupation = _guarded(RESUME)


# around_is_locked waits this long for every answer decided or the lock free (docs/pause-release-resume.md), not
# upstream's loop's 1 s sleep: a drain of 0.9-1.9 s would pay the full sleep on top.
DRAIN_WAIT_S = 3.0
# The tokenizer manager whose pause_generation runs in this task (None elsewhere).
_ABORT_PAUSE: contextvars.ContextVar = contextvars.ContextVar("fork_abort_pause", default=None)


async def _lock_free(lock) -> None:
    cond, upstream = fork_touch.upstream(lock, "_cond"), fork_touch.upstream
    async with cond:  # upstream's is_locked condition, read under the lock's own asyncio lock
        await cond.wait_for(lambda: not (upstream(lock, "_writer_active") or upstream(lock, "_readers") > 0))


def _retrieved(future: "asyncio.Future") -> None:
    """Done callback of a gather the wait cancels: its CancelledError is read, not logged as never retrieved."""
    if not future.cancelled():
        future.exception()


async def _answers_decided(tokenizer_manager, lock_free, timeout: float) -> bool:
    """Wait at most `timeout` until the lock is free (False) or every client request past the gate has its answer
    decided (True; one arriving during the pause passes the gate only after continue; health probes never count:
    `PauseGate.undecided_client_requests`), woken by the requests' output events; a state with an output not yet
    consumed (a stream's chunk) leaves the lock as the only criterion."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not lock_free.done():
        pending = None if tokenizer_manager is None else gate_of(tokenizer_manager).undecided_client_requests()
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


async def tm_internal_state(original, tokenizer_manager, *args, **kwargs):
    """AROUND TokenizerControlMixin.get_internal_state: each resource report counts the requests at the gate."""
    states = await original(tokenizer_manager, *args, **kwargs)
    held = gate_of(tokenizer_manager).held()
    for state in states:
        report = state.get("fork_pd_resources") if isinstance(state, dict) else None
        if isinstance(report, dict):
            report["pause_gate_held"] = held
            report["engine_state"] = state_of(tokenizer_manager).as_dict()  # the HTTP side's pause state
            report["rebootstrap_waiting"] = resend_wait_of(tokenizer_manager).waiting
    return states
