"""PD queues release and re-register their transfer-engine buffers across a pause.

Invariant: after `release_memory_occupation` a PD queue has nothing registered with
the transfer engine and its kv_manager keeps no room state that no live request owns;
on `resume_memory_occupation` the KV (and draft KV) and metadata buffer addresses are
re-read into kv_args before re-registering, so transfers after resume land in the
buffers as they are now (decode re-sends them at its next handshake).
Who calls: AROUND hooks on {PrefillBootstrapQueue,DecodePreallocQueue}.
{release,resume}_memory_occupation (fork_plugin.HOOKS); the resource report reads
`registration_report`.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List

from sglang.srt.disaggregation import pd_queues
from sglang.srt.managers import fork_touch, pd_pause

logger = logging.getLogger(__name__)


def refresh_addresses(queue) -> bool:
    """BEFORE a PD queue's resume_memory_occupation: re-read the KV and metadata
    buffer addresses (they may have moved while released) into the kv_manager's
    kv_args, so the re-registration and the next handshake use them."""
    from sglang.srt.disaggregation.utils import get_kv_transfer_buf_infos

    kv_args = queue.kv_manager.kv_args
    changed = False
    pools = [queue.token_to_kv_pool]
    draft = fork_touch.upstream(queue, "draft_token_to_kv_pool")
    ptrs: List[int] = list(get_kv_transfer_buf_infos(queue.token_to_kv_pool)[0])
    if draft is not None:
        ptrs += list(draft.get_contiguous_buf_infos()[0])
        pools.append(draft)
    if len(ptrs) == len(kv_args.kv_data_ptrs) and ptrs != list(kv_args.kv_data_ptrs):
        kv_args.kv_data_ptrs = ptrs
        changed = True
    aux = list(queue.metadata_buffers.get_buf_infos()[0])
    if len(aux) == len(kv_args.aux_data_ptrs) and aux != list(kv_args.aux_data_ptrs):
        kv_args.aux_data_ptrs = aux
        changed = True
    if changed:
        logger.info("pd_pause: KV buffer addresses changed across release; re-registering")
    return changed


def queue_resume(original, queue, *args, **kwargs):
    """AROUND {PrefillBootstrapQueue,DecodePreallocQueue}.resume_memory_occupation."""
    refresh_addresses(queue)
    # Room state the peer re-created while this side was released (its own teardown
    # messages, late handshakes of requests it ended) belongs to no live request.
    forget_orphan_rooms(queue.scheduler, queue.kv_manager)
    result = original(queue, *args, **kwargs)
    _note_registration(queue.kv_manager, registered=True)
    pd_pause.scheduler_pause(queue.scheduler).released = False
    return result


def queue_release(original, queue, *args, **kwargs):
    """AROUND {PrefillBootstrapQueue,DecodePreallocQueue}.release_memory_occupation."""
    forget_orphan_rooms(queue.scheduler, queue.kv_manager)
    result = original(queue, *args, **kwargs)
    _note_registration(queue.kv_manager, registered=False)
    pd_pause.scheduler_pause(queue.scheduler).released = True
    return result


def _live_rooms(scheduler) -> set:
    reqs = pd_queues.queued_reqs(scheduler) + list(scheduler.running_batch.reqs)
    reqs += pd_queues.parked_reqs(scheduler)
    return {fork_touch.upstream(r, "bootstrap_room") for r in reqs}


def forget_orphan_rooms(scheduler, kv_manager) -> int:
    """At release no transfer can run (the buffers are about to be deregistered):
    room state that no live request owns is dropped, not carried across the cycle."""
    live = _live_rooms(scheduler)
    dropped = 0
    for name in pd_queues.ROOM_TABLES:
        table = getattr(kv_manager, name, None)
        if not isinstance(table, dict):
            continue
        for room in [r for r in list(table) if r not in live]:
            table.pop(room, None)
            dropped += 1
    if dropped:
        logger.info("pd_pause: dropped %d room-table entries of ended requests", dropped)
    return dropped


def _regions(kv_manager) -> int:
    regions = getattr(kv_manager, "_registerable_regions", None)  # mooncake's; none on fake
    return len(regions()) if regions is not None else 0


def _note_registration(kv_manager, registered: bool) -> None:
    kv_manager._fork_registered_regions = _regions(kv_manager) if registered else 0


def registration_report(kv_manager) -> Dict[str, Any]:
    """Regions this kv_manager has registered with the transfer engine right now."""
    n = getattr(kv_manager, "_fork_registered_regions", None)
    if n is None:  # never released: upstream registered everything at start-up
        n = _regions(kv_manager)
    return {"registered_regions": n, "kv_data_ptrs": list(kv_manager.kv_args.kv_data_ptrs)}
