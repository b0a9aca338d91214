"""Counterexamples of the lifecycle model (testing/lifecycle_model.py), each a named test: the shortest step list
that reaches it, replayed on the model (same harnesses, same wire, same contract). A bug still open is
xfail(strict=True) naming it, and sits in `lifecycle_model.KNOWN_BUGS`; when its fix merges the test XPASSes:
remove the mark and the KNOWN_BUGS entry together."""

import pytest

from testing import lifecycle_model
from testing.lifecycle_model import LifecycleMachine

pytestmark = pytest.mark.unit


@pytest.fixture
def model(monkeypatch):
    """A machine whose contract is the full one (no known bug relaxed)."""
    monkeypatch.setattr(lifecycle_model, "KNOWN_BUGS", set())
    machine = LifecycleMachine()
    machine.check_step()
    yield machine


def steps(machine, *calls):
    for name, kwargs in calls:
        getattr(machine, name)(**kwargs)
        machine.check_step()


def test_release_on_prefill_keeps_a_handshake_that_came_before_its_request(model):
    """Decode got its copy first, preallocated and sent its handshake; prefill's copy is still on its way (waiting at
    prefill's tokenizer, paused for the RL step) when prefill releases and resumes its memory. The copy then
    arrives: it must complete with the handshake decode already sent (decode does not send it again).
    Found by the model (ci profile, shrunk by hand from a 14-step counterexample). Fixed: release/resume keeps a handshake whose request is
    still on its way (`room_reads.awaits_its_request`). Stock upstream 0.5.23: its
    release clears nothing of the kv manager's tables, so the handshake stays and the request completes."""
    steps(model,
          ("new_request_decode_first", {}),
          ("scheduler_pass", {"side": "decode"}),  # decode preallocates: its handshake goes out
          ("deliver_handshake", {"i": 0}),  # ... and lands in prefill's manager before the request
          ("rl_step", {"side": "prefill"}))  # pause, release, resume, continue on prefill
    model.teardown()  # settle: the late copy arrives; with the clock standing still both complete


def test_decode_first_completes(model):
    """The same ordering without the release completes (the control of the test above)."""
    steps(model,
          ("new_request_decode_first", {}),
          ("scheduler_pass", {"side": "decode"}),
          ("deliver_handshake", {"i": 0}))
    model.teardown()
    r = model.reqs[0]
    assert (r.prefill.answer, r.decode.answer) == (200, 200)


def test_leftover_room_failure_after_decode_abort_all(model):
    """The model's first counterexample was its own wire's (a decode abort delivered to a prefill room already
    cleared left `request_status` / `failure_records` behind): the wire now drops a status for a room that ended, as
    the real backends do. Kept as a check of the wire: both sides end idle."""
    steps(model,
          ("new_request_prefill_first", {}),
          ("late_copy", {"i": 0}),
          ("scheduler_pass", {"side": "decode"}),
          ("abort_all", {"side": "decode"}))
    model.teardown()


# ---------------------------------------------------------------------- recovery (docs/recovery.md)
# decode's tokenizer re-runs a request whose last chunk write failed on prefill before its first token. Stock upstream
# 0.5.23, and the fork with SGLANG_FORK_RECOVERY_ATTEMPTS=0: the client is answered 500 naming the chunk.

def _failed_first_attempt(model, attempts, budget="ample"):
    """A request whose only (last) chunk write fails on prefill; decode hears of it and ends its copy 500, which
    its tokenizer passes to recovery (attempts / budget: the knobs)."""
    model.set_recovery(attempts, budget)
    steps(model,
          ("new_request_both", {}),
          ("chunk_fails", {"i": 0, "kind": "last"}),
          ("scheduler_pass", {"side": "decode"}),  # prealloc: decode's handshake goes out
          ("deliver_handshake", {"i": 0}),
          ("scheduler_pass", {"side": "prefill"}),  # bootstrap, forward, the last chunk's write fails
          ("scheduler_pass", {"side": "prefill"}),
          ("deliver_notices", {}),  # decode told
          ("scheduler_pass", {"side": "decode"}))  # decode ends its copy 500: its tokenizer asks recovery
    return model.clients[0]


def _fail_the_attempt(model):
    """The running attempt's copies arrive; its last chunk write fails too."""
    steps(model,
          ("attempt_copy_arrives", {"i": 0}),  # decode's copy first
          ("attempt_copy_arrives", {"i": 0}),  # then the prefill leg
          ("chunk_fails", {"i": 0, "kind": "last"}),
          ("scheduler_pass", {"side": "decode"}),
          ("deliver_handshake", {"i": 0}),
          ("scheduler_pass", {"side": "prefill"}),
          ("scheduler_pass", {"side": "prefill"}),
          ("deliver_notices", {}),
          ("scheduler_pass", {"side": "decode"}))


def _answer(client):
    attempt, s, meta = client.final
    return attempt, lifecycle_model.status_of(s), meta.get("recovery"), s.output_ids


def test_a_failed_chunk_before_the_first_token_is_recovered(model):
    """With one attempt allowed, the failed end is held back and the request re-runs under a new room (prefill leg
    `<rid>~recovery-1`): the client gets one answer, the attempt's completion, and `meta_info` says so; the failed
    attempt's rooms are given back on both servers (settle's resource check)."""
    c = _failed_first_attempt(model, attempts=1)
    assert len(c.legs) == 2 and c.legs[1].prefill_rid == f"{c.rid}~recovery-1" and c.legs[1].room != c.legs[0].room
    assert not c.delivered and c.legs[0].decode.answer == 500 and c.legs[0].prefill.answer == "abort"  # handed over
    model.teardown()
    attempt, answer, meta, tokens = _answer(c)
    assert (attempt, answer, meta) == (1, 200, {"attempts": 1, "cause": "chunk_failure"}) and tokens, c.final


def test_recovery_off_answers_the_failed_chunk(model):
    """SGLANG_FORK_RECOVERY_ATTEMPTS=0 (the default): the client gets the failure's 500, as upstream's."""
    c = _failed_first_attempt(model, attempts=0)
    model.teardown()
    assert len(c.legs) == 1 and _answer(c)[:3] == (0, 500, None), c.final


def test_a_fault_on_every_attempt_answers_the_failure_once(model):
    """The attempt fails the same way: with no attempt left, its 500 is the client's one answer."""
    c = _failed_first_attempt(model, attempts=1)
    _fail_the_attempt(model)
    model.teardown()
    assert len(c.legs) == 2 and _answer(c)[:3] == (1, 500, {"attempts": 1, "cause": "chunk_failure"}), c.final


def test_a_spent_budget_answers_the_second_failure(model):
    """Two attempts allowed, but the budget (from the first failure) is spent when the first attempt fails: that
    failure is answered, no second attempt."""
    c = _failed_first_attempt(model, attempts=2, budget="spent")
    _fail_the_attempt(model)
    model.teardown()
    assert len(c.legs) == 2 and _answer(c)[:2] == (1, 500), c.final


def test_two_attempts_after_two_failures(model):
    """Two attempts allowed, the budget ample: the second failure is re-run too, and the third attempt completes."""
    c = _failed_first_attempt(model, attempts=2)
    _fail_the_attempt(model)
    assert len(c.legs) == 3 and c.legs[2].prefill_rid == f"{c.rid}~recovery-2"
    model.teardown()
    assert _answer(c)[:3] == (2, 200, {"attempts": 2, "cause": "chunk_failure"}), c.final


def test_a_client_abort_while_an_attempt_starts_is_answered(model):
    """The client aborts after decode held the failed end back and before the attempt reached decode's scheduler
    (in `_rerun`: asking prefill's bootstrap server its address, re-tokenizing): decode's scheduler has nothing of
    that rid to end. Found by the model as a completion answered to the client that aborted; now decode's tokenizer
    answers the abort itself (recovery.after_abort_request; test_recovery_skew_e2e on real servers) and the attempt
    sends nothing. Stock upstream 0.5.23 never re-runs: the abort comes after the failure's 500, which the client
    already has."""
    c = _failed_first_attempt(model, attempts=1)
    assert c.starting()
    steps(model, ("client_abort", {"side": "decode", "i": 0}))
    model.teardown()
    attempt, answer, _, tokens = _answer(c)
    assert (attempt, answer, tokens) == (1, lifecycle_model.ABORT, ()), c.final  # the abort's answer, by attempt 1
    assert not (c.legs[1].prefill.arrived or c.legs[1].decode.arrived), c.legs[1]  # the attempt sent nothing


@pytest.mark.parametrize("attempts", [0, 1])
def test_an_abort_all_in_the_pass_a_transfer_deadline_falls_is_answered_as_the_abort(model, attempts):
    """Decode's copy waits for prefill's KV (prefill's copy not there yet); the transfer deadline passes; then an
    `abort_all` on decode. Decode's next pass scans the deadline before it polls the receiver the abort concluded
    Failed. Found by the model's long run (shrunk by hand from a 40-step counterexample): the deadline ended the room
    504 though the abort had already decided it, so the client that aborted got the deadline (recovery off) or,
    with recovery on, a re-run and a completion. Fixed: the deadline leaves a decode entry an abort already ended to
    the poll right after it (`transfer_deadline._not_aborted`), and an abort that reaches decode's tokenizer ends
    recovery for that request (`recovery_life`: IDLE/RUNNING on ABORTED -> ENDED). Now the abort's answer, as stock
    upstream 0.5.23 (no deadline) gives it."""
    model.set_recovery(attempts, "ample")
    steps(model,
          ("new_request_decode_first", {}),
          ("scheduler_pass", {"side": "decode"}),  # preallocated, its handshake out, waiting for the KV
          ("clock_advances", {"seconds": lifecycle_model.DEADLINE + 1.0}),
          ("abort_all", {"side": "decode"}))
    model.teardown()
    c = model.clients[0]
    attempt, answer, meta, tokens = _answer(c)
    assert (len(c.legs), attempt, answer, meta, tokens) == (1, 0, lifecycle_model.ABORT, None, ()), c.final


def test_an_abort_that_reached_decode_s_tokenizer_first_is_never_re_run(model):
    """The client aborts while decode's scheduler is ending its copy for a failed chunk write: the abort reaches
    decode's tokenizer (recovery's hook on `abort_request`) before the scheduler's 500 does, and the AbortReq is
    still on its way to the scheduler. Before the fix the 500 was held back and the request re-run: a completion
    answered to a client that had aborted. Now recovery is over for it once the abort reached the tokenizer: the
    client gets the 500, as with recovery off (and as stock upstream 0.5.23, which answers that 500 too)."""
    from sglang.srt.disaggregation.fork_recovery import recovery

    model.set_recovery(1, "ample")
    steps(model,
          ("new_request_both", {}),
          ("chunk_fails", {"i": 0, "kind": "last"}),
          ("scheduler_pass", {"side": "decode"}),
          ("deliver_handshake", {"i": 0}),
          ("scheduler_pass", {"side": "prefill"}),
          ("scheduler_pass", {"side": "prefill"}),
          ("deliver_notices", {}))
    c = model.clients[0]
    c.aborted = True  # the model's record: an abort reached this client's request (no completion may follow)
    recovery.after_abort_request(None, model.tm, c.rid, False)  # the tokenizer's side only
    steps(model, ("scheduler_pass", {"side": "decode"}))  # the 500 reaches the tokenizer after the abort
    model.teardown()
    attempt, answer, meta, _ = _answer(c)
    assert (len(c.legs), attempt, answer, meta) == (1, 0, 500, None), c.final
