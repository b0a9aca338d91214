"""A room one rank failed is answered, counted and remembered alike on every rank (room_agreement), over real gloo
groups in two processes (no server, a few seconds): each rank runs upstream's poll_and_all_reduce with the fork's
hook table entries applied, on its own kv manager state (upstream's CommonKVManager methods on a bare object), the
room ledger and the end-cause tags of its own. The end-to-end proof at TP=2: test_tensor_parallel_rank_faults_e2e.
"""

from __future__ import annotations

import threading

import pytest

from sglang.srt.disaggregation.fork_ending.room_agreement import Known, agreed
from sglang.srt.disaggregation.fork_ending.room_ledger import CANCEL_REASON
from sglang.srt.disaggregation.fork_ending.room_transitions import Transition
from testing.gloo_ranks import apply_fork_hooks, run_ranks

pytestmark = pytest.mark.pair

WORLD = 2
KV_FAILED = "Failed to send kv chunk of bootstrap_room 11 to 127.0.0.1:7000"
LOST = "PD peer lost: decode peer 127.0.0.1:7001 lost (refused)"
DEADLINE = "PD transfer deadline exceeded: request r13 (bootstrap_room=13) spent 10.1s in stage prefill_bootstrap"


def _manager(*bases):
    """A prefill kv manager's room tables and upstream's own methods over them (no transfer engine); `bases`: the
    upstream class it passes for (its __init__ not run)."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.fork_ending.room_ledger import ATTR, RoomLedger
    from sglang.srt.disaggregation.utils import DisaggregationMode

    class Manager(*bases):
        record_failure = CommonKVManager.record_failure
        update_status = CommonKVManager.update_status
        disaggregation_mode = DisaggregationMode.PREFILL

        def __init__(self):
            self.request_status, self.failure_records, self.transfer_infos = {}, {}, {}
            self.req_to_decode_prefix_len, self._deferred_ack_targets, self._staging_outstanding = {}, {}, {}
            self._deferred_ack_poisoned_rooms = set()
            self.failure_lock = threading.Lock()
            self.deferred_bootstrap = None
            self.told = []  # Failed statuses sent to decode: (room, reason)
            self.causes = []  # the ledger's PEER_CAUSE messages sent to decode (frames)
            self.wire = []  # both, in the order sent: ("cause", room, cause name) / ("status", room, reason)

        def _room_notify_targets(self, room):
            return [("127.0.0.1", 7000)]

        def send_kv_status_message(self, targets, bootstrap_room, status, failure_reason=None):
            self.told.append((bootstrap_room, failure_reason))
            self.wire.append(("status", bootstrap_room, failure_reason))

        def _prefill_unique_rank(self):
            return 0

        def _send_multipart_locked(self, endpoint, frames, is_ipv6=False):  # the ledger's cause message, before
            self.causes.append(frames)
            self.wire.append(("cause", int(frames[1]), frames[3].decode()))

    mgr = Manager()
    mgr.__dict__[ATTR] = RoomLedger(mgr)
    return mgr


class Poller:
    """A sender as the queue polls it: its room's status on this rank."""

    def __init__(self, mgr, room):
        self.kv_mgr, self.bootstrap_room = mgr, room

    def poll(self):
        return self.kv_mgr.request_status[self.bootstrap_room]


def _rank(rank: int, store: str, out) -> None:
    import torch.distributed as dist

    from sglang.srt.disaggregation import utils
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.fork_ending import request_end_cause as end_cause
    from sglang.srt.disaggregation.fork_ending import room_agreement, room_kv_hooks, room_ledger, verdict

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        group = dist.new_group([0, 1], backend="gloo")
        apply_fork_hooks("sglang.srt.disaggregation.utils.poll_and_all_reduce")
        mgr = _manager()
        ledger = room_ledger.ledger_of(mgr)
        S = KVPoll
        # room 11: a kv write failed on rank 1 alone; rank 0's own write went through
        # room 12: rank 1's peer monitor lost the decode first; rank 0 still transferring
        # room 13: rank 0's deadline (its clock) ended it before decode's handshake; rank 1 still bootstrapping
        # room 14: nothing failed
        # room 15: decode's ABORT reached rank 1 before its sender (the cancellation fails the sender at once); rank 0
        #          has neither the ABORT nor the handshake yet (decode TP 1 talks to each prefill rank on its own socket)
        mgr.request_status.update({11: S.Success if rank == 0 else S.Failed, 12: S.Transferring,
                                   13: S.Bootstrapping, 14: S.Transferring, 15: S.Bootstrapping})
        if rank == 1:
            ledger.note_abort(15, "127.0.0.1:7000")
        # on_prefill_create_sender: the sender upstream created for room 15 (its __init__ not run: the tables above)
        from sglang.srt.disaggregation.common.conn import CommonKVSender

        sender = CommonKVSender.__new__(CommonKVSender)
        cancelled = ledger.claim(15, sender)
        if cancelled is not None:
            ledger.make(Transition.FAIL_UNTOLD, 15, cancelled[0])
        if rank == 1:
            mgr.failure_records[11] = KV_FAILED
            room_ledger.end_room(mgr, Transition.FAIL_UNTOLD, 12, LOST, cause=end_cause.PEER_FAILURE,
                                 peer="127.0.0.1:7001")
        else:
            room_ledger.end_room(mgr, Transition.REMEMBER_ENDED, 13, DEADLINE)  # a deadline, its telling left out
            room_ledger.end_room(mgr, Transition.FAIL_UNTOLD, 13, DEADLINE, cause=end_cause.TIMEOUT)
        gathers = room_agreement.COUNTS["gathers"]
        polls = utils.poll_and_all_reduce([Poller(mgr, r) for r in (11, 12, 13, 14, 15)], group)
        seen = {
            "polls": [int(p) for p in polls],
            "gathers": room_agreement.COUNTS["gathers"] - gathers,
            "records": {r: mgr.failure_records.get(r) for r in (11, 12, 13, 14, 15)},
            "tags": {r: end_cause.room_tag(mgr, r) for r in (11, 12, 13, 14, 15)},
            "status_12": int(verdict.lost_peer_status(mgr.failure_records.get(12), 500)),
            "late_13": (ledger.late(13) or (None,))[0],
            # a rank that learned a room's failure from the other tells its own decode peers
            "told_at_poll": sorted(mgr.told),
        }
        mgr.told.clear()
        # no room failed: no collective at all (a rank that gathered alone would hang)
        gathers = room_agreement.COUNTS["gathers"]
        utils.poll_and_all_reduce([Poller(mgr, 14)], group)
        seen["quiet_gathers"] = room_agreement.COUNTS["gathers"] - gathers
        # the queue retires rooms 13 and 15 (upstream's sender.clear, then the ledger's hook) ...
        for room in (13, 15):
            mgr.request_status.pop(room)
            mgr.failure_records.pop(room, None)
            room_kv_hooks.on_sender_clear(None, type("Sender", (), {"kv_mgr": mgr, "bootstrap_room": room,
                                                                    "conclude_state": S.Failed})())
        # ... and decode's late handshake reaches this rank: answered Failed with the reason, nothing re-created
        for room in (13, 15) if rank == 0 else (13,):
            room_kv_hooks.around_update_status(type(mgr).update_status, mgr, room, S.WaitingForInput)
            seen[f"handshake_{room}"] = {"request_status": mgr.request_status.get(room), "told": list(mgr.told)}
            mgr.told.clear()
        out.put((rank, seen))
    finally:
        dist.destroy_process_group()


def test_a_room_failed_on_one_rank_is_known_alike_on_every_rank():
    results = run_ranks(_rank, WORLD, timeout=180)
    failed, transferring = 0, 3
    cancelled = CANCEL_REASON.format(peer="127.0.0.1:7000", room=15)
    for rank in range(WORLD):
        seen = results[rank]
        assert seen["polls"] == [failed, failed, failed, transferring, failed], (rank, seen)
        assert (seen["gathers"], seen["quiet_gathers"]) == (1, 0), (rank, seen)
        # the answering rank names rank 1's failed write, answers rank 1's lost peer 502 with its cause, and
        # every rank remembers rank 0's deadline for a late handshake
        assert seen["records"] == {11: KV_FAILED, 12: LOST, 13: DEADLINE, 14: None, 15: cancelled}, (rank, seen)
        assert seen["tags"] == {11: None, 12: ("peer_failure", "127.0.0.1:7001"), 13: ("timeout", None), 14: None,
                                15: None}, (rank, seen)
        assert seen["status_12"] == 502, (rank, seen)
        assert seen["late_13"] == DEADLINE, (rank, seen)
        assert seen["told_at_poll"] == ([(11, KV_FAILED), (12, LOST), (15, cancelled)] if rank == 0
                                        else [(13, DEADLINE)]), (rank, seen)
        assert seen["handshake_13"] == {"request_status": None, "told": [(13, DEADLINE)]}, (rank, seen)
    # rank 0 learned room 15's failure from rank 1; decode's handshake reaching it only now is answered Failed, no
    # room re-created that no sender would close (the leak prefill TP 2 + decode TP 1 showed under random aborts).
    # Rank 1 had decode's handshake and ABORT in order on one socket: no late handshake there.
    assert results[0]["handshake_15"] == {"request_status": None, "told": [(15, cancelled)]}, results[0]


def test_agreed_is_rank_0s_unless_a_higher_rank_outranks_it():
    abort = "Aborted by AbortReq."
    echo = "PD request aborted on decode: bootstrap_room=11 was aborted by the decode peer."
    assert agreed([Known("a", None, None), Known("b", None, None)]).reason == "a"
    assert agreed([None, Known(KV_FAILED, None, None)]).reason == KV_FAILED
    assert agreed([Known(abort, None, None), Known(KV_FAILED, None, None)]).reason == KV_FAILED  # a bare abort loses
    # decode's ABORT reached rank 0 first, answering the failed write rank 1 had told it of: the write wins
    assert agreed([Known(echo, None, None), Known(KV_FAILED, None, None)]).reason == KV_FAILED
    assert agreed([Known(echo, None, None), Known(abort, None, None)]).reason == echo
    assert agreed([Known(KV_FAILED, None, None), Known(LOST, None, None)]).reason == LOST  # a lost peer wins
    assert agreed([Known(LOST, None, None), Known(KV_FAILED, None, None)]).reason == LOST
    one = agreed([Known(None, ("timeout", None), DEADLINE), Known(None, ("transport", None), "other")])
    assert (one.tag, one.late) == (("timeout", None), DEADLINE)  # rank order: rank 0 decides deadlines
    assert agreed([None, None]) == Known(None, None, None)


def test_the_cause_told_with_a_reason_is_agreed_with_it():
    """Every rank answers by, and tells decode, the cause that came with the agreed reason (the rank that chose it),
    whatever the reason's text reads as; a told peer's abort ranks last as its text would."""
    from sglang.srt.disaggregation.fork_ending.verdict_rows import Cause, Told

    paused = Told(Cause.PEER_PAUSE, "Aborted by pause_generation(mode=abort).")
    echo = "PD request aborted on decode: bootstrap_room=11 was aborted by the decode peer."
    one = agreed([Known("not an abort by its text", None, None, Told(Cause.PEER_ABORT)),
                  Known(KV_FAILED, None, None)])
    assert (one.reason, one.told) == (KV_FAILED, None)  # a told abort ranks last: the failed write wins, no cause
    one = agreed([Known(echo, None, None, paused), Known(echo + " ", None, None)])
    assert (one.reason, one.told) == (echo, paused)  # rank 0's reason, with its cause
    one = agreed([None, Known(None, None, DEADLINE, None, Told(Cause.PEER_DEADLINE))])
    assert (one.late, one.late_told) == (DEADLINE, Told(Cause.PEER_DEADLINE))


SESSION = "127.0.0.1:16000"  # rank 0's decode session, blacklisted (a failed write whose probe got no answer)
DEAD = f"Decode instance could be dead, remote mooncake session {SESSION} is not alive"  # upstream's reason
REWORDED = (f"PD peer lost: decode peer 127.0.0.1:7000 lost (a KV write failed and its transfer session {SESSION} "
            "does not answer a probe)")


def _rank_blacklisted(rank: int, store: str, out) -> None:
    import types

    import torch.distributed as dist

    from sglang.srt.disaggregation import utils
    from sglang.srt.disaggregation.base import KVPoll as S
    from sglang.srt.disaggregation.fork_ending import room_ledger
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        group = dist.new_group([0, 1], backend="gloo")
        for target in ("sglang.srt.disaggregation.utils.poll_and_all_reduce",
                       "sglang.srt.disaggregation.common.conn.CommonKVManager.conclude_transfer",
                       "sglang.srt.disaggregation.common.conn.CommonKVManager.record_failure",
                       "sglang.srt.disaggregation.common.conn.CommonKVManager.update_status"):
            apply_fork_hooks(target)
        mgr = _manager(MooncakeKVManager)
        mgr.failed_sessions = {SESSION} if rank == 0 else set()
        ledger = room_ledger.ledger_of(mgr)
        # room 21: rank 0's transfer worker meets the blacklisted session; rank 1 still transferring
        # room 22: rank 0's sender cleared meanwhile (upstream's clear pops request_status first): nothing concluded
        # room 23: rank 0 had recorded a failed write first: upstream sends that record, with the cause it came with
        info = types.SimpleNamespace(endpoint="127.0.0.1", dst_port=7000)
        mgr.request_status.update({21: S.Transferring, 23: S.Transferring})
        mgr.transfer_infos.update({21: {SESSION: info}, 23: {SESSION: info}})
        if rank == 0:
            mgr.transfer_infos[22] = {SESSION: info}
            mgr.failure_records[23] = KV_FAILED
            for room in (21, 22, 23):
                mgr.conclude_failure(bootstrap_room=room, failure_reason=DEAD)
        seen = {"concluded": list(mgr.wire)}
        mgr.wire.clear()
        utils.poll_and_all_reduce([Poller(mgr, r) for r in (21, 23)], group)
        told = {r: ledger.told_with(r) for r in (21, 22, 23)}
        seen.update(at_poll=list(mgr.wire), records={r: mgr.failure_records.get(r) for r in (21, 22, 23)},
                    told={r: t and t.cause.name for r, t in told.items()})
        out.put((rank, seen))
    finally:
        dist.destroy_process_group()


def test_a_write_to_a_blacklisted_session_tells_every_decode_its_peer_lost():
    """prefill_side_monitor rewords upstream's reason for a write to a blacklisted session to name the lost decode: the
    rank that concluded tells LOST_PEER as a field right before its Failed status, keeps it with its record, and the
    rank that learns the failure from it tells its own decode peers the same; a room cleared before its conclusion
    is told nothing (no cause left waiting for a status that never comes); a room whose first record was another
    failure is sent that record without the loss's cause."""
    results = run_ranks(_rank_blacklisted, WORLD, timeout=180)
    assert results[0]["concluded"] == [("cause", 21, "LOST_PEER"), ("status", 21, REWORDED),
                                       ("status", 23, KV_FAILED)], results[0]
    assert results[0]["at_poll"] == [], results[0]
    assert results[1]["concluded"] == [], results[1]
    # rank 1 learned both failures at the poll: it tells its decode peers what rank 0 told its own
    assert results[1]["at_poll"] == [("cause", 21, "LOST_PEER"), ("status", 21, REWORDED),
                                     ("status", 23, KV_FAILED)], results[1]
    for rank in range(WORLD):
        assert results[rank]["records"] == {21: REWORDED, 22: None, 23: KV_FAILED}, (rank, results[rank])
        assert results[rank]["told"] == {21: "LOST_PEER", 22: None, 23: None}, (rank, results[rank])
