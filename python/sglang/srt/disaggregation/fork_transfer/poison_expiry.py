"""A failed write's poison mark expires: upstream's `_deferred_ack_poisoned_rooms` (which refuses a room's drain ACK
after a failed write) keeps a room marked for the server's life; the fork drops the mark once decode's release
deadline (`SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`) passed on the engine clock, checked each
bootstrap-queue pass — no thread per failed write (docs/chunk-failures.md).

Threads: transfer workers (`after_poison`, at the failed write: upstream marks the room there), the scheduler
(`expire_poison`, each `pop_bootstrapped` pass; the resource report's `poison_table`). Lock: `PoisonExpiry.lock`, a
leaf over its table (`until`); upstream's set is changed outside it (one set operation). Invariant: every mark this
side adds is dropped by its expiry, or early past `MAX_POISON_EXPIRIES` (oldest first), or forgotten once upstream
dropped it another way; the table is one entry per marked room, on the engine clock."""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Dict, List

from sglang.srt.disaggregation.fork_ending.engine_clock import engine_clock
from sglang.srt.environ import envs
from sglang.srt.managers.fork_core import fork_touch
from sglang.srt.managers.fork_core.bounded import Cap, entry

logger = logging.getLogger(__name__)

# Rooms whose poison mark waits for its expiry, per manager.
MAX_POISON_EXPIRIES = Cap(65536, "a failed write in each room; more within decode's release deadline (30 s) is a "
                                 "flood, whose oldest marks go early: their drain ACK is no longer refused, and "
                                 "decode's deadline releases those pages anyway")
POISON_ATTR = "fork_poison_expiry"


class PoisonExpiry:
    """A failed write's poison mark (upstream's `_deferred_ack_poisoned_rooms`, which refuses the room's drain ACK)
    goes once decode's release deadline passed on the engine clock: `note` (a transfer worker, at the failed write),
    `expire` (the scheduler thread, each bootstrap-queue pass: `before_pop_bootstrapped`). `until` (room -> its
    expiry, in order of expiry: one deadline for all) is guarded by `lock`, a leaf; upstream's set is changed outside
    it (a set operation)."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.until: "collections.OrderedDict[int, float]" = collections.OrderedDict()

    def note(self, room: int) -> List[int]:
        """`room` was just poison-marked; the rooms whose marks go now to keep the cap."""
        with self.lock:
            self.until.pop(room, None)
            self.until[room] = engine_clock.now() + self.delay_s
            return [self.until.popitem(last=False)[0] for _ in range(len(self.until) - MAX_POISON_EXPIRIES)]

    def due(self, marked: Any) -> List[int]:
        """The rooms whose marks go now; a room no longer `marked` (its mark went another way: the peer monitor
        dropped its decode session) is forgotten."""
        now = engine_clock.now()
        out = []
        with self.lock:
            while self.until and next(iter(self.until.values())) <= now:
                out.append(self.until.popitem(last=False)[0])
            for room in [r for r in self.until if r not in marked]:
                del self.until[room]
        return out


def after_poison(result: Any, mgr: Any, room: int, *args: Any, **kwargs: Any) -> None:
    """AFTER CommonKVManager.poison_deferred_ack_room (a transfer worker: a failed write, or the worker's own crash):
    the mark, now set, is dropped once decode's release deadline passed (`PoisonExpiry`). Noted after upstream's mark,
    never before: a bootstrap-queue pass in between would find an unmarked room and forget its expiry (the mark
    then stayed for the server's life; seen under load)."""
    if not fork_touch.upstream(mgr, "enable_deferred_decode_kv_release"):
        return
    expiry = mgr.__dict__.get(POISON_ATTR)
    if expiry is None:  # the first failed write (a transfer worker; a race makes two, one is kept)
        delay = envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get()
        expiry = mgr.__dict__.setdefault(POISON_ATTR, PoisonExpiry(delay))
    early = expiry.note(room)
    if early:
        logger.warning("%d poison marks dropped before their expiry (more than %d pending)", len(early),
                       MAX_POISON_EXPIRIES)
    _discard_poison(mgr, early)


def _discard_poison(mgr: Any, rooms: List[int]) -> None:
    poisoned = fork_touch.upstream(mgr, "_deferred_ack_poisoned_rooms")
    for room in rooms:
        poisoned.discard(room)


def expire_poison(queue: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE PrefillBootstrapQueue.pop_bootstrapped (scheduler thread, every loop pass): the poison marks due."""
    expiry = getattr(queue.kv_manager, "__dict__", {}).get(POISON_ATTR)
    if expiry is not None and expiry.until:
        marked = fork_touch.upstream(queue.kv_manager, "_deferred_ack_poisoned_rooms")
        _discard_poison(queue.kv_manager, expiry.due(marked))


def poison_table(mgr: Any) -> Dict[str, Any]:
    """The resource report's view of the pending poison expiries (`fork_tables`)."""
    expiry = getattr(mgr, "__dict__", {}).get(POISON_ATTR)
    return entry(0 if expiry is None else len(expiry.until), MAX_POISON_EXPIRIES,
                 "rooms whose failed write's poison mark waits for decode's release deadline (engine clock)")
