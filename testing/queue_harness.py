"""Upstream's real PD queues on CPU, driven tick by tick, with a scripted transfer backend.

`PrefillHarness` and `DecodeHarness` build the real `PrefillBootstrapQueue` (plus the
prefill mixin's waiting/chunk/inflight processing) and the real `DecodePreallocQueue` +
`DecodeTransferQueue` over real CPU KV pools, allocators, metadata buffers and radix
cache, on a one-rank gloo group. The only stand-in is `SchedulerStandIn` (what needs a
GPU or a model). The transfer backend is upstream's `fake` one, wrapped so that a test
scripts each bootstrap room (`Faults`) and reads back what was called and what the peer
was told. A failure-case test is then: make requests, script a fault, tick, assert what
the client saw (`outputs`), what was counted (`counters`) and what is still held
(`snapshot()` against the idle baseline):

    h = PrefillHarness()
    idle = h.snapshot()
    req = h.add(h.make_req())
    h.faults.set(req.bootstrap_room, KVPoll.Failed)
    h.tick()
    assert h.outputs.status_code(req.rid) == 500
    assert h.counters.counts["increment_bootstrap_failed_reqs"] == 1
    h.assert_baseline(idle)

Also: `h.abort(rid)` (the real `Scheduler.abort_request`), `h.chunk_size` (chunked
prefill), `h.hold_admission` (requests wait in the waiting queue), `h.during_forward`
(act while a prefill batch runs), `h.run_until(pred)`, `h.room_state(room)`, `h.faults.notices_for(room)`,
`DecodeHarness.finish(req)`, `kv_bytes(req)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from array import array
from collections import Counter
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

import sglang.srt.disaggregation.fake as fake_backend
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.common.conn import KVTransferError
from sglang.srt.disaggregation.decode import (
    DecodePreallocQueue,
    DecodeReqToTokenPool,
    DecodeTransferQueue,
    SchedulerDisaggregationDecodeMixin,
)
from sglang.srt.disaggregation.fake import FakeKVManager, FakeKVReceiver, FakeKVSender
from sglang.srt.disaggregation.prefill import (
    PrefillBootstrapQueue,
    SchedulerDisaggregationPrefillMixin,
)
from sglang.srt.disaggregation.utils import (
    FAKE_BOOTSTRAP_HOST,
    DisaggregationMode,
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
    TransferBackend,
)
from sglang.srt.managers.io_struct import AbortReq
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.plugins import load_plugins
from sglang.srt.runtime_context import (
    SpawnRanks,
    create_context,
    get_parallel,
    publish,
    use_context,
)
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

POLL_NAMES = {v: k for k, v in vars(KVPoll).items() if isinstance(v, int)}


def poll_name(state: Optional[int]) -> str:
    return "None" if state is None else POLL_NAMES.get(int(state), str(state))


def free_port() -> int:
    """A port reserved for this process, outside the ephemeral range (pd_cluster.free_ports)."""
    from testing.pd_cluster import free_ports

    return free_ports(1)[0]


# ---------------------------------------------------------------------------
# Scripted transfer backend
# ---------------------------------------------------------------------------


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
    """

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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.request_status: Dict[int, int] = {}
        self.failure_records: Dict[int, str] = {}

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


def _uninstall_faulty_backend() -> None:
    global _backend_users
    _backend_users -= 1
    if _backend_users == 0:
        (
            fake_backend.FakeKVManager,
            fake_backend.FakeKVSender,
            fake_backend.FakeKVReceiver,
        ) = _upstream_fake_classes


# ---------------------------------------------------------------------------
# What the client saw, what was counted
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Streamed:
    rid: str
    finished: bool
    reason: Optional[Dict[str, Any]]  # finished_reason.to_json()
    output_ids: Tuple[int, ...]
    via: str = "stream"  # "stream" (output streamer) or "abort_req" (send_abort_output)


class Outputs:
    """What the client would receive: `output_streamer.stream_output` calls and the
    `AbortReq`s the scheduler sends to the tokenizer (`send_abort_output`)."""

    def __init__(self) -> None:
        self.items: List[Streamed] = []

    def stream_output(self, reqs, return_logprob=False, *args, **kwargs) -> None:
        for req in reqs:
            reason = req.finished_reason
            self.items.append(
                Streamed(
                    req.rid,
                    req.finished(),
                    None if reason is None else reason.to_json(),
                    tuple(req.output_ids),
                )
            )

    def send_output(self, abort_req, req) -> None:  # ipc_channels.send_to_tokenizer
        reason = dict(abort_req.finished_reason or {"type": "abort", "status_code": None})
        self.items.append(Streamed(req.rid, True, reason, tuple(req.output_ids), "abort_req"))

    def of(self, rid: str) -> List[Streamed]:
        return [s for s in self.items if s.rid == rid]

    def final(self, rid: str) -> Optional[Streamed]:
        done = [s for s in self.of(rid) if s.finished]
        return done[-1] if done else None

    def status_code(self, rid: str) -> Optional[int]:
        """Status an abort carries (None if it carries none); 200 for a normal finish;
        None while unfinished."""
        final = self.final(rid)
        if final is None:
            return None
        if final.reason and final.reason.get("type") == "abort":
            code = final.reason.get("status_code")
            return None if code is None else int(code)
        return 200


class Counters:
    """A metrics collector that counts every call by method name (`increment_*` by the
    amount passed, if any)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("_"):
            raise AttributeError(name)

        def record(*args, **kwargs) -> None:
            self.counts[name] += args[0] if args and isinstance(args[0], int) else 1

        return record


# ---------------------------------------------------------------------------
# The scheduler stand-in
# ---------------------------------------------------------------------------


def _borrowed(name: str) -> Callable[..., Any]:
    """`Scheduler.<name>`, looked up at call time so that a hook the fork's plugin put
    on it applies to the stand-in too."""

    def method(self, *args, **kwargs):
        return getattr(Scheduler, name)(self, *args, **kwargs)

    method.__name__ = name
    return method


class SchedulerStandIn(SchedulerDisaggregationPrefillMixin, SchedulerDisaggregationDecodeMixin):
    """The one stand-in: a `Scheduler` without a model, a GPU or sockets.

    The PD mixins are upstream's own (inherited, not copied), and the `Scheduler`
    methods the queues call back into, plus `abort_request`, are borrowed below.
    Class attributes: features that are off for a plain CPU MHA model. Instance
    attributes, set by `_Harness.__init__` and each side's `_build`: the real pools,
    cache and queues, and stubs only for what needs a model (`tp_worker`,
    `model_config`), the tokenizer link (`output_streamer` / `ipc_channels` ->
    `Outputs`) and metrics (`metrics_collector` -> `Counters`).
    To exercise another `Scheduler` method, borrow it here the same way.
    """

    _release_aborted_request = _borrowed("_release_aborted_request")
    retire_unadmitted_request = _borrowed("retire_unadmitted_request")
    abort_request = _borrowed("abort_request")
    collect_inflight_reqs = _borrowed("collect_inflight_reqs")
    _collect_inflight_batches = _borrowed("_collect_inflight_batches")
    send_abort_output = _borrowed("send_abort_output")
    process_pending_chunked_abort = _borrowed("process_pending_chunked_abort")

    # features that are off
    enable_overlap = False
    enable_staging = False
    enable_lora = False
    enable_hisparse = False
    enable_decode_hicache = False
    enable_priority_scheduling = False
    hisparse_coordinator = None
    decode_offload_manager = None
    rust_server = None
    pp_group = None
    chunked_req = None
    _pending_chunked_abort_req = None
    last_batch = None
    _engine_paused = False  # set True to stand for a paused event loop
    kv_checksum_computer = None
    sliding_window_size = None
    scheduler_stage_metrics = None
    return_health_check_ipcs = None
    kv_shard_widening = 1
    random_seed = 0
    spec_algorithm = SpeculativeAlgorithm.NONE
    enable_continuous_input_polling = False
    # components the borrowed methods touch, with nothing to do here
    result_queue = ()
    mm_receiver = None
    dllm_config = None
    beam_coordinator = SimpleNamespace(retire_group=lambda req: None)
    grammar_manager = SimpleNamespace(abort_requests=lambda recv_req: None)

    def maybe_send_health_check_signal(self) -> None:
        pass


def _model_stub(num_layers: int, num_kv_heads: int, vocab_size: int) -> SimpleNamespace:
    return SimpleNamespace(
        num_hidden_layers=num_layers,
        num_key_value_heads=num_kv_heads,
        get_total_num_kv_heads=lambda: num_kv_heads,
        vocab_size=vocab_size,
        is_encoder_decoder=False,
        hf_config=SimpleNamespace(),
        hf_text_config=SimpleNamespace(),
    )


# ---------------------------------------------------------------------------
# Snapshots
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Everything a request can hold, at one instant. `kv_evictable` is cache content,
    not a hold, so `held()` leaves it out."""

    kv_held: int  # KV tokens neither free nor evictable cache
    kv_evictable: int
    req_slots_held: int
    metadata_held: int
    queues: Tuple[Tuple[str, int], ...]
    rooms: Tuple[int, ...]  # rooms the transfer manager still tracks

    def held(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("kv_evictable")
        d["queues"] = dict(self.queues)
        return d

    def diff(self, other: "Snapshot") -> Dict[str, Tuple[Any, Any]]:
        a, b = self.held(), other.held()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}


# ---------------------------------------------------------------------------
# Harnesses
# ---------------------------------------------------------------------------

_gloo_group = None


def _gloo() -> "dist.ProcessGroup":
    """The process's one-rank gloo group (created once, on a free port)."""
    global _gloo_group
    if _gloo_group is None:
        if not dist.is_initialized():
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
            )
        _gloo_group = dist.group.WORLD
    return _gloo_group


class _Harness:
    mode: DisaggregationMode

    def __init__(
        self,
        *,
        kv_tokens: int = 256,
        req_slots: int = 8,
        metadata_slots: int = 8,
        max_context_len: int = 128,
        page_size: int = 1,
        num_layers: int = 2,
        num_kv_heads: int = 2,
        head_dim: int = 16,
        vocab_size: int = 1000,
        transfer_backend: str = "fake",
        server_args: Optional[Dict[str, Any]] = None,
        process_wide: bool = False,
    ) -> None:
        """Sizes are tiny on purpose. `transfer_backend="fake"` is the scripted backend
        (`faults` applies); another backend (see `testing/mooncake_pair.py`) needs its
        engine and bootstrap server started by the caller, and `faults` stays unused.
        The runtime config is private to the harness (so a prefill and a decode harness
        can share a process) unless `process_wide`, which a backend with its own
        threads needs: they read the process's config, not the harness's."""
        load_plugins()  # as run_scheduler_process does: the fork's hooks, if installed
        self.group = _gloo()
        self.transfer_backend = TransferBackend(transfer_backend)
        self.server_args = ServerArgs(
            model_path="dummy",
            device="cpu",
            page_size=page_size,
            disaggregation_mode=self.mode.value,
            disaggregation_transfer_backend=transfer_backend,
            **(server_args or {}),
        )
        make_context = publish if process_wide else create_context
        self.context = make_context(self.server_args, role="test", ranks=SpawnRanks(world_rank=0))
        self.kv_tokens = kv_tokens
        self.vocab_size = vocab_size
        self.faults = Faults()
        self.outputs = Outputs()
        self.counters = Counters()
        self._rooms = itertools.count(1000)
        self._rids = itertools.count(1)
        _install_faulty_backend()
        self._closed = False
        with self.active():
            get_parallel().override_permanently(
                attn_tp_group=SimpleNamespace(cpu_group=self.group, rank_in_group=0, world_size=1),
                pp_group=None,
            )
            self.kv_pool = MHATokenToKVPool(
                size=kv_tokens, page_size=page_size, dtype=torch.float16, head_num=num_kv_heads,
                head_dim=head_dim, layer_num=num_layers, device="cpu",
                enable_memory_saver=False, enable_alt_stream=False,
            )
            if page_size == 1:
                self.allocator = TokenToKVPoolAllocator(
                    kv_tokens, torch.float16, "cpu", self.kv_pool, need_sort=False
                )
            else:
                self.allocator = PagedTokenToKVPoolAllocator(
                    kv_tokens, page_size, torch.float16, "cpu", self.kv_pool, need_sort=False
                )
            self.meta_alloc = ReqToMetadataIdxAllocator(metadata_slots)
            self.meta_bufs = MetadataBuffers(
                metadata_slots, hidden_size=16, hidden_states_dtype=torch.float32,
                max_sampling_mask_tokens=16,
            )
            self.scheduler = SchedulerStandIn()
            self.scheduler.__dict__.update(
                server_args=self.server_args,
                model_config=_model_stub(num_layers, num_kv_heads, vocab_size),
                attn_cp_cpu_group=self.group,
                attn_tp_cpu_group=self.group,
                output_streamer=self.outputs,
                ipc_channels=SimpleNamespace(send_to_tokenizer=self.outputs),
                disaggregation_mode=self.mode,
                running_batch=SimpleNamespace(reqs=[]),
                metrics_collector=self.counters,
                metrics_reporter=SimpleNamespace(
                    enable_metrics=True,
                    current_scheduler_metrics_enabled=False,
                    report_prefill_stats=lambda **kw: None,
                ),
                token_to_kv_pool_allocator=self.allocator,
                req_to_metadata_buffer_idx_allocator=self.meta_alloc,
                disagg_metadata_buffers=self.meta_bufs,
                waiting_queue=[],
                processed_tokens_counter=0,
            )
            self._build(req_slots=req_slots, max_context_len=max_context_len, page_size=page_size)

    # -- lifecycle --
    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make this harness's runtime config the process's while upstream code runs."""
        with use_context(self.context):
            yield

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _uninstall_faulty_backend()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- requests --
    def make_req(
        self,
        rid: Optional[str] = None,
        prompt_len: int = 10,
        room: Optional[int] = None,
        max_new_tokens: int = 8,
        bootstrap_host: Optional[str] = None,
        tokens: Optional[Sequence[int]] = None,
        **kwargs: Any,
    ) -> Req:
        """A fresh request as the tokenizer hands it over. The prompt is `tokens`, else
        1..prompt_len (so such requests share a cached prefix on prefill). Rooms are
        unique per harness."""
        with self.active():
            sp = SamplingParams(max_new_tokens=max_new_tokens)
            sp.normalize(None)
            return Req(
                rid=rid or f"{self.mode.value}-{next(self._rids)}",
                origin_input_text="",
                origin_input_ids=array("q", tokens if tokens is not None else range(1, prompt_len + 1)),
                sampling_params=sp,
                bootstrap_host=bootstrap_host or self.default_bootstrap_host,
                bootstrap_port=self.server_args.disaggregation_bootstrap_port,
                bootstrap_room=next(self._rooms) if room is None else room,
                disagg_mode=self.mode,
                vocab_size=self.vocab_size,
                **kwargs,
            )

    def abort(self, rid: str) -> None:
        """The real `Scheduler.abort_request` for one rid (a client abort)."""
        with self.active():
            self.scheduler.abort_request(AbortReq(rid=rid))

    def tick(self, n: int = 1) -> None:
        for _ in range(n):
            with self.active():
                self._tick()

    def run_until(self, pred: Callable[[], bool], max_ticks: int = 50) -> int:
        """Tick until `pred()` holds; returns the number of ticks. Bounded."""
        for i in range(max_ticks + 1):
            if pred():
                return i
            self.tick()
        raise AssertionError(f"condition not reached in {max_ticks} ticks; {self.snapshot()}")

    # -- resources --
    def snapshot(self) -> Snapshot:
        with self.active():
            free = self.allocator.available_size()
            evictable = self.tree_cache.evictable_size()
            return Snapshot(
                kv_held=self.kv_tokens - free - evictable,
                kv_evictable=evictable,
                req_slots_held=self._req_slots_total - self.req_to_token_pool.available_size(),
                metadata_held=self.meta_alloc.size - self.meta_alloc.available_size(),
                queues=tuple(self._queue_lengths().items()),
                rooms=tuple(sorted(self.kv_manager.request_status)),
            )

    def assert_baseline(self, baseline: Snapshot) -> None:
        diff = self.snapshot().diff(baseline)
        assert not diff, f"resources not back to baseline (now, baseline): {diff}"

    def room_state(self, room: int) -> str:
        """The room's KVPoll state by name, as the queues last polled it."""
        return poll_name(self.faults.state(room))

    # -- KV content --
    def model_kv(self, token_ids: torch.Tensor, positions: torch.Tensor, layer: int):
        """The stand-in model's K and V for these tokens: a pure function of (token,
        position, layer, head, dim), so a cached prefix holds what a recompute would."""
        heads = torch.arange(self.kv_pool.head_num)[None, :, None] * 13
        dims = torch.arange(self.kv_pool.head_dim)[None, None, :]
        base = (token_ids * 31 + positions * 7 + layer * 101)[:, None, None] + heads + dims
        k = (base % 251 + 1).to(self.kv_pool.dtype) / 256
        return k, -k

    def kv_bytes(self, req: Req, num_tokens: Optional[int] = None) -> bytes:
        """The K and V bytes, all layers, of the first `num_tokens` (default: the prompt)
        of the request's row; the request must still hold its row."""
        n = len(req.origin_input_ids) if num_tokens is None else num_tokens
        with self.active():
            locs = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].long()
            parts = []
            for layer in range(self.kv_pool.layer_num):
                parts.append(self.kv_pool.k_buffer[layer][locs].contiguous().numpy().tobytes())
                parts.append(self.kv_pool.v_buffer[layer][locs].contiguous().numpy().tobytes())
            return b"".join(parts)

    def room_entries(self, room: int) -> List[str]:
        """Names of the transfer manager's per-room containers that still hold `room`
        (dicts and sets, and dicts of sets such as decode's addr_to_rooms_tracker)."""
        found = []
        for name, value in sorted(vars(self.kv_manager).items()):
            if isinstance(value, (dict, set, frozenset)):
                try:
                    if room in value:
                        found.append(name)
                        continue
                except TypeError:
                    continue
                if isinstance(value, dict) and any(
                    isinstance(v, (set, frozenset, dict)) and room in v for v in value.values()
                ):
                    found.append(name)
        return found

    # -- per side --
    def _attach_faults(self) -> None:
        if self.transfer_backend == TransferBackend.FAKE:
            self.kv_manager.faults = self.faults

    def _build(self, *, req_slots: int, max_context_len: int, page_size: int) -> None:
        raise NotImplementedError

    def _tick(self) -> None:
        raise NotImplementedError

    def _queue_lengths(self) -> Dict[str, int]:
        raise NotImplementedError


class PrefillHarness(_Harness):
    """Real `PrefillBootstrapQueue` + the prefill mixin's waiting/inflight processing.

    One `tick()` is `event_loop_normal_disagg_prefill` with the model replaced:
    pop_bootstrapped -> process_pending_chunked_abort -> resolve_waiting_queue_bootstrap ->
    process_prefill_chunk ->
    `forward()` -> process_disagg_prefill_inflight_queue. Set `chunk_size` for
    chunked prefill (non-last chunks are sent one tick after they are computed).
    """

    chunk_size: Optional[int] = None
    # True: `admit()` admits nothing, so bootstrapped requests stay in the waiting
    # queue (a prefill whose compute is saturated).
    hold_admission: bool = False
    # Called with the batch's requests after the model ran and before the result is
    # processed: what lands while a prefill batch is running (e.g. `h.abort(rid)`).
    during_forward: Optional[Callable[[List[Req]], None]] = None

    mode = DisaggregationMode.PREFILL
    next_token = 7
    # Any host but the fake one: the queue's backend is FAKE anyway, and a real host
    # keeps `skip_radix_cache_insert` off, so the radix cache fills as in production.
    default_bootstrap_host = "127.0.0.1"

    def _build(self, *, req_slots: int, max_context_len: int, page_size: int) -> None:
        s = self.scheduler
        self.kv_sent: Dict[int, bytes] = {}
        self.req_to_token_pool = ReqToTokenPool(
            size=req_slots, max_context_len=max_context_len, device="cpu", enable_memory_saver=False
        )
        self._req_slots_total = self.req_to_token_pool.available_size()
        self.tree_cache = RadixCache(
            CacheInitParams(
                disable=False, req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator, page_size=page_size,
            )
        )
        s.__dict__.update(
            req_to_token_pool=self.req_to_token_pool,
            tree_cache=self.tree_cache,
            tp_worker=SimpleNamespace(
                model_runner=SimpleNamespace(
                    effective_logical_max_total_num_tokens=self.kv_tokens,
                    kv_cache_dtype_str="auto",
                )
            ),
            disagg_prefill_inflight_queue=[],
            disagg_prefill_pending_chunk_rids=set(),
            batch_result_processor=SimpleNamespace(
                snapshot_auxiliary_output_starts=lambda batch, result: None,
                move_logprobs_to_cpu=lambda **kw: None,
            ),
        )
        self.queue = PrefillBootstrapQueue(
            token_to_kv_pool=self.kv_pool, draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=self.meta_alloc, metadata_buffers=self.meta_bufs,
            gpu_id=0, bootstrap_port=self.server_args.disaggregation_bootstrap_port,
            max_total_num_tokens=self.kv_tokens, scheduler=s, scheduler_stage_metrics=None,
            transfer_backend=self.transfer_backend,
        )
        s.disagg_prefill_bootstrap_queue = self.queue
        self.kv_manager = self.queue.kv_manager
        self._attach_faults()

    # convenient views of the scheduler's queues
    @property
    def waiting(self) -> List[Req]:
        return self.scheduler.waiting_queue

    @property
    def inflight(self) -> List[Req]:
        return self.scheduler.disagg_prefill_inflight_queue

    def add(self, req: Req) -> Req:
        """What `Scheduler._add_request_to_queue` does in PREFILL mode."""
        with self.active():
            self.queue.add(req, self.scheduler.model_config.num_key_value_heads)
        return req

    def admit(self) -> List[Req]:
        """`Scheduler.get_new_batch_prefill` / `PrefillAdder`, reduced to a token budget
        of `chunk_size` per batch (None: unlimited): the continuing chunked request
        first, then waiting requests in order; one that does not fit is cut and
        becomes `chunked_req`, and admission stops."""
        s = self.scheduler
        if self.hold_admission:
            return []
        budget = self.chunk_size or float("inf")
        reqs = []
        if s.chunked_req is not None:
            req = s.chunked_req
            req.init_next_round_input()
            remaining = len(req.full_untruncated_fill_ids) - req.prefix_len
            n = min(remaining, budget)
            req.extend_end = req.prefix_len + n
            budget -= n
            s.chunked_req = req if n < remaining else None
            reqs.append(req)
        while s.waiting_queue and budget > 0 and s.chunked_req is None:
            req = s.waiting_queue.pop(0)
            req.init_next_round_input(self.tree_cache)
            remaining = len(req.full_untruncated_fill_ids) - req.prefix_len
            n = min(remaining, budget)
            req.extend_end = req.prefix_len + n
            req.lock = self.tree_cache.lock(req.last_node)
            budget -= n
            if n < remaining:
                s.chunked_req = req
            reqs.append(req)
        if s.chunked_req is not None:
            s.chunked_req.inflight_middle_chunks += 1
        return reqs

    def forward(self) -> Optional[ScheduleBatch]:
        """One prefill batch through a stand-in model: `admit()`, the real
        `prepare_for_extend` (KV allocation), `model_kv` written for the computed
        tokens, `next_token` sampled, then the real `process_batch_result_disagg_prefill`
        (which sends the KV). `kv_sent[room]` keeps the prompt's KV bytes as sent."""
        s = self.scheduler
        reqs = self.admit()
        if not reqs:
            return None
        batch = ScheduleBatch.init_new(
            reqs, self.req_to_token_pool, self.allocator, self.tree_cache,
            s.model_config, False, s.spec_algorithm, chunked_req=s.chunked_req,
        )
        batch.prepare_for_extend()
        for req in reqs:
            row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
            positions = torch.arange(req.prefix_len, req.extend_end)
            locs = row[req.prefix_len : req.extend_end].long()
            tokens = torch.tensor(req.full_untruncated_fill_ids[req.prefix_len : req.extend_end])
            for layer in range(self.kv_pool.layer_num):
                k, v = self.model_kv(tokens, positions, layer)
                self.kv_pool.k_buffer[layer][locs] = k
                self.kv_pool.v_buffer[layer][locs] = v
            self.kv_sent[req.bootstrap_room] = self.kv_bytes(req)
        result = GenerationBatchResult(
            next_token_ids=torch.full((len(reqs),), self.next_token, dtype=torch.int64)
        )
        if self.during_forward is not None:
            # As in overlap mode: the next iteration's intake (e.g. an AbortReq) runs
            # while this batch is `last_batch` and its result is not processed yet.
            previous, s.last_batch = s.last_batch, batch
            self.during_forward(list(reqs))
            s.last_batch = previous
        s.process_batch_result_disagg_prefill(batch, result)
        return batch

    def _tick(self) -> None:
        s = self.scheduler
        s.waiting_queue.extend(self.queue.pop_bootstrapped())
        s.process_pending_chunked_abort()  # as get_next_disagg_prefill_batch_to_run
        s.resolve_waiting_queue_bootstrap()
        # sends the previous batch's chunk of a chunked request (non-overlap mode)
        s.process_prefill_chunk(last_batch=s.last_batch, running_batch=s.running_batch)
        batch = self.forward()
        s.process_disagg_prefill_inflight_queue()
        s.last_batch = batch

    def _queue_lengths(self) -> Dict[str, int]:
        s = self.scheduler
        return {
            "bootstrap": len(self.queue.queue),
            "waiting": len(s.waiting_queue),
            "inflight": len(s.disagg_prefill_inflight_queue),
            "pending_chunk_sends": len(s.disagg_prefill_pending_chunk_rids),
        }


class DecodeHarness(_Harness):
    """Real `DecodePreallocQueue` + `DecodeTransferQueue`; one `tick()` is the mixin's
    `process_decode_queue`. Transferred requests land in `waiting` holding their KV;
    `finish(req)` retires one as a finished decode would."""

    mode = DisaggregationMode.DECODE
    # Decode resolves the prefill's parallel info for any other host.
    default_bootstrap_host = FAKE_BOOTSTRAP_HOST

    def _build(self, *, req_slots: int, max_context_len: int, page_size: int) -> None:
        s = self.scheduler
        self.req_to_token_pool = DecodeReqToTokenPool(
            size=req_slots, max_context_len=max_context_len, device="cpu",
            enable_memory_saver=False, pre_alloc_size=req_slots,
        )
        self._req_slots_total = self.req_to_token_pool.available_size()
        # Decode runs without a radix cache by default (disaggregation_decode_enable_radix_cache).
        self.tree_cache = RadixCache(
            CacheInitParams(
                disable=True, req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator, page_size=page_size,
            )
        )
        s.__dict__.update(
            req_to_token_pool=self.req_to_token_pool,
            tree_cache=self.tree_cache,
            tp_worker=SimpleNamespace(is_hybrid_swa=False, model_runner=SimpleNamespace(kv_cache_dtype_str="auto")),
            disagg_decode_prealloc_queue=None,
            batch_result_processor=SimpleNamespace(_maybe_update_reasoning_tokens=lambda *a, **k: None),
        )
        self.transfer_queue = DecodeTransferQueue(
            req_to_metadata_buffer_idx_allocator=self.meta_alloc, metadata_buffers=self.meta_bufs,
            scheduler=s, tree_cache=self.tree_cache,
        )
        self.queue = DecodePreallocQueue(
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
            draft_token_to_kv_pool=None, req_to_metadata_buffer_idx_allocator=self.meta_alloc,
            metadata_buffers=self.meta_bufs, scheduler=s, transfer_queue=self.transfer_queue,
            tree_cache=self.tree_cache, gpu_id=0,
            bootstrap_port=self.server_args.disaggregation_bootstrap_port,
            max_total_num_tokens=self.kv_tokens, num_reserved_decode_tokens=16,
            transfer_backend=self.transfer_backend,
        )
        s.disagg_decode_prealloc_queue = self.queue
        s.disagg_decode_transfer_queue = self.transfer_queue
        self.kv_manager = self.queue.kv_manager
        self._attach_faults()

    @property
    def waiting(self) -> List[Req]:
        return self.scheduler.waiting_queue

    def add(self, req: Req) -> Req:
        """What `Scheduler._add_request_to_queue` does in DECODE mode."""
        with self.active():
            self.queue.add(req)
        return req

    def finish(self, req: Req) -> None:
        """Retire a transferred request as a decode that ran to its length would."""
        with self.active():
            self.scheduler.waiting_queue.remove(req)
            req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
            release_kv_cache(req, self.tree_cache, checkpoint=True)
            self.outputs.stream_output([req])

    def _tick(self) -> None:
        self.scheduler.process_decode_queue()

    def _queue_lengths(self) -> Dict[str, int]:
        return {
            "prealloc": len(self.queue.queue),
            "pending": len(self.queue.pending_reqs),
            "retracted": len(self.queue.retracted_queue),
            "transfer": len(self.transfer_queue.queue),
            "deferred_release": len(self.transfer_queue._deferred_releases),
            "waiting": len(self.scheduler.waiting_queue),
        }


__all__ = [
    "CHUNK_KINDS",
    "Call",
    "Counters",
    "DecodeHarness",
    "FAKE_BOOTSTRAP_HOST",
    "Faults",
    "KVPoll",
    "Notice",
    "Outputs",
    "PrefillHarness",
    "SchedulerStandIn",
    "Snapshot",
    "poll_name",
]
