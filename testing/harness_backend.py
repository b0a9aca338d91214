"""The queue harness's transfer backend: upstream's `fake` one, scripted per room.

`Faults` says, per bootstrap room, what the sender/receiver polls, which chunk write
fails, what raises; `FaultyKVManager` / `FaultySender` / `FaultyReceiver` wrap the fake
backend's classes so each call is recorded (`Call`) and each message the real backend
would put on the wire is kept (`Notice`). Installed while a harness lives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

import sglang.srt.disaggregation.fake as fake_backend
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.common.conn import KVTransferError
from sglang.srt.disaggregation.fake import FakeKVManager, FakeKVReceiver, FakeKVSender

POLL_NAMES = {v: k for k, v in vars(KVPoll).items() if isinstance(v, int)}


def poll_name(state: Optional[int]) -> str:
    return "None" if state is None else POLL_NAMES.get(int(state), str(state))


@dataclasses.dataclass(frozen=True)
class Call:
    side: str  # "prefill" (sender) or "decode" (receiver)
    room: int
    name: str  # init, send, send_metadata, abort, clear, failure_exception
    detail: Dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Notice:
    """A message the real backend would put on the wire to the other side."""

    room: int
    to: str  # "decode" or "prefill"
    status: int  # KVPoll value the peer is told
    reason: Optional[str]


CHUNK_KINDS = ("kv", "last", "state", "any")


class Faults:
    """The script for every bootstrap room of one harness, and the record of what happened.

    Script: `set(room, state)` makes `poll()` answer `state` (Failed is terminal, like a
    real conclude; other states hold until `release(room)`); `hold_transfer(room)` keeps
    a sent room at Transferring until `release(room)` (never released: a transfer worker
    that died); `raise_on_send(room)` makes the next `send()` / `send_metadata()` raise
    in the scheduler's thread; `fail_chunk(room, kind)` (prefill) makes the send of that
    chunk kind ("kv" = a non-last chunk, "last" = the last chunk's KV, "state" = the
    extra-state part that rides with the last chunk, "any") fail the room the way a
    transfer worker does: Failed, reason recorded, decode told unless
    `notify_peer=False`.
    Record: `calls`, `notices` (what the peer would receive), `endpoints` (the
    sender/receiver per room), `state(room)` (as the queues last polled it).
    `paired = True` (set before the first request): a prefill sender stays
    Bootstrapping until decode's handshake for its room is in the manager's
    `transfer_infos` (put there by whoever plays the wire, e.g. testing/lifecycle_model.py),
    as on a real backend, where the handshake may land before the request does.
    """

    paired = False

    def __init__(self) -> None:
        self._forced: Dict[int, int] = {}
        self._held: set = set()
        self._raise_on_send: Dict[int, BaseException] = {}
        self._chunk_faults: Dict[int, Tuple[str, str, bool]] = {}
        self.calls: List[Call] = []
        self.notices: List[Notice] = []
        self.endpoints: Dict[int, Any] = {}
        self.last_poll: Dict[int, int] = {}

    # -- script --
    def set(self, room: int, state: int) -> None:
        self._forced[room] = int(state)

    def hold_transfer(self, room: int) -> None:
        """Let the room bootstrap and send normally, but report Transferring instead of
        Success until `release(room)`: a transfer that is slow or stuck on the wire."""
        self._held.add(room)

    def release(self, room: int) -> None:
        """Drop `set` / `hold_transfer`: the room follows the fake backend again."""
        self._forced.pop(room, None)
        self._held.discard(room)

    def raise_on_send(self, room: int, exc: Optional[BaseException] = None) -> None:
        self._raise_on_send[room] = exc or RuntimeError(f"injected send error room={room}")

    def fail_chunk(
        self,
        room: int,
        kind: str = "last",
        reason: Optional[str] = None,
        notify_peer: bool = True,
    ) -> None:
        assert kind in CHUNK_KINDS, kind
        self._chunk_faults[room] = (kind, reason or f"injected {kind} chunk failure", notify_peer)

    # -- record --
    def calls_for(self, room: int, name: Optional[str] = None) -> List[Call]:
        return [c for c in self.calls if c.room == room and (name is None or c.name == name)]

    def notices_for(self, room: int) -> List[Notice]:
        return [n for n in self.notices if n.room == room]

    def state(self, room: int) -> Optional[int]:
        """The room's state as the queues last polled it (None if never polled)."""
        return self.last_poll.get(room)

    # -- used by the endpoints --
    def _record(self, side: str, room: int, name: str, **detail: Any) -> None:
        self.calls.append(Call(side, room, name, detail))

    def _notify(self, room: int, to: str, status: int, reason: Optional[str]) -> None:
        self.notices.append(Notice(room, to, int(status), reason))


class FaultyKVManager(FakeKVManager):
    """Upstream's fake manager plus the per-room bookkeeping of `CommonKVManager`.

    `request_status` / `failure_records` follow Common's semantics (set on creation and
    status changes, popped by the endpoint's `clear()`), so a leaked room shows up the
    same way it would on mooncake. `update_status`, `record_failure`, `conclude_failure`
    and `send_kv_status_message` have Common's names, so code written against the real
    manager can run here; the last two record a `Notice` to decode.
    """

    faults: Faults  # attached by the harness right after the queue builds the manager

    def __init__(self, args, disaggregation_mode, *rest, **kwargs):
        super().__init__(args, disaggregation_mode, *rest, **kwargs)
        self.disaggregation_mode = disaggregation_mode  # as Common keeps it
        self.request_status: Dict[int, int] = {}
        self.failure_records: Dict[int, str] = {}
        self.failure_lock = threading.Lock()
        # decode's handshakes by room (Common's name), used when `faults.paired`: a room's entry may come
        # before its sender; the sender's clear() pops it
        self.transfer_infos: Dict[int, Any] = {}

    def _room_notify_targets(self, bootstrap_room: int) -> list:
        return []  # send_kv_status_message records a Notice whatever the targets

    def update_status(self, bootstrap_room: int, status: int) -> None:
        if self.request_status.get(bootstrap_room) == KVPoll.Failed:
            return  # Failed is sticky in Common too
        self.request_status[bootstrap_room] = int(status)

    def record_failure(self, bootstrap_room: int, failure_reason: str) -> None:
        self.failure_records[bootstrap_room] = failure_reason

    def send_kv_status_message(
        self,
        targets=None,
        bootstrap_room: int = 0,
        status: int = KVPoll.Failed,
        failure_reason: Optional[str] = None,
    ) -> None:
        self.faults._notify(bootstrap_room, "decode", status, failure_reason)

    def conclude_failure(self, *, bootstrap_room: int, failure_reason: str, targets=None):
        self.record_failure(bootstrap_room, failure_reason)
        self.update_status(bootstrap_room, KVPoll.Failed)
        self.send_kv_status_message(targets, bootstrap_room, KVPoll.Failed, failure_reason)
        return KVPoll.Failed


class _Scripted:
    """Shared by both endpoints: forced states, Common-like clear/failure_exception."""

    side: str
    kv_mgr: FaultyKVManager
    bootstrap_room: int

    def _attach(self) -> None:
        self.faults = self.kv_mgr.faults
        self.faults.endpoints[self.bootstrap_room] = self
        self.kv_mgr.request_status[self.bootstrap_room] = KVPoll.Bootstrapping

    def _fake_poll(self) -> int:  # the fake backend's own answer
        raise NotImplementedError

    def poll(self) -> int:
        room = self.bootstrap_room
        forced = self.faults._forced.get(room)
        if self.conclude_state is None and self.kv_mgr.request_status.get(room) == KVPoll.Failed:
            self.conclude_state = KVPoll.Failed  # failed by update_status, as Common polls it
        if self.conclude_state is None and forced is not None:
            state = forced
            if forced == KVPoll.Failed:
                self.conclude_state = KVPoll.Failed
        else:
            state = int(self._fake_poll())
        if state == KVPoll.Success and room in self.faults._held:
            self.conclude_state = None  # not concluded while held: a later set() applies
            state = KVPoll.Transferring
        self.faults.last_poll[room] = state
        if self.bootstrap_room in self.kv_mgr.request_status:
            self.kv_mgr.request_status[self.bootstrap_room] = state
        return state

    def clear(self) -> None:
        self.faults._record(self.side, self.bootstrap_room, "clear")
        self.kv_mgr.request_status.pop(self.bootstrap_room, None)
        self.kv_mgr.transfer_infos.pop(self.bootstrap_room, None)

    def failure_exception(self):
        # As CommonKV{Sender,Receiver}: conclude, clear, raise with the recorded reason.
        self.faults._record(self.side, self.bootstrap_room, "failure_exception")
        self.conclude_state = KVPoll.Failed
        self.clear()
        reason = self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
        raise KVTransferError(
            self.bootstrap_room,
            reason or "Failed due to an unknown reason from another rank",
            is_from_another_rank=reason is None,
        )


class FaultySender(_Scripted, FakeKVSender):
    """Prefill side. Natural progression is `FakeKVSender`'s (WaitingForInput right away,
    Success once the last chunk is sent); `abort()` behaves as `CommonKVSender.abort`:
    the room goes Failed locally and decode is *not* told."""

    side = "prefill"

    def __init__(self, mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank=False):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        self._attach()
        self.num_pages = 0
        self.sent_pages = 0

    def _fake_poll(self) -> int:
        if self.faults.paired and self.conclude_state is None and self.bootstrap_room not in self.kv_mgr.transfer_infos:
            return KVPoll.Bootstrapping  # decode's handshake not here (yet, or dropped)
        return FakeKVSender.poll(self)

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        self.faults._record(self.side, self.bootstrap_room, "init", num_pages=num_kv_indices, aux_index=aux_index)
        self.num_pages = num_kv_indices
        super().init(num_kv_indices, aux_index)

    def send(self, kv_indices, state_indices=None, num_kv_tokens=None, **kwargs):
        room = self.bootstrap_room
        self.sent_pages += len(kv_indices)
        last = state_indices is not None or self.sent_pages >= self.num_pages
        self.faults._record(
            self.side, room, "send", pages=list(np.asarray(kv_indices).tolist()), last=last,
            state=state_indices,
        )
        exc = self.faults._raise_on_send.pop(room, None)
        if exc is not None:
            raise exc
        fault = self.faults._chunk_faults.get(room)
        if fault is not None:
            kind, reason, notify = fault
            hit = kind == "any" or (kind == "kv" and not last) or (kind in ("last", "state") and last)
            if hit:
                del self.faults._chunk_faults[room]
                self.kv_mgr.record_failure(room, reason)
                self.kv_mgr.update_status(room, KVPoll.Failed)
                if notify:
                    self.kv_mgr.send_kv_status_message(None, room, KVPoll.Failed, reason)
                return
        if last:
            FakeKVSender.send(self, kv_indices, state_indices, num_kv_tokens)

    def abort(self):
        self.faults._record(self.side, self.bootstrap_room, "abort")
        self.kv_mgr.record_failure(self.bootstrap_room, "Aborted by AbortReq.")
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed


class FaultyReceiver(_Scripted, FakeKVReceiver):
    """Decode side. Natural progression is `FakeKVReceiver`'s (Bootstrapping until
    `init`, WaitingForInput until `send_metadata`, then Success); `abort()` behaves as
    `CommonKVReceiver.abort`: Failed locally and prefill is told (a `Notice`)."""

    side = "decode"

    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None):
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self.bootstrap_room = bootstrap_room
        self._attach()

    def _fake_poll(self) -> int:
        return FakeKVReceiver.poll(self)

    def init(self, prefill_dp_rank: int):
        self.faults._record(self.side, self.bootstrap_room, "init", prefill_dp_rank=prefill_dp_rank)
        super().init(prefill_dp_rank)

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None, **kwargs):
        self.faults._record(
            self.side, self.bootstrap_room, "send_metadata",
            pages=list(np.asarray(kv_indices).tolist()), aux_index=aux_index,
        )
        exc = self.faults._raise_on_send.pop(self.bootstrap_room, None)
        if exc is not None:
            raise exc
        super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len)

    def abort(self):
        self.faults._record(self.side, self.bootstrap_room, "abort")
        if self.conclude_state != KVPoll.Failed:
            self.kv_mgr.record_failure(self.bootstrap_room, "Aborted by AbortReq.")
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed
        self.ensure_abort_notified()

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        if not self.abort_notified:
            self.abort_notified = True
            self.faults._notify(self.bootstrap_room, "prefill", KVPoll.Failed, "abort")


_backend_users = 0
_upstream_fake_classes = (FakeKVManager, FakeKVSender, FakeKVReceiver)


def _install_faulty_backend() -> None:
    """Point upstream's `fake` backend at the scripted classes.

    `get_kv_class(FAKE, ...)` imports the classes from `sglang.srt.disaggregation.fake`
    at call time, so swapping the package attributes reaches every caller (upstream's
    queues and any module of the fork) without touching them. Reference-counted.
    """
    global _backend_users
    _backend_users += 1
    fake_backend.FakeKVManager = FaultyKVManager
    fake_backend.FakeKVSender = FaultySender
    fake_backend.FakeKVReceiver = FaultyReceiver


@contextlib.contextmanager
def upstream_fake_sender():
    """Upstream's own `FakeKVSender` for the senders created in the block (a request to the fake bootstrap host on a
    real backend, as the server's warmup: upstream pairs that sender with the real kv manager), the scripted one
    after."""
    scripted = fake_backend.FakeKVSender
    fake_backend.FakeKVSender = _upstream_fake_classes[1]
    try:
        yield
    finally:
        fake_backend.FakeKVSender = scripted


def _uninstall_faulty_backend() -> None:
    global _backend_users
    _backend_users -= 1
    if _backend_users == 0:
        (
            fake_backend.FakeKVManager,
            fake_backend.FakeKVSender,
            fake_backend.FakeKVReceiver,
        ) = _upstream_fake_classes


