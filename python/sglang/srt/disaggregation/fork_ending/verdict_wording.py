"""The verdict's wording: every text the fork compares, here alone, and the predicates that read them. Upstream's texts
the fork must recognise and cannot get as a field (each naming its upstream source), and the fork's own messages and
tags (read only as the fallback for a room no cause was told with: a peer that is an older fork build or stock
upstream, or a failure this side recorded itself); the end causes counted (`request_end_cause`'s labels). No other
fork module compares message wording: they ask the predicates below (test_verdict.py checks it).

Thread: any (constants and pure functions of their arguments). Lock: none. Invariant: a text the fork compares is
declared once, here, and compared only here. Imports no fork module."""

from __future__ import annotations

import re
from typing import Any, Optional

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
# transfer_deadline's reason, whole (`deadline_stage` reads the stage back: recovery re-runs some stages' deadlines)
DEADLINE_MESSAGE = (DEADLINE_TAG + ": request {rid} (bootstrap_room={room}) spent {spent:.1f}s in stage {stage}, over "
                    "the {deadline:g}s deadline. Raise {env} or {arg} if transfers legitimately take longer.")
_DEADLINE_STAGE = re.compile(re.escape(DEADLINE_TAG) + r": .*? in stage (\w+), over the ")
PEER_LOST_TAG = "PD peer lost"  # the peer monitors' reasons (and transfer_deadline's unreachable prefill)
ABORT_TAG = "PD request aborted"  # the reason a room carries to the peer when its request was aborted (peer_reason)
PEER_WHY = " was aborted: "  # peer_reason: what the peer is told, then why
REJECTED = "rejected by"  # a tokenizer's or scheduler's rejection, told to the peer with its message
# Opens with ABORT_TAG: decode ended the request, so prefill's leg ends as an abort, not as a bootstrap failure.
CANCEL_REASON = ("PD request aborted on decode: the decode peer {peer} aborted room {room} before prefill received "
                 "the request")
DECODE_ABORT_REASON = "PD request aborted on decode: bootstrap_room={room} was aborted by the decode peer."
# Prefill's answer (an abort, 200) for its leg of a request decode's recovery runs again; the failure's reason follows
# (it names the room and the failed chunk).
RECOVERY_HANDOFF_MESSAGE = "PD room handed to decode's recovery (the request runs again under a new room there):"

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


# ----------------------------------------------------------------------------- what a text names


def names_pause(message: Any) -> bool:
    """Whether a message says a pause or a release ended the request (end cause "pause")."""
    return any(m in str(message or "") for m in PAUSE_MARKERS)


def names_deadline(text: Any) -> bool:
    return DEADLINE_TAG in str(text or "")


def deadline_stage(text: Any) -> Optional[str]:
    """The stage a deadline's reason (`DEADLINE_MESSAGE`, this side's or the peer's) names, or None (no deadline)."""
    match = _DEADLINE_STAGE.search(str(text or ""))
    return None if match is None else match.group(1)


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


def check_cause(cause: str) -> None:
    if cause not in CAUSES:
        raise ValueError(f"unknown PD request end cause {cause!r}; expected one of {CAUSES}")
