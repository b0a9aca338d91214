"""Why a PD request ended without a completion, counted once; and every counter the fork adds.

Whoever ends a room `tag()`s it first (any thread; first tag wins); the queue that retires the request
calls `record_end()` (scheduler thread), which counts it and forgets the tag. `COUNTERS`: names and
labels are public; each is made at first use (importing prometheus_client early leaves multiprocess mode).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import Any, Dict, Optional, Tuple

from sglang.srt.disaggregation.fork_ending import pd_queues, verdict
# The causes (the counter's labels) and which one a request's end counts as: the verdict's table.
from sglang.srt.disaggregation.fork_ending.verdict import CAUSES, CLIENT_ABORT, PAUSE, PEER_FAILURE, TIMEOUT, TRANSPORT

# (role, cause, stage) -> requests ended so in this process.
COUNTS: Counter = Counter()

# Per kv manager: room -> (cause, peer), newest last, bounded.
_ROOMS_ATTR = "fork_end_causes"
MAX_TAGGED_ROOMS = 4096
# Per request: (cause, peer) once known and whether its end was counted: verdict.ReqState (end_cause, counted).
_lock = threading.Lock()  # guards the per-manager room tags (docs/layout.md, threading model)

# key -> (name, documentation, the counter's own label names); labelled by the scheduler's labels first.
COUNTERS = {
    "end_cause": (
        "sglang:num_pd_request_end_causes_total",
        "PD requests that ended without a completion, by role, cause "
        "(client_abort, pause, timeout, transport, peer_failure) and stage.",
        ("role", "cause", "stage"),
    ),
    "transfer_timeout": (
        "sglang:num_transfer_timeout_reqs_total",
        "PD requests aborted (HTTP 504) by the transfer deadline, by stage.",
        ("stage",),
    ),
    "chunk_failure": (
        "sglang:num_transfer_chunk_failures_total",
        "Failed KV/aux/extra-state chunk writes of a PD transfer, by chunk kind and role.",
        ("kind", "role"),
    ),
    "peer_loss": (
        "sglang:num_pd_peer_losses_total",
        "PD peers declared lost (their requests failed, their state dropped)",
        ("role", "peer"),
    ),
    "peer_recovery": (
        "sglang:num_pd_peer_recoveries_total",
        "PD peers seen again after a loss (a restarted incarnation accepted)",
        ("role", "peer"),
    ),
}
_made: Dict[str, Any] = {}
_made_lock = threading.Lock()  # guards the counters' creation (any thread counts)


def scheduler_labels(scheduler: Any) -> Optional[Dict[str, str]]:
    """The scheduler's metric labels, or None when its metrics are off."""
    if not getattr(getattr(scheduler, "metrics_reporter", None), "enable_metrics", False):
        return None
    labels = getattr(getattr(scheduler, "metrics_collector", None), "labels", None)
    return dict(labels) if isinstance(labels, dict) else {}


def answering_rank(scheduler: Any) -> bool:
    """Whether this scheduler is the rank that answers the client and exports upstream's scheduler metrics
    (attention TP/CP rank 0). With tensor parallelism every rank retires the same request in the same
    iteration; only this rank counts its end (the others' counts would double it, and a rank that did not
    decide the end knows no tag: it would count a transport failure). True without upstream's context."""
    context = getattr(scheduler, "metrics_collector_context", None)
    return getattr(context, "is_stats_logging_rank", True) is not False


def counter(key: str, base_labels: Dict[str, str]) -> Any:
    """The counter `key` (created on first use with `base_labels`' names first)."""
    with _made_lock:
        if key not in _made:
            from prometheus_client import Counter as PromCounter

            name, doc, own = COUNTERS[key]
            _made[key] = PromCounter(name=name, documentation=doc, labelnames=list(base_labels) + list(own))
        return _made[key]


def inc(key: str, base_labels: Optional[Dict[str, str]], **labels: str) -> None:
    """Count one under `key`; nothing when `base_labels` is None (metrics off)."""
    if base_labels is None:
        return
    base = {k: v for k, v in base_labels.items() if k not in labels}
    counter(key, base).labels(**base, **labels).inc(1)


_check = verdict.check_cause


def tag(kv_manager: Any, room: int, cause: str, peer: Optional[str] = None) -> None:
    """Record why `room` is about to fail (call before marking it Failed). First tag wins."""
    _check(cause)
    with _lock:
        rooms = kv_manager.__dict__.setdefault(_ROOMS_ATTR, OrderedDict())
        rooms.setdefault(room, (cause, peer))
        while len(rooms) > MAX_TAGGED_ROOMS:
            rooms.popitem(last=False)


def room_tag(kv_manager: Any, room: int) -> Optional[Tuple[str, Optional[str]]]:
    """(cause, peer) `room` is tagged with on this manager, or None."""
    with _lock:
        return _rooms(kv_manager).get(room)


def retag(kv_manager: Any, room: int, cause: str, peer: Optional[str] = None) -> None:
    """Tag `room` with the cause every rank agreed on (rank_agreement.share_failures): replaces this rank's own."""
    _check(cause)
    with _lock:
        kv_manager.__dict__.setdefault(_ROOMS_ATTR, OrderedDict()).pop(room, None)
    tag(kv_manager, room, cause, peer)


def tag_req(req: Any, cause: str, peer: Optional[str] = None) -> None:
    """Record why `req` is ending (sites that hold the request, not the room). First tag wins."""
    verdict.tag(req, cause, peer)


def _rooms(kv_manager: Any) -> dict:
    return getattr(kv_manager, "__dict__", {}).get(_ROOMS_ATTR) or {}


def tagged_rooms(kv_manager: Any) -> int:
    """How many rooms carry a tag (the resource report lists it as per-room state)."""
    return len(_rooms(kv_manager))


def cause_of(req: Any, kv_manager: Any = None) -> Tuple[str, Optional[str]]:
    """(cause, peer) for `req`: its own tag, its room's, a client abort, else a transport failure (the verdict)."""
    return verdict.counted_cause(req, _rooms(kv_manager).get(getattr(req, "bootstrap_room", None)))


def record_end(scheduler: Any, req: Any, role: str, stage: str, kv_manager: Any = None) -> Optional[str]:
    """Count `req`'s end once and forget its room's tag; the cause counted (later calls: None). The exported
    counter moves on the answering rank only (answering_rank); COUNTS is this process's own."""
    if verdict.peek(req).counted:
        return None
    cause, _peer = cause_of(req, kv_manager)
    verdict.of(req).counted = True
    with _lock:
        _rooms(kv_manager).pop(getattr(req, "bootstrap_room", None), None)
    COUNTS[(role, cause, stage)] += 1
    if answering_rank(scheduler):
        inc("end_cause", scheduler_labels(scheduler), role=role, cause=cause, stage=stage)
    return cause


def after_process_batch_result(result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.process_batch_result (decode): count the batch's aborted requests."""
    if pd_queues.role(scheduler) != pd_queues.DECODE:
        return
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    for req in batch.reqs:
        if isinstance(req.finished_reason, FINISH_ABORT) and (
                verdict.peek(req).end_cause is not None or verdict.is_client_abort(req)):
            record_end(scheduler, req, "decode", pd_queues.DECODE_RUNNING)


def before_send_abort_output(scheduler: Any, abort_req: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE Scheduler.send_abort_output (decode): count a tagged request it answers."""
    if pd_queues.role(scheduler) == pd_queues.DECODE and verdict.peek(req).end_cause is not None:
        record_end(scheduler, req, "decode", pd_queues.DECODE_RUNNING)
