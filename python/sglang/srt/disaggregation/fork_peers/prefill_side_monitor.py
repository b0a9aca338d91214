"""Prefill's monitor of its decode peers: a crashed or cut decode is noticed, its rooms end (502), a restart is served.

Threads: its `ForkPeerMonitor-prefill` (`tick`: probes each registered decode session, loses it, ages out the
departed), the `ForkPeerProbe` threads it starts (`held_decodes`), the bootstrap thread (registrations, decode's
claims), the transfer workers (`around_conclude_transfer`: poison marks, a dead peer named; pushes to a lost decode
dropped) and the scheduler (`claimed_by`, `lost`: the lost-handshake rule; a sender's clear drops its claim). Lock:
`PeerMonitor.lock` over every table below; upstream's `session_lock` is never taken while holding it. Invariant:
a decode session is in `known` from its registration until its incarnation is dropped; a lost decode's host:port is
in `lost` until a new decode registers on its host, it answers again, or it departs (`departed_after`); `gone` and
`claims` are bounded (MAX_GONE and `departed_after`; the room's clear and CLAIM_GRACE).

`poisoned` (session -> the rooms a failed write to it poison-marked) is the monitor's, not the room ledger's: it is
a per-peer index of upstream's per-room marks (`_deferred_ack_poisoned_rooms`), so a decode session's marks go with
the session when the monitor forgets it (`drop_incarnation`, under `PeerMonitor.lock` as its other tables) and a mark
whose decode is gone goes at once (`around_conclude_transfer`). It holds no time (no clock): each tick prunes it to
the marks upstream still holds, so a mark dropped another way (`poison_expiry`'s deadline on the engine clock, which
in turn forgets a mark the monitor dropped) leaves nothing here; shown in the resource report as `monitor_poisoned`,
bounded by upstream's marks.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Set, Tuple

from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.fork_ending import request_end_cause, room_ledger, verdict_wording
from sglang.srt.disaggregation.fork_peers import held_decodes, peer_sockets
from sglang.srt.disaggregation.fork_peers.peer_monitor import (
    ALIVE, CLAIM_TAG, LOST, REFUSED, PeerMonitor, attach, loss_message, monitor_of, probe, probe_all)
from sglang.srt.managers.fork_core import fork_touch
from sglang.srt.managers.fork_core.bounded import Cap, entry

logger = logging.getLogger(__name__)

MAX_GONE = Cap(256, "lost decode sessions and host:port remembered for `departed_after`: far more decodes than a "
                    "deployment loses in that time (oldest dropped first)")
# a claim whose prefill request has not arrived (or was cleared before it came) is dropped after this (s)
CLAIM_GRACE = 30.0


class PrefillSideMonitor(held_decodes.HeldDecodes, PeerMonitor):
    """The decode sessions prefill pushes KV to (upstream's `decode_kv_args_table`), watched from one thread."""

    role, watches = "prefill", "decode"

    def __init__(self, mgr: Any, labels: Dict[str, str], metrics: bool):
        super().__init__(mgr, labels, metrics)
        self.misses: Dict[str, int] = {}  # session -> heartbeats unanswered in a row
        self.known: Dict[str, Tuple[str, int]] = {}  # session -> its decode's (host, port)
        self.lost: Dict[str, List[str]] = {}  # host -> decode peers (host:port) lost there and not back, oldest first
        self.lost_at: Dict[str, float] = {}  # lost decode peer (host:port) -> when it was lost
        # lost sessions and host:port -> when (nothing is pushed to them; MAX_GONE entries, `departed_after` seconds)
        self.gone: "OrderedDict[str, float]" = OrderedDict()
        # room -> (decode host:port that claimed it, when): decode holds the request, its handshake follows once it
        # has preallocated (CLAIM_TAG); dropped when prefill clears the room, or after CLAIM_GRACE without it
        self.claims: Dict[int, Tuple[str, float]] = {}
        self.poisoned: Dict[str, Set[int]] = {}  # session -> rooms a failed write poison-marked
        self.held_out: Set[str] = set()  # sessions blacklisted at the last tick (lost if still so at the next)
        self.init_held()

    # -- decode sessions

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

    def tick(self) -> None:
        mgr, marks = self.mgr, self.mgr._deferred_ack_poisoned_rooms
        with self.lock:  # forget the rooms whose poison mark expired
            self.poisoned = {s: live for s, rooms in self.poisoned.items() if (live := rooms & marks)}
        with mgr.session_lock:
            sessions = {s: (info.endpoint, int(info.dst_port)) for s, info in mgr.decode_kv_args_table.items()}
            blacklisted = {s for s in sessions if s in mgr.failed_sessions}
            # a write still running at the loss blacklists the dead session again later
            for session in [s for s in mgr.failed_sessions if s not in sessions and self.is_gone([s])]:
                peer_sockets.forget_session(mgr, session)
        # a status message sent after the loss re-opens a socket to a lost decode: close it
        for endpoint in list(mgr._socket_cache):
            if self.endpoint_gone(endpoint):
                peer_sockets.drop_socket(mgr, endpoint)
        with self.lock:
            for session in [s for s in self.known if s not in sessions]:  # dropped by someone else
                for table in (self.known, self.misses):
                    table.pop(session, None)
                self.unhold(session)
        self._drop_stale_claims(mgr.request_status)
        verdicts = probe_all(sessions)
        # still blacklisted a tick later, or silent: lost, but it may be alive (held out)
        held_out = set()
        for session, (host, port) in sessions.items():
            self.registered(session, host, port)
            if session in self.held:
                self.watch_held(session, verdicts[session])
                continue
            if session in blacklisted:
                if session in self.held_out:
                    self.lose_decode(session, "a KV write failed and its transfer session does not answer a probe",
                                     keep=True)
                    continue
                held_out.add(session)
            answer = verdicts[session]
            if answer == ALIVE:
                self.misses[session] = 0
            elif answer == REFUSED:
                self.lose_decode(session, "connection refused")
            else:
                self.misses[session] = self.misses.get(session, 0) + 1
                if self.misses[session] >= self.max_failures:
                    self.lose_decode(session, f"no answer to {self.misses[session]} heartbeats", keep=True)
        self.held_out = held_out
        self._age_out()

    def _age_out(self) -> None:
        """Monitor thread: a decode lost more than `departed_after` ago and neither back nor held out has left for
        good (scaled in, moved, replaced): it is forgotten (`lost`, `gone`), so the lost-decode handshake rule stops
        counting it and no table grows per departed peer."""
        now = time.monotonic()
        departed = []
        with self.lock:
            kept = set(self.held.values())
            for host, peers in list(self.lost.items()):
                for peer in list(peers):
                    if now - self.lost_at.setdefault(peer, now) > self.departed_after and peer not in kept:
                        self.unlost(host, peer)
                        departed.append(peer)
            listed = {peer for peers in self.lost.values() for peer in peers}
            for peer in [p for p in self.lost_at if p not in listed]:  # back, replaced or departed
                del self.lost_at[peer]
            for name in [n for n, at in self.gone.items() if now - at > self.departed_after]:
                del self.gone[name]
        for peer in departed:
            self.log_departed(peer)

    def registered(self, session: str, host: str, port: int) -> None:
        """Bootstrap or monitor thread: watch a decode session (after a loss there: its new incarnation)."""
        with self.lock:
            if session in self.known:
                return
            self.known[session] = (host, port)
            self.gone.pop(f"{host}:{port}", None)  # a new incarnation listens there now
            old = self.unlost(host)
            # a decode held out as lost whose address a new process took is gone
            stale = [s for s, peer in self.held.items() if peer == f"{host}:{port}"]
        for s in stale:
            self.drop_held(s, "a new decode registered at its address", addr_gone=False)
        if old is not None:
            logger.warning("PD peer recovered: decode peer %s:%s registered (session %s), replacing lost %s",
                           host, port, session, old)
            self.count("recovery", old)

    def unlost(self, host: str, peer: Optional[str] = None) -> Optional[str]:
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
                self.hold(session, f"{host}:{port}")
        self.misses.pop(session, None)
        peer = f"{host}:{port}"
        reason = loss_message("decode", peer, f"{why}; mooncake session {session}")
        if keep:
            with mgr.session_lock:  # it was probed already: straight in
                set.add(mgr.failed_sessions, session)
        else:  # no new chunk is sent to it from here on
            self.drop_incarnation(session, host, port)
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
        self.count("loss", peer)

    def drop_incarnation(self, session: str, host: str, port: int) -> None:
        """Forget a gone decode session: registration, blacklist, socket, poison marks."""
        mgr = self.mgr
        with self.lock:
            self.known.pop(session, None)
        with mgr.session_lock:
            mgr.decode_kv_args_table.pop(session, None)
            peer_sockets.forget_session(mgr, session)
        peer_sockets.drop_socket(mgr, f"tcp://{host}:{port}")
        with self.lock:
            poisoned = self.poisoned.pop(session, set())
        mgr._deferred_ack_poisoned_rooms.difference_update(poisoned)

    # -- decodes' claims (a decode holds a request whose handshake waits for its preallocation)

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

    # -- the report's view

    def gauges(self) -> Dict[str, int]:
        with self.lock:
            return {"lost": sum(map(len, self.lost.values())), "held_out": len(self.held)}

    def counts(self) -> Dict[str, int]:
        with self.lock:
            return {"monitor_watched": len(self.known), "monitor_held_out": len(self.held),
                    "monitor_gone": len(self.gone), "monitor_claims": len(self.claims),
                    "monitor_lost_unrecovered": sum(map(len, self.lost.values()))}

    def tables(self) -> Dict[str, Dict[str, Any]]:
        """Per decode peer, bounded by upstream's decode sessions, or by MAX_GONE; `poisoned` by the rooms upstream
        keeps poison-marked; `claims` by the rooms prefill holds (CLAIM_GRACE for the others)."""
        peers = "upstream's decode sessions"
        with self.lock:
            tables = {
                "misses": (len(self.misses), peers, "decode sessions with heartbeats unanswered in a row"),
                "known": (len(self.known), peers, "decode sessions watched, with their host:port"),
                "lost": (sum(map(len, self.lost.values())), peers, "decode peers lost and not recovered"),
                "lost_at": (len(self.lost_at), peers, "when each lost decode peer was lost (aged out with it)"),
                "gone": (len(self.gone), MAX_GONE, "lost sessions and host:port, remembered"),
                "poisoned": (sum(map(len, self.poisoned.values())), "upstream's poison-marked rooms",
                             "rooms a failed write poison-marked, by session (dropped with the marks)"),
                "held_out": (len(self.held_out), peers, "sessions blacklisted at the last tick"),
                **self.held_tables(peers),
            }
            claims = len(self.claims)
        out = {name: entry(size, cap, why) for name, (size, cap, why) in tables.items()}
        out["claims"] = entry(claims, f"the rooms prefill holds; {CLAIM_GRACE:g} s for one it never had",
                              "rooms a decode claimed (it holds the request), until prefill clears them", memory=True)
        return out


# -- hooks


def on_prefill_manager_init(mgr: Any, queue: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER PrefillBootstrapQueue._init_kv_manager (result: the manager): a monitor on mooncake's manager (its
    sessions and session_lock), started once its swaps are in place."""
    monitor = attach(queue, mgr, PrefillSideMonitor, fork_touch.MOONCAKE_MANAGER)
    if monitor is None:
        return  # fake transfer backend, or not mooncake
    # a registration is seen at once (a restarted decode, before its first request)
    fork_touch.swap(mgr, "_publish_peer_registration",
                    lambda publish: functools.partial(_publish_and_watch, monitor, publish), by=__name__)
    # decode's claims arrive on the bootstrap thread, beside its ABORTs (the room ledger's handler, inside)
    fork_touch.swap(mgr, "_handle_abort_notification",
                    lambda handle: functools.partial(_handle_claim, monitor, handle), by=__name__)
    monitor.thread.start()


def _publish_and_watch(monitor: PrefillSideMonitor, publish: Any, session_id: str, decode_kv_args: Any, *args,
                       **kwargs):
    result = publish(session_id, decode_kv_args, *args, **kwargs)
    monitor.registered(session_id, decode_kv_args.endpoint, int(decode_kv_args.dst_port))
    return result


def _handle_claim(monitor: PrefillSideMonitor, handle: Any, msg: List[bytes]) -> bool:
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


def on_sender_clear(result: Any, sender: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER CommonKVSender.clear (prefill): the room's claim goes with it."""
    monitor = monitor_of(sender.kv_mgr, PrefillSideMonitor)
    if monitor is not None:
        monitor.unclaim(sender.bootstrap_room)


def around_conclude_transfer(original, mgr, *args, bootstrap_room=None, status=None, failure_reason=None, **kwargs):
    """AROUND CommonKVManager.conclude_transfer (prefill's transfer workers): poison marks, a dead peer named."""
    if status == KVPoll.Failed:
        infos = mgr.transfer_infos.get(bootstrap_room) or {}
        monitor = monitor_of(mgr, PrefillSideMonitor)
        if monitor is not None and verdict_wording.is_failed_write(failure_reason):
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
        if verdict_wording.is_dead_session(failure_reason):  # upstream's reason for a blacklisted session: reworded
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
    monitor = monitor_of(mgr, PrefillSideMonitor)
    if monitor is not None and monitor.endpoint_gone(endpoint):
        logger.debug("Not sending to %s: that decode peer was lost", endpoint)
        return None
    return original(mgr, endpoint, parts, *args, **kwargs)
