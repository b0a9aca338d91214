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

Recovery (docs/recovery.md) is a transition of the model: the model plays decode's tokenizer on its output path
(`Client`): every output decode's scheduler streams for a client request goes through the real
`recovery.holds_back` (the knobs drawn per example: `SGLANG_FORK_RECOVERY_ATTEMPTS` 0..2, the budget ample or spent
after the first failure); an end it holds back starts an attempt, which the model carries as `recovery._rerun` does:
the same client request under a new room, its prefill leg's rid `recovery_attempt.attempt_rid`, both copies arriving
later in either order. Each attempt is a `Request` of its own (its copies judged as any request's); the client
request's contract (`_check_client`): answered at most once (exactly once at quiescence), by its last attempt; a
completion only if that attempt completed; the tokens of one attempt only; at most the knob's attempts, each after a
held-back end of a failed transfer with no token; `meta_info` says how many; never a completion after an abort
reached it; and a chunk failure it answers only once attempts or budget ran out.

The model is the contract: each copy (prefill's, decode's) of each request has the set of answers allowed given
the events it saw (`Copy.allowed`, docs/aborts.md and the verdict table: a completion where upstream would complete
it, the abort answer only after an abort or a pause/release reached it or its peer told it so, 500 only after a
transfer failure, 504 only once the engine clock passed the transfer deadline). After every step (`check_step`):
no copy answered twice, no answer outside its allowed set. At quiescence (`settle`, the machine's teardown: both
servers continued and resumed, every late copy arrived, every wire message delivered, every held transfer let go):
first with the engine clock standing still, every request that met no fault completes on both servers; then with
the clock past every deadline, every copy and every client request is answered and both resource reports (`fork_pd_resources`, read only
through `pd_resource_report.build_report`) hold nothing: queues, KV, slots, per-room tables.

Time is the fork's `engine_clock` on a scripted monotonic source the model advances (`ScriptedTime`).

What this tier does not drive: the transfer backend's own threads (the fake backend is scripted per room; thread
interleavings such as the bootstrap thread's abort racing sender creation need the mooncake pair: the pair model,
testing/pair_model.py, drives arrivals, passes, failed writes and aborts over it), the tokenizer
(its pause gate, release tags; of its output path only recovery's decision), peer liveness (a peer lost / silent / back), scale in/out, weight updates, health
probes, more than one rank.

    pytest test/srt/model/test_lifecycle_model.py     # the deterministic tier (fixed seed profile)
    MODEL_PROFILE=long pytest ...                      # the long run (make test-model), prints steps/s
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
from collections import Counter
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Set, Tuple

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.fork_ending import recovery_attempt, recovery_rule, request_record, verdict_wording
from sglang.srt.disaggregation.fork_ending.engine_clock import engine_clock
from sglang.srt.disaggregation.fork_recovery import recovery
from sglang.srt.disaggregation.fork_transfer import transfer_deadline as td
from sglang.srt.managers.fork_core import knobs
from sglang.srt.managers.fork_pause.scheduler_pause import pause_of
from sglang.srt.managers.fork_report import pd_resource_report
from sglang.srt.managers.io_struct import (
    AbortReq,
    ContinueGenerationReqInput,
    GenerateReqInput,
    PauseGenerationReqInput,
)
from sglang.srt.managers.tokenizer_manager import ReqState
from testing.harness_client import Streamed
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
KNOWN_BUGS: set = set()  # orderings whose wrong answer the model tolerates (each with a strict-xfail regression)
RECOVERY_ATTEMPTS = (0, 1, 2)  # SGLANG_FORK_RECOVERY_ATTEMPTS, drawn per example
# SGLANG_FORK_RECOVERY_BUDGET: ample (never spent in a run of the model), or spent by a request's second failure
BUDGETS = {"ample": "600", "spent": "1e-9"}


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
    at_gate: bool = False  # decode: at its tokenizer, waiting at the pause gate (released, or paused in abort mode)
    # prefill's copy of a leg recovery has an attempt left after (recovery_rule.prefill_hands_over): its own deadline
    # (prefill_inflight) is answered as handed over (the verdict's DEADLINE_HANDED_TO_RECOVERY: an abort without
    # status) instead of 504 (the model does not track the stage: allowed after any deadline of such a copy)
    handed_at_deadline: bool = False

    @property
    def arrived(self) -> bool:
        return self.arrived_at is not None

    def allowed(self) -> Set[object]:
        out = set(self.causes)
        if self.completion_allowed:
            out.add(200)
        if self.arrived and engine_clock.now() - self.arrived_at >= DEADLINE:
            out.add(504)
            if self.handed_at_deadline:
                out.add(ABORT)
        return out


@dataclasses.dataclass
class Request:
    """One attempt of a client request: a room of its own, a copy on each server. `rid` is decode's (the client's,
    kept by every attempt); `prefill_rid` is its prefill leg's (a recovery attempt's: `attempt_rid`)."""

    rid: str
    room: int
    prefill_rid: str = ""
    attempt: int = 0  # 0: the client's request as sent; n: recovery attempt n
    client: Optional["Client"] = None
    prefill: Copy = dataclasses.field(default_factory=lambda: Copy("prefill"))
    decode: Copy = dataclasses.field(default_factory=lambda: Copy("decode"))
    faulted: bool = False  # met an event that may end it without a completion (abort, failure, pause abort, ...)
    handshake_delivered: bool = False
    success_delivered: bool = False
    released_before_arrival: bool = False  # a release on the side of its late copy came between them
    prefill_req: object = None
    decode_req: object = None

    def __post_init__(self) -> None:
        self.prefill_rid = self.prefill_rid or self.rid

    def copy(self, side: str) -> Copy:
        return self.prefill if side == "prefill" else self.decode

    def side_rid(self, side: str) -> str:
        return self.prefill_rid if side == "prefill" else self.rid


@dataclasses.dataclass
class Client:
    """A client request as decode's tokenizer holds it: upstream's `ReqState` (recovery's record lives on it), its
    attempts (`legs`), the outputs of decode's scheduler it read (per room), what it passed to the client (with the
    attempt and the `meta_info` recovery annotated) and what recovery held back."""

    rid: str
    state: Any
    legs: List[Request] = dataclasses.field(default_factory=list)
    read: Dict[int, int] = dataclasses.field(default_factory=dict)  # room -> decode outputs of it read
    delivered: List[Tuple[int, Streamed, dict]] = dataclasses.field(default_factory=list)
    held: List[Tuple[int, Streamed]] = dataclasses.field(default_factory=list)
    aborted: bool = False  # a client abort / abort_all on decode reached a live attempt before its answer
    aborted_between: bool = False  # an abort, a pause (abort) or a release on decode while an attempt was starting
    aborted_at_gate: bool = False  # an abort reached decode's tokenizer while the request waited at its pause gate

    @property
    def final(self) -> Optional[Tuple[int, Streamed, dict]]:
        done = [d for d in self.delivered if d[1].finished]
        return done[-1] if done else None

    @property
    def answered(self) -> bool:
        return self.final is not None

    def starting(self) -> bool:
        """An attempt was started (an end held back) and its copy has not reached decode's scheduler yet."""
        return bool(self.held) and not self.legs[-1].decode.arrived and not self.answered


_rids = itertools.count(1)


def pick(items: list, i: int):
    """The i-th of `items`, cyclically (Hypothesis draws i; it shrinks towards the first)."""
    return items[i % len(items)]


def finals_of(h, rid: str, room: int) -> List[Streamed]:
    """The ends `h`'s scheduler streamed for `rid` in `room` (decode: each attempt keeps the rid, not the room)."""
    return [s for s in h.outputs.of(rid) if s.finished and s.room == room]


def status_of(s: Streamed) -> object:
    """An end as its client sees it: 200, ABORT (upstream's abort answer) or the error status."""
    if s.reason and s.reason.get("type") == "abort":
        code = s.reason.get("status_code")
        return ABORT if code is None else int(code)
    return 200


def answer_of(h, rid: str, room: int) -> Optional[object]:
    """The copy's answer: its scheduler's end (what its client saw, but for decode's tokenizer, `Client`)."""
    finals = finals_of(h, rid, room)
    return status_of(finals[-1]) if finals else None


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
        self.reqs: List[Request] = []  # every attempt of every client request
        self.clients: List[Client] = []
        self.time = ScriptedTime()
        # decode's tokenizer as recovery reads it: its server args, one weight version (the model updates none), its
        # requests' states, and upstream's abort answer path (`_handle_abort_req`: here, the client gets the answer)
        self.tm = SimpleNamespace(server_args=self.h["decode"].server_args, config_value=lambda name: "model-v0",
                                  rid_to_state={}, is_pause=False, _handle_abort_req=self._abort_answered)
        self._saved_env = {k.name: os.environ.get(k.name) for k in (knobs.RECOVERY_ATTEMPTS, knobs.RECOVERY_BUDGET)}
        self.set_recovery(0, "ample")  # until the example draws its knobs (`recovery_knobs`)
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
            first = r.client.legs[0].room if r.client is not None else r.room  # an attempt re-runs the same prompt
            tokens = range(100 * (first % 1000) + 1, 100 * (first % 1000) + 1 + PROMPT)  # no shared prefix
            req = h.make_req(rid=r.prefill_rid, room=r.room, tokens=tokens)
            r.prefill_req = req
        else:
            req = h.make_req(rid=r.rid, room=r.room, prompt_len=PROMPT)
            r.decode_req = req
        if side == "decode" and not r.attempt:  # it reached decode's tokenizer (`_init_req_state`, before the gate)
            self.tm.rid_to_state.setdefault(r.rid, r.client.state)
        if self.released[side] or self.paused[side] == "abort":
            # what the tokenizer would do with it is not modelled here: it waits at the gate (arrives later)
            copy.arrived_at = None
            copy.at_gate = True
            return
        copy.at_gate = False
        h.add(req)
        if side == "decode" and r.attempt:  # recovery's re-submission reached decode's scheduler (`recovery._submit`)
            recovery._step(self.tm, request_record.of(r.client.state, recovery.Attempts), recovery.Event.SUBMITTED)
        if r.room in self.pending[side]:
            self._tell(side, r.room, self.pending[side].pop(r.room))

    def _unanswered(self, side: str) -> List[Request]:
        return [r for r in self.reqs if r.copy(side).arrived and r.copy(side).answer is None]

    def _allow(self, r: Request, side: str, *answers) -> None:
        copy = r.copy(side)
        copy.causes.update(answers)
        r.faulted = True

    def _allow_chunk_failure(self, r: Request) -> None:
        """A failed chunk write: 500 on both sides; on prefill, while recovery has an attempt left for this leg
        (recovery_rule.prefill_hands_over: the knob > the leg's attempt), the verdict's handed-over answer instead
        (an abort without status: the gateway keeps decode's answer)."""
        self._allow(r, "prefill", 500)
        self._allow(r, "decode", 500)
        if self.attempts > r.attempt:
            self._allow(r, "prefill", ABORT)

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
        """Read every copy's answer from its scheduler's outputs, and pass decode's through its tokenizer (after each
        step)."""
        for r in self.reqs:
            for side in SIDES:
                copy = r.copy(side)
                if copy.answer is None:
                    copy.answer = answer_of(self.h[side], r.side_rid(side), r.room)
        for c in self.clients:
            for leg in list(c.legs):  # an output held back adds an attempt
                outs = [s for s in self.h["decode"].outputs.of(c.rid) if s.room == leg.room]
                for s in outs[c.read.get(leg.room, 0):]:
                    c.read[leg.room] = c.read.get(leg.room, 0) + 1
                    self._tokenizer_output(c, leg, s)

    # ------------------------------------------------------------------ decode's tokenizer: recovery

    def set_recovery(self, attempts: int, budget: str) -> None:
        """The recovery knobs decode's tokenizer reads (`knobs.RECOVERY_*`, read on each decision)."""
        self.attempts, self.budget = attempts, budget
        os.environ[knobs.RECOVERY_ATTEMPTS.name] = str(attempts)
        os.environ[knobs.RECOVERY_BUDGET.name] = BUDGETS[budget]

    def _tokenizer_output(self, c: Client, leg: Request, s: Streamed) -> None:
        """One output of decode's scheduler for `c`, as `TokenizerManager` handles it: an `AbortReq` answer
        (`send_abort_output`) through `_handle_abort_req` (no recovery there); a streamed output through
        `_handle_batch_output`, whose patched line asks the real `recovery.holds_back`."""
        if s.via == "abort_req":
            c.delivered.append((leg.attempt, s, {}))
            return
        recv = SimpleNamespace(finished_reasons=[s.reason if s.finished else None],
                               completion_tokens=[len(s.output_ids)])
        meta_info: Dict[str, Any] = {}
        if recovery.holds_back(self.tm, c.state, recv, 0, meta_info, start=self._start_attempt):
            c.held.append((leg.attempt, s))
            return
        c.delivered.append((leg.attempt, s, meta_info))

    def _start_attempt(self, tm: Any, state: Any, attempt: int) -> None:
        """Recovery's attempt `attempt`, carried as `recovery._rerun` does: a new room, the prefill leg under
        `attempt_rid`, the same request re-submitted to decode; both copies reach their scheduler later (any order)."""
        c = next(c for c in self.clients if c.state is state)
        leg = Request(c.rid, next(self.h["prefill"]._rooms), prefill_rid=recovery_attempt.attempt_rid(c.rid, attempt),
                      attempt=attempt, client=c)
        leg.prefill.handed_at_deadline = self.attempts > attempt
        state.obj.bootstrap_room = leg.room
        c.legs.append(leg)
        self.reqs.append(leg)
        LifecycleMachine.seen[f"recovery attempt {attempt} started"] += 1

    def _between(self, side: str, why: str, rid: str = "") -> None:
        """An abort (a client's by `rid`, else `abort_all`, also the abort-mode pause's) reaches decode's tokenizer:
        recovery's AFTER hook on `TokenizerManager.abort_request` (`recovery.after_abort_request`, real code) answers
        a request between attempts (held back, in no scheduler) at once; its attempt then never re-submits (neither
        copy is sent: `_abort_answered` withdraws it). The scheduler's own abort follows (the caller's)."""
        if side != "decode":
            return
        for c in self.clients:
            if c.starting() and (not rid or c.rid.startswith(rid)):
                c.aborted_between = True
                LifecycleMachine.seen[f"recovery: {why} on decode while an attempt was starting"] += 1
            if c.legs[0].decode.at_gate and (not rid or c.rid == rid):
                # the fork's gate answers it the abort (pause_gate; not modelled: it arrives later); recovery is
                # over for it (`recovery.after_abort_request`: never held back after)
                c.aborted_at_gate = True
        recovery.after_abort_request(None, self.tm, rid, not rid)

    def _abort_answered(self, recv: AbortReq) -> None:
        """Upstream's `_handle_abort_req` as recovery calls it for a held-back request: the client gets the abort
        answer (by its pending attempt), and that attempt is withdrawn (recovery's re-run stops before it sends
        anything)."""
        c = next(c for c in self.clients if c.rid == recv.rid)
        leg = c.legs[-1]
        assert not (leg.prefill.arrived or leg.decode.arrived), f"{c.rid}: answered between attempts after a copy was sent"
        self.reqs.remove(leg)
        c.delivered.append((leg.attempt, Streamed(rid=recv.rid, finished=True, reason=recv.finished_reason,
                                                  output_ids=(), via="abort_req", room=leg.room), {}))

    # ------------------------------------------------------------------ rules: requests

    def _new_request(self, arrives) -> None:
        rid = f"m{next(_rids):07d}"  # fixed width: no rid is a prefix of another's (upstream aborts by prefix)
        r = Request(rid, next(self.h["prefill"]._rooms))
        r.prefill.handed_at_deadline = self.attempts > 0
        d = self.h["decode"]
        obj = GenerateReqInput(input_ids=list(range(1, PROMPT + 1)), sampling_params={"max_new_tokens": 8}, rid=rid,
                               bootstrap_host=d.default_bootstrap_host,
                               bootstrap_port=d.server_args.disaggregation_bootstrap_port, bootstrap_room=r.room)
        r.client = Client(rid, ReqState(out_list=[], finished=False, event=asyncio.Event(), obj=obj, time_stats=None),
                          legs=[r])
        self.clients.append(r.client)
        self.reqs.append(r)
        for side in arrives:
            self._arrive(r, side)

    @initialize(attempts=st.sampled_from(RECOVERY_ATTEMPTS), budget=st.sampled_from(tuple(BUDGETS)))
    def recovery_knobs(self, attempts: int, budget: str) -> None:
        self.set_recovery(attempts, budget)

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

    @precondition(lambda self: len(self.reqs) < MAX_REQUESTS)
    @rule(kind=st.sampled_from(("last", "state")))
    def new_request_failing(self, kind: str) -> None:
        """A request (both copies) whose last chunk write will fail on prefill: the failure recovery acts on, made
        common enough for the fixed profile to reach recovery's orderings (`chunk_fails` arms it at any moment)."""
        self._new_request(SIDES)
        r = self.reqs[-1]
        self.h["prefill"].faults.fail_chunk(r.room, kind, reason=verdict_wording.UPSTREAM_CHUNK_FAILED["kv"] + " (model)")
        self._allow_chunk_failure(r)

    @precondition(lambda self: any(not r.attempt and not (r.prefill.arrived and r.decode.arrived) for r in self.reqs))
    @rule(i=st.integers(0, MAX_REQUESTS - 1))
    def late_copy(self, i: int) -> None:
        """A client's request's copy that is still on its way arrives (a recovery attempt's copies arrive in their
        own order: `attempt_copy_arrives`)."""
        late = [r for r in self.reqs if not r.attempt and not (r.prefill.arrived and r.decode.arrived)]
        r = late[i % len(late)]
        for side in SIDES:
            if not r.copy(side).arrived:
                self._arrive(r, side)
                return

    def eligible_attempt_copies(self) -> List[Request]:
        return [r for r in self.reqs if r.attempt and not (r.prefill.arrived and r.decode.arrived)]

    @precondition(lambda self: bool(self.eligible_attempt_copies()))
    @rule(i=st.integers(0, MAX_REQUESTS - 1))
    def attempt_copy_arrives(self, i: int) -> None:
        """A recovery attempt's copy reaches its scheduler: decode's first (`recovery._rerun` sends the prefill leg only
        once decode's scheduler has the request), then prefill's."""
        r = pick(self.eligible_attempt_copies(), i)
        self._arrive(r, "decode" if not r.decode.arrived else "prefill")

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
        self._allow_chunk_failure(r)

    def eligible_attempts(self) -> List[Request]:
        return [r for r in self.reqs if r.attempt and r.prefill.answer is None
                and r.room not in self.h["prefill"].faults._chunk_faults]

    @precondition(lambda self: bool(self.eligible_attempts()))
    @rule(i=st.integers(0, MAX_REQUESTS - 1), kind=st.sampled_from(("last", "state")))
    def attempt_chunk_fails(self, i: int, kind: str) -> None:
        """A recovery attempt's chunk write fails too (armed before or after its copy reached prefill): the fault
        that persists, or fires again, as `chunk_fails` for any room (a rule of its own: attempts are rare)."""
        r = pick(self.eligible_attempts(), i)
        self.h["prefill"].faults.fail_chunk(r.room, kind,
                                            reason=verdict_wording.UPSTREAM_CHUNK_FAILED["kv"] + " (model)")
        self._allow_chunk_failure(r)

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
        rid = pick(self.reqs, i).side_rid(side)
        hit = [r for r in self.reqs if r.side_rid(side).startswith(rid)]  # upstream aborts by prefix
        for r in hit:
            if r.copy(side).arrived and r.copy(side).answer is None:
                self._allow(r, side, ABORT)
                r.copy(side).completion_allowed = False  # never a completion once an abort is pending on it
                if side == "decode" and not r.client.answered:
                    r.client.aborted = True
        self._between(side, "client abort", rid)
        self.h[side].abort(rid)

    @rule(side=st.sampled_from(SIDES))
    def abort_all(self, side: str) -> None:
        for r in self._unanswered(side):
            self._allow(r, side, ABORT)
            r.copy(side).completion_allowed = False
            if side == "decode" and not r.client.answered:
                r.client.aborted = True
        self._between(side, "abort_all")
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
            self._between(side, "pause (abort)")
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
        # a request between recovery attempts is not in flight: it waits at the pause gate (`recovery._submit`) and is
        # re-submitted after the resume, as any request at the gate (its decode copy's arrival waits: `_arrive`)
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
                finals = finals_of(self.h[side], r.side_rid(side), r.room)
                assert len(finals) <= 1, f"{side} answered {r.side_rid(side)} (room {r.room}) twice: {finals}"
                if copy.answer is not None:
                    assert copy.arrived or copy.answer is None, f"{side} answered {r.rid} before it arrived"
                    assert copy.answer in copy.allowed(), (
                        f"{side} answered {r.side_rid(side)} (room {r.room}) {copy.answer!r}, allowed "
                        f"{sorted(map(str, copy.allowed()))}: {finals[-1]}")
                if side == "decode" and copy.answer == 200:
                    assert r.success_delivered, f"decode completed {r.rid} without prefill's KV"
        for c in self.clients:
            self._check_client(c)

    def _check_client(self, c: Client) -> None:
        """The client request's contract, after every step (module docstring)."""
        finals = [d for d in c.delivered if d[1].finished]
        assert len(finals) <= 1, f"the client of {c.rid} was answered twice: {finals}"
        assert not finals or c.delivered[-1][1].finished, f"the client of {c.rid} got output after its answer"
        reruns = len(c.legs) - 1
        most = self.attempts if self.budget == "ample" else min(self.attempts, 1)
        assert reruns <= most, (f"{c.rid} ran {reruns} recovery attempts; SGLANG_FORK_RECOVERY_ATTEMPTS="
                                f"{self.attempts}, budget {self.budget}")
        assert len(c.held) == reruns, f"{c.rid}: {len(c.held)} ends held back, {reruns} attempts started"
        for attempt, s in c.held:
            # a failed chunk write (500) or a transfer deadline in a recoverable stage (504), before any token
            assert recovery_rule.cause_of_answer(s.reason) is not None and not s.output_ids, \
                f"{c.rid}: attempt {attempt}'s end held back though it is no recoverable failure before a token: {s}"
            assert attempt < reruns, f"{c.rid}: attempt {attempt}'s end held back, no attempt started after it"
        with_tokens = {attempt for attempt, s, _ in c.delivered if s.output_ids}
        assert len(with_tokens) <= 1, f"the client of {c.rid} got tokens of attempts {sorted(with_tokens)}"
        if not finals:
            return
        attempt, s, meta = finals[0]
        answer = status_of(s)
        assert attempt == reruns, f"{c.rid} answered by attempt {attempt} of {reruns}: {s}"
        if s.via == "stream":
            want = {"attempts": reruns, "cause": recovery_rule.cause_of_answer(c.held[0][1].reason)} if reruns else None
            assert meta.get("recovery") == want, f"{c.rid}: meta_info recovery {meta.get('recovery')}, {reruns} attempts"
        if answer == 200:
            assert c.legs[attempt].decode.answer == 200, f"{c.rid}: a completion its attempt did not make"
            assert c.legs[attempt].success_delivered
            if c.aborted:
                raise AssertionError(f"{c.rid} answered a completion after an abort reached it (attempt {attempt})")
            if c.aborted_between:
                raise AssertionError(f"{c.rid} answered a completion after an abort or pause reached it while "
                                     f"recovery attempt {attempt} was starting")

    def _check_quiescent_client(self, c: Client) -> None:
        """At quiescence: answered exactly once; a failure recovery could re-run answered only once none was left."""
        assert c.answered, f"the client of {c.rid} was never answered ({len(c.legs)} attempts, held back {c.held})"
        attempt, s, _ = c.final
        reruns = len(c.legs) - 1
        recoverable = s.via == "stream" and not s.output_ids and recovery_rule.cause_of_answer(s.reason) is not None
        if recoverable and not (c.aborted or c.aborted_between or c.aborted_at_gate):
            spent = self.budget == "spent" and reruns >= 1
            assert reruns == self.attempts or spent, (
                f"{c.rid} answered a recoverable failure before its first token after {reruns} of {self.attempts} "
                f"attempts (budget {self.budget}): {s}")
        if reruns:
            LifecycleMachine.seen[f"recovered request answered {status_of(s)} by attempt {attempt}"] += 1

    # ------------------------------------------------------------------ quiescence

    def _drain(self, rounds: int = 12) -> None:
        """Every wire message delivered, every hold let go, every attempt's copies arrived, both sides passing,
        until nothing moves (12 more rounds after an attempt starts)."""
        done, attempts = 0, len(self.reqs)
        while done < rounds:
            done += 1
            for r in self.eligible_attempt_copies():
                for side in SIDES:
                    if not r.copy(side).arrived:
                        self._arrive(r, side)
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
            if len(self.reqs) > attempts:
                attempts, rounds = len(self.reqs), max(rounds, done + 12)

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
                assert r.copy(side).answer is not None, \
                    f"{side} never answered {r.side_rid(side)} (room {r.room})"
        for c in self.clients:
            self._check_quiescent_client(c)
        for side in SIDES:
            leftover = held(report(self.h[side]))
            assert not leftover, f"{side} holds something at quiescence: {leftover}"

    def teardown(self) -> None:
        try:
            self.settle()
            self.sides.dirty = False
        finally:
            for name, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            engine_clock.resume()
            engine_clock._monotonic = self._saved_monotonic
            td.reset_scan_schedule()
