"""pause_generation in abort mode returns as soon as the aborted requests are gone.

Upstream's abort-mode pause (TokenizerManager.pause_generation, and the multi-tokenizer
variant) loops: abort_all, check `model_update_lock.is_locked()` (an in-flight request
holds a reader lock until its answer is out), and while it is locked sleeps a fixed
1 s -- so a pause with requests in flight took >= 1 s although the aborted requests
are answered within milliseconds each (bench/rl_step.py; target 0.25 s, issue 14). The
hook makes that check wait, up to WAIT_S, for the lock to come free, woken by the
lock's own condition (upstream's RWLock notifies it when the last reader leaves or a
writer releases), not by polling: the loop then sees it free on its first check.
Called by AROUND RWLock.is_locked (fork_plugin.HOOKS); upstream calls is_locked only
from those two pause loops (`CALLERS`).

Where the time goes (py-spy on every process of the paused server and CPU accounting
over the call, 256 in flight, fork and upstream; bench/README.md): the scheduler
retires the aborted requests in milliseconds; what remains is the HTTP-facing process
answering each aborted request (its output handed to the waiting handler, upstream's
HTTP middlewares and access log, the answer written, the request generator closed,
which releases the reader lock), one event loop for all of them: 0.13-0.52 s of its
CPU for 256 answers on the fork and upstream alike, stretched to 0.6-2.7 s of wall time
by the peer server, the balancer and the client answering the same requests on the
same 2 shared cores. The pause waits for exactly that, as upstream's does; nothing of
the fork runs per request in that process.
"""

from __future__ import annotations

import asyncio

from sglang.srt.managers import fork_touch

# Up to 3 s: while the drain takes less, the pause returns when it is done. A cap under
# upstream's 1 s sleep made the fork slower than upstream whenever the drain took
# 0.9-1.9 s (bench: 1.9 s vs 1.0 s on decode with 256 in flight), as the loop then
# slept its full second on top. Nothing new reaches the scheduler meanwhile (the pause
# gate holds it), so the loop's abort_all has nothing more to catch.
WAIT_S = 3.0


def _held(lock) -> bool:
    """upstream's is_locked condition, read under the lock's own asyncio lock."""
    return bool(fork_touch.upstream(lock, "_writer_active") or fork_touch.upstream(lock, "_readers") > 0)


async def around_is_locked(original, lock, *args, **kwargs):
    """AROUND sglang.srt.utils.aio_rwlock.RWLock.is_locked."""
    if not await original(lock, *args, **kwargs):
        return False
    cond = fork_touch.upstream(lock, "_cond")
    try:
        async with cond:
            await asyncio.wait_for(cond.wait_for(lambda: not _held(lock)), WAIT_S)
    except asyncio.TimeoutError:
        pass
    return await original(lock, *args, **kwargs)


# The upstream modules whose code calls RWLock.is_locked (both are abort-mode pause loops).
CALLERS = (
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.multi_tokenizer_mixin",
)
