"""Thread-local plumbing of the room ledger's hooks: what one call on this thread hands to an upstream function it
calls, read by the ledger's hook around a function upstream calls inside (record_failure, update_status). Each
value is set for a `with` block on the calling thread only and the outer one put back after; no lock (a
`threading.local` is per thread). Invariant: nothing set here outlives its block. Threads: whichever runs the
block (scheduler, bootstrap, transfer worker, decode's re-bootstrap pool)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Optional

from sglang.srt.disaggregation.fork_ending.verdict_rows import Told


@contextlib.contextmanager
def _scoped(local: threading.local, **values: Any):
    """`values` set on this thread's `local` for the `with` block, the outer ones put back after."""
    outer = {name: getattr(local, name) for name in values}
    for name, value in values.items():
        setattr(local, name, value)
    try:
        yield
    finally:
        for name, value in outer.items():
            setattr(local, name, value)


class _Attaching(threading.local):
    told: Optional[Told] = None


# The cause of the failure `record_failure` is writing on this thread (RoomLedger.make, decode's status handler).
attached = _Attaching()


def attaching(told: Optional[Told]):
    return _scoped(attached, told=told)


class _Concluding(threading.local):
    room: Optional[int] = None
    targets: Optional[list] = None


# The room upstream's `conclude_transfer` may fail on this thread (prefill's transfer worker), and its targets.
concluded = _Concluding()


def concluding(room: int, targets: Optional[list]):
    """Around upstream's `conclude_transfer` of `room` (prefill's transfer worker; prefill_side_monitor's hook, for a write
    to a session upstream blacklisted): the Failed status it sends carries the cause kept with the record it sends
    (`tell_cause`, from `around_update_status`: upstream marks the room Failed only once it has decided to send, so a
    cleared room, which it returns from unconcluded, is told nothing and no told cause waits on decode for a status
    that never comes)."""
    return _scoped(concluded, room=room, targets=targets)


class _Recomputing(threading.local):
    reason: Optional[str] = None


# The reason `_fail_prefill_recompute` is recording on this thread (decode's re-bootstrap pool).
recomputing = _Recomputing()


def recompute_failing(reason: str):
    return _scoped(recomputing, reason=reason)
