"""The PD queue's KV and metadata buffers across release/resume (docs/pause-release-resume.md, "What release does").

Invariant: upstream releases a queue's buffers only once nothing is in flight (`weight_updater_release` ends it
first); across a release or a resume the room state of a request alive on this server is kept (one in the
scheduler's queues, or still on its way to them: a decode handshake prefill stored for a request held at its
tokenizer's pause gate or re-send wait) and no other room state outlives its request; a resume registers the buffers
at the addresses they have now (re-read into kv_args before upstream registers them). Scheduler thread only (hooks
on the weight updater and on the prefill bootstrap / decode prealloc queue); no lock. One `QueueBuffers` per PD queue,
reached through `buffers_of(queue)`; whether they are released is the scheduler pause's state (`RELEASED`)."""

from __future__ import annotations

import logging
from typing import Any, Dict, List

from sglang.srt.disaggregation.fork_ending import pd_queues, room_reads
from sglang.srt.managers.fork_core import fork_touch
from sglang.srt.managers.fork_pause.scheduler_pause import not_idle_reasons, pause_of

logger = logging.getLogger(__name__)

ATTR = "fork_buffers"  # on the prefill bootstrap / decode prealloc queue: its QueueBuffers


class QueueBuffers:
    """One PD queue's buffers (its kv manager's registration): released and resumed through upstream's queue
    methods, each moving the scheduler pause to or from `RELEASED`."""

    def __init__(self, queue: Any):
        self.queue = queue

    def release(self, original, *args, **kwargs):
        self.forget_orphan_rooms()
        result = original(self.queue, *args, **kwargs)
        pause_of(self.queue.scheduler).release()  # registration_report
        return result

    def resume(self, original, *args, **kwargs):
        self.reread_addresses()
        # room state the peer re-created while this side was released for a request that ended
        self.forget_orphan_rooms()
        result = original(self.queue, *args, **kwargs)
        pause_of(self.queue.scheduler).resume()
        return result

    def reread_addresses(self) -> None:
        """The KV and metadata buffer addresses (moved while released?) re-read into kv_args."""
        from sglang.srt.disaggregation.utils import get_kv_transfer_buf_infos

        queue = self.queue
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

    def forget_orphan_rooms(self) -> None:
        forget_orphan_rooms(self.queue.scheduler, self.queue.kv_manager)


def buffers_of(queue) -> QueueBuffers:
    """The queue's buffers (made at first use)."""
    buffers = queue.__dict__.get(ATTR)
    if buffers is None:
        buffers = queue.__dict__[ATTR] = QueueBuffers(queue)
    return buffers


def queue_release(original, queue, *args, **kwargs):
    """AROUND {PrefillBootstrapQueue,DecodePreallocQueue}.release_memory_occupation."""
    return buffers_of(queue).release(original, *args, **kwargs)


def queue_resume(original, queue, *args, **kwargs):
    """AROUND {PrefillBootstrapQueue,DecodePreallocQueue}.resume_memory_occupation: the KV and metadata buffer
    addresses (moved while released?) re-read into kv_args first."""
    return buffers_of(queue).resume(original, *args, **kwargs)


def weight_updater_release(original, weight_updater, recv_req, *args, **kwargs):
    """AROUND WeightUpdater.release_memory_occupation: what is in flight ends before upstream releases."""
    scheduler = weight_updater.scheduler
    if scheduler is not None:
        pause_of(scheduler).end_in_flight()
        if not weight_updater.is_fully_idle(ignore_waiting=fork_touch.upstream(scheduler, "_engine_paused")):
            logger.error("pd_pause: not idle before release: %s", not_idle_reasons(scheduler))
    return original(weight_updater, recv_req, *args, **kwargs)


def forget_orphan_rooms(scheduler, kv_manager) -> None:
    """Drop room state no live request owns (no transfer can run at release or resume). Alive: a request in the
    scheduler's queues, running or parked, and one this scheduler has not seen yet whose decode handshake is stored
    (`room_reads.awaits_its_request`: held at the tokenizer's pause gate, waiting in a re-send's wait, on the wire;
    its sender takes the handshake over after continue). Dropping that handshake left the request waiting for one
    that never came again (decode had sent it), until the transfer deadline."""
    reqs = pd_queues.queued_reqs(scheduler) + list(scheduler.running_batch.reqs) + pd_queues.parked_reqs(scheduler)
    live = {fork_touch.upstream(r, "bootstrap_room") for r in reqs}
    tables = [t for name in pd_queues.ROOM_TABLES if isinstance(t := getattr(kv_manager, name, None), dict)]
    rooms = {room for table in tables for room in table if room not in live}
    live |= {room for room in rooms if room_reads.awaits_its_request(kv_manager, room)}
    orphans = [(table, room) for table in tables for room in list(table) if room not in live]
    for table, room in orphans:
        table.pop(room, None)
    if orphans:
        logger.info("pd_pause: dropped %d room-table entries of ended requests", len(orphans))


def registration_report(scheduler, kv_manager) -> Dict[str, Any]:
    """Regions this kv_manager has registered with the transfer engine right now (all but while released)."""
    regions = getattr(kv_manager, "_registerable_regions", None)  # mooncake's; none on fake
    n = 0 if regions is None or pause_of(scheduler).released else len(regions())
    return {"registered_regions": n, "kv_data_ptrs": list(kv_manager.kv_args.kv_data_ptrs)}
