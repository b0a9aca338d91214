"""Transfer deadline and its unbounded-loop cousins over real mooncake (TCP, two
processes, queue harness on each side; deadline 3 s):
- a prefill transfer worker killed by an exception: its room fails at once on both
  sides instead of staying Transferring, nothing is left held, and the restarted
  worker serves the next request;
- decode's handshake arriving after prefill's deadline expired the room: decode is
  answered Failed (504, the reason) at once and prefill does not re-create the room.
"""

import time

import pytest

from testing.pd_checks import pair_fixture, wait_pair_idle
from testing.pd_checks import pair_is_idle as _idle

pytestmark = pytest.mark.pair

DEADLINE = 3.0
# decode's deferred release of a room whose drain ack is poisoned (upstream's default
# 30 s, which this test would only wait out): as in test_transfer_worker_guard_pair
RELEASE_TIMEOUT_S = 3.0

pair = pair_fixture(
    server_args={"disaggregation_transfer_timeout": DEADLINE},
    decode_env={"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(RELEASE_TIMEOUT_S)},
)


def test_dead_worker_fails_its_room_and_restarts(pair):
    assert _idle(pair)
    pair.prefill.call("break_transfer_engine_once")
    room = pair.submit(prompt_len=12)

    took = pair.run_until(
        lambda: pair.prefill.call("status", room) is not None
        and pair.decode.call("status", room) is not None,
        timeout=30,
    )
    assert took < 15, took  # upstream: Transferring forever
    assert pair.prefill.call("status", room) == 500
    assert "injected transfer engine error" in pair.prefill.call("reason", room)
    # decode heard it from prefill (the room's Failed status), not from its own timer
    assert pair.decode.call("status", room) == 500
    assert "injected transfer engine error" in pair.decode.call("reason", room)
    wait_pair_idle(pair, timeout=60)
    # Upstream's worker poisons the room's drain ACK when a send raised (another
    # layer's write may still be running), and keeps the mark until the room id is
    # reused; decode then frees its pages after its deferred-release timeout.
    assert pair.prefill.call("room_entries", room) in ([], ["_deferred_ack_poisoned_rooms"])
    assert pair.decode.call("room_entries", room) == []

    # the worker runs again: the next request on the same shard transfers
    ok = pair.submit(prompt_len=12)
    pair.run_until(lambda: pair.decode.call("transferred", ok), timeout=30)
    assert pair.decode.call("kv_bytes", ok) == pair.prefill.call("kv_sent", ok)
    pair.decode.call("finish", ok)
    wait_pair_idle(pair)


def test_late_handshake_after_prefill_deadline_is_refused(pair):
    assert _idle(pair)
    room = pair.new_room()
    t0 = time.monotonic()
    pair.prefill.call("add", room, 12)  # decode's leg is late
    while pair.prefill.call("status", room) is None:
        assert time.monotonic() - t0 < DEADLINE + 10
        pair.prefill.call("tick")
    assert time.monotonic() - t0 >= DEADLINE  # not early
    assert pair.prefill.call("status", room) == 504
    assert "prefill_bootstrap" in pair.prefill.call("reason", room)
    # only the room ledger's bounded memory of ended rooms holds it
    assert pair.prefill.call("room_entries", room) == []
    assert "prefill_bootstrap" in pair.prefill.call("late_answer", room)

    pair.decode.call("add", room, 12)  # now decode hands prefill its pages
    took = pair.run_until(lambda: pair.decode.call("status", room) is not None, timeout=30)
    assert took < DEADLINE - 0.5, took  # told by prefill, not by its own deadline
    assert pair.decode.call("status", room) == 504
    assert "prefill_bootstrap" in pair.decode.call("reason", room)
    # the cause came as a field with prefill's answer (its deadline, remembered with the room), not read from the text
    assert pair.decode.call("told", room) == "PEER_DEADLINE"
    wait_pair_idle(pair)
    # upstream: request_status/transfer_infos re-created on prefill and never cleared
    assert pair.prefill.call("room_entries", room) == []
    assert pair.decode.call("room_entries", room) == []
