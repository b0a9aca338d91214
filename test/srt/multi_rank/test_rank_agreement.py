"""rank_agreement over real gloo groups (two processes, no server, a few seconds): ranks that see different things
on their own clocks leave with the same decision (any_rank), so they call the same collectives next; and a rank
left waiting in a collective by a rank that stopped fails after SGLANG_FORK_GLOO_TIMEOUT (gloo_timeout on upstream's
GroupCoordinator) instead of upstream's 120 minutes. The end-to-end proof at TP=2 is test_tensor_parallel_e2e.py."""

from __future__ import annotations

import functools
import os
import time
from types import SimpleNamespace

import pytest

from testing.gloo_ranks import apply_fork_hooks, run_ranks
from testing.polling import wait_until

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


GLOO_TIMEOUT_S = 3.0
# rank 0's collective must fail after the gloo timeout, and well before upstream's 120 minutes: the bound is the
# timeout plus the time a loaded 2-core machine may take to run rank 0 again and raise (seconds, not minutes)
STUCK_FAILS_WITHIN_S = GLOO_TIMEOUT_S + 20


def _stuck_rank(rank: int, store: str, out, group_attr: str = "cpu_group") -> None:
    """Upstream's GroupCoordinator over two ranks with the fork's hook on its __init__ (the knob set as the test
    deployments set it); rank 0 enters an all-reduce on the group's `group_attr` (cpu_group: the PD polls and the
    scheduler's broadcasts; device_group: on CPU also gloo, the model's all-reduce in a forward pass), rank 1 stays
    alive and never joins (a rank stopped elsewhere), until rank 0 has its outcome."""
    os.environ["SGLANG_FORK_GLOO_TIMEOUT"] = str(GLOO_TIMEOUT_S)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    apply_fork_hooks("sglang.srt.distributed.parallel_state.GroupCoordinator.__init__")
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    group = GroupCoordinator([[0, 1]], rank, "gloo", use_pynccl=False, use_mscclpp=False, use_custom_allreduce=False,
                             use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False,
                             use_xpu_communicator=False, group_name="fork_gloo_timeout_test")
    rank0_done = store + ".rank0-done"
    if rank == 0:
        started = time.monotonic()
        try:
            dist.all_reduce(torch.zeros(1), group=getattr(group, group_attr))
            error = None
        except RuntimeError as e:
            error = str(e)
        out.put((0, (time.monotonic() - started, error)))
        with open(rank0_done, "w"):
            pass
    else:
        wait_until(lambda: os.path.exists(rank0_done), STUCK_FAILS_WITHIN_S + 60, "rank 0's stuck collective to end")
        out.put((1, None))
    # no destroy_process_group: rank 0's group is broken by the timeout; the processes exit


@pytest.mark.parametrize("group_attr", ["cpu_group", "device_group"])
def test_a_rank_left_in_a_collective_fails_after_the_gloo_timeout(group_attr):
    results = run_ranks(functools.partial(_stuck_rank, group_attr=group_attr), WORLD, timeout=STUCK_FAILS_WITHIN_S + 90)
    took, error = results[0]
    assert error is not None, f"the all-reduce returned without rank 1 ({took:.1f}s)"
    assert "timed out" in error.lower() or "timeout" in error.lower(), error
    assert GLOO_TIMEOUT_S - 0.5 <= took <= STUCK_FAILS_WITHIN_S, (took, error)
