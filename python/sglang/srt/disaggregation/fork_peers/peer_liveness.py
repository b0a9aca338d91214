"""A crashed PD peer is noticed at once, its requests end (502), and its restart is served.

One `PeerMonitor` thread per (mooncake) kv manager probes its peers; prefill's bootstrap-queue hook ends a
request waiting for a lost decode's handshake that no live decode holds (decode claims each request as it enters its
prealloc queue); a decode lost and not back within `SGLANG_FORK_DEPARTED_DECODE_AFTER` has left (scaled in, moved,
replaced) and is forgotten. docs/peer-liveness.md, docs/gateway.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import socket
import threading
import time
from collections import Counter, OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from sglang.srt.disaggregation.fork_ending import pd_queues, request_end_cause, room_ledger, verdict
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.fork_ending.engine_clock import engine_clock
from sglang.srt.environ import envs
from sglang.srt.managers.fork_core import fork_touch, knobs
from sglang.srt.managers.fork_core.rank_agreement import answers

logger = logging.getLogger(__name__)

TAG = verdict.PEER_LOST_TAG  # opens every failure reason this module records; the verdict answers it 502

ALIVE, REFUSED, SILENT = "alive", "refused", "silent"
CONNECT_TIMEOUT = 1.0
MAX_GONE = 256
# decode -> prefill (bootstrap thread): [ABORT, CLAIM_TAG, room, decode ip, decode rank port] "this decode holds the
# request". Behind upstream's ABORT tag so that a stock prefill (a rolling upgrade) takes it for a malformed ABORT
# (`AbortNotification.from_zmq`: a warning, nothing else) instead of a handshake, whose parse would raise and end its
# bootstrap thread.
CLAIM_TAG = b"FORK_CLAIM"
# a claim whose prefill request has not arrived (or was cleared before it came) is dropped after this (s)
CLAIM_GRACE = 30.0

# (kind "loss"/"recovery", role, peer) -> count in this process (also in Prometheus).
COUNTS: Counter = Counter()
MORI_MANAGER = "sglang.srt.disaggregation.mori.conn.MoriKVManager"  # has mooncake's `_stopped` too
_MONITOR = "fork_peer_monitor"  # the monitor's attribute on its kv manager (monitor_of)


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


abort_status = verdict.lost_peer_status  # the verdict's 502 (row LOST_PEER)
LOST = verdict.Told(verdict.Cause.LOST_PEER)  # the cause told with every room this module ends (a field, not TAG)


def heartbeat_settings() -> Tuple[float, int]:
    """Upstream's decode heartbeat knobs, with its floors (2 s, 1 miss); prefill uses them too."""
    interval = envs.SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL.get()
    max_failures = envs.SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE.get()
    if not interval > 0 or max_failures < 1:
        raise ValueError("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL must be > 0 and "
                         f"SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE >= 1 (got {interval!r}, {max_failures!r})")
    return max(interval, 2.0), max_failures


def _count(monitor: "PeerMonitor", kind: str, peer: str) -> None:
    COUNTS[(kind, monitor.role, peer)] += 1
    request_end_cause.inc(f"peer_{kind}", monitor.labels, role=monitor.role, peer=request_end_cause.peer_label(peer))


class PeerMonitor:
    """Watches one kv manager's peers from a daemon thread (one per scheduler)."""

    def __init__(self, mgr: Any, role: str, labels: Dict[str, str], metrics: bool):
        self.mgr = mgr
        self.role = role
        self.labels = labels if metrics else None  # None: no Prometheus counter
        self.interval, self.max_failures = heartbeat_settings()
        self.lock = threading.Lock()
        self.misses: Dict[str, int] = {}
        self.known: Dict[str, Tuple[str, int]] = {}  # prefill: session -> decode (host, port)
        self.lost: Dict[str, List[str]] = {}  # prefill: host -> lost peers there; decode: bootstrap addrs
        self.lost_at: Dict[str, float] = {}  # lost peer -> when it was lost (aged out: `departed_after`)
        # prefill: lost sessions and host:port -> when (bounded: MAX_GONE entries, `departed_after` seconds)
        self.gone: "OrderedDict[str, float]" = OrderedDict()
        # prefill: room -> (decode host:port that claimed it, when): decode holds the request, its handshake follows
        # once it has preallocated (CLAIM_TAG); dropped when prefill clears the room, or after CLAIM_GRACE without it
        self.claims: Dict[int, Tuple[str, float]] = {}
        self.departed_after = knobs.DEPARTED_DECODE_AFTER.get()
        self.poisoned: Dict[str, set] = {}  # prefill: session -> rooms a failed write poison-marked
        self.held_out: set = set()  # prefill: sessions blacklisted at the last tick
        self.held: Dict[str, str] = {}  # prefill: session -> host:port lost while it may be alive
        self._probing: set = set()  # held sessions with a probe running
        # held session -> when it last did not answer (held out, or silent at a tick): a transfer engine probe
        # started before then may still hang in the transport's connect retries, so none is joined
        self.unanswered_at: Dict[str, float] = {}
        self.silent_since: Dict[str, float] = {}  # held session -> since when its endpoint takes no connection
        self.thread = threading.Thread(target=self._run, name=f"ForkPeerMonitor-{role}", daemon=True)

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
        (self._tick_prefill if self.role == "prefill" else self._tick_decode)()

    # -- prefill: decode sessions

    def is_lost(self, peer: str) -> bool:
        """Whether `peer` (decode: a prefill's bootstrap address) is lost now (the room ledger asks; any thread)."""
        return peer in self.lost

    def is_gone(self, names: List[str], text: Optional[str] = None) -> bool:
        """Whether any of `names` (sessions, host:port), or a peer named in `text`, is lost."""
        with self.lock:
            if any(n in self.gone for n in names):
                return True
            return bool(text) and any(f" {peer}" in text for peer in self.gone if ":" in peer)

    def sessions_named(self, text: Optional[str]) -> List[str]:
        """The known decode sessions whose host:port `text` names (upstream's failed write names its decode)."""
        with self.lock:
            return [s for s, (host, port) in self.known.items()
                    if text and re.search(rf" {re.escape(host)}:{port}(?!\d)", text)]

    def endpoint_gone(self, endpoint: Any) -> bool:
        """Whether the push endpoint "tcp://host:port" is a decode declared lost."""
        return isinstance(endpoint, str) and endpoint.startswith("tcp://") and self.is_gone([endpoint[6:]])

    def mark_gone(self, names: List[str], since: Optional[float] = None) -> None:
        """`names` are gone, since `since` (default: now; aged out `departed_after` from then)."""
        with self.lock:
            for name in names:
                self.gone[name] = time.monotonic() if since is None else since
                self.gone.move_to_end(name)
            while len(self.gone) > MAX_GONE:
                self.gone.popitem(last=False)

    def _tick_prefill(self) -> None:
        mgr, marks = self.mgr, self.mgr._deferred_ack_poisoned_rooms
        with self.lock:  # forget the rooms whose poison mark expired
            self.poisoned = {s: live for s, rooms in self.poisoned.items() if (live := rooms & marks)}
        with mgr.session_lock:
            sessions = {s: (info.endpoint, int(info.dst_port)) for s, info in mgr.decode_kv_args_table.items()}
            blacklisted = {s for s in sessions if s in mgr.failed_sessions}
            # a write still running at the loss blacklists the dead session again later
            for session in [s for s in mgr.failed_sessions if s not in sessions and self.is_gone([s])]:
                _forget_session(mgr, session)
        # a status message sent after the loss re-opens a socket to a lost decode: close it
        for endpoint in list(mgr._socket_cache):
            if self.endpoint_gone(endpoint):
                _drop_socket(mgr, endpoint)
        with self.lock:
            for session in [s for s in self.known if s not in sessions]:  # dropped by someone else
                for table in (self.known, self.misses, self.held, self.unanswered_at, self.silent_since):
                    table.pop(session, None)
        self._drop_stale_claims(mgr.request_status)
        verdicts = probe_all(sessions)
        # still blacklisted a tick later, or silent: lost, but it may be alive (held out)
        held_out = set()
        for session, (host, port) in sessions.items():
            self.registered(session, host, port)
            if session in self.held:
                self._watch_held(session, verdicts[session])
                continue
            if session in blacklisted:
                if session in self.held_out:
                    self.lose_decode(session, "a KV write failed and its transfer session does not answer a probe",
                                     keep=True)
                    continue
                held_out.add(session)
            verdict = verdicts[session]
            if verdict == ALIVE:
                self.misses[session] = 0
            elif verdict == REFUSED:
                self.lose_decode(session, "connection refused")
            else:
                self.misses[session] = self.misses.get(session, 0) + 1
                if self.misses[session] >= self.max_failures:
                    self.lose_decode(session, f"no answer to {self.misses[session]} heartbeats", keep=True)
        self.held_out = held_out
        self._age_out()

    def _age_out(self) -> None:
        """Monitor thread: a peer lost more than `departed_after` ago and neither back nor held out has left for
        good (a scaled-in, moved or replaced decode; on decode: a prefill): it is forgotten (`lost`, `gone`), so
        the lost-decode handshake rule stops counting it and no table grows per departed peer."""
        now = time.monotonic()
        departed = []
        with self.lock:
            kept = set(self.held.values())
            for host, peers in list(self.lost.items()):
                for peer in list(peers):
                    if now - self.lost_at.setdefault(peer, now) > self.departed_after and peer not in kept:
                        self._unlost(host, peer)
                        departed.append(peer)
            listed = {peer for peers in self.lost.values() for peer in peers}
            for peer in [p for p in self.lost_at if p not in listed]:  # back, replaced or departed
                del self.lost_at[peer]
            for name in [n for n, at in self.gone.items() if now - at > self.departed_after]:
                del self.gone[name]
        for peer in departed:
            logger.warning("PD peer departed: %s peer %s, lost more than %gs ago, is not back; forgotten (%s)",
                           "decode" if self.role == "prefill" else "prefill", peer, self.departed_after,
                           knobs.DEPARTED_DECODE_AFTER.name)

    # -- prefill: decodes' claims (a decode holds a request whose handshake waits for its preallocation)

    def claim(self, room: int, peer: str) -> None:
        """Bootstrap thread: decode `peer` (host:port) took request `room` into its prealloc queue."""
        with self.lock:
            self.claims[room] = (peer, time.monotonic())

    def unclaim(self, room: int) -> None:
        """Prefill cleared `room` (any thread)."""
        with self.lock:
            self.claims.pop(room, None)

    def claimed_by(self, room: int) -> Optional[str]:
        with self.lock:
            claim = self.claims.get(room)
        return None if claim is None else claim[0]

    def _drop_stale_claims(self, rooms: Any) -> None:
        """Monitor thread: a claim whose room prefill does not have (`rooms`: its request_status) after
        CLAIM_GRACE is dropped (its request never came, or was cleared before the claim)."""
        now = time.monotonic()
        with self.lock:
            for room in [r for r, (_, at) in self.claims.items() if now - at > CLAIM_GRACE and r not in rooms]:
                del self.claims[room]

    def registered(self, session: str, host: str, port: int) -> None:
        """Bootstrap or monitor thread: watch a decode session (after a loss there: its new incarnation)."""
        with self.lock:
            if session in self.known:
                return
            self.known[session] = (host, port)
            self.gone.pop(f"{host}:{port}", None)  # a new incarnation listens there now
            old = self._unlost(host)
            # a decode held out as lost whose address a new process took is gone
            stale = [s for s, peer in self.held.items() if peer == f"{host}:{port}"]
        for s in stale:
            self._drop_held(s, "a new decode registered at its address", addr_gone=False)
        if old is not None:
            logger.warning("PD peer recovered: decode peer %s:%s registered (session %s), replacing lost %s",
                           host, port, session, old)
            _count(self, "recovery", old)

    def _unlost(self, host: str, peer: Optional[str] = None) -> Optional[str]:
        """Under `lock`: take `peer` (default: the oldest) off `host`'s lost list."""
        waiting = self.lost.get(host, [])
        peer = peer if peer is not None else next(iter(waiting), None)
        if peer not in waiting:
            return None
        waiting.remove(peer)
        if not waiting:
            del self.lost[host]
        return peer

    def lose_decode(self, session: str, why: str, keep: bool = False) -> None:
        """Monitor thread: end every room bound to decode `session` (502); `keep` (it may be alive): held out."""
        mgr = self.mgr
        with self.lock:
            host, port = self.known.get(session, (None, None))
            if host is None or session in self.held:
                return
            if keep:
                self.held[session] = f"{host}:{port}"
                self.unanswered_at[session] = self.silent_since[session] = time.monotonic()
        self.misses.pop(session, None)
        peer = f"{host}:{port}"
        reason = loss_message("decode", peer, f"{why}; mooncake session {session}")
        if keep:
            with mgr.session_lock:  # it was probed already: straight in
                set.add(mgr.failed_sessions, session)
        else:  # no new chunk is sent to it from here on
            self._drop_incarnation(session, host, port)
        failed = [room for room, infos in list(mgr.transfer_infos.items())
                  if session in infos and mgr.request_status.get(room) not in (None, KVPoll.Success)]
        for room in failed:  # other decode ranks of the room wait for it too
            targets = None if keep else [t for t in mgr._room_notify_targets(room) if t != (host, port)]
            # remembered: a held-out decode's queued handshake for it, delivered once the link is back, is
            # answered Failed instead of opening the room again (nothing would close it)
            if keep:
                room_ledger.end_room(mgr, room_ledger.Transition.FAIL_TELL_REMEMBER, room, reason,
                                     cause=request_end_cause.PEER_FAILURE, peer=peer, told=LOST)
            else:
                room_ledger.end_room(mgr, room_ledger.Transition.FAIL_AND_TELL, room, reason,
                                     cause=request_end_cause.PEER_FAILURE, peer=peer, targets=targets, told=LOST)
        with self.lock:
            self.lost.setdefault(host, []).append(peer)
            self.lost_at[peer] = time.monotonic()
        if not keep:
            self.mark_gone([session, peer])
        logger.error("%s: %d requests failed, %s", reason, len(failed),
                     "its session held out until it answers a probe" if keep else "its session state dropped")
        _count(self, "loss", peer)

    def _drop_incarnation(self, session: str, host: str, port: int) -> None:
        """Forget a gone decode session: registration, blacklist, socket, poison marks."""
        mgr = self.mgr
        with self.lock:
            self.known.pop(session, None)
        with mgr.session_lock:
            mgr.decode_kv_args_table.pop(session, None)
            _forget_session(mgr, session)
        _drop_socket(mgr, f"tcp://{host}:{port}")
        with self.lock:
            poisoned = self.poisoned.pop(session, set())
        mgr._deferred_ack_poisoned_rooms.difference_update(poisoned)

    # -- prefill: decodes held out as lost

    def _watch_held(self, session: str, verdict: str) -> None:
        """Monitor thread: a held-out decode is gone once refused, or once its endpoint has taken no connection
        for `departed_after` (its host left); still silent, it is left alone (a transfer engine probe through a
        cut link would only hang for its timeout, and one running when the link heals would hold the re-admission
        back by as much); answering (`verdict`: this tick's connect), it is probed in the background."""
        if verdict == REFUSED:
            self._drop_held(session, "refuses connections")
            return
        now = time.monotonic()
        with self.lock:
            if verdict == SILENT:
                self.unanswered_at[session] = now
                silent = now - self.silent_since.setdefault(session, now)
            else:
                self.silent_since.pop(session, None)
        if verdict == SILENT:
            if silent > self.departed_after:
                self._drop_held(session, f"has taken no connection for {silent:.0f}s "
                                         f"({knobs.DEPARTED_DECODE_AFTER.name}={self.departed_after:g})",
                                since=now - silent)
            return
        with self.lock:
            if session in self._probing:
                return
            self._probing.add(session)
            since = self.unanswered_at.get(session, float("-inf"))
        threading.Thread(target=self._probe_held, args=(session, since), name="ForkPeerProbe", daemon=True).start()

    def _probe_held(self, session: str, since: float) -> None:
        mgr = self.mgr
        # chunk_failures.bounded_probe: answers -1, never raises; a probe started before `since` is not joined
        rc = mgr._send_probe(session, since=since)
        with self.lock:
            self._probing.discard(session)
        if rc == 0:
            # a push sent while it was silent left its connection retransmitting with a backed-off timer: a status
            # message sent on it after the heal waits behind that (seen: 10 s). Closed before the session is let
            # back in, so the first transfer's status after the heal goes on a new socket, which connects at once
            with self.lock:
                peer = self.held.get(session)
            if peer is not None:
                _drop_socket(mgr, f"tcp://{peer}")
        with mgr.session_lock:
            with self.lock:
                held = session in self.held
            if not held or session not in mgr.decode_kv_args_table:
                return  # dropped meanwhile
            if rc != 0:  # still out (upstream's probe loop may have let it back in)
                set.add(mgr.failed_sessions, session)
                return
            mgr._unblacklist_session(session)
        with self.lock:  # it answers again: served again
            peer = self.held.pop(session, None)
            self.unanswered_at.pop(session, None)
            self.silent_since.pop(session, None)
            if peer is None:
                return
        with self.lock:
            host = peer.rpartition(":")[0]
            counted = self._unlost(host, peer) is not None  # else a new decode there counted it
        logger.warning("PD peer recovered: decode peer %s answers again (session %s); served again", peer, session)
        if counted:
            _count(self, "recovery", peer)

    def _drop_held(self, session: str, why: str, addr_gone: bool = True, since: Optional[float] = None) -> None:
        """A decode held out as lost is gone (its loss was counted already), since `since` (default: now)."""
        with self.lock:
            peer = self.held.pop(session, None)
            self.unanswered_at.pop(session, None)
            self.silent_since.pop(session, None)
            host, port = self.known.get(session, (None, None))
        if peer is None or host is None:
            return
        self._drop_incarnation(session, host, port)
        self.mark_gone([session, peer] if addr_gone else [session], since)
        logger.warning("PD peer gone: decode peer %s, lost earlier (session %s), %s; its session state dropped",
                       peer, session, why)

    # -- decode: prefill bootstrap servers

    def _tick_decode(self) -> None:
        """A prefill bootstrap server that refuses, or has not answered `max_failures` connects in a row (a
        silent host: upstream's HTTP heartbeat waits its 2+3 s timeouts per miss), is lost."""
        mgr = self.mgr
        with mgr.connection_lock:
            addrs = list(mgr.prefill_info_table)
        for addr in [a for a in self.misses if a not in addrs]:  # dropped (by upstream's heartbeat, or a loss)
            self.misses.pop(addr, None)
        verdicts = probe_all({addr: (addr.rpartition(":")[0].strip("[]"), int(addr.rpartition(":")[2]))
                              for addr in addrs})
        for addr in addrs:
            verdict = verdicts[addr]
            if verdict == ALIVE:
                self.misses[addr] = 0
                continue
            self.misses[addr] = self.misses.get(addr, 0) + 1
            if verdict == REFUSED or self.misses[addr] >= self.max_failures:
                self.misses.pop(addr, None)
                mgr._handle_node_failure(addr)
                with mgr.session_pool_lock:
                    mgr.session_pool.pop(addr, None)
        self._age_out()


def _forget_session(mgr: Any, session: str) -> None:
    """Drop a decode session's blacklist and layout entries (caller holds session_lock)."""
    mgr._unblacklist_session(session)
    mgr.state_layout_rejections.pop(session, None)
    mgr.state_strides_validated.discard(session)


def _drop_socket(mgr: Any, endpoint: str) -> None:
    """Close the cached push socket to a lost endpoint, not while a sender uses it."""
    with mgr._socket_lock:
        sock = mgr._socket_cache.pop(endpoint, None)
        monitor = mgr._monitor_cache.pop(endpoint, None)
    with mgr._socket_send_locks.get(endpoint) or contextlib.nullcontext():
        if sock is not None:
            sock.close(linger=0)
    if monitor is not None:
        monitor.close()


def _reconnect_receivers(bootstrap_addr: str) -> None:
    """Close decode's cached push sockets to the host of a prefill that answers again. One used while the
    prefill was silent (a handshake or an abort sent during a partition) is stuck: its connection retransmits on
    a backed-off timer (or its connect waits for a SYN retry), and a handshake sent on it after the heal would
    wait as long (seen: 15 s, the whole transfer deadline). A new socket connects at once."""
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    host = bootstrap_addr.rpartition(":")[0]
    with CommonKVReceiver._global_lock:
        stale = [ep for ep in CommonKVReceiver._socket_cache if ep.rpartition(":")[0] == f"tcp://{host}"]
    for endpoint in stale:
        CommonKVReceiver.disconnect_endpoint(endpoint)


def monitor_of(mgr: Any) -> Optional[PeerMonitor]:
    return getattr(mgr, "__dict__", {}).get(_MONITOR)


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
        with monitor.lock:
            if monitor.role == "prefill":
                out.update(monitor_watched=len(monitor.known), monitor_held_out=len(monitor.held),
                           monitor_gone=len(monitor.gone), monitor_claims=len(monitor.claims))
            out["monitor_lost_unrecovered"] = sum(map(len, monitor.lost.values()))
            # the bound within which a lost peer that does not come back leaves every table above
            out["monitor_departed_after_s"] = monitor.departed_after
    return out


def monitor_tables(mgr: Any) -> Dict[str, Dict[str, Any]]:
    """The resource report's view of the manager's PeerMonitor tables (`fork_tables`; read-only): per peer, each
    bounded by the peers upstream knows (its sessions, its prefill table) or by MAX_GONE; `poisoned` by the rooms
    upstream keeps poison-marked."""
    monitor = monitor_of(mgr)
    if monitor is None:
        return {}
    peers = "upstream's peer tables (decode sessions / prefill addresses)"
    with monitor.lock:
        tables = {
            "misses": (len(monitor.misses), peers, "peers with heartbeats unanswered in a row"),
            "known": (len(monitor.known), peers, "prefill: decode sessions watched, with their host:port"),
            "lost": (sum(map(len, monitor.lost.values())), peers, "peers lost and not recovered"),
            "gone": (len(monitor.gone), MAX_GONE, "prefill: lost sessions and host:port, remembered"),
            "poisoned": (sum(map(len, monitor.poisoned.values())), "upstream's poison-marked rooms",
                         "prefill: rooms a failed write poison-marked, by session (dropped with the marks)"),
            "held_out": (len(monitor.held_out), peers, "prefill: sessions blacklisted at the last tick"),
            "held": (len(monitor.held), peers, "prefill: sessions lost while they may be alive"),
            "probing": (len(monitor._probing), peers, "prefill: held sessions with a probe running"),
            "unanswered_at": (len(monitor.unanswered_at), peers, "peers with a heartbeat unanswered since"),
        }
    return {f"monitor_{name}": {"size": size, "cap": cap, "why": why, "per_peer": True}
            for name, (size, cap, why) in tables.items()}


def _start(queue: Any, mgr: Any, role: str) -> None:
    # prefill: mooncake's (its sessions and session_lock); decode: any of upstream's (its prefill_info_table)
    owner = fork_touch.MOONCAKE_MANAGER if role == "prefill" else fork_touch.COMMON_MANAGER
    if mgr is None or not fork_touch.is_a(mgr, owner) or monitor_of(mgr) is not None:
        return  # fake transfer backend, or (prefill) not mooncake
    labels = request_end_cause.scheduler_labels(fork_touch.upstream(queue, "scheduler"))
    monitor = PeerMonitor(mgr, role, labels or {}, labels is not None)
    mgr.__dict__[_MONITOR] = monitor
    room_ledger.ledger_for(mgr).watch_peers(monitor.is_lost)
    if role == "prefill":  # a registration is seen at once (a restarted decode, before its first request)
        fork_touch.swap(mgr, "_publish_peer_registration",
                        lambda publish: functools.partial(_publish_and_watch, monitor, publish), by=__name__)
        # decode's claims arrive on the bootstrap thread, beside its ABORTs (the room ledger's handler, inside)
        fork_touch.swap(mgr, "_handle_abort_notification",
                        lambda handle: functools.partial(_handle_claim, monitor, handle), by=__name__)
    monitor.thread.start()


def _publish_and_watch(monitor: PeerMonitor, publish: Any, session_id: str, decode_kv_args: Any, *args, **kwargs):
    result = publish(session_id, decode_kv_args, *args, **kwargs)
    monitor.registered(session_id, decode_kv_args.endpoint, int(decode_kv_args.dst_port))
    return result


def claim_frames(room: int, ip: str, port: int) -> List[bytes]:
    """Decode's claim of `room` on the wire (CLAIM_TAG)."""
    from sglang.srt.disaggregation.common.conn import ABORT_TAG

    return [ABORT_TAG, CLAIM_TAG, str(room).encode("ascii"), ip.encode("ascii"), str(port).encode("ascii")]


def _handle_claim(monitor: PeerMonitor, handle: Any, msg: List[bytes]) -> bool:
    """Prefill's bootstrap thread: a decode's claim (`claim_frames`) is recorded; anything else goes on to `handle`."""
    if len(msg) < 2 or msg[1] != CLAIM_TAG:
        return handle(msg)
    try:
        room, peer = int(msg[2]), f"{msg[3].decode('ascii')}:{int(msg[4])}"
    except (IndexError, ValueError, UnicodeDecodeError):
        logger.warning("Dropping a malformed decode claim: %r", msg[:5])
        return True
    monitor.claim(room, peer)
    return True


def after_receiver_init(result: Any, receiver: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER CommonKVReceiver.init (decode's scheduler, as the request enters the prealloc queue): claim the room
    with each prefill rank it will shake hands with, so that prefill knows a live decode holds it while it waits
    for a preallocation (the lost-decode handshake rule). Best effort: a claim that cannot be sent leaves the
    request unclaimed (ended by that rule only while a decode is lost and it waited 5 s)."""
    import zmq

    mgr = receiver.kv_mgr
    if (fork_touch.upstream(receiver, "conclude_state") == KVPoll.Failed or monitor_of(mgr) is None
            or not fork_touch.is_a(mgr, fork_touch.MOONCAKE_MANAGER)):
        return  # failed at init, fake transfer, or a backend whose prefill has no claim handler
    room = receiver.bootstrap_room
    message = claim_frames(room, mgr.local_ip, mgr.rank_port)
    for info in fork_touch.upstream(receiver, "bootstrap_infos") or ():
        try:
            sock, lock = receiver._connect_to_bootstrap_server(info)
            with lock:
                sock.send_multipart(message)
        except zmq.ZMQError as exc:
            logger.warning("Could not claim room %s with prefill %s:%s: %s", room, info.get("rank_ip"),
                           info.get("rank_port"), exc)


def on_sender_clear(result: Any, sender: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER CommonKVSender.clear (prefill): the room's claim goes with it."""
    monitor = monitor_of(sender.kv_mgr)
    if monitor is not None:
        monitor.unclaim(sender.bootstrap_room)


def on_prefill_manager_init(mgr: Any, queue: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER PrefillBootstrapQueue._init_kv_manager (result: the manager)."""
    _start(queue, mgr, "prefill")


def on_decode_manager_init(mgr: Any, queue: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER DecodePreallocQueue._init_kv_manager (result: the manager)."""
    _start(queue, mgr, "decode")


def around_handle_node_failure(original, mgr, peer, *args, **kwargs):
    """AROUND CommonKVManager._handle_node_failure(bootstrap addr) (decode): end the rooms, settle the drains."""
    monitor = monitor_of(mgr)
    reason = loss_message("prefill", peer, "its bootstrap server does not answer")
    known = peer in mgr.prefill_info_table
    if monitor is not None:
        with monitor.lock:  # the first of two concurrent callers claims the loss
            known = known and peer not in monitor.lost
            if known:
                monitor.lost[peer] = [peer]
                monitor.lost_at[peer] = time.monotonic()
    failed = [room for room in list(mgr.addr_to_rooms_tracker.get(peer, ()))
              if mgr.request_status.get(room) not in (None, KVPoll.Success)]
    for room in failed:
        room_ledger.end_room(mgr, room_ledger.Transition.FAIL_UNTOLD, room, reason,
                             cause=request_end_cause.PEER_FAILURE, peer=peer)
    result = original(mgr, peer, *args, **kwargs)
    # drains this prefill owes: nobody will ack (a room parked after `lost` is acked at once)
    ledger = room_ledger.ledger_of(mgr)
    if ledger is not None and monitor is not None:
        ledger.settle_peer(peer)
    if known and monitor is not None:
        logger.error("%s: %d requests failed, its connection info dropped", reason, len(failed))
        _count(monitor, "loss", peer)
    return result


def after_try_ensure_parallel_info(result, mgr, bootstrap_addr, *args, **kwargs) -> None:
    """AFTER CommonKVManager.try_ensure_parallel_info: a lost prefill fetched again is back."""
    monitor = monitor_of(mgr)
    if result and monitor is not None and bootstrap_addr in monitor.lost:
        with monitor.lock:
            back = monitor.lost.pop(bootstrap_addr, None) is not None
        if back:
            _reconnect_receivers(bootstrap_addr)
            logger.warning("PD peer recovered: prefill peer %s answers again; its new info fetched", bootstrap_addr)
            _count(monitor, "recovery", bootstrap_addr)


def around_conclude_transfer(original, mgr, *args, bootstrap_room=None, status=None, failure_reason=None, **kwargs):
    """AROUND CommonKVManager.conclude_transfer (prefill): poison marks, a dead peer named."""
    if status == KVPoll.Failed:
        infos = mgr.transfer_infos.get(bootstrap_room) or {}
        monitor = monitor_of(mgr)
        if monitor is not None and verdict.is_failed_write(failure_reason):
            # nothing listens at the peer of a failed write: gone before the status is pushed (it would block)
            for session, info in list(infos.items()):
                peer = f"{info.endpoint}:{info.dst_port}"
                if not monitor.is_gone([peer]) and probe(info.endpoint, int(info.dst_port), 0.5) == REFUSED:
                    monitor.mark_gone([session, peer])
        if monitor is not None and bootstrap_room in mgr._deferred_ack_poisoned_rooms:
            peers = [f"{i.endpoint}:{i.dst_port}" for i in list(infos.values())]
            peers += [f"{host}:{port}" for host, port in (kwargs.get("targets") or ())]
            if monitor.is_gone(list(infos) + peers, failure_reason):  # nobody to ack or protect
                mgr._deferred_ack_poisoned_rooms.discard(bootstrap_room)
            else:
                # a room cleared meanwhile (another rank failed it first) has no infos left: the sessions of the
                # decode its failed write names, so the mark still goes when that decode is lost
                sessions = list(infos) or monitor.sessions_named(failure_reason)
                with monitor.lock:
                    for session in sessions:
                        monitor.poisoned.setdefault(session, set()).add(bootstrap_room)
        if verdict.is_dead_session(failure_reason):  # upstream's reason for a blacklisted session: reworded
            failed = fork_touch.upstream_on(mgr, "failed_sessions", fork_touch.MOONCAKE_MANAGER, default=())
            dead = [(s, i) for s, i in list(infos.items()) if s in failed]
            if dead:
                session, info = dead[0]
                peer = f"{info.endpoint}:{info.dst_port}"
                request_end_cause.tag(mgr, bootstrap_room, request_end_cause.PEER_FAILURE, peer)
                failure_reason = loss_message("decode", peer, f"a KV write failed and its transfer session {session} "
                                              "does not answer a probe")
                # recorded here with its cause (LOST), for upstream's conclusion to mark and send and room_agreement
                # to share; upstream keeps a room's first record, so only when it has none (an existing one is sent
                # with the cause it came with)
                ledger = room_ledger.ledger_for(mgr)
                if not ledger.has_record(bootstrap_room):
                    ledger.make(room_ledger.Transition.RECORD_FOR_UPSTREAM, bootstrap_room, failure_reason, told=LOST)
                with room_ledger.concluding(bootstrap_room, kwargs.get("targets")):  # told only if a status is sent
                    return original(mgr, *args, bootstrap_room=bootstrap_room, status=status,
                                    failure_reason=failure_reason, **kwargs)
    return original(mgr, *args, bootstrap_room=bootstrap_room, status=status, failure_reason=failure_reason, **kwargs)


def around_send_multipart_locked(original, mgr, endpoint, parts, *args, **kwargs):
    """AROUND CommonKVManager._send_multipart_locked: a push to a lost decode is dropped."""
    monitor = monitor_of(mgr)
    if monitor is not None and monitor.role == "prefill" and monitor.endpoint_gone(endpoint):
        logger.debug("Not sending to %s: that decode peer was lost", endpoint)
        return None
    return original(mgr, endpoint, parts, *args, **kwargs)


HANDSHAKE_ENV = knobs.LOST_DECODE_HANDSHAKE_TIMEOUT.name  # a gateway's lost decode (docs/gateway.md)
# Per request (verdict.ReqState): `handshake_wait_since` (engine-clock time first seen waiting for its handshake),
# `lost_decode` (the message that ended it).
SCAN_INTERVAL = 0.5
_next_scan = [float("-inf")]


def lost_decodes(monitor: Any) -> List[str]:
    """host:port of every decode declared lost and not replaced on its host."""
    if monitor is None:
        return []
    with monitor.lock:
        return [peer for peers in monitor.lost.values() for peer in peers]


def orphans(reqs: Sequence[Any], waits, now: float, timeout: float) -> List[Tuple[Any, float]]:
    """(req, seconds waited) of each request `waits(room)` does not excuse (handshaken, or held by a live decode)
    after `timeout`; one seen unexcused for the first time is stamped `now`."""
    out = []
    for req in reqs:
        state = verdict.of(req)
        if state.lost_decode is not None or waits(req.bootstrap_room):
            continue
        since = state.handshake_wait_since
        if since is None:
            state.handshake_wait_since = now
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
    monitor = monitor_of(kv_mgr)
    lost = lost_decodes(monitor)
    if not lost or timeout == 0:
        for req in queue.queue:  # nothing is lost: forget the stamps
            verdict.of(req).handshake_wait_since = None
        return
    waits = functools.partial(waits_for_live_decode, handshaken=kv_mgr.transfer_infos.__contains__,
                              claimed_by=monitor.claimed_by, lost=lost)
    for req, waited in orphans(queue.queue, waits, now, timeout):
        holder = monitor.claimed_by(req.bootstrap_room)
        text = orphan_message(req, waited, lost, timeout, holder)
        verdict.of(req).lost_decode = text
        logger.warning(text)
        # remembered: the handshake a silent decode queued for it may still arrive once the link is back
        room_ledger.end_room(kv_mgr, room_ledger.Transition.FAIL_TELL_REMEMBER, req.bootstrap_room, text,
                             cause=request_end_cause.PEER_FAILURE, peer=holder or lost[0], told=LOST)
