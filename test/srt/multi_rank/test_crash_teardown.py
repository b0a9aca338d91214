"""A scheduler rank that raised takes its server down at once (rank_agreement.crash_diagnostics_that_can_run on
upstream's TokenizerManager.dump_requests_before_crash, which upstream's SIGQUIT handler runs before it kills the
server's process tree): upstream sleeps 5 s before crash diagnostics and waits 60 s for CUDA core dumps also where
neither py-spy nor a core dump can run; with the fork's hook it returns at once there. Upstream's real method, in a
python subprocess (the hook applied there only), called unhooked and then hooked. The end-to-end proof:
test_frozen_rank_e2e.py (a frozen rank's server is gone within the gloo timeout + a margin)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
CALL = """
import json, time, types
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from testing.gloo_ranks import apply_fork_hooks

def took():
    me = types.SimpleNamespace(crash_dump_folder=None, crash_dump_performed=False)
    t0 = time.monotonic()
    TokenizerManager.dump_requests_before_crash(me)
    return time.monotonic() - t0

upstream = took()
apply_fork_hooks("sglang.srt.managers.tokenizer_manager.TokenizerManager.dump_requests_before_crash")
print(json.dumps({"upstream": upstream, "fork": took()}))
"""


def test_a_crash_without_runnable_diagnostics_is_not_delayed():
    # no py-spy on PATH, no CUDA_ENABLE_USER_TRIGGERED_COREDUMP: neither diagnostic can run
    env = {k: v for k, v in os.environ.items() if k != "CUDA_ENABLE_USER_TRIGGERED_COREDUMP"}
    env["PATH"] = os.pathsep.join(p for p in ("/usr/bin", "/bin") if os.path.isdir(p))
    out = subprocess.run([sys.executable, "-c", CALL], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    took = json.loads(out.stdout.strip().splitlines()[-1])
    assert took["upstream"] >= 5.0, took  # upstream's settle sleep (no scheduler here: no 60 s core dump wait)
    assert took["fork"] < 1.0, took
