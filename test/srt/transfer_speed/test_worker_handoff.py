"""Prefill's scheduler hands a queued KV chunk to an idle transfer worker at once (fork_transfer/worker_handoff.py):
after upstream's sender (`MooncakeKVSender.send`, through `CommonKVSender.send` and the manager's
`add_transfer_request`) put a chunk for a worker parked on its queue, the scheduler
thread waits (letting go of the GIL) until the worker took it, at most SGLANG_FORK_TRANSFER_HANDOFF; a busy worker is
not waited for; 0 keeps upstream's hand-off (the worker gets upstream's own queue). Through the real code paths:
upstream's `send` and `add_transfer_request` with the fork's AFTER hook, and upstream's `transfer_worker` loop as the fork runs
it (chunk_failures' guarded worker, on its own thread, over upstream's FastQueue), on a `MooncakeKVManager` and sender whose
state is set by hand (no mooncake engine: each chunk here waits on its `wait_event`, then is skipped as failed, the
worker's own path for a room that failed meanwhile)."""

from __future__ import annotations

import collections
import threading
import time

import numpy as np
import pytest

from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.common.utils import FastQueue
from sglang.srt.disaggregation.fork_transfer import chunk_failures, worker_handoff
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.fork_core import fork_plugin
from sglang.srt.plugins import load_plugins
from testing.knob_bounds import widen

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def measurable_waits(monkeypatch):
    """Paces of seconds, past the operator's 0.1 s bound, so a wait is told apart from none on a loaded machine."""
    widen(monkeypatch, "TRANSFER_HANDOFF", 10.0)

KNOB = "SGLANG_FORK_TRANSFER_HANDOFF"
TARGET = "sglang.srt.disaggregation.common.conn.CommonKVSender.send"
ROOM = 7
BOUND = 5.0  # the knob in the tests: far above any wake-up on a loaded machine, so "taken" never means "timed out"


class Gate:
    """A chunk's `wait_event` (upstream's worker synchronizes it before reading the KV): holds the worker inside the
    chunk until the test opens it, and says when the worker got there."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.open = threading.Event()

    def synchronize(self) -> None:
        self.reached.set()
        assert self.open.wait(30), "the test never opened the gate"


@pytest.fixture
def prefill(monkeypatch):
    """A prefill MooncakeKVManager with one transfer queue and its worker running (upstream's loop, the fork's
    guarded worker), and a function queueing a chunk for ROOM through upstream's sender."""

    def start(knob: str):
        monkeypatch.setenv(KNOB, knob)
        load_plugins()  # as run_scheduler_process does: the fork's hooks
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVSender
        from sglang.srt.observability.trace import TraceNullContext

        chunk_failures.guard_transfer_worker()  # as the BEFORE hook on _init_kv_manager does
        mgr = MooncakeKVManager.__new__(MooncakeKVManager)
        queue = FastQueue()
        mgr.__dict__.update(
            disaggregation_mode=DisaggregationMode.PREFILL, request_status={ROOM: KVPoll.WaitingForInput},
            transfer_infos={ROOM: {"10.0.0.2:17001": object()}}, transfer_queues=[queue], enable_trace=False,
            _staging_outstanding=collections.defaultdict(int), enable_deferred_decode_kv_release=False,
            _stopped=False, kv_shard_size=1, enable_all_cp_ranks_for_transfer=False, is_dummy_cp_rank=False)
        worker = threading.Thread(target=mgr.transfer_worker, args=(queue, None), daemon=True)
        worker.start()
        started.append((queue, worker))
        deadline = time.monotonic() + 10
        while worker_handoff.ATTR not in vars(mgr) and time.monotonic() < deadline:
            time.sleep(0.01)  # the worker's thread makes the hand-off at its start (bounded poll)

        def send(gate: Gate) -> float:
            """One non-last chunk of 4 pages through upstream's sender (the early-send event: the gate)."""
            sender = MooncakeKVSender.__new__(MooncakeKVSender)
            sender.__dict__.update(kv_mgr=mgr, bootstrap_room=ROOM, conclude_state=None, curr_idx=0,
                                   num_kv_indices=64, aux_index=0, _transfer_start_time=None,
                                   _early_send_wait_event=gate, trace_ctx=TraceNullContext(),
                                   _transfer_num_kv_indices=0, _transfer_num_state_indices=0)
            t0 = time.monotonic()
            sender.send(np.arange(4, dtype=np.int32))
            return time.monotonic() - t0

        return mgr, queue, send

    started = []
    yield start
    for queue, worker in started:
        queue.put(None)  # upstream's teardown sentinel: the worker's loop ends
        worker.join(10)
        assert not worker.is_alive(), "the transfer worker did not stop at the teardown sentinel"


def release(mgr, gate: Gate) -> None:
    """Let the worker out of the chunk: the room failed meanwhile, so upstream's worker skips it."""
    mgr.request_status[ROOM] = KVPoll.Failed
    gate.open.set()


def wait_parked(mgr, queue) -> None:
    """Until the worker waits on its queue again (bounded poll)."""
    watched = worker_handoff.handoff_of(mgr).queues[id(queue)]
    deadline = time.monotonic() + 10
    while not watched.parked and time.monotonic() < deadline:
        time.sleep(0.005)
    assert watched.parked, "the worker never came back to its queue"


def test_the_handoff_is_the_forks_one_hook_on_the_senders_send_and_applied(prefill):
    assert [(t, ref, kind) for t, ref, kind in fork_plugin.HOOKS if t == TARGET] == [
        (TARGET, "sglang.srt.disaggregation.fork_transfer.worker_handoff:after_send", "AFTER")]
    prefill(str(BOUND))
    assert fork_plugin.hooks_applied()[TARGET]


def test_a_chunk_for_a_parked_worker_is_taken_before_the_scheduler_goes_on(prefill):
    mgr, queue, send = prefill(str(BOUND))
    handoff = worker_handoff.handoff_of(mgr)
    assert handoff.bound == BOUND and isinstance(handoff.queues[id(queue)], worker_handoff.WatchedQueue)
    wait_parked(mgr, queue)
    for n in range(1, 4):
        gate = Gate()
        took = send(gate)
        # the worker ran upstream's loop up to the chunk's wait_event before the sender's send returned: without
        # the hand-off the chunk is still queued here, the worker not yet run (the scheduler thread holds the GIL)
        assert gate.reached.is_set() and not queue._buf, "send returned before the worker took the chunk"
        assert took < BOUND / 2, f"the hand-off took {took:.3f}s"
        # each wait ended by the worker (the worker may also have run before the hook looked: no wait then)
        assert handoff.handed == handoff.waits >= 1 and handoff.late == 0
        release(mgr, gate)
        wait_parked(mgr, queue)  # it skipped the chunk of the failed room
        mgr.request_status[ROOM] = KVPoll.WaitingForInput


def test_a_busy_worker_is_not_waited_for(prefill):
    mgr, queue, send = prefill(str(BOUND))
    handoff = worker_handoff.handoff_of(mgr)
    wait_parked(mgr, queue)
    first, second = Gate(), Gate()
    send(first)
    assert first.reached.is_set()  # the worker is inside the first chunk
    took = send(second)  # the worker is busy: the scheduler goes on at once, the chunk waits in the queue
    assert took < BOUND / 2, f"a put to a busy worker waited {took:.3f}s"
    assert len(queue._buf) == 1 and not second.reached.is_set()
    assert handoff.handed == handoff.waits <= 1 and handoff.late == 0
    release(mgr, first)  # the worker skips both chunks (the room failed) and parks again
    second.open.set()
    wait_parked(mgr, queue)
    assert not queue._buf


def test_a_worker_that_does_not_come_is_waited_for_at_most_the_knob():
    """A parked worker that does not take its chunk within the bound (no core for it): the scheduler goes on after
    the knob's time and the chunk stays queued for the worker."""
    handoff = worker_handoff.HandOff(0.2)
    queue = FastQueue()
    watched = handoff.watch(queue)
    watched.parked = True  # as `get` leaves it while the worker waits; no worker thread takes the chunk
    queue.put("chunk")
    t0 = time.monotonic()
    handoff.after_put()
    took = time.monotonic() - t0
    assert 0.19 <= took < 2.0, f"the wait took {took:.3f}s, the bound is 0.2s"
    assert (handoff.waits, handoff.handed, handoff.late) == (1, 0, 1) and list(queue._buf) == ["chunk"]


def test_a_knob_of_zero_keeps_upstreams_handoff(prefill):
    mgr, queue, send = prefill("0")
    handoff = worker_handoff.handoff_of(mgr)
    assert handoff.bound == 0 and handoff.queues == {}  # the worker got upstream's own queue
    gate = Gate()
    took = send(gate)
    assert took < BOUND / 2 and handoff.waits == 0
    deadline = time.monotonic() + 10
    while not gate.reached.is_set() and time.monotonic() < deadline:
        time.sleep(0.005)  # the worker takes it once this thread lets go of the GIL, as upstream's does
    assert gate.reached.is_set()
    release(mgr, gate)
