"""Recovery's ask of prefill's bootstrap server across a silent partition (testing/hosts.py, no sglang server): an
attempt starts by asking prefill's bootstrap server `/route` for its HTTP address (recovery._prefill_url, in the
session recovery._asking_session makes). When decode is cut off from prefill (a partition between them only,
docs/recovery.md "A partition between prefill and decode"), the connect is never answered: the attempt gives up after
the peer monitor's own connect bound (ASK_CONNECT_S, 1 s), and the held-back failure is answered that much later than
without recovery, not after the whole ask's 5 s (ASK_PREFILL_S: what it was, for a failure that off is answered at
once). Before the cut and after the heal the same ask gets the address; a bootstrap server that accepts and never
answers (a frozen prefill) still has the whole ASK_PREFILL_S.

The ask runs from the decode host (a subprocess in its network namespace) against a stand-in bootstrap server on the
prefill host that answers `/route` as upstream's does (`prefill_http_port`), or accepts and never answers.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang.srt.disaggregation.fork_recovery import recovery
from testing import hosts as hosts_mod
from testing.hosts import TestHosts

pytestmark = [pytest.mark.pair, pytest.mark.skipif(hosts_mod.unavailable() is not None,
                                                   reason=str(hosts_mod.unavailable()))]

PORT, HTTP_PORT = 8998, 30123
MARGIN = 1.0  # a busy 2-core machine: the subprocess's event loop
# The stand-in bootstrap server: `/route` answered as upstream's bootstrap server does; "frozen": accepts, never answers.
BOOTSTRAP = """
import json, socket, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
if sys.argv[3] == "frozen":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(8)
    print("ready", flush=True)
    time.sleep(3600)
class Route(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"prefill_http_port": int(sys.argv[4])}).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *args):
        return
server = ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), Route)
print("ready", flush=True)
server.serve_forever()
"""
# An attempt's ask, as _rerun makes it; prints the outcome and the seconds it took.
ASK = """
import asyncio, sys, time, types
from sglang.srt.disaggregation.fork_recovery import recovery
async def ask():
    obj = types.SimpleNamespace(rid="partitioned", bootstrap_host=sys.argv[1], bootstrap_port=int(sys.argv[2]))
    t = time.monotonic()
    try:
        async with recovery._asking_session() as asking:
            url = await recovery._prefill_url(asking, obj)
        print("ok", time.monotonic() - t, url)
    except Exception as e:
        print(type(e).__name__, time.monotonic() - t, "-")
asyncio.run(ask())
"""


def _ask(h: TestHosts) -> "tuple[str, float, str]":
    argv = h["decode"].exec_argv([sys.executable, "-c", ASK, h["prefill"].address, str(PORT)])
    kind, seconds, url = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout.split()
    return kind, float(seconds), url


def _bootstrap(h: TestHosts, mode: str) -> subprocess.Popen:
    server = subprocess.Popen(h["prefill"].exec_argv([sys.executable, "-c", BOOTSTRAP, h["prefill"].address,
                                                      str(PORT), mode, str(HTTP_PORT)]),
                              stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    return server


def _stop(server: subprocess.Popen) -> None:
    server.kill()
    server.wait(10)


def test_an_attempt_gives_up_on_a_partitioned_prefill_within_the_connect_bound():
    with TestHosts(("prefill", "decode")) as h:
        server = _bootstrap(h, "route")
        try:
            before = _ask(h)
            h.cut("prefill", "decode")
            cut = _ask(h)
            h.heal()
            after = _ask(h)
        finally:
            h.heal()
            _stop(server)
    print(f"\nrecovery's ask of a partitioned prefill's bootstrap server (outcome, s): before the cut {before[:2]}, "
          f"cut {cut[:2]}, after the heal {after[:2]}")
    url = f"http://{h['prefill'].address}:{HTTP_PORT}"
    assert before[0] == "ok" and before[2] == url and before[1] <= MARGIN, before
    # a silent connect: given up at the connect bound, not at the whole ask's ASK_PREFILL_S
    assert cut[0] != "ok", cut
    assert recovery.ASK_CONNECT_S - 0.1 <= cut[1] <= recovery.ASK_CONNECT_S + MARGIN < recovery.ASK_PREFILL_S, cut
    assert after[0] == "ok" and after[2] == url and after[1] <= MARGIN, after


def test_a_bootstrap_server_that_accepts_and_never_answers_has_the_whole_ask():
    with TestHosts(("prefill", "decode")) as h:
        server = _bootstrap(h, "frozen")
        try:
            frozen = _ask(h)
        finally:
            _stop(server)
    print(f"\nrecovery's ask of a bootstrap server that accepts and never answers (outcome, s): {frozen[:2]}")
    assert frozen[0] != "ok", frozen
    assert recovery.ASK_PREFILL_S - 0.1 <= frozen[1] <= recovery.ASK_PREFILL_S + MARGIN, frozen
