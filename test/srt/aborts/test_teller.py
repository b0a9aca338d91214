"""The teller (fork_ending/teller.py) tells a prefill's bootstrap thread of a room that ended before that side's
scheduler saw it. Its targets are client-chosen (`bootstrap_host`/`bootstrap_port` of a request): a target that
accepts and never answers, trickles its answer, answers without end or with absurd rank counts must cost only its
own tells, within a bound, never a tell to a good prefill, and never unbounded memory or threads.

The good prefill here is a stand-in of its bootstrap server (`/route`, as upstream's answers it) and of its rank's
bootstrap socket (a ZMQ PULL, as upstream's bootstrap thread binds it); the hostile ones are plain TCP servers.
Stock upstream 0.5.23 has no teller (its prefill copy of such a room waits out the bootstrap timeout, 300 s)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import zmq

from sglang.srt.disaggregation.fork_ending import teller as teller_module
from sglang.srt.disaggregation.fork_ending.teller import Teller, rank_endpoints
from testing.polling import wait_until
from testing.ports import free_port

pytestmark = pytest.mark.unit

GOOD_WITHIN_S = 3.0  # a tell to a good prefill, whatever the bad ones queued before it (was: 5 s per bad tell, in turn)
CALL_BOUND_S = 5.0  # any one call to a target, all of it (the teller's ROUTE_TIMEOUT_S, 2 s, and a loaded box's margin)


class _Good:
    """A prefill stand-in: /route answers one rank whose bootstrap socket is `pull`."""

    def __init__(self):
        self.ctx = zmq.Context.instance()
        self.pull = self.ctx.socket(zmq.PULL)
        self.rank_port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        rank_port = self.rank_port

        class Route(BaseHTTPRequestHandler):
            def do_GET(self):
                body = json.dumps({"rank_ip": "127.0.0.1", "rank_port": rank_port, "dp_size": 1,
                                   "attn_cp_size": 1, "attn_tp_size": 1, "pp_size": 1}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", free_port()), Route)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def received(self, timeout_s: float):
        if self.pull.poll(int(timeout_s * 1000)):
            return self.pull.recv_multipart()
        return None

    def close(self):
        self.http.shutdown()
        self.pull.close(0)


class _Hostile:
    """A TCP server on 0.0.0.0 (any 127.x.y.z reaches it) that does `behave(conn)` with each connection; counts
    what it accepted and the bytes it managed to send."""

    def __init__(self, behave):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", free_port()))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.sent = 0
        self.closed = threading.Event()
        self._behave = behave
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            self._behave(self, conn)
        except OSError:
            pass  # the client gave up: what the test wants
        finally:
            conn.close()

    def close(self):
        self.closed.set()
        self.sock.close()


def _silent(server, conn):
    server.closed.wait(60)


def _trickle(server, conn):
    conn.recv(4096)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
    while not server.closed.wait(0.2):
        conn.sendall(b" ")


def _endless(server, conn):
    conn.recv(4096)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000000000\r\n\r\n[")
    chunk = b"0," * 32768
    while not server.closed.is_set():
        conn.sendall(chunk)
        server.sent += len(chunk)


def _absurd_sizes(server, conn):
    conn.recv(4096)
    body = json.dumps({"rank_ip": "127.0.0.1", "rank_port": 1, "dp_size": 10 ** 6, "attn_cp_size": 10 ** 6,
                       "attn_tp_size": 10 ** 6, "pp_size": 10 ** 6}).encode()
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                 b"Connection: close\r\n\r\n%s" % (len(body), body))


@pytest.fixture
def good():
    g = _Good()
    yield g
    g.close()


def _hostile(behave):
    @pytest.fixture
    def server():
        s = _Hostile(behave)
        yield s
        s.close()

    return server


silent = _hostile(_silent)
trickle = _hostile(_trickle)
endless = _hostile(_endless)
absurd = _hostile(_absurd_sizes)


def _in_thread(fn, *args):
    """Run fn(*args) on a daemon thread; (thread, box of its outcome)."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args)
        except Exception as e:
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _idle(teller) -> bool:
    """No target, no tell pending (the cached endpoints of live prefills may stay: per peer)."""
    report = teller.report()
    return report["targets"] == 0 and report["queued"] == 0


def test_a_silent_target_delays_no_tell_to_a_good_one(good, silent):
    t = Teller()
    start = time.monotonic()
    for room in range(3):
        t.tell("127.0.0.1", silent.port, 100 + room, "test")
    t.tell("127.0.0.1", good.port, 7, "test")
    assert time.monotonic() - start < 0.5  # a tell never blocks its caller
    message = good.received(GOOD_WITHIN_S)
    took = time.monotonic() - start
    assert message is not None, f"the good prefill was not told within {GOOD_WITHIN_S}s"
    assert message[1] == b"7", message
    assert took < GOOD_WITHIN_S, took
    # the silent target's tells are given up within its bound (one deadline: the others fail the same way), and
    # the teller holds nothing afterwards
    wait_until(lambda: _idle(t), 2 * CALL_BOUND_S, "the teller to give the silent target up",
               on_timeout=lambda: str(t.report()))
    assert t.report()["dropped"] >= 2


def test_a_trickling_answer_is_given_up_at_the_deadline(trickle):
    start = time.monotonic()
    th, box = _in_thread(rank_endpoints, f"127.0.0.1:{trickle.port}")
    th.join(CALL_BOUND_S)
    assert not th.is_alive(), "a trickling /route answer held the teller's call past its deadline"
    assert "error" in box, box
    assert time.monotonic() - start < CALL_BOUND_S


def test_an_endless_answer_is_not_read_whole(endless):
    th, box = _in_thread(rank_endpoints, f"127.0.0.1:{endless.port}")
    th.join(CALL_BOUND_S)
    assert not th.is_alive(), f"still reading an endless /route answer ({endless.sent} bytes sent)"
    assert "error" in box, box
    # what the client read is capped; what the server got out is that plus the sockets' buffers
    assert endless.sent < 16 * 2 ** 20, endless.sent


def test_absurd_rank_counts_are_refused(absurd):
    th, box = _in_thread(rank_endpoints, f"127.0.0.1:{absurd.port}")
    th.join(CALL_BOUND_S)
    assert not th.is_alive(), f"still asking for ranks of an absurd answer ({absurd.accepted} calls)"
    assert "error" in box, box
    assert absurd.accepted == 1, absurd.accepted


def test_client_chosen_targets_are_bounded(good, silent):
    """As many distinct silent targets as clients like (127.0.0.x:port): the teller keeps at most MAX_TARGETS
    targets (threads), drops the rest with a log, still tells a good prefill, and ends holding nothing."""
    t = Teller()
    n = teller_module.MAX_TARGETS + 16
    for i in range(n):
        t.tell(f"127.0.{1 + i // 250}.{1 + i % 250}", silent.port, i, "test")
    report = t.report()
    assert report["targets"] <= teller_module.MAX_TARGETS, report
    assert report["dropped"] >= n - teller_module.MAX_TARGETS, report
    wait_until(lambda: t.report()["targets"] == 0, 2 * CALL_BOUND_S, "the silent targets to go",
               on_timeout=lambda: str(t.report()))
    start = time.monotonic()
    t.tell("127.0.0.1", good.port, 9, "test")
    message = good.received(GOOD_WITHIN_S)
    assert message is not None and message[1] == b"9", message
    assert time.monotonic() - start < GOOD_WITHIN_S
    wait_until(lambda: _idle(t), GOOD_WITHIN_S, "the teller to be idle", on_timeout=lambda: str(t.report()))
    assert t.report()["endpoints"] == 1  # the good prefill's, kept (per peer)
