"""The test-only fault switch SGLANG_TEST_DISAGG_FAIL_CHUNKS: what it accepts, what it
selects, and that it fails each selected write exactly once."""

import pytest

from sglang.srt.disaggregation.fork_transfer.chunk_failures import chunk_kind
from sglang.srt.disaggregation.fork_transfer.chunk_faults import FaultPlan

pytestmark = pytest.mark.unit


def test_unset_is_no_plan():
    assert FaultPlan.parse("") is None
    assert FaultPlan.parse(" , ") is None


@pytest.mark.parametrize(
    "spec",
    ["bogus:rid=x", "kv", "kv:rid=", "kv:room=abc", "kv:name=x", "kv+later:rid=x", "kv:rid"],
)
def test_malformed_value_is_rejected(spec):
    with pytest.raises(ValueError, match="SGLANG_TEST_DISAGG_FAIL_CHUNKS"):
        FaultPlan.parse(spec)


def test_selects_by_rid_prefix_and_room_once_per_kind():
    plan = FaultPlan.parse("kv:rid=bad-,state+failed:room=7, aux:rid=bad-aux")
    plan.bind("bad-1", 100)
    plan.bind("good-1", 101)
    plan.bind("bad-aux-2", 102)

    assert plan.take(101, "kv") is None
    assert plan.take(100, "aux") is None
    first = plan.take(100, "kv")
    assert first is not None and first.kind == "kv" and not first.mark_failed_first
    assert plan.take(100, "kv") is None  # once per room

    assert plan.take(102, "aux").kind == "aux"
    assert plan.take(102, "kv").kind == "kv"  # "bad-aux-2" also starts with "bad-"

    state = plan.take(7, "state")
    assert state is not None and state.mark_failed_first
    assert plan.take(7, "kv") is None


def test_first_entry_fires_on_a_requests_first_attempt_only():
    """`+first`: a recovery attempt's prefill leg (the rid with recovery_attempt's mark, a new room) is written
    cleanly, so a recovery can be shown to succeed; without it the entry fires again on the new room."""
    from sglang.srt.disaggregation.fork_ending.recovery_attempt import attempt_rid

    plan = FaultPlan.parse("kv+first:rid=bad-,aux:rid=bad-")
    plan.bind("bad-1", 100)
    plan.bind(attempt_rid("bad-1", 1), 200)
    plan.bind(attempt_rid("bad-1", 2), 300)
    first = plan.take(100, "kv")
    assert first is not None and first.first_only and not first.mark_failed_first
    assert plan.take(100, "kv") is None  # once per room, as any entry
    assert plan.take(200, "kv") is None and plan.take(300, "kv") is None  # never on a recovery attempt
    assert plan.take(200, "aux").kind == "aux" and plan.take(300, "aux").kind == "aux"  # without +first: every room
    assert [f.first_only for f in FaultPlan.parse("kv+failed+first@0:rid=x").faults] == [True]
    assert FaultPlan.parse("kv+delay=1+first:rid=x").faults[0].delay == 1.0


@pytest.mark.parametrize("spec", ["kv+first:room=7", "kv+first+failed:rid=x", "kv+firsts:rid=x"])
def test_first_needs_a_rid_and_comes_after_the_option(spec):
    with pytest.raises(ValueError, match="SGLANG_TEST_DISAGG_FAIL_CHUNKS"):
        FaultPlan.parse(spec)


def test_recovery_attempt_rids_round_trip():
    from sglang.srt.disaggregation.fork_ending import recovery_attempt as ra

    assert ra.split("r-1") == ("r-1", 0) and ra.is_first_attempt("r-1")
    assert ra.attempt_rid("r-1", 2) == "r-1" + ra.RID_MARK + "2"
    assert ra.split(ra.attempt_rid("r-1", 2)) == ("r-1", 2)
    assert ra.attempt_rid(ra.attempt_rid("r-1", 1), 2) == ra.attempt_rid("r-1", 2)  # never nested
    with pytest.raises(ValueError):
        ra.attempt_rid("r-1", 0)


def test_decode_classifies_upstream_reasons():
    assert chunk_kind("Failed to send kv chunk of 5 to 1.2.3.4:5") == "kv"
    assert chunk_kind("Failed to send aux data of 5") == "aux"
    assert chunk_kind("Failed to send state components of 5 to h:1") == "state"
    assert chunk_kind("Aborted by AbortReq.") is None
    assert chunk_kind(None) is None


def test_plugin_load_leaves_prometheus_unimported():
    """Plugins load before the server sets PROMETHEUS_MULTIPROC_DIR; importing
    prometheus_client then (e.g. through mooncake/conn.py) silently zeroes every
    metric of the HTTP process."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from sglang.srt.managers.fork_core import fork_plugin\n"
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "fork_plugin.register(); HookRegistry.apply_hooks()\n"
        "assert all(fork_plugin.hooks_applied().values())\n"
        "print('prometheus_client' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_rank_selector_keeps_only_this_ranks_entries():
    spec = "kv@1:rid=one-,aux:rid=all-,kv+failed@0:room=5"
    assert [(f.kind, f.rank) for f in FaultPlan.parse(spec, rank=1).faults] == [("kv", 1), ("aux", None)]
    assert [(f.kind, f.rank) for f in FaultPlan.parse(spec, rank=0).faults] == [("aux", None), ("kv", 0)]
    assert FaultPlan.parse("kv@1:rid=x", rank=0) is None  # nothing for rank 0: no plan, no cost
    assert len(FaultPlan.parse(spec).faults) == 3  # no rank given: every entry
    assert FaultPlan.parse(spec, rank=0).faults[1].mark_failed_first


def test_delay_entry_reports_the_write_late_and_does_not_fail_it():
    plan = FaultPlan.parse("kv+delay=2.5@1:rid=slow-", rank=1)
    (fault,) = plan.faults
    assert (fault.delay, fault.mark_failed_first, fault.rank) == (2.5, False, 1)
    plan.bind("slow-1", 9)
    assert plan.take(9, "kv").delay == 2.5
    assert plan.take(9, "kv") is None  # once per room


@pytest.mark.parametrize("spec", ["kv+delay=:rid=x", "kv+delay=x:rid=x", "kv@:rid=x", "kv@one:rid=x",
                                  "kv+failed+delay=1:rid=x"])
def test_malformed_rank_or_delay_is_rejected(spec):
    with pytest.raises(ValueError, match="SGLANG_TEST_DISAGG_FAIL_CHUNKS"):
        FaultPlan.parse(spec)


def test_a_delayed_write_holds_its_worker_then_reports_success():
    import time
    from types import SimpleNamespace

    from sglang.srt.disaggregation.fork_transfer.chunk_failures import checked

    mgr = SimpleNamespace(fork_chunk_faults=FaultPlan.parse("kv+delay=0.3:room=4"))
    t0 = time.monotonic()
    assert checked(mgr, 4, "kv", 0) == 0
    assert time.monotonic() - t0 >= 0.3
    t0 = time.monotonic()
    assert checked(mgr, 4, "kv", 0) == 0 and time.monotonic() - t0 < 0.3  # once
