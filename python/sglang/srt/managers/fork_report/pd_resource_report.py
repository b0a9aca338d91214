"""What a scheduler holds right now, as `fork_pd_resources` in its internal state (GET /server_info ->
internal_states[i]; read-only, scheduler thread): KV tokens, slots, PD queues, the kv manager's per-room tables,
hooks and swaps applied, and each component's own `report()`."""

from __future__ import annotations

from typing import Any, Dict, Optional

from sglang.srt.disaggregation.fork_ending import pd_queues, request_end_cause
from sglang.srt.managers.fork_core import fork_touch

# Per-room (or per-peer-of-a-room) tables of upstream's Common/MooncakeKVManager (a role or backend may lack some)
KV_MANAGER_ROOM_TABLES = pd_queues.ROOM_TABLES + (
    "required_prefill_response_num_table", "prefill_response_tracker",
    "_deferred_ack_targets", "_deferred_ack_poisoned_rooms", "_deferred_abort_ack_tracker",
)


def kv_tokens(scheduler) -> Dict[str, int]:
    """KV tokens: total, free, evictable cache, protected, held (neither free nor evictable: owned by requests)."""
    total, free = int(scheduler.max_total_num_tokens), int(scheduler.token_to_kv_pool_allocator.available_size())
    evictable = int(scheduler.tree_cache.evictable_size())
    return {"total": total, "free": free, "evictable": evictable,
            "protected": int(scheduler.tree_cache.protected_size()), "held": total - free - evictable}


DECODE_REQ_POOL = "sglang.srt.disaggregation.decode.DecodeReqToTokenPool"  # the one with pre-allocated slots


def slots(allocator) -> Optional[Dict[str, int]]:
    """Free and total slots of a request or metadata-buffer allocator (decode's req pool: pre_alloc_size more)."""
    if allocator is None:
        return None
    total = allocator.size + fork_touch.upstream_on(allocator, "pre_alloc_size", DECODE_REQ_POOL, default=0)
    return {"free": int(allocator.available_size()), "total": int(total)}


def room_tables(kv_manager) -> Dict[str, int]:
    """The kv manager's per-room tables, each one's size (the report's `transfer_rooms`; the queue harness's snapshot
    counts them too): every one is empty when the server is idle."""
    tables = pd_queues.table_sizes(kv_manager, KV_MANAGER_ROOM_TABLES)
    tables["fork_end_causes"] = request_end_cause.tagged_rooms(kv_manager)  # the fork's, until each end is counted
    rooms_by_addr = getattr(kv_manager, "addr_to_rooms_tracker", None)  # decode's only (a report: what it has)
    if rooms_by_addr is not None:
        # list() copies the values in one step: transfer threads mutate the dict.
        tables["addr_to_rooms_tracker"] = sum(len(r) for r in list(rooms_by_addr.values()))
    return tables


def fork_tables(kv_manager) -> Dict[str, Dict[str, Any]]:
    """Every per-room and per-peer table the fork keeps for this kv manager and process: name -> {size, cap, why}
    (cap: a number, or what bounds it); `per_peer`: one entry per live peer may stay while idle; `memory`: kept
    after its request ended by design, until it expires; `counter`: a count, not a table. The others are empty
    when the server is idle (testing/pd_checks.held counts them)."""
    from sglang.srt.disaggregation.fork_ending import room_reads
    from sglang.srt.disaggregation.fork_ending.teller import teller
    from sglang.srt.disaggregation.fork_peers.peer_monitor import monitor_tables
    from sglang.srt.disaggregation.fork_transfer import poison_expiry, transfer_deadline
    from sglang.srt.managers.fork_pause import pd_pause

    return {
        **room_reads.ledger_tables(kv_manager),
        **teller.tables(),
        **transfer_deadline.fetch_tables(kv_manager),
        "poison_expiry": poison_expiry.poison_table(kv_manager),
        "pause_why": pd_pause.why_table(),
        **request_end_cause.tables(kv_manager),
        **monitor_tables(kv_manager),
    }


def build_report(scheduler) -> Dict[str, Any]:
    from sglang.srt.disaggregation.fork_ending import room_reads
    from sglang.srt.disaggregation.fork_transfer import transfer_deadline
    from sglang.srt.disaggregation.fork_peers.peer_monitor import peer_tables
    from sglang.srt.managers.fork_cache import weight_epoch
    from sglang.srt.managers.fork_pause import queue_buffers, scheduler_pause
    from sglang.srt.managers.fork_core.fork_plugin import hooks_applied

    mode = scheduler.disaggregation_mode
    kv_manager = pd_queues.kv_manager(scheduler)
    return {
        "disaggregation_mode": mode.value,
        "kv_tokens": kv_tokens(scheduler),
        "req_slots": slots(scheduler.req_to_token_pool),
        # PD modes only (upstream makes it with the PD queues)
        "metadata_slots": slots(None if mode.value == "null"
                                else fork_touch.upstream(scheduler, "req_to_metadata_buffer_idx_allocator")),
        "queues": pd_queues.lengths(scheduler),
        "transfer_rooms": None if kv_manager is None else room_tables(kv_manager),
        "hooks_applied": hooks_applied(),
        # fork_plugin.SWAPS made on this scheduler's kv manager (and its transfer engine), each still in place
        "swaps_applied": fork_touch.manager_swaps_applied(kv_manager, mode.value),
        "pause": scheduler_pause.report(scheduler),
        # the prefix cache's weight epoch (None before the first weight update)
        "weight_epoch": weight_epoch.report(scheduler),
        # which of upstream's is_fully_idle conditions fail now (a cache flush would be refused)
        "not_idle": scheduler_pause.not_idle_reasons(scheduler) if kv_manager is not None else [],
        "peers": None if kv_manager is None else peer_tables(kv_manager),
        "te_registration": None if kv_manager is None else queue_buffers.registration_report(scheduler, kv_manager),
        # decode: prefill info / endpoint fetches running on transfer_deadline's pool, totals
        "bootstrap_fetch": None if kv_manager is None else transfer_deadline.fetch_report(kv_manager),
        # Peer cancellations kept for rooms not created yet (bounded; held by no request).
        "cancelled_rooms": None if kv_manager is None else room_reads.report(kv_manager),
        # every per-room / per-peer table of the fork's, with its size, cap and why (`fork_tables`)
        "fork_tables": None if kv_manager is None else fork_tables(kv_manager),
    }


# What each rank holds on its own (its pools, queues and its kv manager's room tables): with more than one attention
# TP rank the report gives the other ranks' too (`other_ranks`), so a leak on rank 1 is seen as one on rank 0 is.
PER_RANK = ("kv_tokens", "req_slots", "metadata_slots", "queues", "transfer_rooms", "bootstrap_fetch",
            "cancelled_rooms", "fork_tables")


def _other_ranks(scheduler, report: Dict[str, Any]) -> Optional[list]:
    """The PER_RANK parts of every attention TP rank's report but this one's (every rank builds its report for
    the same request, so the gather is one collective all of them call); None with one rank."""
    from torch import distributed as dist

    from sglang.srt.managers.fork_core.fork_touch import upstream
    from sglang.srt.managers.fork_core.rank_agreement import gather

    group = upstream(scheduler, "attn_tp_cpu_group")
    gathered = gather(group, {key: report[key] for key in PER_RANK})
    if gathered is None:
        return None
    rank = dist.get_rank(group)
    return [r for i, r in enumerate(gathered) if i != rank]


def add_to_internal_state(result, controller, *args, **kwargs):
    """AFTER hook: result is upstream's GetInternalStateReqOutput."""
    report = build_report(controller.scheduler)
    report["other_ranks"] = _other_ranks(controller.scheduler, report)
    result.internal_state["fork_pd_resources"] = report
    return result
