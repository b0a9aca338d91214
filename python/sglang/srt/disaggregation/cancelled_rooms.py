"""A room decode ended before prefill created it fails on prefill at creation.

Invariant: when decode ends a request (client abort, release during a pause, its own
deadline) it sends prefill an ABORT for the room. Upstream acts on it only when
prefill already has the room; an ABORT that arrives first (prefill's copy still held
at its pause gate, in its tokenizer, or on the wire) was dropped, and prefill later
waited for a handshake that never came (bootstrap timeout, 300 s) while the router
waited with it. Here such an ABORT is remembered (bounded: at most `MAX_ROOMS`, each
for the bootstrap + waiting timeout on the engine clock, so paused time does not
count) and the room moves `Bootstrapping -> Failed` as soon as prefill creates its
sender, with a reason naming the decode peer that marks it an abort (abort_retirement
answers it as one and counts no failure); upstream's bootstrap-failure path then
frees its slot.

An ABORT for a room prefill itself failed and cleared (decode's answer to our Failed)
is not kept; one for a room decode's handshake created but no sender owns (prefill's
copy not received, or answered at prefill's pause gate) also drops that room state. Who calls: `fork_plugin` hooks `on_prefill_manager_init` (AFTER
`PrefillBootstrapQueue._init_kv_manager`: wraps the mooncake manager's ABORT handler
on the instance, so mooncake/conn.py is not imported at plugin load),
`on_prefill_create_sender` (AFTER `PrefillBootstrapQueue.create_sender`) and
`on_sender_clear` (AFTER `CommonKVSender.clear`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, List, Optional, Tuple

from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.managers import fork_touch
from sglang.srt.managers.engine_clock import engine_clock

logger = logging.getLogger(__name__)

MAX_ROOMS = 65536
# Opens with abort_retirement.ABORT_TAG: decode ended the request (its ABORT carries no
# cause), so prefill's leg ends as an abort, not as a bootstrap failure.
REASON = "PD request aborted on decode: the decode peer {peer} aborted room {room} before prefill received the request"


class CancelledRooms:
    """Rooms a peer cancelled before this side created them: room -> (peer, expiry).
    Written by the manager's bootstrap thread, read by the scheduler; one lock."""

    def __init__(self, ttl_s: float, max_rooms: int = MAX_ROOMS):
        self.ttl_s = ttl_s
        self.max_rooms = max_rooms
        self._rooms: "OrderedDict[int, Tuple[str, float]]" = OrderedDict()
        # Rooms this side failed and cleared itself: decode's ABORT for one of them
        # (its answer to our Failed) cancels nothing, so it is not kept.
        self._ended: "OrderedDict[int, Tuple[str, float]]" = OrderedDict()
        # Rooms a live sender of this side owns (create_sender .. clear).
        self._owned: set = set()
        self._lock = threading.Lock()

    def own(self, room: int) -> None:
        with self._lock:
            self._owned.add(room)
            self._ended.pop(room, None)  # a new lifecycle (decode re-bootstraps rooms)

    def disown(self, room: int) -> None:
        with self._lock:
            self._owned.discard(room)

    def owns(self, room: int) -> bool:
        with self._lock:
            return room in self._owned

    def ended(self, room: int) -> None:
        now = engine_clock.now()
        with self._lock:
            self._ended.pop(room, None)
            self._ended[room] = ("", now + self.ttl_s)
            self._expire(now)

    def was_ended(self, room: int) -> bool:
        with self._lock:
            return room in self._ended

    def add(self, room: int, reason: str) -> None:
        now = engine_clock.now()
        with self._lock:
            self._rooms.pop(room, None)
            self._rooms[room] = (reason, now + self.ttl_s)
            self._expire(now)

    def discard(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)

    def take(self, room: int) -> Optional[str]:
        """Why `room` was cancelled (and forget it), or None."""
        now = engine_clock.now()
        with self._lock:
            self._expire(now)
            entry = self._rooms.pop(room, None)
        return None if entry is None else entry[0]

    def __len__(self) -> int:
        with self._lock:
            self._expire(engine_clock.now())
            return len(self._rooms)

    def _expire(self, now: float) -> None:  # caller holds the lock
        for table in (self._rooms, self._ended):
            while table:
                _, (_, expiry) = next(iter(table.items()))
                if expiry > now and len(table) <= self.max_rooms:
                    break
                table.popitem(last=False)


def _ttl_s() -> float:
    from sglang.srt.environ import envs

    return float(
        envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()
        + envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()
    )


def note_abort(mgr: Any, msg: List[bytes]) -> Optional[int]:
    """Remember an ABORT for a room this manager does not have (yet). Returns the room
    remembered, else None. Runs before upstream's handler sees the message."""
    from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification

    if not msg or msg[0] != ABORT_TAG:
        return None
    note = AbortNotification.from_zmq(msg)
    cancelled = mgr.fork_cancelled_rooms
    if note is None or cancelled.was_ended(note.room) or cancelled.owns(note.room):
        return None  # a live room: upstream's handler fails it
    peer = f"{note.decode_ip}:{note.decode_port}" if note.decode_ip else "(unknown)"
    cancelled.add(note.room, REASON.format(peer=peer, room=note.room))
    # Decode's handshake may have created the room already (WaitingForInput) though no
    # sender owns it (prefill's copy not received, or answered at its pause gate and
    # never to come): nobody would clear that state, so drop it now.
    for name in ("request_status", "transfer_infos", "req_to_decode_prefix_len", "failure_records"):
        table = getattr(mgr, name, None)
        if isinstance(table, dict):
            table.pop(note.room, None)  # one dict op: atomic
    return note.room


def on_prefill_manager_init(mgr: Any, queue: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `PrefillBootstrapQueue._init_kv_manager` (result: the manager). Wraps the
    bootstrap thread's ABORT handler on the instance (the thread looks it up per
    message); managers without one (fake, or upstream's deferred-bootstrap path,
    which keeps cancellations itself) are left as they are."""
    if mgr is None or getattr(mgr, "fork_cancelled_rooms", None) is not None:
        return None

    def keeping_cancellations(original):
        def handle_abort_notification(msg: List[bytes]) -> bool:
            room = note_abort(mgr, msg)
            handled = original(msg)
            if room is not None and room in mgr.request_status:
                # The sender appeared meanwhile; upstream's handler has failed it.
                mgr.fork_cancelled_rooms.discard(room)
            return handled

        return handle_abort_notification

    mgr.fork_cancelled_rooms = CancelledRooms(_ttl_s())  # before the bootstrap thread may use it
    if fork_touch.swap(mgr, "_handle_abort_notification", keeping_cancellations, by=__name__) is None:
        del mgr.fork_cancelled_rooms  # not a mooncake manager: nothing to keep
    return None


def on_prefill_create_sender(result: Any, queue: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER `PrefillBootstrapQueue.create_sender`: a room decode already ended is
    Failed before it waits for a handshake; pop_bootstrapped retires it next."""
    cancelled = getattr(queue.kv_manager, "fork_cancelled_rooms", None)
    if not result or cancelled is None or req.bootstrap_room is None:
        return None
    cancelled.own(req.bootstrap_room)
    mgr = queue.kv_manager
    reason = cancelled.take(req.bootstrap_room)
    if reason is None:
        return None
    logger.info("cancelled_rooms: %s (rid=%s)", reason, req.rid)
    mgr.record_failure(req.bootstrap_room, reason)
    mgr.update_status(req.bootstrap_room, KVPoll.Failed)
    # the ABORT handler may have dropped the room the sender had just opened
    mgr.request_status.setdefault(req.bootstrap_room, KVPoll.Failed)
    return None


def on_sender_clear(result: Any, sender: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `CommonKVSender.clear`: a room this prefill failed is remembered as ended
    (decode answers our Failed with an ABORT, which must not be kept as a
    cancellation of a room still to come)."""
    cancelled = getattr(sender.kv_mgr, "fork_cancelled_rooms", None)
    if cancelled is None:
        return None
    cancelled.disown(sender.bootstrap_room)
    if sender.conclude_state == KVPoll.Failed:
        cancelled.ended(sender.bootstrap_room)
    return None


def report(mgr: Any) -> Optional[int]:
    """How many cancellations are remembered (bounded; not held by any request)."""
    cancelled = getattr(mgr, "fork_cancelled_rooms", None)
    return None if cancelled is None else len(cancelled)


def around_record_failure(original, mgr: Any, bootstrap_room: int, failure_reason: str, *args: Any, **kwargs: Any) -> Any:
    """AROUND `CommonKVManager.record_failure`, decode side: the peer's Failed for a
    room this side already ended and cleared (e.g. prefill's answer to a late
    handshake, arriving after decode's own release ended its copy) is not recorded:
    no receiver will ever pop it, so it stayed in `failure_records` forever."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    if (
        getattr(mgr, "disaggregation_mode", None) == DisaggregationMode.DECODE
        and bootstrap_room not in mgr.request_status
    ):
        logger.debug("cancelled_rooms: dropping failure for ended room %s: %s",
                     bootstrap_room, failure_reason)
        return None
    return original(mgr, bootstrap_room, failure_reason, *args, **kwargs)
