"""Every rank answers, counts and remembers a failed room alike, whichever rank noticed the failure.

A room one rank fails (a deadline decided on the answering rank; a failed chunk write, a lost peer, a given-up
bootstrap fetch on any rank) reaches the other ranks as `KVPoll.Failed` through upstream's MIN all-reduce of the
queue's polls, but its reason, end-cause tag and late-handshake answer stay on that rank (upstream's other ranks read
"Failed due to an unknown reason from another rank"). Right after the all-reduce, the Failed set is the same on
every rank, so `share_failures` makes one all-gather of what each rank knows of exactly those rooms (none when no
room failed) and every rank adopts the same `agreed` reason, tag and late answer before its queue reads the failure.
Hooks AROUND upstream's poll functions (scheduler thread); docs/layout.md, "More than one rank per server". It keeps
no per-room table: the agreed record is written by the ledger (`room_ledger.write_failure`), the tag by
`request_end_cause.retag`, the late answer by a ledger transition.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

from sglang.srt.disaggregation.fork_ending import request_end_cause as end_cause
from sglang.srt.disaggregation.fork_ending.room_ledger import failure_record, has_room_tables, ledger_of, write_failure
from sglang.srt.disaggregation.fork_ending.room_transitions import Transition
from sglang.srt.disaggregation.fork_ending.verdict import reason_weight
from sglang.srt.disaggregation.fork_ending.verdict_rows import Told
from sglang.srt.managers.fork_core.rank_agreement import gather, group_size
from sglang.srt.managers.fork_core.fork_touch import upstream

FAILED = 0  # KVPoll.Failed: the lowest state, so the MIN all-reduce spreads it
OTHER_RANK_REASON = "KV transfer failed on another prefill rank"  # what decode is told when no rank knew why
COUNTS: Counter = Counter()  # "gathers": collectives made in this process; "rooms": the failed rooms they covered


class Known(NamedTuple):
    """What one rank knows of a failed room: its failure record, its end-cause tag (cause, peer), the reason a
    late handshake for it is answered with; the cause each of the two came with (the peer's frames, this side's
    `make`), so every rank answers and tells the same one."""

    reason: Optional[str]
    tag: Optional[Tuple[str, Optional[str]]]
    late: Optional[str]
    told: Optional[Told] = None
    late_told: Optional[Told] = None


def _room_of(poller: Any) -> Tuple[Any, Optional[int]]:
    """A poller's (kv manager, room); (None, None) for one without (fake transfer, a wrapper without them)."""
    # Defaults genuinely needed: a poller of the fake backend or a wrapper may have neither. Whether its manager is
    # ours is the one rule, by class (`room_ledger.has_room_tables`), not by the attributes it happens to have
    mgr, room = getattr(poller, "kv_mgr", None), getattr(poller, "bootstrap_room", None)
    return (mgr, room) if room is not None and has_room_tables(mgr) else (None, None)


def known(poller: Any) -> Optional[Known]:
    """What this rank knows of the poller's failed room, or None."""
    mgr, room = _room_of(poller)
    if mgr is None:
        return None
    reason = failure_record(mgr, room)
    ledger = ledger_of(mgr)
    late, late_told = (None if ledger is None else ledger.late(room)) or (None, None)
    told = None if ledger is None or reason is None else ledger.told_with(room)
    found = Known(reason, end_cause.room_tag(mgr, room), late, told, late_told)
    return found if any(found) else None


def agreed(by_rank: Sequence[Optional[Known]]) -> Known:
    """One Known from every rank's (rank order), the same on every rank: the reason of the lowest rank among those
    of the strongest kind (`verdict.reason_weight`), the first tag and the first late answer in rank order (rank 0 decides
    deadlines)."""
    reasons = [(reason_weight(k.reason, k.told), rank) for rank, k in enumerate(by_rank) if k is not None and k.reason]
    chosen = by_rank[min(reasons)[1]] if reasons else None
    tag = next((k.tag for k in by_rank if k is not None and k.tag), None)
    late = next((k for k in by_rank if k is not None and k.late), None)
    return Known(chosen and chosen.reason, tag, late and late.late, chosen and chosen.told, late and late.late_told)


def adopt(poller: Any, by_rank: Sequence[Optional[Known]]) -> None:
    """This rank takes the agreed reason, tag and late answer for the poller's room, before its queue reads the
    failure (`failure_exception` pops the record; `clear` disowns the room, keeping a remembered one). A prefill rank
    that learns the failure here (its own room was not Failed) tells its own decode peers, as the rank that ended
    the room told its: a decode rank another prefill rank does not reach would otherwise take this rank's late
    Success (a stalled transfer worker) as the room's end; and it remembers the room, so a decode handshake that
    reaches it late is answered Failed instead of re-creating the room."""
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    mgr, room = _room_of(poller)
    if mgr is None:
        return
    reason, tag, late, told, late_told = agreed(by_rank)
    if tag is not None:
        end_cause.retag(mgr, room, *tag)
    ledger = ledger_of(mgr)
    if late is not None and ledger is not None:
        ledger.make(Transition.REMEMBER_ENDED, room, late, told=late_told)
    if reason:  # the agreed record and its cause, over this rank's (only while the room exists)
        write_failure(mgr, room, reason, told, replace=True)
    learned = mgr.request_status.get(room) not in (None, KVPoll.Failed)
    if learned and ledger is not None and upstream(mgr, "disaggregation_mode") == DisaggregationMode.PREFILL:
        # remembered (unless a late answer was agreed above): decode's handshake may reach this rank only after its
        # sender is cleared (decode TP 1 handshakes each prefill rank on its own socket), and would otherwise open
        # the room again with no sender to close it
        ledger.make(Transition.TELL_AND_REMEMBER if late is None else Transition.ANSWER_LATE, room,
                    reason or OTHER_RANK_REASON, told=told if reason else None)


def share_failures(pollers: Sequence[Any], polls: Sequence[int], group: Any) -> None:
    """After a poll's MIN all-reduce over `group`: one all-gather of what each rank knows of the rooms that turned
    Failed, then `adopt` on every rank. Called on every rank with the all-reduce's result, so either every rank of
    `group` gathers or none does."""
    if FAILED not in polls or group_size(group) == 1:  # the common case: nothing failed, or one rank
        return
    failed = [p for p, poll in zip(pollers, polls) if poll == FAILED]
    gathered = gather(group, [known(p) for p in failed])
    COUNTS["gathers"] += 1
    COUNTS["rooms"] += len(failed)
    for i, poller in enumerate(failed):
        adopt(poller, [ranks[i] for ranks in gathered])


def around_poll_and_all_reduce(original, pollers, gloo_group, *args, **kwargs):
    """AROUND disaggregation.utils.poll_and_all_reduce (decode's queues; prefill's through the CP/TP variant):
    the all-reduced polls, then `share_failures` over the same group."""
    pollers = list(pollers)
    polls = original(pollers, gloo_group, *args, **kwargs)
    share_failures(pollers, polls, gloo_group)
    return polls


def around_poll_cp_tp(original, pollers, attn_cp_cpu_group, attn_tp_cpu_group, *args, **kwargs):
    """AROUND disaggregation.utils.poll_and_all_reduce_attn_cp_tp_group (prefill's queues): its TP poll shares over
    TP (the hook above), then this over CP (nothing with one CP rank)."""
    pollers = list(pollers)
    polls = original(pollers, attn_cp_cpu_group, attn_tp_cpu_group, *args, **kwargs)
    share_failures(pollers, polls, attn_cp_cpu_group)
    return polls


def around_poll_with_staging(original, decode_reqs, staging_handler, gloo_group, *args, **kwargs):
    """AROUND disaggregation.utils.poll_and_all_reduce_with_staging (decode's transfer queue with staging)."""
    decode_reqs = list(decode_reqs)
    polls = original(decode_reqs, staging_handler, gloo_group, *args, **kwargs)
    pollers = kwargs.get("pollers") or (args[1] if len(args) > 1 else None)
    share_failures(pollers if pollers is not None else [r.kv_receiver for r in decode_reqs], polls, gloo_group)
    return polls
