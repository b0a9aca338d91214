"""A decode whose endpoint stops taking connections (its host left: a deleted pod, a blackholed address) is held out
as lost by prefill's monitor -- it may be a partition that heals -- and was never let go: it stayed in every table,
and each tick waited a whole connect timeout for each such decode, one after another. Now a tick probes every peer
at once (it waits for the slowest, not the sum), and a held-out decode silent for SGLANG_FORK_DEPARTED_DECODE_AFTER
is dropped as departed, from every per-peer table.

The monitor is the real one, its ticks driven by the test; the kv manager is a stand-in with upstream's tables (the
monitor only reads and edits them). A silent endpoint is a real loopback listener whose accept queue is full: the
kernel drops further SYNs, so a connect times out exactly as to a host that is gone.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from sglang.srt.disaggregation.fork_peers import peer_monitor as pl
from sglang.srt.disaggregation.fork_peers.lost_handshake import lost_decodes
from sglang.srt.disaggregation.fork_peers.prefill_side_monitor import PrefillSideMonitor

pytestmark = pytest.mark.unit

N_SILENT = 3
DEPARTED_AFTER = 2.0


@contextlib.contextmanager
def silent_endpoints(n: int):
    """n loopback ports where a connect times out (listen backlog 0, taken by one connection never accepted)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            listener = stack.enter_context(socket.socket())
            listener.bind(("127.0.0.1", 0))
            listener.listen(0)
            port = listener.getsockname()[1]
            filler = stack.enter_context(socket.socket())
            filler.connect(("127.0.0.1", port))
            ports.append(port)
        assert pl.probe("127.0.0.1", ports[0], timeout=0.3) == pl.SILENT
        yield ports


def _prefill_manager(ports) -> SimpleNamespace:
    """Upstream's prefill tables, as the monitor reads them: a registered decode session per port."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    mgr = SimpleNamespace(
        session_lock=threading.Lock(), _socket_lock=threading.Lock(),
        decode_kv_args_table={f"127.0.0.1:{17000 + i}": SimpleNamespace(endpoint="127.0.0.1", dst_port=port)
                              for i, port in enumerate(ports)},
        failed_sessions=set(), session_failures={}, failed_session_probes={}, state_layout_rejections={}, state_strides_validated=set(),
        _deferred_ack_poisoned_rooms=set(), _socket_cache={}, _monitor_cache={}, _socket_send_locks={},
        transfer_infos={}, request_status={},
    )
    mgr._unblacklist_session = lambda session: MooncakeKVManager._unblacklist_session(mgr, session)  # upstream's
    return mgr


def _timed_tick(monitor) -> float:
    t0 = time.monotonic()
    monitor.tick()
    return time.monotonic() - t0


def test_silent_held_out_decodes_cost_one_connect_timeout_a_tick_and_depart(monkeypatch):
    monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "2")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "2")
    monkeypatch.setenv("SGLANG_FORK_DEPARTED_DECODE_AFTER", str(DEPARTED_AFTER))
    with silent_endpoints(N_SILENT) as ports:
        mgr = _prefill_manager(ports)
        monitor = PrefillSideMonitor(mgr, {}, metrics=False)  # its thread not started: the test ticks
        mgr.__dict__[pl._MONITOR] = monitor
        sessions = set(mgr.decode_kv_args_table)

        # two silent heartbeats: each decode lost, held out (it may be a partition that heals)
        ticks = [_timed_tick(monitor), _timed_tick(monitor)]
        assert set(monitor.held) == sessions, monitor.held
        assert lost_decodes(monitor) and len(lost_decodes(monitor)) == N_SILENT
        # a tick waits one connect timeout for all of them, not one each (before: N_SILENT x 1 s a tick)
        ticks.append(_timed_tick(monitor))
        print(f"ticks with {N_SILENT} silent decodes: {[round(t, 2) for t in ticks]} s")
        assert max(ticks) < pl.CONNECT_TIMEOUT * 1.8, ticks

        # still silent DEPARTED_AFTER after the loss: departed, dropped from every table at the next tick
        t_lost = time.monotonic() - ticks[-1]
        deadline = t_lost + DEPARTED_AFTER + 2 * pl.CONNECT_TIMEOUT + 2.0
        while monitor.held or lost_decodes(monitor):
            assert time.monotonic() < deadline, (monitor.held, lost_decodes(monitor))
            monitor.tick()
        departed_s = time.monotonic() - t_lost
        print(f"departed {departed_s:.1f}s after the loss (bound {DEPARTED_AFTER:g}s + a tick)")
        assert departed_s >= DEPARTED_AFTER - 0.5  # not before the bound
        assert mgr.decode_kv_args_table == {} and mgr.failed_sessions == set()
        tables = pl.peer_tables(mgr)
        assert tables["monitor_departed_after_s"] == DEPARTED_AFTER
        left = {k: v for k, v in tables.items() if k != "monitor_departed_after_s" and v}
        assert left == {}, tables
        assert not monitor.known and not monitor.silent_since and not monitor.unanswered_at and not monitor.lost_at
