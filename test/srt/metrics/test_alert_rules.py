"""The fork's metrics, its Grafana dashboard and its Prometheus alert rules, statically: promtool accepts the
rules and their unit tests pass (each alert fires on the series it is for, and not before its `for:`); every fork
metric has the one prefix (`sglang:pd_`), counters end in `_total`, gauges are made as upstream's are (multiprocess
mode "mostrecent"); the dashboard and the rules read only metrics the fork or upstream declares, and the dashboard
shows every fork metric; docs/metrics.md names each. test_metrics_e2e.py: a running 1P1D exports them all.
promtool comes from Debian's `prometheus` package (`make system-deps`); missing, these tests fail."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sglang.srt.disaggregation.fork_ending import request_end_cause as rec
from testing.pd_checks import (DASHBOARD, DOCS, RULES, RULES_TESTS, dashboard_exprs, referenced_metrics,
                               rule_exprs, run_promtool)

pytestmark = pytest.mark.unit

PREFIX = "sglang:pd_"
FORK_METRICS = {name for name, _doc, _labels in [*rec.COUNTERS.values(), *rec.GAUGES.values()]}
# The alerts the PD guarantees need (stuck transfers, peer loss, deadline rate, pause stuck) and the others.
ALERTS = {"SglangPDTransferStuck", "SglangPDTransferSlow", "SglangPDTransferDeadlineRate", "SglangPDPeerLost",
          "SglangPDPeerLosses", "SglangPDPeerHeldOut", "SglangPDPauseStuck", "SglangPDChunkFailures"}


def _upstream_metric_names() -> set:
    """Every metric name the installed upstream declares (`name="sglang:..."` in its sources)."""
    import sglang.srt.observability.metrics_collector as collector

    root = Path(collector.__file__).parents[1]  # site-packages/sglang/srt
    names = set()
    for path in root.rglob("*.py"):
        if "fork_" in str(path.relative_to(root)):
            continue
        names.update(re.findall(r'name="(sglang:[A-Za-z0-9_:]+)"', path.read_text(errors="replace")))
    return names


def test_promtool_checks_the_rules():
    out = run_promtool("check", "rules", str(RULES))
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout, out.stdout


def test_promtool_unit_tests_of_the_alerts_pass():
    out = run_promtool("test", "rules", RULES_TESTS.name, cwd=RULES_TESTS.parent)
    assert "SUCCESS" in out.stdout, out.stdout
    tested = set(re.findall(r"alertname: (\w+)", RULES_TESTS.read_text()))
    assert tested == set(rule_exprs()) == ALERTS, (tested, set(rule_exprs()))


def test_fork_metrics_have_one_prefix_and_prometheus_names():
    for key, (name, doc, labels) in rec.COUNTERS.items():
        assert name.startswith(PREFIX) and name.endswith("_total"), (key, name)
    for key, (name, doc, labels) in rec.GAUGES.items():
        assert name.startswith(PREFIX) and not name.endswith("_total"), (key, name)
    assert len(FORK_METRICS) == len(rec.COUNTERS) + len(rec.GAUGES)
    upstream = _upstream_metric_names()
    assert "sglang:num_running_reqs" in upstream  # the scan finds upstream's declarations
    assert not FORK_METRICS & upstream, FORK_METRICS & upstream


def test_gauges_are_made_as_upstream_makes_them():
    """Multiprocess mode "mostrecent" (as upstream's scheduler gauges), the scheduler's labels first (made here
    and taken back: the process-wide ones are made with the label names of their first user)."""
    from prometheus_client import REGISTRY

    base = {"model_name": "m", "tp_rank": "0"}
    assert not set(rec.GAUGES) & set(rec._made), "a gauge was made in this test process before"
    try:
        for key, (name, _doc, own) in rec.GAUGES.items():
            gauge = rec._metric(key, base)
            assert gauge._multiprocess_mode == "mostrecent", key
            assert list(gauge._labelnames) == [*base, *own], key
    finally:
        for key in rec.GAUGES:
            made = rec._made.pop(key, None)
            if made is not None:
                REGISTRY.unregister(made)


def test_dashboard_and_rules_read_only_declared_metrics():
    declared = FORK_METRICS | _upstream_metric_names()
    unknown = {name: sorted(where) for name, where in referenced_metrics().items() if name not in declared}
    assert not unknown, unknown


def test_dashboard_shows_every_fork_metric_and_docs_name_them():
    on_dashboard = {name for expr in dashboard_exprs().values() for name in re.findall(r"sglang:[\w:]+", expr)}
    assert FORK_METRICS <= on_dashboard, FORK_METRICS - on_dashboard
    doc = (DOCS / "metrics.md").read_text()
    assert not [n for n in FORK_METRICS if f"`{n}" not in doc], [n for n in FORK_METRICS if f"`{n}" not in doc]
    assert DASHBOARD.name in doc and RULES.name in doc
