"""The one rule both sides read for recovery (disaggregation/fork_ending/recovery_rule.py): decode's tokenizer holds back
and re-runs exactly the requests whose leg prefill answers as handed over (the verdict's rows HANDED_TO_RECOVERY, a
failed chunk write, and DEADLINE_HANDED_TO_RECOVERY, prefill's own deadline in a stage recovery re-runs).
Each side's reader is checked against the other on upstream's real objects (a tokenizer's GenerateReqInput, a
scheduler's Req), feature by feature; the attempts are read from a leg's rid against the same knob."""

from __future__ import annotations

from array import array

import pytest

from sglang.srt.disaggregation.fork_ending import pd_queues, recovery_attempt, recovery_rule, verdict_wording
from sglang.srt.disaggregation.fork_transfer.transfer_deadline_knob import ARG, ENV
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

KNOB = "SGLANG_FORK_RECOVERY_ATTEMPTS"
KV_FAILED = verdict_wording.UPSTREAM_CHUNK_FAILED["kv"] + " of 5 to 10.0.0.2:7000"  # mooncake's transfer worker


def _deadline(stage: str) -> str:
    """transfer_deadline's message for a request overdue in `stage`."""
    return verdict_wording.DEADLINE_MESSAGE.format(rid="r", room=5, spent=5.3, stage=stage, deadline=5.0, env=ENV,
                                                   arg=ARG)


# the stages a transfer deadline fires in (transfer_deadline: each queue's poll)
DEADLINED = (pd_queues.PREFILL_BOOTSTRAP, pd_queues.PREFILL_WAITING, pd_queues.PREFILL_INFLIGHT,
             pd_queues.DECODE_PREALLOC, pd_queues.DECODE_TRANSFER)


def _input(**fields) -> GenerateReqInput:
    """Decode's tokenizer's copy of a request (the client's JSON as upstream parses it)."""
    fields.setdefault("sampling_params", {"temperature": 0.0, "max_new_tokens": 4})
    return GenerateReqInput(text="hello", rid=fields.pop("rid", "r"), **fields)


def _req(rid: str = "r", *, n: int = 1, multimodal=None, sender=True, **fields) -> Req:
    """Prefill's scheduler's copy of a request (a sender: prefill's side)."""
    req = Req(rid, "hello", array("q", [1, 2, 3]), SamplingParams(max_new_tokens=4, n=n), **fields)
    req.multimodal_inputs = multimodal
    req.disagg_kv_sender = object() if sender else None
    return req


# A feature recovery does not take: (the tokenizer's fields, the scheduler's) of one request using it.
FEATURES = {
    "parallel": ({"sampling_params": {"n": 2}}, {"n": 2}),
    "logprobs": ({"return_logprob": True}, {"return_logprob": True}),
    "session": ({"session_params": {"id": "s"}}, {"session_id": "s"}),
    "multimodal": ({"image_data": "a.png"}, {"multimodal": object()}),
    "lora": ({"lora_path": "adapter"}, {"lora_id": "adapter"}),
    "embeds": ({"input_embeds": [[0.0, 1.0]]}, {"input_embeds": [[0.0, 1.0]]}),
}


def test_every_feature_of_the_shape_is_named():
    assert set(FEATURES) == {f for f in recovery_rule.Shape.__dataclass_fields__}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_both_sides_read_a_feature_alike_and_exclude_it(feature):
    as_input, as_req = FEATURES[feature]
    shape = recovery_rule.input_shape(_input(**as_input))
    assert shape == recovery_rule.req_shape(_req(**as_req))
    assert recovery_rule.excluded(shape) == feature


def test_a_plain_request_is_taken_on_both_sides():
    shape = recovery_rule.input_shape(_input())
    assert shape == recovery_rule.req_shape(_req())
    assert recovery_rule.excluded(shape) is None


def test_the_cause_is_a_failed_chunk_write_of_any_kind():
    for kind, text in verdict_wording.UPSTREAM_CHUNK_FAILED.items():
        assert recovery_rule.cause_of(f"Prefill transfer failed with exception {text} of room 5") == "chunk_failure"
    assert recovery_rule.cause_of(verdict_wording.PEER_LOST_TAG + ": decode 10.0.0.2:7000 silent") is None
    assert recovery_rule.cause_of(None) is None


@pytest.mark.parametrize("stage", DEADLINED)
def test_the_cause_is_a_deadline_only_in_a_stage_that_waits_for_prefill_s_kv(stage):
    want = "transfer_deadline" if stage in (pd_queues.DECODE_TRANSFER, pd_queues.PREFILL_INFLIGHT) else None
    assert recovery_rule.cause_of(_deadline(stage)) == want


# (the room's failure reason, the status it is answered with when not recovered): every failure the rule reads
FAILURES = [(KV_FAILED, 500), (verdict_wording.UPSTREAM_CHUNK_FAILED["aux"], 500)] + [
    (_deadline(stage), 504) for stage in DEADLINED] + [
    (verdict_wording.PEER_LOST_TAG + ": decode 10.0.0.2:7000 silent", 502), ("KV transfer failed", 500)]


@pytest.mark.parametrize("reason,status", FAILURES)
@pytest.mark.parametrize("attempts", ["0", "1", "2"])
@pytest.mark.parametrize("attempt", [0, 1])
def test_prefill_hands_over_exactly_the_legs_decode_re_runs(monkeypatch, reason, status, attempts, attempt):
    """One rule, both sides: for the same failure of the same attempt, prefill hands its leg over (the verdict's
    rows HANDED_TO_RECOVERY, DEADLINE_HANDED_TO_RECOVERY) exactly when decode's tokenizer holds the end back and
    starts another attempt (its cause, answered with that cause's status, and an attempt left)."""
    monkeypatch.setenv(KNOB, attempts)
    rid = recovery_attempt.attempt_rid("r", attempt) if attempt else "r"
    answer = {"type": "abort", "message": reason, "status_code": status}
    decode_re_runs = (recovery_rule.enabled() and recovery_rule.cause_of_answer(answer) is not None
                      and recovery_rule.another_attempt(attempt))
    assert recovery_rule.prefill_hands_over(_req(rid), reason) == decode_re_runs


def test_prefill_hands_a_leg_over_while_decode_has_attempts_left(monkeypatch):
    """Decode starts attempt n+1 after n made while n < the knob; prefill reads n from its leg's rid."""
    first, second = "r", recovery_attempt.attempt_rid("r", 1)
    monkeypatch.setenv(KNOB, "0")  # off: nothing is handed over (today's 500)
    assert not recovery_rule.prefill_hands_over(_req(first), KV_FAILED)
    monkeypatch.setenv(KNOB, "1")
    assert recovery_rule.prefill_hands_over(_req(first), KV_FAILED)
    assert not recovery_rule.prefill_hands_over(_req(second), KV_FAILED)  # the last attempt answers the failure
    assert [recovery_rule.another_attempt(n) for n in (0, 1)] == [True, False]
    monkeypatch.setenv(KNOB, "2")
    assert recovery_rule.prefill_hands_over(_req(second), KV_FAILED)


def test_only_prefill_s_copy_of_a_plain_request_is_handed_over(monkeypatch):
    monkeypatch.setenv(KNOB, "1")
    assert not recovery_rule.prefill_hands_over(_req(sender=False), KV_FAILED)  # decode's copy: its tokenizer decides
    for _, as_req in FEATURES.values():
        assert not recovery_rule.prefill_hands_over(_req(**as_req), KV_FAILED)
