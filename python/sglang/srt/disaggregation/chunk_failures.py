"""A failed chunk write fails that room on both sides, and only that room.

Invariant: when a mooncake write of a room's KV chunk, its aux (metadata) chunk or its
extra-state chunk fails, prefill marks the room Failed and tells decode (the transfer
worker's `conclude_failure`, which also speaks for a room already Failed locally);
decode then ends the request with a 5xx naming the failure and frees its KV. The peer's
session is taken out only once a probe shows it dead (`SessionBlacklist`), and the
upstream probe loop brings it back when it answers again -- a probe here being an answer
to mooncake's probe and a completed read of the peer's memory (`probe_session`).

Who calls: the mooncake transfer worker passes every write's return code through
`checked()` and concludes a failed write through `conclude_failure` /
`conclude_transfer` here (one patch line each); `fork_plugin` hooks `on_prefill_manager_init`,
`on_prefill_add` and `on_decode_transfer_failure`. `checked()` is also where the
test-only fault switch `SGLANG_TEST_DISAGG_FAIL_CHUNKS` acts; unset, it costs one
attribute read per write.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.room_ledger import end_room
from sglang.srt.environ import envs
from sglang.srt.managers import fork_touch

logger = logging.getLogger(__name__)

KINDS = ("kv", "aux", "state")



def _chunk_failures_counter():
    """Next to upstream's per-request `sglang:num_transfer_failed_reqs_total`: failed
    chunk writes by kind, on prefill (where the write failed) and on decode (where a
    room failed because of it); declared in `fork_metrics`."""
    from sglang.srt.disaggregation import fork_metrics

    return fork_metrics.counter("chunk_failure", {})


# How upstream's transfer worker words each failure (mooncake/conn.py): decode receives
# the reason with the Failed status and classifies by it.
_REASON_PREFIX = {
    "kv": "Failed to send kv chunk",
    "aux": "Failed to send aux data",
    "state": "Failed to send state components",
}


def chunk_kind(failure_reason: Optional[str]) -> Optional[str]:
    """The chunk kind a transfer failure reason names, or None (abort, timeout...)."""
    for kind, prefix in _REASON_PREFIX.items():
        if failure_reason and prefix in failure_reason:
            return kind
    return None


def chunk_failure_counts() -> Dict[Tuple[str, str], float]:
    """(kind, role) -> count, for tests and the resource report."""
    out: Dict[Tuple[str, str], float] = {}
    for metric in _chunk_failures_counter().collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                out[(sample.labels["kind"], sample.labels["role"])] = sample.value
    return out


# ---------------------------------------------------------------------------
# Test-only fault switch
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Fault:
    kind: str  # kv | aux | state
    selector: str  # rid | room
    value: str  # rid prefix, or the room number
    mark_failed_first: bool  # the room is Failed locally before the write reports
    fired: Set[int] = dataclasses.field(default_factory=set)


class FaultPlan:
    """`SGLANG_TEST_DISAGG_FAIL_CHUNKS`: comma-separated `kind[+failed]:rid=PREFIX` or
    `kind[+failed]:room=N`, kind in kv/aux/state. Each matching room fails its first
    write of that kind once (reported by the engine as rc -1; the write itself ran).
    `+failed` first marks the room Failed locally, as a concurrent local abort would.
    Rids are matched when prefill admits a request (`bind`), since the transfer worker
    only knows rooms; that is how an e2e test picks one request among many."""

    def __init__(self, faults: List[_Fault]):
        self.faults = faults
        self._rooms: Dict[int, List[_Fault]] = {}
        self._lock = threading.Lock()
        for f in faults:
            if f.selector == "room":
                self._rooms.setdefault(int(f.value), []).append(f)

    @classmethod
    def parse(cls, spec: str) -> Optional["FaultPlan"]:
        faults = []
        for item in (s.strip() for s in spec.split(",")):
            if not item:
                continue
            head, _, sel = item.partition(":")
            kind, _, flag = head.partition("+")
            selector, _, value = sel.partition("=")
            if (
                kind not in KINDS
                or flag not in ("", "failed")
                or selector not in ("rid", "room")
                or not value
                or (selector == "room" and not value.isdigit())
            ):
                raise ValueError(
                    f"SGLANG_TEST_DISAGG_FAIL_CHUNKS: bad entry {item!r}; expected "
                    "kind[+failed]:rid=PREFIX or kind[+failed]:room=N, kind in kv/aux/state"
                )
            faults.append(_Fault(kind, selector, value, flag == "failed"))
        return cls(faults) if faults else None

    def bind(self, rid: str, room: int) -> None:
        for f in self.faults:
            if f.selector == "rid" and isinstance(rid, str) and rid.startswith(f.value):
                with self._lock:
                    self._rooms.setdefault(room, []).append(f)

    def take(self, room: int, kind: str) -> Optional[_Fault]:
        with self._lock:
            for f in self._rooms.get(room, ()):
                if f.kind == kind and room not in f.fired:
                    f.fired.add(room)
                    return f
        return None


# ---------------------------------------------------------------------------
# The transfer worker's write results
# ---------------------------------------------------------------------------


def checked(mgr: Any, room: int, kind: str, rc: int) -> int:
    """The write's return code as the worker should act on it: the engine's, or -1
    when the fault switch fails this room's `kind` write. Counts every failure."""
    plan = getattr(mgr, "fork_chunk_faults", None)
    if plan is not None and rc == 0:
        fault = plan.take(room, kind)
        if fault is not None:
            if fault.mark_failed_first:  # as a concurrent local abort would (the write tells decode)
                end_room(mgr, room, None, f"room {room} failed locally during its {kind} write (injected)", tell=False)
            logger.warning("Injected %s chunk write failure for room %s", kind, room)
            rc = -1
    if rc != 0:
        _chunk_failures_counter().labels(kind=kind, role="prefill").inc()
        logger.warning("The %s chunk write of room %s failed (rc=%s); failing the room", kind, room, rc)
        _expire_poison_later(mgr, room)
    return rc


def conclude_failure(mgr: Any, req: Any, *, bootstrap_room: int, failure_reason: str) -> None:
    """The worker's `conclude_failure` after a failed KV or state write of `req`."""
    conclude_transfer(
        mgr,
        bootstrap_room=bootstrap_room,
        status=KVPoll.Failed,
        targets=None,
        failure_reason=failure_reason,
        fallback_targets=[(req.endpoint, req.dst_port)],
    )


def conclude_transfer(
    mgr: Any,
    *,
    bootstrap_room: int,
    status: int,
    targets: Optional[List[Tuple[str, int]]] = None,
    failure_reason: Optional[str] = None,
    fallback_targets: Optional[List[Tuple[str, int]]] = None,
) -> Optional[int]:
    """Upstream's `conclude_transfer`, which says nothing when the room is already gone
    from `request_status`: the scheduler cleared it after it went Failed locally (a
    local abort) while this write was failing. Decode still waits for that room, so a
    failure is then sent to the write's own targets."""
    emitted = mgr.conclude_transfer(
        bootstrap_room=bootstrap_room, status=status, targets=targets, failure_reason=failure_reason
    )
    if emitted is None and status == KVPoll.Failed:
        to = targets or fallback_targets or []
        logger.warning("Room %s was already concluded on prefill; telling decode %s of its failed write", bootstrap_room, to)
        end_room(mgr, bootstrap_room, None, f"{failure_reason} (room already failed on prefill)", targets=to)
    return emitted


def _expire_poison_later(mgr: Any, room: int) -> None:
    """The worker poisons a room whose write failed (`_poison_unsettled_send`): no
    drain ack may free decode's pages while the write might still land, so decode
    waits out its release deadline instead. Past that deadline decode has freed them
    and the mark protects nothing; upstream keeps it until the room number is reused,
    i.e. forever. Drop it then."""
    if not getattr(mgr, "enable_deferred_decode_kv_release", False):
        return
    delay = envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get()
    timer = threading.Timer(delay, mgr._deferred_ack_poisoned_rooms.discard, args=(room,))
    timer.daemon = True
    timer.start()


# ---------------------------------------------------------------------------
# Session blacklist: only a peer shown dead is taken out, and it is let back in
# only once a transfer to it completes
# ---------------------------------------------------------------------------

# mooncake's TCP transport drops its connections to a peer whose transfer made no
# progress for 30 s (MC_TCP_PROGRESS_TIMEOUT_SEC: a frozen or stalled decode). The first
# transfer submitted to that peer afterwards fails at once, without a connect attempt
# (the dropped connections count as tried in the transport's current connect round, so
# it fails the queued work and starts its 1 s reconnect cooldown); the next one, after
# the cooldown, reconnects. A probe (mooncake's handshake port, not the data path) does
# not see this: a session let back in on a probe alone lost its first request to it.
RECONNECT_COOLDOWN_S = 1.0  # mooncake's kReconnectRoundCooldown
READ_ATTEMPTS = 2
READ_BYTES = 8


def probe_session(mgr: Any, send_probe: Any, session_id: str) -> int:
    """What the manager's `_send_probe` does (bounded by `SessionProbe`; called by
    upstream's failed-session probe loop, `SessionBlacklist` and peer_liveness for a
    decode held out as lost): 0 only when the peer answers mooncake's probe and then a read
    of READ_BYTES of its registered KV memory completes -- a READ, nothing of the
    peer's changes -- within READ_ATTEMPTS tries a reconnect cooldown apart. The read
    goes through the transport's data connections, so a session let back in has them
    open again; a first read that fails is the one the transport fails after dropping
    its connections. A peer with no registration to read answers on the probe alone."""
    rc = send_probe(session_id)
    if rc != 0:
        return rc
    with mgr.session_lock:
        info = mgr.decode_kv_args_table.get(session_id)
    peer_ptrs = [p for p in (getattr(info, "dst_kv_ptrs", None) or []) if p]
    scratch = getattr(mgr, "fork_probe_scratch", None)
    if not peer_ptrs or scratch is None:
        return rc
    engine = getattr(mgr.engine, "engine", mgr.engine)
    for attempt in range(READ_ATTEMPTS):
        if attempt:
            time.sleep(RECONNECT_COOLDOWN_S + 0.2)  # the transport's cooldown, then a new round
        rc = engine.transfer_sync_read(session_id, ctypes.addressof(scratch), peer_ptrs[0], READ_BYTES)
        if rc == 0:
            if attempt:
                logger.warning("Session %s: a read failed once after it answered a probe (its data connections "
                               "had been dropped); the next one completed", session_id)
            return 0
    logger.warning("Session %s answers a probe but a read of its memory fails (rc=%s)", session_id, rc)
    return rc


# A probe of a frozen peer would block for mooncake's own timeouts: `send_probe` waits
# for the handshake answer up to its socket's 60 s receive timeout (a stopped process's
# kernel still accepts the connection; nobody reads it), a read up to MC_TRANSFER_TIMEOUT
# (30 s). Seen: ~155 s before a frozen decode's session was taken out.
PROBE_TIMEOUT_ENV = "SGLANG_FORK_SESSION_PROBE_TIMEOUT"
PROBE_TIMEOUT_DEFAULT = 5.0
PROBE_TIMEOUT_ACCEPTED = "a finite number of seconds > 0 (e.g. 5)"


def probe_timeout() -> float:
    """`SGLANG_FORK_SESSION_PROBE_TIMEOUT` in seconds (default 5); ValueError naming
    the knob when it is not valid (checked when prefill's kv manager starts)."""
    from sglang.srt.disaggregation.transfer_deadline_knob import positive_seconds

    value = os.environ.get(PROBE_TIMEOUT_ENV)
    if value is None:
        return PROBE_TIMEOUT_DEFAULT
    return positive_seconds(value, PROBE_TIMEOUT_ENV, "valid", PROBE_TIMEOUT_ACCEPTED)


class SessionProbe:
    """The manager's `_send_probe`: `probe_session` run in a thread of its own and
    waited for at most `timeout` seconds (no answer in time: -1, the peer does not
    answer). One probe per session at a time: a caller arriving while one runs waits
    for that one (its answer is as fresh), so a frozen peer holds at most one thread
    per session, for mooncake's own timeouts."""

    def __init__(self, mgr: Any, send_probe: Any, timeout: float):
        self.mgr = mgr
        self.send_probe = send_probe
        self.timeout = timeout
        self._lock = threading.Lock()
        self._running: Dict[str, concurrent.futures.Future] = {}

    def __call__(self, session_id: str) -> int:
        with self._lock:
            future = self._running.get(session_id)
            if future is None:
                future = self._running[session_id] = concurrent.futures.Future()
                threading.Thread(target=self._run, args=(session_id, future), name="ForkSessionProbeIO",
                                 daemon=True).start()
        try:
            return future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            logger.warning("Session %s: no answer to a probe within %gs (%s)", session_id, self.timeout,
                           PROBE_TIMEOUT_ENV)
            return -1

    def _run(self, session_id: str, future: concurrent.futures.Future) -> None:
        rc = -1
        try:
            rc = probe_session(self.mgr, self.send_probe, session_id)
        except Exception:
            logger.exception("Session %s: the probe raised; counted as no answer", session_id)
        finally:
            with self._lock:
                self._running.pop(session_id, None)
            future.set_result(rc)

    def running(self) -> int:
        with self._lock:
            return len(self._running)


def _install_probe(mgr: Any) -> None:
    """Give the manager a bounded `probe_session` as its `_send_probe` and the scratch
    buffer the reads land in (registered with the engine once, kept for the manager's
    life)."""
    timeout = probe_timeout()
    scratch = ctypes.create_string_buffer(READ_BYTES)
    mgr.engine.register(ctypes.addressof(scratch), READ_BYTES)
    mgr.fork_probe_scratch = scratch
    fork_touch.swap(mgr, "_send_probe", lambda send_probe: SessionProbe(mgr, send_probe, timeout), by=__name__)


class SessionBlacklist(set):
    """Upstream's `failed_sessions`, which its transfer worker fills on the first failed
    write (one strike takes a decode session out for every request). Here `add()` only
    nominates: a probe thread asks the engine (`send_probe`) and the session goes in
    only if the peer does not answer. Upstream's failed-session probe loop takes it out
    again once it answers (`discard`). Reads (`in`, iteration) are plain set reads."""

    def __init__(self, mgr: Any):
        super().__init__()
        self._mgr = mgr
        self._probing: Set[str] = set()

    def add(self, session_id: str) -> None:  # caller holds mgr.session_lock
        if session_id in self or session_id in self._probing:
            return
        self._probing.add(session_id)
        threading.Thread(
            target=self._confirm, args=(session_id,), name="ForkSessionProbe", daemon=True
        ).start()

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


# ---------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------


def on_prefill_manager_init(mgr: Any, queue: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `PrefillBootstrapQueue._init_kv_manager` (result: the manager): validate
    and attach the fault switch, and give a mooncake manager the probing blacklist and
    `probe_session` (no request has been sent yet). Hooked here rather than on `MooncakeKVManager`, whose
    module must not be imported when plugins load (it creates prometheus metrics)."""
    mgr.fork_chunk_faults = FaultPlan.parse(envs.SGLANG_TEST_DISAGG_FAIL_CHUNKS.get() or "")
    def probing(failed_sessions):
        assert not failed_sessions, "session blacklist swapped after first use"
        return SessionBlacklist(mgr)

    with getattr(mgr, "session_lock", contextlib.nullcontext()):  # mooncake's (prefill)
        swapped = fork_touch.swap(mgr, "failed_sessions", probing, by=__name__)
    if swapped is not None:
        _install_probe(mgr)
    return None


def on_prefill_add(result: Any, queue: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `PrefillBootstrapQueue.add`: bind rid-selected faults to the room."""
    plan = getattr(getattr(queue, "kv_manager", None), "fork_chunk_faults", None)
    if plan is not None and req.bootstrap_room is not None:
        plan.bind(req.rid, req.bootstrap_room)
    return None


def on_decode_transfer_failure(result: Any, queue: Any, failure_reason: str, *args: Any, **kwargs: Any) -> None:
    """AFTER `DecodeTransferQueue._record_transfer_failure`: count by chunk kind."""
    kind = chunk_kind(failure_reason)
    if kind is not None:
        _chunk_failures_counter().labels(kind=kind, role="decode").inc()
    return None


def on_sender_clear(result: Any, sender: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `CommonKVSender.clear`: drop the room's zero in-flight count. After a
    failed write of a non-last KV chunk the worker keeps the room's
    `_staging_outstanding` entry for the chunks still to come, but none comes:
    `add_transfer_request` drops chunks of a Failed room, so the entry (0) stayed
    forever. Zero and cleared means nothing of this room is in flight; a chunk still
    queued re-creates the entry at dequeue and the worker's skip path removes it."""
    mgr = sender.kv_mgr
    room = sender.bootstrap_room
    outstanding = getattr(mgr, "_staging_outstanding", None)
    if outstanding is not None and room not in mgr.request_status and outstanding.get(room) == 0:
        outstanding.pop(room, None)
    return None
