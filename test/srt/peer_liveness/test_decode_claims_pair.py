"""A request decode holds in its prealloc queue -- claimed with prefill, no handshake yet, waiting for KV -- is bound
to that decode: when the decode dies, prefill ends it 502 naming that decode within the lost-decode handshake
timeout of the loss (the requests it had shaken hands for end at the loss), holds nothing afterwards, and forgets the
claims. Real mooncake over TCP between two processes (the queue harness on each side)."""

import time

import pytest

from testing.pd_checks import pair_fixture

pytestmark = pytest.mark.pair

HEARTBEAT = 2.0
ENV = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": str(HEARTBEAT),
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
    "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": "60",
}
HANDSHAKE_TIMEOUT = 5.0  # SGLANG_FORK_LOST_DECODE_HANDSHAKE_TIMEOUT, its default
# loss declared within a heartbeat, then the rule's timeout, generously (busy 2-core machine)
END_BOUND = HEARTBEAT + HANDSHAKE_TIMEOUT + 6.0
# two metadata slots: decode preallocates two requests and holds the others in its prealloc queue
pair = pair_fixture(scope="function", prefill_env=ENV, decode_env=ENV, kv_tokens=2048, req_slots=8,
                    metadata_slots=2, max_context_len=64)


def test_a_request_the_lost_decode_held_in_its_prealloc_queue_ends_502_naming_it(pair):
    idle = pair.prefill.call("snapshot")
    rooms = [pair.new_room() for _ in range(4)]
    for room in rooms:  # both legs, as a balancer sends them
        pair.prefill.call("add", room, 12, None)
        pair.decode.call("add", room, 12, None)
    deadline = time.monotonic() + 60
    while (queues := pair.decode.call("snapshot")["queues"])["transfer"] < 2 or queues["prealloc"] < 2:
        assert time.monotonic() < deadline, queues
        pair.decode.call("tick")
    while pair.prefill.call("peers")["monitor_claims"] < 4:  # each claimed as it entered decode's prealloc queue
        assert time.monotonic() < deadline, pair.prefill.call("peers")
        pair.prefill.call("tick")
    peer = None

    t_kill = time.monotonic()
    pair.decode.kill()
    while any(pair.prefill.call("status", room) is None for room in rooms):
        assert time.monotonic() - t_kill < END_BOUND, [pair.prefill.call("status", r) for r in rooms]
        pair.prefill.call("tick")
    ended_s = time.monotonic() - t_kill
    statuses = {room: pair.prefill.call("status", room) for room in rooms}
    reasons = {room: pair.prefill.call("reason", room) for room in rooms}
    held = [room for room in rooms if "which took request" in (reasons[room] or "")]
    assert len(held) == 2, reasons  # the two in decode's prealloc queue, bound to it by their claims
    for room in held:
        assert statuses[room] == 502, (statuses, reasons)
        peer = reasons[room].split("decode peer ")[1].split(",")[0]
        assert f"PD peer lost: decode peer {peer}, which took request " in reasons[room], reasons[room]
    for room in set(rooms) - set(held):  # handshaken: ended at the loss (or by the write that revealed it)
        assert (statuses[room], "PD peer lost" in reasons[room] or "Failed to send kv chunk" in reasons[room]) in (
            (500, True), (502, True)), (statuses, reasons)
    assert ended_s < END_BOUND
    print(f"claimed requests of the killed decode ended {ended_s:.1f}s after the kill")

    # nothing held on prefill, and the claims went with the rooms
    deadline = time.monotonic() + 15
    while pair.prefill.call("snapshot") != idle or pair.prefill.call("peers")["monitor_claims"]:
        assert time.monotonic() < deadline, (pair.prefill.call("snapshot"), idle, pair.prefill.call("peers"))
        pair.prefill.call("tick")
