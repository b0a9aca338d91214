"""An abort that reaches a paused scheduler is answered in that same call, wherever
the request sits in the PD queues (real upstream queues, queue harness): a paused
event loop does no queue processing, so without pd_pause's abort hook the answer
would wait for continue_generation. Everything the request held is returned.

The end-to-end version (both servers paused under load, answered within 1 s) is
test_pd_pause.py::test_abort_during_long_pause_is_answered_within_1s.
"""

import contextlib

import pytest

from testing.pd_checks import is_client_abort
from testing.queue_harness import DecodeHarness

pytestmark = pytest.mark.unit


@contextlib.contextmanager
def paused(h):
    h.scheduler._engine_paused = True
    try:
        yield
    finally:
        h.scheduler._engine_paused = False


def _abort_while_paused(h, req, place: str, held_place):
    assert held_place(), f"{req.rid} not in the {place}"
    with paused(h):
        assert h.outputs.final(req.rid) is None
        h.abort(req.rid)
        # answered in the abort call itself: no scheduler pass ran
        assert h.outputs.final(req.rid) is not None, place
        reason = h.outputs.final(req.rid).reason
        assert reason["type"] == "abort", place
        # upstream's client-abort answer at every place: no status (HTTP 200, finish_reason abort)
        assert h.outputs.status_code(req.rid) is None and is_client_abort(reason), (place, reason)
        assert not held_place(), place
    h.faults.release(req.bootstrap_room)
    h.assert_baseline(h.idle)
    # and the queues serve again after continue
    ok = h.add(h.make_req())
    if isinstance(h, DecodeHarness):
        h.run_until(lambda: ok in h.waiting)  # transferred, holding its KV
        h.finish(ok)
    else:
        h.run_until(lambda: h.outputs.final(ok.rid) is not None)
    assert h.outputs.status_code(ok.rid) == 200
    h.assert_baseline(h.idle)


def test_prefill_bootstrap_queue(prefill_h):
    h = prefill_h
    req, _ = h.add_bootstrapping()  # decode not there yet
    _abort_while_paused(h, req, "bootstrap queue", lambda: req in h.queue.queue)


def test_prefill_waiting_queue(prefill_h):
    h = prefill_h
    req = h.add(h.make_req())
    h.hold_admission = True  # compute saturated: bootstrapped, not yet scheduled
    try:
        h.tick()
    finally:
        h.hold_admission = False
    _abort_while_paused(h, req, "waiting queue", lambda: req in h.waiting)


def test_prefill_inflight_queue(prefill_h):
    h = prefill_h
    req, _ = h.add_held()  # KV on the wire
    _abort_while_paused(h, req, "inflight queue", lambda: req in h.inflight)


def test_decode_prealloc_queue(decode_h):
    h = decode_h
    req, _ = h.add_bootstrapping()  # prefill not there yet
    _abort_while_paused(
        h, req, "prealloc queue", lambda: any(e.req is req for e in h.queue.queue))


def test_decode_transfer_queue(decode_h):
    h = decode_h
    req, _ = h.add_held()
    _abort_while_paused(
        h, req, "transfer queue", lambda: any(e.req is req for e in h.transfer_queue.queue))
