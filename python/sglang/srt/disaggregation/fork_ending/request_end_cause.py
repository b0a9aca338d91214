"""Why a PD request ended without a completion, counted once; and every counter the fork adds.

Whoever ends a room `tag()`s it first (any thread; first tag wins); the queue that retires the request
calls `record_end()` (scheduler thread), which counts it and forgets the tag. `COUNTERS`: names and
labels are public; each is made at first use (importing prometheus_client early leaves multiprocess mode).

The per-room tags (room -> (cause, peer), `fork_end_causes` on the kv manager) are this module's, not the room
ledger's: a tag lives from the first step of a room's end (`RoomLedger.make`, or a hook that names the lost peer
first) to the counting of its request's end (`record_end`, which pops it), and counting is this module's; the ledger
imports this module to tag, so reading the tags through the ledger would make the counter import the ledger (a
circle) or move the counting into it. Lock: `_lock`, a leaf (taken alone, never while calling upstream). No clock: a
tag does not expire, it is popped when counted, bounded by `MAX_TAGGED_ROOMS` (oldest dropped) and shown in the
resource report (`fork_tables.end_cause_rooms`).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from sglang.srt.disaggregation.fork_ending import pd_queues, request_record, verdict, verdict_wording
# The causes (the counter's labels) and which one a request's end counts as: the verdict's table.
from sglang.srt.disaggregation.fork_ending.verdict_wording import (CAUSES, CLIENT_ABORT, PAUSE, PEER_FAILURE, TIMEOUT,
                                                                   TRANSPORT)
from sglang.srt.managers.fork_core.bounded import Cap, entry

# (role, cause, stage) -> requests ended so in this process.
COUNTS: Counter = Counter()

# Per kv manager: room -> (cause, peer), newest last, bounded.
_ROOMS_ATTR = "fork_end_causes"
MAX_TAGGED_ROOMS = Cap(4096, "a tag lives from a room's failure to its request's retirement, a scheduler pass or a "
                             "few; more failing at once than a server's queues hold is a flood: the oldest tags go "
                             "first (such an end counts by its request's own tag, else as transport)")
# Per request: (cause, peer) once known, the verdict's (`verdict.tag`, ReqState.end_cause); whether its end was
# counted, this module's (`Counted`).
_lock = threading.Lock()  # guards the per-manager room tags (docs/layout.md, threading model)

# One prefix for every metric the fork adds: `sglang:pd_` (upstream's `sglang:` namespace, then `pd_`); counters end
# in `_total`. Every one carries the scheduler's labels (upstream's: model_name, engine_type, tp_rank, ...) first,
# then its own, and exists only with --enable-metrics. Label values are bounded (docs/metrics.md).
# key -> (name, documentation, the counter's own label names)
COUNTERS = {
    "end_cause": (
        "sglang:pd_request_end_causes_total",
        "PD requests that ended without a completion, by role, cause "
        "(client_abort, pause, timeout, transport, peer_failure) and stage.",
        ("role", "cause", "stage"),
    ),
    "transfer_timeout": (
        "sglang:pd_transfer_timeouts_total",
        "PD requests aborted (HTTP 504) by the transfer deadline, by stage.",
        ("stage",),
    ),
    "chunk_failure": (
        "sglang:pd_transfer_chunk_failures_total",
        "Failed KV/aux/extra-state chunk writes of a PD transfer, by chunk kind and role.",
        ("kind", "role"),
    ),
    "peer_loss": (
        "sglang:pd_peer_losses_total",
        "PD peers declared lost (their requests failed, their state dropped), by role and peer (host:port).",
        ("role", "peer"),
    ),
    "peer_recovery": (
        "sglang:pd_peer_recoveries_total",
        "PD peers seen again after a loss (a restarted incarnation accepted), by role and peer (host:port).",
        ("role", "peer"),
    ),
    "recovery": (
        "sglang:pd_request_recoveries_total",
        "PD requests decode ran again after a transfer failure before their first token, by cause and outcome "
        "(started: per attempt; how the request ended: recovered, failed, not_started, weights_changed, aborted).",
        ("cause", "outcome"),
    ),
}
# key -> (name, documentation, the gauge's own label names): set by the scheduler (fork_report.pd_metrics), each
# process its own series (the scheduler's tp_rank label), "mostrecent" across processes as upstream's gauges.
GAUGES = {
    "paused": (
        "sglang:pd_paused",
        "1 while the scheduler is paused (pause_generation, any mode) until continue_generation, else 0.",
        (),
    ),
    "weight_epoch": (
        "sglang:pd_weight_epoch",
        "Weight updates this scheduler's prefix cache has seen (0 before the first); KV of an earlier epoch is "
        "never matched.",
        (),
    ),
    "peers_lost": (
        "sglang:pd_peers_lost",
        "PD peers declared lost and not seen again, by role.",
        ("role",),
    ),
    "peers_held_out": (
        "sglang:pd_peers_held_out",
        "Decode peers a prefill holds out as lost while they may be alive (silent: probed until they answer).",
        ("role",),
    ),
    "oldest_transfer": (
        "sglang:pd_oldest_transfer_seconds",
        "How long the oldest request has been in this PD transfer stage (0 when the stage is empty), by stage.",
        ("stage",),
    ),
    "transfer_deadline": (
        "sglang:pd_transfer_deadline_seconds",
        "The transfer deadline: no request stays longer in one PD transfer stage.",
        (),
    ),
}
# The `peer` label's values per process (the first peers counted); any later peer is counted as OTHER_PEER.
MAX_PEER_LABELS = Cap(64, "a metric series per value: a fleet that keeps restarting decodes on new ports must not "
                          "grow the series without bound; a deployment has far fewer peers")
OTHER_PEER = "other"
_peer_labels: set = set()
_made: Dict[str, Any] = {}
_made_lock = threading.Lock()  # guards the metrics' creation and the peer labels (any thread counts)


def scheduler_labels(scheduler: Any) -> Optional[Dict[str, str]]:
    """The scheduler's metric labels, or None when its metrics are off."""
    if not getattr(getattr(scheduler, "metrics_reporter", None), "enable_metrics", False):
        return None
    labels = getattr(getattr(scheduler, "metrics_collector", None), "labels", None)
    return dict(labels) if isinstance(labels, dict) else {}


_LABELS_ATTR = "fork_metric_labels"  # a kv manager's scheduler's labels (its transfer threads count with them)


def bind_labels(kv_manager: Any, scheduler: Any) -> None:
    """Give `kv_manager` its scheduler's labels (None: metrics off), for counts made on its own threads."""
    kv_manager.__dict__[_LABELS_ATTR] = scheduler_labels(scheduler)


def labels_of(kv_manager: Any) -> Optional[Dict[str, str]]:
    """The labels `bind_labels` gave `kv_manager`; None (nothing counted) when metrics are off or never bound."""
    return getattr(kv_manager, "__dict__", {}).get(_LABELS_ATTR)


def peer_label(peer: str) -> str:
    """`peer` as the `peer` label: itself for the first MAX_PEER_LABELS peers seen, OTHER_PEER after."""
    with _made_lock:
        if peer in _peer_labels:
            return peer
        if len(_peer_labels) < MAX_PEER_LABELS:
            _peer_labels.add(peer)
            return peer
    return OTHER_PEER


def answering_rank(scheduler: Any) -> bool:
    """Whether this scheduler is the rank that answers the client and exports upstream's scheduler metrics
    (attention TP/CP rank 0). With tensor parallelism every rank retires the same request in the same
    iteration; only this rank counts its end (the others' counts would double it, and a rank that did not
    decide the end knows no tag: it would count a transport failure). True without upstream's context."""
    context = getattr(scheduler, "metrics_collector_context", None)
    return getattr(context, "is_stats_logging_rank", True) is not False


def _metric(key: str, base_labels: Dict[str, str]) -> Any:
    """The counter or gauge `key` (created on first use with `base_labels`' names first)."""
    with _made_lock:
        if key not in _made:
            from prometheus_client import Counter as PromCounter
            from prometheus_client import Gauge as PromGauge

            if key in COUNTERS:
                name, doc, own = COUNTERS[key]
                _made[key] = PromCounter(name=name, documentation=doc, labelnames=list(base_labels) + list(own))
            else:
                name, doc, own = GAUGES[key]
                _made[key] = PromGauge(name=name, documentation=doc, labelnames=list(base_labels) + list(own),
                                       multiprocess_mode="mostrecent")
        return _made[key]


counter = _metric


def _child(key: str, base_labels: Dict[str, str], labels: Dict[str, str]) -> Any:
    base = {k: v for k, v in base_labels.items() if k not in labels}
    return _metric(key, base).labels(**base, **labels)


def inc(key: str, base_labels: Optional[Dict[str, str]], **labels: str) -> None:
    """Count one under `key`; nothing when `base_labels` is None (metrics off)."""
    if base_labels is not None:
        _child(key, base_labels, labels).inc(1)


def zero(key: str, base_labels: Optional[Dict[str, str]], **labels: str) -> None:
    """Export counter `key`'s series for `labels` at 0 before its first count (a rate over a series that appears
    with its first event misses that event); nothing when metrics are off."""
    if base_labels is not None:
        _child(key, base_labels, labels)


def set_gauge(key: str, base_labels: Optional[Dict[str, str]], value: float, **labels: str) -> None:
    """Set gauge `key`; nothing when `base_labels` is None (metrics off)."""
    if base_labels is not None:
        _child(key, base_labels, labels).set(value)


_check = verdict_wording.check_cause


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


def tables(kv_manager: Any) -> Dict[str, Dict[str, Any]]:
    """The resource report's view (pd_resource_report `fork_tables`): the rooms tagged on `kv_manager`, the peer
    label values of this process (kept: a label, once exported, stays)."""
    return {"end_cause_rooms": entry(tagged_rooms(kv_manager), MAX_TAGGED_ROOMS,
                                     "rooms tagged with their end's cause, until the end is counted"),
            "end_cause_peer_labels": entry(len(_peer_labels), MAX_PEER_LABELS,
                                           "peers named by the `peer` label of the fork's counters", per_peer=True)}


def cause_of(req: Any, kv_manager: Any = None) -> Tuple[str, Optional[str]]:
    """(cause, peer) for `req`: its own tag, its room's, a client abort, else a transport failure (the verdict)."""
    return verdict.counted_cause(req, _rooms(kv_manager).get(getattr(req, "bootstrap_room", None)))


@dataclass
class Counted:
    """This module's record on a request (`request_record`; scheduler thread): whether `record_end` counted its end."""

    counted: bool = False


def record_end(scheduler: Any, req: Any, role: str, stage: str, kv_manager: Any = None) -> Optional[str]:
    """Count `req`'s end once and forget its room's tag; the cause counted (later calls: None). The exported
    counter moves on the answering rank only (answering_rank); COUNTS is this process's own."""
    if request_record.peek(req, Counted).counted:
        return None
    cause, _peer = cause_of(req, kv_manager)
    request_record.of(req, Counted).counted = True
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
