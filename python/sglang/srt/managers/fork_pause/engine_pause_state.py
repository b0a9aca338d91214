"""The engine's pause state as the HTTP-facing process sees it (docs/pause-release-resume.md, "409s"): named states
and one table of named transitions, like upstream's `KVPoll` (docs/layout.md, "The engine pause state").

Invariant: the state is one `Phase`; the mode (a pause's) and the released tags are data carried with it (a mode
exactly in the paused phases, released tags exactly in the released ones); it moves only along a row of
`TRANSITIONS` `(phase, event) -> next phase`, and a call with no row for the phase is a 409 changing nothing. A call
is checked (`check`) before it reaches upstream and its transition made (`done`) only once upstream answered; the
call in progress (`call`, between `begin` and `ended`) makes every other call that would change something a 409.
The tokenizer's event loop only (single-threaded, no lock). One `EnginePauseState` per tokenizer manager, reached
through `state_of(tokenizer_manager)`; its calls are made by `tokenizer_pause`."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Dict, List, Optional, Tuple

from fastapi import HTTPException

from sglang.srt.constants import (
    GPU_MEMORY_ALL_TYPES,
    GPU_MEMORY_TYPE_CUDA_GRAPH,
    GPU_MEMORY_TYPE_KV_CACHE,
    GPU_MEMORY_TYPE_WEIGHTS,
)

ATTR = "_fork_pause_state"  # on the tokenizer manager: its EnginePauseState

PAUSE_MODES = ("abort", "in_place", "retract")
# upstream's memory tags (sglang.srt.constants GPU_MEMORY_TYPE_*), in GPU_MEMORY_ALL_TYPES' order: the only ones a
# release or resume accepts (any other is a 400, `memory_tags`)
KV_CACHE, WEIGHTS, CUDA_GRAPH = GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPE_CUDA_GRAPH
ALL_TAGS = tuple(GPU_MEMORY_ALL_TYPES)
# resumed with kv_cache alone: serving with graphs released would fault on a GPU (docs/pause-release-resume.md)
RESUMED_WITH_KV = (CUDA_GRAPH,)

# The state's public name, in 409s, the 400 of an invalid pause body and the resource report (docs: "Engine state").
RUNNING, PAUSED, RELEASED, RESUMED = "running", "paused", "released", "resumed"

PAUSE, CONTINUE = "pause_generation", "continue_generation"
RELEASE, RESUME = "release_memory_occupation", "resume_memory_occupation"


class Phase(enum.Enum):
    """Where the engine is between pause / release / resume / continue (the value: its public name, one of the
    names above, spelled here because the members' names shadow them in the class body; and what it means)."""

    RUNNING = ("running", "no pause, nothing released: serving")
    PAUSED = ("paused", "paused (a mode), nothing released")
    RELEASED = ("released", "memory released, no pause: the release holds the gate (also after a continue)")
    RELEASED_IN_PAUSE = ("released", "paused, memory released during this pause")
    PAUSED_WHILE_RELEASED = ("released", "paused after a release without a pause, memory still released")
    RESUMED = ("resumed", "paused, everything released during this pause resumed")

    @property
    def public(self) -> str:
        return self.value[0]

    @property
    def paused(self) -> bool:
        return self not in (Phase.RUNNING, Phase.RELEASED)


class Event(str, enum.Enum):
    """A call as the transition table reads it (`EnginePauseState.event`)."""

    PAUSE = "pause_generation"  # no pause yet, or another mode than the pause's
    PAUSE_AGAIN = "pause_generation in the pause's mode"
    CONTINUE = "continue_generation"
    RELEASE = "release_memory_occupation"
    RESUME_SOME = "resume_memory_occupation leaving tags released"
    RESUME_ALL = "resume_memory_occupation leaving nothing released"  # or only tags resumed with kv_cache


class Effect(str, enum.Enum):
    NOOP = "no-op"  # answered 200 at once, nothing changes, not even refused while a call is in progress
    LOCAL = "local"  # answered 200 without upstream, the transition made at once
    UPSTREAM = "upstream"  # upstream's call, the transition made once it answered


@dataclass(frozen=True)
class Row:
    to: Phase
    effect: Effect
    counts_in_flight: bool = False  # a release without a pause: 409 while client requests run
    serves_again: bool = False  # the scheduler is continued and the gate opened (no continue_generation needed)


_P = Phase
TRANSITIONS: Dict[Tuple[Phase, Event], Row] = {
    (_P.RUNNING, Event.PAUSE): Row(_P.PAUSED, Effect.UPSTREAM),
    (_P.RUNNING, Event.CONTINUE): Row(_P.RUNNING, Effect.NOOP),
    (_P.RUNNING, Event.RELEASE): Row(_P.RELEASED, Effect.UPSTREAM, counts_in_flight=True),
    (_P.RUNNING, Event.RESUME_ALL): Row(_P.RUNNING, Effect.UPSTREAM),  # tags resumed with kv_cache only: forgotten
    (_P.PAUSED, Event.PAUSE_AGAIN): Row(_P.PAUSED, Effect.NOOP),
    (_P.PAUSED, Event.CONTINUE): Row(_P.RUNNING, Effect.UPSTREAM),
    (_P.PAUSED, Event.RELEASE): Row(_P.RELEASED_IN_PAUSE, Effect.UPSTREAM),
    (_P.PAUSED, Event.RESUME_ALL): Row(_P.PAUSED, Effect.UPSTREAM),
    (_P.RELEASED, Event.PAUSE): Row(_P.PAUSED_WHILE_RELEASED, Effect.UPSTREAM),
    (_P.RELEASED, Event.CONTINUE): Row(_P.RELEASED, Effect.LOCAL),  # the scheduler stays paused until serving again
    (_P.RELEASED, Event.RELEASE): Row(_P.RELEASED, Effect.UPSTREAM, counts_in_flight=True),
    (_P.RELEASED, Event.RESUME_SOME): Row(_P.RELEASED, Effect.UPSTREAM),
    (_P.RELEASED, Event.RESUME_ALL): Row(_P.RUNNING, Effect.UPSTREAM, serves_again=True),
    (_P.RELEASED_IN_PAUSE, Event.PAUSE_AGAIN): Row(_P.RELEASED_IN_PAUSE, Effect.NOOP),
    (_P.RELEASED_IN_PAUSE, Event.CONTINUE): Row(_P.RELEASED, Effect.LOCAL),  # requests held until serving again
    (_P.RELEASED_IN_PAUSE, Event.RELEASE): Row(_P.RELEASED_IN_PAUSE, Effect.UPSTREAM),
    (_P.RELEASED_IN_PAUSE, Event.RESUME_SOME): Row(_P.RELEASED_IN_PAUSE, Effect.UPSTREAM),
    (_P.RELEASED_IN_PAUSE, Event.RESUME_ALL): Row(_P.RESUMED, Effect.UPSTREAM),
    (_P.PAUSED_WHILE_RELEASED, Event.PAUSE_AGAIN): Row(_P.PAUSED_WHILE_RELEASED, Effect.NOOP),
    (_P.PAUSED_WHILE_RELEASED, Event.CONTINUE): Row(_P.RELEASED, Effect.LOCAL),
    (_P.PAUSED_WHILE_RELEASED, Event.RELEASE): Row(_P.RELEASED_IN_PAUSE, Effect.UPSTREAM),
    (_P.PAUSED_WHILE_RELEASED, Event.RESUME_SOME): Row(_P.PAUSED_WHILE_RELEASED, Effect.UPSTREAM),
    (_P.PAUSED_WHILE_RELEASED, Event.RESUME_ALL): Row(_P.PAUSED, Effect.UPSTREAM),
    (_P.RESUMED, Event.PAUSE_AGAIN): Row(_P.RESUMED, Effect.NOOP),
    (_P.RESUMED, Event.CONTINUE): Row(_P.RUNNING, Effect.UPSTREAM),
    (_P.RESUMED, Event.RELEASE): Row(_P.RELEASED_IN_PAUSE, Effect.UPSTREAM),
    (_P.RESUMED, Event.RESUME_ALL): Row(_P.RESUMED, Effect.UPSTREAM),
}
# The only event a phase has no row for that a caller can send: a pause in another mode while paused (the other
# missing rows, RESUME_SOME with nothing released, cannot be asked). Its 409: (why, hint).
_NO_ROW = {Event.PAUSE: ("already paused in mode {mode!r}", "call continue_generation before pausing in another mode")}

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


class MemoryTagsError(HTTPException):
    """A release or resume naming a tag upstream has no memory for (nothing changed): 400 naming the field and the
    valid tags. Upstream takes the call and does nothing for it; the fork's release would close the pause gate for
    memory that is never released, and no resume could open it again."""

    def __init__(self, message: str):
        super().__init__(status_code=HTTPStatus.BAD_REQUEST, detail=message)

    def __str__(self) -> str:
        return self.detail


def memory_tags(op: str, tags: Any) -> Optional[List[str]]:
    """The `tags` of a release or resume as the state reads them: None or [] (all, upstream's default) unchanged,
    duplicates dropped (upstream's release keeps a set; its resume would fail on the second); MemoryTagsError (400)
    for anything but a list of upstream's tags, before anything is checked or changed."""
    if tags is None:
        return None
    valid = f"valid tags: {list(ALL_TAGS)} (or omit tags, null or []: all of them); nothing changed"
    if not isinstance(tags, (list, tuple)):
        raise MemoryTagsError(f"{op} rejected: field 'tags' must be a list, got {tags!r}; {valid}")
    unknown = [t for t in tags if t not in ALL_TAGS]
    if unknown:
        raise MemoryTagsError(f"{op} rejected: unknown memory tag(s) {unknown} in field 'tags'; {valid}")
    return list(dict.fromkeys(tags))


@dataclass(frozen=True)
class Call:
    """The call in progress: its name and, for a pause, its mode."""

    op: str
    mode: Optional[str] = None


class EnginePauseState:
    """The engine's pause state as the HTTP-facing process sees it (one per server): `phase`, with its data (`mode`,
    `released`, `auto_resumed`), and the call in progress (`call`)."""

    def __init__(self):
        self.phase = Phase.RUNNING
        self.mode: Optional[str] = None  # the pause's mode (exactly in the paused phases)
        self.released: List[str] = []  # memory tags released, in release order (exactly in the released phases)
        self.auto_resumed: List[str] = []  # resumed with kv_cache, not by name (any phase: a later resume is a no-op)
        self.call: Optional[Call] = None

    # -- reading it
    @property
    def state(self) -> str:
        """The public name (running, paused, released, resumed)."""
        return self.phase.public

    @property
    def busy(self) -> Optional[str]:
        """The call in progress, by name."""
        return self.call.op if self.call else None

    @property
    def gate_closed_by_release(self) -> bool:
        """A release without a pause holds the gate: released with no pause, or such a release in progress."""
        return self.phase is Phase.RELEASED or (self.phase is Phase.RUNNING and self.busy == RELEASE)

    def serving(self) -> bool:
        return self.phase is Phase.RUNNING

    def named(self) -> str:
        return f"engine state is {self.state!r}" + (f" (pause mode {self.mode})" if self.mode else "")

    def event(self, op: str, mode: Optional[str] = None, tags: Optional[List[str]] = None) -> Event:
        """The event `op` is for the transition table, read from the state's data."""
        if op == PAUSE:
            return Event.PAUSE_AGAIN if self.phase.paused and mode == self.mode else Event.PAUSE
        if op == RESUME:
            left = [t for t in self.released if t not in self.to_resume(self.resume_named(tags))]
            return Event.RESUME_SOME if left else Event.RESUME_ALL
        return Event(op)

    def row(self, op: str, mode: Optional[str] = None, tags: Optional[List[str]] = None) -> Optional[Row]:
        """The transition `op` makes now (None: a 409)."""
        return TRANSITIONS.get((self.phase, self.event(op, mode, tags)))

    def is_noop(self, op: str, mode: Optional[str] = None) -> bool:
        """`op` is answered 200 at once and changes nothing (continue while serving, a pause in the pause's mode)."""
        row = self.row(op, mode) if op in (PAUSE, CONTINUE) else None
        return row is not None and row.effect is Effect.NOOP

    # -- the checks (409s; nothing changes)
    def _reject(self, op: str, why: str, hint: Optional[str] = None) -> None:
        tags = f" (released: {self.released})" if self.released else ""
        raise PauseStateError(f"{op} rejected: {why}; {self.named()}{tags}; {hint or _HINT[self.state]}")

    def check(self, op: str, mode: Optional[str] = None, tags: Optional[List[str]] = None,
              in_flight: "int | List[str]" = 0) -> None:
        """Raise PauseStateError (409) if `op` is not accepted now: a call in progress, no row for the phase, or a
        tag the released set refuses; change nothing."""
        if self.call is not None:
            raise PauseStateError(f"{op} rejected: {self.call.op} is in progress (engine state: {self.state})")
        if op == PAUSE and mode not in PAUSE_MODES:
            self._reject(op, f"unknown mode {mode!r}, expected one of {list(PAUSE_MODES)}")
        event = self.event(op, mode, tags)
        row = TRANSITIONS.get((self.phase, event))
        if row is None:
            why, hint = _NO_ROW[event]
            self._reject(op, why.format(mode=self.mode), hint)
        if op == RELEASE:
            again = [t for t in tags or ALL_TAGS if t in self.released]
            if again:
                self._reject(op, f"{again} already released")
            if row.counts_in_flight and in_flight:
                count, named = (in_flight, "") if isinstance(in_flight, int) else (
                    len(in_flight), f" ({', '.join(map(str, in_flight[:4]))}{', ...' if len(in_flight) > 4 else ''})")
                self._reject(op, f"{count} request(s) in flight{named} and no pause (upstream's scheduler asserts "
                             "it is idle)", "call pause_generation first, or wait until they finish")
        elif op == RESUME:
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

    # -- the call in progress and the transitions
    def begin(self, op: str, mode: Optional[str] = None) -> None:
        """`op` goes to upstream now: until `ended`, every other call that would change something is a 409."""
        self.call = Call(op, mode)

    def ended(self) -> None:
        self.call = None

    def done(self, op: str, mode: Optional[str] = None, tags: Optional[List[str]] = None) -> Row:
        """Make `op`'s transition (checked before, upstream answered): the phase its row names, and its data."""
        row = TRANSITIONS[(self.phase, self.event(op, mode, tags))]
        if row.effect is Effect.NOOP:
            return row
        if op == PAUSE:
            self.mode = mode
        elif op == CONTINUE:
            self.mode = None
        elif op == RELEASE:
            self.released += [t for t in tags or ALL_TAGS if t not in self.released]  # none: all (upstream's default)
            self.auto_resumed = [t for t in self.auto_resumed if t not in self.released]
        elif op == RESUME:
            named = self.resume_named(tags)
            resumed = self.to_resume(named)
            self.auto_resumed = [t for t in self.auto_resumed if t not in named]
            self.auto_resumed += [t for t in resumed if t not in named]
            self.released = [t for t in self.released if t not in resumed]
        self.phase = row.to
        return row

    def gate_reason(self) -> Optional[str]:
        """Why the pause gate is closed now: 'pause' or 'release' (None: open)."""
        if self.phase.paused or self.busy == PAUSE:
            return "pause"
        if self.gate_closed_by_release:
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
