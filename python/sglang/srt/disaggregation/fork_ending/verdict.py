"""The verdict: what a PD request that ends without a completion is answered (HTTP status, message), what its end is
counted as (`request_end_cause`), and which cause wins over which. Deciding is a lookup over the rows
(`verdict_rows.TABLE`: `find`, the first row that matches, and the row's values: `verdict`); the texts it reads are
`verdict_wording`'s. Here also:

- `ReqState`: what the verdict reads of a request (`of(req)`: its part of the one attribute the fork sets on a request,
  `request_record`), written by the module each field names, read here.
- what the peer is told (`told_for`, `peer_reason`): a `verdict_rows.Told` (the row the peer's request answers by, and
  its message), carried as frames of its own (room_frames, teller), kept by the receiving ledger with the room's
  failure and moved into the request's record by the verdict hook: the verdict reads it as a field, never out of the
  reason's text.
- every other "which cause wins" (`kept_over`, `reason_weight`, `requested`, `abort_answer`, `counted_cause`).

Callers: room_scheduler_hooks (`prepare_abort`'s verdict, the abort hooks), room_kv_hooks (`record_failure`'s
precedence), pd_pause (the answers of the pause and of aborts while paused), request_end_cause (the counted cause),
room_agreement (which rank's reason). Thread: the calling one (scheduler; `kept_over` on whichever records a failure).
Lock: none (pure functions of their arguments and the request's record). Invariant: one answer per request, the first
row that matches, read from the row's values. Imports `request_record`, `verdict_rows`, `verdict_wording`."""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Dict, Optional, Tuple

from sglang.srt.disaggregation.fork_ending import request_record
from sglang.srt.disaggregation.fork_ending.verdict_rows import PEER_ENDED, RESTATED, ROWS, TABLE, Cause, From, Row, Told
from sglang.srt.disaggregation.fork_ending.verdict_rows import SLA_ABORT_STATUS, TAKES_OVER
from sglang.srt.disaggregation.fork_ending.verdict_wording import (
    ABORT_TAG,
    CLIENT_ABORT,
    CLIENT_ABORT_MESSAGE,
    RECOVERY_HANDOFF_MESSAGE,
    PAUSE,
    PAUSE_ABORT_MESSAGE,
    PAUSED_ABORT_REASON,
    PEER_WHY,
    REJECTED,
    TIMEOUT,
    TRANSPORT,
    UPSTREAM_BARE_ABORT,
    check_cause,
    is_bare_abort,
    is_bare_finish_abort,
    is_lost_peer,
    names_abort,
    names_pause,
)

# ----------------------------------------------------------------------------- the per-request record

ATTR = request_record.ATTR  # the one attribute the fork sets on a request: this record is the verdict's part of it


@dataclass
class ReqState:
    """What the verdict reads of one request (`find`, `verdict`, the counted cause), each field written by the module
    named (scheduler thread). Created at first write (`of`); a request without one has none of them. Other
    per-request facts live with their owners, in records of their own (`request_record`)."""

    deadline: Optional[str] = None  # transfer_deadline: its message; the request is answered 504
    pause: Optional[str] = None  # pd_pause: the pause's or a release's message that ended it
    requested: Optional[Tuple[str, Any]] = None  # room_scheduler_hooks.before_abort_request: (message, status)
    told: Optional["Told"] = None  # room_scheduler_hooks.prepare_abort_verdict: what the room's ender told (ledger)
    end_cause: Optional[Tuple[str, Optional[str]]] = None  # (cause, peer) it is counted as (`tag`); first tag wins


def of(req: Any) -> ReqState:
    """`req`'s record, made at first use."""
    return request_record.of(req, ReqState)


def peek(req: Any) -> ReqState:
    """`req`'s record, or an empty one (not stored): for reads that must not add state to a request."""
    return request_record.peek(req, ReqState)


# ----------------------------------------------------------------------------- building what the peer is told


def rejected_by(where: str, detail: Optional[str] = None) -> str:
    """The why of a request `where` rejected, told to the peer (it answers it as `Cause.PEER_REJECTION`)."""
    return f"{REJECTED} {where}" + (f" ({detail})" if detail else "")


def told_for(why: Optional[str] = None) -> Told:
    """What the peer is told of a request this side ended, `why` being the message that ended it: the pause's or a
    release's (its pause), a rejection (`rejected_by`), else an abort (answered as the client's)."""
    if why and names_pause(why):
        return Told(Cause.PEER_PAUSE, why)
    if why and str(why).startswith(REJECTED):
        return Told(Cause.PEER_REJECTION, why)
    return Told(Cause.PEER_ABORT)


def told_for_ended_room(reason: str) -> Told:
    """What prefill tells decode with a room its pause path ended (pd_pause.end_prefill_rooms): an abort while
    paused (`PAUSED_ABORT_REASON`) is the peer's abort; the pause's or a release's message, a room the pause ended."""
    return Told(Cause.PEER_ABORT) if reason == PAUSED_ABORT_REASON else Told(Cause.PAUSE_REASON)


def peer_reason(rid: Any, room: int, side: str, why: Optional[str] = None) -> str:
    """The failure reason the peer records for a request `side` ended (`why` only for a pause or rejection); its
    cause travels next to it as `told_for(why)`; the text stays for logs and for peers that read no cause."""
    told = told_for(why)
    said = f"{PEER_WHY}{why}" if told.message else " was aborted."
    return f"{ABORT_TAG} on {side}: request {rid} (bootstrap_room={room}){said}"


def with_why(reason: str, why: Optional[str]) -> str:
    """Decode's reason, with the pause's or release's message that ended the room (decode's ABORT carries it as a
    separate frame: room_frames.WHY_FRAME)."""
    return f"{reason.rstrip('.')}{PEER_WHY}{why}" if why else reason


# ----------------------------------------------------------------------------- the verdict


def find(req: Any, text: str) -> Cause:
    """The first row of `TABLE` that matches `req`, the room's failure reason being `text`: rows 1-4 by the record's
    own field (`Row.field`); the others by the cause the room's ender told (`ReqState.told`, a field; or the row that
    takes over that cause for this request, `Row.takes_over`), and only without one by what the reason's text names
    (`Row.reads`: upstream's own reasons, and the fork's tags as an older fork build or this side itself wrote them);
    for a row that says so, the request and the failure's text (the field's message, or the reason) too
    (`Row.takes`)."""
    state = peek(req)
    told = state.told
    for row in TABLE:
        if row.field is not None:
            value = getattr(state, row.field)
            if value is not None and (row.takes is None or row.takes(req, value)):
                return row.cause
        elif told is not None:
            over = TAKES_OVER.get(told.cause)
            return over.cause if over is not None and over.takes(req, text) else told.cause
        elif row.reads(text) and (row.takes is None or row.takes(req, text)):
            return row.cause
    raise AssertionError("the last row reads anything")


def verdict(req: Any, error_message: Any, status_code: Any) -> Tuple[Any, Any, Optional[str]]:
    """(message, status, end cause to tag or None) `prepare_abort` reports for `req`: the values of its row
    (`find`), then `RESTATED` for a message naming a deadline or the pause; the first tag wins."""
    text = str(error_message or "")
    state = peek(req)
    row = ROWS[find(req, text)]
    told = state.told if state.told is not None and state.told.cause is row.cause else None
    message = _message(row, state, told, text, error_message)
    status, tagged = _status(row, state, status_code), row.end_cause
    if row.restated:
        for names, cause in RESTATED:
            if names(message):
                return message, _status(ROWS[cause], state, status_code), tagged or ROWS[cause].end_cause
    return message, status, tagged


def _recorded(row: Row, state: ReqState) -> Tuple[Any, Any]:
    """(message, status) the record's field of `row` holds (`requested` holds both; the others a message)."""
    value = getattr(state, row.field)
    return value if isinstance(value, tuple) else (value, None)


def _status(row: Row, state: ReqState, status_code: Any) -> Any:
    if isinstance(row.status, HTTPStatus):
        return row.status
    if row.status is From.CALLER:
        return status_code
    return _recorded(row, state)[1] if row.status is From.RECORD else None  # ABORT_ANSWER: no status


def _message(row: Row, state: ReqState, told: Optional[Told], text: str, error_message: Any) -> Any:
    if isinstance(row.message, str):
        return row.message
    if row.message is From.RECORD:
        return _recorded(row, state)[0]
    if row.message is From.HANDED:
        return f"{RECOVERY_HANDOFF_MESSAGE} {_recorded(row, state)[0] if row.field else error_message}"
    return _told_message(told, text) if row.message is From.TOLD else error_message  # REASON


def _told_message(told: Optional[Told], text: str) -> str:
    """The peer's message: told as a field, else (an older peer) what its reason says after `PEER_WHY`."""
    if told is not None and told.message:
        return told.message
    return text.rsplit(PEER_WHY, 1)[-1]


def lost_peer_status(error_message: Any, status_code: Any) -> Any:
    """The LOST_PEER row's status for a reason naming a lost peer, else `status_code`."""
    lost = ROWS[Cause.LOST_PEER]
    return lost.status if error_message and lost.reads(str(error_message)) else status_code


def kept_over(current: Optional[str], new: str, current_told: bool = False, new_told: bool = False) -> bool:
    """Whether a room's recorded reason `current` stays when `new` is recorded: over upstream's bare abort reason
    (e.g. the sender's Failed after the ledger told the pause), a lost peer over anything but a lost peer, and a
    reason that came with its cause (`current_told`) over a later one without (`new_told` False: a transfer worker's
    late conclusion of a write that was on its way, an older peer's second status) unless that one names a lost
    peer: the first root cause stays, as upstream's `conclude_transfer` keeps it."""
    if not current:
        return False
    if is_bare_abort(new) or is_lost_peer(current) and not is_lost_peer(new):
        return True
    return current_told and not new_told and not is_lost_peer(new)




def reason_weight(reason: str, told: Optional[Told] = None) -> int:
    """How a reason ranks against another rank's for the same room (lowest wins): a lost peer first, then a failure
    of this side (a failed write, a deadline), last the peer's abort of the room (upstream's bare abort reason, or
    decode's ABORT echoing a failure another rank had already told it of). `told`: the cause that came with it."""
    if told is not None and told.cause is Cause.LOST_PEER or is_lost_peer(reason):
        return 0
    if told is not None:
        return 2 if told.cause in PEER_ENDED else 1
    return 2 if names_abort(reason) else 1


# ----------------------------------------------------------------------------- what an abort asks for


def pause_message(finished_reason: Optional[dict]) -> Optional[str]:
    """The message of an abort the pause or a release sent (its finished_reason names them, no status), or None."""
    reason = finished_reason or {}
    message = reason.get("message")
    return message if reason.get("status_code") is None and names_pause(message) else None


def requested(recv_req: Any) -> Tuple[str, Optional[int], str]:
    """(message, status, end cause) an AbortReq asks for (client abort: no status; SLA abort: 503)."""
    if recv_req.abort_message:
        return recv_req.abort_message, SLA_ABORT_STATUS, TIMEOUT
    reason = recv_req.finished_reason or {}
    if reason.get("status_code") is not None:
        return reason.get("message") or UPSTREAM_BARE_ABORT, reason["status_code"], CLIENT_ABORT
    if names_pause(reason.get("message")):  # pause(abort), release
        return reason["message"], None, PAUSE
    return CLIENT_ABORT_MESSAGE, None, CLIENT_ABORT


def requested_by_pending(pending: Any) -> Tuple[Tuple[str, Optional[int]], str]:
    """((message, status), end cause) of an abort pending on a request (upstream's FINISH_ABORT, not yet finished)."""
    if pending.status_code is None:
        return (CLIENT_ABORT_MESSAGE, None), CLIENT_ABORT
    return (pending.message, pending.status_code), TIMEOUT


def abort_answer(req: Any, recv_req: Any, reached: bool) -> Optional[Tuple[str, Any]]:
    """After Scheduler.abort_request set upstream's FINISH_ABORT on `req` (pd_pause.keep_abort_verdict): the
    (message, status) its answer must carry instead, or None to leave it. `reached`: `recv_req` names `req`.
    A request the verdict marking (before_abort_request) did not see is marked here with `recv_req`'s: the pause's,
    or a client's (by rid, or a bare abort_all: the pause's own are named); the end cause tagged with it."""
    pending = req.to_finish
    asked = peek(req).requested
    if asked is None and pending.status_code is None and reached:
        pause = pause_message(getattr(recv_req, "finished_reason", None))
        cause = PAUSE
        if pause is not None:
            asked = (pause, None)
        elif is_bare_finish_abort(pending.message):
            message, status, cause = requested(recv_req)
            asked = (message, status)
        if asked is not None:
            of(req).requested = asked
            tag(req, cause)
    if asked is None or pending.message == asked[0]:
        return None
    if names_pause(asked[0]) or (is_bare_finish_abort(pending.message) and pending.status_code is None
                                 and asked[1] is None):
        return asked
    return None


def kept_pause_answer(req: Any) -> Optional[str]:
    """The pause's or a release's message a queued request keeps when a later bare abort_all answers it (the
    abort-mode pause repeats it), or None."""
    state = peek(req)
    asked = state.requested
    message = asked[0] if asked is not None and asked[1] is None else state.pause
    return message if message is not None and names_pause(message) else None


def pause_finish_reason(message: str = PAUSE_ABORT_MESSAGE) -> Dict[str, Any]:
    """Upstream's abort answer (200, finish_reason abort with the message, no status) for an end the pause decides."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return FINISH_ABORT(message, None).to_json()


# ----------------------------------------------------------------------------- the counted cause


def tag(req: Any, cause: str, peer: Optional[str] = None) -> None:
    """Record why `req` is ending (sites that hold the request, not the room). First tag wins."""
    check_cause(cause)
    state = of(req)
    if state.end_cause is None:
        state.end_cause = (cause, peer)


def counted_cause(req: Any, room_tag: Optional[Tuple[str, Optional[str]]]) -> Tuple[str, Optional[str]]:
    """(cause, peer) `req`'s end is counted as: its own tag, its room's, upstream's client abort (FINISH_ABORT
    without a status), else a transport failure."""
    return peek(req).end_cause or room_tag or ((CLIENT_ABORT if is_client_abort(req) else TRANSPORT), None)


def is_client_abort(req: Any) -> bool:
    """Upstream's client abort: `to_finish` / `finished_reason` FINISH_ABORT without a status."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    reasons = (getattr(req, "to_finish", None), getattr(req, "finished_reason", None))
    return any(isinstance(r, FINISH_ABORT) and getattr(r, "status_code", None) is None for r in reasons)
