"""Decode's retract re-send to prefill (`/generate`) never fails on a reused connection.

Upstream's re-bootstrap pool (`CommonKVManager._run_prefill_recompute`) posts through a
pooled `requests.Session`; a connection prefill's HTTP server closes as idle just as the
next re-send goes out is reset, and the request ends with 500 "PD retract rebootstrap
/generate request errored" (seen in test_pd_pause.py's retract cycles). Here upstream's
own re-send code, with the fork's hooks loaded, posts twice on one pool thread to a
server that resets any request arriving on a connection it already served (the race,
made certain): both re-sends must reach the server once each and none may fail.
"""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

CODE = r'''
import json, socket, struct, threading, time

from sglang.srt.managers.fork_core import fork_plugin
from sglang.srt.plugins.hook_registry import HookRegistry

fork_plugin.register(); HookRegistry.apply_hooks()
from sglang.srt.disaggregation.common.conn import CommonKVManager

seen = {"connections": 0, "requests": [], "reset": 0}
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(8)


def serve(conn):
    f, served = conn.makefile("rb"), 0
    while f.readline():
        headers = {}
        while (line := f.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode().partition(":")
            headers[key.strip().lower()] = value.strip()
        body = f.read(int(headers.get("content-length", 0)))
        if served:  # closed as idle as this request came in: reset
            seen["reset"] += 1
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
            return
        served += 1
        seen["requests"].append(json.loads(body))
        close = headers.get("connection", "").lower() == "close"
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                     + (b"Connection: close\r\n" if close else b"") + b"\r\n{}")
        if close:
            conn.close()
            return


def accept():
    while True:
        conn, _ = srv.accept()
        seen["connections"] += 1
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


threading.Thread(target=accept, daemon=True).start()
mgr = CommonKVManager.__new__(CommonKVManager)  # upstream's methods; only what they read is set
mgr._prefill_recompute_sessions = threading.local()
mgr.waiting_timeout = 10
failures = []
mgr._fail_prefill_recompute = lambda receiver, reason: failures.append(reason)
url = "http://127.0.0.1:%d" % srv.getsockname()[1]
started = time.monotonic()
for i in range(2):  # one pool thread, one after the other, as upstream's executor runs them
    mgr._run_prefill_recompute(None, url, {"rid": f"resend-{i}", "bootstrap_room": i})
seen["resend_s"] = time.monotonic() - started
print(json.dumps({"failures": failures, "hooks": all(fork_plugin.hooks_applied().values()), **seen}))
'''


def test_two_resends_on_one_pool_thread_never_reuse_a_connection():
    # importing sglang in the subprocess takes 10-60 s on a loaded 2-core box: the bound is on the re-sends alone
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["hooks"]
    assert result["failures"] == [], result
    assert [r["rid"] for r in result["requests"]] == ["resend-0", "resend-1"], result
    assert result["connections"] == 2 and result["reset"] == 0, result
    # each re-send is one loopback request; one that hung would take upstream's waiting_timeout (10 s)
    assert result["resend_s"] < 10, result
