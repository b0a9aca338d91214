"""Decode's teller across a silent partition (testing/hosts.py, no sglang server): a tell that a room ended, sent
while the prefill host does not accept a connect (the link between the two cut silently), is tried again every
RETRY_PAUSE_S and reaches prefill once the link heals within SILENT_RETRY_S (docs/recovery.md, "A partition between
prefill and decode": prefill then ends that room as decode's abort instead of at its own deadline, which a gateway
would put in place of decode's recovered answer). Before this release the teller gave the tell up at its first
failed connect (the room ended on prefill only at its deadline). A refused connect, or a target that accepts and does
not answer, is still given up at once (test_teller.py).

The teller runs on the decode host (a subprocess in its network namespace); a stand-in bootstrap server on the prefill
host answers `/route` as upstream's does and prints the room of each ABORT its rank socket receives.
"""

from __future__ import annotations

import select
import subprocess
import sys
import time

import pytest

from sglang.srt.disaggregation.fork_ending import teller as teller_module
from testing import hosts as hosts_mod
from testing.hosts import TestHosts

pytestmark = [pytest.mark.pair, pytest.mark.skipif(hosts_mod.unavailable() is not None,
                                                   reason=str(hosts_mod.unavailable()))]

PORT, RANK_PORT, ROOM = 8998, 8999, 4242
CUT_S = 4.0  # the cut lasts this long after the tell: at least one silent connect (ROUTE_TIMEOUT_S) and a retry
MARGIN = 3.0  # a busy 2-core machine: the subprocesses' start, one retry pause, one connect after the heal
# The stand-in: `/route` answers one rank, whose bootstrap socket (zmq PULL) prints each message's room.
BOOTSTRAP = """
import json, sys, threading, zmq
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
host, port, rank_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pull = zmq.Context.instance().socket(zmq.PULL)
pull.bind(f"tcp://{host}:{rank_port}")
class Route(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"rank_ip": host, "rank_port": rank_port, "dp_size": 1, "attn_cp_size": 1,
                           "attn_tp_size": 1, "pp_size": 1}).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *args):
        return
threading.Thread(target=ThreadingHTTPServer((host, port), Route).serve_forever, daemon=True).start()
print("ready", flush=True)
while True:
    frames = pull.recv_multipart()
    print("room", frames[1].decode(), flush=True)
"""
# The teller on decode's host: one tell, then its report once nothing is pending (or after its bound).
TELL = """
import sys, time
from sglang.srt.disaggregation.fork_ending.teller import SILENT_RETRY_S, Teller
t = Teller()
t.tell(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), "a room decode ended during the cut")
print("told", flush=True)
deadline = time.monotonic() + SILENT_RETRY_S + 10
while time.monotonic() < deadline and (t.report()["queued"] or t.report()["targets"]):
    time.sleep(0.1)
print("report", t.report()["queued"], t.report()["targets"], t.report()["dropped"], flush=True)
"""


def test_a_tell_sent_during_a_silent_partition_reaches_prefill_after_the_heal():
    with TestHosts(("prefill", "decode")) as h:
        server = subprocess.Popen(h["prefill"].exec_argv([sys.executable, "-c", BOOTSTRAP, h["prefill"].address,
                                                          str(PORT), str(RANK_PORT)]),
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready"
            h.cut("prefill", "decode")
            tell = subprocess.Popen(h["decode"].exec_argv([sys.executable, "-c", TELL, h["prefill"].address,
                                                           str(PORT), str(ROOM)]),
                                    stdout=subprocess.PIPE, text=True)
            assert tell.stdout.readline().strip() == "told"
            t_told = time.monotonic()
            while time.monotonic() - t_told < CUT_S:  # the cut lasts CUT_S: the tell's connects go unanswered
                assert tell.poll() is None, "the teller gave up during the cut"
                time.sleep(0.1)
            h.heal()
            t_heal = time.monotonic()
            ready, _, _ = select.select([server.stdout], [], [], teller_module.SILENT_RETRY_S)
            assert ready, f"the tell did not arrive within {teller_module.SILENT_RETRY_S:g} s of the heal"
            line = server.stdout.readline().split()
            arrived = time.monotonic() - t_heal
            report = tell.stdout.readline().split()
            tell.wait(30)
        finally:
            server.kill()
            h.heal()
    print(f"\ntell sent during a {CUT_S:g} s cut arrived {arrived:.2f} s after the heal; teller {report}")
    assert line == ["room", str(ROOM)], line
    # the next try after the heal: one retry pause and one connect (plus the subprocesses' own pace)
    assert arrived <= teller_module.RETRY_PAUSE_S + teller_module.ROUTE_TIMEOUT_S + MARGIN, arrived
    assert report == ["report", "0", "0", "0"], report  # nothing pending, no tell dropped
