"""A prefill transfer worker killed by an exception (real mooncake over TCP, two
processes): its room fails at once on both sides instead of staying Transferring,
nothing is left held, and the restarted worker serves the next request."""

import pytest

from testing.mooncake_pair import MooncakePair


@pytest.fixture(scope="module")
def pair():
    with MooncakePair() as p:
        p.idle = (p.prefill.call("snapshot"), p.decode.call("snapshot"))
        yield p


def _idle(pair):
    return (pair.prefill.call("snapshot"), pair.decode.call("snapshot")) == pair.idle


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
    pair.run_until(lambda: _idle(pair), timeout=60)
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
    pair.run_until(lambda: _idle(pair), timeout=30)
