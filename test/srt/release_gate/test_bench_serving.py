"""`make bench-serving` (bench/serving.py) without servers: its command line is one upstream's own client parses
as meant, its dataset file feeds upstream's `random` sampling at the asked lengths, and its figures come from what
upstream's client and servers really wrote. The result lines in data/ were written by upstream's client
(`python -m sglang.benchmark.serving`, 0.5.23) in a smoke run of this bench against the fork and stock upstream
(`--rounds 1 --concurrency 1 2`, data/serving_fork.jsonl and data/serving_upstream.jsonl, as appended there), and
the ReqTimeStats lines (data/serving_time_stats.log) by that run's prefill and decode servers. Fast; starts no
server (the bench itself is `make bench-serving`, not part of the suite)."""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import serving
from testing.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.unit

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[3]


def saved_lines(side: str):
    return [json.loads(l) for l in (DATA / f"serving_{side}.jsonl").read_text().splitlines() if l.strip()]


def test_upstreams_client_parses_the_benchs_command_line(monkeypatch, tmp_path):
    """bench/serving.py's argv through upstream's own `cli_main` (its parser and checks), the run itself replaced:
    streaming sglang backend, the random dataset from the given file at fixed lengths, the concurrency bound."""
    from sglang.benchmark import serving as upstream_client

    seen = {}
    monkeypatch.setattr(upstream_client, "run_benchmark", lambda args: seen.setdefault("args", args))
    argv = serving.client_argv(sys.executable, "http://127.0.0.1:1", "/models/tiny", tmp_path / "d.json",
                               tmp_path / "out.jsonl", concurrency=4, num_prompts=16, input_len=128, output_len=32,
                               seed=3)
    assert argv[1:3] == ["-m", "sglang.benchmark.serving"]
    monkeypatch.setattr(sys, "argv", argv[2:])
    upstream_client.cli_main()
    a = seen["args"]
    assert (a.backend, a.base_url, a.dataset_name, a.dataset_path) == (
        "sglang", "http://127.0.0.1:1", "random", str(tmp_path / "d.json"))
    assert (a.random_input_len, a.random_output_len, a.random_range_ratio) == (128, 32, 1.0)
    assert (a.num_prompts, a.max_concurrency, a.request_rate, a.seed) == (16, 4, float("inf"), 3)
    assert not a.disable_stream and a.output_file == str(tmp_path / "out.jsonl")
    assert (a.model, a.tokenizer) == ("/models/tiny", "/models/tiny")


def test_the_dataset_file_feeds_upstreams_random_sampling_at_the_asked_lengths(tmp_path):
    """Upstream's own `random` sampling (token ids from ShareGPT-format conversations, here the bench's file of the
    tiny model's words, no download) with the tiny tokenizer: every prompt is the asked 128 tokens, output 32."""
    from transformers import AutoTokenizer

    from sglang.benchmark.datasets.random import sample_random_requests

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model(str(ROOT / ".cache" / "tiny-llama"))))
    path = serving.write_sharegpt(tmp_path / "sharegpt.json")
    random.seed(1)  # as upstream's client seeds them (--seed)
    np.random.seed(1)
    rows = sample_random_requests(128, 32, 20, 1.0, tokenizer, str(path))
    assert len(rows) == 20
    assert {(r.prompt_len, r.output_len) for r in rows} == {(128, 32)}
    # the prompt goes as text: 128 ids decoded, encoded again by the server (a cut word may split differently)
    lengths = [len(tokenizer.encode(r.prompt)) for r in rows]
    assert statistics.median(lengths) == 128 and all(120 <= n <= 136 for n in lengths), lengths


def test_ratios_come_from_upstreams_result_lines(tmp_path):
    """The result lines upstream's client wrote in the smoke run, read back through `read_result` (each from a file
    as the client leaves it), compared per concurrency: each figure the bench shows is the line's own value, and the
    ratio is fork / upstream of those values (one round: median and spread are that ratio)."""
    fork, upstream = saved_lines("fork"), saved_lines("upstream")
    assert len(fork) == len(upstream) >= 2
    results = {"fork": {}, "upstream": {}}
    for side, lines in (("fork", fork), ("upstream", upstream)):
        for i, line in enumerate(lines):
            path = tmp_path / f"{side}-{i}.jsonl"
            path.write_text(json.dumps(line) + "\n")
            r = serving.read_result(path)
            results[side][int(line["max_concurrency"])] = [r]
    cmp = serving.compare(results)
    assert sorted(cmp) == sorted(int(l["max_concurrency"]) for l in fork)
    for f, u in zip(fork, upstream):
        conc = int(f["max_concurrency"])
        assert u["max_concurrency"] == conc and f["completed"] == u["completed"] > 0
        for m in serving.METRICS:
            c = cmp[conc][m.key]
            assert (c["fork"], c["upstream"]) == (f[m.key], u[m.key])
            assert c["ratio"] == pytest.approx(f[m.key] / u[m.key])
            assert c["spread"] == (c["ratio"], c["ratio"])
    table = serving.ratio_table(cmp)
    conc = int(fork[-1]["max_concurrency"])
    row = next(l for l in table.splitlines() if l.startswith(f"| {conc} | output throughput"))
    assert f"| {fork[-1]['output_throughput']:.1f} | {upstream[-1]['output_throughput']:.1f} | " in row
    assert f"{fork[-1]['output_throughput'] / upstream[-1]['output_throughput']:.2f}" in row
    line = serving.summary_line(cmp, None)
    assert line.startswith("- **Upstream's client** (`make bench-serving`)") and "alone, TTFT p50" in line
    loaded = [c for c in cmp if c > 1]
    assert f"at concurrency {'/'.join(map(str, loaded))} " in line
    # a run at concurrency 1 alone has a line too (no loaded rows to summarise)
    alone = serving.summary_line({1: cmp[1]}, None)
    assert "alone, TTFT p50" in alone and "at concurrency" not in alone


def test_read_result_rejects_a_run_without_figures(tmp_path):
    """A line from a failed run (upstream writes its arguments but no figures) is an error, not zeros."""
    line = {k: v for k, v in saved_lines("fork")[0].items() if not k.endswith("_ms")}
    path = tmp_path / "failed.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match="median_ttft_ms"):
        serving.read_result(path)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no result line"):
        serving.read_result(tmp_path / "empty.jsonl")


def test_stage_durations_come_from_the_servers_time_stats_lines():
    """Upstream's ReqTimeStats log lines (`--enable-request-time-stats-logging`), as the smoke run's prefill and
    decode servers wrote them, read one server's log at a time (as the bench reads each server's log): each rid's
    stage durations in ms, exactly as printed."""
    lines = [l for l in (DATA / "serving_time_stats.log").read_text().splitlines() if "ReqTimeStats(" in l]
    for role, wanted in (("prefill", serving.PREFILL_STAGES), ("decode", serving.DECODE_STAGES)):
        mine = [l for l in lines if f"type={role})" in l]
        assert mine, f"no {role} line in the saved log"
        stamps = serving.parse_time_stats("\n".join(mine))
        assert len(stamps) == len(mine)
        for line in mine:
            rid = line.split("ReqTimeStats(rid=", 1)[1].split(",", 1)[0]
            for name in wanted:
                printed = line.split(f" {name}=", 1)[1].split("ms", 1)[0]
                assert stamps[rid][name] == float(printed)


def test_lone_figures_are_paired_differences_of_the_same_cycles():
    """fork - upstream is the median of the per-cycle differences (not a difference of medians), with the release
    gate's robust standard error; a cycle missing a stamp on either side is left out of that stage's pairs."""
    ttft = {"fork": [0.030, 0.040, 0.050], "fork-pace0": [0.029, 0.041, 0.048], "upstream": [0.031, 0.035, 0.049]}
    stages = {s: {"prefill bootstrap": [1.0, None, 3.0]} for s in ttft}
    stages["upstream"]["prefill bootstrap"] = [0.5, 2.0, None]
    lone = serving.lone_summary(ttft, stages, {s: 1.0 for s in ttft})
    diffs = [1e3 * (f - u) for f, u in zip(ttft["fork"], ttft["upstream"])]
    assert lone["fork_added_ms"] == pytest.approx(statistics.median(diffs))
    assert lone["fork_added_se"] == pytest.approx(serving.se_of_median(diffs))
    assert lone["stage_diffs"]["prefill bootstrap"]["vs upstream"][::2] == (pytest.approx(1.0 - 0.5), 1)
    assert "| TTFT at the client |" in serving.lone_table(lone)


def test_the_scheduler_thread_stages_are_summed_per_cycle_then_paired():
    """The lone request's decided figure: per cycle, the sum of the stages that run on one scheduler thread alone
    (serving.THREAD_STAGES), fork - upstream, median ± robust SE; a cycle missing any of them on either side is left
    out; the verdict holds the figure + 2 SE against the goal."""
    sides = ("fork", "fork-pace0", "upstream")
    ttft = {s: [0.03, 0.03, 0.03, 0.03] for s in sides}
    stages = {s: {k: [0.1, 0.1, 0.1, 0.1] for k in serving.THREAD_STAGES} for s in sides}
    stages["fork"]["decode bootstrap"] = [0.2, 0.3, None, 0.25]  # +0.1, +0.2, (left out), +0.15
    stages["fork"]["prefill forward"] = [9.0, 9.0, 9.0, 9.0]  # not a thread stage: not in the sum
    lone = serving.lone_summary(ttft, stages, {s: 1.0 for s in sides})
    assert lone["thread_n"] == 3
    assert lone["thread_added_ms"] == pytest.approx(0.15)
    assert lone["thread_added_se"] == pytest.approx(serving.se_of_median([0.1, 0.2, 0.15]))
    assert serving.thread_verdict(lone) == "within the 0.5 ms goal"
    stages["fork"]["decode queue"] = [1.1, 1.1, 1.1, 1.1]  # +1 ms on every cycle
    assert serving.thread_verdict(serving.lone_summary(ttft, stages, {s: 1.0 for s in sides})) == "OVER the 0.5 ms goal"
