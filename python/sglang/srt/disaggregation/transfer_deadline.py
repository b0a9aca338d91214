"""Transfer deadlines: no PD request stays in one transfer stage longer than the deadline.

BEFORE each PD queue's poll (scheduler thread, rank 0 decides), an overdue request ends through
the ledger (504, the peer told). What and why: docs/transfer-deadline.md.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Sequence

from sglang.srt.disaggregation import fork_metrics, request_end_cause, room_ledger
from sglang.srt.disaggregation.pd_queues import (
    DECODE_PREALLOC, DECODE_TRANSFER, PREFILL_BOOTSTRAP, PREFILL_INFLIGHT, PREFILL_WAITING,
)
from sglang.srt.disaggregation.transfer_deadline_knob import ARG, ENV, configured
from sglang.srt.managers.engine_clock import engine_clock

logger = logging.getLogger(__name__)

_STAMP = "fork_transfer_stage"  # per request: (stage, entered_at on engine_clock)
TAG = room_ledger.DEADLINE_TAG  # opens every deadline message, the room's failure reason at the peer too
# A queue is scanned at most every deadline/SCAN_DIVISOR s (capped): a request expires at
# most two intervals late, and a 10k-request queue is not walked each pass.
SCAN_DIVISOR = 50
MAX_SCAN_INTERVAL = 1.0
COUNTS: Counter = Counter()
_next_scan: dict = {}


def _decides() -> bool:
    """Whether this rank answers the client (attention TP/CP rank 0, PP rank 0)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return all(getattr(parallel, rank, 0) == 0 for rank in ("attn_tp_rank", "attn_cp_rank", "pp_rank"))


def _expire(scheduler, stage: str, queue: Sequence[Any], side: str, keep=None) -> None:
    """Stamp the entries of `queue` (prefill: Req; decode: DecodeRequest) new to `stage`; end the overdue ones
    `keep` accepts."""
    if not queue:
        return
    now = engine_clock.now()
    if now < _next_scan.get(stage, float("-inf")) or not _decides():  # the common case: one lookup per pass
        return
    deadline = configured()
    _next_scan[stage] = now + min(deadline / SCAN_DIVISOR, MAX_SCAN_INTERVAL)
    for entry in list(queue):
        req = entry if side == "prefill" else entry.req
        stamp = getattr(req, _STAMP, None)
        if stamp is None or stamp[0] != stage:
            setattr(req, _STAMP, (stage, now))
            continue
        if now - stamp[1] <= deadline or getattr(req, room_ledger.DEADLINE_EXPIRED, None) is not None:
            continue
        # `keep` only for the overdue ones: upstream's is_aborted costs ~8 µs a request
        if keep is not None and not keep(entry):
            continue
        endpoint = req.disagg_kv_sender if side == "prefill" else entry.kv_receiver
        if endpoint is None:
            continue
        text = (f"{TAG}: request {req.rid} (bootstrap_room={req.bootstrap_room}) spent {now - stamp[1]:.1f}s in "
                f"stage {stage}, over the {deadline:g}s deadline. Raise {ENV} or {ARG} if transfers legitimately "
                "take longer.")
        setattr(req, room_ledger.DEADLINE_EXPIRED, text)
        logger.warning(text)
        if hasattr(endpoint.kv_mgr, "record_failure"):  # the peer told; prefill: a late handshake fails too
            room_ledger.end_room(endpoint.kv_mgr, req.bootstrap_room, request_end_cause.TIMEOUT, text,
                                 remember=side == "prefill", receiver=endpoint if side == "decode" else None)
        else:  # fake transfer: no peer
            endpoint.abort()
        COUNTS[stage] += 1
        fork_metrics.inc("transfer_timeout", fork_metrics.scheduler_labels(scheduler), stage=stage)


def before_pop_bootstrapped(queue, *args, **kwargs):  # BEFORE PrefillBootstrapQueue.pop_bootstrapped
    _expire(queue.scheduler, PREFILL_BOOTSTRAP, queue.queue, "prefill")


def before_resolve_waiting(scheduler, *args, **kwargs):
    """BEFORE SchedulerDisaggregationPrefillMixin.resolve_waiting_queue_bootstrap (PD, not aborted)."""
    from sglang.srt.disaggregation.utils import is_aborted

    _expire(
        scheduler, PREFILL_WAITING, scheduler.waiting_queue, "prefill",
        keep=lambda r: getattr(r, "disagg_kv_sender", None) is not None and not is_aborted(r),
    )


def before_prefill_inflight(scheduler, *args, **kwargs):  # BEFORE process_disagg_prefill_inflight_queue
    _expire(scheduler, PREFILL_INFLIGHT, scheduler.disagg_prefill_inflight_queue, "prefill")


def before_pop_preallocated(queue, *args, **kwargs):  # BEFORE DecodePreallocQueue.pop_preallocated
    _expire(queue.scheduler, DECODE_PREALLOC, queue.queue, "decode")


def before_pop_transferred(queue, *args, **kwargs):  # BEFORE DecodeTransferQueue.pop_transferred
    _expire(queue.scheduler, DECODE_TRANSFER, queue.queue, "decode")


def reset_scan_schedule() -> None:
    """Forget when each stage was last scanned (tests that move the clock around)."""
    _next_scan.clear()
