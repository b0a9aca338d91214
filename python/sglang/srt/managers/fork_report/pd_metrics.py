"""The fork's gauges, set from what each concern holds (request_end_cause.GAUGES: pause, weight epoch, lost and
held-out peers, the oldest request of each PD transfer stage, the deadline), at most every PERIOD seconds, and the
bounded counters' series exported at 0 from the start. Scheduler thread (AFTER Scheduler.process_input_requests,
which runs every loop iteration, paused or not); nothing without --enable-metrics. docs/metrics.md.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional

from sglang.srt.disaggregation.fork_ending import pd_queues, request_end_cause, verdict_wording
from sglang.srt.disaggregation.fork_ending.engine_clock import engine_clock
from sglang.srt.disaggregation.fork_transfer import transfer_deadline
from sglang.srt.managers.fork_core import fork_touch

PERIOD = 1.0  # seconds between two settings of one scheduler's gauges
_ATTR = "fork_metrics_next"  # on the scheduler: when its gauges are set next (monotonic); absent: not yet started
# The stages the transfer deadline watches, by role (their oldest request's age is exported).
TRANSFER_STAGES = {
    pd_queues.PREFILL: (pd_queues.PREFILL_BOOTSTRAP, pd_queues.PREFILL_WAITING, pd_queues.PREFILL_INFLIGHT),
    pd_queues.DECODE: (pd_queues.DECODE_PREALLOC, pd_queues.DECODE_TRANSFER),
}
RUNNING = {pd_queues.PREFILL: pd_queues.PREFILL_RUNNING, pd_queues.DECODE: pd_queues.DECODE_RUNNING}
CHUNK_KINDS = ("kv", "aux", "state")


def _zero_counters(scheduler: Any, labels: Dict[str, str], role: str) -> None:
    """Export the counters whose label values are known in advance at 0 (the role's stages, causes, chunk kinds),
    on the ranks that count them: end causes, deadlines and decode's chunk failures on the answering rank only,
    prefill's chunk failures on every rank (each writes its own)."""
    answering = request_end_cause.answering_rank(scheduler)
    if role == pd_queues.PREFILL or answering:
        for kind in CHUNK_KINDS:
            request_end_cause.zero("chunk_failure", labels, kind=kind, role=role)
    if not answering:
        return
    for stage in TRANSFER_STAGES[role]:
        request_end_cause.zero("transfer_timeout", labels, stage=stage)
    for stage in TRANSFER_STAGES[role] + (RUNNING[role],):
        for cause in verdict_wording.CAUSES:
            request_end_cause.zero("end_cause", labels, role=role, cause=cause, stage=stage)


def oldest_by_stage(scheduler: Any, role: str, now: float) -> Dict[str, float]:
    """Seconds the oldest request of each transfer stage has spent there, on the deadline's clock (0: none
    stamped; the deadline stamps a request at its first scan of the stage, on the answering rank)."""
    oldest = {stage: 0.0 for stage in TRANSFER_STAGES[role]}
    for stage, req in pd_queues.walk(scheduler):
        stamp = transfer_deadline.stamp(req)
        if stage in oldest and stamp is not None and stamp[0] == stage:
            oldest[stage] = max(oldest[stage], now - stamp[1])
    return oldest


def _peers(kv_manager: Any) -> Optional[Dict[str, int]]:
    """{"lost": n, "held_out": n} of the kv manager's peer monitor; None without one (fake transfer backend)."""
    from sglang.srt.disaggregation.fork_peers.peer_monitor import gauges

    return gauges(kv_manager)


def set_gauges(scheduler: Any, labels: Dict[str, str], role: str) -> None:
    """Set every gauge of `scheduler` from what it holds now."""
    from sglang.srt.disaggregation.fork_transfer.transfer_deadline_knob import configured
    from sglang.srt.managers.fork_cache import weight_epoch

    paused = bool(fork_touch.upstream(scheduler, "_engine_paused"))
    request_end_cause.set_gauge("paused", labels, 1.0 if paused else 0.0)
    state = weight_epoch.state_of(scheduler.tree_cache)
    request_end_cause.set_gauge("weight_epoch", labels, 0 if state is None else state.epoch)
    peers = _peers(pd_queues.kv_manager(scheduler))
    if peers is not None:
        request_end_cause.set_gauge("peers_lost", labels, peers["lost"], role=role)
        request_end_cause.set_gauge("peers_held_out", labels, peers["held_out"], role=role)
    if request_end_cause.answering_rank(scheduler):  # the rank whose deadline scans stamp the requests
        request_end_cause.set_gauge("transfer_deadline", labels, configured())
        for stage, age in oldest_by_stage(scheduler, role, engine_clock.now()).items():
            request_end_cause.set_gauge("oldest_transfer", labels, age, stage=stage)


def after_process_input_requests(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER Scheduler.process_input_requests: a PD scheduler with metrics on sets its gauges every PERIOD s."""
    now = time.monotonic()
    due = scheduler.__dict__.get(_ATTR)
    if due is not None and now < due:  # the common case: one lookup
        return result
    role = pd_queues.role(scheduler)
    labels = request_end_cause.scheduler_labels(scheduler)
    if role not in TRANSFER_STAGES or labels is None:
        scheduler.__dict__[_ATTR] = float("inf")  # not PD, or metrics off: never again
        return result
    if due is None:
        _zero_counters(scheduler, labels, role)
    scheduler.__dict__[_ATTR] = now + PERIOD
    set_gauges(scheduler, labels, role)
    return result
