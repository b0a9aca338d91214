"""pause_generation in abort mode returns as soon as the aborted requests are gone.

Upstream's abort-mode pause (TokenizerManager.pause_generation, and the multi-tokenizer
variant) loops: abort_all, check `model_update_lock.is_locked()` (an in-flight request
holds a reader lock until its answer is out), and while it is locked sleeps a fixed
1 s -- so a pause with requests in flight took >= 1 s although the aborted requests
are answered within milliseconds (bench/rl_step.py; target 0.25 s, issue 14). The hook
makes that check wait, polling every POLL_S, up to WAIT_S for the lock to come
free: the loop then sees it free on its first check. Called by
AROUND RWLock.is_locked (fork_plugin.HOOKS); upstream calls is_locked only from those
two pause loops, which `callers_of_is_locked` lets a test check.
"""

from __future__ import annotations

import asyncio
import time

POLL_S = 0.005
# Up to 3 s: while the drain takes less, the pause returns when it is done. A cap under
# upstream's 1 s sleep made the fork slower than upstream whenever the drain took
# 0.9-1.9 s (bench: 1.9 s vs 1.0 s on decode with 256 in flight), as the loop then
# slept its full second on top. Nothing new reaches the scheduler meanwhile (the pause
# gate holds it), so the loop's abort_all has nothing more to catch.
WAIT_S = 3.0


async def around_is_locked(original, lock, *args, **kwargs):
    """AROUND sglang.srt.utils.aio_rwlock.RWLock.is_locked."""
    deadline = time.monotonic() + WAIT_S
    locked = await original(lock, *args, **kwargs)
    while locked and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        locked = await original(lock, *args, **kwargs)
    return locked


# The upstream modules whose code calls RWLock.is_locked (both are abort-mode pause loops).
CALLERS = (
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.multi_tokenizer_mixin",
)
