"""A PD scheduler's idle passes, paced: the scheduler thread waits a moment instead of spinning.

Why: upstream's `Scheduler.on_idle` returns after `time.sleep(0)` when a PD queue still holds a request (a transfer
pending, a handshake awaited) and its event loop polls again at once. Decode's scheduler spins like that through
the whole prefill compute and transfer, prefill's while its transfer runs; and mooncake's synchronous batch write
waits for completion by polling on its transfer thread. Where prefill, decode and the transfer share few cores,
the spinning takes the cores the transfer and the prefill forward need (docs/peer-liveness.md, "Transfer speed").

What: after each idle pass of a prefill or decode server, the scheduler thread waits up to
`SGLANG_FORK_PD_IDLE_PACE` seconds (default 0.001; 0 turns pacing off; validated at start with every knob). On the
rank that reads requests (attention TP/CP rank 0), it waits on the scheduler's own request and RPC sockets (zmq), so
a new request or call ends the wait at once; other ranks (and an ingress that is not a zmq socket) sleep. That rank
also waits on a wake (an eventfd, `Wake`, hung on its kv manager) set once a room's transfer ended: on prefill by the
transfer worker that concluded it (`chunk_failures.conclude_transfer`: Success or Failed), on decode by the thread
that applied prefill's Success or Failed for it (`after_apply_prefill_status`); so a finished transfer ends the wait
at once too. The wake is also set when another thread moves a room to WaitingForInput (`after_update_status`): on
prefill, its bootstrap thread once decode's handshake for the room arrived, so a lone request's prefill starts at once
instead of up to one pace later. Elsewhere a transfer that completes is noticed at most one pace later.

Invariant: only an idle pass of a PD server is paced (upstream calls `on_idle` only when the pass ran no batch), once
per pass, for at most the knob's time; a pass in which upstream's own idle sleeper already waited (fully idle, with
`--sleep-on-idle`) is not paced again; a plain server and a pace of 0 never wait. No collective and no lock: the
pacer changes when a rank reaches its next collective, never which one (the loop's collectives keep the ranks in
step, as before).

Called by: the AROUND hook on `Scheduler.on_idle` (`paced_on_idle`, fork_plugin.HOOKS), on the scheduler thread only;
the wake's setters on the transfer worker (prefill), decode's status thread (the AFTER hook on
`CommonKVManager.apply_prefill_status`) and any thread but the scheduler's that marks a room WaitingForInput (the AFTER
hook on `CommonKVManager.update_status`: prefill's bootstrap thread).
"""

from __future__ import annotations

import enum
import os
import threading
import time
from typing import Any, Optional

import zmq

from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.fork_core import knobs
from sglang.srt.managers.fork_core.fork_touch import upstream

ATTR = "fork_idle_pacer"  # the scheduler's pacer (`pacer_of`)
WAKE_ATTR = "fork_idle_wake"  # on a PD kv manager: the Wake its scheduler's pacer waits on (`wake_scheduler`)


class Wake:
    """An eventfd that ends a paced wait at once. Set by a transfer worker thread once it concluded a room, or by
    decode's status thread once it applied prefill's end of one (any number of times); cleared by the scheduler thread
    after a wait that it ended. Thread-safe: the kernel's counter is the
    only state (set adds to it, clear reads it back to 0; non-blocking, never read unless the poll said readable)."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.waiter = threading.get_ident()  # the scheduler thread (made there): it never needs to wake itself

    def set(self) -> None:
        os.eventfd_write(self.fd, 1)

    def clear(self) -> None:
        os.eventfd_read(self.fd)


class Mode(enum.Enum):
    OFF = "off"  # not a PD server, or a pace of 0: never waits
    POLL = "poll"  # the rank that reads requests: waits on its request/RPC sockets, woken by a message
    SLEEP = "sleep"  # other ranks, an ingress that is no zmq socket, or a pace under 1 ms: sleeps


class IdlePacer:
    """One scheduler's pacing: its mode (fixed at first use), the pace, and how many idle passes it paced."""

    def __init__(self, scheduler, pace: float) -> None:
        self.pace = pace
        self.paced = 0  # idle passes paced (read by tests)
        self._poller = None
        self._poll_ms = int(pace * 1000)  # zmq polls in whole milliseconds: never longer than the knob
        self.wake: Optional[Wake] = None  # POLL mode: set once a room's transfer ended (`wake_scheduler`)
        is_pd = upstream(scheduler, "disaggregation_mode") in (DisaggregationMode.PREFILL, DisaggregationMode.DECODE)
        if not is_pd or pace <= 0:
            self.mode = Mode.OFF
            return
        channels = upstream(scheduler, "ipc_channels")
        # None on the ranks that read no requests; the embedded Rust server's ingress is no zmq socket
        sockets = [s for s in (upstream(channels, "recv_from_tokenizer"), upstream(channels, "recv_from_rpc"))
                   if isinstance(s, zmq.Socket)]
        if sockets and self._poll_ms >= 1:
            self._poller = zmq.Poller()
            for s in sockets:
                self._poller.register(s, zmq.POLLIN)
            self.mode = Mode.POLL
            self.wake = attach_wake(scheduler)
            if self.wake is not None:
                self._poller.register(self.wake.fd, zmq.POLLIN)
        else:
            self.mode = Mode.SLEEP

    def after_idle_pass(self, scheduler) -> None:
        """Wait up to the pace unless off, or upstream's idle sleeper just waited (fully idle, --sleep-on-idle)."""
        if self.mode is Mode.OFF:
            return
        if upstream(scheduler, "idle_sleeper") is not None and scheduler.is_fully_idle():
            return
        self.paced += 1
        if self.mode is Mode.POLL:
            ready = self._poller.poll(self._poll_ms)
            if self.wake is not None and any(what == self.wake.fd for what, _ in ready):
                self.wake.clear()
        else:
            time.sleep(self.pace)


def pacer_of(scheduler) -> IdlePacer:
    """The scheduler's pacer (made at first use, with the knob's value then)."""
    pacer = scheduler.__dict__.get(ATTR)
    if pacer is None:
        pacer = scheduler.__dict__[ATTR] = IdlePacer(scheduler, knobs.PD_IDLE_PACE.get())
    return pacer


# the PD queue whose kv manager carries the wake, by role
_MANAGER_QUEUE = {DisaggregationMode.PREFILL: "disagg_prefill_bootstrap_queue",
                  DisaggregationMode.DECODE: "disagg_decode_prealloc_queue"}


def attach_wake(scheduler) -> Optional[Wake]:
    """A new Wake hung on the scheduler's kv manager (prefill: for its transfer workers, `wake_scheduler` from
    chunk_failures.conclude_transfer; decode: for its status thread, `after_apply_prefill_status`), for the pacer to
    wait on; None without eventfd or without a manager. Called once, at the pacer's creation (on the rank that reads requests): a manager made later (a
    role switch) gets none, and its transfers are noticed within a pace, as before. A backend whose workers do not
    conclude through chunk_failures never sets it on prefill."""
    queue = _MANAGER_QUEUE.get(upstream(scheduler, "disaggregation_mode"))
    if queue is None or not hasattr(os, "eventfd"):
        return None
    mgr = getattr(upstream(scheduler, queue), "kv_manager", None)  # the queue is None until the role's is made
    if mgr is None:
        return None
    wake = vars(mgr)[WAKE_ATTR] = Wake()
    return wake


def wake_scheduler(mgr: Any) -> None:
    """A room of `mgr` ended its transfer (any thread): end its scheduler's paced wait, if the pacer waits on a Wake."""
    wake = vars(mgr).get(WAKE_ATTR)
    if wake is not None:
        wake.set()


def after_apply_prefill_status(result: Any, mgr: Any, *args: Any, status: Any = None, **kwargs: Any) -> None:
    """AFTER CommonKVManager.apply_prefill_status (decode's status thread): prefill's Success or Failed for a room
    ends decode's scheduler's paced wait, so it takes the transferred request (or its failure) at once."""
    if status in (KVPoll.Success, KVPoll.Failed):
        wake_scheduler(mgr)


def after_update_status(result: Any, mgr: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER CommonKVManager.update_status(bootstrap_room, status): a room moved to WaitingForInput by a thread other
    than its scheduler's -- prefill's bootstrap thread, once decode's handshake (its KV indices) arrived -- ends the
    scheduler's paced wait, so the pass that follows starts the room's prefill at once. The scheduler thread's own
    calls (decode's receiver init) never set it: that thread is not waiting."""
    status = args[1] if len(args) > 1 else kwargs.get("status")
    if status != KVPoll.WaitingForInput:
        return
    wake = vars(mgr).get(WAKE_ATTR)
    if wake is not None and wake.waiter != threading.get_ident():
        wake.set()


# ----------------------------------------------------------------------------- hook (scheduler thread)

def paced_on_idle(original, scheduler, *args, **kwargs):
    """AROUND Scheduler.on_idle: upstream's idle pass, then the pace."""
    result = original(scheduler, *args, **kwargs)
    pacer_of(scheduler).after_idle_pass(scheduler)
    return result
