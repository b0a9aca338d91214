"""The engine pause state machine and the pause gate (pd_pause) and
pd_pause's timer shift, without a server (fast).

The end-to-end behaviour (409 over HTTP, cycles under load) is in test_pd_pause.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang.srt.disaggregation.fork_ending import pd_queues, verdict_wording
from sglang.srt.managers.fork_pause import engine_pause_state, pause_gate, pd_pause, scheduler_pause, tokenizer_pause
from sglang.srt.managers.fork_pause.engine_pause_state import ALL_TAGS, EnginePauseState, PauseStateError

pytestmark = pytest.mark.unit

CYCLE = [
    ("pause_generation", "retract"),
    ("release_memory_occupation", None),
    ("resume_memory_occupation", None),
    ("continue_generation", None),
]


def _run(state: EnginePauseState, op: str, mode=None, tags=None, in_flight=0):
    state.check(op, mode, tags, in_flight)
    state.done(op, mode, tags)


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


# Calls upstream cannot survive (its scheduler dies or the engine computes on released
# memory) or that have no defined meaning: 409, nothing changed. Each (state prefix,
# call, mode/tags, in-flight count).
REJECTED = [
    ([], "resume_memory_occupation", None, None, 0),  # upstream: KeyError in the scheduler
    ([], "release_memory_occupation", None, None, 3),  # busy, no pause: upstream asserts
    (CYCLE[:1], "resume_memory_occupation", None, None, 0),
    (CYCLE[:1], "pause_generation", "abort", None, 0),  # another mode mid-pause
    (CYCLE[:2], "release_memory_occupation", None, None, 0),  # already released
    (CYCLE[:2], "pause_generation", "abort", None, 0),
    (CYCLE[:3], "resume_memory_occupation", None, None, 0),
]


@pytest.mark.parametrize("case", range(len(REJECTED)))
def test_calls_upstream_cannot_survive_are_409_and_change_nothing(case):
    prefix, op, mode, tags, in_flight = REJECTED[case]
    s = EnginePauseState()
    for p_op, p_mode in prefix:
        _run(s, p_op, p_mode)
    before = s.as_dict()
    with pytest.raises(PauseStateError) as err:
        s.check(op, mode, tags, in_flight)
    assert err.value.status_code == 409
    assert f"engine state is '{s.state}'" in str(err.value), str(err.value)
    assert s.as_dict() == before
    if in_flight:
        assert f"{in_flight} request(s) in flight" in str(err.value)
        assert "call pause_generation first" in str(err.value)
    # ...and the cycle still completes from here.
    for p_op, p_mode in CYCLE[len(prefix):]:
        _run(s, p_op, p_mode)
    assert s.state == "running"


def test_colocated_loop_release_without_pause_resume_per_tag():
    """The RL colocated loop: release {} (no pause), resume ["weights"], update,
    resume ["kv_cache"]: serving again with no continue_generation."""
    s = EnginePauseState()
    _run(s, "release_memory_occupation")
    assert (s.state, s.released, s.serving()) == ("released", list(ALL_TAGS), False)
    _run(s, "resume_memory_occupation", tags=["weights"])
    assert s.state == "released" and not s.serving()
    assert s.to_resume(["kv_cache"]) == ["kv_cache", "cuda_graph"]
    _run(s, "resume_memory_occupation", tags=["kv_cache"])
    assert (s.state, s.released, s.serving()) == ("running", [], True)
    # a framework that resumes cuda_graph on its own afterwards: accepted, a no-op
    s.check("resume_memory_occupation", None, ["cuda_graph"])
    assert s.to_resume(["cuda_graph"]) == []
    _run(s, "resume_memory_occupation", tags=["cuda_graph"])
    with pytest.raises(PauseStateError, match=r"\['cuda_graph'\] not released"):
        s.check("resume_memory_occupation", None, ["cuda_graph"])


def test_release_and_resume_with_tags():
    s = EnginePauseState()
    _run(s, "release_memory_occupation", tags=["kv_cache"])
    assert s.released == ["kv_cache"]
    with pytest.raises(PauseStateError, match=r"\['weights'\] not released"):
        s.check("resume_memory_occupation", None, ["weights"])
    with pytest.raises(PauseStateError, match="already released"):
        s.check("release_memory_occupation", None, ["kv_cache"])
    _run(s, "release_memory_occupation", tags=["weights"])  # another tag: fine
    assert s.released == ["kv_cache", "weights"]
    _run(s, "resume_memory_occupation")  # no tags: whatever is released
    assert s.serving()
    # a restarted engine: released, resumed ["weights"] before its first update
    _run(s, "release_memory_occupation")
    _run(s, "resume_memory_occupation", tags=["weights"])
    _run(s, "resume_memory_occupation", tags=["kv_cache", "cuda_graph"])
    assert s.serving()


def test_pause_and_release_mix():
    s = EnginePauseState()
    _run(s, "pause_generation", "abort")
    s.check("pause_generation", "abort")  # same mode again: accepted (a no-op)
    _run(s, "release_memory_occupation", tags=["kv_cache"])
    _run(s, "resume_memory_occupation", tags=["kv_cache"])
    assert s.state == "resumed" and not s.serving()  # the pause still holds
    _run(s, "continue_generation")
    assert s.serving()
    # continue on a running engine is a no-op for upstream: accepted
    s.check("continue_generation")
    # The colocated RL loop: released without a pause, the weights resumed, paused for the update, continued
    # while the KV cache is still released: the pause ends, requests stay held until the KV cache is resumed.
    _run(s, "release_memory_occupation")
    _run(s, "resume_memory_occupation", tags=["weights"])
    _run(s, "pause_generation", "abort")
    _run(s, "continue_generation")
    assert (s.state, s.mode, s.gate_closed_by_release, s.serving()) == ("released", None, True, False)
    _run(s, "resume_memory_occupation", tags=["kv_cache"])
    assert s.serving()
    # The same with the release inside the pause.
    _run(s, "pause_generation", "retract")
    _run(s, "release_memory_occupation")
    _run(s, "continue_generation")
    assert (s.state, s.mode, s.gate_closed_by_release) == ("released", None, True)
    _run(s, "resume_memory_occupation")
    assert s.serving()


def test_unknown_mode_and_concurrent_call_are_rejected():
    s = EnginePauseState()
    with pytest.raises(PauseStateError, match="unknown mode 'sideways'.*running"):
        s.check("pause_generation", "sideways")
    s.begin("pause_generation", "abort")
    with pytest.raises(PauseStateError, match="pause_generation is in progress"):
        s.check("continue_generation")
    assert s.state == "running"


def test_pause_gate_opens_only_for_aborted_requests():
    tm = SimpleNamespace(is_pause=True, rid_to_state={}, disaggregation_mode="null")  # not decode: nobody to tell
    waiting = {"a": SimpleNamespace(), "b": SimpleNamespace()}
    tm.rid_to_state.update(waiting)
    assert not pause_gate.gate_open(tm, waiting)
    assert not pause_gate.gate_aborted(waiting)
    pause_gate.marks(waiting["b"]).gate_abort = "Aborted by the client while the engine was paused (rid=b)."
    assert pause_gate.gate_open(tm, waiting)
    # answered as upstream answers an abort: 200 body, finish_reason abort, the reason
    (out,) = pause_gate.gate_abort_answers(tm, SimpleNamespace(is_single=True), {"b": waiting["b"]})
    assert out["meta_info"]["finish_reason"] == {
        "type": "abort", "status_code": None,
        "message": "Aborted by the client while the engine was paused (rid=b).",
    }
    assert out["meta_info"]["id"] == "b" and "b" not in tm.rid_to_state
    assert pause_gate.gate_open(SimpleNamespace(is_pause=False), {"a": SimpleNamespace()})


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
                endpoints = pd_queues.transfer_endpoints(sched)
                assert len(endpoints) == 1, cls
                ep = endpoints[0]
                ep.init_time, ep._prefill_wait_start = 1000.0, None
                assert scheduler_pause.shift_upstream_timers(sched, 42.5) == 1
                assert (ep.init_time, ep._prefill_wait_start) == (1042.5, None)
                assert scheduler_pause.shift_upstream_timers(sched, 0.0) == 0
                h.abort(req.rid)


def test_invalid_pause_body_names_the_state():
    """The validation-error hook (http_server patch) adds the state to /pause_generation
    400s only."""
    tm = SimpleNamespace()
    gs = SimpleNamespace(tokenizer_manager=tm)
    s = engine_pause_state.state_of(tm)
    _run(s, "pause_generation", "in_place")
    msg = engine_pause_state.name_state_if_pause_call("/pause_generation", "bad mode", gs)
    assert "engine state is 'paused' (pause mode in_place)" in msg and msg.endswith("bad mode")
    assert engine_pause_state.name_state_if_pause_call("/generate", "bad", gs) == "bad"
    assert engine_pause_state.name_state_if_pause_call("/pause_generation", "bad", None) == "bad"


def test_abort_pause_answers_once_every_answer_is_decided():
    """The abort-mode pause's wait (around_is_locked on upstream's RWLock.is_locked):
    a reader still held by an HTTP handler whose answer is decided (its state left
    rid_to_state and its output event is set, in that order, as upstream's
    _handle_batch_output does) does not hold the pause; a request past the gate whose
    answer is not decided keeps it waiting; one waiting at the pause gate, or not there
    yet, does not. Outside a pause call only the lock counts, as upstream's is_locked."""
    import asyncio
    import inspect

    from sglang.srt.utils.aio_rwlock import RWLock

    original = inspect.unwrap(RWLock.is_locked)

    async def yield_to_loop(n=50):
        for _ in range(n):
            await asyncio.sleep(0)

    async def scenario():
        lock = RWLock()
        running, gated, arriving = (SimpleNamespace(event=asyncio.Event()) for _ in range(3))
        pause_gate.marks(running).at_gate = False  # passed the gate (gate_open's mark)
        pause_gate.marks(gated).at_gate = True
        # arriving: not at the gate yet (waits for the gate's lock the pause holds)
        tm = SimpleNamespace(rid_to_state={"run": running, "gate": gated, "new": arriving})
        for _ in range(2):  # the running request's handler; one writing a decided answer
            await lock.acquire_reader()
        token = tokenizer_pause._ABORT_PAUSE.set(tm)
        try:
            check = asyncio.ensure_future(tokenizer_pause.around_is_locked(original, lock))
            await yield_to_loop()
            assert not check.done()  # "run" is past the gate, its answer not decided
            del tm.rid_to_state["run"]
            running.event.set()
            assert await asyncio.wait_for(check, 2.0) is False
            assert lock._readers == 2  # answered before the handlers left
        finally:
            tokenizer_pause._ABORT_PAUSE.reset(token)
        # not in a pause call: upstream's criterion, the lock
        check = asyncio.ensure_future(tokenizer_pause.around_is_locked(original, lock))
        await yield_to_loop()
        assert not check.done()
        for _ in range(2):
            await lock.release_reader()
        assert await asyncio.wait_for(check, 2.0) is False

    asyncio.run(scenario())


def test_abort_pause_does_not_wait_for_a_health_probe_a_busy_scheduler_dropped():
    """A gateway's /health on a busy server: upstream's scheduler drops the probe (never answered) and its
    handler holds the probe's state and a model-update reader for a second. The abort-mode pause answers once
    the client requests are decided, not once that handler's sleep ends (it waited up to 1 s: bench/README.md,
    "Through the Rust gateway"); a client request still undecided keeps it waiting as before."""
    import asyncio
    import inspect

    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX
    from sglang.srt.utils.aio_rwlock import RWLock

    original = inspect.unwrap(RWLock.is_locked)

    async def scenario():
        lock = RWLock()
        probe, running = SimpleNamespace(event=asyncio.Event()), SimpleNamespace(event=asyncio.Event())
        for state in (probe, running):
            pause_gate.marks(state).at_gate = False  # both passed the gate
        tm = SimpleNamespace(rid_to_state={f"{HEALTH_CHECK_RID_PREFIX}_0f": probe, "rollout-1": running})
        for _ in range(2):  # the probe's handler and the running request's
            await lock.acquire_reader()
        token = tokenizer_pause._ABORT_PAUSE.set(tm)
        loop = asyncio.get_running_loop()
        try:
            check = asyncio.ensure_future(tokenizer_pause.around_is_locked(original, lock))
            await asyncio.sleep(0.05)
            assert not check.done()  # rollout-1's answer is not decided
            t0 = loop.time()
            del tm.rid_to_state["rollout-1"]
            running.event.set()
            assert await asyncio.wait_for(check, 2.0) is False  # before the fix: DRAIN_WAIT_S (3 s), then True
            assert loop.time() - t0 < 0.5
            assert lock._readers == 2 and f"{HEALTH_CHECK_RID_PREFIX}_0f" in tm.rid_to_state
        finally:
            tokenizer_pause._ABORT_PAUSE.reset(token)

    asyncio.run(scenario())


def test_running_request_answers_the_abort_verdict_not_upstreams_bare_abort():
    """After Scheduler.abort_request (upstream set the bare FINISH_ABORT() "Aborted" on each running request it
    reached), keep_abort_verdict makes each answer name why: the client's verdict the marking gave it, a client's
    abort of its rid or of all for one the marking did not see, the pause's; an SLA abort (503, its message) is
    left as it is."""
    from sglang.srt.disaggregation.fork_ending import request_end_cause as ec
    from sglang.srt.disaggregation.fork_ending import verdict as table
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    def running(rid, verdict=None, pending=None):
        req = SimpleNamespace(rid=rid, to_finish=pending or FINISH_ABORT())
        if verdict is not None:
            table.of(req).requested = verdict
        return req

    client = (verdict_wording.CLIENT_ABORT_MESSAGE, None)
    marked = running("marked", verdict=client)
    unseen = running("unseen")  # e.g. decode's last batch, which the marking does not walk
    paused = running("paused", verdict=(pd_pause.PAUSE_ABORT_MESSAGE, None))
    sla = running("sla", verdict=("SLA exceeded", 503), pending=FINISH_ABORT("SLA exceeded", 503))
    scheduler = SimpleNamespace(collect_inflight_reqs=lambda: [marked, unseen, paused, sla])

    pd_pause.keep_abort_verdict(scheduler, AbortReq(rid="unseen"))
    assert (marked.to_finish.message, marked.to_finish.status_code) == client
    assert (unseen.to_finish.message, unseen.to_finish.status_code) == client
    assert table.of(unseen).requested == client
    assert ec.cause_of(unseen)[0] == ec.CLIENT_ABORT
    assert paused.to_finish.message == pd_pause.PAUSE_ABORT_MESSAGE
    assert (sla.to_finish.message, sla.to_finish.status_code) == ("SLA exceeded", 503)

    # A client's /abort_request {"abort_all": true} reaching a request only in decode's last batch: the client's
    # answer, not upstream's bare "Aborted" (a pause's abort_all is never bare: the next test).
    last_batch = running("in decode's last batch only")
    scheduler = SimpleNamespace(collect_inflight_reqs=lambda: [last_batch])
    pd_pause.keep_abort_verdict(scheduler, AbortReq(abort_all=True))
    assert (last_batch.to_finish.message, last_batch.to_finish.status_code) == client
    assert ec.cause_of(last_batch)[0] == ec.CLIENT_ABORT
    # The abort-mode pause's own abort_all names the pause.
    by_pause = running("reached by the pause's abort_all")
    scheduler = SimpleNamespace(collect_inflight_reqs=lambda: [by_pause])
    pd_pause.keep_abort_verdict(scheduler, AbortReq(abort_all=True, finished_reason=pd_pause.pause_finish_reason()))
    assert by_pause.to_finish.message == pd_pause.PAUSE_ABORT_MESSAGE
    assert ec.cause_of(by_pause)[0] == ec.PAUSE


def test_the_abort_mode_pause_never_sends_a_bare_abort_all():
    """upstream's pause_generation(mode=abort) repeats abort_request(abort_all=True) while it waits; each goes to
    the scheduler named (the pause's message), so a bare abort_all there is always a client's. A client's
    abort_all outside a pause is upstream's own."""
    from sglang.srt.managers.io_struct import AbortReq

    sent = []
    tm = SimpleNamespace(_dispatch_to_scheduler=sent.append, is_pause=False, rid_to_state={})

    def upstream_abort_request(tokenizer_manager, rid="", abort_all=False):
        tokenizer_manager._dispatch_to_scheduler(AbortReq(rid=rid, abort_all=abort_all))

    state = engine_pause_state.state_of(tm)
    state.begin("pause_generation", "abort")
    tm.is_pause = True
    for _ in range(3):  # upstream's repeats
        pause_gate.tm_abort_request(upstream_abort_request, tm, abort_all=True)
    assert [(r.abort_all, (r.finished_reason or {}).get("message")) for r in sent] == [
        (True, pd_pause.PAUSE_ABORT_MESSAGE)] * 3
    sent.clear()
    state.ended()
    tm.is_pause = False
    pause_gate.tm_abort_request(upstream_abort_request, tm, abort_all=True)
    assert [(r.abort_all, r.finished_reason) for r in sent] == [(True, None)]


# ----------------------------------------------------------------------------- every (state, call) pair

# Each state reached from a fresh engine by calls the docs list (docs/pause-release-resume.md: "Engine state",
# "Supported sequences"); the pause is in mode retract, the released tags are weights and kv_cache (cuda_graph not).
REACH = {
    "RUNNING": [],
    "PAUSED": [("pause_generation", "retract", None)],
    "RELEASED": [("release_memory_occupation", None, ["weights", "kv_cache"])],
    "RELEASED_IN_PAUSE": [("pause_generation", "retract", None),
                          ("release_memory_occupation", None, ["weights", "kv_cache"])],
    "PAUSED_WHILE_RELEASED": [("release_memory_occupation", None, ["weights", "kv_cache"]),
                              ("pause_generation", "retract", None)],
    "RESUMED": [("pause_generation", "retract", None), ("release_memory_occupation", None, ["weights", "kv_cache"]),
                ("resume_memory_occupation", None, None)],
}
CALLS = {
    "pause (retract)": ("pause_generation", "retract", None),
    "pause (in_place)": ("pause_generation", "in_place", None),
    "continue": ("continue_generation", None, None),
    "release [cuda_graph]": ("release_memory_occupation", None, ["cuda_graph"]),
    "release [weights]": ("release_memory_occupation", None, ["weights"]),
    "resume [weights]": ("resume_memory_occupation", None, ["weights"]),
    "resume {}": ("resume_memory_occupation", None, None),
}
OTHER_MODE = "409 already paused in mode 'retract'; call continue_generation before pausing in another mode"
# (state, call) -> (answer: 200 or the 409's words, upstream's call made, state after, its public name, gate reason).
# Written from the docs' sequences, 409 table and "Per-tag state", not from the code.
EXPECTED = {
    ("RUNNING", "pause (retract)"): ("200", True, "PAUSED", "paused", "pause"),
    ("RUNNING", "pause (in_place)"): ("200", True, "PAUSED", "paused", "pause"),
    ("RUNNING", "continue"): ("200", False, "RUNNING", "running", None),  # no-op
    ("RUNNING", "release [cuda_graph]"): ("200", True, "RELEASED", "released", "release"),
    ("RUNNING", "release [weights]"): ("200", True, "RELEASED", "released", "release"),
    ("RUNNING", "resume [weights]"): ("409 ['weights'] not released", False, "RUNNING", "running", None),
    ("RUNNING", "resume {}"): ("409 nothing is released", False, "RUNNING", "running", None),

    ("PAUSED", "pause (retract)"): ("200", False, "PAUSED", "paused", "pause"),  # same mode: no-op
    ("PAUSED", "pause (in_place)"): (OTHER_MODE, False, "PAUSED", "paused", "pause"),
    ("PAUSED", "continue"): ("200", True, "RUNNING", "running", None),
    ("PAUSED", "release [cuda_graph]"): ("200", True, "RELEASED_IN_PAUSE", "released", "pause"),
    ("PAUSED", "release [weights]"): ("200", True, "RELEASED_IN_PAUSE", "released", "pause"),
    ("PAUSED", "resume [weights]"): ("409 ['weights'] not released", False, "PAUSED", "paused", "pause"),
    ("PAUSED", "resume {}"): ("409 nothing is released", False, "PAUSED", "paused", "pause"),

    ("RELEASED", "pause (retract)"): ("200", True, "PAUSED_WHILE_RELEASED", "released", "pause"),
    ("RELEASED", "pause (in_place)"): ("200", True, "PAUSED_WHILE_RELEASED", "released", "pause"),
    ("RELEASED", "continue"): ("200", False, "RELEASED", "released", "release"),  # requests stay held
    ("RELEASED", "release [cuda_graph]"): ("200", True, "RELEASED", "released", "release"),
    ("RELEASED", "release [weights]"): ("409 ['weights'] already released", False, "RELEASED", "released", "release"),
    ("RELEASED", "resume [weights]"): ("200", True, "RELEASED", "released", "release"),  # kv_cache still released
    ("RELEASED", "resume {}"): ("200", True, "RUNNING", "running", None),  # serves with no continue_generation

    ("RELEASED_IN_PAUSE", "pause (retract)"): ("200", False, "RELEASED_IN_PAUSE", "released", "pause"),
    ("RELEASED_IN_PAUSE", "pause (in_place)"): (OTHER_MODE, False, "RELEASED_IN_PAUSE", "released", "pause"),
    ("RELEASED_IN_PAUSE", "continue"): ("200", False, "RELEASED", "released", "release"),  # the pause ends, held
    ("RELEASED_IN_PAUSE", "release [cuda_graph]"): ("200", True, "RELEASED_IN_PAUSE", "released", "pause"),
    ("RELEASED_IN_PAUSE", "release [weights]"): ("409 ['weights'] already released", False, "RELEASED_IN_PAUSE",
                                                 "released", "pause"),
    ("RELEASED_IN_PAUSE", "resume [weights]"): ("200", True, "RELEASED_IN_PAUSE", "released", "pause"),
    ("RELEASED_IN_PAUSE", "resume {}"): ("200", True, "RESUMED", "resumed", "pause"),

    ("PAUSED_WHILE_RELEASED", "pause (retract)"): ("200", False, "PAUSED_WHILE_RELEASED", "released", "pause"),
    ("PAUSED_WHILE_RELEASED", "pause (in_place)"): (OTHER_MODE, False, "PAUSED_WHILE_RELEASED", "released", "pause"),
    ("PAUSED_WHILE_RELEASED", "continue"): ("200", False, "RELEASED", "released", "release"),
    ("PAUSED_WHILE_RELEASED", "release [cuda_graph]"): ("200", True, "RELEASED_IN_PAUSE", "released", "pause"),
    ("PAUSED_WHILE_RELEASED", "release [weights]"): ("409 ['weights'] already released", False,
                                                     "PAUSED_WHILE_RELEASED", "released", "pause"),
    ("PAUSED_WHILE_RELEASED", "resume [weights]"): ("200", True, "PAUSED_WHILE_RELEASED", "released", "pause"),
    # released before this pause: "resumed" names a pause whose own release was resumed
    ("PAUSED_WHILE_RELEASED", "resume {}"): ("200", True, "PAUSED", "paused", "pause"),

    ("RESUMED", "pause (retract)"): ("200", False, "RESUMED", "resumed", "pause"),
    ("RESUMED", "pause (in_place)"): (OTHER_MODE, False, "RESUMED", "resumed", "pause"),
    ("RESUMED", "continue"): ("200", True, "RUNNING", "running", None),
    ("RESUMED", "release [cuda_graph]"): ("200", True, "RELEASED_IN_PAUSE", "released", "pause"),
    ("RESUMED", "release [weights]"): ("200", True, "RELEASED_IN_PAUSE", "released", "pause"),
    ("RESUMED", "resume [weights]"): ("409 ['weights'] not released", False, "RESUMED", "resumed", "pause"),
    ("RESUMED", "resume {}"): ("409 nothing is released", False, "RESUMED", "resumed", "pause"),
}


def _engine():
    """A tokenizer manager as the pause calls see it, with upstream's calls recorded (pause and continue set its
    gate as upstream's do); `call` runs one through the fork's hook: (answer, upstream calls made)."""
    import asyncio

    from sglang.srt.managers import io_struct

    tm = SimpleNamespace(rid_to_state={}, is_pause=False, is_pause_cond=asyncio.Condition(), upstream=[])

    async def dispatch(obj):
        tm.upstream.append(f"scheduler: {type(obj).__name__}")

    tm._async_dispatch_to_scheduler = dispatch
    objs = {"pause_generation": lambda mode, tags: io_struct.PauseGenerationReqInput(mode=mode),
            "continue_generation": lambda mode, tags: io_struct.ContinueGenerationReqInput(),
            "release_memory_occupation": lambda mode, tags: io_struct.ReleaseMemoryOccupationReqInput(tags=tags),
            "resume_memory_occupation": lambda mode, tags: io_struct.ResumeMemoryOccupationReqInput(tags=tags)}

    async def call(op, mode, tags):
        async def original(tokenizer_manager, obj):
            tm.upstream.append(op)
            if op in ("pause_generation", "continue_generation"):
                tm.is_pause = op == "pause_generation"

        del tm.upstream[:]
        hook = getattr(tokenizer_pause, f"tm_{op}")
        try:
            await hook(original, tm, objs[op](mode, tags))
        except PauseStateError as err:
            assert err.status_code == 409
            return f"409 {err.detail}", list(tm.upstream)
        return "200", list(tm.upstream)

    return tm, call


@pytest.mark.parametrize("pair", sorted(EXPECTED), ids=lambda p: f"{p[0]}-{p[1]}")
def test_every_state_answers_every_call_as_the_docs_say(pair):
    """Every (state, call) pair through the fork's hooks: the answer (200 or the 409's words, the state named),
    whether upstream was called, the state after, its public name, why the pause gate is closed; a 409 changes
    nothing; the resume that serves again after a release without a pause continues the scheduler."""
    import asyncio

    phase, name = pair
    answer, calls_upstream, after, public, gate = EXPECTED[pair]

    async def run():
        tm, call = _engine()
        for step in REACH[phase]:
            assert (await call(*step))[0] == "200", step
        state = engine_pause_state.state_of(tm)
        assert state.phase.name == phase
        before, named = state.as_dict(), state.named()
        got, upstream = await call(*CALLS[name])
        return tm, state, before, named, got, upstream

    tm, state, before, named, got, upstream = asyncio.run(run())
    if answer == "200":
        assert got == "200", got
    else:
        why, _, hint = answer[len("409 "):].partition("; ")
        assert got.startswith(f"409 {CALLS[name][0]} rejected: {why}; {named}"), got
        assert hint in got and state.as_dict() == before, got  # nothing changed
    assert any(c == CALLS[name][0] for c in upstream) is calls_upstream, upstream
    assert (state.phase.name, state.state, state.gate_reason(), state.call) == (after, public, gate, None)
    assert tm.is_pause is (gate is not None)
    assert ("scheduler: ContinueGenerationReqInput" in upstream) is (pair == ("RELEASED", "resume {}"))


def test_every_state_has_a_row_for_every_call_but_a_pause_in_another_mode():
    """The walk above covers each state and each call; the transition table has a row for each pair it answers
    200 and none for a pause in another mode (the only 409 a row's absence gives; the others are the tags')."""
    table = engine_pause_state.TRANSITIONS
    assert {p.name for p in engine_pause_state.Phase} == set(REACH)
    assert {(s, c) for s in REACH for c in CALLS} == set(EXPECTED)
    missing = {(p.name, e.name) for p in engine_pause_state.Phase for e in engine_pause_state.Event
               if (p, e) not in table}
    paused = {"PAUSED", "RELEASED_IN_PAUSE", "PAUSED_WHILE_RELEASED", "RESUMED"}
    assert missing == ({(p, "PAUSE") for p in paused} | {(p, "PAUSE_AGAIN") for p in ("RUNNING", "RELEASED")}
                       | {(p, "RESUME_SOME") for p in ("RUNNING", "PAUSED", "RESUMED")})


def test_a_call_in_progress_refuses_every_other_change():
    """While upstream runs a call (here a pause), every other call that would change something is a 409 naming it
    and changes nothing; continue on a running engine stays upstream's no-op."""
    import asyncio

    from sglang.srt.managers.io_struct import PauseGenerationReqInput

    async def run():
        tm, call = _engine()
        held = asyncio.get_running_loop().create_future()

        async def slow_pause(tokenizer_manager, obj):
            tokenizer_manager.is_pause = True
            await held

        pausing = asyncio.ensure_future(tokenizer_pause.tm_pause_generation(
            slow_pause, tm, PauseGenerationReqInput(mode="retract")))
        for _ in range(5):
            await asyncio.sleep(0)
        state = engine_pause_state.state_of(tm)
        assert (state.busy, state.gate_reason()) == ("pause_generation", "pause")
        answers = {name: (await call(*args))[0] for name, args in CALLS.items()}
        held.set_result(None)
        await pausing
        return state, answers

    state, answers = asyncio.run(run())
    busy = "409 {op} rejected: pause_generation is in progress (engine state: running)"
    assert answers == {name: "200" if name == "continue" else busy.format(op=CALLS[name][0]) for name in CALLS}
    assert (state.state, state.mode, state.call) == ("paused", "retract", None)


# ----------------------------------------------------------------------------- release after a finished rollout

def _req_state(rid: str, finished: bool = False):
    import asyncio

    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import ReqState
    from sglang.srt.observability.req_time_stats import APIServerReqTimeStats

    return ReqState([], finished, asyncio.Event(), GenerateReqInput(rid=rid, text="x"), APIServerReqTimeStats())


def _release(rid_to_state, finish_later=()):
    """Run the fork's release_memory_occupation hook (no pause) over `rid_to_state`; the rids in `finish_later`
    end 50 ms into the call, as a client answer the detokenizer delivers after a flush was answered."""
    import asyncio

    from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

    async def run():
        tm = SimpleNamespace(rid_to_state=rid_to_state, is_pause=False, is_pause_cond=asyncio.Condition())
        calls = []

        async def original(tokenizer_manager, obj):
            calls.append(obj)

        async def finish():
            await asyncio.sleep(0.05)
            for rid in finish_later:
                del rid_to_state[rid]

        task = asyncio.create_task(finish())
        try:
            await tokenizer_pause.tm_release_memory_occupation(original, tm, ReleaseMemoryOccupationReqInput())
        finally:
            await task
        return tm, calls

    return asyncio.run(run())


def test_release_after_a_finished_rollout_is_not_blocked_by_probes_or_answered_requests():
    """A health probe (/health, /health_generate), an answered request and one whose last output arrives just
    after the call never make a release without a pause a 409 (the RL trainer's flush -> release)."""
    states = {"HEALTH_CHECK_0f": _req_state("HEALTH_CHECK_0f"), "done": _req_state("done", finished=True),
              "late": _req_state("late")}
    tm, calls = _release(states, finish_later=("late",))
    assert len(calls) == 1
    assert engine_pause_state.state_of(tm).state == "released"


def test_release_without_pause_names_the_client_requests_still_running():
    states = {"HEALTH_CHECK_1": _req_state("HEALTH_CHECK_1"), "rollout-7": _req_state("rollout-7")}
    with pytest.raises(PauseStateError) as err:
        _release(states)
    message = str(err.value)
    assert "1 request(s) in flight (rollout-7)" in message and "call pause_generation first" in message
    assert "HEALTH_CHECK" not in message


def test_scheduler_pause_moves_only_by_its_named_transitions():
    """SchedulerPause (docs/layout.md, "The scheduler pause's states"): the first mode is kept unless a retract
    follows, a release keeps the pause's mode and a resume goes back to it, continue ends it; the pump window is
    never open while released; a pump inside a drain leaves the drain's work as it found it."""
    S, Work = scheduler_pause.PauseState, scheduler_pause.Work
    sp = scheduler_pause.SchedulerPause(SimpleNamespace(disaggregation_mode="null"))
    assert (sp.state, sp.mode, sp.work) == (S.SERVING, None, Work.IDLE)
    sp.pause("in_place")
    sp.pause("abort")
    assert (sp.state, sp.mode) == (S.PAUSED, "in_place")
    sp.pause("retract")
    sp.release()
    assert (sp.state, sp.mode, sp.released) == (S.RELEASED, "retract", True)
    sp.resume()
    assert (sp.state, sp.mode) == (S.PAUSED, "retract")
    sp.continue_()
    assert (sp.state, sp.mode) == (S.SERVING, None)
    sp.release()  # without a pause
    sp.continue_()
    assert sp.state is S.RELEASED
    sp.open_pump_window()
    assert not sp.in_pump_window()
    sp.resume()
    assert sp.state is S.SERVING and sp.in_pump_window()
    sp.close_pump_window()
    assert not sp.in_pump_window()
    sp.work = Work.DRAINING
    sp.pump()  # no PD queues here: nothing to pump, the drain's work kept
    assert sp.work is Work.DRAINING


BAD_TAGS = [["kv"], ["weight"], ["kv_cache", "bogus"], ["KV_CACHE"], "kv_cache"]


@pytest.mark.parametrize("phase", sorted(REACH))
@pytest.mark.parametrize("op", ["release_memory_occupation", "resume_memory_occupation"])
@pytest.mark.parametrize("tags", BAD_TAGS, ids=repr)
def test_an_unknown_memory_tag_is_a_400_naming_the_valid_tags_in_every_state_and_changes_nothing(phase, op, tags):
    """Before: a release of ["kv"] (a typo for kv_cache) while serving was taken: the state recorded 'kv' released
    and the pause gate stayed closed; no resume could open it (upstream ignores unknown tags: serving goes on).
    Now: 400 naming the field and upstream's tags (sglang.srt.constants GPU_MEMORY_ALL_TYPES), before any other
    check (not a 409 even where the call is out of order), upstream not called, state and gate unchanged."""
    import asyncio

    from sglang.srt.constants import GPU_MEMORY_ALL_TYPES

    assert list(ALL_TAGS) == GPU_MEMORY_ALL_TYPES == ["kv_cache", "weights", "cuda_graph"]

    async def run():
        tm, call = _engine()
        for step in REACH[phase]:
            assert (await call(*step))[0] == "200", step
        state = engine_pause_state.state_of(tm)
        before, gate = (state.as_dict(), state.phase, state.gate_reason()), tm.is_pause
        del tm.upstream[:]
        with pytest.raises(engine_pause_state.MemoryTagsError) as err:
            await getattr(tokenizer_pause, f"tm_{op}")(lambda *a: pytest.fail("upstream called"), tm,
                                                       SimpleNamespace(tags=tags))
        assert (state.as_dict(), state.phase, state.gate_reason()) == before and tm.is_pause is gate
        assert tm.upstream == []
        return err.value

    err = asyncio.run(run())
    assert err.status_code == 400
    assert str(err).startswith(f"{op} rejected: ") and "field 'tags'" in str(err), str(err)
    assert "valid tags: ['kv_cache', 'weights', 'cuda_graph']" in str(err) and "nothing changed" in str(err)


def test_tags_none_empty_and_duplicates_keep_upstreams_meaning():
    """null and [] are all of upstream's tags (its `if tags is None or len(tags) == 0`); duplicates are one tag
    (upstream's release keeps a set; its resume would raise KeyError on the second removal)."""
    import asyncio

    assert engine_pause_state.memory_tags("release_memory_occupation", None) is None
    assert engine_pause_state.memory_tags("release_memory_occupation", []) == []
    assert engine_pause_state.memory_tags("resume_memory_occupation", ["weights", "weights", "kv_cache"]) == \
        ["weights", "kv_cache"]

    async def run():
        tm, call = _engine()
        state = engine_pause_state.state_of(tm)
        assert (await call("release_memory_occupation", None, ["kv_cache", "kv_cache"]))[0] == "200"
        assert state.released == ["kv_cache"]
        assert (await call("resume_memory_occupation", None, ["kv_cache", "kv_cache"]))[0] == "200"
        assert state.serving() and not tm.is_pause
        assert (await call("release_memory_occupation", None, []))[0] == "200"
        assert state.released == list(ALL_TAGS)
        assert (await call("resume_memory_occupation", None, []))[0] == "200"
        assert state.serving() and not tm.is_pause

    asyncio.run(run())
