"""Decode's monitor of its prefill peers: a crashed or cut prefill is noticed, its rooms end (502), its restart is
served; and decode's claims, which tell prefill that a live decode holds a request.

Threads: its `ForkPeerMonitor-decode` (`tick`: probes each prefill bootstrap server decode fetched; a lost one goes
through upstream's `_handle_node_failure`, which upstream's heartbeat also calls), the thread that fetches a
prefill's info again (`after_try_ensure_parallel_info`: back), the scheduler (`after_receiver_init`: claims sent)
and the ledger's readers on any thread (`is_lost`). Lock: `PeerMonitor.lock` over `lost`; `misses` is the monitor
thread's alone; upstream's `connection_lock` / `session_pool_lock` are never taken while holding it. Invariant: a
prefill bootstrap address is in `lost` from its loss (claimed once, by the first of two concurrent callers) until
it is fetched again or departs (`departed_after`); each loss and recovery is counted once.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict

from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.fork_ending import request_end_cause, room_ledger, teller
from sglang.srt.disaggregation.fork_peers import peer_sockets
from sglang.srt.disaggregation.fork_peers.peer_monitor import (
    ALIVE, REFUSED, PeerMonitor, attach, claim_frames, loss_message, monitor_of, probe_all)
from sglang.srt.managers.fork_core import fork_touch
from sglang.srt.managers.fork_core.bounded import entry

logger = logging.getLogger(__name__)


class DecodeSideMonitor(PeerMonitor):
    """The prefill bootstrap servers decode fetched (upstream's `prefill_info_table`), watched from one thread."""

    role, watches = "decode", "prefill"

    def __init__(self, mgr: Any, labels: Dict[str, str], metrics: bool):
        super().__init__(mgr, labels, metrics)
        self.misses: Dict[str, int] = {}  # bootstrap addr -> heartbeats unanswered in a row (monitor thread)
        self.lost: Dict[str, float] = {}  # bootstrap addr of a prefill lost and not back -> when it was lost

    def is_lost(self, addr: str) -> bool:
        """Whether the prefill at bootstrap address `addr` is lost now (the room ledger asks; any thread)."""
        return addr in self.lost

    def tick(self) -> None:
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
            answer = verdicts[addr]
            if answer == ALIVE:
                self.misses[addr] = 0
                continue
            self.misses[addr] = self.misses.get(addr, 0) + 1
            if answer == REFUSED or self.misses[addr] >= self.max_failures:
                self.misses.pop(addr, None)
                mgr._handle_node_failure(addr)
                with mgr.session_pool_lock:
                    mgr.session_pool.pop(addr, None)
        self._age_out()

    def _age_out(self) -> None:
        """Monitor thread: a prefill lost more than `departed_after` ago and not back has left for good: it is
        forgotten (no table grows per departed peer)."""
        now = time.monotonic()
        with self.lock:
            departed = [addr for addr, at in self.lost.items() if now - at > self.departed_after]
            for addr in departed:
                del self.lost[addr]
        for addr in departed:
            self.log_departed(addr)

    def lose(self, addr: str) -> bool:
        """Claim the loss of the prefill at `addr` (any thread): True for the first of concurrent callers."""
        with self.lock:
            if addr in self.lost:
                return False
            self.lost[addr] = time.monotonic()
            return True

    def back(self, addr: str) -> bool:
        """The prefill at `addr` answers again: True if it was lost (counted once)."""
        with self.lock:
            return self.lost.pop(addr, None) is not None

    # -- the report's view

    def gauges(self) -> Dict[str, int]:
        with self.lock:
            return {"lost": len(self.lost), "held_out": 0}

    def counts(self) -> Dict[str, int]:
        with self.lock:
            return {"monitor_lost_unrecovered": len(self.lost)}

    def tables(self) -> Dict[str, Dict[str, Any]]:
        """Per prefill peer, bounded by upstream's prefill table (a lost one's entry: by `departed_after`)."""
        peers = "upstream's prefill addresses"
        with self.lock:
            lost = len(self.lost)
        return {"misses": entry(len(self.misses), peers, "prefills with heartbeats unanswered"),
                "lost": entry(lost, peers, "prefills lost and not recovered, with when")}


# -- hooks


def on_decode_manager_init(mgr: Any, queue: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER DecodePreallocQueue._init_kv_manager (result: the manager): a monitor on any of upstream's managers
    (its prefill_info_table), registered with the room ledger (a drain a lost prefill owes is settled), started."""
    monitor = attach(queue, mgr, DecodeSideMonitor, fork_touch.COMMON_MANAGER)
    if monitor is None:
        return  # fake transfer backend
    room_ledger.ledger_for(mgr).watch_peers(monitor.is_lost)
    teller.teller.watch_lost(monitor.is_lost)  # no tell to a lost prefill on a socket from before its loss
    monitor.thread.start()


def around_handle_node_failure(original, mgr, peer, *args, **kwargs):
    """AROUND CommonKVManager._handle_node_failure(bootstrap addr) (decode): end the rooms, settle the drains."""
    monitor = monitor_of(mgr, DecodeSideMonitor)
    reason = loss_message("prefill", peer, "its bootstrap server does not answer")
    known = peer in mgr.prefill_info_table
    if monitor is not None:
        known = known and monitor.lose(peer)  # the first of two concurrent callers claims the loss
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
        monitor.count("loss", peer)
    return result


def after_try_ensure_parallel_info(result, mgr, bootstrap_addr, *args, **kwargs) -> None:
    """AFTER CommonKVManager.try_ensure_parallel_info: a lost prefill fetched again is back."""
    monitor = monitor_of(mgr, DecodeSideMonitor)
    if result and monitor is not None and monitor.is_lost(bootstrap_addr) and monitor.back(bootstrap_addr):
        peer_sockets.reconnect_receivers(bootstrap_addr)
        logger.warning("PD peer recovered: prefill peer %s answers again; its new info fetched", bootstrap_addr)
        monitor.count("recovery", bootstrap_addr)


def after_receiver_init(result: Any, receiver: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER CommonKVReceiver.init (decode's scheduler, as the request enters the prealloc queue): claim the room
    with each prefill rank it will shake hands with, so that prefill knows a live decode holds it while it waits
    for a preallocation (the lost-decode handshake rule). Best effort: a claim that cannot be sent leaves the
    request unclaimed (ended by that rule only while a decode is lost and it waited 5 s)."""
    import zmq

    mgr = receiver.kv_mgr
    if (fork_touch.upstream(receiver, "conclude_state") == KVPoll.Failed
            or monitor_of(mgr, DecodeSideMonitor) is None or not fork_touch.is_a(mgr, fork_touch.MOONCAKE_MANAGER)):
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
