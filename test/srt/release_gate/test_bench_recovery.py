"""`make bench-recovery` (bench/recovery.py) without servers: the hold-back stamps it reads are the lines decode's
tokenizer really writes (recovery's own warning through upstream's logger format with `SGLANG_LOG_MS=1`), its figures are the per-cycle
differences it says, one deployment serves every cause of its table, and README.md's bench summary carries the line
its block writes. Fast; starts no server (the bench itself is `make bench-recovery`, not part of the suite)."""

from __future__ import annotations

from datetime import datetime

import pytest

from bench import recovery
from bench.readme_block import write_block
from testing import doc_tables

pytestmark = pytest.mark.unit


def _decode_log_line(monkeypatch, rid: str) -> str:
    """The line decode's tokenizer writes when recovery holds an end back: the real `recovery.holds_back` (its starter
    replaced: nothing is re-run) logging through upstream's own `configure_logger` with `SGLANG_LOG_MS=1`."""
    import asyncio
    import io
    import logging
    from types import SimpleNamespace

    from sglang.srt.disaggregation.fork_ending import verdict_wording
    from sglang.srt.disaggregation.fork_recovery import recovery as rec
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import ReqState
    from sglang.srt.utils.common import configure_logger

    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    monkeypatch.setenv("SGLANG_LOG_MS", "1")
    monkeypatch.setenv("SGLANG_FORK_RECOVERY_ATTEMPTS", "1")
    configure_logger(SimpleNamespace(log_level="info"))
    out = io.StringIO()
    root.handlers[0].setStream(out)
    try:
        obj = GenerateReqInput(text="x", sampling_params={}, rid=rid, bootstrap_host="10.0.0.1", bootstrap_port=8998,
                               bootstrap_room=1)
        state = ReqState(out_list=[], finished=False, event=asyncio.Event(), obj=obj, time_stats=None)
        failed = {"type": "abort", "status_code": 500, "message": verdict_wording.UPSTREAM_CHUNK_FAILED["kv"]}
        tm = SimpleNamespace(server_args=SimpleNamespace(disaggregation_mode="decode"), config_value=lambda name: "v0")
        held = rec.holds_back(tm, state,
                              SimpleNamespace(finished_reasons=[failed], completion_tokens=[0]), 0, {},
                              start=lambda *a: None)
    finally:
        root.handlers[:], root.level = saved
    assert held
    return out.getvalue()


def test_the_hold_back_stamp_is_read_from_the_line_decode_writes(monkeypatch):
    rid = recovery.CAUSES[0].prefix + "t-1"
    before = datetime.now().timestamp()
    text = "[2026-12-06 17:00:00.001] Prefill transfer failed for request rid='x'\n" + \
        _decode_log_line(monkeypatch, rid)
    after = datetime.now().timestamp()
    held = recovery.parse_held_back(text)
    assert list(held) == [rid], text
    assert before - 0.002 <= held[rid] <= after + 0.002, (before, held, after, text)  # to the millisecond


def test_added_detection_and_rerun_are_per_cycle_figures():
    calm = [{"rid": f"calm-{i}", "sent": 100.0 + 10 * i, "latency": 0.2 + 0.01 * i} for i in range(5)]
    rec = [{"rid": f"rec-{i}", "sent": 105.0 + 10 * i, "latency": 0.5 + 0.02 * i} for i in range(5)]
    held = {f"rec-{i}": 105.0 + 10 * i + 0.1 + 0.01 * i for i in range(5)}
    s = recovery.summarize({recovery.CALM: calm, "chunk_failure": rec}, held)["chunk_failure"]
    # recovered - calm of the same cycle: 300 + 10 i ms; detection 100 + 10 i; re-run 500 + 20 i - (100 + 10 i)
    assert s["added"]["median"] == pytest.approx(320) and (s["added"]["min"], s["added"]["max"]) == pytest.approx((300, 340))
    assert s["detection"]["median"] == pytest.approx(120) and s["rerun"]["median"] == pytest.approx(420)
    assert (s["added"]["q1"], s["added"]["q3"], s["added"]["n"]) == (pytest.approx(310), pytest.approx(330), 5)
    with pytest.raises(ValueError, match="no hold-back line"):
        recovery.summarize({recovery.CALM: calm, "chunk_failure": rec}, {})


def test_one_deployment_serves_every_cause_of_the_table():
    prefill, decode = recovery.deployment_env(recovery.CAUSES)
    entries = prefill["SGLANG_TEST_DISAGG_FAIL_CHUNKS"].split(",")
    assert len(entries) == len(recovery.CAUSES) == len({c.prefix for c in recovery.CAUSES})
    assert all(f"rid={c.prefix}" in e and "+first" in e for c, e in zip(recovery.CAUSES, entries))
    assert decode["SGLANG_FORK_RECOVERY_ATTEMPTS"] == "1" and decode["SGLANG_LOG_MS"] == "1"
    from sglang.srt.disaggregation.fork_transfer.chunk_faults import FaultPlan

    assert len(FaultPlan.parse(prefill["SGLANG_TEST_DISAGG_FAIL_CHUNKS"]).faults) == len(recovery.CAUSES)


def test_readme_carries_the_line_the_benchs_block_writes(tmp_path, monkeypatch):
    """The line `summary_line` makes, written by `write_block` into a copy of bench/README.md, is what README.md's
    bench summary then shows (and the real bench/README.md's line, once the bench wrote one, is in README.md)."""
    copy = tmp_path / "README.md"
    copy.write_text(doc_tables.BENCH_README.read_text())
    monkeypatch.setattr(doc_tables, "BENCH_README", copy)
    s = {"added": recovery.spread([300.0, 320.0]), "detection": recovery.spread([90.0, 110.0]),
         "rerun": recovery.spread([400.0, 420.0]), "calm": recovery.spread([200.0]), "recovered": recovery.spread([510.0])}
    line = recovery.summary_line({"chunk_failure": s}, "2026-12-06, 2 CPUs")
    assert line == ("- **Recovery** (`make bench-recovery`): a recovered request, a KV chunk write failed on the first "
                    "attempt: +310 ms over a calm request (median of 2, quartiles 305-315; detection 100 ms, re-run "
                    "410 ms) (2026-12-06, 2 CPUs).")
    monkeypatch.setattr(doc_tables, "refresh_bench_summary", lambda: None)  # README.md itself is not written here
    write_block(copy, recovery.README_BEGIN, recovery.README_END, "figures\n\nREADME line: " + line, recovery.HEADING)
    assert line in doc_tables.bench_summary().splitlines()
