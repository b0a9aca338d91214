"""What both peer monitors share: the probe, the monitor thread, counting, the claim's wire frames, the report.

Threads: one `ForkPeerMonitor-<role>` daemon per kv manager (`PeerMonitor._run`: a `tick` per heartbeat interval,
at a fixed rate), whose ticks probe every peer at once (`probe_all`: a `ForkPeerConnect` thread per peer, each
bounded by its connect timeout); `monitor_of` and the report functions on any thread. Lock: `PeerMonitor.lock`
guards each side's tables, held briefly and never while calling upstream (upstream's locks are taken outside it).
Invariant: a side counts each loss and each recovery of a peer once (`count`), and forgets a peer lost and not back
within `departed_after` (its `_age_out`). The sides: `prefill_side_monitor` (decode sessions, as prefill sees them),
`decode_side_monitor` (prefill bootstrap servers, as decode sees them). docs/peer-liveness.md.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple, Type, TypeVar

from sglang.srt.disaggregation.fork_ending import pd_queues, request_end_cause, verdict, verdict_rows, verdict_wording
from sglang.srt.environ import envs
from sglang.srt.managers.fork_core import fork_touch, knobs

logger = logging.getLogger(__name__)

TAG = verdict_wording.PEER_LOST_TAG  # opens every failure reason the monitors record; the verdict answers it 502

ALIVE, REFUSED, SILENT = "alive", "refused", "silent"
CONNECT_TIMEOUT = 1.0
# decode -> prefill (bootstrap thread): [ABORT, CLAIM_TAG, room, decode ip, decode rank port] "this decode holds the
# request". Behind upstream's ABORT tag so that a stock prefill (a rolling upgrade) takes it for a malformed ABORT
# (`AbortNotification.from_zmq`: a warning, nothing else) instead of a handshake, whose parse would raise and end its
# bootstrap thread.
CLAIM_TAG = b"FORK_CLAIM"

# (kind "loss"/"recovery", role, peer) -> count in this process (also in Prometheus).
COUNTS: Counter = Counter()
MORI_MANAGER = "sglang.srt.disaggregation.mori.conn.MoriKVManager"  # has mooncake's `_stopped` too
_MONITOR = "fork_peer_monitor"  # the monitor's attribute on its kv manager (monitor_of)

abort_status = verdict.lost_peer_status  # the verdict's 502 (row LOST_PEER)
LOST = verdict_rows.Told(verdict_rows.Cause.LOST_PEER)  # the cause told with every room a monitor ends (not TAG)


def probe(host: str, port: int, timeout: float = CONNECT_TIMEOUT) -> str:
    """ALIVE (a TCP connect succeeds), REFUSED (nothing listens) or SILENT (no answer in time)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return ALIVE
    except ConnectionRefusedError:
        return REFUSED
    except OSError:
        return SILENT


def probe_all(peers: Dict[str, Tuple[str, int]], timeout: float = CONNECT_TIMEOUT) -> Dict[str, str]:
    """`probe` of every peer (name -> (host, port)) at once, a thread each: a tick waits for the slowest peer, not
    for the sum of the silent ones' connect timeouts."""
    if len(peers) <= 1:
        return {name: probe(host, port, timeout) for name, (host, port) in peers.items()}
    out: Dict[str, str] = {}

    def one(name: str, host: str, port: int) -> None:
        out[name] = probe(host, port, timeout)

    threads = [threading.Thread(target=one, args=(name, host, port), name="ForkPeerConnect", daemon=True)
               for name, (host, port) in peers.items()]
    for thread in threads:
        thread.start()
    for thread in threads:  # each connect is bounded by `timeout`
        thread.join()
    return out


def loss_message(role_lost: str, peer: str, why: str) -> str:
    return f"{TAG}: {role_lost} peer {peer} lost ({why})"


def heartbeat_settings() -> Tuple[float, int]:
    """Upstream's decode heartbeat knobs, with its floors (2 s, 1 miss); prefill uses them too."""
    interval = envs.SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL.get()
    max_failures = envs.SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE.get()
    if not interval > 0 or max_failures < 1:
        raise ValueError("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL must be > 0 and "
                         f"SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE >= 1 (got {interval!r}, {max_failures!r})")
    return max(interval, 2.0), max_failures


def claim_frames(room: int, ip: str, port: int) -> List[bytes]:
    """Decode's claim of `room` on the wire (CLAIM_TAG): sent by decode's scheduler, read by prefill's bootstrap
    thread (the two sides' monitors)."""
    from sglang.srt.disaggregation.common.conn import ABORT_TAG

    return [ABORT_TAG, CLAIM_TAG, str(room).encode("ascii"), ip.encode("ascii"), str(port).encode("ascii")]


class PeerMonitor:
    """One kv manager's peers, watched from a daemon thread (one per scheduler). A side sets `role` (where it
    runs), `watches` (the role of its peers), and keeps its tables under `lock`."""

    role = ""
    watches = ""

    def __init__(self, mgr: Any, labels: Dict[str, str], metrics: bool):
        self.mgr = mgr
        self.labels = labels if metrics else None  # None: no Prometheus counter
        self.interval, self.max_failures = heartbeat_settings()
        self.lock = threading.Lock()
        self.departed_after = knobs.DEPARTED_DECODE_AFTER.get()  # a peer lost this long and not back has left
        self.thread = threading.Thread(target=self._run, name=f"ForkPeerMonitor-{self.role}", daemon=True)

    def _run(self) -> None:
        """One tick per interval at a fixed rate (a tick probing a silent peer takes CONNECT_TIMEOUT: a sleep of
        a whole interval after it would stretch `max_failures` heartbeats by that much each)."""
        next_tick = time.monotonic()
        while True:
            next_tick += self.interval
            time.sleep(max(0.0, next_tick - time.monotonic()))
            if fork_touch.upstream_on(self.mgr, "_stopped", fork_touch.MOONCAKE_MANAGER, MORI_MANAGER, default=False):
                return
            self.tick()
            next_tick = max(next_tick, time.monotonic() - self.interval)  # fell behind: no burst of ticks

    def tick(self) -> None:
        """Monitor thread: one heartbeat of every peer (each side's)."""
        raise NotImplementedError

    def count(self, kind: str, peer: str) -> None:
        """A loss or a recovery of `peer` (kind "loss"/"recovery"), counted once."""
        COUNTS[(kind, self.role, peer)] += 1
        request_end_cause.inc(f"peer_{kind}", self.labels, role=self.role, peer=request_end_cause.peer_label(peer))

    def log_departed(self, peer: str) -> None:
        logger.warning("PD peer departed: %s peer %s, lost more than %gs ago, is not back; forgotten (%s)",
                       self.watches, peer, self.departed_after, knobs.DEPARTED_DECODE_AFTER.name)

    # the report's view (any thread; read-only): each side's

    def gauges(self) -> Dict[str, int]:
        """{"lost": peers lost and not back, "held_out": peers lost while they may be alive}."""
        raise NotImplementedError

    def counts(self) -> Dict[str, int]:
        """The resource report's `peers` entries of this side (`monitor_*`)."""
        raise NotImplementedError

    def tables(self) -> Dict[str, Dict[str, Any]]:
        """name -> {"size", "cap", "why"} (+ "memory" for one kept by design until it expires) of each table."""
        raise NotImplementedError


M = TypeVar("M", bound=PeerMonitor)


def monitor_of(mgr: Any, side: Type[M] = PeerMonitor) -> Optional[M]:
    """The monitor of kv manager `mgr` if it is a `side` (default: either), else None."""
    monitor = getattr(mgr, "__dict__", {}).get(_MONITOR)
    return monitor if isinstance(monitor, side) else None


def attach(queue: Any, mgr: Any, side: Type[M], owner: str) -> Optional[M]:
    """AFTER a PD queue's `_init_kv_manager` (scheduler thread): a `side` monitor on `mgr` (an `owner`, the upstream
    class whose tables the side reads), not started; None for another backend (the fake one) or one already there."""
    if mgr is None or not fork_touch.is_a(mgr, owner) or monitor_of(mgr) is not None:
        return None
    labels = request_end_cause.scheduler_labels(fork_touch.upstream(queue, "scheduler"))
    monitor = side(mgr, labels or {}, labels is not None)
    mgr.__dict__[_MONITOR] = monitor
    return monitor


def gauges(mgr: Any) -> Optional[Dict[str, int]]:
    """`PeerMonitor.gauges` of the kv manager's monitor; None without one (fake transfer backend)."""
    monitor = monitor_of(mgr) if mgr is not None else None
    return None if monitor is None else monitor.gauges()


def peer_tables(mgr: Any) -> Dict[str, int]:
    """Sizes of a kv manager's per-peer tables (resource report: no growth per peer restart)."""
    out = pd_queues.table_sizes(mgr, (
        "decode_kv_args_table", "failed_sessions", "session_failures", "failed_session_probes",
        "state_layout_rejections", "state_strides_validated", "prefill_info_table",
        "connection_pool", "heartbeat_failures", "session_pool", "_socket_cache",
    ))
    rooms_by_addr = getattr(mgr, "addr_to_rooms_tracker", None)  # decode's only (a report: what this role has)
    if rooms_by_addr is not None:
        out["addr_to_rooms_tracker_addrs"] = len(rooms_by_addr)
    monitor = monitor_of(mgr)
    if monitor is not None:
        out.update(monitor.counts())
        # the bound within which a lost peer that does not come back leaves every table above
        out["monitor_departed_after_s"] = monitor.departed_after
    return out


def monitor_tables(mgr: Any) -> Dict[str, Dict[str, Any]]:
    """The resource report's view of the manager's monitor tables (`fork_tables`; read-only): per peer, each
    bounded by the peers upstream knows or by its own cap; see each side's `tables`."""
    monitor = monitor_of(mgr)
    if monitor is None:
        return {}
    return {f"monitor_{name}": {"per_peer": not table.get("memory"), **table}
            for name, table in monitor.tables().items()}
