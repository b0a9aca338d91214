"""The release gate's own logic (bench/release_gate.py, bench/baseline.py): ratios and
bounds, percentiles, the iteration count read from upstream's batch log lines, the
README block, and the baseline's import stand-ins. Fast; starts no server (the bench
itself is `make bench`, not part of the suite)."""

import os
import subprocess
import sys

import pytest

from bench import baseline, release_gate as gate

pytestmark = pytest.mark.unit


def test_percentile_nearest_rank():
    values = list(range(1, 201))  # 1..200
    assert gate.percentile(values, 50) == 100
    assert gate.percentile(values, 99) == 198
    assert gate.percentile(values, 100) == 200
    assert gate.percentile([3.0], 99) == 3.0


GATED = ("cpu_ms_per_req", "prefill_us_per_iter", "decode_us_per_iter")


def _metrics(cpu=50.0, prefill=20000.0, decode=5000.0, throughput=10.0, p50=1.0, p99=2.0):
    return {
        "cpu_ms_per_req": cpu, "prefill_us_per_iter": prefill, "decode_us_per_iter": decode,
        "throughput": throughput, "p50": p50, "p99": p99,
    }


def test_the_gate_judges_cpu_time_and_reports_wall_time():
    assert tuple(b.metric for b in gate.GATED) == GATED
    assert all(b.hi == 1.03 and b.ratio_name == "fork/upstream" for b in gate.GATED)
    info = {b.metric for b in gate.BOUNDS if not b.gated}
    assert info == {"throughput", "p50", "p99"}


def test_equal_sides_pass_and_each_cpu_bound_fails_just_outside():
    up = _metrics()
    assert all(r["ok"] for r in gate.evaluate(dict(up), up))

    def verdicts(fork):
        return {r["bound"].metric: r["ok"] for r in gate.evaluate(fork, up) if r["bound"].gated}

    assert all(verdicts(_metrics(cpu=51.4, prefill=20580.0, decode=5145.0)).values())  # 1.028
    for fork, metric in (
        (_metrics(cpu=51.6), "cpu_ms_per_req"),
        (_metrics(prefill=20620.0), "prefill_us_per_iter"),
        (_metrics(decode=5155.0), "decode_us_per_iter"),
    ):
        v = verdicts(fork)
        assert v.pop(metric) is False, metric
        assert all(v.values()), (metric, v)


def test_medians_over_rounds():
    runs = [_metrics(cpu=1), _metrics(cpu=3), _metrics(cpu=2, p50=100)]
    m = gate.medians(runs)
    assert m["cpu_ms_per_req"] == 2 and m["p50"] == 1.0


def test_gate_judges_the_median_of_per_round_ratios():
    # The machine's speed changes between rounds (load from elsewhere) and the fork
    # uses 5% more CPU than upstream in 2 of 3 rounds. Per-side medians (fork 52.5,
    # upstream 100) would pass it at 0.53; the per-round ratios (1.05, 1.05, 0.5) fail.
    up = [_metrics(cpu=50.0), _metrics(cpu=100.0), _metrics(cpu=100.0)]
    fork = [_metrics(cpu=52.5), _metrics(cpu=105.0), _metrics(cpu=50.0)]
    rows = {r["bound"].metric: r for r in gate.evaluate_rounds(fork, up)}
    assert rows["cpu_ms_per_req"]["ratio"] == pytest.approx(1.05)
    assert rows["cpu_ms_per_req"]["ok"] is False
    assert rows["cpu_ms_per_req"]["spread"] == (pytest.approx(0.5), pytest.approx(1.05))
    assert (rows["cpu_ms_per_req"]["fork"], rows["cpu_ms_per_req"]["upstream"]) == (52.5, 100.0)


def test_robust_standard_error_of_the_median():
    # MAD of (1.00, 1.01, 1.02, 1.03, 1.10) around 1.02 is 0.01: sigma 0.014826,
    # SE 1.2533 * 0.014826 / sqrt(5). The outlier round (1.10) does not inflate it.
    se = gate.se_of_median([1.00, 1.01, 1.02, 1.03, 1.10])
    assert se == pytest.approx(1.2533 * 1.4826 * 0.01 / 5 ** 0.5, rel=1e-6)
    assert gate.se_of_median([1.0]) == float("inf")


def test_rounds_to_decide_follows_the_standard_error():
    # n=5 rounds, SE 0.02, median 0.02 from the bound: z*SE = 0.04, twice the
    # distance, so the SE must halve: 4x the rounds.
    assert gate.rounds_to_decide(5, 0.02, 0.02, z=2.0) == 20
    assert gate.rounds_to_decide(5, 0.02, 0.0) is None  # median on the bound
    assert gate.rounds_to_decide(5, 0.001, 0.02) == 6  # always at least one more round


def _rounds(ratios, metric="cpu_ms_per_req", **up_kw):
    up = [_metrics(**up_kw) for _ in ratios]
    key = {"cpu_ms_per_req": "cpu", "prefill_us_per_iter": "prefill", "decode_us_per_iter": "decode"}[metric]
    fork = [_metrics(**{**up_kw, key: _metrics(**up_kw)[metric] * r}) for r in ratios]
    return fork, up


def test_verdict_pass_fail_and_inconclusive_on_cpu_ratios():
    fork, up = _rounds([0.99, 1.00, 1.005, 1.01, 0.995])
    outcome, lines = gate.verdict(gate.evaluate_rounds(fork, up))
    assert outcome == "PASS" and gate.EXIT[outcome] == 0, lines

    fork, up = _rounds([1.08, 1.10, 1.09, 1.11, 1.10], metric="decode_us_per_iter")
    outcome, lines = gate.verdict(gate.evaluate_rounds(fork, up))
    assert outcome == "FAIL" and gate.EXIT[outcome] == 1
    assert [l for l in lines if l.startswith("GATE FAILED")] == [
        l for l in lines if l.startswith("GATE FAILED: decode scheduler CPU")
    ] != []

    # Per-round ratios 0.90..1.12 around 1.01: the median is under the bound, but by
    # less than the noise: no verdict, and an estimate of the rounds that would decide.
    fork, up = _rounds([0.90, 0.97, 1.01, 1.06, 1.12])
    rows = gate.evaluate_rounds(fork, up)
    outcome, lines = gate.verdict(rows)
    assert outcome == "INCONCLUSIVE" and gate.EXIT[outcome] == 3
    row = next(r for r in rows if r["bound"].metric == "cpu_ms_per_req")
    need = gate.rounds_to_decide(5, row["se"], 1.03 - 1.01)
    assert need is not None and need > 5
    noisy = [l for l in lines if l.startswith("TOO NOISY")]
    assert len(noisy) == 1 and noisy[0].startswith("TOO NOISY: CPU ms per request")
    assert f"--rounds {need}" in noisy[0]


def test_wall_time_noise_alone_does_not_block_a_verdict():
    up = [_metrics(throughput=10.0, p99=2.0)] * 5
    fork = [_metrics(throughput=t, p99=p) for t, p in ((7.0, 4.0), (13.0, 1.0), (9.0, 3.0), (12.0, 2.0), (8.0, 2.5))]
    rows = gate.evaluate_rounds(fork, up)
    assert not next(r for r in rows if r["bound"].metric == "p99")["ok"]  # shown, not judged
    assert gate.verdict(rows)[0] == "PASS"


def test_a_decided_failure_wins_over_noise_and_too_few_rounds_never_decide():
    fork, up = _rounds([1.30, 1.32, 1.31, 1.29, 1.30])
    noisy_prefill = [dict(f, prefill_us_per_iter=20000.0 * r) for f, r in zip(fork, (0.8, 1.2, 1.0, 0.9, 1.1))]
    assert gate.verdict(gate.evaluate_rounds(noisy_prefill, up))[0] == "FAIL"
    fork, up = _rounds([1.0, 1.0])
    outcome, lines = gate.verdict(gate.evaluate_rounds(fork, up))
    assert outcome == "INCONCLUSIVE"


def test_output_tokens_must_be_identical():
    assert gate.token_mismatches([[1, 2], [3, 4]], [[1, 2], [3, 4]]) == 0
    assert gate.token_mismatches([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == 1
    assert gate.token_mismatches([[1, 2]], [[1, 2], [3, 4]]) == 2
    fork, up = _rounds([1.0, 1.0, 1.0, 1.0, 1.0])
    outcome, lines = gate.verdict(gate.evaluate_rounds(fork, up), token_mismatches=3)
    assert outcome == "FAIL"
    assert "GATE FAILED: output tokens differ between fork and upstream for 3 requests" in lines


def test_forward_iterations_from_upstream_log_lines():
    log = (
        b"[2026-11-29 22:57:53] Prefill batch [6], #new-seq: 1, #new-token: 11, #cached-token: 2\n"
        b"[2026-11-29 22:57:56] Decode batch [41], #running-req: 5, #token: 170\n"
        b"[2026-11-29 22:57:56] Decode batch [42], #running-req: 4, #token: 0\n"
        b"[2026-11-29 22:57:57] Decode batch, #running-req: 4 (no iteration number)\n"
    )
    assert gate.max_forward_iter(log) == 42
    assert gate.max_forward_iter(b"no batches yet\n") == 0


def test_write_readme_replaces_only_the_block(tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\nbefore\n{gate.README_BEGIN}\nold figures\n{gate.README_END}\nafter\n")
    monkeypatch.setattr(gate, "README", readme)
    gate.write_readme("new figures")
    assert readme.read_text() == f"# title\nbefore\n{gate.README_BEGIN}\nnew figures\n{gate.README_END}\nafter\n"
    # the hook table gets its own block (appended the first time, replaced after)
    gate.write_readme("hooks 1", gate.HOOKS_BEGIN, gate.HOOKS_END, "## Cost of each hook")
    gate.write_readme("hooks 2", gate.HOOKS_BEGIN, gate.HOOKS_END, "## Cost of each hook")
    text = readme.read_text()
    assert text.count("## Cost of each hook") == 1 and "hooks 2" in text and "hooks 1" not in text
    assert f"{gate.README_BEGIN}\nnew figures\n{gate.README_END}" in text


def test_baseline_standins_import_and_refuse_use(tmp_path):
    folder = baseline.write_standins(tmp_path)
    code = """
import pytest
from sgl_kernel import some_kernel_cpu
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import InterpolationMode
import torchvision.transforms.functional as F
with pytest.raises(RuntimeError, match="bench stand-in"):
    some_kernel_cpu(1)
with pytest.raises(RuntimeError, match="bench stand-in"):
    decode_image(b"")
with pytest.raises(RuntimeError, match="bench stand-in"):
    InterpolationMode.BICUBIC()
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": str(folder), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _run_py(code, pythonpath):
    env = {"PYTHONPATH": pythonpath, "PATH": "/usr/bin:/bin", "SGLANG_USE_CPU_ENGINE": "1"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_slowdown_plugin_is_found_and_busy_loops_in_its_hook(tmp_path):
    """The deliberately slower fork: an extra `sglang.srt.plugins` entry point whose
    BEFORE hook on pop_transferred spends the asked CPU time."""
    folder = baseline.write_slowdown_plugin(tmp_path / "slow", 2000)
    code = """
import time
from importlib.metadata import entry_points
names = {e.name for e in entry_points(group="sglang.srt.plugins")}
assert "fork_bench_slowdown" in names, names
import fork_bench_slowdown as f
from sglang.srt.plugins.hook_registry import HookRegistry
f.register()
(hook_type, hook, _), = HookRegistry._hooks["sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred"]
t0 = time.thread_time(); hook(None); spent = time.thread_time() - t0
assert hook_type.value == "before" and spent >= 0.0019, spent
print("ok")
"""
    out = _run_py(code, str(folder))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_probe_plugin_splits_scheduler_cpu_into_busy_and_idle_passes(tmp_path):
    """The plugin both sides load: idle passes (on_idle called) are paced and counted
    apart from passes that ran a batch; the totals land in <pid>.json when fully idle."""
    folder = baseline.write_probe_plugin(tmp_path / "probe", tmp_path / "out", pace_s=0.002)
    code = """
import json, os, time
import fork_bench_probe as p
from sglang.srt.plugins.hook_registry import HookRegistry
p.register()
assert {"sglang.srt.managers.scheduler.Scheduler.on_idle",
        "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.process_decode_queue",
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.get_next_disagg_prefill_batch_to_run",
       } <= set(HookRegistry._hooks)

def burn(s):
    end = time.thread_time() + s
    while time.thread_time() < end:
        pass

class Sched:
    fully_idle = False
    def is_fully_idle(self):
        return self.fully_idle

s = Sched()
p.pass_boundary()            # first pass starts
burn(0.02)                   # a batch runs
p.pass_boundary()            # second pass: finds nothing
burn(0.005)
t0 = time.monotonic(); p.paced_on_idle(lambda sch: None, s); paced = time.monotonic() - t0
p.pass_boundary()
s.fully_idle = True
p.paced_on_idle(lambda sch: None, s)
d = json.load(open(os.path.join(p.OUT, f"{os.getpid()}.json")))
assert d["busy_passes"] == 1 and d["idle_passes"] == 1, d
assert 0.019 <= d["busy_cpu"] < 0.03 and 0.004 <= d["idle_cpu"] < 0.015, d
assert paced >= 0.002, paced
print("ok")
"""
    out = _run_py(code, str(folder))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_hook_switch_restores_upstream_callables_and_back():
    """bench/hook_cost.py's on/off switch: off gives every HOOKS target the callable
    HookRegistry wrapped (no hook_registry wrapper left), on gives the patched one."""
    from bench import hook_cost

    switch = hook_cost.HookSwitch()
    assert set(switch.targets) == {t for t, _, _ in hook_cost.fork_plugin.HOOKS}

    def current(target):
        owner_path, attr = target.rsplit(".", 1)
        owner = hook_cost.pkgutil.resolve_name(owner_path)
        raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        return getattr(raw, "__func__", raw)

    try:
        switch.set(False)
        for target in switch.targets:
            assert not current(target).__code__.co_filename.endswith("hook_registry.py"), target
        from sglang.srt.disaggregation import utils as pd_utils
        from sglang.srt.disaggregation import prefill as pd_prefill
        assert pd_prefill.prepare_abort is pd_utils.prepare_abort  # propagated copies follow
        switch.set(True)
        for target, (raw, _) in switch.targets.items():
            assert current(target) is getattr(raw, "__func__", raw), target
    finally:
        switch.set(True)


def test_hook_cost_runs_over_the_real_queues_at_small_counts():
    from bench import hook_cost

    results, _ = hook_cost.run_passes([20, 40], budget_s=0.05, log=lambda m: None)
    stages = {(r["side"], r["stage"]) for r in results}
    assert stages == {(side, stage) for side, stage, _ in hook_cost.STAGES}
    assert all(r["on_us"] > 0 and r["off_us"] > 0 and r["pairs"] >= 15 for r in results)
    # each pass runs exactly the fork hooks on its own method (transfer deadline's BEFORE) and on the poll's
    # all-reduce (room_agreement's AROUND: with one rank and nothing failed it shares nothing)
    called = {r["stage"]: r["called"] for r in results if r["n"] == 40}
    assert called["transfer"] == {"sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred": 1,
                                  "sglang.srt.disaggregation.utils.poll_and_all_reduce": 1}


def test_work_dir_is_removed_after_a_run_and_kept_when_it_failed_or_was_asked_for(tmp_path, monkeypatch, capsys):
    """bench.work_dir (release_gate, rl_step, transfer): a run that reached its end (a return inside the block)
    leaves nothing; one that raised, or --keep-logs, keeps the dir and names it on stderr."""
    import tempfile

    from bench.work_dir import work_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def run(keep: bool, fail: bool) -> str:
        with work_dir("sglang-bench-test-", keep) as work:
            (work / "logs").mkdir()
            if fail:
                raise RuntimeError(str(work))
            return str(work)

    done = run(keep=False, fail=False)
    assert done.startswith(str(tmp_path / "sglang-bench-test-")) and not os.path.exists(done)
    assert capsys.readouterr().err == ""
    kept = run(keep=True, fail=False)
    assert os.path.isdir(os.path.join(kept, "logs")) and capsys.readouterr().err == f"logs kept in {kept}\n"
    with pytest.raises(RuntimeError) as err:
        run(keep=False, fail=True)
    failed = str(err.value)
    assert os.path.isdir(failed) and capsys.readouterr().err == f"logs kept in {failed}\n"
