"""Aborted PD requests end as aborts, never as successes, and leave nothing behind.

An AbortReq marks each PD request it reaches with the verdict it asked for (BEFORE
`Scheduler.abort_request`); prefill tells decode at once and clears the room on its retire
paths (AFTER hooks); the patched lines call `counts_as_failure` and `finish_transferred`.
Scheduler thread. What and why: docs/aborts.md.
"""

from __future__ import annotations

import contextlib
from http import HTTPStatus
from typing import Any, Optional, Tuple

from sglang.srt.disaggregation import pd_queues, request_end_cause as end_cause, room_ledger
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.pd_queues import (  # the stages, declared once
    DECODE_PREALLOC, DECODE_TRANSFER, PREFILL_BOOTSTRAP, PREFILL_INFLIGHT, PREFILL_RUNNING, PREFILL_WAITING,
)
from sglang.srt.managers.fork_touch import upstream

# Opens the reason a room carries to the peer when its request was aborted (the peer's verdict: an abort).
ABORT_TAG = room_ledger.ABORT_TAG
CLIENT_ABORT_MESSAGE = room_ledger.CLIENT_ABORT_MESSAGE
_ABORT = room_ledger.REQUESTED_ABORT  # per request: (message, status) the abort asked for


def requested_verdict(recv_req: Any) -> Tuple[str, Optional[int], str]:
    """(message, status, cause) an AbortReq asks for (client abort: no status; SLA abort: 503)."""
    if recv_req.abort_message:
        return recv_req.abort_message, HTTPStatus.SERVICE_UNAVAILABLE, end_cause.TIMEOUT
    reason = recv_req.finished_reason or {}
    if reason.get("status_code") is not None:
        return reason.get("message") or "Aborted", reason["status_code"], end_cause.CLIENT_ABORT
    if any(m in str(reason.get("message") or "") for m in room_ledger.PAUSE_MARKERS):  # pause(abort), release
        return reason["message"], None, end_cause.PAUSE
    return CLIENT_ABORT_MESSAGE, None, end_cause.CLIENT_ABORT


peer_reason = room_ledger.peer_reason  # what the peer is told (one form, with the gate's)


def _kv_mgr(req):
    sender = upstream(req, "disagg_kv_sender")
    return None if sender is None else upstream(sender, "kv_mgr")


def _retire_prefill_room(scheduler, req, stage: str) -> None:
    """`req` ended here at `stage`: drop its room's transfer state, count its end."""
    kv_mgr = _kv_mgr(req)
    if kv_mgr is not None:
        req.disagg_kv_sender.clear()
        with getattr(kv_mgr, "failure_lock", None) or contextlib.nullcontext():  # fake: neither
            getattr(kv_mgr, "failure_records", {}).pop(req.bootstrap_room, None)
    end_cause.record_end(scheduler, req, "prefill", stage, kv_mgr)


def before_abort_request(scheduler, recv_req, *args, **kwargs) -> None:
    """BEFORE Scheduler.abort_request: mark the PD requests it reaches; prefill tells decode at once."""
    role = pd_queues.role(scheduler)
    if role is None:
        return
    message, status, cause = requested_verdict(recv_req)
    seen = set()
    for stage, req in pd_queues.walk(scheduler):
        if id(req) in seen or not (recv_req.abort_all or req.rid.startswith(recv_req.rid or "")) or req.finished():
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
                    reason = peer_reason(req.rid, room, "prefill", message)
                    room_ledger.end_room(kv_mgr, room, None, reason, fail=False, remember=True)


def counts_as_failure(scheduler, req, role: str, stage: Optional[str] = None, kv_mgr=None) -> bool:
    """Patched failure paths: count `req`'s end once; whether upstream counts a failure too."""
    if stage is None:
        stage = pd_queues.prefill_stage(scheduler, req) if role == "prefill" else DECODE_TRANSFER
    if kv_mgr is None and role == "prefill":
        kv_mgr = _kv_mgr(req)
    cause = end_cause.record_end(scheduler, req, role, stage, kv_mgr)
    if cause is None:
        cause = end_cause.cause_of(req, kv_mgr)[0]
    return cause not in (end_cause.CLIENT_ABORT, end_cause.PAUSE)


def finish_transferred(scheduler, req) -> bool:
    """Prefill inflight, Success polled: whether `req` ends as an abort (a pending one wins)."""
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
    if kv_mgr is not None and hasattr(kv_mgr, "send_kv_status_message"):  # decode must not run it
        reason = peer_reason(req.rid, req.bootstrap_room, "prefill", getattr(req, _ABORT)[0])
        room_ledger.end_room(kv_mgr, req.bootstrap_room, None, reason, fail=False, remember=True)
    return True


def after_retire_aborted(result, scheduler, req, *args, **kwargs):
    """AFTER SchedulerDisaggregationPrefillMixin._retire_aborted_prefill_result: its room ends here."""
    if result:
        _retire_prefill_room(scheduler, req, PREFILL_RUNNING)
    return result


def after_release_aborted_waiting(result, scheduler, req, *args, **kwargs):
    """AFTER release_aborted_prefill_waiting_req: upstream never clears the room."""
    _retire_prefill_room(scheduler, req, PREFILL_WAITING)
    return result


def around_pending_chunked_abort(original, scheduler, *args, **kwargs):
    """AROUND Scheduler.process_pending_chunked_abort: clear the retired request's room."""
    req = upstream(scheduler, "_pending_chunked_abort_req")
    retiring = req is not None and scheduler.chunked_req is req
    result = original(scheduler, *args, **kwargs)
    if retiring and scheduler.chunked_req is not req and pd_queues.role(scheduler) == "prefill":
        _retire_prefill_room(scheduler, req, PREFILL_RUNNING)
    return result
