"""Aborted PD requests end as aborts, never as successes, and leave nothing behind.

Invariant: a PD request that an AbortReq reaches (client disconnect, /abort_request,
abort_all) ends with the abort's own finish reason -- for a client abort upstream's
FINISH_ABORT without an error status (HTTP 200 with finish_reason "abort"; a pause or
SLA abort keeps its 503) -- at whatever stage it is, including a transfer that
completes while the abort is pending (`to_finish` set, Success polled). It is counted
once under its cause (`request_end_cause`), never as a bootstrap/transfer failure. On
prefill the decode peer is told Failed at once (decode already sends ABORT), the
room's per-room transfer state is cleared, and a late handshake for the room is
answered Failed (`room_ledger.around_update_status`) instead of re-creating it.

Called by: the BEFORE hook on `Scheduler.abort_request` (marks the requests), the
verdict (`room_ledger.verdict`), AFTER hooks on prefill's retire paths (clear the
room), and the patched lines of prefill.py / decode.py (`counts_as_failure`,
`finish_transferred`).
"""

from __future__ import annotations

import contextlib
import logging
from http import HTTPStatus
from typing import Any, Iterable, Optional, Tuple

from sglang.srt.disaggregation import pd_queues, request_end_cause as end_cause, room_ledger
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.managers.fork_touch import upstream
from sglang.srt.disaggregation.pd_queues import (  # the stages, declared once
    DECODE_PREALLOC, DECODE_RUNNING, DECODE_TRANSFER, PREFILL_BOOTSTRAP, PREFILL_INFLIGHT,
    PREFILL_RUNNING, PREFILL_WAITING,
)

logger = logging.getLogger(__name__)

# Opens the reason a room carries to the peer when its request was aborted; the peer's
# prepare_abort recognises it and ends the request as an abort, not a failure.
ABORT_TAG = room_ledger.ABORT_TAG
CLIENT_ABORT_MESSAGE = room_ledger.CLIENT_ABORT_MESSAGE
_ABORT = room_ledger.REQUESTED_ABORT  # per request: (message, status) the abort asked for


# ----------------------------------------------------------------------------- pure


def _matches(recv_req: Any, rid: str) -> bool:
    return bool(recv_req.abort_all or rid.startswith(recv_req.rid or ""))


def requested_verdict(recv_req: Any) -> Tuple[str, Optional[int], str]:
    """(message, status, cause) an AbortReq asks for: a client abort has no status;
    an SLA abort (`abort_message`) is a 503 timeout; a finish reason the sender
    attached is kept as is (one naming the pause or release: end cause "pause")."""
    if recv_req.abort_message:
        return recv_req.abort_message, HTTPStatus.SERVICE_UNAVAILABLE, end_cause.TIMEOUT
    reason = recv_req.finished_reason or {}
    if reason.get("status_code") is not None:
        return reason.get("message") or "Aborted", reason["status_code"], end_cause.CLIENT_ABORT
    if _names_pause(reason.get("message")):  # pause_generation(abort) or a release
        return reason["message"], None, end_cause.PAUSE
    return CLIENT_ABORT_MESSAGE, None, end_cause.CLIENT_ABORT


def _names_pause(message) -> bool:
    from sglang.srt.managers.pd_pause import names_pause

    return names_pause(message)


peer_reason = room_ledger.peer_reason  # what the peer is told (one form, with the gate's)


# ----------------------------------------------------------------------------- side effects


def _kv_mgr(req):
    sender = upstream(req, "disagg_kv_sender")
    return None if sender is None else upstream(sender, "kv_mgr")


def _tell_decode(kv_mgr, room: int, reason: str) -> None:
    """Prefill -> decode: the room failed with `reason` (decode frees its preallocation
    now); remembered, so a handshake that comes later is answered Failed. Upstream's
    abort path marks the room Failed here."""
    room_ledger.end_room(kv_mgr, room, None, reason, fail=False, remember=True)


def _retire_prefill_room(scheduler, req, stage: str) -> None:
    """`req` ended here at `stage`: drop what the transfer manager keeps for its room,
    count its end."""
    kv_mgr = _kv_mgr(req)
    if kv_mgr is not None:
        req.disagg_kv_sender.clear()
        with getattr(kv_mgr, "failure_lock", None) or contextlib.nullcontext():  # fake: neither
            getattr(kv_mgr, "failure_records", {}).pop(req.bootstrap_room, None)
    end_cause.record_end(scheduler, req, "prefill", stage, kv_mgr)


def before_abort_request(scheduler, recv_req, *args, **kwargs) -> None:
    """BEFORE Scheduler.abort_request: mark each PD request the abort reaches with the
    verdict it asked for; on prefill, tell decode at once for each room not yet
    transferred."""
    role = pd_queues.role(scheduler)
    if role is None:
        return
    message, status, cause = requested_verdict(recv_req)
    seen = set()
    for stage, req in pd_queues.walk(scheduler):
        if id(req) in seen or not _matches(recv_req, req.rid) or req.finished():
            continue
        seen.add(id(req))
        if getattr(req, _ABORT, None) is not None:
            continue  # already aborted: a second abort changes nothing
        setattr(req, _ABORT, (message, status))
        end_cause.tag_req(req, cause)
        if role == "prefill":
            kv_mgr = _kv_mgr(req)
            room = req.bootstrap_room
            if kv_mgr is not None and room is not None and hasattr(kv_mgr, "send_kv_status_message"):
                if getattr(kv_mgr, "request_status", {}).get(room) != KVPoll.Success:
                    _tell_decode(kv_mgr, room, peer_reason(req.rid, room, "prefill", message))


def counts_as_failure(scheduler, req, role: str, stage: Optional[str] = None, kv_mgr=None) -> bool:
    """Count `req`'s end under its cause (once); whether upstream's failure counter
    should count it too (not for an abort). Called by the patched failure paths."""
    if stage is None:
        stage = pd_queues.prefill_stage(scheduler, req) if role == "prefill" else DECODE_TRANSFER
    if kv_mgr is None and role == "prefill":
        kv_mgr = _kv_mgr(req)
    cause = end_cause.record_end(scheduler, req, role, stage, kv_mgr)
    if cause is None:
        cause = end_cause.cause_of(req, kv_mgr)[0]
    return cause not in (end_cause.CLIENT_ABORT, end_cause.PAUSE)


def finish_transferred(scheduler, req) -> bool:
    """Prefill inflight, Success polled: True if `req` ends as an abort (its finish
    reason is set), False for a completion. An abort pending on the request
    (`to_finish`, or marked by `before_abort_request`) wins over the transfer."""
    from sglang.srt.disaggregation.utils import is_aborted, prepare_abort
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    if isinstance(req.finished_reason, FINISH_ABORT):
        return True
    if not (is_aborted(req) or getattr(req, _ABORT, None) is not None):
        return False
    pending = req.to_finish
    if getattr(req, _ABORT, None) is None and isinstance(pending, FINISH_ABORT):
        if pending.status_code is None:
            setattr(req, _ABORT, (CLIENT_ABORT_MESSAGE, None))
            end_cause.tag_req(req, end_cause.CLIENT_ABORT)
        else:
            setattr(req, _ABORT, (pending.message, pending.status_code))
            end_cause.tag_req(req, end_cause.TIMEOUT)
    req.to_finish = None
    prepare_abort(req, CLIENT_ABORT_MESSAGE)
    kv_mgr = _kv_mgr(req)
    end_cause.record_end(scheduler, req, "prefill", PREFILL_INFLIGHT, kv_mgr)
    if kv_mgr is not None and hasattr(kv_mgr, "send_kv_status_message"):
        # Decode may still hold the room: it must not run a request aborted here.
        _tell_decode(kv_mgr, req.bootstrap_room,
                     peer_reason(req.rid, req.bootstrap_room, "prefill", getattr(req, _ABORT)[0]))
    return True


def after_retire_aborted(result, scheduler, req, *args, **kwargs):
    """AFTER SchedulerDisaggregationPrefillMixin._retire_aborted_prefill_result: an
    aborted request retired before its KV was exposed; its room ends here."""
    if result:
        _retire_prefill_room(scheduler, req, PREFILL_RUNNING)
    return result


def after_release_aborted_waiting(result, scheduler, req, *args, **kwargs):
    """AFTER SchedulerDisaggregationPrefillMixin.release_aborted_prefill_waiting_req:
    upstream aborts the sender but never clears its room."""
    _retire_prefill_room(scheduler, req, PREFILL_WAITING)
    return result


def around_pending_chunked_abort(original, scheduler, *args, **kwargs):
    """AROUND Scheduler.process_pending_chunked_abort: upstream retires an aborted
    chunked prefill request (sender aborted, KV and slot released) but never clears
    its room; clear it here."""
    req = upstream(scheduler, "_pending_chunked_abort_req")
    retiring = req is not None and scheduler.chunked_req is req
    result = original(scheduler, *args, **kwargs)
    if retiring and scheduler.chunked_req is not req and pd_queues.role(scheduler) == "prefill":
        _retire_prefill_room(scheduler, req, PREFILL_RUNNING)
    return result
