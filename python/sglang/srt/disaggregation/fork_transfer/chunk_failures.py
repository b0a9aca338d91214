"""A failed chunk write fails that room on both sides, and only that room; a decode session is blacklisted only
once a probe shows it dead; a transfer worker that raises ends its rooms in flight and starts again.
Called by the transfer workers (patch lines) and hooks. docs/chunk-failures.md, docs/transfer-deadline.md.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import functools
import logging
import re
import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Set, Tuple

from sglang.srt.disaggregation.fork_ending import recovery_attempt, request_end_cause, verdict
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.fork_ending.engine_clock import engine_clock
from sglang.srt.disaggregation.fork_ending.room_ledger import end_room
from sglang.srt.disaggregation.fork_ending.room_transitions import Transition
from sglang.srt.disaggregation.fork_transfer import idle_pacing, worker_handoff
from sglang.srt.environ import envs
from sglang.srt.managers.fork_core import fork_touch, knobs
from sglang.srt.managers.fork_core.bounded import Cap, entry
from sglang.srt.managers.fork_core.rank_agreement import answers, attn_tp_rank

logger = logging.getLogger(__name__)

# The chunk kind a transfer failure reason names (upstream's wording: the verdict's), or None (abort, timeout...).
chunk_kind = verdict.failed_chunk_kind


class _Fault(NamedTuple):
    kind: str  # kv | aux | state
    rid: Optional[str]  # a rid prefix, or None
    room: Optional[int]  # a room number, or None
    mark_failed_first: bool  # the room is Failed locally before the write reports
    delay: float = 0.0  # > 0: the write succeeds, its transfer worker reports it this many seconds late
    rank: Optional[int] = None  # only on this attention TP rank (None: every rank)
    first_only: bool = False  # `+first`: only a request's first attempt (no recovery attempt's rid, recovery_attempt)


_FAULT = re.compile(r"(kv|aux|state)(\+failed|\+delay=(\d+(?:\.\d*)?))?(\+first)?(?:@(\d+))?:(?:rid=(.+)|room=(\d+))")


class FaultPlan:
    """`SGLANG_TEST_DISAGG_FAIL_CHUNKS`: a matching room's first write of a kind reports -1 once (or, `+delay=S`,
    holds its transfer worker S seconds); `@R` aims an entry at attention TP rank R alone. A `rid=` entry fires once
    per room, so on a recovery attempt's new room too; with `+first` it fires only on the request's first attempt
    (a rid that is no recovery attempt's, `recovery_attempt.is_first_attempt`)."""

    def __init__(self, faults: List[_Fault]):
        self.faults = faults
        self._rids: Dict[int, str] = {}  # room -> rid, for rooms a rid selector matches
        self._fired: Set[Tuple[int, int]] = set()  # (fault index, room)
        self._lock = threading.Lock()

    @classmethod
    def parse(cls, spec: str, rank: Optional[int] = None) -> Optional["FaultPlan"]:
        """The entries of `spec` for attention TP rank `rank` (None: every entry); None if there are none."""
        faults = []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            match = _FAULT.fullmatch(item)
            if match is None:
                raise ValueError(f"SGLANG_TEST_DISAGG_FAIL_CHUNKS: bad entry {item!r}; expected "
                                 "kind[+failed|+delay=S][+first][@RANK]:rid=PREFIX or ...:room=N, kind in kv/aux/state")
            kind, option, delay, first, on_rank, rid, room = match.groups()
            if first and rid is None:
                raise ValueError(f"SGLANG_TEST_DISAGG_FAIL_CHUNKS: bad entry {item!r}; +first needs rid=PREFIX "
                                 "(a room number is never a request's second attempt)")
            fault = _Fault(kind, rid, None if room is None else int(room), option == "+failed",
                           float(delay or 0.0), None if on_rank is None else int(on_rank), bool(first))
            if rank is None or fault.rank is None or fault.rank == rank:
                faults.append(fault)
        return cls(faults) if faults else None

    def bind(self, rid: str, room: int) -> None:
        if isinstance(rid, str) and any(f.rid is not None and rid.startswith(f.rid) for f in self.faults):
            with self._lock:
                self._rids[room] = rid

    def take(self, room: int, kind: str) -> Optional[_Fault]:
        with self._lock:
            rid = self._rids.get(room)
            for i, f in enumerate(self.faults):
                hit = f.room == room if f.rid is None else rid is not None and rid.startswith(f.rid) and (
                    not f.first_only or recovery_attempt.is_first_attempt(rid))
                if f.kind == kind and hit and (i, room) not in self._fired:
                    self._fired.add((i, room))
                    return f
        return None


def checked(mgr: Any, room: int, kind: str, rc: int) -> int:
    """The write's return code (-1 when the fault switch fails it); counts every failure."""
    plan = getattr(mgr, "fork_chunk_faults", None)
    if plan is not None and rc == 0:
        fault = plan.take(room, kind)
        if fault is not None and fault.delay > 0:  # a stalled transfer worker: the write is reported late
            logger.warning("Injected: the %s chunk write of room %s reported %gs late", kind, room, fault.delay)
            time.sleep(fault.delay)
        elif fault is not None:
            if fault.mark_failed_first:  # as a concurrent local abort would (the write tells decode)
                end_room(mgr, Transition.FAIL_UNTOLD, room,
                         f"room {room} failed locally during its {kind} write (injected)")
            logger.warning("Injected %s chunk write failure for room %s", kind, room)
            rc = -1
    if rc != 0:
        request_end_cause.inc("chunk_failure", request_end_cause.labels_of(mgr), kind=kind, role="prefill")
        logger.warning("The %s chunk write of room %s failed (rc=%s); failing the room", kind, room, rc)
    return rc


def ended_before_state(mgr: Any, room: int, state_rc: int) -> bool:
    """The last chunk's state write done (its code from `checked`): whether the worker stops there without concluding,
    as upstream does for a room already Failed (an ABORT during the send marks it Failed too). A failed state write
    is never skipped so: it always concludes, so decode hears of it (the patched line's one call)."""
    return state_rc == 0 and fork_touch.upstream(mgr, "request_status").get(room, KVPoll.Failed) == KVPoll.Failed


def conclude_failure(mgr: Any, req: Any, *, bootstrap_room: int, failure_reason: str) -> None:
    """The worker's `conclude_failure` after a failed KV or state write of `req`."""
    conclude_transfer(mgr, bootstrap_room=bootstrap_room, status=KVPoll.Failed, failure_reason=failure_reason,
                      fallback_targets=[(req.endpoint, req.dst_port)])


def conclude_transfer(mgr: Any, *, bootstrap_room: int, status: int, targets: Optional[List[Tuple[str, int]]] = None,
                      failure_reason: Optional[str] = None,
                      fallback_targets: Optional[List[Tuple[str, int]]] = None) -> Optional[int]:
    """Upstream's `conclude_transfer`; a failure of a room cleared meanwhile still reaches its targets; then the
    scheduler's paced idle wait ends (idle_pacing.wake_scheduler), so it sees the room's status at once."""
    emitted = mgr.conclude_transfer(
        bootstrap_room=bootstrap_room, status=status, targets=targets, failure_reason=failure_reason
    )
    if emitted is None and status == KVPoll.Failed:
        to = targets or fallback_targets or []
        logger.warning("Room %s was already concluded on prefill; telling decode %s of its failed write", bootstrap_room, to)
        end_room(mgr, Transition.FAIL_AND_TELL, bootstrap_room,
                 f"{failure_reason} (room already failed on prefill)", targets=to)
    idle_pacing.wake_scheduler(mgr)
    return emitted


# Rooms whose poison mark waits for its expiry, per manager.
MAX_POISON_EXPIRIES = Cap(65536, "a failed write in each room; more within decode's release deadline (30 s) is a "
                                 "flood, whose oldest marks go early: their drain ACK is no longer refused, and "
                                 "decode's deadline releases those pages anyway")
POISON_ATTR = "fork_poison_expiry"


class PoisonExpiry:
    """A failed write's poison mark (upstream's `_deferred_ack_poisoned_rooms`, which refuses the room's drain ACK)
    goes once decode's release deadline passed on the engine clock: `note` (a transfer worker, at the failed write),
    `expire` (the scheduler thread, each bootstrap-queue pass: `before_pop_bootstrapped`). `until` (room -> its
    expiry, in order of expiry: one deadline for all) is guarded by `lock`, a leaf; upstream's set is changed outside
    it (a set operation)."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.until: "collections.OrderedDict[int, float]" = collections.OrderedDict()

    def note(self, room: int) -> List[int]:
        """`room` was just poison-marked; the rooms whose marks go now to keep the cap."""
        with self.lock:
            self.until.pop(room, None)
            self.until[room] = engine_clock.now() + self.delay_s
            return [self.until.popitem(last=False)[0] for _ in range(len(self.until) - MAX_POISON_EXPIRIES)]

    def due(self, marked: Any) -> List[int]:
        """The rooms whose marks go now; a room no longer `marked` (its mark went another way: the peer monitor
        dropped its decode session) is forgotten."""
        now = engine_clock.now()
        out = []
        with self.lock:
            while self.until and next(iter(self.until.values())) <= now:
                out.append(self.until.popitem(last=False)[0])
            for room in [r for r in self.until if r not in marked]:
                del self.until[room]
        return out


def after_poison(result: Any, mgr: Any, room: int, *args: Any, **kwargs: Any) -> None:
    """AFTER CommonKVManager.poison_deferred_ack_room (a transfer worker: a failed write, or the worker's own crash):
    the mark, now set, is dropped once decode's release deadline passed (`PoisonExpiry`). Noted after upstream's mark,
    never before: a bootstrap-queue pass in between would find an unmarked room and forget its expiry (the mark
    then stayed for the server's life; seen under load)."""
    if not fork_touch.upstream(mgr, "enable_deferred_decode_kv_release"):
        return
    expiry = mgr.__dict__.get(POISON_ATTR)
    if expiry is None:  # the first failed write (a transfer worker; a race makes two, one is kept)
        delay = envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get()
        expiry = mgr.__dict__.setdefault(POISON_ATTR, PoisonExpiry(delay))
    early = expiry.note(room)
    if early:
        logger.warning("%d poison marks dropped before their expiry (more than %d pending)", len(early),
                       MAX_POISON_EXPIRIES)
    _discard_poison(mgr, early)


def _discard_poison(mgr: Any, rooms: List[int]) -> None:
    poisoned = fork_touch.upstream(mgr, "_deferred_ack_poisoned_rooms")
    for room in rooms:
        poisoned.discard(room)


def expire_poison(queue: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE PrefillBootstrapQueue.pop_bootstrapped (scheduler thread, every loop pass): the poison marks due."""
    expiry = getattr(queue.kv_manager, "__dict__", {}).get(POISON_ATTR)
    if expiry is not None and expiry.until:
        marked = fork_touch.upstream(queue.kv_manager, "_deferred_ack_poisoned_rooms")
        _discard_poison(queue.kv_manager, expiry.due(marked))


def poison_table(mgr: Any) -> Dict[str, Any]:
    """The resource report's view of the pending poison expiries (`fork_tables`)."""
    expiry = getattr(mgr, "__dict__", {}).get(POISON_ATTR)
    return entry(0 if expiry is None else len(expiry.until), MAX_POISON_EXPIRIES,
                 "rooms whose failed write's poison mark waits for decode's release deadline (engine clock)")


# A session is let back in only once a read from it completes (docs/chunk-failures.md).
RECONNECT_COOLDOWN_S = 1.0  # mooncake's kReconnectRoundCooldown
READ_ATTEMPTS = 2
READ_BYTES = 8


MOONCAKE_ENGINE = "sglang.srt.distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine"


def probe_session(mgr: Any, send_probe: Any, session_id: str) -> int:
    """0 only when the peer answers mooncake's probe and a read of its KV memory completes."""
    rc = send_probe(session_id)
    if rc != 0:
        return rc
    with mgr.session_lock:
        info = mgr.decode_kv_args_table.get(session_id)
    peer_ptrs = [p for p in (() if info is None else fork_touch.upstream(info, "dst_kv_ptrs") or ()) if p]
    if not peer_ptrs:
        return rc
    engine = fork_touch.upstream_on(mgr.engine, "engine", MOONCAKE_ENGINE, default=mgr.engine)  # the raw one reads
    for attempt in range(READ_ATTEMPTS):
        if attempt:
            time.sleep(RECONNECT_COOLDOWN_S + 0.2)  # the transport's cooldown, then a new round
        rc = engine.transfer_sync_read(session_id, ctypes.addressof(mgr.fork_probe_scratch), peer_ptrs[0], READ_BYTES)
        if rc == 0:
            if attempt:
                logger.warning("Session %s: a read failed once after it answered a probe (its data connections "
                               "had been dropped); the next one completed", session_id)
            return 0
    logger.warning("Session %s answers a probe but a read of its memory fails (rc=%s)", session_id, rc)
    return rc


# Bounds a probe of a frozen peer (mooncake's own timeouts: 60 s handshake, 30 s read); default 5 s.
PROBE_TIMEOUT_ENV = knobs.SESSION_PROBE_TIMEOUT.name


def bounded_probe(mgr: Any, send_probe: Any, timeout: float) -> Callable[..., int]:
    """The manager's `_send_probe`: `probe_session` on its own thread (one per session), awaited at most `timeout` s.
    A caller joins the probe already running for the session, unless that one started before `since` (a probe
    started while the link was cut stays in the transport's connect retries after the heal: held_decodes asks
    for one started once the peer answered again)."""
    lock, running = threading.Lock(), {}  # session -> (started, future)

    def run(session_id: str, entry: tuple) -> None:
        rc = -1
        try:
            rc = probe_session(mgr, send_probe, session_id)
        except Exception:
            logger.exception("Session %s: the probe raised; counted as no answer", session_id)
        finally:
            with lock:
                if running.get(session_id) is entry:
                    del running[session_id]
            entry[1].set_result(rc)

    def probe(session_id: str, since: float = float("-inf")) -> int:
        with lock:
            entry = running.get(session_id)
            if entry is None or entry[0] < since:
                entry = running[session_id] = (time.monotonic(), concurrent.futures.Future())
                threading.Thread(target=run, args=(session_id, entry), name="ForkSessionProbeIO", daemon=True).start()
        try:
            return entry[1].result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            logger.warning("Session %s: no answer to a probe within %gs (%s)", session_id, timeout, PROBE_TIMEOUT_ENV)
            return -1

    return probe


class SessionBlacklist(set):
    """Upstream's `failed_sessions`: `add()` nominates; a probe thread puts a dead session in."""

    def __init__(self, mgr: Any):
        super().__init__()
        self._mgr = mgr
        self._probing: Set[str] = set()

    def add(self, session_id: str) -> None:  # caller holds mgr.session_lock
        if session_id in self or session_id in self._probing:
            return
        self._probing.add(session_id)
        threading.Thread(target=self._confirm, args=(session_id,), name="ForkSessionProbe", daemon=True).start()

    def _confirm(self, session_id: str) -> None:
        rc = self._mgr._send_probe(session_id)
        with self._mgr.session_lock:
            self._probing.discard(session_id)
            if rc != 0:
                set.add(self, session_id)
            else:
                self._mgr.session_failures.pop(session_id, None)
        if rc != 0:
            logger.error("Session %s does not answer a probe (rc=%s): taken out until it does", session_id, rc)
        else:
            logger.warning("Session %s answers a probe after a failed write: kept; only that room failed", session_id)

    def settled(self) -> bool:
        """No probe in flight (tests wait on this)."""
        return not self._probing


def on_prefill_manager_init(mgr: Any, queue: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER PrefillBootstrapQueue._init_kv_manager: the scheduler's metric labels (its transfer workers count
    failed writes with them), the fault switch, the probing blacklist."""
    request_end_cause.bind_labels(mgr, fork_touch.upstream(queue, "scheduler"))
    mgr.fork_chunk_faults = FaultPlan.parse(envs.SGLANG_TEST_DISAGG_FAIL_CHUNKS.get() or "", attn_tp_rank())

    def probing(failed_sessions):
        assert not failed_sessions, "session blacklist swapped after first use"
        return SessionBlacklist(mgr)

    with fork_touch.upstream_on(mgr, "session_lock", fork_touch.MOONCAKE_MANAGER, default=contextlib.nullcontext()):
        swapped = fork_touch.swap(mgr, "failed_sessions", probing, by=__name__)
    if swapped is not None:
        timeout = knobs.SESSION_PROBE_TIMEOUT.get()
        scratch = mgr.fork_probe_scratch = ctypes.create_string_buffer(READ_BYTES)
        mgr.engine.register(ctypes.addressof(scratch), READ_BYTES)  # kept for the manager's life
        fork_touch.swap(mgr, "_send_probe", lambda send_probe: bounded_probe(mgr, send_probe, timeout), by=__name__)


def on_prefill_add(result: Any, queue: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `PrefillBootstrapQueue.add`: bind rid-selected faults to the room."""
    plan = getattr(fork_touch.upstream(queue, "kv_manager"), "fork_chunk_faults", None)  # the fork's own attribute
    if plan is not None and req.bootstrap_room is not None:
        plan.bind(req.rid, req.bootstrap_room)


def on_decode_transfer_failure(result: Any, queue: Any, failure_reason: str, *args: Any, **kwargs: Any) -> None:
    """AFTER `DecodeTransferQueue._record_transfer_failure`: count by chunk kind, once (the answering rank: every
    rank has the reason, rank_agreement.share_failures)."""
    kind = chunk_kind(failure_reason)
    if kind is not None and answers():
        labels = request_end_cause.scheduler_labels(fork_touch.upstream(queue, "scheduler"))
        request_end_cause.inc("chunk_failure", labels, kind=kind, role="decode")


def on_sender_clear(result: Any, sender: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `CommonKVSender.clear`: drop the zero in-flight count a failed non-last chunk left."""
    mgr, room = sender.kv_mgr, sender.bootstrap_room  # a CommonKVManager: it has _staging_outstanding
    if room not in mgr.request_status and mgr._staging_outstanding.get(room) == 0:
        mgr._staging_outstanding.pop(room, None)


def _rooms_in_flight(kv_mgr: Any, queue: Any) -> List[int]:
    """Rooms with a chunk in flight on `queue`'s worker (sharded as add_transfer_request does)."""
    queues = kv_mgr.transfer_queues
    shard = next(i for i, q in enumerate(queues) if q is queue)

    def shard_of(room: int) -> Optional[int]:
        sessions = list(kv_mgr.transfer_infos.get(room) or ())
        return sum(int(s.rsplit(":", 1)[1]) for s in sessions) % len(queues) if sessions else None

    return [room for room, count in list(kv_mgr._staging_outstanding.items()) if count > 0 and shard_of(room) == shard]


def _guarded(original: Any) -> Any:
    """Upstream's transfer worker loop, run again after it raised; its rooms in flight end (500, decode told). The loop
    takes its chunks through worker_handoff's watched queue (the scheduler's hand-off)."""

    @functools.wraps(original)
    def transfer_worker(kv_mgr: Any, queue: Any, *args: Any, **kwargs: Any) -> Any:
        while True:
            try:
                return original(kv_mgr, worker_handoff.watched(kv_mgr, queue), *args, **kwargs)
            except Exception as exc:
                if fork_touch.upstream(kv_mgr, "_stopped"):
                    raise
                for room in _rooms_in_flight(kv_mgr, queue):
                    reason = f"KV transfer worker raised while sending room {room}: {exc!r}; restarted"
                    logger.error(reason)
                    if kv_mgr.request_status.get(room) not in (None, KVPoll.Success):
                        end_room(kv_mgr, Transition.FAIL_AND_TELL, room, reason)
                    kv_mgr._staging_outstanding.pop(room, None)

    transfer_worker.fork_guarded = True
    return transfer_worker


def guard_transfer_worker(*args: Any, **kwargs: Any) -> None:
    """BEFORE PrefillBootstrapQueue._init_kv_manager: MooncakeKVManager.transfer_worker patched (SWAPS), once."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    if not getattr(fork_touch.upstream(MooncakeKVManager, "transfer_worker"), "fork_guarded", False):
        fork_touch.swap(MooncakeKVManager, "transfer_worker", _guarded, by=__name__, kind="class")
