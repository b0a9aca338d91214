"""The room ledger: the one way the fork ends a PD room, its memory of ended rooms, the abort hooks.

`RoomLedger.end` does the ending in the order of docs/layout.md ("How a room ends"); `prepare_abort_verdict`
answers every PD request's failure end by the verdict's table (`verdict`). Any thread; `RoomLedger.lock` is a leaf
(taken inside upstream's `failure_lock` where both are held: `_drop_unowned_room`)."""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from sglang.srt.disaggregation.fork_ending import pd_queues, request_end_cause as end_cause, verdict as table
from sglang.srt.disaggregation.fork_ending.engine_clock import engine_clock
from sglang.srt.disaggregation.fork_ending.teller import (CAUSE_FRAME, ENDED_ON_PREFILL, tell_prefill, told_frames,
                                                          told_in)
from sglang.srt.disaggregation.fork_ending.verdict import (CANCEL_REASON, DECODE_ABORT_REASON, Told, peer_reason,
                                                           told_for, with_why)
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.environ import envs
from sglang.srt.managers.fork_core import fork_touch
from sglang.srt.managers.fork_core.bounded import Cap, entry
from sglang.srt.managers.fork_core.fork_touch import upstream
from sglang.srt.managers.fork_core.rank_agreement import answers

logger = logging.getLogger(__name__)

ATTR = "fork_room_ledger"
MAX_RECORDS = Cap(65536, "a room is a few words and a number; far more rooms than a server ends within the bootstrap + "
                         "waiting timeouts (oldest dropped first)")
NEVER = float("inf")
# Decode appends [WHY_FRAME, message] to the ABORT of a room its pause or a release ended (read by older fork builds),
# then its cause (teller.CAUSE_FRAME, to every ABORT: `abort_frames`); prefill strips them before upstream's handler.
WHY_FRAME = b"fork-why"
# Prefill tells decode a room's cause as a message of its own, right before the Failed status (upstream's frame, left
# as it is) on the same socket: [PEER_CAUSE, room, prefill rank, cause name, message] (`RoomLedger.end`). A decode of
# an older build or stock upstream drops it as an unparsable status (mooncake logs a warning; nixl/mori: a tag mismatch).
PEER_CAUSE = b"~fork-cause"
FORK_FRAMES = (WHY_FRAME, CAUSE_FRAME)


@dataclass
class Ended:
    """A room this side ended, or the peer cancelled before this side created it."""

    reason: str
    answer: bool  # a late handshake for it is answered Failed with `reason`
    cancel: bool  # the peer ended it first: a sender created for it fails at once
    expiry: float  # engine clock; the cancellation (or a bare record) is dropped then
    told: Optional[Told] = None  # the cause that goes with `reason` (told with a late answer; a cancel's, recorded)


class RoomLedger:
    """Per kv manager: drains owed by peers (decode), ended/cancelled/owned rooms (prefill), the cause each room's
    failure came with (`told`, both sides), the receivers whose prefill was told early (decode)."""

    def __init__(self, mgr: Any):
        self.mgr = mgr
        self.lock = threading.Lock()
        # decode: room -> (prefill's bootstrap address, generation, acks upstream waits for) until prefill acks
        self.drains: "OrderedDict[int, Tuple[str, int, int]]" = OrderedDict()
        self.ended: "OrderedDict[int, Ended]" = OrderedDict()
        # prefill: room -> its owner, a live sender whose `clear` disowns it (`claim`); weak: an owner gone without
        # its clear owns nothing
        self.owned: Dict[int, "weakref.ref[Any]"] = {}
        self.ttl_s = float(envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()
                           + envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get())
        self.peer_lost: Optional[Callable[[str], bool]] = None  # watch_peers: whether a peer is lost now
        # room -> (the cause its failure record came with: the peer's frames, or this side's `end`; that record),
        # under upstream's `failure_lock` with the record; the verdict hook moves it into the request's record
        # (`take_told`)
        self.told: "OrderedDict[int, Tuple[Told, str]]" = OrderedDict()
        # (room, prefill rank) -> the cause a PEER_CAUSE message announced for that rank's next Failed status
        # (decode's bootstrap thread alone)
        self.announced: "OrderedDict[Tuple[int, int], Told]" = OrderedDict()
        # decode: receivers ended before their prefill's rank endpoints were known, whose prefill was told (once)
        self.told_early: "weakref.WeakSet[Any]" = weakref.WeakSet()

    def watch_peers(self, lost: Callable[[str], bool]) -> None:
        """peer_liveness, when its monitor starts on this manager: `lost(addr)` says whether that peer is lost now.
        Decode notes a drain a prefill owes only while one is watching (`after_ensure_abort_notified`)."""
        self.peer_lost = lost

    def end(self, room: int, cause: Optional[str], reason: str, *, peer: Optional[str] = None, fail: bool = True,
            tell: bool = True, targets: Optional[list] = None, receiver: Any = None, remember: bool = False,
            cancel: bool = False, clear: Any = None, mark: bool = True, told: Optional[Told] = None) -> None:
        """End `room` for `cause` (None: the request's own) with `reason` (docs/layout.md). `clear`: the room's
        sender, whose transfer state and failure record this side drops first (a request retired elsewhere).
        `mark=False`: the failure is recorded, not marked (an upstream path about to fail the room reads it).
        `told`: the verdict's row for whoever reads `reason` (the request's record here, the peer when told): kept
        with the record and the remembered room, and sent to decode before the Failed status (`PEER_CAUSE`)."""
        mgr = self.mgr
        if room is None:
            return
        if cause is not None:  # first: before anyone can see Failed
            end_cause.tag(mgr, room, cause, peer)
        tables = has_room_tables(mgr)
        if clear is not None and tables and room in upstream(mgr, "request_status"):
            clear.clear()
            forget_failure(mgr, room)
        if remember or cancel:
            self.remember(room, reason, answer=remember, cancel=cancel, told=told)
        if fail and tables and room in upstream(mgr, "request_status"):
            with _attaching(told):  # around_record_failure keeps it with the record it writes
                mgr.record_failure(room, reason)
            if mark:
                mgr.update_status(room, KVPoll.Failed)
        if tell and receiver is not None:
            receiver.ensure_abort_notified()
        elif tell and tables:
            if targets is None:
                targets = upstream(mgr, "_room_notify_targets")(room)
            if told is not None:
                self.tell_cause(targets, room, told)
            upstream(mgr, "send_kv_status_message")(targets=targets, bootstrap_room=room, status=KVPoll.Failed,
                                                    failure_reason=reason)

    def tell_cause(self, targets: list, room: int, told: Told) -> None:
        """Prefill: `told` to each of the room's decode endpoints, before the Failed status it goes with (one socket
        per endpoint, so it arrives first). Every prefill rank that tells decode sends the same one (room_agreement
        agrees on it first)."""
        from sglang.srt.utils.network import NetworkAddress

        if not targets:
            return
        send = upstream(self.mgr, "_send_multipart_locked")
        frames = [PEER_CAUSE, str(room).encode("ascii"),
                  str(upstream(self.mgr, "_prefill_unique_rank")()).encode("ascii"), *told.frames()]
        for endpoint, port in targets:
            address = NetworkAddress(endpoint, port)
            try:
                send(address.to_tcp(), frames, is_ipv6=address.is_ipv6)
            except Exception as e:  # as upstream's status send: the status follows; its reason is read as text
                logger.warning("room_ledger: could not tell %s room %s's cause: %r", address.to_host_port_str(), room, e)

    def remember(self, room: int, reason: str, *, answer: bool = True, cancel: bool = False,
                 told: Optional[Told] = None) -> None:
        now = engine_clock.now()
        with self.lock:
            old = self.ended.pop(room, None)
            if old is not None and old.expiry > now:
                answer, cancel = answer or old.answer, cancel or old.cancel
            self.ended[room] = Ended(reason, answer, cancel, now + self.ttl_s if cancel or not answer else NEVER, told)
            self._expire(now)

    def late(self, room: int, pop: bool = False) -> Optional[Tuple[str, Optional[Told]]]:
        """(reason, its cause) a late handshake for `room` is answered with, or None."""
        with self.lock:
            record = self.ended.get(room)
            if record is None or not record.answer or not record.reason:
                return None
            if pop:  # answered once; still remembered as ended (the peer's ABORT cancels nothing)
                record.answer = False
                record.expiry = min(record.expiry, engine_clock.now() + self.ttl_s)
            return record.reason, record.told

    def claim(self, room: int, sender: Any) -> Optional[Tuple[str, Optional[Told]]]:
        """`sender` now owns `room`: (the reason to fail it, the cause) if the peer cancelled it first, else None.
        Only a sender whose `clear` disowns the room (`disowns_on_clear`) owns it: upstream pairs a fake sender (a
        request to the fake bootstrap host: the server's warmup, room 0) with this manager, but keeps none of its
        state in this manager's tables and has no peer here; it owns nothing and takes no cancellation."""
        if not disowns_on_clear(sender):
            return None
        now = engine_clock.now()
        with self.lock:
            self.owned[room] = weakref.ref(sender)
            record = self.ended.get(room)
            if record is None:
                return None
            claimed = (record.reason, record.told) if record.cancel and record.expiry > now else None
            if claimed is not None:
                record.cancel = False
            if not record.answer:
                del self.ended[room]  # consumed, or a new lifecycle (decode re-bootstraps rooms)
            return claimed

    # ------------------------------------------------------------------- the cause a room's failure came with

    def keep_told(self, room: int, told: Optional[Told], reason: str = "") -> None:
        """The room's failure record `reason` was just written with `told` (None: without a cause; a stale one
        goes). Caller holds upstream's `failure_lock` (the record and its cause change together)."""
        self.told.pop(room, None)
        if told is not None:
            self.told[room] = (told, reason)
            while len(self.told) > MAX_RECORDS:
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
        first (peer_liveness' hook for a write to a blacklisted session); the table is read only in this module."""
        with upstream(self.mgr, "failure_lock"):
            return room in upstream(self.mgr, "failure_records")

    def announce(self, room: int, rank: int, told: Optional[Told]) -> None:
        """Decode, bootstrap thread: prefill rank `rank` announced `told` for its next Failed status of `room`."""
        with self.lock:
            self.announced.pop((room, rank), None)
            if told is not None:
                self.announced[(room, rank)] = told
                while len(self.announced) > MAX_RECORDS:
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

    def owns(self, room: int) -> bool:
        """Whether a live sender owns `room` (an owner gone without its clear is forgotten here). Caller holds the
        lock."""
        owner = self.owned.get(room)
        if owner is not None and owner() is None:
            del self.owned[room]
            owner = None
        return owner is not None

    def owners(self) -> int:
        """How many rooms live senders own (the report). Caller holds the lock."""
        for room in [r for r, owner in self.owned.items() if owner() is None]:
            del self.owned[room]
        return len(self.owned)

    def disown(self, room: int, sender: Any, failed: bool) -> None:
        """`sender` was cleared: it owns `room` no more (a newer sender of the same number keeps it)."""
        with self.lock:
            owner = self.owned.get(room)
            if owner is not None and owner() in (sender, None):
                del self.owned[room]
            if failed and room not in self.ended:  # decode's ABORT answering our Failed cancels nothing
                self.ended[room] = Ended("", False, False, engine_clock.now() + self.ttl_s)

    def knows_of(self, room: int) -> bool:
        """Whether this side knows `room` at all: a live sender owns it, or it ended here or was cancelled by the peer
        (and is not forgotten yet)."""
        with self.lock:
            self._expire(engine_clock.now())
            return self.owns(room) or room in self.ended

    def note_abort(self, room: int, peer: str, why: Optional[str] = None, told: Optional[Told] = None) -> bool:
        """The peer's ABORT for a room this side neither owns nor remembers: kept as a cancellation (with `told`, the
        cause its frames carried; None from a peer that sends none)."""
        with self.lock:
            self._expire(engine_clock.now())
            if self.owns(room) or room in self.ended:
                return False
        self.remember(room, with_why(CANCEL_REASON.format(peer=peer, room=room), why), answer=False, cancel=True,
                      told=told)
        return True

    def drop_cancel(self, room: int) -> None:
        with self.lock:
            record = self.ended.get(room)
            if record is not None and record.cancel:
                del self.ended[room]

    def cancelled(self) -> int:
        now = engine_clock.now()
        with self.lock:
            self._expire(now)
            return sum(1 for r in self.ended.values() if r.cancel and r.expiry > now)

    def _expire(self, now: float) -> None:  # caller holds the lock
        while self.ended:
            _, record = next(iter(self.ended.items()))
            if record.expiry > now and len(self.ended) <= MAX_RECORDS:
                break
            self.ended.popitem(last=False)

    def note_drain(self, room: int, peer: str, generation: int, ranks: int) -> None:
        tracker = self.mgr._deferred_abort_ack_tracker
        with self.lock:
            self.drains.pop(room, None)
            self.drains[room] = (peer, generation, ranks)
            self._forget_released_drains(tracker)

    def _forget_released_drains(self, tracker: Any) -> None:
        """Forget the drains of rooms upstream released meanwhile (`clear_deferred_abort_state`: acked, or its
        deferred release timed out), oldest first, and beyond MAX_RECORDS. Caller holds the lock."""
        while self.drains:
            old, (_, held, _) = next(iter(self.drains.items()))
            state = tracker.get(old)
            if len(self.drains) <= MAX_RECORDS and state is not None and state.generation == held:
                break
            self.drains.popitem(last=False)

    def settle_peer(self, peer: str) -> None:
        """Ack, on behalf of the lost `peer`, every drain it still owes."""
        with self.lock:
            owed = [(room, self.drains.pop(room)) for room, d in list(self.drains.items()) if d[0] == peer]
        for room, (_, generation, ranks) in owed:  # the lock is released: upstream is called
            for i in range(max(ranks, 1)):
                self.mgr.note_abort_ack(room, -1 - i, generation)  # ranks no live prefill uses
        if owed:
            logger.info("room_ledger: prefill peer %s lost; drains of %d rooms acked on its behalf", peer, len(owed))


def has_room_tables(mgr: Any) -> bool:
    """Whether `mgr` keeps per-room tables and a peer to tell: every kv manager but upstream's fake backend's
    (`FakeKVManager` itself, no peer). Decided by class, never by an attribute's presence: on the others, upstream's
    names (`request_status`, `record_failure`, `send_kv_status_message`, ...) are read through
    `fork_touch.upstream`, so a rename raises instead of silently not telling the peer."""
    from sglang.srt.disaggregation.fake.conn import FakeKVManager

    return mgr is not None and type(mgr) is not FakeKVManager


def disowns_on_clear(sender: Any) -> bool:
    """Whether `sender`'s `clear` disowns its room (`on_sender_clear`): its class is one `fork_plugin.HOOKS` hooks
    `on_sender_clear` on (read from the hook table, as `handles_aborts` reads the swaps')."""
    return _disowns_on_clear(type(sender))


@functools.lru_cache(maxsize=64)
def _disowns_on_clear(cls: type) -> bool:
    from sglang.srt.managers.fork_core.fork_plugin import HOOKS

    classes = {f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__}
    return any(ref.endswith(":on_sender_clear") and ref.startswith(__name__ + ":")
               and target.rpartition(".")[0] in classes for target, ref, _ in HOOKS)


def handles_aborts(mgr: Any) -> bool:
    """Whether `mgr`'s class is one `fork_plugin.SWAPS` gives the ledger's ABORT handler (mooncake, nixl): read from
    the touch table, not from the presence of upstream's handler."""
    from sglang.srt.managers.fork_core.fork_plugin import SWAPS

    classes = {f"{c.__module__}.{c.__qualname__}" for c in type(mgr).__mro__}
    return mgr is not None and any(target.endswith("._handle_abort_notification") and target.rpartition(".")[0] in classes
                                   for target, *_ in SWAPS)


def awaits_its_request(mgr: Any, room: int) -> bool:
    """Prefill: whether what `mgr` holds for `room` is decode's handshake for a request still on its way to this
    scheduler (held at the tokenizer's pause gate, waiting in a re-send's wait, on the wire): the handshake is stored
    (`transfer_infos`), has not concluded (no failure record; Bootstrapping or WaitingForInput) and the ledger knows
    nothing of the room (no sender owned it, it did not end here, the peer did not cancel it). Upstream's sender takes
    it over when the request arrives; an end on the way drops it (`ended_at_gate` / decode's ABORT:
    `_drop_unowned_room`). Decode (no handshake is stored before its receiver exists): never."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    if not has_room_tables(mgr) or upstream(mgr, "disaggregation_mode") != DisaggregationMode.PREFILL:
        return False
    if room not in upstream(mgr, "transfer_infos") or room in upstream(mgr, "failure_records"):
        return False
    if upstream(mgr, "request_status").get(room) not in (None, KVPoll.Bootstrapping, KVPoll.WaitingForInput):
        return False
    ledger = ledger_of(mgr)
    return ledger is None or not ledger.knows_of(room)  # no ledger (a hook-less manager): upstream keeps it too


def failure_record(mgr: Any, room: int) -> Optional[str]:
    """`room`'s failure record now (upstream's table, under its failure lock), or None: room_agreement shares it
    with the other ranks (a manager whose ledger may not exist yet: read by manager, not through the ledger)."""
    with upstream(mgr, "failure_lock"):
        return upstream(mgr, "failure_records").get(room)


def forget_failure(mgr: Any, room: int) -> None:
    """Drop `room`'s failure record (upstream's table, under its failure lock) and its cause: its request was
    retired."""
    if has_room_tables(mgr):
        ledger = ledger_of(mgr)
        with upstream(mgr, "failure_lock"):
            upstream(mgr, "failure_records").pop(room, None)
            if ledger is not None:
                ledger.keep_told(room, None)


# Decode's ledgers in this process (one per decode kv manager): a decode request's answer finds its room's cause here
# (upstream's decode Req holds no reference to its receiver or manager).
DECODE_LEDGERS: "weakref.WeakSet[RoomLedger]" = weakref.WeakSet()


def told_for_req(req: Any, message: str) -> Optional[Told]:
    """The cause `req`'s room's failure came with, taken from its ledger (prefill: its sender's manager; decode:
    this process's decode ledgers) if `message` holds that failure, or None."""
    room = upstream(req, "bootstrap_room")
    if room is None:
        return None
    sender = upstream(req, "disagg_kv_sender")
    if sender is not None:
        ledger = ledger_of(upstream(sender, "kv_mgr"))
        return None if ledger is None or not has_room_tables(ledger.mgr) else ledger.take_told(room, message)
    for ledger in list(DECODE_LEDGERS):
        told = ledger.take_told(room, message)
        if told is not None:
            return told
    return None


@contextlib.contextmanager
def _scoped(local: threading.local, **values: Any):
    """`values` set on this thread's `local` for the `with` block, the outer ones put back after."""
    outer = {name: getattr(local, name) for name in values}
    for name, value in values.items():
        setattr(local, name, value)
    try:
        yield
    finally:
        for name, value in outer.items():
            setattr(local, name, value)


class _Attaching(threading.local):
    told: Optional[Told] = None


# The cause of the failure `record_failure` is writing on this thread (RoomLedger.end, decode's status handler).
_attach = _Attaching()


def _attaching(told: Optional[Told]):
    return _scoped(_attach, told=told)


class _Concluding(threading.local):
    room: Optional[int] = None
    targets: Optional[list] = None


# The room upstream's `conclude_transfer` may fail on this thread (prefill's transfer worker), and its targets.
_concluding = _Concluding()


def concluding(room: int, targets: Optional[list]):
    """Around upstream's `conclude_transfer` of `room` (prefill's transfer worker; peer_liveness' hook, for a write
    to a session upstream blacklisted): the Failed status it sends carries the cause kept with the record it sends
    (`tell_cause`, from `around_update_status`: upstream marks the room Failed only once it has decided to send, so a
    cleared room, which it returns from unconcluded, is told nothing and no told cause waits on decode for a status
    that never comes)."""
    return _scoped(_concluding, room=room, targets=targets)


def ledger_of(mgr: Any) -> Optional[RoomLedger]:
    return getattr(mgr, "__dict__", {}).get(ATTR)


def ledger_for(mgr: Any) -> RoomLedger:
    """`mgr`'s ledger, made here if a hook-less manager has none."""
    return ledger_of(mgr) or mgr.__dict__.setdefault(ATTR, RoomLedger(mgr))


def end_room(mgr: Any, room: int, cause: Optional[str], reason: str, **kwargs: Any) -> None:
    """`RoomLedger.end` on `mgr`'s ledger (made here if a hook-less manager has none)."""
    ledger_for(mgr).end(room, cause, reason, **kwargs)


def report(mgr: Any) -> Optional[int]:
    """How many peer cancellations are remembered (resource report)."""
    ledger = ledger_of(mgr)
    return None if ledger is None or not handles_aborts(mgr) else ledger.cancelled()


def ledger_tables(mgr: Any) -> Dict[str, Dict[str, Any]]:
    """The resource report's view of `mgr`'s ledger (`fork_tables`): each table's size, cap and why. `memory`: kept
    after its request ended, by design, until it expires (bounded); the others are empty when the server is idle."""
    ledger = ledger_of(mgr)
    if ledger is None:
        return {}
    tracker = getattr(mgr, "_deferred_abort_ack_tracker", None)  # decode's (upstream's); read as note_drain does
    with ledger.lock:
        if tracker is not None:
            ledger._forget_released_drains(tracker)
        sizes = {"drains": len(ledger.drains), "ended": len(ledger.ended), "owned": ledger.owners(),
                 "announced": len(ledger.announced), "told_early": len(ledger.told_early)}
    sizes["told"] = len(ledger.told)  # under upstream's failure_lock when written; a length read is one step
    why = {
        "drains": "decode: rooms whose prefill owes a drain ack, until it acks or is lost",
        "ended": "rooms this side ended or the peer cancelled, for late handshakes (expire on the engine clock)",
        "owned": "prefill: rooms a live sender owns",
        "announced": "decode: causes prefill announced for its next Failed status of a room",
        "told_early": "decode: receivers whose prefill was told before its endpoints were known (weak: go with them)",
        "told": "the cause kept with a room's failure record, until its request is answered",
    }
    cap = {"owned": "the senders alive", "told_early": "the receivers alive"}
    return {f"ledger_{name}": entry(size, cap.get(name, MAX_RECORDS), why[name],
                                   **({"memory": True} if name in ("ended", "told_early") else {}))
            for name, size in sizes.items()}


# ----------------------------------------------------------------------------- hooks


def on_manager_init(mgr: Any, queue_: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER each PD queue's `_init_kv_manager`: the ledger; prefill: its ABORT handler (SWAPS)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    ledger = mgr.__dict__[ATTR] = RoomLedger(mgr)  # a new manager each call (upstream's role switch too)
    if has_room_tables(mgr) and upstream(mgr, "disaggregation_mode") == DisaggregationMode.PREFILL:
        fork_touch.swap(mgr, "_handle_abort_notification",
                        lambda original: lambda msg: _handle_abort(ledger, original, msg), by=__name__)
    elif has_room_tables(mgr):
        DECODE_LEDGERS.add(ledger)


def _handle_abort(ledger: RoomLedger, original: Any, msg: List[bytes]) -> bool:
    """Decode's ABORT (bootstrap thread), before upstream's: cancels a room not created yet, else records why."""
    from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification

    mgr = ledger.mgr
    if msg and msg[0] == ABORT_TAG and len(msg) >= 4 and msg[2] == ENDED_ON_PREFILL:
        _ended_on_prefill(ledger, int(msg[1].decode("ascii")), msg[3].decode("utf-8", "replace"), told_in(msg, 4))
        return True
    why = told = None
    if msg and msg[0] == ABORT_TAG:
        msg, why, told = split_abort(msg)
    note = AbortNotification.from_zmq(msg) if msg and msg[0] == ABORT_TAG else None
    kept = False
    if note is not None:
        room = note.room
        peer = f"{note.decode_ip}:{note.decode_port}" if note.decode_ip else "(unknown)"
        kept = ledger.note_abort(room, peer, why, told)
        if kept:  # decode's handshake may have created it, though no sender owns it
            _drop_unowned_room(mgr, room)
        if mgr.request_status.get(room) not in (None, KVPoll.Success):
            with mgr.failure_lock:  # re-checked: a room cleared meanwhile gets no record back
                if room in mgr.request_status and room not in mgr.failure_records:
                    mgr.failure_records[room] = with_why(DECODE_ABORT_REASON.format(room=room), why)
                    ledger.keep_told(room, told, mgr.failure_records[room])
    handled = original(msg)
    if kept and note.room in mgr.request_status:
        ledger.drop_cancel(note.room)  # the sender appeared meanwhile; upstream failed it
    return handled


def abort_frames(frames: List[bytes], why: Optional[str]) -> List[bytes]:
    """Decode's ABORT (upstream's frames) with what the fork tells prefill: the pause's message `why` (WHY_FRAME, as
    older fork builds read it) and the cause (teller.CAUSE_FRAME: `told_for(why)`), the same to every prefill rank.
    Stock upstream prefill parses only its first five frames (room, return address, generation): an ABORT that has
    all five is handled as if nothing followed; one without a generation or return address has a frame of ours read
    as one, logs upstream's "Malformed ABORT message" warning and is handled as a room-only ABORT."""
    extra = [WHY_FRAME, why.encode("utf-8")] if why else []
    return list(frames) + extra + told_frames(told_for(why))


def split_abort(msg: List[bytes]) -> Tuple[List[bytes], Optional[str], Optional[Told]]:
    """(upstream's frames, the why, the cause) of decode's ABORT: the fork's frames follow upstream's (from the first
    of `FORK_FRAMES` on); a peer that sends none (older fork build: no cause; stock upstream: neither) gives None."""
    at = next((i for i, frame in enumerate(msg) if i >= 2 and frame in FORK_FRAMES), len(msg))
    ours = msg[at:]
    why = None
    if WHY_FRAME in ours:
        i = ours.index(WHY_FRAME)
        why = b"".join(ours[i + 1:i + 2]).decode("utf-8", "replace") or None
    return msg[:at], why, told_in(ours)


def _drop_unowned_room(mgr: Any, room: int) -> None:
    """Drop what the bootstrap thread stored for a room no sender owns (nobody else would). The scheduler may have
    created the room's sender since the caller looked (`on_prefill_create_sender`: `claim` makes it the owner, then
    fails it with the cancellation's reason): that room and its failure record are the sender's and stay, else its
    request would poll a room gone Failed without a record (500, "unknown reason"). Ownership is checked and the
    tables dropped in one step under the ledger's lock (`claim` adds the owner under it), inside upstream's
    failure lock (the record and its cause go together)."""
    ledger = ledger_of(mgr)
    with mgr.failure_lock, (ledger.lock if ledger is not None else contextlib.nullcontext()):
        if ledger is not None and ledger.owns(room):
            return
        for table in (mgr.request_status, mgr.transfer_infos, mgr.req_to_decode_prefix_len, mgr.failure_records):
            table.pop(room, None)
        if ledger is not None:
            ledger.keep_told(room, None)


def on_prefill_create_sender(result: Any, queue_: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER `PrefillBootstrapQueue.create_sender`: a room decode already ended fails at once."""
    mgr, ledger = queue_.kv_manager, ledger_of(queue_.kv_manager)
    if not result or ledger is None or req.bootstrap_room is None or not handles_aborts(mgr):
        return
    claimed = ledger.claim(req.bootstrap_room, req.disagg_kv_sender)
    if claimed is not None:
        reason, told = claimed
        logger.info("room_ledger: %s (rid=%s)", reason, req.rid)
        # the ABORT handler may have dropped the room the sender had just opened
        mgr.request_status.setdefault(req.bootstrap_room, KVPoll.Bootstrapping)
        ledger.end(req.bootstrap_room, None, reason, tell=False, told=told)


def on_sender_clear(result: Any, sender: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `CommonKVSender.clear`: a room this prefill failed is remembered as ended."""
    ledger_of(sender.kv_mgr).disown(sender.bootstrap_room, sender, sender.conclude_state == KVPoll.Failed)


def around_update_status(original, mgr, bootstrap_room, status, *args, **kwargs):
    """AROUND CommonKVManager.update_status: a late handshake for an ended room is answered Failed; a room a
    `concluding` conclusion fails has the cause kept with its record told first (its Failed status follows)."""
    ledger, current = ledger_of(mgr), mgr.request_status.get(bootstrap_room)
    if status == KVPoll.Failed and ledger is not None and _concluding.room == bootstrap_room:
        told, targets = ledger.told_with(bootstrap_room), _concluding.targets
        _concluding.room = None  # once
        if told is not None:
            ledger.tell_cause(mgr._room_notify_targets(bootstrap_room) if targets is None else targets,
                              bootstrap_room, told)
    late = status == KVPoll.WaitingForInput and ledger is not None and ledger.ended and current in (None, KVPoll.Failed)
    answer = ledger.late(bootstrap_room, pop=current is None) if late else None
    if answer is None:
        return original(mgr, bootstrap_room, status, *args, **kwargs)
    reason, told = answer
    targets = mgr._room_notify_targets(bootstrap_room)
    result = None if current is None else original(mgr, bootstrap_room, status, *args, **kwargs)
    if current is None:
        mgr.transfer_infos.pop(bootstrap_room, None)
        mgr.req_to_decode_prefix_len.pop(bootstrap_room, None)
    ledger.end(bootstrap_room, None, reason, fail=False, targets=targets, told=told)
    return result


def around_record_failure(original, mgr, bootstrap_room, failure_reason, *args, **kwargs):
    """AROUND CommonKVManager.record_failure: none for a cleared room (decode), over a peer loss or, as upstream's
    bare abort reason, over any reason; tags our loss."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    if upstream(mgr, "disaggregation_mode") == DisaggregationMode.DECODE:
        if bootstrap_room not in mgr.request_status:
            logger.debug("room_ledger: dropping failure for ended room %s: %s", bootstrap_room, failure_reason)
            return None
        if table.is_lost_peer(failure_reason):
            end_cause.tag(mgr, bootstrap_room, end_cause.PEER_FAILURE)
    new = failure_reason or ""
    if table.kept_over(mgr.failure_records.get(bootstrap_room), new):
        return None
    if table.is_bare_abort(new) and getattr(_recompute, "reason", None):
        failure_reason = _recompute.reason  # the re-send's failure, not a client's abort
    ledger = ledger_of(mgr)
    if ledger is None:
        return original(mgr, bootstrap_room, failure_reason, *args, **kwargs)
    # upstream's record_failure takes the failure lock itself: the old record's cause goes first (a reader meanwhile
    # finds none and reads the text), the new record's cause is kept once it is written
    with mgr.failure_lock:
        ledger.keep_told(bootstrap_room, None)
    result = original(mgr, bootstrap_room, failure_reason, *args, **kwargs)
    with mgr.failure_lock:
        if mgr.failure_records.get(bootstrap_room) == failure_reason:
            ledger.keep_told(bootstrap_room, _attach.told, failure_reason)
    return result


def around_parse_kv_status_message(original, mgr, msg, *args, **kwargs):
    """AROUND CommonKVManager.parse_kv_status_message (decode's bootstrap thread): prefill's `PEER_CAUSE` message is
    the fork's, announcing the cause of that rank's next Failed status of the room; anything else is upstream's."""
    if msg and msg[0] == PEER_CAUSE and len(msg) >= 5:
        ledger = ledger_of(mgr)
        try:
            room, rank = int(msg[1].decode("ascii")), int(msg[2].decode("ascii"))
        except ValueError:
            logger.warning("room_ledger: dropping a malformed cause message %r", msg[:3])
            return None
        if ledger is not None:
            ledger.announce(room, rank, Told.from_frames(msg[3:5]))
        return None
    return original(mgr, msg, *args, **kwargs)


def around_apply_prefill_status(original, mgr, *args, bootstrap_room=None, status=None, prefill_rank=None, **kwargs):
    """AROUND CommonKVManager.apply_prefill_status (decode's bootstrap thread): the cause prefill announced for this
    Failed status is kept with the failure record it writes (around_record_failure); without one (a prefill of an
    older build, stock upstream) the record's text is what the verdict reads."""
    ledger = ledger_of(mgr)
    told = ledger.announced_for(bootstrap_room, prefill_rank) if ledger is not None else None
    with _attaching(told if status == KVPoll.Failed else None):
        return original(mgr, *args, bootstrap_room=bootstrap_room, status=status, prefill_rank=prefill_rank, **kwargs)


# The reason `_fail_prefill_recompute` is recording on this thread (decode's re-bootstrap pool).
_recompute = threading.local()


def around_fail_prefill_recompute(original, mgr, kv_receiver, reason, *args, **kwargs):
    """AROUND CommonKVManager._fail_prefill_recompute (decode: a retract's re-send to prefill failed): the abort's
    record is `reason` from the start, never a client abort (why: docs/pause-release-resume.md)."""
    _recompute.reason = reason
    try:
        return original(mgr, kv_receiver, reason, *args, **kwargs)
    finally:
        _recompute.reason = None


# ----------------------------------------------------------------------------- the verdict (verdict.TABLE)


def prepare_abort_verdict(original, req, error_message, status_code=None, *args, **kwargs):
    """AROUND `disaggregation.utils.prepare_abort`: the one verdict hook (verdict.TABLE). The cause the room's
    failure came with (its ledger) moves into the request's record first: the verdict reads it there."""
    told = told_for_req(req, str(error_message or ""))
    if told is not None:
        table.of(req).told = told
    error_message, status_code, cause = table.verdict(req, error_message, status_code)
    if cause is not None:
        end_cause.tag_req(req, cause)
    return original(req, error_message, status_code, *args, **kwargs)


# ----------------------------------------------------------------------------- aborts (scheduler thread)
# An AbortReq marks each PD request it reaches with the verdict it asked for; prefill tells decode at once and clears
# the room on its retire paths; patched lines call `count_failed_end`, `record_transfer_failure` and
# `finish_transferred` (docs/aborts.md).


def _kv_mgr(req):
    sender = upstream(req, "disagg_kv_sender")
    return None if sender is None else upstream(sender, "kv_mgr")


def _retire_prefill_room(scheduler, req, stage: str) -> None:
    """`req` ended here at `stage`: drop its room's transfer state, count its end."""
    kv_mgr = _kv_mgr(req)
    if kv_mgr is not None:
        req.disagg_kv_sender.clear()
        forget_failure(kv_mgr, req.bootstrap_room)  # fake: none
    end_cause.record_end(scheduler, req, "prefill", stage, kv_mgr)


def before_abort_request(scheduler, recv_req, *args, **kwargs) -> None:
    """BEFORE Scheduler.abort_request: mark the PD requests it reaches; prefill tells decode at once."""
    role = pd_queues.role(scheduler)
    if role is None:
        return
    message, status, cause = table.requested(recv_req)
    for stage, req in pd_queues.walk(scheduler):
        if not (recv_req.abort_all or req.rid.startswith(recv_req.rid or "")) or req.finished():
            continue
        if table.peek(req).requested is not None:
            continue  # already aborted (or met earlier in the walk): a second abort changes nothing
        table.of(req).requested = (message, status)
        end_cause.tag_req(req, cause)
        kv_mgr = _kv_mgr(req) if role == "prefill" else None  # decode: none; the fake one cannot send
        room = req.bootstrap_room  # None: `end` ends nothing
        if has_room_tables(kv_mgr) and upstream(kv_mgr, "request_status").get(room) != KVPoll.Success:
            end_room(kv_mgr, room, None, peer_reason(req.rid, room, "prefill", message), fail=False, remember=True,
                     told=told_for(message))


def counts_as_failure(scheduler, req, role: str, stage: Optional[str] = None, kv_mgr=None) -> bool:
    """Patched failure paths: count `req`'s end once; whether upstream counts a failure too."""
    if role == "prefill":  # decode's patched lines pass its stage and kv manager, prefill's neither
        stage, kv_mgr = stage or pd_queues.prefill_stage(scheduler, req), _kv_mgr(req)
    cause = end_cause.record_end(scheduler, req, role, stage, kv_mgr) or end_cause.cause_of(req, kv_mgr)[0]
    return cause not in (end_cause.CLIENT_ABORT, end_cause.PAUSE)


def count_failed_end(scheduler, req, role: str, stage: Optional[str] = None, kv_mgr=None, *, counter: str) -> None:
    """A patched failure path's one call (prefill's bootstrap and inflight failures, decode's prealloc): `req`'s
    end counted by cause; upstream's failure `counter` (a SchedulerMetricsCollector method) only for a real one."""
    if not counts_as_failure(scheduler, req, role, stage, kv_mgr):
        return
    if upstream(upstream(scheduler, "metrics_reporter"), "enable_metrics"):
        upstream(upstream(scheduler, "metrics_collector"), counter)()


def record_transfer_failure(queue_, decode_req, failure_reason: str) -> None:
    """Decode's transfer queue, a Failed poll (the patched line's one call): the request's end counted by cause;
    upstream's `_record_transfer_failure` (its failure counter, chunk_failures' hook) only for a real failure."""
    if counts_as_failure(queue_.scheduler, decode_req.req, "decode", "decode_transfer", decode_req.kv_receiver.kv_mgr):
        queue_._record_transfer_failure(failure_reason)


def finish_transferred(scheduler, req) -> bool:
    """Prefill inflight, Success polled: whether `req` ends as an abort (a pending one wins)."""
    from sglang.srt.disaggregation.utils import is_aborted, prepare_abort
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    if isinstance(req.finished_reason, FINISH_ABORT):
        return True
    asked = table.peek(req).requested
    if not (is_aborted(req) or asked is not None):
        return False
    pending = req.to_finish
    if asked is None:  # the pending abort (is_aborted, not finished) asks for its own verdict
        asked, cause = table.requested_by_pending(pending)
        table.of(req).requested = asked
        end_cause.tag_req(req, cause)
    req.to_finish = None
    prepare_abort(req, table.CLIENT_ABORT_MESSAGE)
    kv_mgr = _kv_mgr(req)
    end_cause.record_end(scheduler, req, "prefill", pd_queues.PREFILL_INFLIGHT, kv_mgr)
    if has_room_tables(kv_mgr):  # the fake backend has no peer
        reason = peer_reason(req.rid, req.bootstrap_room, "prefill", asked[0])
        end_room(kv_mgr, req.bootstrap_room, None, reason, fail=False, remember=True, told=told_for(asked[0]))
    return True


def after_retire_aborted(result, scheduler, req, *args, **kwargs):
    """AFTER SchedulerDisaggregationPrefillMixin._retire_aborted_prefill_result: its room ends here."""
    if result:
        _retire_prefill_room(scheduler, req, pd_queues.PREFILL_RUNNING)


def after_release_aborted_waiting(result, scheduler, req, *args, **kwargs):
    """AFTER release_aborted_prefill_waiting_req: upstream never clears the room."""
    _retire_prefill_room(scheduler, req, pd_queues.PREFILL_WAITING)


def around_pending_chunked_abort(original, scheduler, *args, **kwargs):
    """AROUND Scheduler.process_pending_chunked_abort: clear the retired request's room."""
    req = upstream(scheduler, "_pending_chunked_abort_req")
    retiring = req is not None and scheduler.chunked_req is req
    result = original(scheduler, *args, **kwargs)
    if retiring and scheduler.chunked_req is not req and pd_queues.role(scheduler) == "prefill":
        _retire_prefill_room(scheduler, req, pd_queues.PREFILL_RUNNING)
    return result


# ----------------------------------------------------------------------------- telling prefill


def ended_at_gate(role: Any, obj: Any, why: str) -> None:
    """A request one side ended before its scheduler saw it (pause gate, rejection): the peer's copy is told."""
    role = str(getattr(role, "value", role))
    if role not in ("decode", "prefill"):
        return
    rooms = obj.bootstrap_room if isinstance(obj.bootstrap_room, list) else [obj.bootstrap_room]
    hosts, ports, rids = ((v if isinstance(v, list) else [v] * len(rooms))
                          for v in (obj.bootstrap_host, obj.bootstrap_port, obj.rid))
    for host, port, room, rid in zip(hosts, ports, rooms, rids):
        if role == "decode":  # decode's ABORT: its cause as every ABORT's (abort_frames)
            tell_prefill(host, port, room, why)
        else:
            tell_prefill(host, port, room, why, peer_reason(rid, room, "prefill", why), told_for(why))


def before_release_on_failure(tokenizer_manager: Any, request_states: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE `TokenizerManager._release_req_states_on_failure` (HTTP thread): a request that failed
    before this side's scheduler (rejected, or its client gone at the gate) has its peer's copy told."""
    exc = sys.exc_info()[1]
    role = str(getattr(tokenizer_manager.disaggregation_mode, "value", ""))
    rejected = isinstance(exc, Exception)  # not the CancelledError (a BaseException) of a client gone at the gate
    why = table.rejected_by(f"{role}'s tokenizer", str(exc)) if rejected else f"ended at {role}'s tokenizer"
    for rid, state in request_states.items():
        if tokenizer_manager.rid_to_state.get(rid) is state and not state.dispatched:
            ended_at_gate(role, state.obj, why)


def _ended_on_prefill(ledger: "RoomLedger", room: int, reason: str, told: Optional[Told]) -> None:
    """Bootstrap thread: answer decode's handshake for a room prefill ended, now or when it lands, with `reason` and
    its cause `told` (the ENDED_ON_PREFILL frames')."""
    with ledger.lock:
        if ledger.owns(room):  # a live sender owns the number: not this request's room
            return
    targets = ledger.mgr._room_notify_targets(room)
    ledger.end(room, None, reason, fail=False, tell=bool(targets), targets=targets, remember=not targets, cancel=True,
               told=told)
    if targets:
        _drop_unowned_room(ledger.mgr, room)
    logger.info("room_ledger: room %s ended on prefill before its scheduler saw it (%s); decode %s",
                room, reason, "told" if targets else "will be told at its handshake")


def after_send_abort_output(result: Any, scheduler: Any, abort_req: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.send_abort_output: a scheduler's rejection ends the other side's copy (told by the answering
    rank alone: every rank rejects the same request, and the teller tells every prefill rank)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode, TransferBackend

    if not answers():
        return
    mode = scheduler.disaggregation_mode  # a request without a room: tell_prefill tells nothing
    if (mode == DisaggregationMode.DECODE and scheduler.transfer_backend != TransferBackend.FAKE
            and not req.time_stats.decode_prealloc_queue_entry_time):
        ended_at_gate(mode, req, table.rejected_by("decode's scheduler"))
    elif mode == DisaggregationMode.PREFILL and req.disagg_kv_sender is None:  # no room here
        said = (upstream(abort_req, "finished_reason") or {}).get("message")
        ended_at_gate(mode, req, table.rejected_by("prefill's scheduler", said))


def after_ensure_abort_notified(result: Any, receiver: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `CommonKVReceiver.ensure_abort_notified` (decode): prefill is told of a room ended before its rank
    endpoints were known (once); a drain ack armed for the room is owed by that prefill (its loss settles it)."""
    addr = upstream(receiver, "bootstrap_addr")
    mgr = receiver.kv_mgr
    ledger = ledger_for(mgr)
    if not (receiver.abort_notified or getattr(receiver, "bootstrap_infos", None) is not None  # set lazily
            or not upstream(receiver, "_owns_bootstrap_room")) and ledger.told_prefill_early(receiver):
        host, _, port = str(addr).rpartition(":")
        tell_prefill(host.strip("[]"), int(port), receiver.bootstrap_room,
                     "ended on decode before prefill's info was fetched")
        return
    lost = ledger.peer_lost  # peer_liveness' monitor (RoomLedger.watch_peers)
    generation, room = upstream(receiver, "_abort_generation"), receiver.bootstrap_room
    if lost is None or generation is None or room not in mgr._deferred_abort_ack_tracker:
        return
    ledger.note_drain(room, addr, generation, len(receiver.bootstrap_infos or ()))
    if lost(addr):  # lost already, or meanwhile (settle_peer may have run)
        ledger.settle_peer(addr)
