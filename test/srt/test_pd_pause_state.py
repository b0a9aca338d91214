"""The engine pause state machine (pd_pause_state), the pause gate (pd_pause_gate) and
pd_pause's timer shift, without a server (fast).

The end-to-end behaviour (409 over HTTP, cycles under load) is in test_pd_pause.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang.srt.managers import pd_pause, pd_pause_gate
from sglang.srt.managers.pd_pause_state import EnginePauseState, PauseStateError

CYCLE = [
    ("pause_generation", "retract"),
    ("release_memory_occupation", None),
    ("resume_memory_occupation", None),
    ("continue_generation", None),
]
OPS = [op for op, _ in CYCLE]


def _run(state: EnginePauseState, op: str, mode=None):
    state.check(op, mode)
    state.done(op, mode)


def test_full_cycle_and_short_cycle():
    s = EnginePauseState()
    seen = []
    for op, mode in CYCLE:
        _run(s, op, mode)
        seen.append(s.state)
    assert seen == ["paused", "released", "resumed", "running"]
    assert s.mode is None
    _run(s, "pause_generation", "in_place")
    assert (s.state, s.mode) == ("paused", "in_place")
    _run(s, "continue_generation")  # pause without release is a cycle too
    assert s.state == "running"


@pytest.mark.parametrize("prefix", range(len(CYCLE)))
def test_every_out_of_order_call_is_409_and_changes_nothing(prefix):
    s = EnginePauseState()
    for op, mode in CYCLE[:prefix]:
        _run(s, op, mode)
    allowed = {CYCLE[prefix][0]} | ({"continue_generation"} if s.state == "paused" else set())
    for op in OPS:
        if op in allowed:
            continue
        before = s.as_dict()
        with pytest.raises(PauseStateError) as err:
            s.check(op, "in_place")
        assert err.value.status_code == 409
        assert f"engine state is '{s.state}'" in str(err.value), str(err.value)
        assert s.as_dict() == before
    # ...and the cycle still completes from here.
    for op, mode in CYCLE[prefix:]:
        _run(s, op, mode)
    assert s.state == "running"


def test_unknown_mode_and_concurrent_call_are_rejected():
    s = EnginePauseState()
    with pytest.raises(PauseStateError, match="unknown mode 'sideways'.*running"):
        s.check("pause_generation", "sideways")
    s.busy = "pause_generation"
    with pytest.raises(PauseStateError, match="pause_generation is in progress"):
        s.check("continue_generation")
    assert s.state == "running"


def test_pause_gate_opens_only_for_aborted_requests():
    tm = SimpleNamespace(is_pause=True)
    waiting = {"a": SimpleNamespace(), "b": SimpleNamespace()}
    assert not pd_pause_gate.gate_open(tm, waiting)
    pd_pause_gate.raise_if_gate_aborted(waiting)  # nothing aborted: no error
    waiting["b"]._fork_gate_abort = True
    assert pd_pause_gate.gate_open(tm, waiting)
    with pytest.raises(pd_pause_gate.PauseGateAbort) as err:
        pd_pause_gate.raise_if_gate_aborted(waiting)
    assert err.value.status_code == 499 and "rid=b" in str(err.value)
    assert pd_pause_gate.gate_open(SimpleNamespace(is_pause=False), {"a": SimpleNamespace()})


def test_upstream_timers_of_live_transfers_skip_the_pause():
    """shift_upstream_timers moves the start times upstream's bootstrap/waiting timeouts
    read (CommonKVSender/Receiver attributes) on every request in the real queues."""
    from testing.queue_harness import DecodeHarness, PrefillHarness

    for cls in (PrefillHarness, DecodeHarness):
        with cls() as h:
            with h.active():
                req = h.add(h.make_req())
                sched = h.scheduler
                sched.disagg_prefill_bootstrap_queue = getattr(
                    sched, "disagg_prefill_bootstrap_queue", None) or (
                    h.queue if cls is PrefillHarness else None)
                if cls is DecodeHarness:
                    sched.disagg_decode_prealloc_queue = h.queue
                    sched.disagg_decode_transfer_queue = h.transfer_queue
                endpoints = pd_pause._transfer_endpoints(sched)
                assert len(endpoints) == 1, cls
                ep = endpoints[0]
                ep.init_time, ep._prefill_wait_start = 1000.0, None
                assert pd_pause.shift_upstream_timers(sched, 42.5) == 1
                assert (ep.init_time, ep._prefill_wait_start) == (1042.5, None)
                assert pd_pause.shift_upstream_timers(sched, 0.0) == 0
                h.abort(req.rid)


def test_invalid_pause_body_names_the_state():
    """The validation-error hook (http_server patch) adds the state to /pause_generation
    400s only."""
    from sglang.srt.managers import pd_pause_state

    tm = SimpleNamespace()
    gs = SimpleNamespace(tokenizer_manager=tm)
    s = pd_pause_state._state_of(tm)
    _run(s, "pause_generation", "in_place")
    msg = pd_pause_state.name_state_if_pause_call("/pause_generation", "bad mode", gs)
    assert "engine state is 'paused' (pause mode in_place)" in msg and msg.endswith("bad mode")
    assert pd_pause_state.name_state_if_pause_call("/generate", "bad", gs) == "bad"
    assert pd_pause_state.name_state_if_pause_call("/pause_generation", "bad", None) == "bad"
