"""The test-only fault switch SGLANG_TEST_DISAGG_FAIL_CHUNKS: what it accepts, what it
selects, and that it fails each selected write exactly once."""

import pytest

from sglang.srt.disaggregation.fork_transfer.chunk_failures import FaultPlan, chunk_kind


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
