"""`make bench-recovery` (bench/recovery.py) without servers: the hold-back stamps it reads are the lines decode's
tokenizer really writes (data/recovery_decode.log: lines of the decode server's log from a run of this bench, its
`Recovery of <rid>: ...` warnings with `SGLANG_LOG_MS=1` among the others), its figures are the per-cycle
differences it says, one deployment serves every cause of its table, and README.md's bench summary carries the line
its block writes. Fast; starts no server (the bench itself is `make bench-recovery`, not part of the suite)."""

from __future__ import annotations

from datetime import datetime

import pytest

from bench import recovery
from testing import doc_tables

pytestmark = pytest.mark.unit

DATA = doc_tables.ROOT / "test" / "srt" / "release_gate" / "data"


def test_the_hold_back_stamps_are_read_from_decodes_real_log_lines():
    text = (DATA / "recovery_decode.log").read_text()
    held = recovery.parse_held_back(text)
    lines = [l for l in text.splitlines() if "Recovery of " in l and "its transfer failed" in l]
    assert lines and len(held) == len({l.split("Recovery of ")[1].split(":")[0] for l in lines}), held
    for line in lines:
        rid = line.split("Recovery of ")[1].split(":")[0]
        stamp = datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S.%f").timestamp()
        assert rid.startswith(recovery.CAUSES[0].prefix) and held[rid] == pytest.approx(stamp, abs=1e-6), (rid, line)
    # the other lines of the same log (the attempt's other warnings, ReqTimeStats, requests) are not stamps
    assert all("Recovery of " in l for l in text.splitlines() if recovery._HELD.match(l))


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


def test_readme_carries_the_line_the_benchs_block_writes():
    block = doc_tables.bench_block(doc_tables.BENCH_README.read_text(), "bench-recovery")
    line = next(l.removeprefix("README line: ") for l in block.splitlines() if l.startswith("README line: "))
    assert line.startswith("- **Recovery** (`make bench-recovery`)") and line in doc_tables.bench_summary()
