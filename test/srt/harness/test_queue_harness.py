"""The queue harness drives upstream's real PD queues and observes what a fault leaves.

One harness per side for the module; each test starts by checking it is idle.
"""

import pytest

from testing.queue_harness import KVPoll, Notice

pytestmark = pytest.mark.unit


@pytest.fixture
def prefill(prefill_h):
    prefill_h.assert_baseline(prefill_h.idle)
    return prefill_h


@pytest.fixture
def decode(decode_h):
    decode_h.assert_baseline(decode_h.idle)
    return decode_h


def test_prefill_happy_path(prefill):
    h = prefill
    # not in the radix cache yet; held at Transferring to look at the held state
    req, room = h.add_held(tokens=range(100, 110))

    assert [c.name for c in h.faults.calls_for(room)] == ["init", "send"]
    send = h.faults.calls_for(room, "send")[0]
    assert send.detail["last"] and len(send.detail["pages"]) == 10
    assert h.inflight == [req] and h.room_state(room) == "Transferring"
    held = h.snapshot()
    assert (held.kv_held, held.req_slots_held, held.metadata_held) == (10, 1, 1)
    assert held.rooms == (room,)
    assert h.outputs.final(req.rid) is None

    h.faults.release(room)
    h.tick()
    assert h.room_state(room) == "Success"
    assert h.outputs.status_code(req.rid) == 200
    assert h.outputs.final(req.rid).output_ids == (h.next_token,)
    assert h.faults.calls_for(room)[-1].name == "clear"
    assert h.faults.notices_for(room) == []
    h.assert_baseline(h.idle)
    assert h.snapshot().kv_evictable >= 10  # the radix cache kept the prompt


def test_prefill_bootstrap_failed(prefill):
    h = prefill
    req = h.add(h.make_req())
    h.faults.set(req.bootstrap_room, KVPoll.Failed)
    failed_before = h.counters.counts["increment_bootstrap_failed_reqs"]
    h.tick()

    assert h.outputs.status_code(req.rid) == 500
    assert "bootstrap failed" in h.outputs.final(req.rid).reason["message"]
    assert h.counters.counts["increment_bootstrap_failed_reqs"] == failed_before + 1
    assert h.faults.calls_for(req.bootstrap_room, "send") == []
    h.assert_baseline(h.idle)


def _transfer_failed(h):
    """A held transfer turned Failed: the room Failed, a 500, one transfer failure
    counted. Returns (request, room)."""
    req, room = h.add_held()
    assert h.snapshot().kv_held > 0
    failed_before = h.counters.counts["increment_transfer_failed_reqs"]

    h.faults.set(room, KVPoll.Failed)
    h.tick()

    assert h.room_state(room) == "Failed"
    assert h.outputs.status_code(req.rid) == 500
    assert h.counters.counts["increment_transfer_failed_reqs"] == failed_before + 1
    return req, room


def test_prefill_transfer_failed(prefill):
    h = prefill
    req, room = _transfer_failed(h)
    assert "failure_exception" in [c.name for c in h.faults.calls_for(room)]
    h.assert_baseline(h.idle)


@pytest.mark.parametrize("kind", ["kv", "last"])
def test_prefill_chunk_failure_tells_decode(prefill, kind):
    h = prefill
    h.chunk_size = 4  # 14 prompt tokens: three non-last chunks, then the last
    try:
        first = {"kv": 500, "last": 600}[kind]  # uncached prompts
        req = h.add(h.make_req(tokens=range(first, first + 14)))
        room = req.bootstrap_room
        h.faults.fail_chunk(room, kind, reason=f"{kind} chunk ret=-1")
        h.run_until(lambda: h.outputs.final(req.rid) is not None, max_ticks=10)
    finally:
        h.chunk_size = None

    assert h.faults.calls_for(room, "send")[0].detail["last"] is False
    assert h.faults.notices_for(room) == [
        Notice(room, "decode", KVPoll.Failed, f"{kind} chunk ret=-1")
    ]
    assert h.outputs.status_code(req.rid) == 500
    assert f"{kind} chunk ret=-1" in h.outputs.final(req.rid).reason["message"]
    h.assert_baseline(h.idle)


def test_decode_happy_path(decode):
    h = decode
    req, room = h.add_held(prompt_len=12)

    calls = h.faults.calls_for(room)
    assert [c.name for c in calls] == ["init", "send_metadata"]
    held = h.snapshot()
    assert dict(held.queues)["transfer"] == 1
    assert (held.kv_held, held.req_slots_held, held.metadata_held) == (12, 1, 1)
    # the destination pages sent to prefill are the ones decode allocated
    row = h.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :12].tolist()
    assert calls[1].detail["pages"] == row

    h.faults.release(room)
    h.tick()
    assert h.waiting == [req] and len(req.output_ids) == 1
    after = h.snapshot()
    assert (after.kv_held, after.metadata_held, after.rooms) == (12, 0, ())

    h.finish(req)
    assert h.outputs.status_code(req.rid) == 200
    h.assert_baseline(h.idle)


def test_decode_fake_transfer_without_host(decode):
    """A request sent to a fake-backend decode without bootstrap_host is served as the
    fake transfer upstream intends (pd_queues.fake_bootstrap_addr; upstream's
    _bootstrap_addr raised on NetworkAddress(None, ...) and killed the scheduler)."""
    h = decode
    req = h.make_req(prompt_len=6)
    req.bootstrap_host = None
    h.add(req)
    h.run_until(lambda: req in h.waiting)
    assert len(req.output_ids) == 1
    h.finish(req)
    assert h.outputs.status_code(req.rid) == 200
    h.assert_baseline(h.idle)


def test_decode_transfer_failed(decode):
    h = decode
    _transfer_failed(h)
    assert h.waiting == []
    h.assert_baseline(h.idle)


def test_decode_abort_tells_prefill(decode):
    h = decode
    req, room = h.add_held()

    h.abort(req.rid)  # the real Scheduler.abort_request
    h.tick()

    assert h.faults.notices_for(room) == [Notice(room, "prefill", KVPoll.Failed, "abort")]
    assert h.outputs.final(req.rid).reason["type"] == "abort"
    h.assert_baseline(h.idle)
