"""A prefill and a decode process joined by real mooncake over TCP on 127.0.0.1.

Each child runs the queue harness (`testing/queue_harness.py`) with the mooncake
backend: upstream's `MooncakeKVManager` over CPU KV pools, the prefill side with its
bootstrap server. The parent holds no sglang state; it scripts both children step by
step over a pipe, so a test reads like a timeline:

    with MooncakePair() as pair:
        room = pair.submit(prompt_len=12)
        pair.run_until(lambda: pair.decode.call("transferred", room)
                       and pair.prefill.call("status", room) == 200, timeout=60)
        assert pair.decode.call("kv_bytes", room) == pair.prefill.call("kv_sent", room)
        assert pair.prefill.call("room_entries", room) == []

Commands are the methods of `_Worker`; add one there to expose more of a side.
`pair.decode.kill()` crashes a side (SIGKILL); `pair.restart(role)` starts a new process
for it (prefill on the same bootstrap port).

Only the scheduler is a stand-in; queues, manager, engine and bootstrap are upstream's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable, Dict, Optional

from testing.ports import free_port

# Mooncake needs none of MOONCAKE_PROTOCOL, MC_FORCE_TCP or SGLANG_HOST_IP: without an
# RDMA device it serves TCP by itself, and the host IP is detected. (Its engine.so does
# need libibverbs1 installed.) One thing in stock 0.5.23 needs help on a CPU:
CHILD_ENV = {
    # The prefill send path pins memory and records a torch.cuda.Event unless every
    # CP rank transfers (disaggregation/prefill.py, _send_kv_chunk); with CP=1 this
    # only selects the plain CPU index path. Redundant once the fork's CPU send-path
    # patch is in the build; harmless with it.
    "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1",
}


class _Worker:
    """Runs in the child: one side's harness and the commands the parent may send."""

    def __init__(self, role: str, bootstrap_port: int, http_port: int, sizes: Dict[str, Any]):
        sizes = dict(sizes)
        state_component = sizes.pop("state_component", False)
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            init_mooncake_transfer_engine,
        )

        from testing.queue_harness import DecodeHarness, PrefillHarness

        self.role = role
        self.bootstrap_port = bootstrap_port
        init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
        self.bootstrap_server = None
        if role == "prefill":
            from sglang.srt.disaggregation.mooncake import MooncakeKVBootstrapServer

            self.bootstrap_server = MooncakeKVBootstrapServer(host="127.0.0.1", port=bootstrap_port)
        cls = PrefillHarness if role == "prefill" else DecodeHarness
        sizes = dict(sizes)
        extra_args = sizes.pop("server_args", {})
        self.h = cls(
            transfer_backend="mooncake",
            process_wide=True,
            server_args=dict(
                host="127.0.0.1", port=http_port, disaggregation_bootstrap_port=bootstrap_port,
                **extra_args,
            ),
            **sizes,
        )
        self.reqs: Dict[int, Any] = {}
        self.sent_chunks: Dict[int, int] = {}
        if role == "prefill":
            self._count_sends()
        if state_component:
            self._add_state_component()

    def _count_sends(self) -> None:
        """Count the chunks the sender hands to the manager, per room (`sends`)."""
        mgr = self.h.kv_manager
        original = mgr.add_transfer_request

        def counted(bootstrap_room, *args, **kwargs):
            self.sent_chunks[bootstrap_room] = self.sent_chunks.get(bootstrap_room, 0) + 1
            return original(bootstrap_room, *args, **kwargs)

        mgr.add_transfer_request = counted

    def _add_state_component(self) -> None:
        """Give both managers an extra-state component, so the last chunk of every
        request also goes through the transfer worker's state path
        (`maybe_send_extra` -> `_send_kvcache_generic`), as a hybrid model's does.
        The component is page-indexed (BLOCK_SCALE, whose payload is the request's
        KV pages on both sides) and aliases the K pool: its rows are already
        registered with the engine and the write lands the bytes the KV write did,
        so any misplaced state write shows up in `kv_bytes`. Added before the first
        request: decode publishes it in its registration, prefill reads it per send."""
        from sglang.srt.disaggregation.base.conn import StateType
        from sglang.srt.disaggregation.utils import append_state_component

        pool = self.h.kv_pool
        layers = range(pool.layer_num)
        append_state_component(
            self.h.kv_manager.kv_args,
            StateType.BLOCK_SCALE,
            [pool.k_buffer[i].data_ptr() for i in layers],
            [pool.k_buffer[i].nbytes for i in layers],
            [pool.k_buffer[i][0].nbytes for i in layers],
        )

    # -- commands --
    def add(self, room: int, prompt_len: int, rid: Optional[str] = None) -> str:
        req = self.h.make_req(
            rid=rid or f"room-{room}", room=room, prompt_len=prompt_len, bootstrap_host="127.0.0.1"
        )
        self.reqs[room] = req
        self.h.add(req)
        return req.rid

    def add_fake_host(self, room: int, prompt_len: int) -> str:
        """Prefill: the room's request naming upstream's fake bootstrap host, as the server's warmup request does:
        upstream gives it its own fake sender, paired with this side's real kv manager (no decode involved)."""
        from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
        from testing.harness_backend import upstream_fake_sender

        req = self.h.make_req(rid=f"room-{room}", room=room, prompt_len=prompt_len, bootstrap_host=FAKE_BOOTSTRAP_HOST)
        self.reqs[room] = req
        with upstream_fake_sender():
            self.h.add(req)
        return req.rid

    def tick(self, n: int = 1) -> None:
        if getattr(self.h.scheduler, "_engine_paused", False):
            # what a paused event loop runs instead of scheduling (the fork's hook)
            from sglang.srt.managers.fork_pause import scheduler_pause

            with self.h.active():
                scheduler_pause.paused_loop_tick(None, self.h.scheduler)
            return
        self.h.tick(n)

    def abort(self, room: int) -> None:
        """A client abort of the room's request (the real Scheduler.abort_request)."""
        self.h.abort(self.reqs[room].rid)

    def fail_rebootstrap(self, room: int, reason: str) -> Optional[str]:
        """Decode: upstream's failure path of a retract's re-send to prefill (`_fail_prefill_recompute`) for the
        room's receiver; returns the failure record a scheduler poll would read the moment the room turns Failed."""
        from sglang.srt.disaggregation.base import KVPoll

        mgr = self.h.kv_manager
        (entry,) = [d for d in self.h.transfer_queue.queue if d.req.bootstrap_room == room]
        seen = []

        def update_status(bootstrap_room, status, *args, **kwargs):  # the hooked class method, observed
            if bootstrap_room == room and status == KVPoll.Failed:
                seen.append(mgr.failure_records.get(room))
            return type(mgr).update_status(mgr, bootstrap_room, status, *args, **kwargs)

        mgr.update_status = update_status
        try:
            mgr._fail_prefill_recompute(entry.kv_receiver, reason)
        finally:
            del mgr.update_status
        return seen[0] if seen else None

    def set_paused(self, paused: bool) -> None:
        """Stand for a paused (or running again) event loop: while paused `tick` runs
        only what a paused loop runs; aborts take the fork's abort-while-paused path."""
        self.h.scheduler._engine_paused = paused

    def end_queued(self, message: str) -> None:
        """What a release during a pause does with the PD queues (scheduler_pause): abort
        everything queued and drain it through upstream's retire paths."""
        from sglang.srt.managers.fork_pause import scheduler_pause

        with self.h.active():
            scheduler_pause.pause_of(self.h.scheduler).abort_all_and_drain(message)

    def end_room(self, room: int, reason: str, cause: Optional[str] = None, message: Optional[str] = None) -> None:
        """End the room through the ledger (`RoomLedger.make`: fail_and_tell), its failure `reason` told to
        the peer with the cause named `cause` (a verdict_rows.Cause name, and its `message`), or without one (as a
        peer of an older build or stock upstream tells it)."""
        from sglang.srt.disaggregation.fork_ending import room_ledger, verdict, verdict_rows

        told = None if cause is None else verdict_rows.Told(verdict_rows.Cause[cause], message)
        with self.h.active():
            room_ledger.end_room(self.h.kv_manager, room_ledger.Transition.FAIL_AND_TELL, room, reason, told=told)

    def disown(self, room: int, failed: bool) -> None:
        """What clearing a sender of the room tells the ledger (`RoomLedger.disown`; no sender owns it here): a failed
        room is remembered as ended here."""
        from sglang.srt.disaggregation.fork_ending import room_ledger

        room_ledger.ledger_for(self.h.kv_manager).disown(room, None, failed)

    def hold_unowned_drops(self) -> None:
        """Prefill: the bootstrap thread's drop of a room no sender owns (room_ledger.drop_unowned_room, after an
        ABORT it kept as a cancellation) waits, once reached, until `release_unowned_drops`: a test puts the
        scheduler's sender creation for that room in between (the interleaving the ledger must survive)."""
        import threading

        from sglang.srt.disaggregation.fork_ending import room_ledger

        real = self._real_drop = room_ledger.drop_unowned_room
        reached, go = self._drop_reached, self._drop_go = threading.Event(), threading.Event()

        def gated(mgr, room):  # the real drop, later
            reached.set()
            go.wait(60)
            return real(mgr, room)

        room_ledger.drop_unowned_room = gated

    def unowned_drop_reached(self) -> bool:
        return self._drop_reached.is_set()

    def release_unowned_drops(self) -> None:
        from sglang.srt.disaggregation.fork_ending import room_ledger

        room_ledger.drop_unowned_room = self._real_drop
        self._drop_go.set()

    def cancelled_rooms(self) -> Optional[int]:
        """Peer cancellations this side remembers (disaggregation.fork_ending.room_ledger)."""
        from sglang.srt.disaggregation.fork_ending import room_reads

        return room_reads.report(self.h.kv_manager)

    def late_answer(self, room: int) -> Optional[str]:
        """The reason this side answers a late handshake for `room` with (the room
        ledger's memory of ended rooms), or None."""
        from sglang.srt.disaggregation.fork_ending import room_ledger

        answer = room_ledger.ledger_of(self.h.kv_manager).late(room)
        return None if answer is None else answer[0]

    def attach_wake(self) -> None:
        """Prefill: hang the idle pacer's wake on the kv manager, as the pacer does on the rank that reads requests
        (fork_transfer.idle_pacing.attach_wake); `wakes` counts how often the transfer workers set it."""
        from sglang.srt.disaggregation.fork_transfer import idle_pacing

        self.wake = idle_pacing.attach_wake(self.h.scheduler)
        self.wake_count = 0

    def wakes(self) -> int:
        """How many times the transfer workers and the bootstrap thread set the wake since `attach_wake`."""
        import select

        if select.select([self.wake.fd], [], [], 0)[0]:
            self.wake_count += os.eventfd_read(self.wake.fd)
        return self.wake_count

    def status(self, room: int) -> Optional[int]:
        return self.h.outputs.status_code(self.reqs[room].rid)

    def kv_status(self, room: int) -> Optional[str]:
        """The kv manager's KVPoll name for `room` (None: no such room), as its
        background threads left it; the queue reads it on its next poll."""
        status = self.h.kv_manager.request_status.get(room)
        return None if status is None else _kv_poll_name(status)

    def told(self, room: int) -> Optional[str]:
        """The name of the cause the room's ender told this side (verdict_rows.Cause, the request's record `told`, which
        the verdict read before any text), or None: none came with the room's failure."""
        from sglang.srt.disaggregation.fork_ending import verdict

        told = verdict.peek(self.reqs[room]).told
        return None if told is None else told.cause.name

    def final_reason(self, room: int) -> Optional[dict]:
        """The finished_reason the client got (None while unfinished)."""
        final = self.h.outputs.final(self.reqs[room].rid)
        return None if final is None else final.reason

    def counter(self, name: str) -> int:
        """A scheduler metrics call count (`Counters`), e.g. increment_transfer_failed_reqs."""
        return self.h.counters.counts[name]

    def chunk_failures(self) -> dict:
        """(kind, role) -> count of `sglang:pd_transfer_chunk_failures_total` in this process."""
        from sglang.srt.disaggregation.fork_ending import request_end_cause

        out = {}
        for metric in request_end_cause.counter("chunk_failure", {}).collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    out[(sample.labels["kind"], sample.labels["role"])] = sample.value
        return out

    def session_id(self) -> str:
        return self.h.kv_manager.get_session_id()

    def failed_sessions(self) -> Optional[list]:
        """Prefill's blacklisted sessions; None while a liveness probe is in flight."""
        blacklist = self.h.kv_manager.failed_sessions
        if hasattr(blacklist, "settled") and not blacklist.settled():
            return None
        return sorted(blacklist)

    def nominate_failed_session(self, session_id: str) -> None:
        """What the transfer worker does with a session after a failed write."""
        mgr = self.h.kv_manager
        with mgr.session_lock:
            mgr.session_failures[session_id] += 1
            mgr.failed_sessions.add(session_id)

    def blacklist_session(self, session_id: str, out: bool = True) -> None:
        """Prefill: put a session straight into the blacklist (`out`), as a failed write whose probe got no answer
        would (the peer monitor's way in, no probe), or take it out as upstream's probe loop does once it answers."""
        mgr = self.h.kv_manager
        with mgr.session_lock:
            if out:
                set.add(mgr.failed_sessions, session_id)
            else:
                mgr._unblacklist_session(session_id)

    def transferred(self, room: int) -> bool:
        return self.reqs[room] in self.h.waiting

    def output_ids(self, room: int) -> list:
        return list(self.reqs[room].output_ids)

    def kv_bytes(self, room: int) -> bytes:
        return self.h.kv_bytes(self.reqs[room])

    def kv_sent(self, room: int) -> bytes:
        return self.h.kv_sent[room]

    def finish(self, room: int) -> None:
        self.h.finish(self.reqs[room])

    def room_entries(self, room: int) -> list:
        return self.h.room_entries(room)

    def fork_tables(self) -> dict:
        """The resource report's `fork_tables` for this side's kv manager (every fork table: size, cap, why)."""
        from sglang.srt.managers.fork_report import pd_resource_report

        with self.h.active():
            return pd_resource_report.fork_tables(self.h.kv_manager)

    def snapshot(self) -> dict:
        return self.h.snapshot().held()

    def move_kv_buffers(self, poison_old: bool = False) -> dict:
        """Release this side's PD queue (deregisters its buffers from the transfer
        engine), drop the KV cache as a release does, move the KV buffers to new
        memory, resume (re-registers). Returns the kv_args pointers before and after;
        the old buffers are kept alive and watched, or (`poison_old`) filled with a
        constant, as memory reused by someone else would be, so a read from them shows."""
        import torch

        h = self.h
        with h.active():
            before = list(h.kv_manager.kv_args.kv_data_ptrs)
            h.queue.release_memory_occupation()
            # upstream's release flushes the cache (idle): the KV content is gone
            h.tree_cache.reset()
            h.allocator.clear()
            pool = h.kv_pool
            self._old_kv = pool.k_buffer + pool.v_buffer
            if poison_old:
                for t in self._old_kv:
                    t.fill_(0.5)
            self._old_kv_copy = [t.clone() for t in self._old_kv]
            pool.k_buffer = [torch.zeros_like(t) for t in pool.k_buffer]
            pool.v_buffer = [torch.zeros_like(t) for t in pool.v_buffer]
            h.queue.resume_memory_occupation()
            after = list(h.kv_manager.kv_args.kv_data_ptrs)
        return {
            "before": before,
            "after": after,
            "buffers": [t.data_ptr() for t in pool.k_buffer + pool.v_buffer],
        }

    def old_kv_unchanged(self) -> bool:
        return all(bool((a == b).all()) for a, b in zip(self._old_kv, self._old_kv_copy))

    def sends(self, room: int) -> int:
        """How many KV chunks prefill handed to the transfer engine for the room."""
        return self.sent_chunks.get(room, 0)

    def answers(self, rooms: list) -> dict:
        """Per room of `rooms` this side has: [final answers given, the last one's finish reason (None: none yet),
        transferred (decode: waiting to run; prefill: False)], in one call (the pair model reads every room after
        every step)."""
        waiting = self.h.waiting if self.role == "decode" else ()
        out = {}
        for room in rooms:
            req = self.reqs.get(room)
            if req is None:
                continue
            finals = [s for s in self.h.outputs.of(req.rid) if s.finished]
            out[room] = [len(finals), finals[-1].reason if finals else None, req in waiting]
        return out

    def finals(self, room: int) -> int:
        """How many final answers the room's request got (exactly one when it ended)."""
        return sum(1 for s in self.h.outputs.of(self.reqs[room].rid) if s.finished)

    def end_causes(self) -> dict:
        """`request_end_cause.COUNTS` of this process, keys joined by '/'."""
        from sglang.srt.disaggregation.fork_ending.request_end_cause import COUNTS

        return {"/".join(k): v for k, v in COUNTS.items()}

    def reason(self, room: int) -> Optional[str]:
        final = self.h.outputs.final(self.reqs[room].rid)
        return None if final is None or final.reason is None else final.reason.get("message")

    def peers(self) -> dict:
        """Sizes of the kv manager's per-peer tables (see peer_monitor.peer_tables)."""
        from sglang.srt.disaggregation.fork_peers.peer_monitor import peer_tables

        return peer_tables(self.h.kv_manager)

    def peer_counts(self) -> dict:
        """(kind, role, peer) -> peer losses/recoveries counted in this process."""
        from sglang.srt.disaggregation.fork_peers.peer_monitor import COUNTS

        return {"/".join(k): v for k, v in COUNTS.items()}

    def swaps_applied(self) -> dict:
        """fork_plugin.SWAPS made on this side's kv manager and its transfer engine, each still in place."""
        from sglang.srt.managers.fork_core import fork_touch

        return fork_touch.manager_swaps_applied(self.h.kv_manager, self.role)

    def break_transfer_engine_once(self) -> None:
        """The next mooncake batch transfer raises in the transfer worker's thread (as
        an unexpected error in a send path does), killing upstream's worker loop."""
        mgr = self.h.kv_manager
        original = mgr._transfer_data

        def broken(*args, **kwargs):
            mgr._transfer_data = original
            raise RuntimeError("injected transfer engine error")

        mgr._transfer_data = self._broken = broken

    def transfer_break_armed(self) -> bool:
        """Whether `break_transfer_engine_once` still waits for a transfer to take it."""
        broken = getattr(self, "_broken", None)
        return broken is not None and self.h.kv_manager.__dict__.get("_transfer_data") is broken


# Test-only: "module.Class.attr" renamed to attr + "_renamed" in the child before
# anything is built, as an upstream release that renamed it would leave it.
RENAME_ENV = "FORK_TEST_RENAME_UPSTREAM_ATTR"


def _rename_upstream(target: Optional[str]) -> None:
    if not target:
        return
    import importlib

    path, attr = target.rsplit(".", 1)
    module, cls_name = path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), cls_name)
    setattr(cls, attr + "_renamed", cls.__dict__[attr])
    delattr(cls, attr)


def _kv_poll_name(status: Any) -> str:
    from sglang.srt.disaggregation.base.conn import KVPoll

    names = {getattr(KVPoll, n): n for n in ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")}
    return names[int(status)]


def _serve(
    role: str,
    conn: Connection,
    bootstrap_port: int,
    http_port: int,
    sizes: Dict[str, Any],
    env: Dict[str, str],
) -> None:
    os.environ.update(CHILD_ENV)
    os.environ.update(env)
    try:
        _rename_upstream(os.environ.get(RENAME_ENV))
        worker = _Worker(role, bootstrap_port, http_port, sizes)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        msg = conn.recv()
        if msg is None:
            break
        name, args, kwargs = msg
        try:
            conn.send(("ok", getattr(worker, name)(*args, **kwargs)))
        except BaseException:
            conn.send(("err", traceback.format_exc()))
    worker.h.close()
    if worker.bootstrap_server is not None:
        worker.bootstrap_server.close()
    conn.close()
    # The managers' transfer and heartbeat threads have no stop and would hold the
    # interpreter's exit for seconds; nothing in this process is left to flush.
    os._exit(0)


def _context() -> mp.context.BaseContext:
    """A forkserver that imports sglang once and forks both children from it: half the
    start-up of two concurrent spawns on a small machine. The parent stays import-free."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["testing.queue_harness"])
    return ctx


class Side:
    """The parent's handle on one child: `call(command, *args)` with a bounded wait."""

    def __init__(
        self, role: str, bootstrap_port: int, sizes: Dict[str, Any], env: Optional[Dict[str, str]] = None
    ):
        self.role = role
        ctx = _context()
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve,
            args=(role, child_conn, bootstrap_port, free_port(), sizes, dict(env or {})),
            name=f"mooncake-{role}",
            daemon=True,
        )
        self.proc.start()
        child_conn.close()

    def _reply(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.role} gave no answer in {timeout}s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"{self.role} process died (exit code {self.proc.exitcode})")
        if status == "err":
            raise RuntimeError(f"{self.role} failed:\n{value}")
        return value

    def ready(self, timeout: float) -> None:
        self._reply(timeout)

    def call(self, name: str, *args: Any, timeout: float = 30.0, **kwargs: Any) -> Any:
        self.conn.send((name, args, kwargs))
        return self._reply(timeout)

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL the child (a crash: no teardown, sockets closed by the kernel)."""
        self.proc.kill()
        self.proc.join(timeout)
        self.conn.close()

    def close(self, timeout: float = 10.0) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout)


class MooncakePair:
    """Both children start at once; `__init__` returns when both are built, so the
    prefill's bootstrap server is up before any request makes decode handshake.
    `prefill_env` / `decode_env` are set in that child before anything is built."""

    def __init__(
        self,
        start_timeout: float = 120.0,
        prefill_env: Optional[Dict[str, str]] = None,
        decode_env: Optional[Dict[str, str]] = None,
        **sizes: Any,
    ):
        self.bootstrap_port = free_port()
        self._rooms = iter(range(5000, 1 << 30))
        self._sizes, self._env = sizes, {"prefill": prefill_env, "decode": decode_env}
        self.prefill = Side("prefill", self.bootstrap_port, sizes, prefill_env)
        self.decode = Side("decode", self.bootstrap_port, sizes, decode_env)
        try:
            self.prefill.ready(start_timeout)
            self.decode.ready(start_timeout)
        except BaseException:
            self.close()
            raise

    def restart(self, role: str, timeout: float = 120.0) -> Side:
        """SIGKILL one side and start a new process for it (the prefill on the same
        bootstrap port): a crashed peer coming back with new buffers and session."""
        getattr(self, role).kill()
        side = Side(role, self.bootstrap_port, self._sizes, self._env[role])
        setattr(self, role, side)
        side.ready(timeout)
        return side

    def new_room(self) -> int:
        return next(self._rooms)

    def submit(self, prompt_len: int = 12, rid: Optional[str] = None) -> int:
        """The same request on both sides, as the router would send it."""
        room = self.new_room()
        self.prefill.call("add", room, prompt_len, rid)
        self.decode.call("add", room, prompt_len, rid)
        return room

    def run_until(self, done: Callable[[], bool], timeout: float = 60.0) -> float:
        """Tick both schedulers in turn until `done()`; bounded by `timeout` seconds."""
        start = time.monotonic()
        while not done():
            if time.monotonic() - start > timeout:
                raise TimeoutError(
                    f"not done after {timeout}s: prefill {self.prefill.call('snapshot')}, "
                    f"decode {self.decode.call('snapshot')}"
                )
            self.prefill.call("tick")
            self.decode.call("tick")
        return time.monotonic() - start

    def ticks_until(self, side: "Side", done: Callable[[], bool], max_ticks: int) -> int:
        """Tick `side` alone until `done()`; returns the ticks it took (0: already
        done), failing after `max_ticks` ticks."""
        for ticks in range(max_ticks + 1):
            if done():
                return ticks
            if ticks < max_ticks:
                side.call("tick")
        raise AssertionError(f"{side.role}: not done after {max_ticks} ticks: {side.call('snapshot')}")

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()

    def __enter__(self) -> "MooncakePair":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
