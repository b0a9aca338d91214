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
