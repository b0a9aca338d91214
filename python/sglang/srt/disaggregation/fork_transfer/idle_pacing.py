"""A PD scheduler's idle passes, paced: the scheduler thread waits a moment instead of spinning.

Why: upstream's `Scheduler.on_idle` returns after `time.sleep(0)` when a PD queue still holds a request (a transfer
pending, a handshake awaited) and its event loop polls again at once. Decode's scheduler spins like that through
the whole prefill compute and transfer, prefill's while its transfer runs; and mooncake's synchronous batch write
waits for completion by polling on its transfer thread. Where prefill, decode and the transfer share few cores,
the spinning takes the cores the transfer and the prefill forward need (docs/peer-liveness.md, "Transfer speed").

What: after each idle pass of a prefill or decode server, the scheduler thread waits up to
`SGLANG_FORK_PD_IDLE_PACE` seconds (default 0.001; 0 turns pacing off; validated at start with every knob). On the
rank that reads requests (attention TP/CP rank 0), it waits on the scheduler's own request and RPC sockets (zmq), so
a new request or call ends the wait at once; other ranks (and an ingress that is not a zmq socket) sleep. A transfer
that completes is noticed at most one pace later.

Invariant: only an idle pass of a PD server is paced (upstream calls `on_idle` only when the pass ran no batch), once
per pass, for at most the knob's time; a pass in which upstream's own idle sleeper already waited (fully idle, with
`--sleep-on-idle`) is not paced again; a plain server and a pace of 0 never wait. No collective and no lock: the
pacer changes when a rank reaches its next collective, never which one (the loop's collectives keep the ranks in
step, as before).

Called by: the AROUND hook on `Scheduler.on_idle` (`paced_on_idle`, fork_plugin.HOOKS), on the scheduler thread only.
"""

from __future__ import annotations

import enum
import time

import zmq

from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.fork_core import knobs
from sglang.srt.managers.fork_core.fork_touch import upstream

ATTR = "fork_idle_pacer"  # the scheduler's pacer (`pacer_of`)


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
            self._poller.poll(self._poll_ms)
        else:
            time.sleep(self.pace)


def pacer_of(scheduler) -> IdlePacer:
    """The scheduler's pacer (made at first use, with the knob's value then)."""
    pacer = scheduler.__dict__.get(ATTR)
    if pacer is None:
        pacer = scheduler.__dict__[ATTR] = IdlePacer(scheduler, knobs.PD_IDLE_PACE.get())
    return pacer


# ----------------------------------------------------------------------------- hook (scheduler thread)

def paced_on_idle(original, scheduler, *args, **kwargs):
    """AROUND Scheduler.on_idle: upstream's idle pass, then the pace."""
    result = original(scheduler, *args, **kwargs)
    pacer_of(scheduler).after_idle_pass(scheduler)
    return result
