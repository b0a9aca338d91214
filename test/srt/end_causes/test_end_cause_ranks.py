"""The end-cause counter with tensor parallelism: every rank retires the same request, the answering rank
(upstream's stats-logging rank) alone moves the exported counter; without upstream's context (one rank, a
harness) the counter moves as before."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang.srt.disaggregation.fork_ending import request_end_cause as rec

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def own_end_cause_counter():
    """A counter of this module's own: the process-wide one is made with the label names of its first user (an
    earlier test of the same pytest process may have made it without `tp_rank`); put back after."""
    from prometheus_client import REGISTRY

    earlier = rec._made.pop("end_cause", None)
    if earlier is not None:
        REGISTRY.unregister(earlier)
    yield
    made = rec._made.pop("end_cause", None)
    if made is not None:
        REGISTRY.unregister(made)
    if earlier is not None:
        REGISTRY.register(earlier)
        rec._made["end_cause"] = earlier


def _scheduler(rank0: bool) -> SimpleNamespace:
    return SimpleNamespace(
        metrics_reporter=SimpleNamespace(enable_metrics=True),
        metrics_collector=SimpleNamespace(labels={"tp_rank": "0" if rank0 else "1"}),
        metrics_collector_context=SimpleNamespace(is_stats_logging_rank=rank0),
    )


def _exported(tp_rank: str, stage: str) -> float:
    c = rec.counter("end_cause", {"tp_rank": tp_rank})
    return c.labels(tp_rank=tp_rank, role="decode", cause="timeout", stage=stage)._value.get()


def test_only_the_answering_rank_exports_an_end():
    stage = "test_only_the_answering_rank"
    before = rec.COUNTS[("decode", "timeout", stage)]
    for rank0 in (True, False):
        req = SimpleNamespace(bootstrap_room=7)
        rec.tag_req(req, rec.TIMEOUT)
        assert rec.record_end(_scheduler(rank0), req, "decode", stage) == rec.TIMEOUT
        assert rec.record_end(_scheduler(rank0), req, "decode", stage) is None  # once per request
    assert rec.COUNTS[("decode", "timeout", stage)] == before + 2  # each process's own record
    assert (_exported("0", stage), _exported("1", stage)) == (1.0, 0.0)


def test_a_scheduler_without_upstreams_context_exports():
    stage = "test_without_context"
    scheduler = _scheduler(True)
    del scheduler.metrics_collector_context
    req = SimpleNamespace(bootstrap_room=8)
    rec.tag_req(req, rec.TIMEOUT)
    rec.record_end(scheduler, req, "decode", stage)
    assert _exported("0", stage) == 1.0
