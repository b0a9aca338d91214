"""A prefill request routed to a decode that is gone ends within seconds, as peer loss.

While a decode is lost and not replaced, a request waiting for its handshake longer than
`SGLANG_FORK_LOST_DECODE_HANDSHAKE_TIMEOUT` ends through the ledger (502), not after upstream's
300 s (docs/gateway.md). Scheduler thread: BEFORE PrefillBootstrapQueue.pop_bootstrapped.
"""

from __future__ import annotations

import logging
import os
from typing import Any, List, Optional, Sequence, Tuple

from sglang.srt.disaggregation import request_end_cause
from sglang.srt.disaggregation.peer_liveness import TAG, monitor_of
from sglang.srt.disaggregation.room_ledger import end_room
from sglang.srt.disaggregation.transfer_deadline import _decides
from sglang.srt.disaggregation.transfer_deadline_knob import positive_seconds
from sglang.srt.managers import fork_touch
from sglang.srt.managers.engine_clock import engine_clock

logger = logging.getLogger(__name__)

ENV = "SGLANG_FORK_LOST_DECODE_HANDSHAKE_TIMEOUT"
DEFAULT = 5.0
ACCEPTED = "a finite number of seconds >= 0 (0 turns the rule off)"
# Per request: engine-clock time it was first seen waiting for its handshake.
_SINCE = "fork_handshake_wait_since"
_ENDED = "fork_lost_decode_handshake"
SCAN_INTERVAL = 0.5
_next_scan = [float("-inf")]


def parse(value: Optional[str]) -> float:
    """The knob's value in seconds; ValueError naming the knob when it is not valid."""
    return DEFAULT if value is None else positive_seconds(value, ENV, "valid", ACCEPTED, zero=True)


def lost_decodes(monitor: Any) -> List[str]:
    """host:port of every decode declared lost and not replaced on its host."""
    if monitor is None:
        return []
    with monitor.lock:
        return [peer for peers in monitor.lost.values() for peer in peers]


def orphans(reqs: Sequence[Any], handshaken, now: float, timeout: float) -> List[Tuple[Any, float]]:
    """(req, seconds waited) of each request without its decode's handshake (`handshaken(room)`)
    after `timeout`; one seen waiting for the first time is stamped `now`."""
    out = []
    for req in reqs:
        if getattr(req, _ENDED, None) is not None or handshaken(req.bootstrap_room):
            continue
        since = getattr(req, _SINCE, None)
        if since is None:
            setattr(req, _SINCE, now)
        elif now - since > timeout:
            out.append((req, now - since))
    return out


def message(req: Any, waited: float, lost: Sequence[str], timeout: float) -> str:
    # Opens with peer_liveness.TAG: prepare_abort answers it 502 like any peer loss.
    return (
        f"{TAG}: no decode took request {req.rid} (bootstrap_room={req.bootstrap_room}) "
        f"within {waited:.1f}s while decode peer {', '.join(lost)} is lost and not replaced "
        f"(a balancer still routing to it?); {ENV}={timeout:g}"
    )


def before_pop_bootstrapped(queue, *args, **kwargs):
    """BEFORE PrefillBootstrapQueue.pop_bootstrapped."""
    if not queue.queue:
        return
    now = engine_clock.now()
    if now < _next_scan[0] or not _decides():  # rank 0 decides; the poll's all-reduce spreads it
        return
    _next_scan[0] = now + SCAN_INTERVAL
    timeout = parse(os.environ.get(ENV))
    kv_mgr = fork_touch.upstream(queue, "kv_manager")
    lost = lost_decodes(monitor_of(kv_mgr))
    if not lost or timeout == 0 or not hasattr(kv_mgr, "conclude_failure"):
        for req in queue.queue:  # nothing is lost: forget the stamps
            if getattr(req, _SINCE, None) is not None:
                setattr(req, _SINCE, None)
        return
    infos = kv_mgr.transfer_infos
    for req, waited in orphans(queue.queue, lambda room: room in infos, now, timeout):
        if fork_touch.upstream(req, "disagg_kv_sender") is None:
            continue
        text = message(req, waited, lost, timeout)
        setattr(req, _ENDED, text)
        logger.warning(text)
        end_room(kv_mgr, req.bootstrap_room, request_end_cause.PEER_FAILURE, text, peer=lost[0])


def validate_at_start(mgr: Any, queue: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER PrefillBootstrapQueue._init_kv_manager: a bad knob stops the prefill."""
    parse(os.environ.get(ENV))
