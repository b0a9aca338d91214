"""A retract's re-send (docs/pause-release-resume.md, "Legs a paused prefill has sent"): decode re-sends a request
it retracted to prefill under the same rid and room; prefill's tokenizer may still hold the first leg.

Invariant: on prefill, a re-send of a room whose first leg the tokenizer still holds reaches upstream's
generate_request only once that leg has left rid_to_state, or after `REBOOTSTRAP_WAIT_S` (then upstream's 400
"Duplicate request ID"); every other request is upstream's at once. The tokenizer's event loop only (no lock). One
`ResendWait` per tokenizer manager, reached through `resend_wait_of(tokenizer_manager)` (its count is the resource
report's `rebootstrap_waiting`). On decode, each re-send opens its own connection (`fresh_connection_per_resend`,
upstream's `pd-rebootstrap-prefill` pool)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from sglang.srt.disaggregation.fork_ending import pd_queues
from sglang.srt.managers.fork_core import fork_touch

logger = logging.getLogger(__name__)

# A re-send of a first leg this tokenizer still holds waits for its end at most this long (upstream: 400 "Duplicate
# request ID detected"; docs/pause-release-resume.md, "Legs a paused prefill has sent")
REBOOTSTRAP_WAIT_S = 30.0
ATTR = "fork_resend_wait"  # on the tokenizer manager: its ResendWait


class ResendWait:
    """The re-sends waiting now for their first leg (`waiting`)."""

    def __init__(self, tokenizer_manager: Any):
        self.tm = tokenizer_manager
        self.waiting = 0

    async def after_first_leg(self, original, obj, first, *args, **kwargs):
        tm = self.tm
        loop, states = asyncio.get_running_loop(), tm.rid_to_state
        event = fork_touch.upstream(first, "event")
        deadline = loop.time() + REBOOTSTRAP_WAIT_S
        self.waiting += 1
        logger.info("pd_pause: re-send of rid=%s (room %s) waits for its first leg", obj.rid, obj.bootstrap_room)
        try:
            while states.get(obj.rid) is first and (remaining := deadline - loop.time()) > 0:
                if event.is_set():  # an output its own handler has not taken yet
                    await asyncio.sleep(min(0.01, remaining))
                else:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(event.wait(), remaining)
        finally:
            self.waiting -= 1
        generator = original(tm, obj, *args, **kwargs)
        try:
            async for out in generator:
                yield out
        finally:
            await generator.aclose()


def resend_wait_of(tokenizer_manager) -> ResendWait:
    """The tokenizer manager's re-send wait (made at first use)."""
    wait = tokenizer_manager.__dict__.get(ATTR)
    if wait is None:
        wait = tokenizer_manager.__dict__[ATTR] = ResendWait(tokenizer_manager)
    return wait


def tm_generate_request(original, tokenizer_manager, obj, *args, **kwargs):
    """AROUND TokenizerManager.generate_request: a prefill's re-send of a room whose first leg it still holds waits
    for that leg (every other request gets upstream's generator itself)."""
    rid, room = getattr(obj, "rid", None), getattr(obj, "bootstrap_room", None)
    first = tokenizer_manager.rid_to_state.get(rid) if isinstance(rid, str) and room is not None else None
    if first is None or getattr(first.obj, "bootstrap_room", None) != room or \
            str(tokenizer_manager.disaggregation_mode.value) != pd_queues.PREFILL:
        return original(tokenizer_manager, obj, *args, **kwargs)
    return resend_wait_of(tokenizer_manager).after_first_leg(original, obj, first, *args, **kwargs)


def fresh_connection_per_resend(session, mgr, *args, **kwargs):
    """AFTER CommonKVManager._get_prefill_recompute_session (decode's re-bootstrap pool): each re-send opens its own
    connection, never a pooled one prefill's server is closing as idle (uvicorn's keep-alive: reset, 500)."""
    session.headers["Connection"] = "close"
    return session
