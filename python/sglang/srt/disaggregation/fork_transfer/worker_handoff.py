"""Prefill's scheduler hands a KV chunk to an idle transfer worker and lets it run at once.

Why: `send_kv_chunk` ends in upstream's `MooncakeKVManager.add_transfer_request`, which puts the chunk in a transfer
worker's queue; that wakes the worker, but the worker runs Python only once the scheduler thread lets go of the GIL,
which it does at its next blocking call (its paced idle wait) after the rest of its loop pass: the write starts
0.6-0.8 ms late on a loaded 2-core machine (bench/README.md, "the fixed cost per request, broken down").

What: right after the put (when upstream's `CommonKVSender.send` returns), if that queue's worker was parked waiting for a chunk, the scheduler thread waits (a
`threading.Event`, which lets go of the GIL) until the worker took the chunk, for at most
`SGLANG_FORK_TRANSFER_HANDOFF` seconds (default 0.0005; 0 never waits: upstream's behaviour; read once per kv
manager). The worker then prepares and starts the write at once; the scheduler goes on when the worker first blocks.
A worker busy with an earlier chunk is not waited for: it takes the chunk when it is done, as before.

Invariant: the scheduler thread waits only right after a put to a parked worker, at most the knob's time per put;
the worker's loop is upstream's, its queue seen through `WatchedQueue` (get and put delegated, nothing reordered or
dropped). No lock: a queue's `parked` and `taken` are written by its worker only (the GIL orders them).

Called by: `chunk_failures`' guarded transfer worker (`watched`, on each worker thread, before upstream's loop) and
the AFTER hook on `CommonKVSender.send` (`after_send`, prefill's scheduler thread; the sender's, so that loading the
hooks does not import mooncake's module, which imports prometheus_client before the server configured it).
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List

from sglang.srt.managers.fork_core import knobs
from sglang.srt.managers.fork_core.fork_touch import upstream

ATTR = "fork_worker_handoff"  # on prefill's kv manager: its HandOff (`handoff_of`)


class WatchedQueue:
    """One transfer queue as its worker sees it: upstream's queue (`get`, `put` delegated), and the worker's state.
    `parked`: the worker waits in `get` (or is about to); `taken`: cleared before it parks, set once `get` returned."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue
        self.parked = False
        self.taken = threading.Event()

    def get(self) -> Any:
        self.taken.clear()
        self.parked = True
        try:
            return self.queue.get()
        finally:
            self.parked = False
            self.taken.set()

    def put(self, item: Any) -> None:
        self.queue.put(item)  # upstream's worker re-enqueues a deferred chunk itself

    def waiting_for_worker(self) -> bool:
        """A chunk is queued and the worker is parked: it was woken and has not taken it yet (scheduler thread)."""
        return self.parked and bool(upstream(self.queue, "_buf"))


class HandOff:
    """A prefill kv manager's watched transfer queues and the scheduler's bounded wait after a put. Counts (read by
    tests): `waits` (puts to a parked worker), `handed` (taken within the bound), `late` (not)."""

    def __init__(self, bound: float) -> None:
        self.bound = bound
        self.queues: Dict[int, WatchedQueue] = {}  # id(upstream's queue) -> its WatchedQueue (added by each worker)
        self.waits = self.handed = self.late = 0

    def watch(self, queue: Any) -> WatchedQueue:
        watched = self.queues.get(id(queue))
        if watched is None or watched.queue is not queue:
            watched = self.queues[id(queue)] = WatchedQueue(queue)
        return watched

    def after_put(self) -> None:
        """The scheduler thread put a chunk: wait until a parked worker woken by it took it, at most `bound`."""
        ready: List[WatchedQueue] = [w for w in list(self.queues.values()) if w.waiting_for_worker()]
        for watched in ready:
            self.waits += 1
            if watched.taken.wait(self.bound):
                self.handed += 1
            else:
                self.late += 1


def handoff_of(mgr: Any) -> HandOff:
    """The kv manager's HandOff (made at first use, with the knob's value then)."""
    handoff = vars(mgr).get(ATTR)
    if handoff is None:  # the workers start together: setdefault keeps the first one made
        handoff = vars(mgr).setdefault(ATTR, HandOff(knobs.TRANSFER_HANDOFF.get()))
    return handoff


def watched(mgr: Any, queue: Any) -> Any:
    """The queue a transfer worker of `mgr` is given in place of upstream's (its thread, before upstream's loop):
    upstream's own where the knob is 0."""
    handoff = handoff_of(mgr)
    return handoff.watch(queue) if handoff.bound > 0 else queue


# ----------------------------------------------------------------------------- hook (scheduler thread)

def after_send(result: Any, sender: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER CommonKVSender.send (its kv manager's add_transfer_request queued the chunk, if it sent one): let a parked
    worker take the chunk before going on."""
    handoff = vars(sender.kv_mgr).get(ATTR)
    if handoff is not None:  # None: no worker watched (another backend, whose workers are not mooncake's guarded ones)
        handoff.after_put()
