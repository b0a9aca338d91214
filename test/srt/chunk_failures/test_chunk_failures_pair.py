"""A failed KV, aux or extra-state chunk write of one room among 16, over real mooncake
TCP between two processes: that room ends 500 on both sides naming the failed write, the
other 15 land byte-identical, both sides give everything back, the failures are counted
by kind, and the decode session stays in service (one failed write does not blacklist it).

The fault switch is SGLANG_TEST_DISAGG_FAIL_CHUNKS (sglang.srt.disaggregation.fork_transfer.chunk_failures)
selecting rooms by rid prefix. Extra state: both sides get a page-indexed state
component (`state_component=True`, see testing/mooncake_pair.py), so every request's
last chunk also takes the transfer worker's state path, as a hybrid model's does.
"""

import os
import signal
import socket
import time

import pytest

from testing.pd_checks import assert_pair_idle as _assert_idle
from testing.pd_checks import assert_pair_serves, pair_fixture
from testing.pd_checks import wait_pair_idle as _wait_idle

pytestmark = pytest.mark.pair

N = 16
FAILING = 3  # index of the failing request among the N
FAULTS = "kv:rid=fail-kv-,aux:rid=fail-aux-,state:rid=fail-state-,state+failed:rid=fail-state+failed-"
SIZES = dict(
    kv_tokens=2048, req_slots=N + 2, metadata_slots=N + 2, max_context_len=64, state_component=True
)
# What each side's 500 says. "state+failed": the room was already Failed locally (as a
# concurrent local abort leaves it) when its state write failed; upstream then broke out
# without telling decode. Decode hears the first root cause.
REASON = {
    "kv": "Failed to send kv chunk",
    "aux": "Failed to send aux data",
    "state": "Failed to send state components",
    # the first root cause, or, when the scheduler already cleared the Failed room
    # before the worker concluded, the write's own reason
    "state+failed": ("failed locally during its state write", "Failed to send state components"),
}
# After a failed write decode cannot know the write has stopped (mooncake may return -1
# with the batch still running), so it holds the pages until prefill acks a drain or
# this deadline passes (upstream's deferred release; 30 s by default).
RELEASE_TIMEOUT_S = 3.0
RELEASE_ENV = {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(RELEASE_TIMEOUT_S)}
# upstream's failed-session probe loop, fast enough for a test
PROBE_ENV = {
    "SGLANG_FAILED_SESSION_PROBE_INTERVAL_S": "0.5",
    "SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S": "1",
}
# A probe of a frozen peer fails on mooncake's own timeout (measured ~61 s).
FROZEN_PROBE_S = 120.0


pair = pair_fixture(
    prefill_env={"SGLANG_TEST_DISAGG_FAIL_CHUNKS": FAULTS, **RELEASE_ENV, **PROBE_ENV},
    decode_env=RELEASE_ENV,
    **SIZES,
)


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _wait_no_room_entries(pair, rooms, timeout):
    deadline = time.monotonic() + timeout
    while True:
        left = {
            (side.role, r): side.call("room_entries", r)
            for side in (pair.prefill, pair.decode)
            for r in rooms
        }
        left = {k: v for k, v in left.items() if v}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _settled_blacklist(pair, timeout=30.0, want=None):
    """Prefill's blacklist once no nomination probe is in flight (and, with `want`,
    once it equals `want`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sessions = pair.prefill.call("failed_sessions")
        if sessions is not None and (want is None or sessions == want):
            return sessions
        time.sleep(0.05)
    raise TimeoutError(f"session blacklist did not settle (last: {sessions})")


@pytest.mark.parametrize("kind", ["kv", "aux", "state", "state+failed"])
def test_one_failed_chunk_fails_only_its_room(pair, kind):
    _assert_idle(pair)
    counted = kind.split("+")[0]
    p_before = pair.prefill.call("chunk_failures")
    d_before = pair.decode.call("chunk_failures")
    p_failed = pair.prefill.call("counter", "increment_transfer_failed_reqs")
    d_failed = pair.decode.call("counter", "increment_transfer_failed_reqs")

    rooms = [
        pair.submit(prompt_len=8 + i, rid=(f"fail-{kind}-{i}" if i == FAILING else f"ok-{kind}-{i}"))
        for i in range(N)
    ]
    bad = rooms[FAILING]
    good = [r for r in rooms if r != bad]

    def concluded():
        return all(pair.prefill.call("status", r) is not None for r in rooms) and all(
            pair.decode.call("transferred", r) for r in good
        ) and pair.decode.call("status", bad) is not None

    elapsed = pair.run_until(concluded, timeout=90)
    assert elapsed < 60

    # the failing room: 500 on both sides, naming the failed write
    for side in (pair.prefill, pair.decode):
        assert side.call("status", bad) == 500, side.role
        message = side.call("final_reason", bad)["message"]
        assert any(r in message for r in _as_tuple(REASON[kind])), (side.role, message)
    # the other 15: transferred intact, prefill answered 200
    for r in good:
        assert pair.prefill.call("status", r) == 200
        assert pair.decode.call("kv_bytes", r) == pair.prefill.call("kv_sent", r)
        assert pair.decode.call("output_ids", r) == [7]
        pair.decode.call("finish", r)
        assert pair.decode.call("status", r) == 200

    # everything back (decode's pages for the failed room after the release deadline),
    # no room state left on either side
    assert _wait_idle(pair, timeout=RELEASE_TIMEOUT_S + 20) < RELEASE_TIMEOUT_S + 15
    assert _wait_no_room_entries(pair, rooms, timeout=RELEASE_TIMEOUT_S + 10) == {}

    # counted once per side, by kind; the per-request counter too
    p_after = pair.prefill.call("chunk_failures")
    d_after = pair.decode.call("chunk_failures")
    assert p_after.get((counted, "prefill"), 0) - p_before.get((counted, "prefill"), 0) == 1
    # decode counts by the reason it was told; "+failed" tells the earlier root cause
    d_told = pair.decode.call("final_reason", bad)["message"]
    d_expected = 1 if REASON[counted] in d_told else 0
    assert d_after.get((counted, "decode"), 0) - d_before.get((counted, "decode"), 0) == d_expected
    assert pair.prefill.call("counter", "increment_transfer_failed_reqs") - p_failed == 1
    assert pair.decode.call("counter", "increment_transfer_failed_reqs") - d_failed == 1

    # the decode session was not taken out: it answers, so only that room failed
    assert _settled_blacklist(pair) == []
    assert_pair_serves(pair, [pair.submit(prompt_len=9, rid=f"after-{kind}")])
    _assert_idle(pair)


def test_dead_session_is_taken_out_live_one_is_not(pair):
    """A session whose peer does not answer a probe is blacklisted; the live decode's
    session, nominated the same way, is not."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed
    live = pair.decode.call("session_id")
    pair.prefill.call("nominate_failed_session", live)
    assert _settled_blacklist(pair) == []
    pair.prefill.call("nominate_failed_session", dead)
    assert _settled_blacklist(pair) == [dead]


def test_session_out_while_peer_dead_back_when_it_answers(pair):
    """A failed write to a decode that does not answer (frozen) takes its session out;
    once it answers again the session comes back and requests flow again."""
    _assert_idle(pair)
    live = pair.decode.call("session_id")
    others = _settled_blacklist(pair)  # e.g. the dead port of the test above
    assert live not in others
    os.kill(pair.decode.proc.pid, signal.SIGSTOP)
    try:
        pair.prefill.call("nominate_failed_session", live)
        assert _settled_blacklist(pair, timeout=FROZEN_PROBE_S) == sorted(others + [live])
    finally:
        os.kill(pair.decode.proc.pid, signal.SIGCONT)
    t0 = time.monotonic()
    assert _settled_blacklist(pair, timeout=15, want=others) == others
    assert time.monotonic() - t0 < 10
    assert_pair_serves(pair, [pair.submit(prompt_len=10, rid="after-resume")])
    _assert_idle(pair)
