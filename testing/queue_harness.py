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
(act while a prefill batch runs), `h.add_held()` / `h.add_bootstrapping()` (a request
whose transfer is held / whose peer is not there yet), `h.run_until(pred)`,
`h.room_state(room)`, `h.faults.notices_for(room)`, `DecodeHarness.finish(req)`,
`kv_bytes(req)`.
"""

from __future__ import annotations

import contextlib
import itertools
from array import array
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeReqToTokenPool, DecodeTransferQueue
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
from sglang.srt.disaggregation.utils import (
    FAKE_BOOTSTRAP_HOST,
    DisaggregationMode,
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
    TransferBackend,
)
from sglang.srt.managers.fork_report import pd_resource_report
from sglang.srt.managers.io_struct import AbortReq
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ScheduleBatch
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

# The harness's parts, one module each (re-exported: tests import them from here).
from testing.harness_backend import (  # noqa: F401  the scripted transfer backend
    CHUNK_KINDS,
    POLL_NAMES,
    Call,
    Faults,
    FaultyKVManager,
    FaultyReceiver,
    FaultySender,
    Notice,
    _install_faulty_backend,
    _uninstall_faulty_backend,
    poll_name,
)
from testing.harness_client import Counters, Outputs, Streamed  # noqa: F401  what the client saw, counted
from testing.harness_scheduler import SchedulerStandIn, _model_stub  # noqa: F401  the scheduler stand-in
from testing.harness_snapshot import Snapshot, fork_tables_held  # what a harness holds
from testing.ports import free_port

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
                transfer_backend=self.transfer_backend,  # Scheduler.init_disaggregation's
                idle_sleeper=None,  # Scheduler.init_idle_sleeper's when it has no sockets to wait on
                running_batch=SimpleNamespace(reqs=[], is_empty=lambda: True),  # the harness runs no decode batch
                metrics_collector=self.counters,
                metrics_reporter=SimpleNamespace(
                    enable_metrics=True,
                    current_scheduler_metrics_enabled=False,
                    report_prefill_stats=lambda **kw: None,
                ),
                token_to_kv_pool_allocator=self.allocator,
                max_total_num_tokens=kv_tokens,
                req_to_metadata_buffer_idx_allocator=self.meta_alloc,
                disagg_metadata_buffers=self.meta_bufs,
                waiting_queue=[],
                processed_tokens_counter=0,
                _pause_intervals=[],
            )
            self._build(req_slots=req_slots, max_context_len=max_context_len, page_size=page_size)
            self.kv_manager = self.queue.kv_manager
            self._attach_faults()

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
    @property
    def waiting(self) -> List[Req]:
        """The scheduler's waiting queue."""
        return self.scheduler.waiting_queue

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

    def add_held(self, **req_kwargs: Any) -> Tuple[Req, int]:
        """A fresh request (`make_req`'s arguments) added with its room's transfer held
        (`faults.hold_transfer`), then one tick: on prefill it waits Transferring in the
        inflight queue, on decode its metadata went out. Returns (request, room)."""
        req = self.add(self.make_req(**req_kwargs))
        self.faults.hold_transfer(req.bootstrap_room)
        self.tick()
        return req, req.bootstrap_room

    def add_bootstrapping(self, **req_kwargs: Any) -> Tuple[Req, int]:
        """A fresh request (`make_req`'s arguments) added while its room stays
        Bootstrapping (the peer not there yet), then one tick: it waits in prefill's
        bootstrap queue or decode's prealloc queue. Returns (request, room)."""
        req = self.add(self.make_req(**req_kwargs))
        self.faults.set(req.bootstrap_room, KVPoll.Bootstrapping)
        self.tick()
        return req, req.bootstrap_room

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
        """Counted as the server's resource report counts (pd_resource_report)."""
        with self.active():
            kv = pd_resource_report.kv_tokens(self.scheduler)
            req_slots = pd_resource_report.slots(self.req_to_token_pool)
            metadata = pd_resource_report.slots(self.meta_alloc)
            return Snapshot(
                kv_held=kv["held"],
                kv_evictable=kv["evictable"],
                req_slots_held=req_slots["total"] - req_slots["free"],
                metadata_held=metadata["total"] - metadata["free"],
                queues=tuple(self._queue_lengths().items()),
                rooms=tuple(sorted(self.kv_manager.request_status)),
                room_tables=tuple(sorted(pd_resource_report.room_tables(self.kv_manager).items())),
                fork=tuple(sorted(fork_tables_held(pd_resource_report.fork_tables(self.kv_manager)).items())),
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
    def _radix_cache(self, *, disable: bool, page_size: int) -> RadixCache:
        """The side's radix cache over its req-to-token pool and KV allocator (`disable`:
        decode runs without one by default)."""
        return RadixCache(
            CacheInitParams(
                disable=disable, req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator, page_size=page_size,
            )
        )

    def _attach_faults(self) -> None:
        if self.transfer_backend == TransferBackend.FAKE:
            self.kv_manager.faults = self.faults

    def _build(self, *, req_slots: int, max_context_len: int, page_size: int) -> None:
        """The side's pools, radix cache and PD queue(s); sets `self.queue` (the queue
        whose kv_manager the harness scripts). Called once, from __init__."""
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
        self.tree_cache = self._radix_cache(disable=False, page_size=page_size)
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

    # convenient views of the scheduler's queues
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
        # Decode runs without a radix cache by default (disaggregation_decode_enable_radix_cache).
        self.tree_cache = self._radix_cache(disable=True, page_size=page_size)
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

