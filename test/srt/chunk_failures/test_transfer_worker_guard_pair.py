"""chunk_failures.guard_transfer_worker over real mooncake (TCP loopback, two processes, queue harness
on each side), with no transfer deadline to fall back on (the default, 600 s): an
exception in a prefill transfer worker moves the room it was sending to Failed on both
sides with a reason naming the exception, within seconds (upstream: Transferring
forever, the worker thread dead); nothing is left held on either side; the restarted
worker serves the requests after it, byte-identical.
"""

import pytest

from testing.pd_checks import assert_pair_serves, assert_pair_idle, pair_fixture, wait_pair_idle

pytestmark = pytest.mark.pair

RELEASE_TIMEOUT_S = 3.0  # decode's deferred release of a room whose drain ack is poisoned
ERROR = "injected transfer engine error"
N_AFTER = 6

# on both sides, as an operator sets it: prefill drops the worker's poison mark at the same deadline
RELEASE_ENV = {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(RELEASE_TIMEOUT_S)}
pair = pair_fixture(
    prefill_env=RELEASE_ENV, decode_env=RELEASE_ENV,
    kv_tokens=1024, req_slots=N_AFTER + 2, metadata_slots=N_AFTER + 2, max_context_len=64,
)


def test_worker_exception_fails_its_room_naming_it_and_nothing_is_held(pair):
    assert_pair_idle(pair)
    assert pair.prefill.call("swaps_applied")[
        "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.transfer_worker"
        " <- sglang.srt.disaggregation.fork_transfer.chunk_failures:guard_transfer_worker"]
    failed_before = {s.role: s.call("counter", "increment_transfer_failed_reqs") for s in (pair.prefill, pair.decode)}
    pair.prefill.call("break_transfer_engine_once")
    room = pair.submit(prompt_len=12)

    took = pair.run_until(
        lambda: pair.prefill.call("status", room) is not None and pair.decode.call("status", room) is not None,
        timeout=60,
    )
    assert took < 20, took
    for side in (pair.prefill, pair.decode):  # what each client saw
        assert side.call("status", room) == 500, side.role
        assert ERROR in side.call("reason", room), (side.role, side.call("reason", room))
        assert side.call("finals", room) == 1, side.role
    for side in (pair.prefill, pair.decode):  # counted once per side, as a transfer failure
        assert side.call("counter", "increment_transfer_failed_reqs") - failed_before[side.role] == 1, side.role
    # nothing held: decode frees the pages at its deferred-release deadline (the worker poisons the drain ack, a
    # write may have been running); prefill drops that mark at the same deadline (upstream keeps it for good)
    assert wait_pair_idle(pair, timeout=RELEASE_TIMEOUT_S + 30) < RELEASE_TIMEOUT_S + 25
    assert pair.prefill.call("room_entries", room) == []
    assert pair.decode.call("room_entries", room) == []

    # the worker runs again: every request after it transfers intact
    rooms = [pair.submit(prompt_len=8 + i) for i in range(N_AFTER)]
    assert_pair_serves(pair, rooms)
    for r in rooms:
        assert pair.decode.call("status", r) == 200
    assert wait_pair_idle(pair, timeout=30) < 30
