"""Aborts end as aborts, never as successes, and leave nothing behind (queue harness).

The stage x abort matrix on upstream's real PD queues (one harness per side for the
module; each test starts idle): what the client got (upstream's client-abort finish
reason: type "abort", no error status -- never 500, never a completion), that no KV
chunk went out after the abort, what the peer was told, what was counted (per cause,
and not as a bootstrap/transfer failure), and that nothing is held afterwards.
"""

import pytest

from sglang.srt.disaggregation.fork_ending import pd_queues
from sglang.srt.disaggregation.fork_ending import request_end_cause as ec
from sglang.srt.disaggregation.fork_ending import room_kv_hooks as ar
from sglang.srt.disaggregation.fork_ending import verdict, verdict_wording
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from testing.pd_checks import is_client_abort
from testing.queue_harness import KVPoll, Notice, PrefillHarness

pytestmark = pytest.mark.unit

FAILURE_COUNTERS = ("increment_bootstrap_failed_reqs", "increment_transfer_failed_reqs")
# The bounded memory of ended rooms that answers a late handshake (transfer_deadline).
TOMBSTONE = "fork_expired_rooms"


@pytest.fixture
def prefill(prefill_h):
    h = prefill_h
    h.assert_baseline(h.idle)
    h.hold_admission, h.chunk_size, h.during_forward = False, None, None
    h.before = (dict(h.counters.counts), dict(ec.COUNTS))
    return h


@pytest.fixture
def decode(decode_h):
    decode_h.assert_baseline(decode_h.idle)
    decode_h.before = (dict(decode_h.counters.counts), dict(ec.COUNTS))
    return decode_h


def assert_client_abort(h, req):
    final = h.outputs.final(req.rid)
    assert final is not None, f"{req.rid} never answered"
    assert is_client_abort(final.reason), final  # upstream's client abort: no error status
    assert h.outputs.status_code(req.rid) is None, final
    assert "transfer failed" not in str(final.reason) and "bootstrap failed" not in str(final.reason)
    assert [s for s in h.outputs.of(req.rid) if s.finished] == [final]  # ended exactly once


def assert_counted(h, role, stage):
    counts, causes = h.before
    for name in FAILURE_COUNTERS:
        assert h.counters.counts[name] == counts.get(name, 0), name  # not a failure
    new = {k: v - causes.get(k, 0) for k, v in ec.COUNTS.items() if v != causes.get(k, 0)}
    assert new == {(role, ec.CLIENT_ABORT, stage): 1}, new


def assert_room_gone(h, room):
    assert set(h.room_entries(room)) <= {TOMBSTONE}, h.room_entries(room)
    h.assert_baseline(h.idle)


def told_decode(h, room):
    return [n for n in h.faults.notices_for(room) if n.to == "decode" and n.status == KVPoll.Failed
            and verdict_wording.ABORT_TAG in (n.reason or "")]


def assert_prefill_abort_sent_nothing(h, req, stage):
    """Prefill's copy ended in `stage` before any KV chunk went out: answered as a client
    abort, decode told once, counted once under `stage`, nothing left."""
    room = req.bootstrap_room
    assert_client_abort(h, req)
    assert h.faults.calls_for(room, "send") == []  # KV never exposed to decode
    assert len(told_decode(h, room)) == 1
    assert_counted(h, "prefill", stage)
    assert_room_gone(h, room)


# ----------------------------------------------------------------------------- prefill


def _assert_ended_as_pause(h, req, key) -> None:
    """Answered as the pause's abort (200, its message), no failure counted, one end
    counted under `key` (role, "pause", stage)."""
    from sglang.srt.managers.fork_pause import pd_pause

    final = h.outputs.final(req.rid)
    assert final is not None and final.reason["type"] == "abort", final
    assert final.reason["message"] == pd_pause.PAUSE_ABORT_MESSAGE, final
    assert h.outputs.status_code(req.rid) is None, final
    counts, causes = h.before
    for name in FAILURE_COUNTERS:
        assert h.counters.counts[name] == counts.get(name, 0), name
    new = {k: v - causes.get(k, 0) for k, v in ec.COUNTS.items() if v != causes.get(k, 0)}
    assert new == {key: 1}, new


def test_prefill_bootstrap_queue_abort(prefill):
    h = prefill
    req, room = h.add_bootstrapping()  # decode's handshake not there yet
    assert req in h.queue.queue
    h.abort(req.rid)
    h.faults.release(room)
    h.tick()
    assert_prefill_abort_sent_nothing(h, req, pd_queues.PREFILL_BOOTSTRAP)


def test_prefill_bootstrap_queue_pause_abort(prefill):
    """The abort_all of an abort-mode pause (its finish reason names the pause) ends the
    request with the pause's message, counts it under "pause" (neither client_abort
    nor a failure) and tells decode why."""
    from sglang.srt.managers.fork_pause import pd_pause
    from sglang.srt.managers.io_struct import AbortReq

    h = prefill
    req, room = h.add_bootstrapping()
    with h.active():
        h.scheduler.abort_request(AbortReq(abort_all=True, finished_reason=pd_pause.pause_finish_reason()))
    h.faults.release(room)
    h.tick()
    _assert_ended_as_pause(h, req, ("prefill", ec.PAUSE, pd_queues.PREFILL_BOOTSTRAP))
    notices = told_decode(h, room)
    assert len(notices) == 1 and pd_pause.PAUSE_ABORT_MESSAGE in notices[0].reason, notices
    assert_room_gone(h, room)


def test_prefill_waiting_queue_abort(prefill):
    h = prefill
    h.hold_admission = True
    req = h.add(h.make_req())
    h.tick()
    assert req in h.waiting
    h.abort(req.rid)
    h.hold_admission = False
    h.tick()
    # upstream: request_status (Failed) and failure_records kept the room forever
    assert_prefill_abort_sent_nothing(h, req, pd_queues.PREFILL_WAITING)


def test_prefill_abort_while_batch_runs_sends_no_kv(prefill):
    h = prefill
    req = h.add(h.make_req(tokens=range(200, 212)))
    h.during_forward = lambda reqs: h.abort(req.rid) if req in reqs else None
    h.tick()
    h.during_forward = None
    assert h.outputs.final(req.rid).output_ids == ()  # no token streamed
    assert_prefill_abort_sent_nothing(h, req, pd_queues.PREFILL_RUNNING)


def test_prefill_abort_between_chunks(prefill):
    h = prefill
    h.chunk_size = 4
    req = h.add(h.make_req(tokens=range(300, 314)))
    room = req.bootstrap_room
    h.run_until(lambda: len(h.faults.calls_for(room, "send")) >= 1)  # a first chunk went out
    sent = len(h.faults.calls_for(room, "send"))
    h.abort(req.rid)
    h.run_until(lambda: h.outputs.final(req.rid) is not None)
    h.tick(2)
    assert_client_abort(h, req)
    assert not any(c.detail["last"] for c in h.faults.calls_for(room, "send"))
    assert len(h.faults.calls_for(room, "send")) <= sent + 1  # at most the chunk already computed
    assert len(told_decode(h, room)) == 1
    assert_counted(h, "prefill", pd_queues.PREFILL_RUNNING)
    assert_room_gone(h, room)


def test_prefill_inflight_abort(prefill):
    h = prefill
    req, room = h.add_held()
    assert h.inflight == [req] and h.room_state(room) == "Transferring"
    h.abort(req.rid)
    h.faults.release(room)
    h.tick()
    assert_client_abort(h, req)
    assert len(told_decode(h, room)) == 1
    assert_counted(h, "prefill", pd_queues.PREFILL_INFLIGHT)
    assert_room_gone(h, room)


def test_prefill_transfer_done_while_abort_pending_is_not_a_success(prefill):
    """The race: the abort is pending on the request (to_finish, as upstream's abort
    of a running request leaves it) when the poll reports Success."""
    h = prefill
    req, room = h.add_held()
    req.to_finish = FINISH_ABORT()
    h.faults.release(room)
    h.tick()
    assert h.room_state(room) == "Success"
    assert_client_abort(h, req)  # upstream: 200, finish_reason length
    assert len(told_decode(h, room)) == 1  # decode must not run it either
    assert_counted(h, "prefill", pd_queues.PREFILL_INFLIGHT)
    assert_room_gone(h, room)


def test_prefill_failure_still_counts_as_failure(prefill):
    """The other causes are unchanged: a transport failure is a 500 and a failure."""
    h = prefill
    req = h.add(h.make_req())
    h.faults.set(req.bootstrap_room, KVPoll.Failed)
    h.tick()
    assert h.outputs.status_code(req.rid) == 500
    counts, causes = h.before
    assert h.counters.counts["increment_bootstrap_failed_reqs"] == counts.get("increment_bootstrap_failed_reqs", 0) + 1
    key = ("prefill", ec.TRANSPORT, pd_queues.PREFILL_BOOTSTRAP)
    assert ec.COUNTS[key] == causes.get(key, 0) + 1
    h.assert_baseline(h.idle)


def test_prefill_bad_aborts_are_harmless(prefill):
    h = prefill
    h.abort("no-such-rid")  # unknown
    done = h.add(h.make_req())
    h.run_until(lambda: h.outputs.final(done.rid) is not None)
    h.abort(done.rid)  # finished
    assert h.outputs.status_code(done.rid) == 200

    req, _ = h.add_held()
    h.abort(req.rid)
    h.abort(req.rid)  # twice before it is retired
    h.faults.release(req.bootstrap_room)
    h.tick()
    h.abort(req.rid)  # already aborted
    h.tick()
    assert_client_abort(h, req)
    assert len(told_decode(h, req.bootstrap_room)) == 1
    assert_counted(h, "prefill", pd_queues.PREFILL_INFLIGHT)
    assert_room_gone(h, req.bootstrap_room)


# ----------------------------------------------------------------------------- decode


def test_decode_prealloc_abort(decode):
    h = decode
    req, room = h.add_bootstrapping()
    h.abort(req.rid)
    h.faults.release(room)
    h.tick()
    assert_client_abort(h, req)
    assert h.faults.notices_for(room) == [Notice(room, "prefill", KVPoll.Failed, "abort")]
    assert_counted(h, "decode", pd_queues.DECODE_PREALLOC)
    assert h.room_entries(room) == []
    h.assert_baseline(h.idle)


def test_decode_transfer_abort(decode):
    h = decode
    req, room = h.add_held()
    h.run_until(lambda: len(h.transfer_queue.queue) == 1)
    h.abort(req.rid)
    h.faults.release(room)
    h.tick()
    assert_client_abort(h, req)
    assert h.outputs.final(req.rid).output_ids == ()
    assert h.faults.notices_for(room) == [Notice(room, "prefill", KVPoll.Failed, "abort")]
    assert_counted(h, "decode", pd_queues.DECODE_TRANSFER)
    assert h.room_entries(room) == []
    h.assert_baseline(h.idle)


@pytest.mark.parametrize("stage", ["prealloc", "transfer"])
def test_decode_ends_a_room_prefill_aborted_as_an_abort(decode, stage):
    """Prefill's Failed with the abort reason: decode frees its preallocation now and
    answers an abort without generating a token (not a 500 transfer failure)."""
    h = decode
    req = h.add(h.make_req())
    room = req.bootstrap_room
    if stage == "prealloc":
        h.faults.set(room, KVPoll.Bootstrapping)
        h.tick()
    else:
        h.faults.hold_transfer(room)
        h.run_until(lambda: len(h.transfer_queue.queue) == 1)
    h.kv_manager.record_failure(room, verdict.peer_reason(req.rid, room, "prefill"))
    h.faults.set(room, KVPoll.Failed)
    h.tick()
    assert_client_abort(h, req)
    assert h.outputs.final(req.rid).output_ids == ()
    assert_counted(h, "decode", pd_queues.DECODE_PREALLOC if stage == "prealloc" else pd_queues.DECODE_TRANSFER)
    assert h.room_entries(room) == []
    h.assert_baseline(h.idle)
    h.faults.release(room)


@pytest.mark.parametrize("then_bare", [False, True], ids=["named", "then_upstreams_bare_abort"])
def test_decode_ends_a_room_prefills_pause_ended_as_a_pause_abort(decode, then_bare):
    """Prefill's Failed naming its pause: decode's copy ends with that message, counted
    under "pause" (not client_abort, not a transfer failure) -- also when the sender's Failed
    then arrives with upstream's bare "Aborted by AbortReq." (a room prefill was sending)."""
    from sglang.srt.managers.fork_pause import pd_pause

    h = decode
    req, room = h.add_held()
    h.run_until(lambda: len(h.transfer_queue.queue) == 1)
    reasons = [verdict.peer_reason(req.rid, room, "prefill", pd_pause.PAUSE_ABORT_MESSAGE)]
    reasons += ["Aborted by AbortReq."] if then_bare else []
    for reason in reasons:  # through the hook around the manager's own (CommonKVManager's on mooncake)
        ar.around_record_failure(type(h.kv_manager).record_failure, h.kv_manager, room, reason)
    h.faults.set(room, KVPoll.Failed)
    h.tick()
    _assert_ended_as_pause(h, req, ("decode", ec.PAUSE, pd_queues.DECODE_TRANSFER))
    assert h.room_entries(room) == []
    h.assert_baseline(h.idle)
    h.faults.release(room)


# ----------------------------------------------------------------------------- other causes


def test_deadline_expiry_counts_as_timeout(monkeypatch):
    """The transfer deadline tags its rooms "timeout": counted once under that cause
    (and as upstream's failure), and the tag does not outlive the request."""
    from sglang.srt.disaggregation.fork_transfer import transfer_deadline as td
    from sglang.srt.disaggregation.fork_ending.room_ledger import engine_clock

    now = [1000.0]
    monkeypatch.setattr(engine_clock, "_monotonic", lambda: now[0])
    td.reset_scan_schedule()
    with PrefillHarness(server_args={"disaggregation_transfer_timeout": 5.0}) as h:
        idle = h.snapshot()
        causes = dict(ec.COUNTS)
        req, _ = h.add_held()
        now[0] += 6.0
        td.reset_scan_schedule()
        h.tick()
        assert h.outputs.status_code(req.rid) == 504
        new = {k: v - causes.get(k, 0) for k, v in ec.COUNTS.items() if v != causes.get(k, 0)}
        assert new == {("prefill", ec.TIMEOUT, pd_queues.PREFILL_INFLIGHT): 1}, new
        assert h.counters.counts["increment_transfer_failed_reqs"] == 1
        assert ec.tagged_rooms(h.kv_manager) == 0
        h.faults.release(req.bootstrap_room)
        h.assert_baseline(idle)
    td.reset_scan_schedule()
