"""Prefill's decodes held out as lost while they may be alive (frozen, cut off): let back in once they answer a
probe, dropped once they refuse or stay silent for `departed_after`.

Threads: the `ForkPeerMonitor-prefill` thread (`watch_held` each tick, `hold` at a loss) and the `ForkPeerProbe`
threads it starts (`_probe_held`, one per held session at a time). Lock: the prefill monitor's `PeerMonitor.lock`
over `held`, `probing`, `unanswered_at` and `silent_since` (a part of `PrefillSideMonitor`, whose other tables it
reads); upstream's `session_lock` is taken before it, never inside it. Invariant: a held session stays in
upstream's blacklist (`failed_sessions`) until a probe started after its last unanswered heartbeat answers; a held
session leaves `held` exactly once (back, refused, silent past `departed_after`, or its address taken by a new
decode), and its loss is counted once (its recovery once, if it comes back).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, Optional, Set, Tuple

from sglang.srt.disaggregation.fork_peers import peer_sockets
from sglang.srt.disaggregation.fork_peers.peer_monitor import REFUSED, SILENT
from sglang.srt.managers.fork_core import knobs

logger = logging.getLogger(__name__)


class HeldDecodes:
    """The held-out part of `prefill_side_monitor.PrefillSideMonitor` (its tables, its lock)."""

    def init_held(self) -> None:
        self.held: Dict[str, str] = {}  # session -> host:port lost while it may be alive
        self._probing: Set[str] = set()  # held sessions with a probe running
        # held session -> when it last did not answer (held out, or silent at a tick): a transfer engine probe
        # started before then may still hang in the transport's connect retries, so none is joined
        self.unanswered_at: Dict[str, float] = {}
        self.silent_since: Dict[str, float] = {}  # held session -> since when its endpoint takes no connection

    def hold(self, session: str, peer: str) -> None:
        """Under `lock`, at a loss that may not be one: `session` (at `peer`, host:port) held out from now."""
        self.held[session] = peer
        self.unanswered_at[session] = self.silent_since[session] = time.monotonic()

    def unhold(self, session: str) -> Optional[str]:
        """Under `lock`: `session` held no more; its host:port if it was."""
        self.unanswered_at.pop(session, None)
        self.silent_since.pop(session, None)
        return self.held.pop(session, None)

    def watch_held(self, session: str, verdict: str) -> None:
        """Monitor thread: a held-out decode is gone once refused, or once its endpoint has taken no connection
        for `departed_after` (its host left); still silent, it is left alone (a transfer engine probe through a
        cut link would only hang for its timeout, and one running when the link heals would hold the re-admission
        back by as much); answering (`verdict`: this tick's connect), it is probed in the background."""
        if verdict == REFUSED:
            self.drop_held(session, "refuses connections")
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
                self.drop_held(session, f"has taken no connection for {silent:.0f}s "
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
                peer_sockets.drop_socket(mgr, f"tcp://{peer}")
        with mgr.session_lock:
            with self.lock:
                held = session in self.held
            if not held or session not in mgr.decode_kv_args_table:
                return  # dropped meanwhile
            if rc != 0:  # still out (upstream's probe loop may have let it back in)
                set.add(mgr.failed_sessions, session)
                return
            with self.lock:  # it answers again: served again
                peer = self.unhold(session)
                # else a new decode there counted it
                counted = peer is not None and self.unlost(peer.rpartition(":")[0], peer) is not None
            if counted:  # before it is let back in: whoever finds it served finds the recovery counted
                self.count("recovery", peer)
            mgr._unblacklist_session(session)
        if peer is not None:
            logger.warning("PD peer recovered: decode peer %s answers again (session %s); served again", peer, session)

    def drop_held(self, session: str, why: str, addr_gone: bool = True, since: Optional[float] = None) -> None:
        """A decode held out as lost is gone (its loss was counted already), since `since` (default: now)."""
        with self.lock:
            peer = self.unhold(session)
            host, port = self.known.get(session, (None, None))
        if peer is None or host is None:
            return
        self.drop_incarnation(session, host, port)
        self.mark_gone([session, peer] if addr_gone else [session], since)
        logger.warning("PD peer gone: decode peer %s, lost earlier (session %s), %s; its session state dropped",
                       peer, session, why)

    def held_tables(self, peers: str) -> Dict[str, Tuple[int, Any, str]]:
        """Under `lock`: the resource report's view of the tables above (name -> (size, cap, why))."""
        return {
            "held": (len(self.held), peers, "sessions lost while they may be alive"),
            "probing": (len(self._probing), peers, "held sessions with a probe running"),
            "unanswered_at": (len(self.unanswered_at), peers, "held sessions with a heartbeat unanswered since"),
            "silent_since": (len(self.silent_since), peers, "held sessions whose endpoint takes no connection"),
        }
