"""The causes part of the room ledger (`room_ledger.RoomLedger`, a part of it as `held_decodes` is of prefill's
monitor): the cause kept with each room's failure record (`told`, both sides: the peer's frames, or this side's
`make`), handed once to the request that answers the record (`take_told`); the causes prefill announced for a
rank's next Failed status (`announced`, decode); the receivers whose prefill was told early (`told_early`, decode);
and prefill's telling of a cause to decode before the Failed status it goes with (`tell_cause`).

Threads: the bootstrap thread (`announce`, `keep_told` inside `record_failure`), transfer workers and the scheduler
(`told_with`, `take_told`, `keep_told`), the scheduler (`told_prefill_early`). Locks: `told` is guarded by upstream's
`failure_lock`, with the record it goes with; `announced` and `told_early` by the ledger's `RoomLedger.lock` (a
leaf). Invariant: a cause never outlives the failure record it came with (dropped or replaced with it, handed out
only with it), and each table is bounded (`MAX_CAUSES`, or weakly by the live receivers)."""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from typing import Any, Optional, Tuple

from sglang.srt.disaggregation.fork_ending.room_frames import cause_frames
from sglang.srt.disaggregation.fork_ending.verdict_rows import Told
from sglang.srt.managers.fork_core.bounded import Cap
from sglang.srt.managers.fork_core.fork_touch import upstream

logger = logging.getLogger(__name__)

MAX_CAUSES = Cap(65536, "a cause is a few words per room, kept only with a failure record or until the status it was "
                        "announced for: far more than a server fails within the bootstrap + waiting timeouts (oldest "
                        "dropped first; a dropped cause is read from the reason's text, as an older peer's)")


class RoomCauses:
    """The causes part of `room_ledger.RoomLedger` (its `mgr`, its `lock`; these tables)."""

    mgr: Any
    lock: Any

    def init_causes(self) -> None:
        # room -> (the cause its failure record came with: the peer's frames, or this side's `make`; that record),
        # under upstream's `failure_lock` with the record; the verdict hook moves it into the request's record
        # (`take_told`)
        self.told: "OrderedDict[int, Tuple[Told, str]]" = OrderedDict()
        # (room, prefill rank) -> the cause a PEER_CAUSE message announced for that rank's next Failed status
        # (decode's bootstrap thread alone)
        self.announced: "OrderedDict[Tuple[int, int], Told]" = OrderedDict()
        # decode: receivers ended before their prefill's rank endpoints were known, whose prefill was told (once)
        self.told_early: "weakref.WeakSet[Any]" = weakref.WeakSet()

    def tell_cause(self, targets: list, room: int, told: Told) -> None:
        """Prefill: `told` to each of the room's decode endpoints, before the Failed status it goes with (one socket
        per endpoint, so it arrives first). Every prefill rank that tells decode sends the same one (room_agreement
        agrees on it first)."""
        from sglang.srt.utils.network import NetworkAddress

        if not targets:
            return
        send = upstream(self.mgr, "_send_multipart_locked")
        frames = cause_frames(room, upstream(self.mgr, "_prefill_unique_rank")(), told)
        for endpoint, port in targets:
            address = NetworkAddress(endpoint, port)
            try:
                send(address.to_tcp(), frames, is_ipv6=address.is_ipv6)
            except Exception as e:  # as upstream's status send: the status follows; its reason is read as text
                logger.warning("room_ledger: could not tell %s room %s's cause: %r", address.to_host_port_str(), room, e)

    def keep_told(self, room: int, told: Optional[Told], reason: str = "") -> None:
        """The room's failure record `reason` was just written with `told` (None: without a cause; a stale one
        goes). Caller holds upstream's `failure_lock` (the record and its cause change together)."""
        self.told.pop(room, None)
        if told is not None:
            self.told[room] = (told, reason)
            while len(self.told) > MAX_CAUSES:
                self.told.popitem(last=False)

    def take_told(self, room: int, message: str) -> Optional[Told]:
        """The cause `room`'s failure came with, handed to the request that answers it (once): only if `message` (the
        answer upstream built around the popped record) holds that record, so a cause never outlives its record
        (a room number used again, a record replaced meanwhile)."""
        with upstream(self.mgr, "failure_lock"):
            kept = self.told.get(room)
            if kept is None or kept[1] not in message:
                return None
            del self.told[room]
        return kept[0]

    def told_with(self, room: int) -> Optional[Told]:
        """The cause kept with `room`'s failure record now (room_agreement shares it; a Failed status prefill's
        `conclude_transfer` sends carries it), or None: none, or one kept with a record popped or replaced since."""
        with upstream(self.mgr, "failure_lock"):
            kept = self.told.get(room)
            if kept is None or upstream(self.mgr, "failure_records").get(room) != kept[1]:
                return None
        return kept[0]

    def has_record(self, room: int) -> bool:
        """Whether `room` has a failure record now (upstream's `failure_records`, read under its `failure_lock`).
        Upstream keeps a room's first record, so a caller about to record one reads here whether it would be the
        first (prefill_side_monitor's hook for a write to a blacklisted session); the table is read only in this module."""
        with upstream(self.mgr, "failure_lock"):
            return room in upstream(self.mgr, "failure_records")

    def announce(self, room: int, rank: int, told: Optional[Told]) -> None:
        """Decode, bootstrap thread: prefill rank `rank` announced `told` for its next Failed status of `room`."""
        with self.lock:
            self.announced.pop((room, rank), None)
            if told is not None:
                self.announced[(room, rank)] = told
                while len(self.announced) > MAX_CAUSES:
                    self.announced.popitem(last=False)

    def announced_for(self, room: int, rank: int) -> Optional[Told]:
        with self.lock:
            return self.announced.pop((room, rank), None)

    def told_prefill_early(self, receiver: Any) -> bool:
        """Decode: whether `receiver`'s prefill is to be told now (the first call for it); the receiver's entry is
        the ledger's (a weak set: it goes with the receiver)."""
        with self.lock:
            if receiver in self.told_early:
                return False
            self.told_early.add(receiver)
            return True
