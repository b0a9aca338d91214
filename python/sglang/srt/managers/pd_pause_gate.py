"""Aborts of requests held at the tokenizer's pause gate are answered during the pause.

Invariant: a request that reaches a paused server waits in generate_request until
continue_generation; if it is aborted meanwhile it leaves the gate at once with 499
(it never reached the scheduler, so it holds nothing there).
Who calls: the tokenizer_manager patch (gate predicate `gate_open`, then
`raise_if_gate_aborted`) and an AFTER hook on TokenizerManager.abort_request
(`tm_abort_request`), which marks the request and wakes the gate.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Dict

from sglang.srt.disaggregation import room_ledger

logger = logging.getLogger(__name__)


class PauseGateAbort(ValueError):
    """A request aborted while it waited at the pause gate (never reached the
    scheduler). A ValueError with a status, as upstream's /generate expects."""

    status_code = 499  # client closed request

    def __init__(self, rid: str):
        super().__init__(f"Aborted by AbortReq while the engine was paused (rid={rid}).")


def tm_abort_request(result, tokenizer_manager, rid: str = "", abort_all: bool = False):
    """AFTER TokenizerManager.abort_request: requests held at the pause gate are
    answered now, not after continue_generation."""
    if not tokenizer_manager.is_pause:
        return result
    hit = False
    for state_rid, state in list(tokenizer_manager.rid_to_state.items()):
        if abort_all or state_rid == rid:
            state._fork_gate_abort = tokenizer_manager.disaggregation_mode  # an Enum: truthy
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
    """The pause gate of generate_request: open when not paused, or for an aborted request."""
    return not tokenizer_manager.is_pause or any(
        getattr(s, "_fork_gate_abort", False) for s in request_states.values()
    )


def raise_if_gate_aborted(request_states: Dict[str, Any]) -> None:
    for rid, state in request_states.items():
        if getattr(state, "_fork_gate_abort", False):
            room_ledger.ended_at_gate(state._fork_gate_abort, getattr(state, "obj", None), "aborted at decode's pause gate")
            raise PauseGateAbort(rid)
