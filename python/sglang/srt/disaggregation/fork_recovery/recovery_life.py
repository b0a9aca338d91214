"""A request's recovery as named phases and one table of named transitions (docs/recovery.md, "A recovery's life"),
like `managers/fork_pause/engine_pause_state.py`.

Invariant: a request recovery touched is in at most one place at a time: `HELD` (its failed attempt's end held back,
the next attempt not yet re-submitted: in NO scheduler; the re-run task and the abort hook may end it, each only
through a row of `TRANSITIONS`), `RUNNING` (re-submitted: its answer is decode's scheduler's, as any request's),
`ENDED` (recovery is over for it: answered, or an abort reached it while it was in a scheduler, whose answer is then
the client's and never held back). It is answered once: by the row that moves it to `ENDED` from `HELD` (the caller
answers), or by the scheduler's output otherwise. An abort is decided where it reaches decode's tokenizer, before the
scheduler's answer comes: the scheduler may still end the room by another verdict in the same pass (a transfer deadline
checked before the aborted receiver is polled), and that end must not start an attempt the client no longer wants.
Each row names the outcome it counts (`sglang:pd_request_recoveries_total`).
The tokenizer's event loop only (single-threaded, no lock); the record (`Attempts`) lives on the tokenizer's ReqState
(`request_record`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple


class Phase(enum.Enum):
    IDLE = "no failure held back"
    HELD = "a failed attempt's end held back; the next attempt not re-submitted yet (in no scheduler)"
    RUNNING = "an attempt re-submitted to decode's scheduler (its answer is the scheduler's)"
    ENDED = "recovery is over for it (answered, or aborted while in a scheduler: never held back after)"


class Event(enum.Enum):
    FAILED = "a recoverable failure before the first token, held back: an attempt starts"
    SUBMITTED = "the attempt re-submitted to decode's scheduler (past the pause gate)"
    ABORTED = "an abort reached it (a client's, abort_all, the abort-mode pause)"
    NOT_STARTED = "the attempt could not start (prefill's address not found, re-tokenizing failed)"
    WEIGHTS_CHANGED = "the weight version is not the one of the first failure (decode's, or prefill's)"
    COMPLETED = "the scheduler answered a completion"
    FAILED_AGAIN = "the scheduler answered a failure recovery does not run again (no attempt or budget left)"


# The outcomes `sglang:pd_request_recoveries_total{cause, outcome}` counts: `started` per attempt, the others once
# per request recovery touched (how it ended).
STARTED, RECOVERED, FAILED, NOT_STARTED, WEIGHTS_CHANGED, ABORTED = (
    "started", "recovered", "failed", "not_started", "weights_changed", "aborted")
OUTCOMES = (STARTED, RECOVERED, FAILED, NOT_STARTED, WEIGHTS_CHANGED, ABORTED)


@dataclass(frozen=True)
class Row:
    to: Phase
    outcome: Optional[str]  # counted when the row is taken (None: nothing)
    answers_failure: bool = False  # the caller answers the held-back failure (HELD -> ENDED, as without recovery)
    answers_abort: bool = False  # the caller answers the abort (HELD -> ENDED)


_P, _E = Phase, Event
TRANSITIONS: Dict[Tuple[Phase, Event], Row] = {
    (_P.IDLE, _E.FAILED): Row(_P.HELD, STARTED),
    (_P.IDLE, _E.ABORTED): Row(_P.ENDED, None),  # never recovered after: nothing counted (recovery never ran)
    (_P.RUNNING, _E.FAILED): Row(_P.HELD, STARTED),
    (_P.HELD, _E.SUBMITTED): Row(_P.RUNNING, None),
    (_P.HELD, _E.ABORTED): Row(_P.ENDED, ABORTED, answers_abort=True),
    (_P.HELD, _E.NOT_STARTED): Row(_P.ENDED, NOT_STARTED, answers_failure=True),
    (_P.HELD, _E.WEIGHTS_CHANGED): Row(_P.ENDED, WEIGHTS_CHANGED, answers_failure=True),
    (_P.RUNNING, _E.COMPLETED): Row(_P.ENDED, RECOVERED),
    (_P.RUNNING, _E.FAILED_AGAIN): Row(_P.ENDED, FAILED),
    (_P.RUNNING, _E.ABORTED): Row(_P.ENDED, ABORTED),
}


class RecoveryStateError(RuntimeError):
    """A transition with no row: a bug in a caller (each checks the phase first)."""


@dataclass
class Attempts:
    """A request's recovery (the tokenizer's ReqState, `request_record`)."""

    phase: Phase = Phase.IDLE
    made: int = 0  # recovery attempts started
    first_failure: Optional[float] = None  # monotonic time of the first failure held back
    cause: Optional[str] = None  # the first failure's cause
    failure: Optional[Dict[str, Any]] = None  # the last held-back end's finish reason (answered if no attempt runs)
    weight_version: Optional[str] = None  # decode's weight version at the first failure

    def move(self, event: Event) -> Row:
        """Take `event`'s row from the current phase (RecoveryStateError if there is none)."""
        row = TRANSITIONS.get((self.phase, event))
        if row is None:
            raise RecoveryStateError(f"recovery: no transition from {self.phase.name} on {event.name}")
        self.phase = row.to
        if event is Event.FAILED:
            self.made += 1
        return row
