"""Which ends recovery takes for a recoverable cause (docs/recovery.md, "What is recovered"): the finish reason decode's
tokenizer holds back (`recovery_rule.cause_of_answer`: the verdict's status and message, the one thing of the verdict's
that reaches the tokenizer), and whether decode's own deadline hands its room to recovery (`recovery_rule.hands_over`);
prefill reads the same rule for its leg (test_recovery_rule). The
messages are the fork's own (`verdict_wording.DEADLINE_MESSAGE`, as transfer_deadline writes it) and upstream's (its
chunk failures, decode's transfer-failure wrapping of prefill's reason). Fast; starts no server.

Stock upstream 0.5.23 recovers nothing: every end here is answered (a chunk failure 500; upstream has no deadline in
these stages). The fork without recovery answers each as the verdict decides (500, 504, 502, ...)."""

from __future__ import annotations

from http import HTTPStatus

import pytest

from sglang.srt.disaggregation.fork_ending import pd_queues, recovery_rule, verdict_wording
from sglang.srt.disaggregation.fork_transfer.transfer_deadline_knob import ARG, ENV

pytestmark = pytest.mark.unit

RID, ROOM = "rec-1", 4242
STAGES = (pd_queues.PREFILL_BOOTSTRAP, pd_queues.PREFILL_WAITING, pd_queues.PREFILL_INFLIGHT,
          pd_queues.DECODE_PREALLOC, pd_queues.DECODE_TRANSFER)
RECOVERED = {pd_queues.DECODE_TRANSFER, pd_queues.PREFILL_INFLIGHT}


def _deadline(stage: str) -> str:
    return verdict_wording.DEADLINE_MESSAGE.format(rid=RID, room=ROOM, spent=5.3, stage=stage, deadline=5.0, env=ENV,
                                                   arg=ARG)


def _told(reason: str) -> str:
    """Decode's message for a room prefill failed (upstream's DecodeTransferQueue, the receiver's exception)."""
    return (f"Decode transfer failed for request rank=0 decode_req.req.rid='{RID}' decode_req.req.bootstrap_room={ROOM} "
            f"with exception Failed to get kvcache from prefill instance, error: {reason}")


def _abort(message, status):
    return {"type": "abort", "message": message, "status_code": status, "err_type": None}


@pytest.mark.parametrize("stage", STAGES)
def test_a_deadline_is_recovered_only_in_the_stages_that_wait_for_prefills_kv(stage):
    own, told = _deadline(stage), _told(_deadline(stage))
    assert verdict_wording.deadline_stage(own) == stage and verdict_wording.deadline_stage(told) == stage
    want = recovery_rule.CAUSE_DEADLINE if stage in RECOVERED else None
    assert recovery_rule.cause_of_answer(_abort(own, HTTPStatus.GATEWAY_TIMEOUT)) == want
    assert recovery_rule.cause_of_answer(_abort(told, HTTPStatus.GATEWAY_TIMEOUT)) == want
    assert recovery_rule.cause_of_answer(_abort(own, 504)) == want  # the status as an int (it crossed a process)


@pytest.mark.parametrize("kind", ["kv", "aux", "state"])
def test_a_failed_chunk_write_of_each_kind_is_recovered(kind):
    message = _told(f"{verdict_wording.UPSTREAM_CHUNK_FAILED[kind]} of {ROOM} to 127.0.0.1:7000")
    assert recovery_rule.cause_of_answer(_abort(message, HTTPStatus.INTERNAL_SERVER_ERROR)) == recovery_rule.CAUSE_CHUNK


@pytest.mark.parametrize("reason", [
    f"{verdict_wording.PEER_LOST_TAG}: prefill peer 10.0.0.1:8998 lost (its bootstrap server does not answer)",
    f"{verdict_wording.PEER_LOST_TAG}: prefill bootstrap server 10.0.0.1:8998 unreachable: declared lost by decode's "
    "peer monitor, and its parallel info could not be fetched",
    f"{verdict_wording.UPSTREAM_PREFILL_LOST} (bootstrap_addr: 10.0.0.1:8998)",
    # as decode answers them: upstream wraps the reason (its handshake's and its transfer's failure messages)
    f"Decode handshake failed for request rank=0 decode_req.req.rid='{RID}' decode_req.req.bootstrap_room={ROOM} with "
    f"exception KVTransferError(bootstrap_room={ROOM}): {verdict_wording.PEER_LOST_TAG}: prefill bootstrap server "
    "10.0.0.1:8998 unreachable: declared lost by decode's peer monitor, and its parallel info could not be fetched",
    _told(f"{verdict_wording.PEER_LOST_TAG}: prefill peer 10.0.0.1:8998 lost (its bootstrap server does not answer)"),
])
def test_a_lost_prefill_is_a_cause_of_its_own(reason):
    """Decode's answer for a request whose prefill it declared lost (its peer monitor, its handshake's fetch, upstream's
    heartbeat): a cause of its own, taken with the lost peer's status only. Whether it is re-run also needs another
    prefill (test_known_prefills)."""
    assert recovery_rule.cause_of_answer(_abort(reason, HTTPStatus.BAD_GATEWAY)) == recovery_rule.CAUSE_LOST_PREFILL
    assert recovery_rule.cause_of_answer(_abort(reason, 502)) == recovery_rule.CAUSE_LOST_PREFILL
    assert recovery_rule.cause_of_answer(_abort(reason, HTTPStatus.GATEWAY_TIMEOUT)) is None


@pytest.mark.parametrize("reason,status", [
    (f"{verdict_wording.PEER_LOST_TAG}: decode peer 10.0.0.2:9000 lost (no heartbeat)", HTTPStatus.BAD_GATEWAY),
    (verdict_wording.CLIENT_ABORT_MESSAGE, None),  # a client's abort
    ("SLA exceeded", HTTPStatus.SERVICE_UNAVAILABLE),  # an SLA abort
    (verdict_wording.PAUSE_ABORT_MESSAGE, None),
    ("KV transfer failed", HTTPStatus.INTERNAL_SERVER_ERROR),  # a failure naming no chunk
    (_deadline(pd_queues.DECODE_TRANSFER), HTTPStatus.INTERNAL_SERVER_ERROR),  # a deadline's text, not its status
    (verdict_wording.UPSTREAM_CHUNK_FAILED["kv"], HTTPStatus.GATEWAY_TIMEOUT),  # a chunk's text, not its status
])
def test_no_other_end_is_recovered(reason, status):
    assert recovery_rule.cause_of_answer(_abort(reason, status)) is None


def test_only_an_abort_is_recovered():
    assert recovery_rule.cause_of_answer({"type": "length", "length": 12}) is None
    assert recovery_rule.cause_of_answer(None) is None


@pytest.mark.parametrize("attempts", ["0", "1"])
@pytest.mark.parametrize("stage", [pd_queues.DECODE_TRANSFER, pd_queues.DECODE_PREALLOC])
def test_decode_hands_its_stalled_room_over_only_with_recovery_on_in_a_recoverable_stage(monkeypatch, attempts, stage):
    monkeypatch.setenv("SGLANG_FORK_RECOVERY_ATTEMPTS", attempts)
    assert recovery_rule.hands_over(stage) == (attempts == "1" and stage == pd_queues.DECODE_TRANSFER)
