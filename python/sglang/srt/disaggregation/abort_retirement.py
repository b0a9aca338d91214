"""Aborted PD requests end as aborts, never as successes, and leave nothing behind.

Invariant: a PD request that an AbortReq reaches (client disconnect, /abort_request,
abort_all) ends with the abort's own finish reason -- for a client abort upstream's
FINISH_ABORT without an error status (HTTP 200 with finish_reason "abort"; a pause or
SLA abort keeps its 503) -- at whatever stage it is, including a transfer that
completes while the abort is pending (`to_finish` set, Success polled). It is counted
once under its cause (`request_end_cause`), never as a bootstrap/transfer failure. On
prefill the decode peer is told Failed at once (decode already sends ABORT), the
room's per-room transfer state is cleared, and a late handshake for the room is
answered Failed (`transfer_deadline.around_update_status`) instead of re-creating it.

Called by: the BEFORE hook on `Scheduler.abort_request` (marks the requests), the
AROUND hook on `prepare_abort` (the finish reason), AFTER hooks on prefill's retire
paths (clear the room), the prefill manager-init hook (decode's ABORT carries a
reason), and the patched lines of prefill.py / decode.py (`counts_as_failure`,
`finish_transferred`).
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any, Iterable, List, Optional, Tuple

from sglang.srt.disaggregation import request_end_cause as end_cause, room_ledger
from sglang.srt.disaggregation.base import KVPoll

logger = logging.getLogger(__name__)

# Opens the reason a room carries to the peer when its request was aborted; the peer's
# prepare_abort recognises it and ends the request as an abort, not a failure.
ABORT_TAG = "PD request aborted"
CLIENT_ABORT_MESSAGE = "Aborted by the client."
# Reasons a room carries when an abort ended it: ours, and the one upstream's
# Common{Sender,Receiver}.abort() records (and the transfer worker may forward).
UPSTREAM_ABORT_REASON = "Aborted by AbortReq"
DECODE_ABORT_REASON = ABORT_TAG + " on decode: bootstrap_room={room} was aborted by the decode peer."
ABORT_REASONS = (ABORT_TAG, UPSTREAM_ABORT_REASON)

# Per request: (message, status) the abort asked for.
_ABORT = room_ledger.REQUESTED_ABORT

PREFILL_BOOTSTRAP = "prefill_bootstrap"
PREFILL_WAITING = "prefill_waiting"
PREFILL_RUNNING = "prefill_running"
PREFILL_INFLIGHT = "prefill_inflight"
DECODE_PREALLOC = "decode_prealloc"
DECODE_TRANSFER = "decode_transfer"
DECODE_RUNNING = "decode_running"


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


def peer_reason(rid: str, room: int, side: str, why: Optional[str] = None) -> str:
    """What the peer is told; `why` (the abort's message) only for a pause or release
    end, so the peer ends its copy as that too (room_ledger.verdict)."""
    said = f"{PEER_WHY}{why}" if why and _names_pause(why) else " was aborted."
    return f"{ABORT_TAG} on {side}: request {rid} (bootstrap_room={room}){said}"


PEER_WHY = " was aborted: "


def _prefill_reqs(scheduler) -> Iterable[Tuple[str, Any]]:
    queue = getattr(scheduler, "disagg_prefill_bootstrap_queue", None)
    for req in getattr(queue, "queue", ()):
        yield PREFILL_BOOTSTRAP, req
    for req in scheduler.waiting_queue:
        yield PREFILL_WAITING, req
    if getattr(scheduler, "chunked_req", None) is not None:
        yield PREFILL_RUNNING, scheduler.chunked_req
    last = getattr(scheduler, "last_batch", None)
    for req in getattr(last, "reqs", None) or ():
        yield PREFILL_RUNNING, req
    for req in getattr(scheduler, "disagg_prefill_inflight_queue", ()):
        yield PREFILL_INFLIGHT, req


def _decode_reqs(scheduler) -> Iterable[Tuple[str, Any]]:
    prealloc = scheduler.disagg_decode_prealloc_queue
    for entry in prealloc.queue:
        yield DECODE_PREALLOC, entry.req
    for entry in scheduler.disagg_decode_transfer_queue.queue:
        yield DECODE_TRANSFER, entry.req
    for req in scheduler.waiting_queue:
        yield DECODE_RUNNING, req
    for req in getattr(scheduler.running_batch, "reqs", ()):
        yield DECODE_RUNNING, req


def _role(scheduler) -> Optional[str]:
    if getattr(scheduler, "disagg_prefill_bootstrap_queue", None) is not None:
        return "prefill"
    if getattr(scheduler, "disagg_decode_prealloc_queue", None) is not None:
        return "decode"
    return None


def prefill_stage(scheduler, req) -> str:
    """Which prefill stage `req` is in (for the count)."""
    queue = getattr(scheduler, "disagg_prefill_bootstrap_queue", None)
    if req in getattr(queue, "queue", ()):
        return PREFILL_BOOTSTRAP
    if req in scheduler.waiting_queue:
        return PREFILL_WAITING
    if req in getattr(scheduler, "disagg_prefill_inflight_queue", ()):
        return PREFILL_INFLIGHT
    return PREFILL_RUNNING


# ----------------------------------------------------------------------------- side effects


def _kv_mgr(req):
    sender = getattr(req, "disagg_kv_sender", None)
    return getattr(sender, "kv_mgr", None)


def _tell_decode(kv_mgr, room: int, reason: str) -> None:
    """Prefill -> decode: the room failed with `reason` (decode frees its
    preallocation now). Decode's endpoints are known once its metadata arrived; a
    handshake that comes later is answered Failed by `around_update_status`."""
    from sglang.srt.disaggregation.transfer_deadline import _remember_expired

    _remember_expired(kv_mgr, room, reason)
    targets = kv_mgr._room_notify_targets(room) if hasattr(kv_mgr, "_room_notify_targets") else None
    kv_mgr.send_kv_status_message(
        targets=targets, bootstrap_room=room, status=KVPoll.Failed, failure_reason=reason
    )


def _clear_prefill_room(req) -> None:
    """Drop what the transfer manager keeps for `req`'s room (it has ended here)."""
    sender = getattr(req, "disagg_kv_sender", None)
    if sender is None:
        return
    kv_mgr = sender.kv_mgr
    room = req.bootstrap_room
    sender.clear()
    failure_lock = getattr(kv_mgr, "failure_lock", None)
    if failure_lock is not None:
        with failure_lock:
            kv_mgr.failure_records.pop(room, None)
    else:
        getattr(kv_mgr, "failure_records", {}).pop(room, None)


def before_abort_request(scheduler, recv_req, *args, **kwargs) -> None:
    """BEFORE Scheduler.abort_request: mark each PD request the abort reaches with the
    verdict it asked for; on prefill, tell decode at once for each room not yet
    transferred."""
    role = _role(scheduler)
    if role is None:
        return
    message, status, cause = requested_verdict(recv_req)
    reqs = _prefill_reqs(scheduler) if role == "prefill" else _decode_reqs(scheduler)
    seen = set()
    for stage, req in reqs:
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
        stage = prefill_stage(scheduler, req) if role == "prefill" else DECODE_TRANSFER
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
        kv_mgr = _kv_mgr(req)
        _clear_prefill_room(req)
        end_cause.record_end(scheduler, req, "prefill", PREFILL_RUNNING, kv_mgr)
    return result


def after_release_aborted_waiting(result, scheduler, req, *args, **kwargs):
    """AFTER SchedulerDisaggregationPrefillMixin.release_aborted_prefill_waiting_req:
    upstream aborts the sender but never clears its room."""
    kv_mgr = _kv_mgr(req)
    _clear_prefill_room(req)
    end_cause.record_end(scheduler, req, "prefill", PREFILL_WAITING, kv_mgr)
    return result


def around_pending_chunked_abort(original, scheduler, *args, **kwargs):
    """AROUND Scheduler.process_pending_chunked_abort: upstream retires an aborted
    chunked prefill request (sender aborted, KV and slot released) but never clears
    its room; clear it here."""
    req = getattr(scheduler, "_pending_chunked_abort_req", None)
    retiring = req is not None and scheduler.chunked_req is req
    result = original(scheduler, *args, **kwargs)
    if retiring and scheduler.chunked_req is not req and _role(scheduler) == "prefill":
        kv_mgr = _kv_mgr(req)
        _clear_prefill_room(req)
        end_cause.record_end(scheduler, req, "prefill", PREFILL_RUNNING, kv_mgr)
    return result


# ----------------------------------------------------------------------------- decode's ABORT


def on_prefill_manager_init(mgr: Any, queue: Any, *args: Any, **kwargs: Any):
    """AFTER PrefillBootstrapQueue._init_kv_manager: decode's ABORT for an active room
    records why (decode ended it: an abort there), so prefill ends the request as an
    abort, not as a failure "for an unknown reason from another rank". An ABORT for a
    room prefill does not have yet is `cancelled_rooms`' (its reason carries
    `ABORT_TAG`, so that leg ends as an abort too)."""
    handler = getattr(mgr, "_handle_abort_notification", None)
    if handler is None or getattr(handler, "fork_wrapped", False):
        return mgr

    def handle_abort_notification(msg: List[bytes]) -> bool:
        from sglang.srt.disaggregation.common.conn import ABORT_TAG as WIRE_ABORT

        from sglang.srt.disaggregation.common.conn import AbortNotification

        notification = AbortNotification.from_zmq(msg) if msg and msg[0] == WIRE_ABORT else None
        if notification is not None:
            room = notification.room
            status = mgr.request_status.get(room)
            if status is not None and status != KVPoll.Success:
                with mgr.failure_lock:
                    # Re-checked under the lock failure_exception() pops with: a
                    # room cleared meanwhile must not get a record back.
                    if room in mgr.request_status:
                        mgr.failure_records.setdefault(room, DECODE_ABORT_REASON.format(room=room))
        return handler(msg)

    handle_abort_notification.fork_wrapped = True
    mgr._handle_abort_notification = handle_abort_notification
    return mgr


