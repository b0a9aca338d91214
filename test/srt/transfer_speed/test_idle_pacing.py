"""A PD scheduler's idle passes are paced (disaggregation/fork_transfer/idle_pacing.py): after a loop pass that ran no
batch, a prefill or decode scheduler waits up to SGLANG_FORK_PD_IDLE_PACE (default 1 ms) instead of polling again at
once; on the rank that reads requests the wait is on its request sockets and a request ends it; a plain server, a
pace of 0 and a pass upstream's idle sleeper already waited in are never paced; a pass that ran a batch never reaches
it. Through the real hook path: upstream's `Scheduler.on_idle` as the fork's plugin wrapped it, on the queue harness's
scheduler over upstream's real PD queues (stubs only for what upstream's idle pass reports to metrics and sockets)."""

from __future__ import annotations

import ast
import contextlib
import inspect
import threading
import time
from types import MethodType, SimpleNamespace

import pytest
import zmq

from sglang.srt.disaggregation import decode as upstream_decode
from sglang.srt.disaggregation import prefill as upstream_prefill
from sglang.srt.disaggregation.fork_transfer import idle_pacing
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers import scheduler as upstream_scheduler
from sglang.srt.managers.fork_core import fork_plugin
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_components.idle_sleeper import IdleSleeper
from sglang.srt.observability.scheduler_stage_metrics import SchedulerStageMetricsRecorder
from testing.knob_bounds import widen
from testing.queue_harness import DecodeHarness, PrefillHarness

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def measurable_waits(monkeypatch):
    """Paces of seconds, past the operator's 0.1 s bound, so a wait is told apart from none on a loaded machine."""
    widen(monkeypatch, "PD_IDLE_PACE", 10.0)

KNOB = "SGLANG_FORK_PD_IDLE_PACE"
TARGET = "sglang.srt.managers.scheduler.Scheduler.on_idle"
PACE = 0.3  # long enough to tell a paced pass from an unpaced one on a loaded machine


def _noop(*args, **kwargs):
    return None


def idle_ready(h, sockets=(None, None), idle_sleeper=None):
    """The harness's scheduler, given what upstream's `on_idle` reads beyond the PD queues (its metrics, load
    publishing and leak checks: nothing to do here) and its request sockets (None: a rank that reads no requests)."""
    s = h.scheduler
    s.running_batch.is_empty = lambda: not s.running_batch.reqs
    s.metrics_reporter.__dict__.update(record_scheduler_active=_noop, record_scheduler_idle=_noop,
                                       _maybe_log_idle_metrics=_noop)
    s.ipc_channels.recv_from_tokenizer, s.ipc_channels.recv_from_rpc = sockets
    s.__dict__.update(
        is_fully_idle=MethodType(Scheduler.is_fully_idle, s),
        _pp_microbatches_drained=MethodType(Scheduler._pp_microbatches_drained, s),
        maybe_sleep_on_idle=MethodType(Scheduler.maybe_sleep_on_idle, s),
        idle_sleeper=idle_sleeper,
        dp_attn_adapter=SimpleNamespace(drop_sync_wait_carry=_noop),
        dllm_manager=SimpleNamespace(any_staging_reqs=lambda: False),
        grammar_manager=SimpleNamespace(grammar_queue=[], abort_requests=_noop),
        enable_hierarchical_cache=False, enable_lmcache=False, enable_hicache_storage=False,
        enable_unified_memory=False, _last_stall_publish_ts=float("-inf"),
        publish_load_snapshot=_noop,
        load_publisher=SimpleNamespace(publish_load_stat=_noop),
        load_inquirer=SimpleNamespace(get_loads=_noop),
        scheduler_stage_metrics=SchedulerStageMetricsRecorder(enabled=False),
        invariant_checker=SimpleNamespace(_check_all_pools=lambda stats: (False, []), _check_req_pool=_noop,
                                          _check_tree_cache=_noop, _report_leak=_noop),
        pool_stats_observer=SimpleNamespace(get_pool_stats=_noop),
        kv_events_publisher=SimpleNamespace(publish_kv_events=_noop),
        new_token_ratio_tracker=SimpleNamespace(reset=_noop),
    )
    return s


def idle_pass(h) -> float:
    """One idle pass through the hooked `Scheduler.on_idle`; its wall time."""
    with h.active():
        t0 = time.monotonic()
        Scheduler.on_idle(h.scheduler)
        return time.monotonic() - t0


@contextlib.contextmanager
def woken_by(method: str, hook: str, harness, sockets, monkeypatch):
    """A harness (on the rank that reads requests) whose scheduler's paced wait, 2 s, the fork's AFTER hook `hook` on
    CommonKVManager.`method` is to end; yields (harness, scheduler, a pending request's room)."""
    target = f"sglang.srt.disaggregation.common.conn.CommonKVManager.{method}"
    assert (target, f"sglang.srt.disaggregation.fork_transfer.idle_pacing:{hook}", "AFTER") in fork_plugin.HOOKS
    pull, rpc, _push = sockets
    monkeypatch.setenv(KNOB, "2")
    with harness() as h:
        s = idle_ready(h, sockets=(pull, rpc))
        room = pending(h).bootstrap_room
        assert fork_plugin.hooks_applied()[target]
        yield h, s, room


def idle_pass_during(h, timer: threading.Timer) -> float:
    """One idle pass while `timer` (an event due during the wait) runs: started before, joined after; its wall time."""
    timer.start()
    try:
        return idle_pass(h)
    finally:
        timer.join()


def pending(h):
    """A request in the role's first PD queue: the server is not fully idle (a transfer to wait for)."""
    return h.add(h.make_req())


@pytest.fixture
def sockets():
    """A request socket pair as the tokenizer and the scheduler have it (PUSH -> PULL), and an RPC socket."""
    ctx = zmq.Context()
    pull, rpc, push = ctx.socket(zmq.PULL), ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH)
    pull.bind("inproc://idle-pacing-requests")
    rpc.bind("inproc://idle-pacing-rpc")
    push.connect("inproc://idle-pacing-requests")
    yield pull, rpc, push
    for sock in (pull, rpc, push):
        sock.close(linger=0)
    ctx.term()


def test_the_pacer_is_the_forks_one_hook_on_on_idle_and_applied():
    assert [(t, ref, kind) for t, ref, kind in fork_plugin.HOOKS if t == TARGET] == [
        (TARGET, "sglang.srt.disaggregation.fork_transfer.idle_pacing:paced_on_idle", "AROUND")]
    with PrefillHarness():  # loads the plugins as a scheduler process does
        assert fork_plugin.hooks_applied()[TARGET]


@pytest.mark.parametrize("harness", [PrefillHarness, DecodeHarness], ids=["prefill", "decode"])
def test_an_idle_pass_of_a_pd_server_waits_the_pace(monkeypatch, harness):
    monkeypatch.setenv(KNOB, str(PACE))
    with harness() as h:
        s = idle_ready(h)  # no request sockets: a rank other than the one reading requests
        pending(h)
        took = idle_pass(h)
        pacer = idle_pacing.pacer_of(s)
        assert (pacer.mode, pacer.pace, pacer.paced) == (idle_pacing.Mode.SLEEP, PACE, 1)
        assert took >= PACE * 0.95, f"paced pass took {took:.3f}s < {PACE}s"
        idle_pass(h)
        assert pacer.paced == 2  # once per pass


def test_on_the_rank_that_reads_requests_a_request_ends_the_wait(monkeypatch, sockets):
    pull, rpc, push = sockets
    monkeypatch.setenv(KNOB, "2")
    with PrefillHarness() as h:
        s = idle_ready(h, sockets=(pull, rpc))
        pending(h)
        sender = threading.Timer(0.1, lambda: push.send(b"req"))
        took = idle_pass_during(h, sender)
        pacer = idle_pacing.pacer_of(s)
        assert (pacer.mode, pacer.paced) == (idle_pacing.Mode.POLL, 1)
        # 0.1 s until the request, then the poll returns at once: far below the 2 s pace even on a loaded machine
        assert took < 1.0, f"the wait lasted {took:.3f}s after a request arrived at 0.1s"
        assert pull.recv(zmq.NOBLOCK) == b"req"  # left for upstream's receiver, not consumed
    monkeypatch.setenv(KNOB, str(PACE))
    with PrefillHarness() as h:  # no request: the whole pace
        idle_ready(h, sockets=(pull, rpc))
        pending(h)
        took = idle_pass(h)
        assert idle_pacing.pacer_of(h.scheduler).mode is idle_pacing.Mode.POLL
        assert took >= PACE * 0.95, f"paced pass took {took:.3f}s < {PACE}s"


@pytest.mark.parametrize("harness", [PrefillHarness, DecodeHarness], ids=["prefill", "decode"])
def test_a_pace_of_zero_turns_pacing_off(monkeypatch, harness):
    monkeypatch.setenv(KNOB, "0")
    with harness() as h:
        s = idle_ready(h)
        pending(h)
        idle_pass(h)
        pacer = idle_pacing.pacer_of(s)
        assert (pacer.mode, pacer.paced) == (idle_pacing.Mode.OFF, 0)


def test_a_plain_server_is_never_paced(monkeypatch):
    monkeypatch.setenv(KNOB, "5")  # a pass that waited would take 5 s
    with PrefillHarness() as h:
        s = idle_ready(h)
        s.disaggregation_mode = DisaggregationMode.NULL
        s.waiting_queue.append(h.make_req())  # not fully idle, as a PD server waiting on a transfer would be
        took = idle_pass(h)
        pacer = idle_pacing.pacer_of(s)
        assert (pacer.mode, pacer.paced) == (idle_pacing.Mode.OFF, 0)
        assert took < 2.5, f"plain server's idle pass took {took:.3f}s"


@pytest.mark.parametrize("harness", [PrefillHarness, DecodeHarness], ids=["prefill", "decode"])
def test_a_fully_idle_pass_is_paced_unless_upstreams_idle_sleeper_waited(monkeypatch, sockets, harness):
    pull, rpc, push = sockets
    monkeypatch.setenv(KNOB, str(PACE))
    with harness() as h:  # --sleep-on-idle: upstream's sleeper waits on the same sockets; the fork adds nothing
        s = idle_ready(h, sockets=(pull, rpc), idle_sleeper=IdleSleeper([pull, rpc]))
        push.send(b"req")  # upstream's sleeper returns at once (it would wait up to 1 s otherwise)
        with h.active():
            assert s.is_fully_idle()
        idle_pass(h)
        assert idle_pacing.pacer_of(s).paced == 0
        pending(h)  # not fully idle: upstream's sleeper does not run, the fork paces
        idle_pass(h)
        assert idle_pacing.pacer_of(s).paced == 1
    with harness() as h:  # no idle sleeper (upstream spins when fully idle): paced
        s = idle_ready(h)
        took = idle_pass(h)
        assert idle_pacing.pacer_of(s).paced == 1 and took >= PACE * 0.95


def _on_idle_calls(module):
    """Each `self.on_idle()` in upstream's module, with the If nodes around it (innermost first) and the branch."""
    tree = ast.parse(inspect.getsource(module))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "on_idle"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
            stmt = parents[node]
            branch = parents[stmt]
            while not isinstance(branch, ast.If):
                stmt, branch = branch, parents[branch]
            yield node.lineno, branch, "orelse" if stmt in branch.orelse else "body"


@pytest.mark.parametrize("module", [upstream_scheduler, upstream_prefill, upstream_decode],
                         ids=["scheduler", "prefill", "decode"])
def test_upstreams_loops_call_on_idle_only_when_the_pass_ran_no_batch(module):
    """What keeps a pass that ran a batch from ever being paced: upstream's event loops call on_idle only under
    `if batch: ... else:` or `elif batch is None:`. An upstream release that changes that fails here."""
    calls = list(_on_idle_calls(module))
    assert calls, f"no on_idle call in {module.__name__}"
    for line, branch, where in calls:
        test = ast.unparse(branch.test)
        assert (test, where) in {("batch", "orelse"), ("batch is None", "body")}, (
            f"{module.__name__}:{line}: on_idle under `if {test}:` ({where})")


def test_on_prefill_a_concluded_transfer_ends_the_wait(monkeypatch, sockets):
    """Prefill's transfer worker, once it concluded a room (chunk_failures.conclude_transfer calls
    `wake_scheduler` on its kv manager), ends the scheduler's paced wait at once: the pass that follows sees the
    room's status without waiting out the pace. The wake is cleared by that wait: the next one lasts the whole pace."""
    pull, rpc, push = sockets
    monkeypatch.setenv(KNOB, "2")
    with PrefillHarness() as h:
        s = idle_ready(h, sockets=(pull, rpc))
        pending(h)
        mgr = s.disagg_prefill_bootstrap_queue.kv_manager
        concluded = threading.Timer(0.1, idle_pacing.wake_scheduler, args=(mgr,))
        took = idle_pass_during(h, concluded)
        pacer = idle_pacing.pacer_of(s)
        assert pacer.mode is idle_pacing.Mode.POLL and vars(mgr)[idle_pacing.WAKE_ATTR] is pacer.wake
        # 0.1 s until the wake, then the poll returns at once: far below the 2 s pace even on a loaded machine
        assert took < 1.0, f"the wait lasted {took:.3f}s after the transfer concluded at 0.1s"
        pacer.pace, pacer._poll_ms = PACE, int(PACE * 1000)  # the next wait: no wake pending, the whole pace
        took = idle_pass(h)
        assert took >= PACE * 0.95, f"a pass after the wake was read took {took:.3f}s < {PACE}s"
        idle_pacing.wake_scheduler(mgr)  # concluded while no wait ran: the next wait ends at once
        took = idle_pass(h)
        assert took < PACE * 0.5, f"a wake set before the wait did not end it ({took:.3f}s)"


def test_on_decode_a_status_from_prefill_ends_the_wait(monkeypatch, sockets):
    """Decode's status thread, once it applied prefill's Failed or Success for a room (upstream's
    `CommonKVManager.apply_prefill_status`, with the fork's AFTER hook), ends decode's scheduler's paced wait at once:
    it takes the transferred request (or its failure) without waiting out the pace. Another status does not."""
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    with woken_by("apply_prefill_status", "after_apply_prefill_status", DecodeHarness, sockets, monkeypatch) as (
            h, s, room):
        mgr = s.disagg_decode_prealloc_queue.kv_manager
        mgr.request_status[room] = KVPoll.WaitingForInput  # a room whose transfer runs

        def status(value):
            return threading.Timer(0.1, CommonKVManager.apply_prefill_status, args=(mgr,), kwargs=dict(
                bootstrap_room=room, status=value, prefill_rank=0, failure_reason="prefill failed the room"))

        applied = status(KVPoll.Failed)
        took = idle_pass_during(h, applied)
        pacer = idle_pacing.pacer_of(s)
        assert pacer.mode is idle_pacing.Mode.POLL and vars(mgr)[idle_pacing.WAKE_ATTR] is pacer.wake
        assert mgr.request_status[room] == KVPoll.Failed  # upstream applied it
        # 0.1 s until the status, then the poll returns at once: far below the 2 s pace even on a loaded machine
        assert took < 1.0, f"the wait lasted {took:.3f}s after prefill's status was applied at 0.1s"
        pacer.pace, pacer._poll_ms = PACE, int(PACE * 1000)
        applied = status(KVPoll.Bootstrapping)  # not an end: upstream ignores it, the wait lasts the whole pace
        took = idle_pass_during(h, applied)
        assert took >= PACE * 0.95, f"a status that is no end ended the wait ({took:.3f}s)"


def test_on_prefill_decodes_handshake_ends_the_wait(monkeypatch, sockets):
    """Prefill's bootstrap thread, once decode's handshake for a room arrived (upstream's mooncake bootstrap thread
    calls `CommonKVManager.update_status(room, WaitingForInput)`, with the fork's AFTER hook), ends prefill's
    scheduler's paced wait at once: a lone request's prefill starts without waiting out the pace (before, it waited up
    to one pace: ~0.5 ms of a lone request's time to first token at the default 1 ms, bench/README.md "The lone
    request"). The scheduler thread's own WaitingForInput (decode's receiver init, a dummy CP rank) sets no wake, and
    another status (Transferring) none either: the next wait lasts the whole pace. Upstream spins instead (no wait)."""
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    with woken_by("update_status", "after_update_status", PrefillHarness, sockets, monkeypatch) as (h, s, room):
        mgr = s.disagg_prefill_bootstrap_queue.kv_manager
        assert mgr.request_status[room] == KVPoll.Bootstrapping  # waiting for decode's handshake

        def from_bootstrap_thread(value):
            return threading.Timer(0.1, CommonKVManager.update_status, args=(mgr, room, value))

        took = idle_pass_during(h, from_bootstrap_thread(KVPoll.WaitingForInput))
        pacer = idle_pacing.pacer_of(s)
        assert pacer.mode is idle_pacing.Mode.POLL and vars(mgr)[idle_pacing.WAKE_ATTR] is pacer.wake
        assert mgr.request_status[room] == KVPoll.WaitingForInput  # upstream applied it
        # 0.1 s until the handshake, then the poll returns at once: far below the 2 s pace even on a loaded machine
        assert took < 1.0, f"the wait lasted {took:.3f}s after decode's handshake arrived at 0.1s"
        pacer.pace, pacer._poll_ms = PACE, int(PACE * 1000)
        took = idle_pass_during(h, from_bootstrap_thread(KVPoll.Transferring))  # no handshake: the whole pace
        assert took >= PACE * 0.95, f"a status that is no handshake ended the wait ({took:.3f}s)"
        other = pending(h).bootstrap_room
        CommonKVManager.update_status(mgr, other, KVPoll.WaitingForInput)  # on the scheduler thread itself
        took = idle_pass(h)
        assert took >= PACE * 0.95, f"the scheduler thread's own WaitingForInput woke it ({took:.3f}s)"


def test_the_ranks_that_read_no_requests_wait_on_no_wake(monkeypatch):
    monkeypatch.setenv(KNOB, str(PACE))
    for harness, queue in ((PrefillHarness, "disagg_prefill_bootstrap_queue"),
                           (DecodeHarness, "disagg_decode_prealloc_queue")):
        with harness() as h:
            s = idle_ready(h)  # a rank that reads no requests sleeps: no poller to wake
            pending(h)
            idle_pass(h)
            assert idle_pacing.pacer_of(s).wake is None
            assert idle_pacing.WAKE_ATTR not in vars(getattr(s, queue).kv_manager)
