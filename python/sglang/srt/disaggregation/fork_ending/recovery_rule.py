"""Which failed PD requests recovery runs again (docs/recovery.md), as one rule read by both sides: decode's tokenizer,
which holds such an end back and re-runs the request (fork_recovery.recovery), and prefill's verdict, which answers
its leg of such a request as an abort instead of the failure (verdict_rows' `Cause.HANDED_TO_RECOVERY` row), so that
a gateway keeps decode's answer. Both servers read the same knob (`SGLANG_FORK_RECOVERY_ATTEMPTS`).

The rule: a failure of a cause recovery takes (`cause_of`: a failed chunk write, named by the reason's text), of a
request of a shape it takes (`excluded`: one prompt, n = 1, no logprobs, session, multimodal input, LoRA or input
embeddings), while attempts remain (`another_attempt`: attempts made < the knob; a leg's rid says its attempt,
`recovery_attempt`). Each side reads its own object into a `Shape` (`input_shape`: the tokenizer's GenerateReqInput;
`req_shape`: the scheduler's Req); what is excluded is decided here once. The budget (from decode's first failure)
only decode knows: past it decode answers the failure itself.

Thread: any (pure functions of their arguments and the environment). Lock: none. Imports `recovery_attempt`,
`verdict_wording`, `knobs`, `fork_touch`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from sglang.srt.disaggregation.fork_ending import recovery_attempt
from sglang.srt.disaggregation.fork_ending.verdict_wording import failed_chunk_kind
from sglang.srt.managers.fork_core import knobs
from sglang.srt.managers.fork_core.fork_touch import upstream

CAUSE_CHUNK = "chunk_failure"  # the causes recovery takes (meta_info["recovery"]["cause"]): a failed chunk write,
CAUSE_DEADLINE = "transfer_deadline"  # a transfer stalled past the deadline (recovery_attempt.DEADLINE_STAGES)


def cause_of(reason: Any) -> Optional[str]:
    """The recoverable cause a failure's reason (or the message carrying it) names, or None."""
    return CAUSE_CHUNK if failed_chunk_kind(reason) is not None else None


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


def prefill_hands_over(req: Any) -> bool:
    """Prefill's copy `req` of a request whose room failed with a cause decode recovers (the caller read the cause):
    whether decode's recovery will run it again, so prefill answers its leg as handed over. Prefill's side only (a
    request with a sender); its attempt is its leg's rid's (`recovery_attempt.split`)."""
    if not enabled() or upstream(req, "disagg_kv_sender") is None:
        return False
    return another_attempt(recovery_attempt.split(req.rid)[1]) and excluded(req_shape(req)) is None
