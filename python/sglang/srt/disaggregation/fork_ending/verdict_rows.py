"""The verdict's rows, as data: `TABLE`, one row per cause in the order the verdict tries them (first match wins), each
with its answer as values (the HTTP status, the client's message: a text, or where it comes from and what it opens
with, the end cause tagged), and `Told`, a row named to the peer (what the side that ended a room tells the other of
why, carried as frames of its own: room_frames, teller). The docs (docs/layout.md's `markdown()`,
docs/operations.md's status table via `cells`) and test_verdict.py read these same rows; deciding (the lookup over
them) is `verdict.find` / `verdict.verdict`.

Thread: any (immutable values, pure functions). Lock: none. Invariant: a row's answer is its values; nothing else
holds a status, message or end cause for a cause. Imports `verdict_wording`, and `recovery_rule` (which requests the
rows `DEADLINE_HANDED_TO_RECOVERY` and `HANDED_TO_RECOVERY` take: the rule decode's recovery reads too)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Callable, Dict, Optional, Tuple, Union

from sglang.srt.disaggregation.fork_ending import recovery_rule, verdict_wording
from sglang.srt.disaggregation.fork_ending.verdict_wording import (
    CLIENT_ABORT,
    CLIENT_ABORT_MESSAGE,
    DEADLINE_TAG,
    RECOVERY_HANDOFF_MESSAGE,
    PAUSE,
    PAUSE_ABORT_MESSAGE,
    PEER_FAILURE,
    PEER_WHY,
    REJECTED,
    RELEASE_ABORT_MESSAGE,
    RELEASE_NO_PAUSE_MESSAGE,
    TIMEOUT,
    TRANSPORT,
    names_abort,
    names_deadline,
    names_lost_peer,
    names_pause,
)

# ----------------------------------------------------------------------------- the table


class Cause(enum.Enum):
    """Why a PD request ended without a completion, as the verdict decides it (the rows of `TABLE`)."""

    DEADLINE_HANDED_TO_RECOVERY = "deadline handed to decode's recovery"
    DEADLINE = "deadline"
    PAUSE = "pause"
    REQUESTED_ABORT = "requested abort"
    PEER_PAUSE = "peer's pause"
    PEER_REJECTION = "peer's rejection"
    PEER_ABORT = "peer's abort"
    PEER_DEADLINE = "peer's deadline"
    PAUSE_REASON = "reason naming the pause"
    LOST_PEER_HANDED_TO_RECOVERY = "lost decode handed to decode's recovery"
    LOST_PEER = "lost peer"
    HANDED_TO_RECOVERY = "failure handed to decode's recovery"
    FAILURE = "failure"


class From(enum.Enum):
    """Where a row's status or message comes from when the row does not hold it as a value (the enum's value is how
    the docs say it)."""

    ABORT_ANSWER = "upstream's abort answer (200, finish_reason abort)"  # status None: upstream answers an abort so
    CALLER = "the caller's (500)"  # the status prepare_abort was called with
    RECORD = "the record's"  # the record's field the row is found by (`Row.field`): its message, or (message, status)
    TOLD = "the peer's message"  # the message the room's ender told (`Told.message`), else its reason's after `PEER_WHY`
    REASON = "the reason"  # the room's failure reason itself
    HANDED = "the reason, handed over"  # the room's failure reason (a record row's: its field's), after `RECOVERY_HANDOFF_MESSAGE`


Status = Union[HTTPStatus, From]  # HTTPStatus members, never ints: upstream's OpenAI stream checks the type


@dataclass(frozen=True)
class Row:
    """One row of `TABLE`: how it is found, and the answer as values: the status, the message (a fixed text or
    where it comes from, and what it opens with), the end cause the verdict tags (None: `counted` says who does)."""

    cause: Cause
    status: Status
    message: Union[str, From]
    end_cause: Optional[str]  # the end cause the verdict tags the request with
    counted: str  # what is counted when the verdict tags none (who tags it instead), for the docs
    found: str  # how the verdict finds it: the record's field, or what the room's failure reason names (the docs)
    wins: str  # why it wins over the rows after it
    field: Optional[str] = None  # the record's field that finds the row (rows 1-4)
    # the told cause this row answers otherwise for the requests it `takes` (told none, it is found by `reads`, in
    # the table's order, as any row)
    takes_over: Optional[Cause] = None
    reads: Optional[Callable[[str], bool]] = None  # what a reason's text names, for a room no cause was told with
    # ... and the request it takes (None: any), read after `field` or `reads`: (the request, the failure's text: the
    # field's message, or the room's reason)
    takes: Optional[Callable[[Any, str], bool]] = None
    opens: Tuple[str, ...] = ()  # what the client's message opens with (the wording constants), where it is known
    message_note: str = ""  # the docs' word on the message, beside its values (a record row's: whose it is)
    restated: bool = True  # a message naming a deadline or the pause is answered as `RESTATED` says


def _names_peer_pause(text: str) -> bool:
    return names_abort(text) and names_pause(text)


def _names_peer_rejection(text: str) -> bool:
    return names_abort(text) and PEER_WHY + REJECTED in text


def _names_recoverable(text: str) -> bool:
    return recovery_rule.cause_of(text) is not None


def _anything(text: str) -> bool:
    return True


_R = HTTPStatus
SLA_ABORT_STATUS = _R.SERVICE_UNAVAILABLE  # an AbortReq with an abort_message (an SLA abort): `requested`
TABLE: Tuple[Row, ...] = (
    # Prefill's own deadline for a room decode's recovery runs again: the same deadline as the next row (the room
    # ended and decode told alike, counted as the deadline), its leg answered as handed over. Not restated: its
    # message names the deadline it hands over.
    Row(Cause.DEADLINE_HANDED_TO_RECOVERY, From.ABORT_ANSWER, From.HANDED, None,
        TIMEOUT + " (transfer_deadline tags the room)",
        "record's `deadline`, and prefill: decode's recovery runs the request again (`recovery_rule`: a stage it "
        "re-runs, recovery on, attempts left by its rid, a shape it takes)",
        "a gateway keeps decode's answer only if prefill's leg answers 2xx: decode's is the recovered one",
        field="deadline", takes=recovery_rule.prefill_hands_over, opens=(RECOVERY_HANDOFF_MESSAGE,),
        message_note="the deadline's", restated=False),
    Row(Cause.DEADLINE, _R.GATEWAY_TIMEOUT, From.RECORD, None, TIMEOUT + " (transfer_deadline tags the room)",
        "record's `deadline` (set by transfer_deadline)",
        "whatever failed meanwhile is a consequence of waiting too long", field="deadline", opens=(DEADLINE_TAG,),
        message_note="the deadline's", restated=False),  # its message is the deadline's own; the room's tag (and its peer) is transfer_deadline's
    Row(Cause.PAUSE, From.ABORT_ANSWER, From.RECORD, PAUSE, "", "record's `pause` (set by pd_pause)",
        "pause/release ended it; the transfer failure it caused is not the client's", field="pause",
        opens=(PAUSE_ABORT_MESSAGE, RELEASE_ABORT_MESSAGE, RELEASE_NO_PAUSE_MESSAGE),
        message_note="the pause's or release's"),
    Row(Cause.REQUESTED_ABORT, From.RECORD, From.RECORD, None,
        "client_abort / timeout (SLA) / pause (room_scheduler_hooks.before_abort_request tags it)",
        "record's `requested` (set by room_scheduler_hooks.before_abort_request, pd_pause.keep_abort_verdict)",
        "the room's failure is the abort's consequence", field="requested",
        message_note="the AbortReq's (a client's: `CLIENT_ABORT_MESSAGE`)"),
    Row(Cause.PEER_PAUSE, From.ABORT_ANSWER, From.TOLD, PAUSE, "",
        "reason carries `ABORT_TAG` or `UPSTREAM_ABORT_REASON` and names the pause (`PAUSE_MARKERS`)",
        "the peer ended the room because its pause or release ended the request there", reads=_names_peer_pause,
        message_note="its pause's or release's"),
    Row(Cause.PEER_REJECTION, From.ABORT_ANSWER, From.TOLD, CLIENT_ABORT, "",
        "reason carries `ABORT_TAG` or `UPSTREAM_ABORT_REASON`, and `PEER_WHY` + `REJECTED`",
        "the peer rejected the request: nothing failed", reads=_names_peer_rejection, opens=(REJECTED,),
        message_note="the rejection, as the peer's tokenizer or scheduler said it"),
    Row(Cause.PEER_ABORT, From.ABORT_ANSWER, CLIENT_ABORT_MESSAGE, CLIENT_ABORT, "",
        "reason carries `ABORT_TAG` or `UPSTREAM_ABORT_REASON`",
        "the peer ended the room because its request was aborted there", reads=names_abort),
    Row(Cause.PEER_DEADLINE, _R.GATEWAY_TIMEOUT, From.REASON, TIMEOUT, "",
        "reason carries `DEADLINE_TAG` (the peer's deadline)", "the peer waited too long: a deadline, as above",
        reads=names_deadline),
    Row(Cause.PAUSE_REASON, From.ABORT_ANSWER, From.REASON, PAUSE, "",
        "reason names the pause or a release (`PAUSE_MARKERS`: a room prefill's pause ended)",
        "pause/release ended it, as above", reads=names_pause),
    # Prefill's room whose decode it lost: decode, if it lives (a partition), lost this prefill too and its recovery
    # may run the request on another prefill; a gateway keeps decode's answer only if prefill's leg answers 2xx.
    # Tags peer_failure (the monitor that lost the peer already did; the first tag wins): its answer has no status.
    Row(Cause.LOST_PEER_HANDED_TO_RECOVERY, From.ABORT_ANSWER, From.HANDED, PEER_FAILURE, "",
        "prefill: told `LOST_PEER` or reason carries `PEER_LOST_TAG`, and decode's recovery may run the request again "
        "(`recovery_rule.prefill_hands_over_lost`: recovery on, attempts left by its rid, a shape it takes)",
        "a gateway keeps decode's answer only if prefill's leg answers 2xx: decode's is the recovered one, or its own "
        "502 when it cannot recover", reads=names_lost_peer, takes=recovery_rule.prefill_hands_over_lost,
        takes_over=Cause.LOST_PEER, opens=(RECOVERY_HANDOFF_MESSAGE,), message_note="the lost peer's reason"),
    Row(Cause.LOST_PEER, _R.BAD_GATEWAY, From.REASON, None,
        PEER_FAILURE + " (tagged by whoever lost it), else " + TRANSPORT,
        "reason carries `PEER_LOST_TAG` or `UPSTREAM_PREFILL_LOST`", "a peer is gone: not this server's fault",
        reads=names_lost_peer),
    # Tags transport, as row FAILURE counts a chunk failure's untagged room: its answer has no status, which the
    # counted cause would otherwise read as a client abort (and upstream's failure counter would miss it).
    Row(Cause.HANDED_TO_RECOVERY, From.ABORT_ANSWER, From.HANDED, TRANSPORT, "",
        "prefill: reason names a failed chunk write, and decode's recovery runs the request again (`recovery_rule`: "
        "recovery on, attempts left by its rid, a shape it takes)",
        "a gateway keeps decode's answer only if prefill's leg answers 2xx: decode's is the recovered one",
        reads=_names_recoverable, takes=recovery_rule.prefill_hands_over, opens=(RECOVERY_HANDOFF_MESSAGE,),
        message_note="the room and the failed chunk"),
    Row(Cause.FAILURE, From.CALLER, From.REASON, None, TRANSPORT + " (untagged)", "anything else", "",
        reads=_anything),
)
ROWS: Dict[Cause, Row] = {row.cause: row for row in TABLE}
TAKES_OVER: Dict[Cause, Row] = {row.takes_over: row for row in TABLE if row.takes_over is not None}  # told -> row
# Whichever row chose the message, one naming a deadline is answered as PEER_DEADLINE says (its status, and its end
# cause unless the row tagged one) and one naming the pause as PAUSE_REASON says: an AbortReq's message can name them.
RESTATED: Tuple[Tuple[Callable[[Any], bool], Cause], ...] = ((names_deadline, Cause.PEER_DEADLINE),
                                                             (names_pause, Cause.PAUSE_REASON))


@dataclass(frozen=True)
class Told:
    """Why a room ended, as the side that ended it tells the other: the row the reader's request answers by (`TABLE`)
    and the message that row answers with (the pause's, a rejection's; None: the row's own). On the wire: the cause's
    enum name and the message, each a frame (`frames`, `from_frames`)."""

    cause: Cause
    message: Optional[str] = None

    def frames(self) -> Tuple[bytes, bytes]:
        return self.cause.name.encode("ascii"), (self.message or "").encode("utf-8")

    @staticmethod
    def from_frames(frames: Any) -> Optional["Told"]:
        """The Told in (name, message) frames, or None (missing, or a cause this build does not know: the reason's
        text is read then, as for a peer that sends none)."""
        if len(frames) < 2:
            return None
        cause = Cause.__members__.get(frames[0].decode("ascii", "replace"))
        return Told(cause, frames[1].decode("utf-8", "replace") or None) if cause in TOLD_CAUSES else None


# The rows a peer can tell (the others are this side's own record's fields, or its own decision).
TOLD_CAUSES = frozenset(Cause) - {Cause.DEADLINE_HANDED_TO_RECOVERY, Cause.DEADLINE, Cause.PAUSE, Cause.REQUESTED_ABORT,
                                  Cause.LOST_PEER_HANDED_TO_RECOVERY, Cause.HANDED_TO_RECOVERY}

PEER_ENDED = (Cause.PEER_PAUSE, Cause.PEER_REJECTION, Cause.PEER_ABORT)  # the peer ended the room: nothing failed


def _spelled(value: str) -> str:
    """A wording constant as the docs name it (`NAME`), else the text itself."""
    names = [name for name, v in vars(verdict_wording).items() if name.isupper() and v == value]
    return f"`{names[0]}`" if names else value


def cells(row: Row) -> Tuple[str, str, str]:
    """(status, client message, end cause) of `row` as the docs show them, from its values (wording constants by
    name: docs/operations.md spells them out)."""
    if isinstance(row.status, HTTPStatus):
        status = str(int(row.status))
    elif row.status is From.RECORD:  # the AbortReq's (`requested`)
        status = (f"the AbortReq's: client abort: {From.ABORT_ANSWER.value}; SLA abort: "
                  f"{int(SLA_ABORT_STATUS)}")
    else:
        status = row.status.value
    if isinstance(row.message, str):
        message = _spelled(row.message)
    elif row.message is From.RECORD:  # the record's field holds what the request's ender wrote: says whose
        message = row.message_note
    else:
        message = row.message.value
    said = ([f"opens as {', '.join(_spelled(o) for o in row.opens)}"] if row.opens else []) + (
        [row.message_note] if row.message_note and row.message is not From.RECORD else [])
    if said:
        message += f" ({'; '.join(said)})"
    return status, message, row.end_cause or row.counted


def markdown() -> str:
    """`TABLE` as docs/layout.md shows it (test_verdict checks the doc holds exactly this)."""
    lines = ["| # | cause | found | status | client message | end cause | why it wins over what follows |",
             "|---|---|---|---|---|---|---|"]
    for i, row in enumerate(TABLE, 1):
        status, message, end_cause = cells(row)
        lines.append(f"| {i} | {row.cause.value} | {row.found} | {status} | {message} | {end_cause} | {row.wins} |")
    return "\n".join(lines)
