"""PD queues release and re-register their transfer-engine buffers across a pause.

Released, a PD queue has nothing registered and no room state no live request owns; on resume the buffer
addresses are re-read first. Scheduler thread (docs/pause-release-resume.md).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List

from sglang.srt.disaggregation import pd_queues
from sglang.srt.managers import fork_touch, pd_pause

logger = logging.getLogger(__name__)


def queue_resume(original, queue, *args, **kwargs):
    """AROUND {PrefillBootstrapQueue,DecodePreallocQueue}.resume_memory_occupation: the KV and metadata buffer
    addresses (moved while released?) re-read into kv_args first."""
    from sglang.srt.disaggregation.utils import get_kv_transfer_buf_infos

    kv_args = queue.kv_manager.kv_args
    draft = fork_touch.upstream(queue, "draft_token_to_kv_pool")
    ptrs: List[int] = list(get_kv_transfer_buf_infos(queue.token_to_kv_pool)[0])
    if draft is not None:
        ptrs += list(draft.get_contiguous_buf_infos()[0])
    aux = list(queue.metadata_buffers.get_buf_infos()[0])
    for name, now in (("kv_data_ptrs", ptrs), ("aux_data_ptrs", aux)):
        if len(now) == len(getattr(kv_args, name)) and now != list(getattr(kv_args, name)):
            setattr(kv_args, name, now)
            logger.info("pd_pause: %s changed across release; re-registering", name)
    # room state the peer re-created while this side was released belongs to no live request
    forget_orphan_rooms(queue.scheduler, queue.kv_manager)
    result = original(queue, *args, **kwargs)
    queue.kv_manager._fork_registered_regions = _regions(queue.kv_manager)
    pd_pause.scheduler_pause(queue.scheduler).released = False
    return result


def queue_release(original, queue, *args, **kwargs):
    """AROUND {PrefillBootstrapQueue,DecodePreallocQueue}.release_memory_occupation."""
    forget_orphan_rooms(queue.scheduler, queue.kv_manager)
    result = original(queue, *args, **kwargs)
    queue.kv_manager._fork_registered_regions = 0
    pd_pause.scheduler_pause(queue.scheduler).released = True
    return result


def forget_orphan_rooms(scheduler, kv_manager) -> None:
    """Drop room state no live request owns (no transfer can run at release or resume)."""
    reqs = pd_queues.queued_reqs(scheduler) + list(scheduler.running_batch.reqs) + pd_queues.parked_reqs(scheduler)
    live = {fork_touch.upstream(r, "bootstrap_room") for r in reqs}
    tables = [t for name in pd_queues.ROOM_TABLES if isinstance(t := getattr(kv_manager, name, None), dict)]
    orphans = [(table, room) for table in tables for room in list(table) if room not in live]
    for table, room in orphans:
        table.pop(room, None)
    if orphans:
        logger.info("pd_pause: dropped %d room-table entries of ended requests", len(orphans))


def _regions(kv_manager) -> int:
    regions = getattr(kv_manager, "_registerable_regions", None)  # mooncake's; none on fake
    return len(regions()) if regions is not None else 0


def registration_report(kv_manager) -> Dict[str, Any]:
    """Regions this kv_manager has registered with the transfer engine right now."""
    n = getattr(kv_manager, "_fork_registered_regions", None)
    if n is None:  # never released: upstream registered everything at start-up
        n = _regions(kv_manager)
    return {"registered_regions": n, "kv_data_ptrs": list(kv_manager.kv_args.kv_data_ptrs)}
