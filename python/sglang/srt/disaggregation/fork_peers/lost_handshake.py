"""The lost-decode handshake rule: while a decode is lost, a prefill request whose decode never shook hands and
that no live decode holds ends (502) after `SGLANG_FORK_LOST_DECODE_HANDSHAKE_TIMEOUT` (a gateway's lost decode).

Thread: prefill's scheduler (`before_pop_bootstrapped`, at most every SCAN_INTERVAL, on the answering rank alone:
the poll's all-reduce carries its Failed to the other ranks). Lock: none of its own; it reads the prefill monitor's
`lost` and `claims` under `PeerMonitor.lock`, and writes only its own record on the request (`HandshakeWait` via
`request_record`: `since`, engine-clock time first seen waiting; `lost_decode`, the message that ended it), which
the scheduler thread alone touches. Invariant: a request is ended by this rule at most once, only while a decode
is lost and only when `waits_for_live_decode` does not excuse it; with no decode lost, every stamp is cleared.
docs/gateway.md, docs/peer-liveness.md.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from sglang.srt.disaggregation.fork_ending import request_end_cause, request_record, room_ledger
from sglang.srt.disaggregation.fork_ending.engine_clock import engine_clock
from sglang.srt.disaggregation.fork_peers.peer_monitor import LOST, TAG, monitor_of
from sglang.srt.disaggregation.fork_peers.prefill_side_monitor import PrefillSideMonitor
from sglang.srt.managers.fork_core import fork_touch, knobs
from sglang.srt.managers.fork_core.rank_agreement import answers

logger = logging.getLogger(__name__)



@dataclass
class HandshakeWait:
    """The lost-handshake rule's record on a request (`request_record`; scheduler thread): when it was first seen
    waiting for its handshake (engine clock), and the message that ended it."""

    since: Optional[float] = None
    lost_decode: Optional[str] = None


HANDSHAKE_ENV = knobs.LOST_DECODE_HANDSHAKE_TIMEOUT.name  # a gateway's lost decode (docs/gateway.md)
SCAN_INTERVAL = 0.5
_next_scan = [float("-inf")]


def lost_decodes(monitor: Any) -> List[str]:
    """host:port of every decode the prefill monitor declared lost and not replaced on its host."""
    if monitor is None:
        return []
    with monitor.lock:
        return [peer for peers in monitor.lost.values() for peer in peers]


def orphans(reqs: Sequence[Any], waits, now: float, timeout: float) -> List[Tuple[Any, float]]:
    """(req, seconds waited) of each request `waits(room)` does not excuse (handshaken, or held by a live decode)
    after `timeout`; one seen unexcused for the first time is stamped `now`."""
    out = []
    for req in reqs:
        state = request_record.of(req, HandshakeWait)
        if state.lost_decode is not None or waits(req.bootstrap_room):
            continue
        since = state.since
        if since is None:
            state.since = now
        elif now - since > timeout:
            out.append((req, now - since))
    return out


def waits_for_live_decode(room: int, handshaken, claimed_by, lost: Sequence[str]) -> bool:
    """THE RULE's exemption, in one place. A request waiting for its decode's handshake while a decode is lost is
    left to wait when its decode shook hands already (a lost decode's rooms end at the loss), or when a decode
    that is not lost claimed it (it sits in that decode's prealloc queue until KV frees up: a scale-in's burst).
    Otherwise -- unclaimed (a balancer sent its decode leg to the lost decode, which never got it), or claimed by
    the decode that was then lost -- it is bound to the lost decode as far as prefill can tell, and ends."""
    if handshaken(room):
        return True
    holder = claimed_by(room)
    return holder is not None and holder not in lost


def orphan_message(req: Any, waited: float, lost: Sequence[str], timeout: float,
                   holder: Optional[str] = None) -> str:
    if holder is not None:
        return (f"{TAG}: decode peer {holder}, which took request {req.rid} (bootstrap_room={req.bootstrap_room}), "
                f"is lost; no handshake within {waited:.1f}s; {HANDSHAKE_ENV}={timeout:g}")
    return (f"{TAG}: no decode took request {req.rid} (bootstrap_room={req.bootstrap_room}) within {waited:.1f}s "
            f"while decode peer {', '.join(lost)} is lost and not replaced (a balancer still routing to it?); "
            f"{HANDSHAKE_ENV}={timeout:g}")


def before_pop_bootstrapped(queue, *args, **kwargs):
    """BEFORE PrefillBootstrapQueue.pop_bootstrapped (scheduler thread): orphans of a lost decode end (502)."""
    now = engine_clock.now()
    if not queue.queue or now < _next_scan[0] or not answers():  # rank 0 decides; the poll's all-reduce spreads it
        return
    _next_scan[0] = now + SCAN_INTERVAL
    timeout = knobs.LOST_DECODE_HANDSHAKE_TIMEOUT.get()
    kv_mgr = fork_touch.upstream(queue, "kv_manager")
    monitor = monitor_of(kv_mgr, PrefillSideMonitor)
    lost = lost_decodes(monitor)
    if not lost or timeout == 0:
        for req in queue.queue:  # nothing is lost: forget the stamps
            request_record.of(req, HandshakeWait).since = None
        return
    waits = functools.partial(waits_for_live_decode, handshaken=kv_mgr.transfer_infos.__contains__,
                              claimed_by=monitor.claimed_by, lost=lost)
    for req, waited in orphans(queue.queue, waits, now, timeout):
        holder = monitor.claimed_by(req.bootstrap_room)
        text = orphan_message(req, waited, lost, timeout, holder)
        request_record.of(req, HandshakeWait).lost_decode = text
        logger.warning(text)
        # remembered: the handshake a silent decode queued for it may still arrive once the link is back
        room_ledger.end_room(kv_mgr, room_ledger.Transition.FAIL_TELL_REMEMBER, req.bootstrap_room, text,
                             cause=request_end_cause.PEER_FAILURE, peer=holder or lost[0], told=LOST)
