"""The room ledger: the one owner of a room's end on this side (docs/layout.md, "How a room ends"). Per kv manager,
one `RoomLedger` holds the per-room memory (ended and cancelled rooms, owners, drains owed; its causes part,
`room_causes`: the cause kept with each failure record, the causes prefill announced, the receivers told early) and
makes every end along a named transition of `room_transitions` (`RoomLedger.make`, `end_room`), in the one order
that cannot leak; here too the few reads and drops of upstream's per-room tables that go with an end
(`forget_failure`, `forget_failure_if_cleared`, `drop_unowned_room`, `failure_record`) and "is this our manager"
(`has_room_tables`).

Threads: any (scheduler, bootstrap, transfer workers, the peer monitor). Lock: `RoomLedger.lock`, a leaf guarding
the ledger's tables only, never held while calling upstream (taken inside upstream's `failure_lock` where both are
held: `drop_unowned_room`); expiry on `engine_clock`. Invariant: a room ends only along a row of `TRANSITIONS`, and
every table is bounded (`MAX_RECORDS`, or by the live senders / receivers it references weakly)."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from sglang.srt.disaggregation.fork_ending import request_end_cause as end_cause
from sglang.srt.disaggregation.fork_ending.engine_clock import engine_clock
from sglang.srt.disaggregation.fork_ending.room_causes import RoomCauses
from sglang.srt.disaggregation.fork_ending.room_threads import attaching, concluding  # noqa: F401 (prefill_side_monitor)
from sglang.srt.disaggregation.fork_ending.room_transitions import TRANSITIONS, Tell, Transition, check
from sglang.srt.disaggregation.fork_ending.verdict import with_why
from sglang.srt.disaggregation.fork_ending.verdict_rows import Told
from sglang.srt.disaggregation.fork_ending.verdict_wording import CANCEL_REASON
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.environ import envs
from sglang.srt.managers.fork_core.bounded import Cap
from sglang.srt.managers.fork_core.fork_touch import upstream

logger = logging.getLogger(__name__)

ATTR = "fork_room_ledger"
MAX_RECORDS = Cap(65536, "a room is a few words and a number; far more rooms than a server ends within the bootstrap + "
                         "waiting timeouts (oldest dropped first)")
NEVER = float("inf")
# the module whose AFTER on `CommonKVSender.clear` disowns a room (`disowns_on_clear` reads the hook table)
KV_HOOKS = "sglang.srt.disaggregation.fork_ending.room_kv_hooks"


@dataclass
class Ended:
    """A room this side ended, or the peer cancelled before this side created it."""

    reason: str
    answer: bool  # a late handshake for it is answered Failed with `reason`
    cancel: bool  # the peer ended it first: a sender created for it fails at once
    expiry: float  # engine clock; the cancellation (or a bare record) is dropped then
    told: Optional[Told] = None  # the cause that goes with `reason` (told with a late answer; a cancel's, recorded)


class RoomLedger(RoomCauses):
    """Per kv manager: drains owed by peers (decode), ended/cancelled/owned rooms (prefill); its causes part
    (`RoomCauses`): the cause each room's failure came with (`told`, both sides), the causes prefill announced and
    the receivers whose prefill was told early (decode)."""

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
        self.init_causes()  # the causes part (room_causes): told, announced, told_early

    def watch_peers(self, lost: Callable[[str], bool]) -> None:
        """decode_side_monitor, when its monitor starts on this manager: `lost(addr)` says whether that peer is lost now.
        Decode notes a drain a prefill owes only while one is watching (`after_ensure_abort_notified`)."""
        self.peer_lost = lost

    def make(self, transition: Transition, room: Optional[int], reason: str, *, cause: Optional[str] = None,
             peer: Optional[str] = None, told: Optional[Told] = None, targets: Optional[list] = None,
             receiver: Any = None, sender: Any = None) -> None:
        """End `room` along `transition`'s row of `TRANSITIONS` (room_transitions), for `cause` (None: the request's
        own) with `reason`, in the one order (docs/layout.md, "How a room ends"): tag the cause; clear `sender` (its
        transfer state and the room's failure record); remember the room; record the failure (and mark it Failed);
        tell the peer (`targets`: the decode endpoints to tell, default all of the room's; `receiver`: decode's, whose
        ABORT tells prefill). `told`: the verdict's row for whoever reads `reason` (the request's record here, the
        peer when told): kept with the record and the remembered room, and sent to decode before the Failed status
        (`PEER_CAUSE`). A room None ends nothing; an illegal transition changes nothing (`room_transitions.check`)."""
        mgr = self.mgr
        if room is None:
            return
        tables = has_room_tables(mgr)
        if not check(transition, room, side_of(mgr) if tables else None, sender=sender, receiver=receiver,
                     targets=targets):
            return
        row = TRANSITIONS[transition]
        if cause is not None:  # first: before anyone can see Failed
            end_cause.tag(mgr, room, cause, peer)
        if row.clear and tables and room in upstream(mgr, "request_status"):
            sender.clear()
            forget_failure(mgr, room)
        if row.remembers:
            self.remember(room, reason, answer=row.answer, cancel=row.cancel, told=told)
        if row.fail and tables and room in upstream(mgr, "request_status"):
            with attaching(told):  # around_record_failure keeps it with the record it writes
                mgr.record_failure(room, reason)
            if row.mark:
                mgr.update_status(room, KVPoll.Failed)
        if row.tell is Tell.ABORT:
            receiver.ensure_abort_notified()
        elif row.tell is Tell.STATUS and tables:
            if targets is None:
                targets = upstream(mgr, "_room_notify_targets")(room)
            if told is not None:
                self.tell_cause(targets, room, told)
            upstream(mgr, "send_kv_status_message")(targets=targets, bootstrap_room=room, status=KVPoll.Failed,
                                                    failure_reason=reason)

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
        self.make(Transition.NOTE_CANCEL, room, with_why(CANCEL_REASON.format(peer=peer, room=room), why), told=told)
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


def side_of(mgr: Any) -> str:
    """`mgr`'s role, "prefill" or "decode" (a manager with room tables: upstream's `disaggregation_mode`)."""
    return str(upstream(upstream(mgr, "disaggregation_mode"), "value"))


def disowns_on_clear(sender: Any) -> bool:
    """Whether `sender`'s `clear` disowns its room (`on_sender_clear`): its class is one `fork_plugin.HOOKS` hooks
    `on_sender_clear` on (read from the hook table, as `handles_aborts` reads the swaps')."""
    return _disowns_on_clear(type(sender))


@functools.lru_cache(maxsize=64)
def _disowns_on_clear(cls: type) -> bool:
    from sglang.srt.managers.fork_core.fork_plugin import HOOKS

    classes = {f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__}
    return any(ref.endswith(":on_sender_clear") and ref.startswith(KV_HOOKS + ":")
               and target.rpartition(".")[0] in classes for target, ref, _ in HOOKS)


def failure_record(mgr: Any, room: int) -> Optional[str]:
    """`room`'s failure record now (upstream's table, under its failure lock), or None: room_agreement shares it
    with the other ranks (a manager whose ledger may not exist yet: read by manager, not through the ledger)."""
    with upstream(mgr, "failure_lock"):
        return upstream(mgr, "failure_records").get(room)


def write_failure(mgr: Any, room: int, reason: str, told: Optional[Told], *, replace: bool) -> bool:
    """Write `room`'s failure record `reason` with its cause `told` into upstream's table, under its failure lock,
    only while the room exists (a cleared room's record would reach the next request with that number): `replace`
    the one there (room_agreement: the reason every rank agreed on), else only if it has none (decode's ABORT handled
    before upstream's: the first record stays). Whether it wrote. Not through `record_failure`: its hook keeps a
    recorded reason over a new one (`verdict.kept_over`), right for a new failure, wrong for an agreed one; and
    neither marks the room (upstream's poll or handler does)."""
    ledger = ledger_of(mgr)
    with upstream(mgr, "failure_lock"):
        records = upstream(mgr, "failure_records")
        if room not in upstream(mgr, "request_status") or (not replace and room in records):
            return False
        records[room] = reason
        if ledger is not None:  # the cause the record came with, with it
            ledger.keep_told(room, told, reason)
    return True


def forget_failure(mgr: Any, room: int) -> None:
    """Drop `room`'s failure record (upstream's table, under its failure lock) and its cause: its request was
    retired."""
    if has_room_tables(mgr):
        ledger = ledger_of(mgr)
        with upstream(mgr, "failure_lock"):
            upstream(mgr, "failure_records").pop(room, None)
            if ledger is not None:
                ledger.keep_told(room, None)


def forget_failure_if_cleared(mgr: Any, room: int) -> None:
    """Decode: drop `room`'s failure record and its cause if the room is gone from upstream's `request_status`.
    `around_record_failure` checks the room before the write without the failure lock (as upstream's
    `apply_prefill_status` does), so the scheduler may clear the room in between (its receiver's `clear`, then
    `failure_exception`'s pop under the lock): a record written after that pop would stay for good, and a later
    request with that room number would read it as its own. Read under the lock after the write, any clear before
    that pop is seen here; a clear after the write is the room's end, which pops it (`failure_exception`, or
    `room_kv_hooks.after_receiver_clear` for a room concluded Success)."""
    ledger = ledger_of(mgr)
    with upstream(mgr, "failure_lock"):
        if room in upstream(mgr, "request_status"):
            return
        upstream(mgr, "failure_records").pop(room, None)
        if ledger is not None:
            ledger.keep_told(room, None)


# Decode's ledgers in this process (one per decode kv manager): a decode request's answer finds its room's cause here
# (upstream's decode Req holds no reference to its receiver or manager). Weak: a ledger goes with its manager.
DECODE_LEDGERS: "weakref.WeakSet[RoomLedger]" = weakref.WeakSet()


def ledger_of(mgr: Any) -> Optional[RoomLedger]:
    return getattr(mgr, "__dict__", {}).get(ATTR)


def ledger_for(mgr: Any) -> RoomLedger:
    """`mgr`'s ledger, made here if a hook-less manager has none."""
    return ledger_of(mgr) or mgr.__dict__.setdefault(ATTR, RoomLedger(mgr))


def end_room(mgr: Any, transition: Transition, room: Optional[int], reason: str, **data: Any) -> None:
    """`RoomLedger.make` on `mgr`'s ledger (made here if a hook-less manager has none): `room` ends along
    `transition`."""
    ledger_for(mgr).make(transition, room, reason, **data)


def drop_unowned_room(mgr: Any, room: int) -> None:
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
