"""Transfer deadline on the real PD queues (queue harness): in every stage an overdue
request ends in HTTP 504 naming stage/rid/room/knob, its room fails, the peer hears,
the stage counter counts it, everything it held is back, and the other requests of the
same pass finish normally. Time runs on a scripted monotonic source under the real
`engine_clock`, so a pause is the real pause()/resume().
"""

import pytest

from sglang.srt.disaggregation.fork_transfer import transfer_deadline as td
from sglang.srt.disaggregation.fork_ending.room_ledger import engine_clock
from testing.queue_harness import DecodeHarness, KVPoll, Notice, PrefillHarness

pytestmark = pytest.mark.unit

DEADLINE = 5.0


class ScriptedTime:
    def __init__(self):
        self.t = 10_000.0

    def __call__(self):
        return self.t

    def advance(self, seconds):
        self.t += seconds


@pytest.fixture
def clock(monkeypatch):
    assert not engine_clock.paused
    time = ScriptedTime()
    monkeypatch.setattr(engine_clock, "_monotonic", time)
    td.reset_scan_schedule()
    yield time
    engine_clock.resume()
    td.reset_scan_schedule()


@pytest.fixture(scope="module")
def prefill_h():
    with PrefillHarness(server_args={"disaggregation_transfer_timeout": DEADLINE}) as h:
        h.idle = h.snapshot()
        yield h


@pytest.fixture(scope="module")
def decode_h():
    with DecodeHarness(server_args={"disaggregation_transfer_timeout": DEADLINE}) as h:
        h.idle = h.snapshot()
        yield h


@pytest.fixture
def prefill(prefill_h, clock):
    prefill_h.assert_baseline(prefill_h.idle)
    prefill_h.hold_admission = False
    yield prefill_h
    prefill_h.hold_admission = False


@pytest.fixture
def decode(decode_h, clock):
    decode_h.assert_baseline(decode_h.idle)
    return decode_h


def expire(h, clock, stage):
    """Tick once (the request is seen in its stage), pass the deadline, tick once."""
    before = td.COUNTS[stage]
    h.tick()
    clock.advance(DEADLINE + 1)
    td.reset_scan_schedule()
    h.tick()
    return td.COUNTS[stage] - before


def assert_504(h, req, stage):
    assert h.outputs.status_code(req.rid) == 504
    text = h.outputs.final(req.rid).reason["message"]
    for part in (stage, req.rid, f"bootstrap_room={req.bootstrap_room}", "6.0s",
                 "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT", "--disaggregation-transfer-timeout"):
        assert part in text, (part, text)


# ----------------------------------------------------------------------------- prefill


def test_prefill_bootstrap_expires(prefill, clock):
    h = prefill
    req = h.add(h.make_req())
    room = req.bootstrap_room
    h.faults.set(room, KVPoll.Bootstrapping)  # decode never answers

    assert expire(h, clock, td.PREFILL_BOOTSTRAP) == 1

    assert_504(h, req, td.PREFILL_BOOTSTRAP)
    assert h.room_state(room) == "Failed"
    assert [n.to for n in h.faults.notices_for(room)] == ["decode"]
    assert h.faults.calls_for(room, "send") == []
    h.faults.release(room)
    h.assert_baseline(h.idle)


def test_prefill_waiting_expires(prefill, clock):
    h = prefill
    h.hold_admission = True  # bootstrapped, but prefill compute never gets to it
    req = h.add(h.make_req(tokens=range(200, 210)))
    h.tick()
    assert h.waiting == [req]

    assert expire(h, clock, td.PREFILL_WAITING) == 1

    assert_504(h, req, td.PREFILL_WAITING)
    assert h.waiting == []
    assert [n.status for n in h.faults.notices_for(req.bootstrap_room)] == [KVPoll.Failed]
    h.assert_baseline(h.idle)


@pytest.mark.parametrize("state", ["WaitingForInput", "Transferring"])
def test_prefill_inflight_expires_others_finish(prefill, clock, state):
    h = prefill
    stuck = h.add(h.make_req(tokens=range(300, 310)))
    room = stuck.bootstrap_room
    if state == "Transferring":
        h.faults.hold_transfer(room)
    else:  # bootstrapped and sent, but the transfer never starts
        h.faults.set(room, KVPoll.WaitingForInput)
    h.tick()
    assert h.inflight == [stuck]
    assert h.snapshot().kv_held == 10
    # a healthy request whose transfer concludes in the very pass the stuck one expires
    healthy = h.add(h.make_req(tokens=range(400, 410)))
    h.faults.hold_transfer(healthy.bootstrap_room)
    h.tick()
    h.faults.release(healthy.bootstrap_room)
    failed_before = h.counters.counts["increment_transfer_failed_reqs"]

    clock.advance(DEADLINE + 1)
    td.reset_scan_schedule()
    count_before = td.COUNTS[td.PREFILL_INFLIGHT]
    h.tick()

    assert td.COUNTS[td.PREFILL_INFLIGHT] == count_before + 1
    assert_504(h, stuck, td.PREFILL_INFLIGHT)
    assert h.outputs.status_code(healthy.rid) == 200
    assert [n.to for n in h.faults.notices_for(room)] == ["decode"]
    assert h.faults.notices_for(healthy.bootstrap_room) == []
    # still a transfer failure for upstream's counter; the deadline counter says why
    assert h.counters.counts["increment_transfer_failed_reqs"] == failed_before + 1
    h.faults.release(room)
    h.assert_baseline(h.idle)


@pytest.fixture
def other_rank_transferring(monkeypatch):
    """Another attention TP rank whose part of every transfer is still in flight: upstream's MIN all-reduce of the
    polls gives at most Transferring while `pending` holds (this rank's own Success stays cached in its sender)."""
    from sglang.srt.disaggregation import utils

    reduce, other = utils._all_reduce_polls, {"pending": True}

    def with_other_rank(polls, group):
        polls = reduce(polls, group)
        return [min(p, int(KVPoll.Transferring)) for p in polls] if other["pending"] else polls

    monkeypatch.setattr(utils, "_all_reduce_polls", with_other_rank)
    return other


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_expires_when_this_rank_is_done_and_another_is_not(prefill_h, decode_h, clock, other_rank_transferring,
                                                           side):
    """TP > 1: this rank's transfer concluded Success, another rank's has not, so the request stays in the stage:
    the deadline (decided on this rank) still ends it 504 (its endpoint's cached Success was kept before)."""
    h, stage = (prefill_h, td.PREFILL_INFLIGHT) if side == "prefill" else (decode_h, td.DECODE_TRANSFER)
    h.assert_baseline(h.idle)
    req = h.add(h.make_req(tokens=range(500, 510)) if side == "prefill" else h.make_req(prompt_len=10))
    for _ in range(3):  # this rank's part concludes (Success, cached); the stage holds it for the other rank
        h.tick()
    queue = h.inflight if side == "prefill" else [d.req for d in h.scheduler.disagg_decode_transfer_queue.queue]
    assert queue == [req] and h.outputs.final(req.rid) is None

    assert expire(h, clock, stage) == 1

    assert_504(h, req, stage)
    other_rank_transferring["pending"] = False
    h.tick()
    h.assert_baseline(h.idle)


def test_pause_longer_than_deadline_expires_nothing(prefill, clock):
    h = prefill
    req = h.add(h.make_req(tokens=range(500, 510)))
    room = req.bootstrap_room
    h.faults.hold_transfer(room)
    h.tick()
    before = dict(td.COUNTS)

    engine_clock.pause()
    clock.advance(10 * DEADLINE)
    td.reset_scan_schedule()
    h.tick()  # a pass during the pause sees the clock stand still
    engine_clock.resume()
    clock.advance(DEADLINE / 2)
    td.reset_scan_schedule()
    h.tick()

    assert dict(td.COUNTS) == before
    assert h.outputs.final(req.rid) is None and h.inflight == [req]
    h.faults.release(room)
    h.tick()
    assert h.outputs.status_code(req.rid) == 200
    h.assert_baseline(h.idle)


def test_knob_prefers_server_arg(prefill):
    with prefill.active():
        assert td.configured() == DEADLINE


# ----------------------------------------------------------------------------- decode


def test_decode_prealloc_expires(decode, clock):
    h = decode
    req = h.add(h.make_req())
    room = req.bootstrap_room
    h.faults.set(room, KVPoll.Bootstrapping)  # prefill never answers the handshake

    assert expire(h, clock, td.DECODE_PREALLOC) == 1

    assert_504(h, req, td.DECODE_PREALLOC)
    assert h.faults.notices_for(room) == [Notice(room, "prefill", KVPoll.Failed, "abort")]
    h.faults.release(room)
    h.assert_baseline(h.idle)


def test_decode_transfer_expires(decode, clock):
    h = decode
    req = h.add(h.make_req(prompt_len=12))
    room = req.bootstrap_room
    h.faults.hold_transfer(room)
    h.tick()
    assert dict(h.snapshot().queues)["transfer"] == 1 and h.snapshot().kv_held == 12

    assert expire(h, clock, td.DECODE_TRANSFER) == 1

    assert_504(h, req, td.DECODE_TRANSFER)
    assert h.faults.notices_for(room) == [Notice(room, "prefill", KVPoll.Failed, "abort")]
    assert h.waiting == []
    h.faults.release(room)
    h.assert_baseline(h.idle)


def test_under_deadline_nothing_expires(decode, clock):
    h = decode
    req = h.add(h.make_req(prompt_len=8))
    h.faults.hold_transfer(req.bootstrap_room)
    h.tick()
    clock.advance(DEADLINE - 0.5)
    td.reset_scan_schedule()
    h.tick()
    assert h.outputs.final(req.rid) is None
    h.faults.release(req.bootstrap_room)
    h.tick()
    h.finish(req)
    assert h.outputs.status_code(req.rid) == 200
    h.assert_baseline(h.idle)


def test_decode_answers_504_when_prefill_deadline_failed_the_room(decode, clock):
    """Prefill's deadline reached decode as the room's failure reason (the status
    message): decode's client gets 504 as well, not a generic 500."""
    h = decode
    req = h.add(h.make_req(prompt_len=8))
    room = req.bootstrap_room
    h.faults.hold_transfer(room)
    h.tick()
    reason = f"{td.TAG}: request p-1 (bootstrap_room={room}) spent 6.0s in stage prefill_inflight"
    with h.active():  # what apply_prefill_status does with prefill's Failed message
        h.kv_manager.record_failure(room, reason)
        h.kv_manager.update_status(room, KVPoll.Failed)
    h.tick()
    assert h.outputs.status_code(req.rid) == 504
    assert "prefill_inflight" in h.outputs.final(req.rid).reason["message"]
    h.faults.release(room)
    h.assert_baseline(h.idle)
