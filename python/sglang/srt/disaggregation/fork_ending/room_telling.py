"""Telling the other side of a request one side ended before its scheduler saw it (its pause gate, a rejection by its
tokenizer or scheduler): decode's ABORT, or prefill's own bootstrap thread told (`teller.tell_prefill`, a daemon
thread per target). Threads: the tokenizer's event loop (`before_release_on_failure`, the pause gate) and the
scheduler (`room_scheduler_hooks.after_send_abort_output`); no lock of its own (the teller's). Invariant: each such
request's peer copy is told once, with the cause every ABORT carries."""

from __future__ import annotations

import sys
from typing import Any

from sglang.srt.disaggregation.fork_ending import verdict as table
from sglang.srt.disaggregation.fork_ending.teller import tell_prefill
from sglang.srt.disaggregation.fork_ending.verdict import peer_reason, told_for


def ended_at_gate(role: Any, obj: Any, why: str) -> None:
    """A request one side ended before its scheduler saw it (pause gate, rejection): the peer's copy is told."""
    role = str(getattr(role, "value", role))
    if role not in ("decode", "prefill"):
        return
    rooms = obj.bootstrap_room if isinstance(obj.bootstrap_room, list) else [obj.bootstrap_room]
    hosts, ports, rids = ((v if isinstance(v, list) else [v] * len(rooms))
                          for v in (obj.bootstrap_host, obj.bootstrap_port, obj.rid))
    for host, port, room, rid in zip(hosts, ports, rooms, rids):
        if role == "decode":  # decode's ABORT: its cause as every ABORT's (abort_frames)
            tell_prefill(host, port, room, why)
        else:
            tell_prefill(host, port, room, why, peer_reason(rid, room, "prefill", why), told_for(why))


def before_release_on_failure(tokenizer_manager: Any, request_states: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE `TokenizerManager._release_req_states_on_failure` (HTTP thread): a request that failed
    before this side's scheduler (rejected, or its client gone at the gate) has its peer's copy told."""
    exc = sys.exc_info()[1]
    role = str(getattr(tokenizer_manager.disaggregation_mode, "value", ""))
    rejected = isinstance(exc, Exception)  # not the CancelledError (a BaseException) of a client gone at the gate
    why = table.rejected_by(f"{role}'s tokenizer", str(exc)) if rejected else f"ended at {role}'s tokenizer"
    for rid, state in request_states.items():
        if tokenizer_manager.rid_to_state.get(rid) is state and not state.dispatched:
            ended_at_gate(role, state.obj, why)
