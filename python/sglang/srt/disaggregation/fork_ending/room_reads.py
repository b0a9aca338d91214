"""What other modules read of the room ledger: whether a manager takes the ledger's ABORT handler
(`handles_aborts`), whether a prefill room is decode's handshake for a request still on its way
(`awaits_its_request`, queue_buffers), the cause for a request's answer (`told_for_req`, the verdict hook), and the
resource report's view of a ledger (`report`, `ledger_tables`). Threads: the scheduler (and the tokenizer's internal
state call reading the report); locks: `RoomLedger.lock` and upstream's `failure_lock`, each briefly, through the
ledger. Invariant: reads only: nothing here changes a room."""

from __future__ import annotations

from typing import Any, Dict, Optional

from sglang.srt.disaggregation.fork_ending.room_causes import MAX_CAUSES
from sglang.srt.disaggregation.fork_ending.room_ledger import (DECODE_LEDGERS, MAX_RECORDS, has_room_tables,
                                                               ledger_of)
from sglang.srt.disaggregation.fork_ending.verdict_rows import Told
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.managers.fork_core.bounded import entry
from sglang.srt.managers.fork_core.fork_touch import upstream


def handles_aborts(mgr: Any) -> bool:
    """Whether `mgr`'s class is one `fork_plugin.SWAPS` gives the ledger's ABORT handler (mooncake, nixl): read from
    the touch table, not from the presence of upstream's handler."""
    from sglang.srt.managers.fork_core.fork_plugin import SWAPS

    classes = {f"{c.__module__}.{c.__qualname__}" for c in type(mgr).__mro__}
    return mgr is not None and any(target.endswith("._handle_abort_notification") and target.rpartition(".")[0] in classes
                                   for target, *_ in SWAPS)


def awaits_its_request(mgr: Any, room: int) -> bool:
    """Prefill: whether what `mgr` holds for `room` is decode's handshake for a request still on its way to this
    scheduler (held at the tokenizer's pause gate, waiting in a re-send's wait, on the wire): the handshake is stored
    (`transfer_infos`), has not concluded (no failure record; Bootstrapping or WaitingForInput) and the ledger knows
    nothing of the room (no sender owned it, it did not end here, the peer did not cancel it). Upstream's sender takes
    it over when the request arrives; an end on the way drops it (`ended_at_gate` / decode's ABORT:
    `room_ledger.drop_unowned_room`). Decode (no handshake is stored before its receiver exists): never."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    if not has_room_tables(mgr) or upstream(mgr, "disaggregation_mode") != DisaggregationMode.PREFILL:
        return False
    if room not in upstream(mgr, "transfer_infos") or room in upstream(mgr, "failure_records"):
        return False
    if upstream(mgr, "request_status").get(room) not in (None, KVPoll.Bootstrapping, KVPoll.WaitingForInput):
        return False
    ledger = ledger_of(mgr)
    return ledger is None or not ledger.knows_of(room)  # no ledger (a hook-less manager): upstream keeps it too


def told_for_req(req: Any, message: str) -> Optional[Told]:
    """The cause `req`'s room's failure came with, taken from its ledger (prefill: its sender's manager; decode:
    this process's decode ledgers) if `message` holds that failure, or None."""
    room = upstream(req, "bootstrap_room")
    if room is None:
        return None
    sender = upstream(req, "disagg_kv_sender")
    if sender is not None:
        ledger = ledger_of(upstream(sender, "kv_mgr"))
        return None if ledger is None or not has_room_tables(ledger.mgr) else ledger.take_told(room, message)
    for ledger in list(DECODE_LEDGERS):
        told = ledger.take_told(room, message)
        if told is not None:
            return told
    return None


def report(mgr: Any) -> Optional[int]:
    """How many peer cancellations are remembered (resource report)."""
    ledger = ledger_of(mgr)
    return None if ledger is None or not handles_aborts(mgr) else ledger.cancelled()


def ledger_tables(mgr: Any) -> Dict[str, Dict[str, Any]]:
    """The resource report's view of `mgr`'s ledger (`fork_tables`): each table's size, cap and why. `memory`: kept
    after its request ended, by design, until it expires (bounded); the others are empty when the server is idle."""
    ledger = ledger_of(mgr)
    if ledger is None:
        return {}
    tracker = getattr(mgr, "_deferred_abort_ack_tracker", None)  # decode's (upstream's); read as note_drain does
    with ledger.lock:
        if tracker is not None:
            ledger._forget_released_drains(tracker)
        sizes = {"drains": len(ledger.drains), "ended": len(ledger.ended), "owned": ledger.owners(),
                 "announced": len(ledger.announced), "told_early": len(ledger.told_early)}
    sizes["told"] = len(ledger.told)  # under upstream's failure_lock when written; a length read is one step
    why = {
        "drains": "decode: rooms whose prefill owes a drain ack, until it acks or is lost",
        "ended": "rooms this side ended or the peer cancelled, for late handshakes (expire on the engine clock)",
        "owned": "prefill: rooms a live sender owns",
        "announced": "decode: causes prefill announced for its next Failed status of a room",
        "told_early": "decode: receivers whose prefill was told before its endpoints were known (weak: go with them)",
        "told": "the cause kept with a room's failure record, until its request is answered",
    }
    cap = {"owned": "the senders alive", "told_early": "the receivers alive", "announced": MAX_CAUSES,
           "told": MAX_CAUSES}
    return {f"ledger_{name}": entry(size, cap.get(name, MAX_RECORDS), why[name],
                                   **({"memory": True} if name in ("ended", "told_early") else {}))
            for name, size in sizes.items()}
