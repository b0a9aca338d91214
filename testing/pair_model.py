"""A model of a room's life over the real mooncake pair: a stateful property test of what the lifecycle model
(testing/lifecycle_model.py) cannot drive, the transfer backend's own threads.

The pair (testing/mooncake_pair.py) is two processes, prefill and decode, each with upstream's real queues and
`MooncakeKVManager` (its bootstrap thread, its transfer workers, decode's status thread) over mooncake TCP on
loopback, and the fork's hooks. The lifecycle model plays the wire itself, with a scripted backend; here the wire is
real, so where a background thread is when a scheduler ticks is up to the machine: the rules below choose what the
schedulers and clients do and when, the threads run in between. Every event the pair can drive is a rule, on either
side, in any order (`PairMachine`): a request's two copies arrive (either first, the other later), a scheduler pass
on either side or both, the background threads running while neither scheduler ticks, a client abort on either side
at any stage, an in-place pause, a release and a continue of either server (a copy for a paused server waits at its
gate), a transfer worker's next write raising, decode finishing a transferred request. Each request is calm or has
one failed chunk write on prefill (KV, aux or state: the fault switch `SGLANG_TEST_DISAGG_FAIL_CHUNKS` by rid prefix,
both sides carrying a state component so every last chunk also takes the state path).

After every step (`check`), each copy (prefill's, decode's) that has an answer:
- was answered once;
- a completion only for a calm request whose own side saw no client abort before its answer (an abort is never a
  success, a failed transfer never a completion);
- upstream's abort answer (no status) only after a client abort or a release reached that request on either side;
- any other answer only 500, naming the request's failed chunk write, or the transfer worker's error for a request
  that was unanswered on prefill while a worker's break was armed (at most one request per break);
- a release answered every copy that was queued on its server by the time it returned.
Decode completes a request only with the bytes prefill sent (checked before it finishes).

At quiescence (`settle`, the machine's teardown: both servers continue, every late copy arrives, both schedulers run,
decode finishes what it received; a break no write took yet is taken by one more calm request, so none outlives its
example): every copy answered exactly once; a request no abort or release reached is
answered the same on both sides (calm: a completion, or the worker's 500 if it was exposed to a break; a failed chunk:
500 naming it); and both sides hold what they held before the example (queues, KV, slots, metadata, rooms, the
kv manager's per-room tables, the fork's per-room tables: `pd_checks.pair_snapshots`).

What this tier does not drive: the engine clock and deadlines (the transfer-deadline pair tests), a peer lost or
silent (the peer-liveness pair tests), an abort-mode pause and retraction (decode runs no batch here; the lifecycle
model), recovery (decode's tokenizer is not in the pair).

    pytest test/srt/model/test_pair_model.py     # the fixed profile (make test)
    MODEL_PROFILE=long pytest ...                # random examples for MODEL_SECONDS (make test-model)
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import Any, Dict, List, Optional

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from testing.harness_client import reason_status
from testing.pd_checks import assert_pair_serves, pair_is_idle, pair_snapshots

SIDES = ("prefill", "decode")
KINDS = ("calm", "kv", "aux", "state")
FAULTS = "kv:rid=fail-kv-,aux:rid=fail-aux-,state:rid=fail-state-"
REASON = {"kv": "Failed to send kv chunk", "aux": "Failed to send aux data", "state": "Failed to send state components"}
# A failed write leaves decode's pages held until prefill acks a drain or this passes (upstream's deferred release).
RELEASE_ENV = {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "1"}
SIZES = dict(kv_tokens=2048, req_slots=12, metadata_slots=12, max_context_len=64, state_component=True)
MAX_ROOMS = 8  # requests per example (the slots above hold them all at once)
ARRIVALS = ("prefill first", "decode first", "prefill alone", "decode alone")
SETTLE_S = 90.0  # quiescence, bounded: a failed write's pages wait up to the release timeout above
WORKER_ERROR = "injected transfer engine error"  # mooncake_pair's break_transfer_engine_once
RELEASE_MESSAGE = "Aborted: engine memory released during pause (mode=in_place)."  # what a release answers
TRAIL = "the example's steps"
ABORT = "abort"  # upstream's client-abort answer: finish_reason abort, no status


def answer_of(reason: Optional[dict]) -> Any:
    """A final finish reason as the model judges it: 200 (a completion), ABORT, or the status an abort carries."""
    code = reason_status(reason)
    return ABORT if code is None else code


@dataclasses.dataclass
class Room:
    """One request, as the model sees it: its copies' arrival, the client aborts that reached each copy before its
    answer, and what each side last reported (`Worker.answers`: finals, last reason, transferred)."""

    room: int
    kind: str
    prompt_len: int
    arrived: Dict[str, bool] = dataclasses.field(default_factory=lambda: dict.fromkeys(SIDES, False))
    aborted: Dict[str, bool] = dataclasses.field(default_factory=lambda: dict.fromkeys(SIDES, False))
    released: bool = False  # a release on either side found a copy of it unanswered (its peer is told)
    exposed: bool = False  # unanswered on prefill while a transfer worker's break was armed: it may be the one failed
    release_pending: set = dataclasses.field(default_factory=set)  # sides whose release must have answered it
    seen: Dict[str, list] = dataclasses.field(default_factory=dict)
    judged: set = dataclasses.field(default_factory=set)  # the sides whose answer the model counted in `seen`

    @property
    def rid(self) -> str:
        return f"calm-{self.room}" if self.kind == "calm" else f"fail-{self.kind}-{self.room}"

    def answered(self, side: str) -> bool:
        return bool(self.seen.get(side, [0])[0])

    def transferred(self) -> bool:
        """Decode received its KV and waits to run it."""
        return bool(self.seen.get("decode", [0, None, False])[2])

    def abort_reached(self) -> bool:
        """A client abort or a release reached it: upstream's abort answer is allowed (on both sides: the peer is
        told)."""
        return any(self.aborted.values()) or self.released

    def error_reasons(self) -> List[str]:
        """What a 500 of it may name: its failed write, and the transfer worker's error if it was exposed to it."""
        return ([REASON[self.kind]] if self.kind != "calm" else []) + ([WORKER_ERROR] if self.exposed else [])

    def settled(self) -> bool:
        return all(self.arrived[s] and self.answered(s) for s in SIDES)


class Pairs:
    """The pair the examples share (starting one takes seconds): built on first use, rebuilt after an example that did
    not reach quiescence (`dirty`), closed by the test."""

    def __init__(self) -> None:
        self.pair = None
        self.dirty = False

    def get(self):
        from testing.mooncake_pair import MooncakePair

        if self.pair is not None and self.dirty:
            self.close()
        if self.pair is None:
            self.pair = MooncakePair(prefill_env={"SGLANG_TEST_DISAGG_FAIL_CHUNKS": FAULTS, **RELEASE_ENV},
                                     decode_env=RELEASE_ENV, **SIZES)
            self.pair.idle = pair_snapshots(self.pair)
            # one request first: decode learns prefill's info, as in a serving deployment
            assert_pair_serves(self.pair, [self.pair.submit(prompt_len=12)])
        self.dirty = True  # until the example's teardown reaches quiescence
        return self.pair

    def close(self) -> None:
        if self.pair is not None:
            self.pair.close()
        self.pair = None


class PairMachine(RuleBasedStateMachine):
    pairs = Pairs()
    seen: Counter = Counter()  # what the examples reached, across runs (the test asserts the run is not vacuous)
    total_steps = 0

    def __init__(self) -> None:
        super().__init__()
        self.pair = self.pairs.get()
        self.rooms: Dict[int, Room] = {}
        self.paused = dict.fromkeys(SIDES, False)  # an in-place pause: that side's scheduler runs its paused loop
        self.break_armed = False  # a transfer worker's next batch raises (prefill)
        self.breaks = 0
        self.trail: List[str] = []  # the steps so far, for a failure's report (the threads' timing is not replayed)

    def step(self, what: str) -> None:
        self.trail.append(what)

    def failed(self, e: BaseException) -> AssertionError:
        if isinstance(e, AssertionError) and TRAIL in str(e):
            return e
        steps = "\n".join(f"  {i}. {s}" for i, s in enumerate(self.trail, 1))
        return AssertionError(f"{type(e).__name__}: {e}\n{TRAIL} (rules as run; the threads' timing was the "
                              f"machine's and may not replay):\n{steps}")

    def call(self, side: str, name: str, *args: Any) -> Any:
        try:
            return getattr(self.pair, side).call(name, *args)
        except Exception as e:
            raise self.failed(e) from e

    # -- helpers --
    # Preconditions and draws read only what the rules decided (arrivals), never what the threads did (answers,
    # transfers): Hypothesis replays a rule list and needs the same choices each time.
    def live(self) -> List[Room]:
        return [r for r in self.rooms.values() if not r.settled()]

    def missing(self) -> List[Room]:
        return [r for r in self.rooms.values() if not all(r.arrived.values())]

    def may_arrive(self) -> List[Room]:
        """Rooms whose missing copy may arrive now: not on a paused side (it waits at that server's pause gate)."""
        return [r for r in self.missing() if any(not r.arrived[s] and not self.paused[s] for s in SIDES)]

    def arrived(self, side: str) -> List[Room]:
        return [r for r in self.rooms.values() if r.arrived[side]]

    def finishable(self) -> List[Room]:
        if self.paused["decode"]:
            return []
        return [r for r in self.rooms.values() if r.transferred() and not r.answered("decode")]

    def _add(self, r: Room, side: str) -> None:
        self.call(side, "add", r.room, r.prompt_len, r.rid)
        r.arrived[side] = True

    def read(self) -> None:
        """Both sides' answers for every room, one call each."""
        rooms = list(self.rooms)
        for side in SIDES:
            for room, seen in self.call(side, "answers", rooms).items():
                self.rooms[room].seen[side] = seen

    def check(self) -> None:
        for r in self.rooms.values():
            for side in SIDES:
                finals, reason, _ = r.seen.get(side, (0, None, False))
                if not finals:
                    continue
                what = (f"{side} answered {r.rid} (room {r.room}, aborted {r.aborted}, released {r.released}, "
                        f"exposed {r.exposed}) {reason!r}")
                assert finals == 1, f"{what} {finals} times"
                answer = answer_of(reason)
                if answer == 200:
                    assert r.kind == "calm", f"{what}: a completion of a failed {r.kind} write"
                    assert not r.aborted[side], f"{what}: a completion after its client abort"
                elif answer == ABORT:
                    assert r.abort_reached(), f"{what}: the abort answer with no abort"
                else:
                    assert answer == 500 and r.error_reasons(), f"{what}: an error it met no cause for"
                    assert any(e in str(reason.get("message")) for e in r.error_reasons()), \
                        f"{what}: naming none of {r.error_reasons()}"
                if side not in r.judged:
                    r.judged.add(side)
                    self.seen[f"{side} {r.kind} {answer}{' after an abort' if r.abort_reached() else ''}"] += 1
        for r in self.rooms.values():
            for side in r.release_pending:
                assert r.answered(side), f"{side}'s release left {r.rid} (room {r.room}) unanswered: {r.seen}"
            r.release_pending.clear()
        failed_workers = [r.rid for r in self.rooms.values()
                          if WORKER_ERROR in str((r.seen.get("prefill", [0, None])[1] or {}).get("message"))]
        assert len(failed_workers) <= self.breaks, f"{failed_workers} failed by {self.breaks} worker break(s)"

    def _finish(self, r: Room) -> None:
        """Decode runs the transferred request to its length, after checking it holds the bytes prefill sent."""
        got, sent = self.call("decode", "kv_bytes", r.room), self.call("prefill", "kv_sent", r.room)
        assert got == sent, f"decode's KV of {r.rid} (room {r.room}) is not what prefill sent"
        self.call("decode", "finish", r.room)

    # -- rules: every event the pair can drive, on either side --
    @precondition(lambda self: len(self.rooms) < MAX_ROOMS)
    @rule(kind=st.sampled_from(KINDS), arrival=st.sampled_from(ARRIVALS), prompt_len=st.integers(4, 40))
    def arrive(self, kind: str, arrival: str, prompt_len: int) -> None:
        """A request: both copies (either first), or one now and the other later (`arrive_late`)."""
        r = Room(self.pair.new_room(), kind, prompt_len)
        self.rooms[r.room] = r
        self.step(f"arrive {r.rid}, {arrival}, prompt {prompt_len}")
        r.exposed = self.break_armed
        first = "decode" if arrival.startswith("decode") else "prefill"
        for side in (first,) if arrival.endswith("alone") else (first, "prefill" if first == "decode" else "decode"):
            if not self.paused[side]:  # else it waits at that server's pause gate: it arrives late
                self._add(r, side)

    @precondition(lambda self: self.may_arrive())
    @rule(data=st.data())
    def arrive_late(self, data) -> None:
        r = data.draw(st.sampled_from(self.may_arrive()))
        for side in [s for s in SIDES if not r.arrived[s] and not self.paused[s]]:
            self.seen[f"{side} copy late{' after an abort' if r.abort_reached() else ''}"] += 1
            self.step(f"{side} copy of {r.rid} arrives")
            self._add(r, side)

    @rule(side=st.sampled_from(SIDES), n=st.integers(1, 3))
    def tick(self, side: str, n: int) -> None:
        self.step(f"{side} ticks {n}")
        self.call(side, "tick", n)

    @rule(n=st.integers(1, 4))
    def tick_both(self, n: int) -> None:
        self.step(f"both tick {n}")
        for _ in range(n):
            for side in SIDES:
                self.call(side, "tick")

    @rule(ms=st.integers(1, 30))
    def threads_run(self, ms: int) -> None:
        """Neither scheduler ticks for `ms`: an event (the bootstrap thread, transfer workers and decode's status
        thread moving on their own), not a wait for anything."""
        self.step(f"threads run {ms} ms")
        time.sleep(ms / 1000)

    @precondition(lambda self: self.rooms)
    @rule(data=st.data(), side=st.sampled_from(SIDES))
    def client_abort(self, data, side: str) -> None:
        """A client abort of a request on one side, whatever its stage (one already answered there: upstream's
        abort of a finished request, a no-op)."""
        rooms = self.arrived(side)
        if not rooms:
            return
        r = data.draw(st.sampled_from(rooms))
        other = "decode" if side == "prefill" else "prefill"
        stage = ("answered" if r.answered(side) else "transferred" if r.transferred()
                 else "peer answered" if r.answered(other)
                 else "peer copy not arrived" if not r.arrived[other] else "in flight")
        self.seen[f"abort on {side}, {stage}"] += 1
        r.aborted[side] = r.aborted[side] or not r.answered(side)
        self.step(f"client abort of {r.rid} on {side} ({stage})")
        self.call(side, "abort", r.room)

    @rule(side=st.sampled_from(SIDES))
    def pause(self, side: str) -> None:
        """An in-place pause of one server (`pause_generation(mode="in_place")`): its scheduler runs only its paused
        loop; the other server goes on."""
        if self.paused[side]:
            return
        self.step(f"{side} pauses")
        self.paused[side] = True
        self.call(side, "set_paused", True)

    @rule(side=st.sampled_from(SIDES))
    def release(self, side: str) -> None:
        """A release of one server's memory (`release_memory_occupation`, after `pause_generation` as RL frameworks
        call them: the server is paused first if it is not): everything queued there ends at once as the release's
        abort, and its peer copies are told."""
        self.pause(side)
        self.step(f"{side} releases")
        self.seen[f"release on {side}"] += 1
        for r in self.rooms.values():
            if r.arrived[side] and not r.answered(side):
                r.released = True
                r.release_pending.add(side)
        self.call(side, "end_queued", RELEASE_MESSAGE)

    @rule(side=st.sampled_from(SIDES))
    def continue_(self, side: str) -> None:
        """`continue_generation` on one server."""
        if not self.paused[side]:
            return
        self.step(f"{side} continues")
        self.paused[side] = False
        self.call(side, "set_paused", False)

    @rule()
    def transfer_worker_raises(self) -> None:
        """Prefill: the next KV write a transfer worker makes raises (an unexpected error in a send path): the room
        it was sending fails (500 naming it), every other room goes on."""
        if self.break_armed:
            return
        self.step("prefill's next transfer raises")
        self.seen["transfer worker break"] += 1
        self.break_armed, self.breaks = True, self.breaks + 1
        for r in self.rooms.values():
            r.exposed = r.exposed or not r.answered("prefill")
        self.call("prefill", "break_transfer_engine_once")

    @rule()
    def decode_finishes(self) -> None:
        """Decode runs every request it has received to its length."""
        for r in self.finishable():
            self.step(f"decode finishes {r.rid}")
            self._finish(r)

    @invariant()
    def answers_hold(self) -> None:
        PairMachine.total_steps += 1
        self.read()
        self.note_break_taken()
        try:
            self.check()
        except AssertionError as e:
            raise self.failed(e) from e

    def note_break_taken(self) -> None:
        if self.break_armed and not self.call("prefill", "transfer_break_armed"):
            self.break_armed = False
            self.seen["transfer worker break taken"] += 1

    # -- quiescence --
    def settle(self) -> None:
        for side in SIDES:
            self.continue_(side)
        for r in self.missing():
            for side in SIDES:
                if not r.arrived[side]:
                    self._add(r, side)
        self.answer_all()
        if self.break_armed:  # no write took the break yet: a calm request does (no break outlives its example)
            r = Room(self.pair.new_room(), "calm", 12, exposed=True)
            self.rooms[r.room] = r
            self.step(f"arrive {r.rid}, both, to take the break")
            for side in SIDES:
                self._add(r, side)
            self.answer_all()
        assert not self.break_armed, "a transfer worker's break that no KV write took"
        for r in self.rooms.values():
            if r.abort_reached():
                continue
            answers = [answer_of(r.seen[s][1]) for s in SIDES]
            expected = [[200, 200]] if r.kind == "calm" else [[500, 500]]
            if r.exposed and r.kind == "calm":
                expected.append([500, 500])
            assert answers in expected, f"{r.rid} (room {r.room}) met no abort, yet answered {answers}: {r.seen}"
        self.pair.run_until(lambda: pair_is_idle(self.pair), timeout=SETTLE_S)
        assert pair_snapshots(self.pair) == self.pair.idle

    def answer_all(self) -> None:
        """Both schedulers run, decode finishing what it received, until every copy is answered (bounded)."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            self.read()
            self.note_break_taken()
            self.check()
            for r in self.finishable():
                self._finish(r)
            if not self.live():
                break
            assert time.monotonic() < deadline, (
                f"not answered after {SETTLE_S:.0f}s: "
                f"{[(r.rid, r.arrived, r.aborted, r.seen) for r in self.live()]}; prefill "
                f"{self.call('prefill', 'snapshot')}, decode {self.call('decode', 'snapshot')}")
            for side in SIDES:
                self.call(side, "tick")

    def teardown(self) -> None:
        try:
            self.settle()
        except Exception as e:
            raise self.failed(e) from e
        self.pairs.dirty = False
