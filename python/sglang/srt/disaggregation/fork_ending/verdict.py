"""The verdict: what a PD request that ends without a completion is answered (HTTP status, message), what its end is
counted as (`request_end_cause`), and which cause wins over which. Three things, each once:

- `TABLE`: one row per cause, in the order the verdict tries them (first match wins), each with its answer as values:
  the HTTP status, the client's message (a text, or where it comes from and what it opens with), the end cause
  tagged; deciding is `find` (the first row that matches) and the row's values (`verdict`). The docs
  (docs/layout.md's `markdown()`, docs/operations.md's status table) and test_verdict.py read the same rows.
- `ReqState`: what the verdict reads of a request (`of(req)`: its part of the one attribute the fork sets on a request,
  `request_record`), written by the module each field names, read here.
- `Told`: what the side that ended a room tells the other of why (the row its request answers by, and the message that
  row reads), carried to the peer as frames of its own (room_ledger: decode's ABORT, prefill's cause message, the
  teller's ENDED_ON_PREFILL), kept by the receiving ledger with the room's failure and moved into the request's
  record by the verdict hook: the verdict reads it as a field, never out of the reason's text.
- every text the fork compares, here alone: upstream's texts the fork must recognise and cannot get as a field (each
  naming its upstream source), and the fork's own tags, read only as the fallback for a room no `Told` came with (a
  peer that is an older fork build or stock upstream, or a failure this side recorded itself). No other fork module
  compares message wording: they ask the predicates below (test_verdict.py checks it).

Callers: room_ledger (`prepare_abort`'s verdict, the abort hooks, `record_failure`'s precedence), pd_pause (the answers
of the pause and of aborts while paused), request_end_cause (the counted cause), room_agreement (which rank's reason),
the peer monitors and transfer_deadline (their reasons' tags). Pure functions of their arguments and the record, on the
calling thread; no lock. Imports no fork module but `request_record`."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Callable, Dict, Optional, Tuple, Union

from sglang.srt.disaggregation.fork_ending import request_record

# ----------------------------------------------------------------------------- end causes (the counter's labels)

CLIENT_ABORT, TIMEOUT, TRANSPORT, PEER_FAILURE, PAUSE = "client_abort", "timeout", "transport", "peer_failure", "pause"
CAUSES = (CLIENT_ABORT, TIMEOUT, TRANSPORT, PEER_FAILURE, PAUSE)

# ----------------------------------------------------------------------------- wording (compared only here)

# The fork's own messages, answered to clients.
PAUSE_ABORT_MESSAGE = "Aborted by pause_generation(mode=abort)."
RELEASE_ABORT_MESSAGE = "Aborted: engine memory released during pause (mode={mode})."
RELEASE_NO_PAUSE_MESSAGE = "Aborted: engine memory released without a pause."
CLIENT_ABORT_MESSAGE = "Aborted by the client."
# A message naming the pause or the release ends the request as a pause abort (end cause "pause"): every message
# above but the client's names one of these.
RELEASE_MARKER = "engine memory released"
PAUSE_MARKERS = ("pause_generation", RELEASE_MARKER)

# How the fork's failure reasons open (a room's reason also reaches the peer: upstream's status message carries it).
DEADLINE_TAG = "PD transfer deadline exceeded"  # transfer_deadline's reasons
PEER_LOST_TAG = "PD peer lost"  # the peer monitors' reasons (and transfer_deadline's unreachable prefill)
ABORT_TAG = "PD request aborted"  # the reason a room carries to the peer when its request was aborted (peer_reason)
PEER_WHY = " was aborted: "  # peer_reason: what the peer is told, then why
REJECTED = "rejected by"  # a tokenizer's or scheduler's rejection, told to the peer with its message
# Opens with ABORT_TAG: decode ended the request, so prefill's leg ends as an abort, not as a bootstrap failure.
CANCEL_REASON = ("PD request aborted on decode: the decode peer {peer} aborted room {room} before prefill received "
                 "the request")
DECODE_ABORT_REASON = "PD request aborted on decode: bootstrap_room={room} was aborted by the decode peer."

# Upstream's texts the fork must recognise (upstream gives no field for them).
UPSTREAM_PREFILL_LOST = "Lost connection with prefill instance"  # decode's heartbeat, CommonKVManager._handle_node_failure
UPSTREAM_ABORT_REASON = "Aborted by AbortReq"  # Common{Sender,Receiver}.abort()'s failure record
UPSTREAM_ABORT_MESSAGE = "Aborted by AbortReq."  # the same, as the fork writes it for a request it answers like upstream
UPSTREAM_BARE_ABORT = "Aborted"  # schedule_batch.FINISH_ABORT's default: an AbortReq's status without a message
UPSTREAM_SESSION_DEAD = "Decode instance could be dead, remote mooncake session"  # mooncake's transfer worker
UPSTREAM_WRITE_FAILED = ("Failed to send", UPSTREAM_SESSION_DEAD)  # how mooncake's reasons for a failed write open
UPSTREAM_CHUNK_FAILED = {  # mooncake/conn.py's transfer worker: how it words each chunk kind's failure
    "kv": "Failed to send kv chunk",
    "aux": "Failed to send aux data",
    "state": "Failed to send state components",
}
# A room prefill ended for an abort while paused: opens as upstream's abort reason, so decode answers a client abort.
PAUSED_ABORT_REASON = UPSTREAM_ABORT_REASON + " while prefill was paused (room {room})"


# ----------------------------------------------------------------------------- the per-request record

ATTR = request_record.ATTR  # the one attribute the fork sets on a request: this record is the verdict's part of it


@dataclass
class ReqState:
    """What the verdict reads of one request (`find`, `verdict`, the counted cause), each field written by the module
    named (scheduler thread). Created at first write (`of`); a request without one has none of them. Other
    per-request facts live with their owners, in records of their own (`request_record`)."""

    deadline: Optional[str] = None  # transfer_deadline: its message; the request is answered 504
    pause: Optional[str] = None  # pd_pause: the pause's or a release's message that ended it
    requested: Optional[Tuple[str, Any]] = None  # room_ledger.before_abort_request: (message, status) asked for
    told: Optional["Told"] = None  # room_ledger.prepare_abort_verdict: what the room's ender told of why (its ledger)
    end_cause: Optional[Tuple[str, Optional[str]]] = None  # (cause, peer) it is counted as (`tag`); first tag wins


def of(req: Any) -> ReqState:
    """`req`'s record, made at first use."""
    return request_record.of(req, ReqState)


def peek(req: Any) -> ReqState:
    """`req`'s record, or an empty one (not stored): for reads that must not add state to a request."""
    return request_record.peek(req, ReqState)


# ----------------------------------------------------------------------------- what a text names


def names_pause(message: Any) -> bool:
    """Whether a message says a pause or a release ended the request (end cause "pause")."""
    return any(m in str(message or "") for m in PAUSE_MARKERS)


def names_deadline(text: Any) -> bool:
    return DEADLINE_TAG in str(text or "")


def names_abort(text: Any) -> bool:
    """The peer aborted the room (our tag, or upstream's bare abort reason)."""
    return any(t in str(text or "") for t in (ABORT_TAG, UPSTREAM_ABORT_REASON))


def names_lost_peer(text: Any) -> bool:
    return any(t in str(text or "") for t in (PEER_LOST_TAG, UPSTREAM_PREFILL_LOST))


def is_lost_peer(reason: Any) -> bool:
    """A reason the fork recorded for a lost peer (opens with its tag)."""
    return str(reason or "").startswith(PEER_LOST_TAG)


def is_bare_abort(reason: Any) -> bool:
    """Upstream's Common{Sender,Receiver}.abort() reason, naming no cause."""
    return str(reason or "").startswith(UPSTREAM_ABORT_REASON)


def is_bare_finish_abort(message: Any) -> bool:
    """Upstream's FINISH_ABORT() message (a running request an AbortReq reached), naming no cause (read from
    upstream's class, so a reworded default is followed)."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return message == FINISH_ABORT().message


def is_failed_write(reason: Any) -> bool:
    """mooncake's reason for a failed KV write."""
    return str(reason or "").startswith(UPSTREAM_WRITE_FAILED)


def failed_chunk_kind(reason: Any) -> Optional[str]:
    """The chunk kind ("kv", "aux", "state") a transfer failure reason names, or None (abort, timeout...)."""
    return next((kind for kind, text in UPSTREAM_CHUNK_FAILED.items() if text in str(reason or "")), None)


def is_dead_session(reason: Any) -> bool:
    """mooncake's reason for a write to a session it found dead."""
    return str(reason or "").startswith(UPSTREAM_SESSION_DEAD)


# ----------------------------------------------------------------------------- the table


class Cause(enum.Enum):
    """Why a PD request ended without a completion, as the verdict decides it (the rows of `TABLE`)."""

    DEADLINE = "deadline"
    PAUSE = "pause"
    REQUESTED_ABORT = "requested abort"
    PEER_PAUSE = "peer's pause"
    PEER_REJECTION = "peer's rejection"
    PEER_ABORT = "peer's abort"
    PEER_DEADLINE = "peer's deadline"
    PAUSE_REASON = "reason naming the pause"
    LOST_PEER = "lost peer"
    FAILURE = "failure"


class From(enum.Enum):
    """Where a row's status or message comes from when the row does not hold it as a value (the enum's value is how
    the docs say it)."""

    ABORT_ANSWER = "upstream's abort answer (200, finish_reason abort)"  # status None: upstream answers an abort so
    CALLER = "the caller's (500)"  # the status prepare_abort was called with
    RECORD = "the record's"  # the record's field the row is found by (`Row.field`): its message, or (message, status)
    TOLD = "the peer's message"  # the message the room's ender told (`Told.message`), else its reason's after `PEER_WHY`
    REASON = "the reason"  # the room's failure reason itself


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
    field: Optional[str] = None  # the record's field that finds the row (rows 1-3)
    reads: Optional[Callable[[str], bool]] = None  # what a reason's text names, for a room no cause was told with
    opens: Tuple[str, ...] = ()  # what the client's message opens with (the wording constants), where it is known
    message_note: str = ""  # the docs' word on the message, beside its values (a record row's: whose it is)
    restated: bool = True  # a message naming a deadline or the pause is answered as `RESTATED` says


def _names_peer_pause(text: str) -> bool:
    return names_abort(text) and names_pause(text)


def _names_peer_rejection(text: str) -> bool:
    return names_abort(text) and PEER_WHY + REJECTED in text


def _anything(text: str) -> bool:
    return True


_R = HTTPStatus
SLA_ABORT_STATUS = _R.SERVICE_UNAVAILABLE  # an AbortReq with an abort_message (an SLA abort): `requested`
TABLE: Tuple[Row, ...] = (
    Row(Cause.DEADLINE, _R.GATEWAY_TIMEOUT, From.RECORD, None, TIMEOUT + " (transfer_deadline tags the room)",
        "record's `deadline` (set by transfer_deadline)",
        "whatever failed meanwhile is a consequence of waiting too long", field="deadline", opens=(DEADLINE_TAG,),
        message_note="the deadline's", restated=False),  # its message is the deadline's own; the room's tag (and its peer) is transfer_deadline's
    Row(Cause.PAUSE, From.ABORT_ANSWER, From.RECORD, PAUSE, "", "record's `pause` (set by pd_pause)",
        "pause/release ended it; the transfer failure it caused is not the client's", field="pause",
        opens=(PAUSE_ABORT_MESSAGE, RELEASE_ABORT_MESSAGE, RELEASE_NO_PAUSE_MESSAGE),
        message_note="the pause's or release's"),
    Row(Cause.REQUESTED_ABORT, From.RECORD, From.RECORD, None,
        "client_abort / timeout (SLA) / pause (room_ledger.before_abort_request tags it)",
        "record's `requested` (set by room_ledger.before_abort_request, pd_pause.keep_abort_verdict)",
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
    Row(Cause.LOST_PEER, _R.BAD_GATEWAY, From.REASON, None,
        PEER_FAILURE + " (tagged by whoever lost it), else " + TRANSPORT,
        "reason carries `PEER_LOST_TAG` or `UPSTREAM_PREFILL_LOST`", "a peer is gone: not this server's fault",
        reads=names_lost_peer),
    Row(Cause.FAILURE, From.CALLER, From.REASON, None, TRANSPORT + " (untagged)", "anything else", "",
        reads=_anything),
)
ROWS: Dict[Cause, Row] = {row.cause: row for row in TABLE}
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


# The rows a peer can tell (the others are this side's own record's fields).
TOLD_CAUSES = frozenset(Cause) - {Cause.DEADLINE, Cause.PAUSE, Cause.REQUESTED_ABORT}


def _spelled(value: str) -> str:
    """A wording constant as the docs name it (`NAME`), else the text itself."""
    names = [name for name, v in globals().items() if name.isupper() and v == value]
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
    separate frame: room_ledger.WHY_FRAME)."""
    return f"{reason.rstrip('.')}{PEER_WHY}{why}" if why else reason


# ----------------------------------------------------------------------------- the verdict


def find(req: Any, text: str) -> Cause:
    """The first row of `TABLE` that matches `req`, the room's failure reason being `text`: rows 1-3 by the record's
    own field (`Row.field`); the others by the cause the room's ender told (`ReqState.told`, a field), and only
    without one by what the reason's text names (`Row.reads`: upstream's own reasons, and the fork's tags as an
    older fork build or this side itself wrote them)."""
    state = peek(req)
    told = state.told
    for row in TABLE:
        if row.field is not None:
            if getattr(state, row.field) is not None:
                return row.cause
        elif told is not None:
            return told.cause
        elif row.reads(text):
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


def kept_over(current: Optional[str], new: str) -> bool:
    """Whether a room's recorded reason `current` stays when `new` is recorded: over upstream's bare abort reason
    (e.g. the sender's Failed after the ledger told the pause), and a lost peer over anything but a lost peer."""
    return bool(current) and (is_bare_abort(new) or is_lost_peer(current) and not is_lost_peer(new))


PEER_ENDED = (Cause.PEER_PAUSE, Cause.PEER_REJECTION, Cause.PEER_ABORT)  # the peer ended the room: nothing failed


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


def check_cause(cause: str) -> None:
    if cause not in CAUSES:
        raise ValueError(f"unknown PD request end cause {cause!r}; expected one of {CAUSES}")


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
