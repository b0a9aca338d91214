"""The room ledger's scheduler-thread hooks (docs/aborts.md): the one verdict hook (`prepare_abort_verdict`,
verdict.TABLE), an AbortReq marking the PD requests it reaches (prefill tells decode at once), prefill's retire
paths clearing their rooms, the patched failure paths counting a request's end by cause (`count_failed_end`,
`record_transfer_failure`, `finish_transferred`), a scheduler's rejection told to the other side.

Thread: the scheduler's event loop only. Locks: none of its own; the ledger's and upstream's `failure_lock` briefly,
through the ledger. Invariant: a request's end is counted once, by cause; a room ends only through the ledger's named
transitions (`room_ledger.end_room`)."""

from __future__ import annotations

from typing import Any, Optional

from sglang.srt.disaggregation.fork_ending import pd_queues, request_end_cause as end_cause, verdict as table
from sglang.srt.disaggregation.fork_ending import verdict_wording
from sglang.srt.disaggregation.fork_ending.room_ledger import end_room, forget_failure, has_room_tables
from sglang.srt.disaggregation.fork_ending.room_reads import told_for_req
from sglang.srt.disaggregation.fork_ending.room_telling import ended_at_gate
from sglang.srt.disaggregation.fork_ending.room_transitions import Transition
from sglang.srt.disaggregation.fork_ending.verdict import peer_reason, told_for
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.managers.fork_core.fork_touch import upstream
from sglang.srt.managers.fork_core.rank_agreement import answers


def prepare_abort_verdict(original, req, error_message, status_code=None, *args, **kwargs):
    """AROUND `disaggregation.utils.prepare_abort`: the one verdict hook (verdict.TABLE). The cause the room's
    failure came with (its ledger) moves into the request's record first: the verdict reads it there."""
    told = told_for_req(req, str(error_message or ""))
    if told is not None:
        table.of(req).told = told
    error_message, status_code, cause = table.verdict(req, error_message, status_code)
    if cause is not None:
        end_cause.tag_req(req, cause)
    return original(req, error_message, status_code, *args, **kwargs)


# An AbortReq marks each PD request it reaches with the verdict it asked for; prefill tells decode at once and clears
# the room on its retire paths; patched lines call `count_failed_end`, `record_transfer_failure` and
# `finish_transferred` (docs/aborts.md).


def _kv_mgr(req):
    sender = upstream(req, "disagg_kv_sender")
    return None if sender is None else upstream(sender, "kv_mgr")


def _retire_prefill_room(scheduler, req, stage: str) -> None:
    """`req` ended here at `stage`: drop its room's transfer state, count its end."""
    kv_mgr = _kv_mgr(req)
    if kv_mgr is not None:
        req.disagg_kv_sender.clear()
        forget_failure(kv_mgr, req.bootstrap_room)  # fake: none
    end_cause.record_end(scheduler, req, "prefill", stage, kv_mgr)


def before_abort_request(scheduler, recv_req, *args, **kwargs) -> None:
    """BEFORE Scheduler.abort_request: mark the PD requests it reaches; prefill tells decode at once."""
    role = pd_queues.role(scheduler)
    if role is None:
        return
    message, status, cause = table.requested(recv_req)
    for stage, req in pd_queues.walk(scheduler):
        if not (recv_req.abort_all or req.rid.startswith(recv_req.rid or "")) or req.finished():
            continue
        if table.peek(req).requested is not None:
            continue  # already aborted (or met earlier in the walk): a second abort changes nothing
        table.of(req).requested = (message, status)
        end_cause.tag_req(req, cause)
        kv_mgr = _kv_mgr(req) if role == "prefill" else None  # decode: none; the fake one cannot send
        room = req.bootstrap_room  # None: `end_room` ends nothing
        if has_room_tables(kv_mgr) and upstream(kv_mgr, "request_status").get(room) != KVPoll.Success:
            end_room(kv_mgr, Transition.TELL_AND_REMEMBER, room, peer_reason(req.rid, room, "prefill", message),
                     told=told_for(message))


def counts_as_failure(scheduler, req, role: str, stage: Optional[str] = None, kv_mgr=None) -> bool:
    """Patched failure paths: count `req`'s end once; whether upstream counts a failure too."""
    if role == "prefill":  # decode's patched lines pass its stage and kv manager, prefill's neither
        stage, kv_mgr = stage or pd_queues.prefill_stage(scheduler, req), _kv_mgr(req)
    cause = end_cause.record_end(scheduler, req, role, stage, kv_mgr) or end_cause.cause_of(req, kv_mgr)[0]
    return cause not in (end_cause.CLIENT_ABORT, end_cause.PAUSE)


def count_failed_end(scheduler, req, role: str, stage: Optional[str] = None, kv_mgr=None, *, counter: str) -> None:
    """A patched failure path's one call (prefill's bootstrap and inflight failures, decode's prealloc): `req`'s
    end counted by cause; upstream's failure `counter` (a SchedulerMetricsCollector method) only for a real one."""
    if not counts_as_failure(scheduler, req, role, stage, kv_mgr):
        return
    if upstream(upstream(scheduler, "metrics_reporter"), "enable_metrics"):
        upstream(upstream(scheduler, "metrics_collector"), counter)()


def record_transfer_failure(queue_, decode_req, failure_reason: str) -> None:
    """Decode's transfer queue, a Failed poll (the patched line's one call): the request's end counted by cause;
    upstream's `_record_transfer_failure` (its failure counter, chunk_failures' hook) only for a real failure."""
    if counts_as_failure(queue_.scheduler, decode_req.req, "decode", "decode_transfer", decode_req.kv_receiver.kv_mgr):
        queue_._record_transfer_failure(failure_reason)


def finish_transferred(scheduler, req) -> bool:
    """Prefill inflight, Success polled: whether `req` ends as an abort (a pending one wins)."""
    from sglang.srt.disaggregation.utils import is_aborted, prepare_abort
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    if isinstance(req.finished_reason, FINISH_ABORT):
        return True
    asked = table.peek(req).requested
    if not (is_aborted(req) or asked is not None):
        return False
    pending = req.to_finish
    if asked is None:  # the pending abort (is_aborted, not finished) asks for its own verdict
        asked, cause = table.requested_by_pending(pending)
        table.of(req).requested = asked
        end_cause.tag_req(req, cause)
    req.to_finish = None
    prepare_abort(req, verdict_wording.CLIENT_ABORT_MESSAGE)
    kv_mgr = _kv_mgr(req)
    end_cause.record_end(scheduler, req, "prefill", pd_queues.PREFILL_INFLIGHT, kv_mgr)
    if has_room_tables(kv_mgr):  # the fake backend has no peer
        reason = peer_reason(req.rid, req.bootstrap_room, "prefill", asked[0])
        end_room(kv_mgr, Transition.TELL_AND_REMEMBER, req.bootstrap_room, reason, told=told_for(asked[0]))
    return True


def after_retire_aborted(result, scheduler, req, *args, **kwargs):
    """AFTER SchedulerDisaggregationPrefillMixin._retire_aborted_prefill_result: its room ends here."""
    if result:
        _retire_prefill_room(scheduler, req, pd_queues.PREFILL_RUNNING)


def after_release_aborted_waiting(result, scheduler, req, *args, **kwargs):
    """AFTER release_aborted_prefill_waiting_req: upstream never clears the room."""
    _retire_prefill_room(scheduler, req, pd_queues.PREFILL_WAITING)


def around_pending_chunked_abort(original, scheduler, *args, **kwargs):
    """AROUND Scheduler.process_pending_chunked_abort: clear the retired request's room."""
    req = upstream(scheduler, "_pending_chunked_abort_req")
    retiring = req is not None and scheduler.chunked_req is req
    result = original(scheduler, *args, **kwargs)
    if retiring and scheduler.chunked_req is not req and pd_queues.role(scheduler) == "prefill":
        _retire_prefill_room(scheduler, req, pd_queues.PREFILL_RUNNING)
    return result


def after_send_abort_output(result: Any, scheduler: Any, abort_req: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.send_abort_output: a scheduler's rejection ends the other side's copy (told by the answering
    rank alone: every rank rejects the same request, and the teller tells every prefill rank)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode, TransferBackend

    if not answers():
        return
    mode = scheduler.disaggregation_mode  # a request without a room: tell_prefill tells nothing
    if (mode == DisaggregationMode.DECODE and scheduler.transfer_backend != TransferBackend.FAKE
            and not req.time_stats.decode_prealloc_queue_entry_time):
        ended_at_gate(mode, req, table.rejected_by("decode's scheduler"))
    elif mode == DisaggregationMode.PREFILL and req.disagg_kv_sender is None:  # no room here
        said = (upstream(abort_req, "finished_reason") or {}).get("message")
        ended_at_gate(mode, req, table.rejected_by("prefill's scheduler", said))
