"""How the fork touches upstream outside HookRegistry (fork_plugin.SWAPS, fork_touch), on
real mooncake managers over TCP loopback (testing/mooncake_pair.py):
- every declared swap is in place on a live prefill kv manager, and none is declared
  for decode;
- an upstream release that renamed a swapped attribute stops the prefill at start-up
  with an error naming that attribute (instead of a silent no-op), for an instance
  swap and for the class patch.
"""

import time

import pytest

from testing.mooncake_pair import RENAME_ENV, Side
from testing.pd_cluster import free_port
from testing.pd_checks import pair_fixture

pytestmark = pytest.mark.pair

MOONCAKE = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager"
D = "sglang.srt.disaggregation"
SWAPPED = {  # "target <- the hook that makes the swap"
    f"{MOONCAKE}._publish_peer_registration <- {D}.fork_peers.prefill_side_monitor:on_prefill_manager_init",
    f"{MOONCAKE}._handle_abort_notification <- {D}.fork_ending.room_kv_hooks:on_manager_init",
    f"{MOONCAKE}._handle_abort_notification <- {D}.fork_peers.prefill_side_monitor:on_prefill_manager_init",
    f"{MOONCAKE}.failed_sessions <- {D}.fork_transfer.chunk_failures:on_prefill_manager_init",
    f"{MOONCAKE}._send_probe <- {D}.fork_transfer.chunk_failures:on_prefill_manager_init",
    f"{MOONCAKE}.transfer_worker <- {D}.fork_transfer.chunk_failures:guard_transfer_worker",
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine.batch_transfer_sync"
    f" <- {D}.fork_transfer.paced_write:on_prefill_manager_init",
}
SIZES = dict(kv_tokens=512, req_slots=4, metadata_slots=4, max_context_len=64)

pair = pair_fixture(**SIZES)


def test_every_declared_swap_is_in_place_on_live_managers(pair):
    applied = pair.prefill.call("swaps_applied")
    assert set(applied) == SWAPPED
    assert all(applied.values()), applied
    assert pair.decode.call("swaps_applied") == {}
    # and the swapped paths serve: a request transfers
    room = pair.submit(prompt_len=12)
    pair.run_until(lambda: pair.decode.call("transferred", room), timeout=60)
    assert pair.decode.call("kv_bytes", room) == pair.prefill.call("kv_sent", room)
    pair.decode.call("finish", room)


@pytest.mark.parametrize("attr", ["_publish_peer_registration", "transfer_worker"])
def test_renamed_upstream_attribute_stops_prefill_at_start(attr):
    target = f"{MOONCAKE}.{attr}"
    t0 = time.monotonic()
    side = Side("prefill", free_port(), SIZES, {RENAME_ENV: target})
    try:
        with pytest.raises(RuntimeError) as failed:
            side.ready(120)
    finally:
        side.close()
    assert time.monotonic() - t0 < 120
    text = str(failed.value)
    assert "UpstreamChanged" in text, text[-2000:]
    assert f"upstream attribute {target} does not exist" in text, text[-2000:]


def test_an_attribute_of_one_backend_is_required_there_and_defaulted_elsewhere():
    from types import SimpleNamespace

    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.managers.fork_core import fork_touch

    class Renamed(MooncakeKVManager):  # as if upstream renamed `session_lock` (no __init__ ran: no attributes)
        pass

    mgr = Renamed.__new__(Renamed)
    with pytest.raises(fork_touch.UpstreamChanged, match="session_lock does not exist"):
        fork_touch.upstream_on(mgr, "session_lock", fork_touch.MOONCAKE_MANAGER, default=None)
    mgr.session_lock = lock = object()
    assert fork_touch.upstream_on(mgr, "session_lock", fork_touch.MOONCAKE_MANAGER) is lock
    assert fork_touch.upstream_on(mgr, "session_lock", fork_touch.COMMON_MANAGER) is lock  # a subclass counts
    other = SimpleNamespace()  # another backend (the fake one): upstream has no such attribute there
    assert fork_touch.upstream_on(other, "session_lock", fork_touch.MOONCAKE_MANAGER, default=7) == 7
    assert fork_touch.upstream_on(None, "session_lock", fork_touch.MOONCAKE_MANAGER) is None
