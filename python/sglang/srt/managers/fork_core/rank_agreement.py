"""One decision, taken once, the same on every rank (docs/layout.md, threading model).

A scheduler with more than one attention TP/CP rank runs the PD queues' polls as collectives (upstream's MIN
all-reduce of `KVPoll`): every rank must call the same collectives in the same order. A fork decision that changes
which collectives a rank calls next (one more drain pass, one more queue pump in the paused loop) is taken with
`any_rank`, never on one rank's clock. A room failed on one rank (a deadline on the answering rank, `answers`; a
failed write, a lost peer, a given-up fetch on any rank) reaches the others as `KVPoll.Failed` through the poll
all-reduce, and what that rank knows of it through `gather` right after (disaggregation/fork_ending/room_agreement).

Also `SGLANG_FORK_GLOO_TIMEOUT`: the timeout of upstream's gloo (CPU) groups, 120 minutes upstream; tests set a
short one so that a rank stuck in a collective fails the test in seconds instead of hanging it.

Thread: the scheduler's (each call is a collective of its group).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, List, Optional

from sglang.srt.managers.fork_core import knobs
from sglang.srt.managers.fork_core.fork_touch import upstream

logger = logging.getLogger(__name__)
GROUPS = ("attn_tp_cpu_group", "attn_cp_cpu_group")  # as upstream's poll all-reduce, in its order


def attn_tp_rank() -> int:
    """This process's attention TP rank (0 without a runtime context: one rank)."""
    from sglang.srt.runtime_context import get_parallel

    return int(upstream(get_parallel(), "attn_tp_rank") or 0)


def answers() -> bool:
    """Whether this rank answers the client (attention TP/CP rank 0, PP rank 0): the one that decides a
    transfer deadline or a lost decode's orphans, and counts what only one rank may count."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return all(upstream(parallel, rank) == 0 for rank in ("attn_tp_rank", "attn_cp_rank", "pp_rank"))


def any_rank(scheduler, *flags: bool) -> List[bool]:
    """Each flag, True if it is True on any rank of the scheduler's attention TP and CP groups: one gloo
    all-reduce per group; none with a single rank. Every rank must call it at the same point."""
    from torch import distributed as dist

    from sglang.srt.disaggregation.utils import all_reduce_flags

    values = [int(bool(f)) for f in flags]
    for group in GROUPS:
        values = all_reduce_flags(values, upstream(scheduler, group), dist.ReduceOp.MAX)
    return [bool(v) for v in values]


def group_size(group: Any) -> int:
    """How many ranks `group` has (1 for None: no group)."""
    from torch import distributed as dist

    return 1 if group is None else dist.get_world_size(group)


def gather(group: Any, mine: Any) -> Optional[List[Any]]:
    """Every rank's `mine` in `group`'s rank order (one all_gather_object), or None with one rank. Every rank of
    `group` must call it at the same point."""
    from torch import distributed as dist

    size = group_size(group)
    if size == 1:
        return None
    gathered: List[Any] = [None] * size
    dist.all_gather_object(gathered, mine, group=group)
    return gathered


def gloo_timeout(*args, **kwargs):
    """BEFORE distributed.parallel_state.GroupCoordinator.__init__: SGLANG_FORK_GLOO_TIMEOUT (seconds > 0) as
    the gloo groups' timeout; unset or 0: upstream's."""
    seconds = knobs.GLOO_TIMEOUT.get()
    if seconds > 0:
        kwargs["gloo_timeout"] = timedelta(seconds=seconds)
        if not _logged:
            _logged.append(seconds)
            logger.info("gloo groups' timeout: %gs (SGLANG_FORK_GLOO_TIMEOUT)", seconds)
        return args, kwargs
    return None


_logged: List[float] = []
