"""A scheduler's PD queues and the requests in them, by stage: the one walker.

Role, stage names and where each stage's requests sit, declared once. Read-only; a leaf
(imports only `fork_touch`). Scheduler thread.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

from sglang.srt.managers.fork_core.fork_touch import upstream

PREFILL, DECODE = "prefill", "decode"

# Stages (names also label counters: `sglang:pd_transfer_timeouts_total{stage}`,
# the end-cause counter's stage).
PREFILL_BOOTSTRAP = "prefill_bootstrap"  # PrefillBootstrapQueue.queue
PREFILL_WAITING = "prefill_waiting"  # waiting_queue (bootstrapped, not yet run)
PREFILL_RUNNING = "prefill_running"  # chunked_req, last batch
PREFILL_INFLIGHT = "prefill_inflight"  # disagg_prefill_inflight_queue (KV being sent)
DECODE_PREALLOC = "decode_prealloc"  # DecodePreallocQueue.queue (DecodeRequest)
DECODE_TRANSFER = "decode_transfer"  # DecodeTransferQueue.queue (DecodeRequest)
DECODE_RUNNING = "decode_running"  # waiting_queue (transferred), running batch
# The kv manager's tables keyed by room that a concluded room leaves behind (a backend may lack some).
ROOM_TABLES = (
    "request_status", "failure_records", "transfer_infos", "req_to_decode_prefix_len", "_staging_outstanding",
)


def role(scheduler: Any) -> Optional[str]:
    """"prefill" / "decode" for a PD scheduler whose queues exist, else None."""
    mode = upstream(scheduler, "disaggregation_mode")
    mode = str(getattr(mode, "value", mode))  # the enum, or its value
    if mode == PREFILL and upstream(scheduler, "disagg_prefill_bootstrap_queue") is not None:
        return PREFILL
    if mode == DECODE and upstream(scheduler, "disagg_decode_prealloc_queue") is not None:
        return DECODE
    return None


def _prefill_running(s: Any) -> List[Any]:
    last = s.last_batch.reqs if s.last_batch is not None else None
    return ([s.chunked_req] if s.chunked_req is not None else []) + list(last or ())


_QUEUES = {  # stage -> its requests: `Req` on prefill, `DecodeRequest` (`.req`, `.kv_receiver`) in decode's queues
    PREFILL_BOOTSTRAP: lambda s: s.disagg_prefill_bootstrap_queue.queue,
    PREFILL_WAITING: lambda s: s.waiting_queue,
    PREFILL_RUNNING: _prefill_running,
    PREFILL_INFLIGHT: lambda s: s.disagg_prefill_inflight_queue,
    DECODE_PREALLOC: lambda s: s.disagg_decode_prealloc_queue.queue,
    DECODE_TRANSFER: lambda s: s.disagg_decode_transfer_queue.queue,
    DECODE_RUNNING: lambda s: list(s.waiting_queue) + list(s.running_batch.reqs),
}
_WALK = {
    PREFILL: (PREFILL_BOOTSTRAP, PREFILL_WAITING, PREFILL_RUNNING, PREFILL_INFLIGHT),
    DECODE: (DECODE_PREALLOC, DECODE_TRANSFER, DECODE_RUNNING),
}
_QUEUED = {PREFILL: (PREFILL_BOOTSTRAP, PREFILL_INFLIGHT), DECODE: (DECODE_PREALLOC, DECODE_TRANSFER)}


def _reqs_of(scheduler: Any, stage: str) -> List[Any]:
    entries = list(_QUEUES[stage](scheduler))
    return [e.req for e in entries] if stage in (DECODE_PREALLOC, DECODE_TRANSFER) else entries


def walk(scheduler: Any) -> Iterator[Tuple[str, Any]]:
    """(stage, req) for every request in a PD stage, queues first (a request may appear twice)."""
    for stage in _WALK.get(role(scheduler), ()):
        for req in _reqs_of(scheduler, stage):
            yield stage, req


def queued_reqs(scheduler: Any) -> List[Any]:
    """Requests in this scheduler's PD queues and waiting queue (prefill: and its chunked request)."""
    r = role(scheduler)
    reqs = list(scheduler.waiting_queue) + [req for st in _QUEUED.get(r, ()) for req in _reqs_of(scheduler, st)]
    if r == PREFILL and scheduler.chunked_req is not None:
        reqs.append(scheduler.chunked_req)
    return reqs


def held_reqs(scheduler: Any) -> List[Any]:
    """Every request this scheduler holds: PD queues, running batch, last batch."""
    last = scheduler.last_batch.reqs if scheduler.last_batch is not None else ()
    return queued_reqs(scheduler) + list(scheduler.running_batch.reqs) + list(last)


def parked_reqs(scheduler: Any) -> List[Any]:
    """Decode's requests held for re-bootstrap or retracted (they own a room, no KV)."""
    if role(scheduler) != DECODE:
        return []
    prealloc = scheduler.disagg_decode_prealloc_queue
    return list(prealloc.held_rebootstrap_reqs) + list(prealloc.retracted_queue)


def transfer_endpoints(scheduler: Any) -> List[Any]:
    """Live KV senders (prefill) or receivers (decode) of the requests in the PD queues."""
    r = role(scheduler)
    stages = _QUEUED.get(r, ()) + ((PREFILL_WAITING,) if r == PREFILL else ())
    attr = "disagg_kv_sender" if r == PREFILL else "kv_receiver"
    out = [upstream(e, attr) for stage in stages for e in _QUEUES[stage](scheduler)]
    return [x for x in out if x is not None]


def prefill_stage(scheduler: Any, req: Any) -> str:
    """Which prefill stage `req` is in (running: none of the queues)."""
    stages = (PREFILL_BOOTSTRAP, PREFILL_WAITING, PREFILL_INFLIGHT)
    return next((st for st in stages if req in _QUEUES[st](scheduler)), PREFILL_RUNNING)


def lengths(scheduler: Any) -> Dict[str, int]:
    """Queue lengths (the resource report's `queues`)."""
    queues = {"waiting": len(scheduler.waiting_queue), "running": len(scheduler.running_batch.reqs)}
    bootstrap = scheduler.disagg_prefill_bootstrap_queue
    if bootstrap is not None:
        queues["prefill_bootstrap"] = len(bootstrap.queue)
        queues["prefill_inflight"] = len(scheduler.disagg_prefill_inflight_queue)
        queues["prefill_pending_chunks"] = len(scheduler.disagg_prefill_pending_chunk_rids)
    prealloc = scheduler.disagg_decode_prealloc_queue
    if prealloc is not None:
        queues["decode_prealloc"] = len(prealloc.queue)
        queues["decode_prealloc_pending"] = len(prealloc.pending_reqs)
        queues["decode_retracted"] = len(prealloc.retracted_queue)
        queues["decode_held_rebootstrap"] = len(prealloc.held_rebootstrap_reqs)
        queues["decode_transfer"] = len(scheduler.disagg_decode_transfer_queue.queue)
    return queues


def table_sizes(obj: Any, names: Tuple[str, ...]) -> Dict[str, int]:
    """len() of each table in `names` that `obj` has (a role or backend may lack some)."""
    return {name: len(table) for name in names if (table := getattr(obj, name, None)) is not None}  # the ones it has


def kv_manager(scheduler: Any) -> Any:
    """The transfer kv manager of this scheduler's PD queue, or None."""
    queues = (scheduler.disagg_prefill_bootstrap_queue, scheduler.disagg_decode_prealloc_queue)
    return next((queue.kv_manager for queue in queues if queue is not None), None)


def fake_bootstrap_addr(original: Any, req: Any) -> str:
    """AROUND `decode._bootstrap_addr`: a host-less request to a fake-backend decode is the fake
    transfer upstream intends, addressed at the fake host (upstream's None host killed the scheduler)."""
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST, _is_fake_transfer
    from sglang.srt.utils.network import NetworkAddress

    if req.bootstrap_host is None and _is_fake_transfer(req):
        return NetworkAddress(FAKE_BOOTSTRAP_HOST, req.bootstrap_port).to_host_port_str()
    return original(req)
