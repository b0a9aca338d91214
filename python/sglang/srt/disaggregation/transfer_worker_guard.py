"""A prefill transfer worker that dies does not strand its rooms.

When a mooncake transfer worker raises, its rooms in flight end through the ledger (500,
decode told) and the loop starts again on the same queue. A class patch (SWAPS) installed
BEFORE `PrefillBootstrapQueue._init_kv_manager`.
"""

from __future__ import annotations

import functools
import logging

from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.room_ledger import end_room
from sglang.srt.managers import fork_touch

logger = logging.getLogger(__name__)


def rooms_in_flight(kv_mgr, queue) -> list:
    """Rooms with a chunk in flight on `queue`'s worker (sharded as add_transfer_request does)."""
    queues = kv_mgr.transfer_queues
    shard = next(i for i, q in enumerate(queues) if q is queue)

    def shard_of(room: int):
        sessions = list(kv_mgr.transfer_infos.get(room) or ())
        return sum(int(s.rsplit(":", 1)[1]) for s in sessions) % len(queues) if sessions else None

    return [room for room, count in list(kv_mgr._staging_outstanding.items()) if count > 0 and shard_of(room) == shard]


def around_transfer_worker(original, kv_mgr, queue, *args, **kwargs):
    """Upstream's worker loop, run again after it raised; its rooms end through the ledger."""
    while True:
        try:
            return original(kv_mgr, queue, *args, **kwargs)
        except Exception as exc:
            if fork_touch.upstream(kv_mgr, "_stopped"):
                raise
            for room in rooms_in_flight(kv_mgr, queue):
                reason = f"KV transfer worker raised while sending room {room}: {exc!r}; restarted"
                logger.error(reason)
                if kv_mgr.request_status.get(room) not in (None, KVPoll.Success):
                    end_room(kv_mgr, room, None, reason)
                kv_mgr._staging_outstanding.pop(room, None)


def install(*args, **kwargs) -> None:
    """BEFORE PrefillBootstrapQueue._init_kv_manager: wrap MooncakeKVManager.transfer_worker once."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    if getattr(fork_touch.upstream(MooncakeKVManager, "transfer_worker"), "fork_guarded", False):
        return

    def guarding(original):
        @functools.wraps(original)
        def guarded(kv_mgr, queue, *a, **kw):
            return around_transfer_worker(original, kv_mgr, queue, *a, **kw)

        guarded.fork_guarded = True
        return guarded

    fork_touch.swap(MooncakeKVManager, "transfer_worker", guarding, by=__name__, kind="class")
