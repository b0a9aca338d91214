"""The test-hosts helper (testing/hosts.py) without servers: hosts reach each other and this process; a cut is
silent (a connect times out, nothing refused) between the two cut hosts only; heal forwards again; a shaped
link goes at its rate; everything made is removed, also when the owner fails or died earlier."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import pytest

from testing import hosts as hosts_mod
from testing.hosts import HostsError, TestHosts, netns_list

pytestmark = [pytest.mark.pair, pytest.mark.skipif(hosts_mod.unavailable() is not None, reason=str(hosts_mod.unavailable()))]

# A listener on a host: sends n bytes to each connection (a thread each), closes.
SERVE = """
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 9000)); s.listen(8)
print("ready", flush=True)
def send(c):
    with c:
        try:
            c.sendall(b"x" * int(sys.argv[2]))
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            return  # the client gave up on a stalled link
while True:
    threading.Thread(target=send, args=(s.accept()[0],), daemon=True).start()
"""
# A client on a host (or here): connect with a 1 s timeout, read everything; prints the outcome and seconds.
CONNECT = """
import socket, sys, time
t = time.monotonic()
try:
    with socket.create_connection((sys.argv[1], 9000), timeout=float(sys.argv[2])) as s:
        n = 0
        while (chunk := s.recv(1 << 20)):
            n += len(chunk)
    print("ok", n, time.monotonic() - t)
except Exception as e:
    print(type(e).__name__, 0, time.monotonic() - t)
"""


def _ours() -> "list[str]":
    return [n for n in netns_list() if n.startswith(f"{hosts_mod.PREFIX}-{os.getpid()}-")]


def _links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def _connect(h: TestHosts, src: str, dst: str, timeout: float = 1.0) -> "tuple[str, int, float]":
    argv = [sys.executable, "-c", CONNECT, h[dst].address, str(timeout)]
    if src != "client":
        argv = h[src].exec_argv(argv)
    kind, n, seconds = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout.split()
    return kind, int(n), float(seconds)


@pytest.fixture
def served():
    """Hosts with a listener on prefill sending `size` bytes per connection."""
    size = 4 << 20
    with TestHosts() as h:
        server = subprocess.Popen(h["prefill"].exec_argv([sys.executable, "-c", SERVE, h["prefill"].address,
                                                          str(size)]), stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready"
            yield h, size
        finally:
            server.kill()
            server.wait(10)


def test_cut_is_silent_between_the_two_hosts_only_and_heals(served):
    h, size = served
    for src in ("client", "decode", "gateway"):
        assert _connect(h, src, "prefill")[:2] == ("ok", size), src
    h.cut("prefill", "decode")
    kind, _, seconds = _connect(h, "decode", "prefill")
    assert kind == "TimeoutError" and seconds >= 0.9, (kind, seconds)  # not refused, not unreachable
    assert _connect(h, "client", "prefill")[:2] == ("ok", size)
    assert _connect(h, "gateway", "prefill")[:2] == ("ok", size)
    with pytest.raises(HostsError):
        h.cut("gateway", "prefill")  # one cut at a time
    h.heal()
    assert _connect(h, "decode", "prefill")[:2] == ("ok", size)


def test_shaped_link_goes_at_its_rate(served):
    h, size = served
    rate = 40_000_000  # bit/s: 4 MiB in ~0.84 s
    h.shape("decode", rate, src="prefill")
    try:
        kind, n, seconds = _connect(h, "decode", "prefill", timeout=30)
        assert (kind, n) == ("ok", size)
        expected = size * 8 / rate
        assert 0.7 * expected <= seconds <= expected + 3.0, (seconds, expected)
    finally:
        h.unshape("decode")
    with pytest.raises(HostsError):
        h.shape("decode", rate, burst_bytes=64 * 1024)  # would drop, not shape


def test_link_that_drops_full_size_packets_stalls_bulk_transfers_only_from_src(served):
    h, size = served
    h.shape("decode", 40_000_000, burst_bytes=1000, drop_large=True, src="prefill")
    try:
        kind, n, seconds = _connect(h, "decode", "prefill", timeout=3)
        assert kind == "TimeoutError" and n == 0, (kind, n, seconds)  # connected, then nothing of bulk arrives
        assert _connect(h, "gateway", "prefill")[:2] == ("ok", size)  # other links untouched
        h.shape("decode", 40_000_000, src="prefill")  # replaces it: shaped, not stalled
        assert _connect(h, "decode", "prefill", timeout=30)[:2] == ("ok", size)
    finally:
        h.unshape("decode")


def test_everything_is_removed_also_on_failure():
    before = _links()
    with pytest.raises(RuntimeError):
        with TestHosts(("a", "b")) as h:
            assert len(_ours()) == 3
            port = h._client_if
            assert port in _links()
            raise RuntimeError("a test failed")
    assert _ours() == []
    assert port not in _links()
    assert _links().count(hosts_mod.PREFIX) == before.count(hosts_mod.PREFIX)


def test_leftovers_of_a_dead_run_are_removed_not_a_live_one():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{hosts_mod.PREFIX}-{dead.pid}-000000-switch"
    live = f"{hosts_mod.PREFIX}-{os.getpid()}-000000-switch"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert hosts_mod.clean_leftovers() == [stale]
        assert stale not in netns_list() and live in netns_list()
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_finalizer_removes_what_an_abandoned_helper_made():
    h = TestHosts(("a",))
    names = list(h._namespaces)
    del h
    deadline = time.monotonic() + 10
    while any(n in netns_list() for n in names) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    assert not any(n in netns_list() for n in names)
