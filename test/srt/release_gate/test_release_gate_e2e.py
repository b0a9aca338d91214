"""The release gate run for real (bench/release_gate.py against the upstream wheel), short,
against a fork made slower on purpose: the gate must fail it. The gate's logic without
servers is test_bench_gate.py."""

import subprocess
import sys

import pytest

from bench import release_gate as gate

pytestmark = pytest.mark.e2e


# The deliberately slower fork: 5 ms of busy loop per decode scheduler pass, against
# ~6-7 ms of CPU per busy pass upstream (README's gate table): fork/upstream ~1.7,
# where the rounds' noise is a few hundredths (robust SE ~0.01 at 48 requests a round),
# so 16 requests a round decide it as surely as 48 did with 2 ms (~1.3).
SLOWDOWN_US = 5000
GATE_ROUNDS = 3  # release_gate.MIN_ROUNDS: fewer rounds never decide
GATE_REQUESTS = 16


def test_a_deliberately_slower_fork_fails_the_cpu_gate():
    """The gate run for real, short (3 rounds of 16 requests, both sides loaded at
    once), with a fork made slower by 5 ms of busy loop per decode scheduler pass (the
    bench-only slowdown plugin, a hook on pop_transferred): the CPU gate must FAIL on
    this shared machine, not pass and not shrug (INCONCLUSIVE).
    Cost: two 1P1D deployments (~5 GB), ~3-4 min on the
    loaded 2-core box, most of it server start-up."""
    assert GATE_ROUNDS == gate.MIN_ROUNDS
    out = subprocess.run(
        [sys.executable, "-m", "bench.release_gate", "--rounds", str(GATE_ROUNDS),
         "--requests", str(GATE_REQUESTS), "--warmup", "8",
         "--inject-slowdown-us", str(SLOWDOWN_US), "--hooks", "skip"],
        cwd=gate.REPO_ROOT, capture_output=True, text=True, timeout=1800,
    )
    tail = out.stdout[-4000:] + out.stderr[-2000:]
    assert out.returncode == 1, tail
    assert "GATE FAILED: decode scheduler CPU µs per iteration" in out.stdout, tail
    assert f"Verdict: FAIL over {GATE_ROUNDS} rounds" in out.stdout, tail
    # the slower fork still answers the same tokens: the failure is the CPU cost alone
    n = GATE_ROUNDS * GATE_REQUESTS
    assert f"Output tokens: {n} of {n} requests identical" in out.stdout, tail
