"""Which pause/release/resume/continue call the engine accepts in which state.

Invariant: the HTTP-facing process of a server keeps one `EnginePauseState`
(running -> paused -> released -> resumed -> running; continue also from paused). A
call out of that order, an unknown pause mode, or a call while another one is in
progress is answered 409 naming the state the engine is in, and changes nothing.
Who calls: AROUND hooks on TokenizerManager's pause_generation / continue_generation /
release_memory_occupation / resume_memory_occupation (fork_plugin.HOOKS). What the
scheduler does with requests in flight is `pd_pause`'s concern.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Callable, Dict, Optional

from fastapi import HTTPException

PAUSE_MODES = ("abort", "in_place", "retract")


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


PAUSE_CALLS = ("/pause_generation",)


def name_state_if_pause_call(route_path: str, message: str, global_state: Any) -> str:
    """The 400 for an invalid pause_generation body (unknown mode, rejected by request
    validation before any handler runs) names the engine state too, like the 409s;
    nothing was changed. Called from upstream's validation error handler (a patch)."""
    tokenizer_manager = getattr(global_state, "tokenizer_manager", None)
    if route_path not in PAUSE_CALLS or tokenizer_manager is None:
        return message
    state = _state_of(tokenizer_manager)
    mode = f" (pause mode {state.mode})" if state.mode else ""
    return (
        f"pause_generation rejected: engine state is {state.state!r}{mode}; expected "
        f"mode one of {list(PAUSE_MODES)}; nothing changed. {message}"
    )
