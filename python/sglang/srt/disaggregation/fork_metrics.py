"""Every Prometheus counter the fork adds, declared once (names and labels are public).

Created on first use (importing prometheus_client when plugins load would take the process
out of multiprocess mode), labelled by the scheduler's labels then the counter's own. Any
thread may count; `_lock` guards creation.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional

# key -> (name, documentation, the counter's own label names)
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
_lock = threading.Lock()


def scheduler_labels(scheduler: Any) -> Optional[Dict[str, str]]:
    """The scheduler's metric labels, or None when its metrics are off."""
    reporter = getattr(scheduler, "metrics_reporter", None)
    if reporter is None or not getattr(reporter, "enable_metrics", False):
        return None
    labels = getattr(getattr(scheduler, "metrics_collector", None), "labels", None)
    return dict(labels) if isinstance(labels, dict) else {}


def counter(key: str, base_labels: Dict[str, str]) -> Any:
    """The counter `key` (created on first use with `base_labels`' names first)."""
    with _lock:
        if key not in _made:
            from prometheus_client import Counter

            name, doc, own = COUNTERS[key]
            _made[key] = Counter(name=name, documentation=doc, labelnames=list(base_labels) + list(own))
        return _made[key]


def inc(key: str, base_labels: Optional[Dict[str, str]], **labels: str) -> None:
    """Count one under `key`; nothing when `base_labels` is None (metrics off)."""
    if base_labels is None:
        return
    base = {k: v for k, v in base_labels.items() if k not in labels}
    counter(key, base).labels(**base, **labels).inc(1)
