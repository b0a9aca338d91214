"""Recovery instead of failure (docs/recovery.md): decode's tokenizer holds back the end of a request whose transfer
failed on prefill's side (a failed chunk write, prefill alive) before its first token, and runs the request again
under a new bootstrap room: the prefill leg re-sent to the same prefill (its rid `recovery_attempt.attempt_rid`), the
same request re-submitted to decode's scheduler (a fresh scheduler request, the client's rid kept). Past the attempts
(`SGLANG_FORK_RECOVERY_ATTEMPTS`) or the budget (`SGLANG_FORK_RECOVERY_BUDGET`, from the first failure) the failure is
answered as without recovery.

Thread: the tokenizer's event loop only (the patched line in `_handle_batch_output`, the re-submission task); the
per-request record (`Attempts`) lives on the tokenizer's ReqState (request_record); no lock.
Invariant: an end is held back only while nothing of the request reached the client (no output token) and only for
a cause that leaves prefill alive; a held-back end is followed by exactly one re-submission, whose answer is the
client's."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Callable, Dict, Optional

from sglang.srt.disaggregation.fork_ending import recovery_attempt, request_record
from sglang.srt.disaggregation.fork_ending.verdict_wording import failed_chunk_kind
from sglang.srt.managers.fork_core import knobs
from sglang.srt.managers.fork_core.fork_touch import upstream

logger = logging.getLogger(__name__)

CAUSE_CHUNK = "chunk_failure"
_TASKS: set = set()  # re-submissions in flight (kept referenced until done)


@dataclass
class Attempts:
    """A request's recoveries (the tokenizer's ReqState)."""

    made: int = 0  # recovery attempts started
    first_failure: Optional[float] = None  # monotonic time of the first failure held back
    cause: Optional[str] = None  # the first failure's cause
    failure: Optional[Dict[str, Any]] = None  # the last held-back end's finish reason (answered if no attempt starts)


def _cause(finish_reason: Any) -> Optional[str]:
    """The recoverable cause an abort's finish reason names, or None."""
    if not isinstance(finish_reason, dict) or finish_reason.get("type") != "abort":
        return None
    if finish_reason.get("status_code") != HTTPStatus.INTERNAL_SERVER_ERROR:
        return None
    return CAUSE_CHUNK if failed_chunk_kind(finish_reason.get("message")) is not None else None


def _eligible(tm: Any, obj: Any) -> bool:
    """Requests recovery may re-run: decode's, one prompt, n = 1, no logprobs, no session, no multimodal input, no LoRA."""
    if getattr(tm.server_args, "disaggregation_mode", "null") != "decode":
        return False
    if not isinstance(getattr(obj, "rid", None), str) or not obj.bootstrap_host or obj.bootstrap_port is None:
        return False
    if isinstance(obj.sampling_params, dict) and obj.sampling_params.get("n", 1) != 1:
        return False
    return not (obj.return_logprob or obj.session_params or obj.image_data or obj.audio_data or obj.video_data
                or obj.lora_path or obj.input_embeds is not None)


def holds_back(tm: Any, state: Any, recv_obj: Any, i: int, meta_info: Dict[str, Any],
               start: Optional[Callable[[Any, Any, int], None]] = None) -> bool:
    """The patched line in `TokenizerManager._handle_batch_output`, for output `i` of `recv_obj` (its `meta_info`
    built): True when this end is held back and the request re-run (the caller skips the output); else annotates
    a recovered request's `meta_info` and returns False. `start(tm, state, attempt)` starts the attempt (default
    `_start`: a task on the tokenizer's loop; the lifecycle model passes its own, which re-submits to its harnesses)."""
    record = request_record.peek(state, Attempts)
    if record.made:
        meta_info["recovery"] = {"attempts": record.made, "cause": record.cause}
    reason = recv_obj.finished_reasons[i]
    if not isinstance(reason, dict) or reason.get("type") != "abort":  # every output but an abort's: one check
        return False
    attempts = knobs.RECOVERY_ATTEMPTS.get()  # off (the default): nothing more is read or decided
    if not attempts:
        return False
    cause = _cause(reason)
    if cause is None or recv_obj.completion_tokens[i] or state.obj is None or not _eligible(tm, state.obj):
        return False
    now = time.monotonic()
    if record.made >= attempts:
        logger.warning("Recovery of %s: %d attempt(s) made, none left; answering the failure", state.obj.rid,
                       record.made)
        return False
    if record.first_failure is not None and now - record.first_failure >= knobs.RECOVERY_BUDGET.get():
        logger.warning("Recovery of %s: budget spent; answering the failure", state.obj.rid)
        return False
    record = request_record.of(state, Attempts)
    if record.first_failure is None:
        record.first_failure, record.cause = now, cause
    record.failure = recv_obj.finished_reasons[i]
    record.made += 1
    (start or _start)(tm, state, record.made)
    logger.warning("Recovery of %s: its transfer failed (%s) before its first token; attempt %d under a new room",
                   state.obj.rid, cause, record.made)
    return True


def _start(tm: Any, state: Any, attempt: int) -> None:
    """Attempt `attempt` of `state`'s request as a task on the tokenizer's event loop (kept referenced until done)."""
    task = asyncio.get_running_loop().create_task(_rerun(tm, state, attempt))
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


async def _prefill_url(session: Any, host: str, port: int) -> str:
    """The prefill's HTTP base URL, from its bootstrap server (as upstream's retract re-send finds it). Asked on each
    attempt (a rare path), not kept: a prefill restarted behind the same bootstrap port may serve on another port."""
    from sglang.srt.utils.network import NetworkAddress

    route = NetworkAddress(host, port).to_url() + "/route"
    query = {"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1, "target_pp_rank": -1}
    async with session.get(route, params=query) as response:
        response.raise_for_status()
        http_port = (await response.json())["prefill_http_port"]
    return NetworkAddress(host, int(http_port)).to_url()


def _prefill_leg(obj: Any, rid: str) -> Dict[str, Any]:
    leg: Dict[str, Any] = {"sampling_params": obj.sampling_params, "rid": rid, "stream": False,
                           "bootstrap_host": obj.bootstrap_host, "bootstrap_port": obj.bootstrap_port,
                           "bootstrap_room": obj.bootstrap_room}
    leg["input_ids" if obj.text is None else "text"] = obj.input_ids if obj.text is None else obj.text
    return leg


async def _post_leg(session: Any, url: str, leg: Dict[str, Any]) -> None:
    async with session.post(url + "/generate", json=leg) as response:
        if response.status >= 300:
            logger.warning("Recovery: prefill leg %s answered %s: %s", leg["rid"], response.status,
                           (await response.text())[:256])


def _answer_failure(tm: Any, rid: str, failure: Dict[str, Any]) -> None:
    """The held-back end answered after all (an attempt that could not start): upstream's own abort answer path with
    the failure's finish reason, so the client sees exactly what it would have seen without recovery."""
    from sglang.srt.managers.io_struct import AbortReq

    upstream(tm, "_handle_abort_req")(AbortReq(rid=rid, finished_reason=failure, abort_message=failure.get("message")))


async def _rerun(tm: Any, state: Any, attempt: int) -> None:
    """Attempt `attempt` of `state`'s request: a new room, the prefill leg re-sent, the request re-submitted.
    If it cannot be re-submitted (prefill's address not found, re-tokenizing fails), the held-back failure is
    answered at once; once re-submitted, a prefill leg that is refused leaves the attempt to decode's own path (its
    transfer deadline)."""
    import aiohttp

    obj = state.obj
    submitted = False
    obj.bootstrap_room = random.randint(0, 2**63 - 1)
    leg = _prefill_leg(obj, recovery_attempt.attempt_rid(obj.rid, attempt))
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
    try:
        url = await _prefill_url(session, obj.bootstrap_host, obj.bootstrap_port)
        post = asyncio.get_running_loop().create_task(_post_leg(session, url, leg))
        tokenized = await upstream(tm, "_tokenize_one_request")(obj)
        await upstream(tm, "_send_one_request")(tokenized)
        submitted = True
        await post
    except Exception as e:  # aiohttp's and the tokenizer's errors alike
        logger.error("Recovery of %s: attempt %d could not start: %r", obj.rid, attempt, e)
        if not submitted:
            _answer_failure(tm, obj.rid, request_record.of(state, Attempts).failure or {})
    finally:
        await session.close()
