"""Surgery on upstream's per-peer connection state: a lost peer's cached push socket closed, a gone decode
session's blacklist and layout entries dropped, decode's sockets to a prefill that answers again reopened.

Threads: the callers' (prefill: its monitor thread and `ForkPeerProbe` threads; decode: the thread that fetched a
lost prefill's info again). Locks: upstream's only -- `_socket_lock`, then the endpoint's send lock (so no sender
is mid-message on a socket closed here), `CommonKVReceiver._global_lock`; `forget_session`'s caller holds
`session_lock`. Never called under a monitor's lock. Invariant: a socket is closed only once no sender uses it, and
it is out of upstream's cache before it is closed (a later send opens a new one).
"""

from __future__ import annotations

import contextlib
from typing import Any


def forget_session(mgr: Any, session: str) -> None:
    """Prefill: drop a decode session's blacklist and layout entries (caller holds session_lock)."""
    mgr._unblacklist_session(session)
    mgr.state_layout_rejections.pop(session, None)
    mgr.state_strides_validated.discard(session)


def drop_socket(mgr: Any, endpoint: str) -> None:
    """Prefill: close the cached push socket to a lost endpoint, not while a sender uses it."""
    with mgr._socket_lock:
        sock = mgr._socket_cache.pop(endpoint, None)
        monitor = mgr._monitor_cache.pop(endpoint, None)
    with mgr._socket_send_locks.get(endpoint) or contextlib.nullcontext():
        if sock is not None:
            sock.close(linger=0)
    if monitor is not None:
        monitor.close()


def reconnect_receivers(bootstrap_addr: str) -> None:
    """Decode: close the cached push sockets to the host of a prefill that answers again. One used while the
    prefill was silent (a handshake or an abort sent during a partition) is stuck: its connection retransmits on
    a backed-off timer (or its connect waits for a SYN retry), and a handshake sent on it after the heal would
    wait as long (seen: 15 s, the whole transfer deadline). A new socket connects at once."""
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    host = bootstrap_addr.rpartition(":")[0]
    with CommonKVReceiver._global_lock:
        stale = [ep for ep in CommonKVReceiver._socket_cache if ep.rpartition(":")[0] == f"tcp://{host}"]
    for endpoint in stale:
        CommonKVReceiver.disconnect_endpoint(endpoint)
