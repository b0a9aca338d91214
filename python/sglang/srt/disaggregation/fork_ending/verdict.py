"""The verdict: what a PD request that ends without a completion is answered (HTTP status, message), what its end is
counted as (`request_end_cause`), and which cause wins over which. Three things, each once:

- `TABLE`: one row per cause, in the order the verdict tries them (first match wins): status, message, end cause and
  why the row wins over those after it. docs/layout.md mirrors it (`markdown()`; a unit test compares the two).
- `ReqState`: the one record the fork keeps on a request (`of(req)`, one attribute), written by the module each field
  names, read here.
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
peer_liveness and transfer_deadline (their reasons' tags). Pure functions of their arguments and the record, on the
calling thread; no lock. A leaf: imports no fork module."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Dict, Optional, Tuple

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
PEER_LOST_TAG = "PD peer lost"  # peer_liveness's reasons (and transfer_deadline's unreachable prefill)
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

ATTR = "fork_state"  # the one attribute the fork sets on a request (upstream's Req, decode's DecodeRequest.req,
# the tokenizer's ReqState)


@dataclass
class ReqState:
    """All the fork keeps on one request, each field written by the module named (scheduler thread; the gate's two
    on the tokenizer's event loop) and read by the verdict / the modules named. Created at first write (`of`); a
    request without one has none of them."""

    deadline: Optional[str] = None  # transfer_deadline: its message; the request is answered 504
    pause: Optional[str] = None  # pd_pause: the pause's or a release's message that ended it
    requested: Optional[Tuple[str, Any]] = None  # room_ledger.before_abort_request: (message, status) asked for
    end_cause: Optional[Tuple[str, Optional[str]]] = None  # (cause, peer) it is counted as; first tag wins
    counted: bool = False  # request_end_cause.record_end counted its end
    stage: Optional[Tuple[str, float]] = None  # transfer_deadline: (stage, entered at, engine clock)
    handshake_wait_since: Optional[float] = None  # peer_liveness: first seen waiting for decode's handshake
    lost_decode: Optional[str] = None  # peer_liveness: the message ending it (no decode took it, its decode lost)
    told: Optional["Told"] = None  # room_ledger.prepare_abort_verdict: what the room's ender told of why (its ledger)
    # On the tokenizer's request state (upstream's tokenizer_manager.ReqState), by pause_gate (tokenizer event loop):
    at_gate: Optional[bool] = None  # waiting at the pause gate now (False: passed it; None: never reached it)
    gate_abort: Optional[str] = None  # the answer of an abort that reached it while it waited at the gate


def of(req: Any) -> ReqState:
    """`req`'s record, made at first use."""
    state = req.__dict__.get(ATTR)
    if state is None:
        state = req.__dict__[ATTR] = ReqState()
    return state


def peek(req: Any) -> ReqState:
    """`req`'s record, or an empty one (not stored): for reads that must not add state to a request."""
    return getattr(req, "__dict__", {}).get(ATTR) or _EMPTY


_EMPTY = ReqState()


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


@dataclass(frozen=True)
class Row:
    cause: Cause
    found: str  # what the verdict finds (the record's field, or what the room's failure reason names)
    status: str  # the HTTP status answered (HTTPStatus members, never ints: upstream's OpenAI stream checks the type)
    message: str  # the client's message
    end_cause: str  # the end-cause label counted
    wins: str  # why it wins over the rows after it


ABORT_ANSWER = "upstream's abort answer (200, finish_reason abort)"
TABLE: Tuple[Row, ...] = (
    Row(Cause.DEADLINE, "record's `deadline` (set by transfer_deadline)", "504",
        "the deadline's (`DEADLINE_TAG` ...)", TIMEOUT,
        "whatever failed meanwhile is a consequence of waiting too long"),
    Row(Cause.PAUSE, "record's `pause` (set by pd_pause)", ABORT_ANSWER,
        "the pause's or release's (`PAUSE_ABORT_MESSAGE`, `RELEASE_*_MESSAGE`)", PAUSE,
        "pause/release ended it; the transfer failure it caused is not the client's"),
    Row(Cause.REQUESTED_ABORT, "record's `requested` (set by room_ledger.before_abort_request, pd_pause.keep_abort_verdict)",
        "the AbortReq's: client abort: " + ABORT_ANSWER + "; SLA abort: 503",
        "the AbortReq's (a client's: `CLIENT_ABORT_MESSAGE`)", "client_abort / timeout (SLA) / pause",
        "the room's failure is the abort's consequence"),
    Row(Cause.PEER_PAUSE, "reason carries `ABORT_TAG` or `UPSTREAM_ABORT_REASON` and names the pause (`PAUSE_MARKERS`)", ABORT_ANSWER,
        "the peer's pause or release message", PAUSE,
        "the peer ended the room because its pause or release ended the request there"),
    Row(Cause.PEER_REJECTION, "reason carries `ABORT_TAG` or `UPSTREAM_ABORT_REASON`, and `PEER_WHY` + `REJECTED`", ABORT_ANSWER,
        "the rejection, as the peer's tokenizer or scheduler said it", CLIENT_ABORT,
        "the peer rejected the request: nothing failed"),
    Row(Cause.PEER_ABORT, "reason carries `ABORT_TAG` or `UPSTREAM_ABORT_REASON`", ABORT_ANSWER,
        "`CLIENT_ABORT_MESSAGE`", CLIENT_ABORT,
        "the peer ended the room because its request was aborted there"),
    Row(Cause.PEER_DEADLINE, "reason carries `DEADLINE_TAG` (the peer's deadline)", "504",
        "the reason", TIMEOUT, "the peer waited too long: a deadline, as above"),
    Row(Cause.PAUSE_REASON, "reason names the pause or a release (`PAUSE_MARKERS`: a room prefill's pause ended)", ABORT_ANSWER,
        "the reason", PAUSE, "pause/release ended it, as above"),
    Row(Cause.LOST_PEER, "reason carries `PEER_LOST_TAG` or `UPSTREAM_PREFILL_LOST`", "502",
        "the reason", "peer_failure (tagged by whoever lost it), else transport", "a peer is gone: not this server's fault"),
    Row(Cause.FAILURE, "anything else", "the caller's (500)", "the reason", TRANSPORT, ""),
)
ROWS: Dict[Cause, Row] = {row.cause: row for row in TABLE}


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
# Whichever row chose the message, one naming a deadline is answered as PEER_DEADLINE says (504, timeout) and one
# naming the pause as PAUSE_REASON says (the abort answer, pause): an AbortReq's message can name them.


def markdown() -> str:
    """`TABLE` as docs/layout.md shows it (test_verdict checks the doc holds exactly this)."""
    lines = ["| # | cause | found | status | client message | end cause | why it wins over what follows |",
             "|---|---|---|---|---|---|---|"]
    for i, row in enumerate(TABLE, 1):
        lines.append(f"| {i} | {row.cause.value} | {row.found} | {row.status} | {row.message} | {row.end_cause} "
                     f"| {row.wins} |")
    return "\n".join(lines)


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
    """The row of `TABLE` that decides `req`'s answer, the room's failure reason being `text`: the record's own
    fields, then the cause the room's ender told (`ReqState.told`, a field), and only without one the text
    (`from_text`)."""
    state = peek(req)
    if state.deadline is not None:
        return Cause.DEADLINE
    if state.pause is not None:
        return Cause.PAUSE
    if state.requested is not None:
        return Cause.REQUESTED_ABORT
    if state.told is not None:
        return state.told.cause
    return from_text(text)


def from_text(text: str) -> Cause:
    """The row a failure reason's text names, for a room whose ender told no cause: upstream's own reasons (its bare
    abort `UPSTREAM_ABORT_REASON`, decode's heartbeat `UPSTREAM_PREFILL_LOST`; anything else is a failure), and the
    fork's tags as an older fork build or this side itself wrote them (`ABORT_TAG`, `PEER_WHY`, `DEADLINE_TAG`,
    `PEER_LOST_TAG`, `PAUSE_MARKERS`)."""
    if names_abort(text):
        if names_pause(text):
            return Cause.PEER_PAUSE
        return Cause.PEER_REJECTION if PEER_WHY + REJECTED in text else Cause.PEER_ABORT
    if names_deadline(text):
        return Cause.PEER_DEADLINE
    if names_pause(text):
        return Cause.PAUSE_REASON
    return Cause.LOST_PEER if names_lost_peer(text) else Cause.FAILURE


def verdict(req: Any, error_message: Any, status_code: Any) -> Tuple[Any, Any, Optional[str]]:
    """(message, status, end cause to tag or None) `prepare_abort` reports for `req`, by `TABLE`."""
    text = str(error_message or "")
    state = peek(req)
    cause = find(req, text)
    told = state.told if state.told is not None and state.told.cause is cause else None
    if cause is Cause.DEADLINE:
        return state.deadline, HTTPStatus.GATEWAY_TIMEOUT, None  # the room is tagged by transfer_deadline
    tagged = None
    if cause is Cause.PAUSE:
        message, status = state.pause, None
    elif cause is Cause.REQUESTED_ABORT:
        message, status = state.requested
    elif cause is Cause.PEER_PAUSE:
        message, status = _told_message(told, text), None
    elif cause is Cause.PEER_REJECTION:
        message, status, tagged = _told_message(told, text), None, CLIENT_ABORT
    elif cause is Cause.PEER_ABORT:
        message, status, tagged = CLIENT_ABORT_MESSAGE, None, CLIENT_ABORT
    elif told is not None:  # PEER_DEADLINE, PAUSE_REASON, LOST_PEER, FAILURE told: the reason, the row's status
        message = error_message
        status = {Cause.PEER_DEADLINE: HTTPStatus.GATEWAY_TIMEOUT, Cause.LOST_PEER: HTTPStatus.BAD_GATEWAY}.get(
            cause, None if cause is Cause.PAUSE_REASON else status_code)
        tagged = {Cause.PEER_DEADLINE: TIMEOUT, Cause.PAUSE_REASON: PAUSE}.get(cause)
    else:  # PEER_DEADLINE, PAUSE_REASON, LOST_PEER, FAILURE read from the text: the reason itself
        message, status = error_message, lost_peer_status(text, status_code)
    # Whatever row chose it, a message naming a deadline answers 504 and one naming the pause the abort answer
    # (the rows PEER_DEADLINE and PAUSE_REASON); the first tag wins.
    if names_deadline(message):
        return message, HTTPStatus.GATEWAY_TIMEOUT, tagged or TIMEOUT
    if names_pause(message):
        return message, None, tagged or PAUSE
    return message, status, tagged


def _told_message(told: Optional[Told], text: str) -> str:
    """The peer's message: told as a field, else (an older peer) what its reason says after `PEER_WHY`."""
    if told is not None and told.message:
        return told.message
    return text.rsplit(PEER_WHY, 1)[-1]


def lost_peer_status(error_message: Any, status_code: Any) -> Any:
    """502 for a reason naming a lost peer, else `status_code` (the LOST_PEER row)."""
    return HTTPStatus.BAD_GATEWAY if error_message and names_lost_peer(error_message) else status_code


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
        return recv_req.abort_message, HTTPStatus.SERVICE_UNAVAILABLE, TIMEOUT
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
