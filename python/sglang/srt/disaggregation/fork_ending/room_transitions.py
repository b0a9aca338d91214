"""A room's end as named transitions (docs/layout.md, "How a room ends"): the `Phase`s a room passes through as this
side's ledger and upstream's tables hold it, and one `TRANSITIONS` table of the ways a room ends, each a `Row` of the
steps `RoomLedger.make` takes in the one order that cannot leak (tag, clear, remember, record and mark, tell). Like
upstream's `KVPoll` and `engine_pause_state`.

Invariant: a room ends only along a row of `TRANSITIONS`, on a side the row names, with the data it needs (the sender
it clears, the receiver whose ABORT tells prefill, the decode endpoints it tells); anything else is an illegal
transition (`IllegalTransition`): it raises under pytest and is logged at error in production (nothing is changed
either way: `check` runs before the first step). Pure data and a check: any thread, no lock."""

from __future__ import annotations

import enum
import logging
import sys
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Optional, Tuple

logger = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"
BOTH = frozenset((PREFILL, DECODE))


class Phase(enum.Enum):
    """Where a room is, as this side knows it (the value: what it means)."""

    NEW = "nothing here yet: no status, nothing remembered (decode's handshake or a sender may open it)"
    OPEN = "upstream holds it (Bootstrapping .. Success), nothing ended it"
    RECORDED = "its failure recorded with its cause, not marked: the upstream path about to fail it marks it and tells"
    FAILED = "marked Failed with its record and cause: its request answers it at its next poll"
    ENDED = "remembered as ended: a late handshake is answered Failed with its reason and cause"
    CANCELLED = "remembered as cancelled: a sender created for it fails at once (expires on the engine clock)"
    CLEARED = "its sender cleared, its transfer state and failure record dropped (its request retired elsewhere)"


class Tell(enum.Enum):
    """How a row tells the peer."""

    NONE = "nobody (the peer is lost, ended it first, or upstream's own path tells it)"
    STATUS = "prefill: the cause (PEER_CAUSE) then upstream's Failed status to the room's decode endpoints"
    ABORT = "decode: the receiver's ABORT to prefill (ensure_abort_notified)"


class Transition(str, enum.Enum):
    """Every way a room ends (`RoomLedger.make`); the value is its name in logs and docs."""

    FAIL_AND_TELL = "fail_and_tell"
    FAIL_AND_ABORT = "fail_and_abort"
    FAIL_TELL_REMEMBER = "fail_tell_remember"
    FAIL_UNTOLD = "fail_untold"
    RECORD_FOR_UPSTREAM = "record_for_upstream"
    TELL_AND_REMEMBER = "tell_and_remember"
    ANSWER_LATE = "answer_late"
    REMEMBER_ENDED = "remember_ended"
    NOTE_CANCEL = "note_cancel"
    CANCEL_AND_TELL = "cancel_and_tell"
    CANCEL_BEFORE_CREATE = "cancel_before_create"
    RETIRE_HELD = "retire_held"
    HAND_TO_RECOVERY = "hand_to_recovery"


@dataclass(frozen=True)
class Row:
    """A transition's steps (in `RoomLedger.make`'s order), where it may run and what it moves the room to."""

    sides: FrozenSet[str]
    before: Tuple[Phase, ...]  # the phases it starts from (the diagram)
    after: Tuple[Phase, ...]  # the phases it leaves the room in (the diagram)
    who: str  # its callers
    clear: bool = False  # drop the sender's transfer state and the room's failure record first (needs `sender`)
    answer: bool = False  # remembered: a late handshake is answered Failed with the reason
    cancel: bool = False  # remembered as cancelled: a sender created later fails at once
    fail: bool = False  # the failure recorded (with its cause), only while the room exists
    mark: bool = False  # ... and the room marked Failed
    tell: Tell = Tell.NONE

    @property
    def remembers(self) -> bool:
        return self.answer or self.cancel


_P, T = Phase, Transition
LIVE = (_P.OPEN, _P.RECORDED, _P.FAILED)
TRANSITIONS: Dict[Transition, Row] = {
    T.FAIL_AND_TELL: Row(
        frozenset((PREFILL,)), LIVE + (_P.CLEARED,), (_P.FAILED,),
        "prefill_side_monitor (a decode lost, its session dropped), chunk_failures (a failed write, a raising worker)",
        fail=True, mark=True, tell=Tell.STATUS),
    T.FAIL_AND_ABORT: Row(
        frozenset((DECODE,)), LIVE, (_P.FAILED,), "transfer_deadline (decode)",
        fail=True, mark=True, tell=Tell.ABORT),
    T.FAIL_TELL_REMEMBER: Row(
        frozenset((PREFILL,)), LIVE + (_P.NEW,), (_P.FAILED, _P.ENDED),
        "transfer_deadline (prefill), prefill_side_monitor (a decode held out), lost_handshake (an orphaned handshake)",
        answer=True, fail=True, mark=True, tell=Tell.STATUS),
    T.FAIL_UNTOLD: Row(
        BOTH, LIVE + (_P.CANCELLED,), (_P.FAILED,),
        "decode_side_monitor (a prefill lost), a sender claiming a cancelled room, chunk_failures (injected)",
        fail=True, mark=True),
    T.RECORD_FOR_UPSTREAM: Row(
        BOTH, LIVE, (_P.RECORDED,),
        "prefill_side_monitor (a write to a blacklisted session), transfer_deadline (decode: prefill's info never fetched)",
        fail=True),
    T.TELL_AND_REMEMBER: Row(
        frozenset((PREFILL,)), LIVE, (_P.ENDED,),
        "an abort (before_abort_request, finish_transferred), room_agreement (a room another rank failed)",
        answer=True, tell=Tell.STATUS),
    T.ANSWER_LATE: Row(
        frozenset((PREFILL,)), (_P.ENDED, _P.FAILED), (_P.ENDED,),
        "a late handshake for an ended room (around_update_status), room_agreement (a late answer agreed)",
        tell=Tell.STATUS),
    T.REMEMBER_ENDED: Row(
        BOTH, LIVE + (_P.NEW,), (_P.ENDED,), "room_agreement (a late answer another rank gave)", answer=True),
    T.NOTE_CANCEL: Row(
        frozenset((PREFILL,)), (_P.NEW,), (_P.CANCELLED,), "decode's ABORT for a room prefill has no sender for",
        cancel=True),
    T.CANCEL_AND_TELL: Row(
        frozenset((PREFILL,)), (_P.NEW,), (_P.CANCELLED,),
        "prefill ended it before its scheduler saw it, decode's handshake already here (ENDED_ON_PREFILL)",
        cancel=True, tell=Tell.STATUS),
    T.CANCEL_BEFORE_CREATE: Row(
        frozenset((PREFILL,)), (_P.NEW,), (_P.CANCELLED, _P.ENDED),
        "prefill ended it before its scheduler saw it, decode's handshake not yet here (ENDED_ON_PREFILL)",
        answer=True, cancel=True),
    T.RETIRE_HELD: Row(
        frozenset((PREFILL,)), LIVE, (_P.CLEARED, _P.CANCELLED, _P.ENDED),
        "pd_pause (a request the pause path ended, held nowhere now)",
        clear=True, answer=True, cancel=True),
    T.HAND_TO_RECOVERY: Row(
        frozenset((DECODE,)), LIVE, (_P.FAILED, _P.ENDED),
        "transfer_deadline (decode, a recoverable stage with recovery on: its transfer stalled, prefill alive, before "
        "the first token; the request may go on under a new room, docs/recovery.md)",
        answer=True, fail=True, mark=True, tell=Tell.ABORT),
}


class IllegalTransition(RuntimeError):
    """A room ended along no row: the wrong side, or without the data its row needs."""


def strict() -> bool:
    """Raise on an illegal transition (under pytest: the harness and pair tests run the hooks in its process)."""
    return "pytest" in sys.modules


def problem(transition: Transition, side: Optional[str], *, sender: Any, receiver: Any,
            targets: Optional[list]) -> Optional[str]:
    """What makes `transition` illegal here (None: legal). `side`: the manager's role (None: not known, a manager
    without room tables)."""
    row = TRANSITIONS.get(transition)
    if row is None:
        return f"{transition!r} is no transition"
    if side is not None and side not in row.sides:
        return f"{transition.value} runs on {'/'.join(sorted(row.sides))}, not on {side}"
    if (sender is not None) != row.clear:
        return f"{transition.value} {'needs' if row.clear else 'takes no'} sender to clear"
    if (receiver is not None) != (row.tell is Tell.ABORT):
        return f"{transition.value} {'needs' if row.tell is Tell.ABORT else 'takes no'} receiver"
    if targets is not None and row.tell is not Tell.STATUS:
        return f"{transition.value} tells no decode endpoints"
    if transition is T.CANCEL_AND_TELL and not targets:
        return f"{transition.value} needs the decode endpoints it tells"
    return None


def check(transition: Transition, room: Any, side: Optional[str], *, sender: Any = None, receiver: Any = None,
          targets: Optional[list] = None) -> bool:
    """Whether `transition` may run (an illegal one raises under pytest, else is logged and skipped)."""
    why = problem(transition, side, sender=sender, receiver=receiver, targets=targets)
    if why is None:
        return True
    if strict():
        raise IllegalTransition(f"room {room}: {why}")
    logger.error("room_ledger: illegal transition for room %s: %s; nothing changed", room, why)
    return False
