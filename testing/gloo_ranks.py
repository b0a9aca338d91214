"""Run a test's code on several ranks over real gloo: one spawned process per rank, joined through a file store.

`run_ranks(target, world, timeout)` starts `target(rank, store, out)` in each process (`store`: a file path for
`dist.init_process_group(init_method=f"file://{store}")`; `out`: a queue the rank puts `(rank, result)` on) and
returns {rank: result}; a rank that does not report within `timeout` s, or exits non-zero, fails the test.
`apply_fork_hooks(prefix)` applies, in the rank's process, the fork's hook table entries on upstream targets under
`prefix`, as the plugin applies them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
from typing import Any, Callable, Dict


def run_ranks(target: Callable[[int, str, Any], None], world: int, timeout: float) -> Dict[int, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=target, args=(rank, store, out)) for rank in range(world)]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=timeout) for _ in procs)
        for p in procs:
            p.join(60)
            assert p.exitcode == 0, (p.name, p.exitcode)
    return results


def apply_fork_hooks(prefix: str) -> None:
    """The fork's hook table entries (fork_plugin.HOOKS) whose upstream target starts with `prefix`, registered and
    applied through upstream's plugin registry in this process."""
    from sglang.srt.managers.fork_core import fork_plugin
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, ref, kind in fork_plugin.HOOKS:
        if target.startswith(prefix):
            module, fn = ref.split(":")
            HookRegistry.register(target, getattr(__import__(module, fromlist=[fn]), fn), HookType[kind])
    HookRegistry.apply_hooks()
