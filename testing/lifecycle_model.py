"""A model of a PD request's life over the real upstream queues with the fork's hooks: a stateful property test.

Both servers live in one process: a `PrefillHarness` and a `DecodeHarness` (testing/queue_harness.py: upstream's
real `PrefillBootstrapQueue`, `DecodePreallocQueue`, `DecodeTransferQueue` over real CPU pools, with the fork's hooks
loaded), each with its own runtime context. The model plays the wire between them (`Wire`): it decides when decode's
handshake reaches prefill, when prefill's Success or failure reaches decode, when decode's abort reaches prefill.
Every event a deployment meets that the harnesses can drive is a rule, on either server, in any order
(`LifecycleMachine`): a copy of a request arrives (either first, the other late), a scheduler pass on either side,
a wire delivery, a KV transfer progresses or fails (a chunk fails, a transfer worker concludes Failed), a client
abort on either side at any stage, `abort_all`, pause (in_place / abort), continue, release / resume of the queue's
memory, the engine clock moving (past the transfer deadline), a decode finishing.

The model is the contract: each copy (prefill's, decode's) of each request has the set of answers allowed given
the events it saw (`Copy.allowed`, docs/aborts.md and the verdict table: a completion where upstream would complete
it, the abort answer only after an abort or a pause/release reached it or its peer told it so, 500 only after a
transfer failure, 504 only once the engine clock passed the transfer deadline). After every step (`check_step`):
no copy answered twice, no answer outside its allowed set. At quiescence (`settle`, the machine's teardown: both
servers continued and resumed, every late copy arrived, every wire message delivered, every held transfer let go):
first with the engine clock standing still, every request that met no fault completes on both servers; then with
the clock past every deadline, every copy is answered and both resource reports (`fork_pd_resources`, read only
through `pd_resource_report.build_report`) hold nothing: queues, KV, slots, per-room tables.

Time is the fork's `engine_clock` on a scripted monotonic source the model advances (`ScriptedTime`).

What this tier does not drive: the transfer backend's own threads (the fake backend is scripted per room; thread
interleavings such as the bootstrap thread's abort racing sender creation need the mooncake pair), the tokenizer
(its pause gate, release tags), peer liveness (a peer lost / silent / back), scale in/out, weight updates, health
probes, more than one rank.

    pytest test/srt/model/test_lifecycle_model.py     # the deterministic tier (fixed seed profile)
    MODEL_PROFILE=long pytest ...                      # the long run (make test-model), prints steps/s
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from typing import Dict, List, Optional, Set

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.fork_ending import verdict_wording
from sglang.srt.disaggregation.fork_ending.engine_clock import engine_clock
from sglang.srt.disaggregation.fork_transfer import transfer_deadline as td
from sglang.srt.managers.fork_pause.scheduler_pause import pause_of
from sglang.srt.managers.fork_report import pd_resource_report
from sglang.srt.managers.io_struct import AbortReq, ContinueGenerationReqInput, PauseGenerationReqInput
from testing.queue_harness import DecodeHarness, PrefillHarness

DEADLINE = 5.0  # disaggregation_transfer_timeout of both harnesses
MAX_REQUESTS = 6  # per example (the harness pools: 8 slots, 256 KV tokens)
PROMPT = 10
SIDES = ("prefill", "decode")
ABORT = "abort"  # an answer: upstream's abort answer (200, finish_reason abort, no status)
ANSWERS = (200, ABORT, 500, 502, 503, 504)
# Bugs the model found that are still open: the contract is relaxed for exactly the orderings that reach each, so
# the deterministic tier keeps guarding everything else; each has a strict-xfail regression test
# (test/srt/model/test_lifecycle_regressions.py). Remove a name once its fix merges (its regression test XPASSes).
KNOWN_BUGS: set = set()


class ScriptedTime:
    """The engine clock's monotonic source, moved only by the model."""

    def __init__(self) -> None:
        self.t = 50_000.0

    def __call__(self) -> float:
        return self.t


@dataclasses.dataclass
class Copy:
    """One server's copy of a request, as the model sees it: when it arrived (engine clock), the events that
    widen what it may be answered, and what it was answered."""

    side: str
    arrived_at: Optional[float] = None
    causes: Set[int] = dataclasses.field(default_factory=set)  # answers (besides completion) its events allow
    completion_allowed: bool = True
    answer: Optional[object] = None

    @property
    def arrived(self) -> bool:
        return self.arrived_at is not None

    def allowed(self) -> Set[object]:
        out = set(self.causes)
        if self.completion_allowed:
            out.add(200)
        if self.arrived and engine_clock.now() - self.arrived_at >= DEADLINE:
            out.add(504)
        return out


@dataclasses.dataclass
class Request:
    rid: str
    room: int
    prefill: Copy = dataclasses.field(default_factory=lambda: Copy("prefill"))
    decode: Copy = dataclasses.field(default_factory=lambda: Copy("decode"))
    faulted: bool = False  # met an event that may end it without a completion (abort, failure, pause abort, ...)
    handshake_delivered: bool = False
    success_delivered: bool = False
    released_before_arrival: bool = False  # a release on the side of its late copy came between them
    prefill_req: object = None
    decode_req: object = None

    def copy(self, side: str) -> Copy:
        return self.prefill if side == "prefill" else self.decode


_rids = itertools.count(1)


def pick(items: list, i: int):
    """The i-th of `items`, cyclically (Hypothesis draws i; it shrinks towards the first)."""
    return items[i % len(items)]


def answer_of(h, rid: str) -> Optional[object]:
    """The copy's answer as its client saw it: 200, ABORT (upstream's abort answer) or the error status."""
    final = h.outputs.final(rid)
    if final is None:
        return None
    code = h.outputs.status_code(rid)
    if code is None:
        return ABORT
    return code


def report(h) -> dict:
    """The side's `fork_pd_resources` (the model reads state only through it)."""
    with h.active():
        return pd_resource_report.build_report(h.scheduler)


def held(rep: dict) -> Dict[str, object]:
    """What a report says is still held (empty: idle)."""
    out: Dict[str, object] = {}
    if rep["kv_tokens"]["held"]:
        out["kv_held"] = rep["kv_tokens"]["held"]
    for name in ("req_slots", "metadata_slots"):
        if rep[name] and rep[name]["free"] != rep[name]["total"]:
            out[name] = rep[name]
    out.update({f"queue.{k}": v for k, v in rep["queues"].items() if v})
    out.update({f"room_table.{k}": v for k, v in (rep["transfer_rooms"] or {}).items() if v})
    return out


class Sides:
    """The two harnesses, built once per process and rebuilt when an example left them dirty."""

    _current: Optional["Sides"] = None

    def __init__(self) -> None:
        args = {"disaggregation_transfer_timeout": DEADLINE}
        self.prefill = PrefillHarness(server_args=args)
        self.decode = DecodeHarness(server_args=args)
        for h in (self.prefill, self.decode):
            h.faults.paired = True
        self.dirty = False

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()

    @classmethod
    def get(cls) -> "Sides":
        if cls._current is not None and cls._current.dirty:
            cls._current.close()
            cls._current = None
        if cls._current is None:
            cls._current = Sides()
        cls._current.dirty = True  # until an example ends clean
        return cls._current


class LifecycleMachine(RuleBasedStateMachine):
    """The rules, the invariants and the quiescence check (module docstring)."""

    total_steps = 0  # over every example of the process (steps/s of the long run)
    seen: Counter = Counter()  # orderings of interest reached, over every example (the long run prints them)

    def __init__(self) -> None:
        super().__init__()
        self.sides = Sides.get()
        self.h = {"prefill": self.sides.prefill, "decode": self.sides.decode}
        self.reqs: List[Request] = []
        self.time = ScriptedTime()
        self._saved_monotonic = engine_clock._monotonic
        assert not engine_clock.paused
        engine_clock._monotonic = self.time
        td.reset_scan_schedule()
        self.paused: Dict[str, Optional[str]] = {"prefill": None, "decode": None}
        self.released: Dict[str, bool] = {"prefill": False, "decode": False}
        self.delivered_notices = {"prefill": 0, "decode": 0}  # per harness: its notices the wire has handled
        self.pending: Dict[str, Dict[int, str]] = {"prefill": {}, "decode": {}}  # room -> reason, copy not there yet
        self.steps = 0
        for side in SIDES:
            self.delivered_notices[side] = len(self.h[side].faults.notices)
            leftover = held(report(self.h[side]))
            assert not leftover, f"{side} not idle at the start: {leftover}"

    # ------------------------------------------------------------------ helpers

    def _arrive(self, r: Request, side: str) -> None:
        h = self.h[side]
        copy = r.copy(side)
        copy.arrived_at = engine_clock.now()
        faults = h.faults
        faults.hold_transfer(r.room)  # prefill: the KV is on the wire until kv_progress; decode: until prefill's Success
        if side == "prefill":
            tokens = range(100 * (r.room % 1000) + 1, 100 * (r.room % 1000) + 1 + PROMPT)  # no shared prefix
            req = h.make_req(rid=r.rid, room=r.room, tokens=tokens)
            r.prefill_req = req
        else:
            req = h.make_req(rid=r.rid, room=r.room, prompt_len=PROMPT)
            r.decode_req = req
        if self.released[side] or self.paused[side] == "abort":
            # what the tokenizer would do with it is not modelled here: it waits at the gate (arrives later)
            copy.arrived_at = None
            return
        h.add(req)
        if r.room in self.pending[side]:
            self._tell(side, r.room, self.pending[side].pop(r.room))

    def _unanswered(self, side: str) -> List[Request]:
        return [r for r in self.reqs if r.copy(side).arrived and r.copy(side).answer is None]

    def _allow(self, r: Request, side: str, *answers) -> None:
        copy = r.copy(side)
        copy.causes.update(answers)
        r.faulted = True

    def _tell(self, side: str, room: int, reason: str) -> None:
        """A failure status for `room` reaches `side`'s manager: Failed with the peer's reason (upstream's status
        message / `_handle_abort_notification` on a real backend). The fake backend has none of the fork's
        handling of a room that is not live, so the wire does what the real one does: a room not created yet keeps
        the message until it is, one already ended drops it."""
        r = self._by_room(room)
        mgr = self.h[side].kv_manager
        if room in mgr.request_status:  # its endpoint is live
            mgr.record_failure(room, reason)
            mgr.update_status(room, KVPoll.Failed)
        elif r is not None and room not in self.h[side].faults.endpoints:
            self.pending[side][room] = reason

    def _by_room(self, room: int) -> Optional[Request]:
        return next((r for r in self.reqs if r.room == room), None)

    def _observe(self) -> None:
        """Read every copy's answer from its client (after each step)."""
        for r in self.reqs:
            for side in SIDES:
                copy = r.copy(side)
                if copy.answer is None:
                    copy.answer = answer_of(self.h[side], r.rid)

    # ------------------------------------------------------------------ rules: requests

    def _new_request(self, arrives) -> None:
        rid = f"m{next(_rids):07d}"  # fixed width: no rid is a prefix of another (upstream aborts by prefix)
        r = Request(rid, next(self.h["prefill"]._rooms))
        self.reqs.append(r)
        for side in arrives:
            self._arrive(r, side)

    # one rule per arrival order (Hypothesis picks rules uniformly: three of them make requests common)
    @precondition(lambda self: len(self.reqs) < MAX_REQUESTS)
    @rule()
    def new_request_both(self) -> None:
        self._new_request(SIDES)

    @precondition(lambda self: len(self.reqs) < MAX_REQUESTS)
    @rule()
    def new_request_prefill_first(self) -> None:
        self._new_request(("prefill",))

    @precondition(lambda self: len(self.reqs) < MAX_REQUESTS)
    @rule()
    def new_request_decode_first(self) -> None:
        self._new_request(("decode",))

    @precondition(lambda self: any(not (r.prefill.arrived and r.decode.arrived) for r in self.reqs))
    @rule(i=st.integers(0, MAX_REQUESTS - 1))
    def late_copy(self, i: int) -> None:
        late = [r for r in self.reqs if not (r.prefill.arrived and r.decode.arrived)]
        r = late[i % len(late)]
        for side in SIDES:
            if not r.copy(side).arrived:
                self._arrive(r, side)
                return

    # ------------------------------------------------------------------ rules: scheduler passes

    @rule(side=st.sampled_from(SIDES))
    def scheduler_pass(self, side: str) -> None:
        if self.paused[side] is not None or self.released[side]:
            return  # a paused loop runs no queue pass (its abort hook pumps)
        self.h[side].tick()

    @precondition(lambda self: bool(self.h["decode"].waiting))
    @rule()
    def decode_finishes(self) -> None:
        d = self.h["decode"]
        d.finish(d.waiting[0])

    # ------------------------------------------------------------------ rules: the wire
    # Each picks among the requests it applies to (the `eligible_*` lists), so that no step is wasted.

    def eligible_handshakes(self) -> List[Request]:
        """Decode sent its metadata (its handshake is on the wire) and prefill has not got it."""
        d = self.h["decode"].faults
        return [r for r in self.reqs if not r.handshake_delivered and d.calls_for(r.room, "send_metadata")]

    def eligible_held_kv(self) -> List[Request]:
        return [r for r in self.reqs if r.room in self.h["prefill"].faults._held]

    def eligible_successes(self) -> List[Request]:
        p = self.h["prefill"].faults
        return [r for r in self.reqs if not r.success_delivered and p.state(r.room) == KVPoll.Success]

    def eligible_live_transfers(self) -> List[Request]:
        p = self.h["prefill"]
        return [r for r in self.reqs if r.room in p.kv_manager.request_status and r.prefill.answer is None
                and p.faults.state(r.room) != KVPoll.Success]

    def eligible_unanswered(self, side: str) -> List[Request]:
        return self._unanswered(side)

    @precondition(lambda self: bool(self.eligible_handshakes()))
    @rule(i=st.integers(0, MAX_REQUESTS - 1))
    def deliver_handshake(self, i: int) -> None:
        """Decode's handshake (its metadata: destination pages) reaches prefill's bootstrap thread."""
        self._deliver_handshake(pick(self.eligible_handshakes(), i))

    def _deliver_handshake(self, r: Request) -> None:
        r.handshake_delivered = True
        if r.prefill.answer is not None:
            # prefill already ended the room: the late handshake is answered Failed (room_ledger, real backend)
            self._tell("decode", r.room, verdict_wording.ABORT_TAG + " on prefill before decode's handshake came")
            self._allow(r, "decode", ABORT, 500, 504)
            return
        self.h["prefill"].kv_manager.transfer_infos[r.room] = "decode handshake"

    @precondition(lambda self: bool(self.eligible_held_kv()))
    @rule(i=st.integers(0, MAX_REQUESTS - 1))
    def kv_progress(self, i: int) -> None:
        """Prefill's KV for the room leaves the wire: its sender may conclude Success."""
        self.h["prefill"].faults._held.discard(pick(self.eligible_held_kv(), i).room)

    @precondition(lambda self: bool(self.eligible_successes()))
    @rule(i=st.integers(0, MAX_REQUESTS - 1))
    def deliver_success(self, i: int) -> None:
        """Prefill's Success for the room reaches decode (its KV landed)."""
        self._deliver_success(pick(self.eligible_successes(), i))

    def _deliver_success(self, r: Request) -> None:
        r.success_delivered = True
        self.h["decode"].faults._held.discard(r.room)

    @precondition(lambda self: any(len(self.h[side].faults.notices) > self.delivered_notices[side] for side in SIDES))
    @rule()
    def deliver_notices(self) -> None:
        """Every status message each side put on the wire reaches the other (a room not there yet: kept)."""
        p, d = self.h["prefill"], self.h["decode"]
        for n in p.faults.notices[self.delivered_notices["prefill"]:]:
            r = self._by_room(n.room)
            if r is not None:
                self._tell("decode", n.room, n.reason or "prefill failed the room")
                self._allow(r, "decode", ABORT, 500, 504)
                r.decode.completion_allowed = r.decode.completion_allowed and r.success_delivered
        self.delivered_notices["prefill"] = len(p.faults.notices)
        for n in d.faults.notices[self.delivered_notices["decode"]:]:
            r = self._by_room(n.room)
            if r is None:
                continue
            self._allow(r, "prefill", ABORT)
            self._tell("prefill", n.room, verdict_wording.DECODE_ABORT_REASON.format(room=n.room))
        self.delivered_notices["decode"] = len(d.faults.notices)

    # ------------------------------------------------------------------ rules: faults

    @precondition(lambda self: bool(self.eligible_unanswered("prefill")))
    @rule(i=st.integers(0, MAX_REQUESTS - 1), kind=st.sampled_from(("kv", "last", "state")))
    def chunk_fails(self, i: int, kind: str) -> None:
        """The room's next chunk of that kind fails in the transfer worker (decode told)."""
        r = pick(self.eligible_unanswered("prefill"), i)
        self.h["prefill"].faults.fail_chunk(r.room, kind,
                                            reason=verdict_wording.UPSTREAM_CHUNK_FAILED["kv"] + " (model)")
        self._allow(r, "prefill", 500)
        self._allow(r, "decode", 500)

    @precondition(lambda self: bool(self.eligible_live_transfers()))
    @rule(i=st.integers(0, MAX_REQUESTS - 1))
    def transfer_worker_fails(self, i: int) -> None:
        """A transfer worker concludes the room Failed mid-transfer (the write failed; decode told)."""
        r = pick(self.eligible_live_transfers(), i)
        self.h["prefill"].kv_manager.conclude_failure(
            bootstrap_room=r.room, failure_reason=verdict_wording.UPSTREAM_SESSION_DEAD + " (model)")
        self._allow(r, "prefill", 500)
        self._allow(r, "decode", 500)

    @precondition(lambda self: bool(self.reqs))
    @rule(side=st.sampled_from(SIDES), i=st.integers(0, MAX_REQUESTS - 1))
    def client_abort(self, side: str, i: int) -> None:
        """A client abort by rid on one server (any stage; also of a copy already answered or not there yet)."""
        r = pick(self.reqs, i)
        if r.copy(side).arrived and r.copy(side).answer is None:
            self._allow(r, side, ABORT)
            r.copy(side).completion_allowed = False  # never a completion once an abort is pending on it
        self.h[side].abort(r.rid)

    @rule(side=st.sampled_from(SIDES))
    def abort_all(self, side: str) -> None:
        for r in self._unanswered(side):
            self._allow(r, side, ABORT)
            r.copy(side).completion_allowed = False
        h = self.h[side]
        with h.active():
            h.scheduler.abort_request(AbortReq(abort_all=True))

    @rule(seconds=st.sampled_from((0.5, 1.0, 2.0, DEADLINE + 1.0)))  # mostly short: a deadline now and then
    def clock_advances(self, seconds: float) -> None:
        self.time.t += seconds
        td.reset_scan_schedule()

    # ------------------------------------------------------------------ rules: pause / release

    @rule(side=st.sampled_from(SIDES), mode=st.sampled_from(("in_place", "abort")))
    def pause(self, side: str, mode: str) -> None:
        if self.paused[side] is not None:
            return
        if mode == "abort":
            for r in self._unanswered(side):
                self._allow(r, side, ABORT)
        self.paused[side] = mode
        h = self.h[side]
        with h.active():
            h.scheduler.pause_generation(PauseGenerationReqInput(mode=mode))

    @rule(side=st.sampled_from(SIDES))
    def continue_generation(self, side: str) -> None:
        if self.paused[side] is None:
            return
        self.paused[side] = None
        h = self.h[side]
        with h.active():
            h.scheduler.continue_generation(ContinueGenerationReqInput())

    @rule(side=st.sampled_from(SIDES))
    def release(self, side: str) -> None:
        """Release the queue's memory in a pause (the RL step: an in_place pause first if the side is not paused):
        what is in flight ends first."""
        if self.released[side]:
            return
        if self.paused[side] is None:
            self.pause(side, "in_place")
        for r in self._unanswered(side):
            self._allow(r, side, ABORT)
        h = self.h[side]
        for r in self.reqs:
            if r.handshake_delivered and not r.copy(side).arrived:
                LifecycleMachine.seen[f"release {side}: a handshake there before its request"] += 1
                r.released_before_arrival = True
        self.released[side] = True
        with h.active():
            pause_of(h.scheduler).end_in_flight()
            h.queue.release_memory_occupation()

    @rule(side=st.sampled_from(SIDES))
    def resume(self, side: str) -> None:
        if not self.released[side]:
            return
        self.released[side] = False
        h = self.h[side]
        with h.active():
            h.queue.resume_memory_occupation()

    @rule(side=st.sampled_from(SIDES))
    def rl_step(self, side: str) -> None:
        """A trainer's whole step on one server: pause (in_place), release, resume, continue."""
        self.release(side)
        self.resume(side)
        self.continue_generation(side)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def check_step(self) -> None:
        self.steps += 1
        LifecycleMachine.total_steps += 1
        self._observe()
        for r in self.reqs:
            for side in SIDES:
                copy = r.copy(side)
                finals = [s for s in self.h[side].outputs.of(r.rid) if s.finished]
                assert len(finals) <= 1, f"{side} answered {r.rid} twice: {finals}"
                if copy.answer is not None:
                    assert copy.arrived or copy.answer is None, f"{side} answered {r.rid} before it arrived"
                    assert copy.answer in copy.allowed(), (
                        f"{side} answered {r.rid} (room {r.room}) {copy.answer!r}, allowed {sorted(map(str, copy.allowed()))}: "
                        f"{self.h[side].outputs.final(r.rid)}")
                if side == "decode" and copy.answer == 200:
                    assert r.success_delivered, f"decode completed {r.rid} without prefill's KV"

    # ------------------------------------------------------------------ quiescence

    def _drain(self, rounds: int = 12) -> None:
        """Every wire message delivered, every hold let go, both sides passing, until nothing moves."""
        for _ in range(rounds):
            for r in self.eligible_handshakes():
                self._deliver_handshake(r)
            self.h["prefill"].faults._held.clear()
            for side in SIDES:
                self.h[side].tick()
            for r in self.eligible_successes():
                self._deliver_success(r)
            self.deliver_notices()
            d = self.h["decode"]
            while d.waiting:
                d.finish(d.waiting[0])
            self.check_step()

    def settle(self) -> None:
        for side in SIDES:
            self.resume(side)
            self.continue_generation(side)
        for r in self.reqs:
            for side in SIDES:
                if not r.copy(side).arrived:
                    self._arrive(r, side)
        self._drain()
        # the engine clock standing still: whatever met no fault is answered on both servers (a completion, or a
        # 504 where its deadline already passed), and completes unless it may be answered 504
        for r in self.reqs:
            if r.faulted:
                continue
            answers = (r.prefill.answer, r.decode.answer)
            late = 504 in r.prefill.allowed() or 504 in r.decode.allowed()
            assert None not in answers and (late or answers == (200, 200)), (
                f"{r.rid} (room {r.room}) met no fault, yet with the clock standing still it is answered "
                f"prefill={r.prefill.answer!r} decode={r.decode.answer!r}")
        # the engine clock past every deadline: everything answered, nothing held
        for _ in range(2):
            self.clock_advances(DEADLINE + 1.0)
            self._drain(rounds=4)
        for r in self.reqs:
            for side in SIDES:
                assert r.copy(side).answer is not None, f"{side} never answered {r.rid} (room {r.room})"
        for side in SIDES:
            leftover = held(report(self.h[side]))
            assert not leftover, f"{side} holds something at quiescence: {leftover}"

    def teardown(self) -> None:
        try:
            self.settle()
            self.sides.dirty = False
        finally:
            engine_clock.resume()
            engine_clock._monotonic = self._saved_monotonic
            td.reset_scan_schedule()
