"""One decision, taken once, the same on every rank (docs/layout.md, threading model).

A scheduler with more than one attention TP/CP rank runs the PD queues' polls as collectives (upstream's MIN
all-reduce of `KVPoll`): every rank must call the same collectives in the same order. A fork decision that changes
which collectives a rank calls next (one more drain pass, one more queue pump in the paused loop) is taken with
`any_rank`, never on one rank's clock. A room failed on one rank (a deadline on the answering rank, `answers`; a
failed write, a lost peer, a given-up fetch on any rank) reaches the others as `KVPoll.Failed` through the poll
all-reduce, and what that rank knows of it through `gather` right after (disaggregation/fork_ending/room_agreement).

Also `SGLANG_FORK_GLOO_TIMEOUT`: the timeout of upstream's gloo (CPU) groups, 120 minutes upstream; tests set a
short one so that a rank stuck in a collective fails the test in seconds instead of hanging it. And a rank that
fails takes its server down at once (`crash_diagnostics_that_can_run`): upstream's crash path waits 5 s and then
60 s for GPU core dumps before it kills the server, also where none can be taken.

Thread: the scheduler's (each call is a collective of its group).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
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
    the gloo groups' timeout; unset or 0: upstream's. Upstream passes it to the CPU group only; the device group
    gets upstream's --dist-timeout (parallel_state._MODEL_PARALLEL_GROUP_TIMEOUT; unset: torch's 30 minutes). On
    CPU the device group is gloo too and carries the model's all-reduce, where a decode rank whose peer rank
    stopped waits: unless --dist-timeout set one, it gets the same timeout."""
    seconds = knobs.GLOO_TIMEOUT.get()
    if seconds > 0:
        kwargs["gloo_timeout"] = timedelta(seconds=seconds)
        # (self, group_ranks, local_rank, torch_distributed_backend, ...)
        backend = kwargs.get("torch_distributed_backend", args[3] if len(args) > 3 else None)
        if str(backend) == "gloo":
            from sglang.srt.distributed import parallel_state

            if upstream(parallel_state, "_MODEL_PARALLEL_GROUP_TIMEOUT") is None:
                parallel_state._MODEL_PARALLEL_GROUP_TIMEOUT = kwargs["gloo_timeout"]
        if not _logged:
            _logged.append(seconds)
            logger.info("gloo groups' timeout: %gs (SGLANG_FORK_GLOO_TIMEOUT)", seconds)
        return args, kwargs
    return None


_logged: List[float] = []


def crash_diagnostics_that_can_run(original, self, *args, **kwargs):
    """AROUND managers.tokenizer_manager.TokenizerManager.dump_requests_before_crash, which upstream's SIGQUIT
    handler (a scheduler rank raised: e.g. a gloo collective past its timeout) runs before it kills the server's
    process tree. Upstream then sleeps 5 s "to let GPU activity settle", runs py-spy on every scheduler and waits
    SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS (60 s) for CUDA core dumps, also where none can be taken: without
    CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1 (upstream's own precondition: it logs that none was triggered and waits
    anyway) or without py-spy on PATH. For that minute the server's HTTP and bootstrap servers stay up: new requests
    wait on a dead scheduler and the PD peer's heartbeat still finds the server alive. Here each of the two
    diagnostics runs only where it can (the requests' dump to --crash-dump-folder always runs), so a server that can
    take neither goes down at once. Thread: the tokenizer manager's main thread (the signal handler)."""
    with contextlib.ExitStack() as stack:
        from sglang.srt.environ import envs

        if os.environ.get("CUDA_ENABLE_USER_TRIGGERED_COREDUMP") != "1":
            stack.enter_context(envs.SGLANG_CUDA_COREDUMP_BEFORE_CRASH.override(False))
        if shutil.which("py-spy") is None:
            stack.enter_context(envs.SGLANG_PYSPY_DUMP_BEFORE_CRASH.override(False))
        return original(self, *args, **kwargs)
