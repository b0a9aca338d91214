"""The pause gate of generate_request (upstream's `is_pause` / `is_pause_cond`): which requests wait at it, which
passed it, and the answer of one aborted while it waits (docs/pause-release-resume.md, "Aborts while paused").

Invariant: a request held at the gate has sent nothing to the scheduler, so an abort answers it here at once (its
state dropped, the peer's copy told); every other abort is upstream's. The tokenizer's event loop only (single-
threaded, no lock). One `PauseGate` per tokenizer manager, reached through `gate_of(tokenizer_manager)`; the
tokenizer_manager patch calls `gate_open` / `gate_aborted` / `gate_abort_answers`, `tokenizer_pause` closes and
opens it."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX
from sglang.srt.disaggregation.fork_ending import request_record, room_telling
from sglang.srt.managers.fork_pause import pd_pause
from sglang.srt.managers.fork_pause.engine_pause_state import PAUSE, state_of
from sglang.srt.managers.io_struct import AbortReq

logger = logging.getLogger(__name__)

ATTR = "fork_pause_gate"  # on the tokenizer manager: its PauseGate


@dataclass
class GateMark:
    """The gate's record on a tokenizer's request state (`request_record`; tokenizer event loop)."""

    at_gate: Optional[bool] = None  # waiting at the pause gate now (False: passed it; None: never reached it)
    gate_abort: Optional[str] = None  # the answer of an abort that reached it while it waited at the gate


def marks(state: Any) -> GateMark:
    """`state`'s gate record, made at first use."""
    return request_record.of(state, GateMark)


def mark_of(state: Any) -> GateMark:
    """`state`'s gate record, or an empty one (not stored): for reads."""
    return request_record.peek(state, GateMark)


class PauseGate:
    """The gate's marks on the tokenizer's request states, in each one's record (`marks(state)`: `at_gate`,
    where it is; `gate_abort`, an abort's answer), and the closing / opening of upstream's gate."""

    def __init__(self, tokenizer_manager: Any):
        self.tm = tokenizer_manager

    def open_for(self, request_states: Dict[str, Any]) -> bool:
        """Open when not paused, or for an aborted request (notes who waits)."""
        is_open = not self.tm.is_pause or gate_aborted(request_states)
        for state in request_states.values():
            marks(state).at_gate = not is_open
        return is_open

    async def set(self, closed: Optional[bool] = None) -> None:
        """Close or open the pause gate (None: leave it as it is) and wake its waiters to look again."""
        async with self.tm.is_pause_cond:
            if closed is not None:
                self.tm.is_pause = closed
            self.tm.is_pause_cond.notify_all()

    def mark_aborted(self, rid: str, abort_all: bool) -> bool:
        """An abort while the gate is closed: each request it names gets its answer (woken by `set`)."""
        where = ("while the engine memory was released" if state_of(self.tm).gate_reason() == "release"
                 else "while the engine was paused")
        why = f"Aborted by {'abort_all' if abort_all else 'the client'} {where} (rid={{rid}})."
        hits = {state_rid: s for state_rid, s in list(self.tm.rid_to_state.items())
                if (abort_all or state_rid == rid) and mark_of(s).gate_abort is None}
        for state_rid, s in hits.items():
            marks(s).gate_abort = why.format(rid=state_rid)
        logger.info("pd_pause: abort while paused (rid=%r, all=%s): %s", rid, abort_all,
                    "waking the pause gate" if hits else "no request state")
        return bool(hits)

    def abort_answers(self, obj: Any, request_states: Dict[str, Any]) -> List[Any]:
        """What generate_request yields for a request aborted at the gate (its states are dropped: nothing was sent
        to the scheduler). A batch ends whole: sub-requests not aborted by name get the same abort."""
        tm = self.tm
        first = next(mark_of(s).gate_abort for s in request_states.values()
                     if mark_of(s).gate_abort is not None)
        outs = []
        for index, (rid, state) in enumerate(request_states.items()):
            if tm.rid_to_state.get(rid) is state:
                del tm.rid_to_state[rid]
            reason = {"type": "abort", "message": mark_of(state).gate_abort or first, "status_code": None}
            meta = {"id": rid, "finish_reason": reason, "prompt_tokens": 0, "completion_tokens": 0,
                    "cached_tokens": 0, "e2e_latency": 0.0}
            # upstream's answer to an abort that produced nothing
            out = {"text": "", "output_ids": [], "meta_info": meta}
            if not obj.is_single:
                out["index"] = index
            outs.append(out)
        # Decode's copy ends here; its prefill copy must not wait for a handshake.
        room_telling.ended_at_gate(tm.disaggregation_mode, obj, first)
        return outs if obj.is_single or getattr(obj, "stream", False) else [outs]

    def held(self) -> int:
        """Requests waiting at the gate now."""
        return sum(1 for state in list(self.tm.rid_to_state.values()) if mark_of(state).at_gate)

    def client_states(self) -> List[Tuple[str, Any]]:
        """(rid, state) of the requests in the tokenizer that a client sent: health probes aside (`/health`,
        `/health_generate` put one in rid_to_state for about a second)."""
        return [(rid, s) for rid, s in list(self.tm.rid_to_state.items())
                if not str(rid).startswith(HEALTH_CHECK_RID_PREFIX)]

    def client_requests_running(self) -> List[str]:
        """Rids of requests a client sent that are still running: not a health probe (the scheduler ends one on
        release), not answered, not held at the pause gate (nothing of it reached the scheduler)."""
        return [rid for rid, s in self.client_states() if not s.finished and not mark_of(s).at_gate]

    async def client_requests_settled(self, timeout: float) -> List[str]:
        """Client requests still running after waiting up to `timeout` for them to end (bounded poll)."""
        deadline = time.monotonic() + timeout
        while True:
            running = self.client_requests_running()
            if not running or time.monotonic() >= deadline:
                return running
            await asyncio.sleep(0.01)

    def undecided_client_requests(self) -> List[Any]:
        """States of requests past the pause gate whose answer is not decided, health probes aside: a busy
        scheduler drops a probe (upstream: "ongoing requests already carry health info"), so it is never answered;
        its /health(_generate) handler holds it, and the model-update reader lock, until its 1 s sleep ends, and
        the abort_all sent before the pause's answer ends it too if it did reach the scheduler."""
        return [s for _, s in self.client_states() if mark_of(s).at_gate is False]


def gate_of(tokenizer_manager) -> PauseGate:
    """The tokenizer manager's pause gate (made at first use)."""
    gate = tokenizer_manager.__dict__.get(ATTR)
    if gate is None:
        gate = tokenizer_manager.__dict__[ATTR] = PauseGate(tokenizer_manager)
    return gate


# ----------------------------------------------------------------------------- hooks and the patch's calls

def tm_abort_request(original, tokenizer_manager, rid: str = "", abort_all: bool = False, *args, **kwargs):
    """AROUND TokenizerManager.abort_request: requests held at the pause gate are answered now, except by the
    abort_all a pause_generation repeats (as upstream: served after continue). The abort_all an abort-mode pause
    repeats goes out named (the pause's message, end cause pause) instead of upstream's bare one, so a bare
    abort_all is always a client's: the scheduler answers what it reaches as the client's (keep_abort_verdict)."""
    call = state_of(tokenizer_manager).call
    pausing = abort_all and call is not None and call.op == PAUSE
    if pausing and call.mode == "abort":
        reason = pd_pause.pause_finish_reason()
        tokenizer_manager._dispatch_to_scheduler(AbortReq(abort_all=True, finished_reason=reason))
        return None
    result = original(tokenizer_manager, rid, abort_all, *args, **kwargs)
    if not tokenizer_manager.is_pause or pausing:
        return result
    gate = gate_of(tokenizer_manager)
    if gate.mark_aborted(rid, abort_all):
        asyncio.get_running_loop().create_task(gate.set())
    return result


def gate_open(tokenizer_manager, request_states: Dict[str, Any]) -> bool:
    """The pause gate of generate_request: open when not paused, or for an aborted request (notes who waits)."""
    return gate_of(tokenizer_manager).open_for(request_states)


def gate_aborted(request_states: Dict[str, Any]) -> bool:
    return any(mark_of(s).gate_abort is not None for s in request_states.values())


def gate_abort_answers(tokenizer_manager, obj: Any, request_states: Dict[str, Any]) -> List[Any]:
    """What generate_request yields for a request aborted at the gate (PauseGate.abort_answers)."""
    return gate_of(tokenizer_manager).abort_answers(obj, request_states)
