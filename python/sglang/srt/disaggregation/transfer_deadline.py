"""Transfer deadlines: no PD request stays in one transfer stage longer than the deadline.

BEFORE each PD queue's poll (scheduler thread, rank 0 decides), an overdue request ends through
the ledger (504, the peer told). What and why: docs/transfer-deadline.md.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, List, Sequence, Tuple

from sglang.srt.disaggregation import request_end_cause, room_ledger
from sglang.srt.disaggregation.pd_queues import (
    DECODE_PREALLOC, DECODE_TRANSFER, PREFILL_BOOTSTRAP, PREFILL_INFLIGHT, PREFILL_WAITING,
)
from sglang.srt.disaggregation.transfer_deadline_knob import ARG, ENV, configured
from sglang.srt.managers.engine_clock import engine_clock

logger = logging.getLogger(__name__)

# Per request: (stage, entered_at on engine_clock) and, once expired, the message.
_STAMP = "fork_transfer_stage"
_EXPIRED = room_ledger.DEADLINE_EXPIRED

# A queue is scanned at most every deadline/SCAN_DIVISOR s (capped): a request expires at
# most two intervals late, and a 10k-request queue is not walked each pass.
SCAN_DIVISOR = 50
MAX_SCAN_INTERVAL = 1.0

COUNTS: Counter = Counter()
_next_scan: dict = {}
_NEVER = float("-inf")


def overdue(stage: str, reqs: Sequence[Any], now: float, deadline: float) -> List[Tuple[int, float]]:
    """(index, seconds in stage) of each request past `deadline` in `stage` (a new one is stamped `now`)."""
    late = []
    for i, req in enumerate(reqs):
        stamp = getattr(req, _STAMP, None)
        if stamp is None or stamp[0] != stage:
            setattr(req, _STAMP, (stage, now))
        elif now - stamp[1] > deadline and getattr(req, _EXPIRED, None) is None:
            late.append((i, now - stamp[1]))
    return late


# Opens every deadline message; it travels to the peer as the room's failure reason.
TAG = room_ledger.DEADLINE_TAG


def message(stage: str, req: Any, elapsed: float, deadline: float) -> str:
    return (
        f"{TAG}: request {req.rid} (bootstrap_room="
        f"{req.bootstrap_room}) spent {elapsed:.1f}s in stage {stage}, over the "
        f"{deadline:g}s deadline. Raise {ENV} or {ARG} if transfers legitimately take longer."
    )


def _decides() -> bool:
    """Whether this rank answers the client (attention TP/CP rank 0, PP rank 0)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return all(getattr(parallel, rank, 0) == 0 for rank in ("attn_tp_rank", "attn_cp_rank", "pp_rank"))


def _expire(scheduler, stage: str, queue: Sequence[Any], side: str, keep=None) -> None:
    """Expire the overdue entries of `queue` (prefill: Req; decode: DecodeRequest) `keep` accepts."""
    if not queue:
        return
    now = engine_clock.now()
    if now < _next_scan.get(stage, _NEVER) or not _decides():  # the common case: one lookup per pass
        return
    deadline = configured()
    _next_scan[stage] = now + min(deadline / SCAN_DIVISOR, MAX_SCAN_INTERVAL)
    reqs = queue if side == "prefill" else [entry.req for entry in queue]
    for i, elapsed in overdue(stage, reqs, now, deadline):
        # `keep` only for the overdue ones: upstream's is_aborted costs ~8 µs a request
        if keep is not None and not keep(queue[i]):
            continue
        req = reqs[i]
        endpoint = req.disagg_kv_sender if side == "prefill" else queue[i].kv_receiver
        if endpoint is None:
            continue
        text = message(stage, req, elapsed, deadline)
        setattr(req, _EXPIRED, text)
        logger.warning(text)
        if hasattr(endpoint.kv_mgr, "record_failure"):  # the peer told; prefill: a late handshake fails too
            room_ledger.end_room(endpoint.kv_mgr, req.bootstrap_room, request_end_cause.TIMEOUT, text,
                                 remember=side == "prefill", receiver=endpoint if side == "decode" else None)
        else:  # fake transfer: no peer
            endpoint.abort()
        COUNTS[stage] += 1
        request_end_cause.inc("transfer_timeout", request_end_cause.scheduler_labels(scheduler), stage=stage)


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
