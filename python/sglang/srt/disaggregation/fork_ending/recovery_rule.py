"""Which failed PD requests recovery runs again (docs/recovery.md), as one rule read by both sides: decode's tokenizer,
which holds such an end back and re-runs the request (fork_recovery.recovery: `cause_of_answer`, `another_attempt`),
decode's own deadline, which ends such a room by `hand_to_recovery` (transfer_deadline: `hands_over`), and prefill's
verdict, which answers its leg of such a request as an abort instead of the failure (verdict_rows' rows
`HANDED_TO_RECOVERY` and `DEADLINE_HANDED_TO_RECOVERY`: `prefill_hands_over`; `LOST_PEER_HANDED_TO_RECOVERY`:
`prefill_hands_over_lost`), so that a gateway keeps decode's answer. Both servers read the same knob
(`SGLANG_FORK_RECOVERY_ATTEMPTS`).

The rule: a failure of a cause recovery takes (`cause_of`, named by the reason's text: a failed chunk write, or a
transfer deadline in a stage of `DEADLINE_STAGES`; answered with that cause's own status, `ANSWERED`), of a request of
a shape it takes (`excluded`: one prompt, n = 1, no logprobs, session, multimodal input, LoRA or input embeddings),
while attempts remain (`another_attempt`: attempts made < the knob; a leg's rid says its attempt,
`recovery_attempt`). Each side reads its own object into a `Shape` (`input_shape`: the tokenizer's GenerateReqInput;
`req_shape`: the scheduler's Req); what is excluded is decided here once. The budget (from decode's first failure)
only decode knows: past it decode answers the failure itself.

Thread: any (pure functions of their arguments and the environment). Lock: none. Imports `recovery_attempt`,
`pd_queues`' stage names, `verdict_wording`, `knobs`, `fork_touch`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from http import HTTPStatus
from typing import Any, Optional

from sglang.srt.disaggregation.fork_ending import recovery_attempt
from sglang.srt.disaggregation.fork_ending.pd_queues import DECODE_TRANSFER, PREFILL_INFLIGHT
from sglang.srt.disaggregation.fork_ending.verdict_wording import (
    PEER_LOST_TAG, UPSTREAM_PREFILL_LOST, deadline_stage, failed_chunk_kind)
from sglang.srt.managers.fork_core import knobs
from sglang.srt.managers.fork_core.fork_touch import upstream

CAUSE_CHUNK = "chunk_failure"  # the causes recovery takes (meta_info["recovery"]["cause"]): a failed chunk write,
CAUSE_DEADLINE = "transfer_deadline"  # a transfer stalled past the deadline in a stage of DEADLINE_STAGES,
# and decode's alone: the prefill a request was bound to, declared lost by decode (decode's peer monitor, or its
# handshake's fetch from a prefill declared lost), re-run on another prefill decode's tokenizer saw serve since
# (fork_recovery.known_prefills: a partition between that prefill and decode, the balancer still reaching both)
CAUSE_LOST_PREFILL = "lost_prefill"
# The status each cause's failure is answered with when not recovered (the verdict's rows FAILURE, DEADLINE /
# PEER_DEADLINE and LOST_PEER): decode's tokenizer reads a held-back end by it and its message (`cause_of_answer`).
ANSWERED = {CAUSE_CHUNK: HTTPStatus.INTERNAL_SERVER_ERROR, CAUSE_DEADLINE: HTTPStatus.GATEWAY_TIMEOUT,
            CAUSE_LOST_PREFILL: HTTPStatus.BAD_GATEWAY}
# How decode's reasons for a lost prefill open (upstream may wrap them): its peer monitor's
# (`peer_monitor.loss_message("prefill", ...)`), its handshake's fetch (transfer_deadline), upstream's own heartbeat's.
LOST_PREFILL_OPENS = (f"{PEER_LOST_TAG}: prefill ", UPSTREAM_PREFILL_LOST)

# The stages whose transfer deadline is a recoverable cause (docs/recovery.md, "What is recovered"): both sides past
# the handshake, decode waiting for prefill's KV and prefill alive. decode_transfer: decode's own deadline (it cannot
# tell a stalled transfer from a prefill slow to compute; either way a new room on a live prefill can serve it);
# prefill_inflight: prefill's KV sent but not concluded (a stalled transfer), told to decode by prefill, so alive.
# Not: decode_prealloc (decode's own handshake or memory: a decode-side cause), prefill_bootstrap (decode's handshake
# never came), prefill_waiting (prefill itself could not compute it in time: a re-run joins the same queue).
DEADLINE_STAGES = frozenset((DECODE_TRANSFER, PREFILL_INFLIGHT))


def cause_of(reason: Any) -> Optional[str]:
    """The recoverable cause a failure's reason (or the message carrying it) names, or None: a failed chunk write
    (`CAUSE_CHUNK`), a transfer deadline in a stage of `DEADLINE_STAGES` (`CAUSE_DEADLINE`; decode's own, prefill's,
    or prefill's told to decode)."""
    if failed_chunk_kind(reason) is not None:
        return CAUSE_CHUNK
    return CAUSE_DEADLINE if deadline_stage(reason) in DEADLINE_STAGES else None


def names_lost_prefill(reason: Any) -> bool:
    """Whether a failure's reason (or the message wrapping it: upstream's "Decode handshake failed ..." / "Decode
    transfer failed ...") is decode's for a lost prefill (`LOST_PREFILL_OPENS`; never a lost decode's)."""
    return any(opens in str(reason or "") for opens in LOST_PREFILL_OPENS)


def cause_of_answer(finish_reason: Any) -> Optional[str]:
    """The recoverable cause an end's finish reason names (decode's tokenizer: the one thing of the verdict's that
    reaches it), or None: an abort whose message names a cause (`cause_of`, or decode's lost prefill,
    `names_lost_prefill`) and whose status is that cause's own (`ANSWERED`: a deadline's text answered 500, or a
    chunk's answered 504, is not taken). Whether a lost prefill's request is re-run also needs another prefill to
    run it on: decode's tokenizer knows (fork_recovery.recovery)."""
    if not isinstance(finish_reason, dict) or finish_reason.get("type") != "abort":
        return None
    message = finish_reason.get("message")
    cause = CAUSE_LOST_PREFILL if names_lost_prefill(message) else cause_of(message)
    return cause if cause is not None and finish_reason.get("status_code") == ANSWERED[cause] else None


def hands_over(stage: str) -> bool:
    """Whether decode's own deadline in `stage` ends its room by `hand_to_recovery` (recovery on, a recoverable
    stage) instead of `fail_and_abort`: the room ends the same way (failed, prefill told by the ABORT, which prefill
    answers as the peer's abort: 200) and is remembered as ended; the request's tokenizer then re-runs it or answers
    the deadline's 504, as it decides."""
    return stage in DEADLINE_STAGES and enabled()


def enabled() -> bool:
    """Recovery is on (`SGLANG_FORK_RECOVERY_ATTEMPTS` > 0); off, nothing else is read."""
    return knobs.RECOVERY_ATTEMPTS.get() > 0


def another_attempt(made: int) -> bool:
    """Whether recovery starts one more attempt after `made` attempts (0: the request's first leg failed)."""
    return made < knobs.RECOVERY_ATTEMPTS.get()


@dataclass(frozen=True)
class Shape:
    """What the rule reads of a request, each field a feature whose state is tied to the first attempt (the value:
    whether the request uses it)."""

    parallel: bool  # a batch, or n > 1: several outputs share one request
    logprobs: bool  # input logprobs are computed by the prefill that ran
    session: bool  # a session's state follows the first attempt
    multimodal: bool  # its processed inputs are not kept for a re-run
    lora: bool  # an adapter held for the first attempt
    embeds: bool  # input embeddings instead of ids


def excluded(shape: Shape) -> Optional[str]:
    """The first feature of `shape` recovery does not take (a `Shape` field's name), or None: recoverable."""
    return next((f.name for f in fields(Shape) if getattr(shape, f.name)), None)


def input_shape(obj: Any) -> Shape:
    """The Shape of a tokenizer's GenerateReqInput (decode's tokenizer, the held-back request)."""
    params = obj.sampling_params
    n = params.get("n", 1) if isinstance(params, dict) else 1
    return Shape(parallel=not isinstance(obj.rid, str) or n != 1, logprobs=bool(obj.return_logprob),
                 session=bool(obj.session_params), multimodal=bool(obj.image_data or obj.audio_data or obj.video_data),
                 lora=bool(obj.lora_path), embeds=obj.input_embeds is not None)


def req_shape(req: Any) -> Shape:
    """The Shape of a scheduler's Req (prefill's copy of the request; a tokenizer has already split a batch and n > 1
    into requests of their own, each with n = 1, so `parallel` reads the sampling params' n as sent)."""
    return Shape(parallel=(req.sampling_params.n or 1) != 1, logprobs=bool(req.return_logprob),
                 session=req.session_id is not None, multimodal=req.multimodal_inputs is not None,
                 lora=req.lora_id is not None, embeds=req.input_embeds is not None)


def prefill_hands_over_lost(req: Any, reason: Any) -> bool:
    """Prefill's copy `req` of a request whose room failed because prefill lost its decode (its peer monitor, the
    lost-decode handshake rule): whether to answer its leg as handed over. Decode, if it lives (a partition between
    the two), lost this prefill too, and its recovery may run the request again on another prefill
    (`CAUSE_LOST_PREFILL`), so that a gateway keeps decode's answer; decode answers its own failure (a 502 naming
    this prefill, which a gateway reads before prefill's) when it cannot, and a decode that died answers nothing a
    gateway would keep. Recovery on, a shape it takes, an attempt left after the one `req`'s leg is; prefill's side
    only."""
    return _leg_recoverable(req)


def _leg_recoverable(req: Any) -> bool:
    """Prefill's copy `req` (it has a sender) of a request decode's recovery may run again, whatever failed: recovery
    on, an attempt left after the one `req`'s leg is (`recovery_attempt.split`), a shape it takes."""
    if not enabled() or upstream(req, "disagg_kv_sender") is None:
        return False
    return another_attempt(recovery_attempt.split(req.rid)[1]) and excluded(req_shape(req)) is None


def prefill_hands_over(req: Any, reason: Any) -> bool:
    """Prefill's copy `req` of a request whose room failed with `reason` (a failed chunk write's, or prefill's own
    deadline's message): whether decode's recovery will run it again (`cause_of`: a cause it takes; recovery on; a
    shape it takes; an attempt left after the one `req`'s leg is, `recovery_attempt.split`), so prefill answers its
    leg as handed over. Prefill's side only (a request with a sender); decode's tokenizer decides for decode's."""
    return cause_of(reason) is not None and _leg_recoverable(req)
