"""rank_agreement.any_rank over real gloo groups (two processes, no server, a few seconds): ranks that see
different things on their own clocks leave with the same decision, so they call the same collectives next.
The end-to-end proof at TP=2 is test_tensor_parallel_e2e.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from testing.gloo_ranks import run_ranks

pytestmark = pytest.mark.pair

WORLD = 2
# (rank 0's flags, rank 1's flags) -> what both must decide
CASES = [
    ((True, False), (False, False), [True, False]),  # rank 0 still holds a request, rank 1 is empty: one more pass
    ((False, False), (False, True), [False, True]),  # rank 1's deadline passed first: both stop now
    ((False, False), (False, False), [False, False]),
]


def _rank(rank: int, store: str, out) -> None:
    import torch.distributed as dist

    from sglang.srt.managers.fork_core.rank_agreement import any_rank

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        tp = dist.new_group([0, 1], backend="gloo")
        # every rank creates every group (torch's rule): the one-rank CP groups {0} and {1}
        cp_groups = [dist.new_group([r], backend="gloo") for r in range(WORLD)]
        cp = cp_groups[rank]
        scheduler = SimpleNamespace(attn_tp_cpu_group=tp, attn_cp_cpu_group=cp)
        out.put((rank, [any_rank(scheduler, *case[rank]) for case in CASES]))
    finally:
        dist.destroy_process_group()


def test_ranks_that_see_different_flags_take_the_same_decision():
    results = run_ranks(_rank, WORLD, timeout=120)
    expected = [case[2] for case in CASES]
    assert results == {0: expected, 1: expected}
