"""The engine's pause state as the HTTP-facing process sees it (docs/pause-release-resume.md, "409s"): which of
pause / release / resume / continue is accepted now, and what each changes.

Invariant: a call is checked (`check`, changing nothing; an out-of-order call is a 409) before it reaches upstream,
and its change is made (`done`) only once upstream answered; `busy` names the call in progress, so a second one
waits for none and is a 409. The tokenizer's event loop only (single-threaded, no lock). One `EnginePauseState`
per tokenizer manager, reached through `state_of(tokenizer_manager)`; its calls are made by `tokenizer_pause`."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Dict, List, Optional

from fastapi import HTTPException

ATTR = "_fork_pause_state"  # on the tokenizer manager: its EnginePauseState

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

    def gate_reason(self) -> Optional[str]:
        """Why the pause gate is closed now: 'pause' or 'release' (None: open)."""
        if self.mode is not None or self.busy == "pause_generation":
            return "pause"
        if self.released or self.gate_closed_by_release:
            return "release"
        return None

    def as_dict(self) -> Dict[str, Any]:
        return {"state": self.state, "mode": self.mode, "released": list(self.released), "busy": self.busy}


def state_of(tokenizer_manager) -> EnginePauseState:
    """The tokenizer manager's pause state (made at first use)."""
    return tokenizer_manager.__dict__.setdefault(ATTR, EnginePauseState())


def pause_reason(tokenizer_manager) -> Optional[str]:
    """Why the pause gate is closed now: 'pause' or 'release' (None: open)."""
    return state_of(tokenizer_manager).gate_reason()


def alive_while_held(tokenizer_manager) -> bool:
    """/health and /health_generate answer 200 at once while the engine holds requests on purpose (a pause or a
    release; docs/pause-release-resume.md). Called by the http_server patch (the health route and its wait loop)."""
    return bool(tokenizer_manager.is_pause) or pause_reason(tokenizer_manager) is not None


def name_state_if_pause_call(route_path: str, message: str, global_state: Any) -> str:
    """The 400 for an invalid pause_generation body names the engine state too, like the 409s (http_server patch)."""
    tokenizer_manager = getattr(global_state, "tokenizer_manager", None)
    if route_path != "/pause_generation" or tokenizer_manager is None:
        return message
    return (f"pause_generation rejected: {state_of(tokenizer_manager).named()}; expected mode one of "
            f"{list(PAUSE_MODES)}; nothing changed. {message}")
