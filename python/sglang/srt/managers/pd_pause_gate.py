"""Aborts of requests held at the tokenizer's pause gate are answered during the pause.

A request aborted while it waits at the gate of a paused (or memory-released) server leaves
at once with upstream's abort answer (200, finish_reason "abort", a message naming the
client or abort_all and the pause or the release); it holds nothing on the scheduler. Runs
on the tokenizer's event loop: the tokenizer_manager patch (`gate_open`, `gate_aborted`,
`gate_abort_answers`) and hooks in fork_plugin.HOOKS.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Dict, List

from sglang.srt.disaggregation import room_ledger
from sglang.srt.managers import pd_pause_state

logger = logging.getLogger(__name__)

_MARK = "_fork_gate_abort"  # on a ReqState: the abort's message
_AT_GATE = "_fork_at_gate"  # on a ReqState: waiting at the pause gate now


def tm_abort_request(result, tokenizer_manager, rid: str = "", abort_all: bool = False):
    """AFTER TokenizerManager.abort_request: requests held at the pause gate are
    answered now, not after continue_generation. Not for the abort_all an abort-mode
    pause_generation repeats: as upstream, what waits at the gate is served after
    continue (answering one server's copy of a PD request would leave the other's going)."""
    if not tokenizer_manager.is_pause or (
        abort_all and pd_pause_state._state_of(tokenizer_manager).busy == "pause_generation"
    ):
        return result
    where = ("while the engine memory was released" if pd_pause_state.pause_reason(tokenizer_manager) == "release"
             else "while the engine was paused")
    why = f"Aborted by {'abort_all' if abort_all else 'the client'} {where} (rid={{rid}})."
    hit = False
    for state_rid, state in list(tokenizer_manager.rid_to_state.items()):
        if (abort_all or state_rid == rid) and getattr(state, _MARK, None) is None:
            setattr(state, _MARK, why.format(rid=state_rid))
            hit = True
    logger.info("pd_pause: abort while paused (rid=%r, all=%s): %s", rid, abort_all,
                "waking the pause gate" if hit else "no request state")
    if hit:
        asyncio.get_running_loop().create_task(_wake_gate(tokenizer_manager))
    return result


async def _wake_gate(tokenizer_manager) -> None:
    async with tokenizer_manager.is_pause_cond:
        tokenizer_manager.is_pause_cond.notify_all()


def gate_open(tokenizer_manager, request_states: Dict[str, Any]) -> bool:
    """The pause gate of generate_request: open when not paused, or for an aborted
    request. Each evaluation notes whether the request waits at the gate."""
    is_open = not tokenizer_manager.is_pause or gate_aborted(request_states)
    for state in request_states.values():
        if is_open:
            state.__dict__.pop(_AT_GATE, None)
        else:
            state.__dict__[_AT_GATE] = True
    return is_open


async def tm_internal_state(original, tokenizer_manager, *args, **kwargs):
    """AROUND TokenizerControlMixin.get_internal_state: each scheduler's resource
    report also says how many requests wait at this tokenizer's pause gate."""
    states = await original(tokenizer_manager, *args, **kwargs)
    held = sum(1 for state in list(tokenizer_manager.rid_to_state.values()) if state.__dict__.get(_AT_GATE))
    for state in states:
        report = state.get("fork_pd_resources") if isinstance(state, dict) else None
        if isinstance(report, dict):
            report["pause_gate_held"] = held
    return states


def gate_aborted(request_states: Dict[str, Any]) -> bool:
    return any(getattr(s, _MARK, None) is not None for s in request_states.values())


def abort_output(rid: str, message: str) -> Dict[str, Any]:
    """Upstream's answer to an aborted request that produced nothing."""
    return {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "abort", "message": message, "status_code": None},
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "e2e_latency": 0.0,
        },
    }


def gate_abort_answers(tokenizer_manager, obj: Any, request_states: Dict[str, Any]) -> List[Any]:
    """What generate_request yields for a request aborted at the gate (its states are
    dropped: nothing was sent to the scheduler). A batch ends whole: sub-requests not
    aborted by name are answered with the same abort."""
    first = next(getattr(s, _MARK) for s in request_states.values()
                 if getattr(s, _MARK, None) is not None)
    outs = []
    for index, (rid, state) in enumerate(request_states.items()):
        if tokenizer_manager.rid_to_state.get(rid) is state:
            del tokenizer_manager.rid_to_state[rid]
        out = abort_output(rid, getattr(state, _MARK, None) or first)
        if not obj.is_single:
            out["index"] = index
        outs.append(out)
    # Decode's copy ends here; its prefill copy must not wait for a handshake.
    room_ledger.ended_at_gate(tokenizer_manager.disaggregation_mode, obj, first)
    if obj.is_single or getattr(obj, "stream", False):
        return outs
    return [outs]
