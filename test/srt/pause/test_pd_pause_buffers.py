"""Release/resume with KV buffers that move (real mooncake over TCP, two processes):
the side that moved re-registers its new addresses and the next transfer goes between
the new buffers, byte for byte: decode's moved buffers receive it (nothing is written
to the old ones), prefill's moved buffers are what is sent (its old ones, filled with
a constant as reused memory would be, are not read)."""

import pytest

from testing.pd_checks import assert_pair_idle, pair_fixture

pytestmark = pytest.mark.pair


def _transfer(pair, prompt_len: int) -> int:
    room = pair.submit(prompt_len=prompt_len)
    took = pair.run_until(lambda: pair.decode.call("transferred", room)
                          and pair.prefill.call("status", room) is not None, timeout=60)
    assert took < 30
    assert pair.prefill.call("status", room) == 200
    sent = pair.prefill.call("kv_sent", room)
    assert len(sent) > 0 and any(sent)
    assert pair.decode.call("kv_bytes", room) == sent
    pair.decode.call("finish", room)
    assert_pair_idle(pair)
    return room


# One request before, so the decode side has registered with prefill already.
pair = pair_fixture(prepare=lambda p: _transfer(p, prompt_len=12))


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_transfer_after_resume_uses_moved_buffers(pair, side):
    moved = getattr(pair, side).call("move_kv_buffers", poison_old=side == "prefill")
    assert moved["after"] == moved["buffers"]               # kv_args follow the buffers
    assert set(moved["after"]).isdisjoint(moved["before"])  # and they really moved
    _transfer(pair, prompt_len=20)  # read from / written to the new buffers, byte check
    assert getattr(pair, side).call("old_kv_unchanged")      # the old ones untouched


def _handshaken(pair, prompt_len: int) -> int:
    """A request decode has (its handshake sent) whose prefill copy has not reached prefill's scheduler (held at
    prefill's pause gate): prefill stores decode's handshake for a room it has not seen."""
    room = pair.new_room()
    pair.decode.call("add", room, prompt_len, None)
    pair.run_until(lambda: "transfer_infos" in pair.prefill.call("room_entries", room), timeout=30)
    return room


def test_a_handshake_for_a_request_still_at_the_gate_survives_release_and_resume(pair):
    """Prefill released and resumed (its buffers moved) between decode's handshake and the request's arrival at its
    scheduler (the request waited at prefill's pause gate): the handshake is kept (`room_reads.awaits_its_request`),
    the request then transfers from prefill's new buffers to the addresses decode's handshake named, byte for byte,
    and nothing is left. Before the fix the release dropped the handshake and the request waited for one that never
    came again (the transfer deadline: 504 on both sides; upstream 0.5.23 keeps it and completes)."""
    room = _handshaken(pair, prompt_len=20)
    pair.prefill.call("move_kv_buffers", poison_old=True)  # release -> resume, the KV buffers at new addresses
    assert {"transfer_infos", "request_status"} <= set(pair.prefill.call("room_entries", room))
    pair.prefill.call("add", room, 20, None)  # the request, past the gate after continue
    took = pair.run_until(lambda: pair.decode.call("transferred", room)
                          and pair.prefill.call("status", room) is not None, timeout=60)
    assert took < 30
    assert pair.prefill.call("status", room) == 200
    sent = pair.prefill.call("kv_sent", room)
    assert len(sent) > 0 and any(sent) and pair.decode.call("kv_bytes", room) == sent
    assert pair.prefill.call("old_kv_unchanged")  # read from the new buffers only
    pair.decode.call("finish", room)
    assert_pair_idle(pair)


def test_a_handshake_for_a_room_ended_here_is_dropped_at_release(pair):
    """The other half of the rule: room state whose request ended on prefill goes at release. One room prefill
    failed itself (its failure recorded, decode told), one the ledger remembers as ended (a failed sender's clear):
    neither is a request on its way, and neither outlives the release; decode's copies end, nothing is held."""
    failed = _handshaken(pair, prompt_len=12)
    pair.prefill.call("end_room", failed, "ended on prefill before its request arrived")
    remembered = _handshaken(pair, prompt_len=12)
    pair.prefill.call("disown", remembered, True)
    pair.prefill.call("move_kv_buffers")
    assert pair.prefill.call("room_entries", failed) == []
    assert pair.prefill.call("room_entries", remembered) == []
    pair.decode.call("abort", remembered)  # its client gives up: nothing on prefill will ever answer it
    pair.run_until(lambda: all(pair.decode.call("final_reason", r) is not None for r in (failed, remembered)),
                   timeout=30)
    assert pair.decode.call("final_reason", failed)["type"] == "abort"  # prefill's end reaches decode's client
    assert pair.decode.call("final_reason", remembered)["type"] == "abort"
    _transfer(pair, prompt_len=16)  # serving goes on (and ends idle)
