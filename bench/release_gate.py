"""Release gate (`make bench`): the fork against stock upstream 0.5.23, same run, same
tiny model, 1 prefill + 1 decode + mini load balancer on CPU.

Both deployments are started once, side by side, with the same flags and env (see
bench/baseline.py); then each round runs the same load on both, alternating which
side goes first (A B, B A, ...), so machine load hits both alike. Per run: N
requests (default 200) at concurrency C (default 8), greedy, `ignore_eos`, fixed
output length. Reported per side as the median over rounds:

- throughput (requests/s) and p50/p99 request latency;
- scheduler-loop cost: CPU seconds (user+system, psutil) the prefill and decode
  scheduler processes spent during the run, divided by the number of scheduler
  iterations that ran a forward pass (forward_ct, from upstream's own
  `SGLANG_LOG_FORWARD_ITERS` batch log lines), in microseconds per iteration.

Gate (exit 0 pass, 1 when a bound is missed, 2 when the bench itself failed, 3 when
the rounds disagree too much to judge a 3% bound: INCONCLUSIVE), on the
median over rounds of each round's fork/upstream ratio (the two runs of a round are
back to back, so load that drifts over minutes cancels within a round):
fork/upstream throughput >= 0.97, upstream/fork p50 and p99 latency >= 0.97 (the fork
at most ~3% slower), fork/upstream scheduler µs per iteration <= 1.03.

Usage: python -m bench.release_gate [--rounds N] [--requests N] [--concurrency N]
         [--max-new-tokens N] [--write-readme] [--keep-logs]
Servers run under $SGLANG_FORK_PYTHON (default: this interpreter), which must have
the fork installed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import psutil

from bench import baseline
from bench.readme_block import write_block
from bench.work_dir import work_dir
from testing.pd_cluster import (
    PDCluster,
    Server,
    fork_python,
    http_post_json,
    prompts,
    start_all,
    wait_until,
)
from testing.tiny_model import ensure_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "bench" / "README.md"  # the figures of record; README.md summarises them (testing/doc_tables.py)
README_BEGIN = "<!-- release-gate:begin (written by `make bench ARGS=--write-readme`) -->"
README_END = "<!-- release-gate:end -->"
HOOKS_BEGIN = "<!-- hook-cost:begin (written by `make bench ARGS=--write-readme`) -->"
HOOKS_END = "<!-- hook-cost:end -->"

SIDES = ("fork", "upstream")
SCHEDULER_ROLES = ("prefill", "decode")
_ITER_LINE = re.compile(rb"(?:Prefill|Decode) batch \[(\d+)\]")


# ----------------------------------------------------------------------------- gate logic


@dataclass(frozen=True)
class Bound:
    """fork vs upstream for one metric: `ratio` is oriented so that bigger is better
    for the fork when higher_is_better, and the gate is ratio >= lo or ratio <= hi.
    `gated` bounds decide the verdict; the others are printed for information."""

    metric: str
    label: str
    higher_is_better: bool  # of the raw metric
    lo: Optional[float] = None  # ratio must be >= lo
    hi: Optional[float] = None  # ratio must be <= hi
    ratio_name: str = "fork/upstream"
    gated: bool = True

    def ratio(self, fork: float, upstream: float) -> float:
        if self.ratio_name == "upstream/fork":
            return upstream / fork
        return fork / upstream

    def ok(self, ratio: float) -> bool:
        return (self.lo is None or ratio >= self.lo) and (self.hi is None or ratio <= self.hi)

    @property
    def limit(self) -> float:
        return self.lo if self.lo is not None else self.hi  # type: ignore[return-value]

    def bound_text(self) -> str:
        text = f"{self.ratio_name} >= {self.lo}" if self.lo is not None else f"{self.ratio_name} <= {self.hi}"
        return text if self.gated else f"(info; was {text})"


# What the gate judges: CPU time, which other tenants of the machine move far less
# than wall time. Wall-time figures stay in the table, for information.
BOUNDS = (
    Bound("cpu_ms_per_req", "CPU ms per request, both servers (tokenizers, detokenizers, scheduler busy passes)", False, hi=1.03),
    Bound("prefill_us_per_iter", "prefill scheduler CPU µs per iteration (busy pass)", False, hi=1.03),
    Bound("decode_us_per_iter", "decode scheduler CPU µs per iteration (busy pass)", False, hi=1.03),
    Bound("throughput", "throughput (req/s)", True, lo=0.97, gated=False),
    Bound("p50", "latency p50 (s)", False, lo=0.97, ratio_name="upstream/fork", gated=False),
    Bound("p99", "latency p99 (s)", False, lo=0.97, ratio_name="upstream/fork", gated=False),
)
GATED = tuple(b for b in BOUNDS if b.gated)

# A gated metric is decided when its median per-round ratio is at least Z robust
# standard errors of the median away from the bound (two-sided ~95%).
Z = 2.0
MIN_ROUNDS = 3  # fewer rounds give no spread estimate: never a verdict


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n*q/100), at least 1
    return ordered[int(rank) - 1]


def medians(runs: Sequence[Dict[str, float]]) -> Dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def evaluate(fork: Dict[str, float], upstream: Dict[str, float]) -> List[Dict[str, object]]:
    """One row per bound: values, ratio, pass/fail (one pair of measurements)."""
    rows = []
    for b in BOUNDS:
        r = b.ratio(fork[b.metric], upstream[b.metric])
        rows.append({"bound": b, "fork": fork[b.metric], "upstream": upstream[b.metric], "ratio": r, "ok": b.ok(r)})
    return rows


def se_of_median(values: Sequence[float]) -> float:
    """Robust standard error of the median of `values`: sigma from the median absolute
    deviation (1.4826 MAD, which one co-tenant burst in one round does not inflate the
    way it inflates the standard deviation), times sqrt(pi/2) / sqrt(n)."""
    n = len(values)
    if n < 2:
        return float("inf")
    m = statistics.median(values)
    sigma = 1.4826 * statistics.median(abs(v - m) for v in values)
    return 1.2533 * sigma / math.sqrt(n)


def rounds_to_decide(n: int, se: float, distance: float, z: float = Z) -> Optional[int]:
    """Rounds in total after which a median `distance` away from the bound would be
    `z` standard errors away, assuming the per-round spread stays what `n` rounds
    showed (the standard error falls as 1/sqrt(rounds)): n * (z * se / distance)^2.
    None when the median sits on the bound (no number of rounds decides it)."""
    if distance <= 0 or not math.isfinite(se):
        return None
    return max(n + 1, math.ceil(n * (z * se / distance) ** 2))


def evaluate_rounds(fork_runs: Sequence[Dict[str, float]], up_runs: Sequence[Dict[str, float]], z: float = Z) -> List[Dict[str, object]]:
    """One row per bound, judged on the median of the per-round ratios: each round
    measures the two sides back to back, so a ratio within a round cancels load that
    drifts over minutes (a ratio of medians over rounds does not). Values are the
    per-side medians; `spread` is the (min, max) per-round ratio; `se` the robust
    standard error of the median ratio; `decided` whether the median is `z` standard
    errors from the bound (so `ok` is a verdict, not noise)."""
    rows = []
    for b in BOUNDS:
        per_round = [b.ratio(f[b.metric], u[b.metric]) for f, u in zip(fork_runs, up_runs)]
        r = statistics.median(per_round)
        se = se_of_median(per_round)
        distance = abs(r - b.limit)
        decided = len(per_round) >= MIN_ROUNDS and distance > z * se
        rows.append({
            "bound": b,
            "fork": statistics.median(f[b.metric] for f in fork_runs),
            "upstream": statistics.median(u[b.metric] for u in up_runs),
            "ratio": r, "per_round": per_round, "spread": (min(per_round), max(per_round)),
            "se": se, "ok": b.ok(r), "decided": decided,
            "rounds_needed": None if decided else rounds_to_decide(len(per_round), se, distance, z),
        })
    return rows


EXIT = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}


def verdict(rows: List[Dict[str, object]], token_mismatches: int = 0, n_rounds: Optional[int] = None):
    """The gate's outcome from the gated (CPU) rows and the output-token comparison.
    FAIL when the two sides' output tokens differ for any request, or when a CPU
    bound is missed by more than the rounds' noise (decided); PASS when every CPU
    bound is met by more than the noise; otherwise INCONCLUSIVE, with the number of
    rounds that would decide it. Wall-time rows never change the outcome.
    Returns (outcome, lines to print)."""
    lines = []
    gated = [r for r in rows if r["bound"].gated]  # type: ignore[union-attr]
    failed, undecided = [], []
    for r in gated:
        b: Bound = r["bound"]  # type: ignore[assignment]
        if not r["decided"]:
            undecided.append(r)
            lo, hi = r["spread"]  # type: ignore[misc]
            need = r["rounds_needed"]
            more = (
                f"about {need} rounds in all (--rounds {need}) would decide it" if need is not None
                else "the median sits on the bound: more rounds cannot decide it"
            )
            lines.append(
                f"TOO NOISY: {b.label}: {b.ratio_name} median {r['ratio']:.3f} ± {r['se']:.3f} (robust SE; "
                f"per round {lo:.3f}..{hi:.3f}) is within {Z:g} SE of the bound {b.limit}; {more}"
            )
        elif not r["ok"]:
            failed.append(r)
            lines.append(f"GATE FAILED: {b.label}: {b.ratio_name} = {r['ratio']:.3f} ± {r['se']:.3f}, bound {b.bound_text()}")
    if token_mismatches:
        lines.append(f"GATE FAILED: output tokens differ between fork and upstream for {token_mismatches} requests")
    if failed or token_mismatches:
        outcome = "FAIL"
    elif undecided:
        outcome = "INCONCLUSIVE"
    else:
        outcome = "PASS"
    rounds = f" over {n_rounds} rounds" if n_rounds else ""
    lines.append(f"Verdict: {outcome}{rounds} (judged on CPU time; wall-time rows are information).")
    return outcome, lines


def max_forward_iter(log_bytes: bytes) -> int:
    """The highest forward_ct in a server log's batch lines (0 if none)."""
    return max((int(m) for m in _ITER_LINE.findall(log_bytes)), default=0)


# ----------------------------------------------------------------------------- machine


def machine() -> Dict[str, str]:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": str(os.cpu_count()),
        "cpu": model,
        "mem_gb": f"{psutil.virtual_memory().total / 2**30:.0f}",
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ----------------------------------------------------------------------------- load


def one_request(url: str, text: str, max_new_tokens: int) -> Dict[str, object]:
    payload = {
        "text": text,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    t0 = time.monotonic()
    status, body = http_post_json(url + "/generate", payload, timeout=300)
    latency = time.monotonic() - t0
    ok = status == 200 and isinstance(body, dict)
    output_ids = list(body.get("output_ids") or []) if ok else []
    return {
        "status": status, "latency": latency, "tokens": len(output_ids), "output_ids": output_ids,
        "error": None if ok else str(body)[:300],
    }


def run_load(url: str, texts: Sequence[str], concurrency: int, max_new_tokens: int) -> Dict[str, object]:
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda t: one_request(url, t, max_new_tokens), texts))
    wall = time.monotonic() - t0
    failed = [r for r in results if r["status"] != 200 or r["tokens"] != max_new_tokens]
    return {"results": results, "wall": wall, "failed": failed}


def token_mismatches(fork_outputs: Sequence[Sequence[int]], up_outputs: Sequence[Sequence[int]]) -> int:
    """Requests (same prompt, same position) whose output token ids differ."""
    if len(fork_outputs) != len(up_outputs):
        return max(len(fork_outputs), len(up_outputs))
    return sum(list(f) != list(u) for f, u in zip(fork_outputs, up_outputs))


# ----------------------------------------------------------------------------- one side


def process_role(proc: psutil.Process, root_pid: int) -> str:
    """Which part of a server a process is: its launch process is the HTTP server and
    tokenizer; its children carry upstream's process titles."""
    if proc.pid == root_pid:
        return "tokenizer"
    title = " ".join(proc.cmdline())
    for role in ("scheduler", "detokenizer"):
        if f"sglang::{role}" in title:
            return role
    return "other"


def cpu_snapshot(cluster: PDCluster) -> Dict[str, Dict[str, float]]:
    """CPU seconds (user + system) so far of every live process of the deployment, per
    server ("prefill", "decode", "lb") and part: tokenizer, detokenizer, other, and
    the scheduler split into its loop thread ("scheduler") and its other threads
    ("scheduler_threads": mooncake's transfer workers, which poll while a transfer
    runs, gloo, zmq)."""
    out: Dict[str, Dict[str, float]] = {}
    for name, server in cluster.servers.items():
        pids = server.pids()
        per: Dict[str, float] = {}
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                role = "balancer" if name == "lb" else process_role(proc, pids[0])
                t = proc.cpu_times()
                total = t.user + t.system
                if role == "scheduler":
                    main = sum(th.user_time + th.system_time for th in proc.threads() if th.id == pid)
                    per["scheduler_threads"] = per.get("scheduler_threads", 0.0) + total - main
                    total = main
            except psutil.NoSuchProcess:
                continue
            per[role] = per.get(role, 0.0) + total
        out[name] = per
    return out


def cpu_delta(before: Dict[str, Dict[str, float]], after: Dict[str, Dict[str, float]]) -> Dict[str, Dict[str, float]]:
    return {
        name: {role: after[name][role] - before.get(name, {}).get(role, 0.0) for role in after[name]}
        for name in after
    }


@dataclass
class Side:
    name: str
    cluster: PDCluster
    probe_dir: Path
    runs: List[Dict[str, float]] = field(default_factory=list)
    outputs: List[List[List[int]]] = field(default_factory=list)  # per run, per request
    version: str = ""

    def scheduler_pid(self, role: str) -> int:
        server = self.cluster[role]
        pids = server.pids()
        found = [pid for pid in pids[1:] if process_role(psutil.Process(pid), pids[0]) == "scheduler"]
        if len(found) != 1:
            raise RuntimeError(f"{self.name} {role}: expected one scheduler process, found {found}")
        return found[0]

    def iterations(self) -> Dict[str, int]:
        """forward_ct so far of each scheduler (from its server's log)."""
        return {role: max_forward_iter(self.cluster[role].log_path.read_bytes()) for role in SCHEDULER_ROLES}

    def probe(self) -> Dict[str, Optional[Dict[str, float]]]:
        """Each scheduler's pass accounting, as the probe plugin last wrote it."""
        out: Dict[str, Optional[Dict[str, float]]] = {}
        for role in SCHEDULER_ROLES:
            path = self.probe_dir / f"{self.scheduler_pid(role)}.json"
            try:
                out[role] = json.loads(path.read_text())
            except (OSError, ValueError):
                out[role] = None
        return out

    def settled(self, since: float):
        """(iterations, probe, cpu snapshot) once both schedulers are fully idle: each
        wrote its pass accounting twice after `since` (wall clock) with the same
        number of busy passes, and the log's iteration counts stopped moving."""
        last: Dict[str, object] = {}

        def stable():
            iters, probe = self.iterations(), self.probe()
            if any(v is None or v["t"] <= since for v in probe.values()):
                return None
            key = (iters, {r: probe[r]["busy_passes"] for r in SCHEDULER_ROLES})  # type: ignore[index]
            stamps = {r: probe[r]["t"] for r in SCHEDULER_ROLES}  # type: ignore[index]
            ref = last.get("v")
            if ref is None or ref[0] != key:
                last["v"] = (key, stamps)  # (re)start from this reading
                return None
            if all(stamps[r] > ref[1][r] for r in SCHEDULER_ROLES):  # each wrote again, unchanged
                return iters, probe, cpu_snapshot(self.cluster)
            return None

        return wait_until(stable, 60, f"{self.name}: schedulers to settle (probe plugin totals)", interval=0.3)


def tree_cpu(cluster: PDCluster) -> float:
    """CPU seconds so far of every process of a deployment (servers, their children, LB)."""
    return sum(sum(per.values()) for per in cpu_snapshot(cluster).values())


WORK_ROLES = ("tokenizer", "detokenizer", "other")  # whole processes counted as work


def measure(side: Side, idle: Side, texts: Sequence[str], concurrency: int, max_new_tokens: int) -> Dict[str, float]:
    """One run on `side` alone; `idle` is the other deployment, whose CPU use during
    the run is recorded (it should be near zero: it must not compete with the side
    measured)."""
    before = side.settled(time.time())
    idle_before = tree_cpu(idle.cluster)
    load = run_load(side.cluster.url, texts, concurrency, max_new_tokens)
    idle_after = tree_cpu(idle.cluster)
    after = side.settled(time.time())
    return account(side, before, after, load, texts, max_new_tokens, idle_after - idle_before)


def measure_together(sides: Sequence[Side], texts: Sequence[str], concurrency: int, max_new_tokens: int) -> List[Dict[str, float]]:
    """One run on every side at the same time (same requests, one client pool each):
    whatever the machine's other tenants do during the run, they do it to both sides
    at once, so it cancels in the round's ratio."""
    befores = [s.settled(time.time()) for s in sides]
    with ThreadPoolExecutor(max_workers=len(sides)) as pool:
        loads = list(pool.map(lambda s: run_load(s.cluster.url, texts, concurrency, max_new_tokens), sides))
    afters = [s.settled(time.time()) for s in sides]
    return [account(s, b, a, l, texts, max_new_tokens, 0.0) for s, b, a, l in zip(sides, befores, afters, loads)]


def account(side: Side, before, after, load, texts: Sequence[str], max_new_tokens: int, idle_side_cpu: float) -> Dict[str, float]:
    """A run's figures from the settled readings before and after it."""
    iters_before, probe_before, cpu_before = before
    iters_after, probe_after, cpu_after = after
    if load["failed"]:
        first = load["failed"][0]
        raise RuntimeError(
            f"{side.name}: {len(load['failed'])}/{len(texts)} requests failed, e.g. "
            f"status {first['status']} tokens {first['tokens']}: {first['error']}"
        )
    n = len(texts)
    lat = [r["latency"] for r in load["results"]]
    cpu = cpu_delta(cpu_before, cpu_after)
    iters = {r: iters_after[r] - iters_before[r] for r in SCHEDULER_ROLES}
    probe = {
        r: {k: probe_after[r][k] - probe_before[r][k] for k in ("busy_cpu", "idle_cpu", "busy_passes", "idle_passes")}  # type: ignore[index]
        for r in SCHEDULER_ROLES
    }
    if min(iters.values()) <= 0 or min(probe[r]["busy_passes"] for r in SCHEDULER_ROLES) <= 0:
        raise RuntimeError(f"{side.name}: no scheduler iterations counted ({iters}, {probe}); logs in {side.cluster.log_dir}")
    work = sum(cpu[s].get(role, 0.0) for s in SCHEDULER_ROLES for role in WORK_ROLES)
    work += sum(probe[s]["busy_cpu"] for s in SCHEDULER_ROLES)
    run = {
        "cpu_ms_per_req": 1e3 * work / n,
        "prefill_us_per_iter": 1e6 * probe["prefill"]["busy_cpu"] / probe["prefill"]["busy_passes"],
        "decode_us_per_iter": 1e6 * probe["decode"]["busy_cpu"] / probe["decode"]["busy_passes"],
        "throughput": n / load["wall"],
        "p50": percentile(lat, 50),
        "p99": percentile(lat, 99),
        "tokens_per_s": n * max_new_tokens / load["wall"],
        "all_cpu_ms_per_req": 1e3 * sum(sum(cpu[s].values()) for s in SCHEDULER_ROLES) / n,
        "balancer_cpu_ms_per_req": 1e3 * sum(cpu["lb"].values()) / n,
        "idle_side_cpu_s": idle_side_cpu,
    }
    for s in SCHEDULER_ROLES:
        run[f"{s}_busy_passes"] = probe[s]["busy_passes"]
        run[f"{s}_forward_iters"] = iters[s]
        run[f"{s}_idle_passes"] = probe[s]["idle_passes"]
        run[f"{s}_scheduler_busy_cpu_ms_per_req"] = 1e3 * probe[s]["busy_cpu"] / n
        run[f"{s}_scheduler_idle_cpu_ms_per_req"] = 1e3 * probe[s]["idle_cpu"] / n
        run[f"{s}_scheduler_threads_cpu_ms_per_req"] = 1e3 * cpu[s].get("scheduler_threads", 0.0) / n
        for role in ("tokenizer", "detokenizer"):
            run[f"{s}_{role}_cpu_ms_per_req"] = 1e3 * cpu[s].get(role, 0.0) / n
    side.runs.append(run)
    side.outputs.append([list(r["output_ids"]) for r in load["results"]])
    return run


def verify_side(side: Side, expected_version: str, fork_expected: bool) -> str:
    """What sglang each server runs: version from /server_info, and whether the
    fork's resource report (present only when the fork's code and plugin run) is there."""
    seen = []
    for role in SCHEDULER_ROLES:
        info = side.cluster[role].server_info()
        version = info.get("version")
        has_fork = any("fork_pd_resources" in s for s in info.get("internal_states", []))
        if version != expected_version or has_fork != fork_expected:
            raise RuntimeError(
                f"{side.name} {role} runs sglang {version} (fork report: {has_fork}); "
                f"expected {expected_version} (fork report: {fork_expected})"
            )
        seen.append(f"{role}={version}{' +fork plugin' if has_fork else ''}")
    return ", ".join(seen)


# ----------------------------------------------------------------------------- output


def fmt(x: float) -> str:
    if float(x).is_integer() or x >= 100:
        return f"{x:.0f}"
    return f"{x:.3f}"


def table(rows: List[Dict[str, object]], fork: Dict[str, float], upstream: Dict[str, float]) -> str:
    lines = [
        "| metric (median of rounds) | fork | upstream | ratio (median of per-round ratios) ± robust SE "
        "| min..max per round | bound | |",
        "|---|---:|---:|---:|---|---|---|",
    ]
    for row in rows:
        b: Bound = row["bound"]  # type: ignore[assignment]
        lo, hi = row["spread"]  # type: ignore[misc]
        if not b.gated:
            mark = "(info)"
        elif not row["decided"]:
            mark = "undecided"
        else:
            mark = "ok" if row["ok"] else "FAIL"
        lines.append(
            f"| {b.label} | {fmt(row['fork'])} | {fmt(row['upstream'])} | "
            f"{row['ratio']:.3f} ± {row['se']:.3f} | {lo:.3f}..{hi:.3f} | {b.bound_text()} | {mark} |"
        )
    info = [("tokens_per_s", "output tokens/s"), ("all_cpu_ms_per_req", "CPU ms per request, both servers, everything (incl. idle polling)")]
    for server in SCHEDULER_ROLES:
        info += [
            (f"{server}_busy_passes", f"{server} scheduler passes that ran a batch, per run"),
            (f"{server}_forward_iters", f"{server} forward iterations per run (server log)"),
            (f"{server}_idle_passes", f"{server} scheduler idle passes per run (wall-bound)"),
            (f"{server}_scheduler_busy_cpu_ms_per_req", f"{server} scheduler busy passes CPU ms/request"),
            (f"{server}_scheduler_idle_cpu_ms_per_req", f"{server} scheduler idle passes CPU ms/request (wall-bound)"),
            (f"{server}_scheduler_threads_cpu_ms_per_req", f"{server} scheduler other threads CPU ms/request (transfer polling)"),
            (f"{server}_tokenizer_cpu_ms_per_req", f"{server} tokenizer CPU ms/request"),
            (f"{server}_detokenizer_cpu_ms_per_req", f"{server} detokenizer CPU ms/request"),
        ]
    info += [
        ("balancer_cpu_ms_per_req", "balancer CPU ms per request (same binary both sides)"),
        ("idle_side_cpu_s", "CPU s used by the idle side during a run"),
    ]
    for key, label in info:
        if not fork[key] and not upstream[key]:
            continue  # e.g. the idle side's CPU when both sides run together
        ratio = f"{fork[key] / upstream[key]:.3f}" if upstream[key] else "-"
        lines.append(f"| {label} | {fmt(fork[key])} | {fmt(upstream[key])} | {ratio} (of medians) | | (info) | |")
    return "\n".join(lines)


def per_round(fork_runs: List[Dict[str, float]], up_runs: List[Dict[str, float]]) -> str:
    """One line: each round's CPU per request, scheduler cost and throughput, fork / upstream."""
    parts = [
        f"{f['cpu_ms_per_req']:.1f}/{u['cpu_ms_per_req']:.1f} ms, "
        f"P {f['prefill_us_per_iter']:.0f}/{u['prefill_us_per_iter']:.0f} µs, "
        f"D {f['decode_us_per_iter']:.0f}/{u['decode_us_per_iter']:.0f} µs, "
        f"{f['throughput']:.1f}/{u['throughput']:.1f} req/s"
        for f, u in zip(fork_runs, up_runs)
    ]
    return "Per round (fork/upstream; CPU per request, prefill/decode scheduler CPU per iteration, throughput): " + "; ".join(parts) + "."


def write_readme(block: str, begin: str = README_BEGIN, end: str = README_END, heading: str = "## Release gate") -> None:
    write_block(README, begin, end, block, heading)


def run_hook_cost() -> str:
    """The hook micro-benchmark (bench/hook_cost.py) in its own process (it loads the
    fork's hooks and builds the real PD queues in process); returns its markdown."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.hook_cost", "--markdown-only"], cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=1500,
    )
    if out.returncode != 0:
        raise RuntimeError(f"bench.hook_cost failed ({out.returncode}): {out.stderr[-2000:]}")
    return out.stdout.strip()


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of (fork, upstream) runs (default 5)")
    parser.add_argument("--requests", type=int, default=100, help="requests per run and side (default 100)")
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight per side (default 1: the same batches on both sides)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=16, help="requests per side before measuring")
    parser.add_argument("--model-dir", default=str(REPO_ROOT / ".cache" / "tiny-llama"))
    parser.add_argument("--write-readme", action="store_true", help="replace the figures in bench/README.md")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument(
        "--inject-slowdown-us", type=float, default=0.0, metavar="US",
        help="bench/test only: give the fork's servers an extra plugin whose hook on "
             "DecodeTransferQueue.pop_transferred busy-loops US µs per call (a deliberately slower fork)",
    )
    parser.add_argument(
        "--mode", choices=("together", "alternate"), default="together",
        help="together: both sides under the same load at the same time in each round (default); "
             "alternate: one side after the other, the other idle",
    )
    parser.add_argument(
        "--hooks", choices=("run", "skip"), default="run",
        help="also run the in-process hook micro-benchmark (bench/hook_cost.py) and print its table (default run)",
    )
    parser.add_argument(
        "--standins", choices=("both", "upstream"), default="both",
        help="which side gets the sgl_kernel/torchvision import stand-ins (default both)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or args.concurrency < 1:
        parser.error("--rounds, --requests and --concurrency must be >= 1")

    t_start = time.monotonic()
    mach = machine()
    load_before = loadavg()
    print(f"machine: nproc {mach['nproc']}, {mach['cpu']}, {mach['mem_gb']} GB, "
          f"python {mach['python']}; load average {load_before}", flush=True)
    with work_dir("sglang-bench-", args.keep_logs) as work:
        model = ensure_tiny_model(args.model_dir)
        prepared = baseline.prepare(work, fork_python())
        print(f"upstream baseline: {Path(prepared['wheel']).name} (sha256 per upstream.lock) "
              f"unpacked in {work}", flush=True)
        fork_version = prepared["fork_version"]
        up_env = baseline.upstream_env(prepared)
        fk_env = baseline.fork_env(prepared, standins=args.standins == "both")
        if args.inject_slowdown_us > 0:
            folder = baseline.write_slowdown_plugin(work / "slowdown-plugin", args.inject_slowdown_us)
            fk_env["PYTHONPATH"] = ":".join(p for p in (str(folder), fk_env["PYTHONPATH"]) if p)
            print(f"fork side gets the bench-only slowdown plugin: {args.inject_slowdown_us:g} µs busy loop "
                  f"per DecodeTransferQueue.pop_transferred call", flush=True)
        lb_env = baseline.fork_env(prepared, standins=False)
        decode_args = (*baseline.SHARED_ARGS, *baseline.DECODE_ARGS)
        sides = {
            "fork": Side("fork", probe_dir=Path(prepared["probe_dir"]), cluster=PDCluster(
                str(model), prefill_env=fk_env, decode_env=fk_env, lb_env=lb_env,
                prefill_args=baseline.SHARED_ARGS, decode_args=decode_args,
                log_dir=str(work / "logs-fork"))),
            "upstream": Side("upstream", probe_dir=Path(prepared["probe_dir"]), cluster=PDCluster(
                str(model), prefill_env=up_env, decode_env=up_env, lb_env=lb_env,
                prefill_args=baseline.SHARED_ARGS, decode_args=decode_args,
                log_dir=str(work / "logs-upstream"))),
        }
        try:
            t0 = time.monotonic()
            start_all(*(s.cluster for s in sides.values()))
            print(f"both 1P1D deployments healthy in {time.monotonic() - t0:.0f}s", flush=True)
            sides["fork"].version = verify_side(sides["fork"], fork_version, True)
            sides["upstream"].version = verify_side(sides["upstream"], prepared["version"], False)
            for s in sides.values():
                print(f"{s.name:8s} runs: {s.version}", flush=True)
                run_load(s.cluster.url, prompts(args.warmup), args.concurrency, args.max_new_tokens)

            texts = prompts(args.requests)
            mismatches = 0
            for rnd in range(args.rounds):
                order = SIDES if rnd % 2 == 0 else SIDES[::-1]
                if args.mode == "together":
                    runs = dict(zip(order, measure_together([sides[n] for n in order], texts,
                                                            args.concurrency, args.max_new_tokens)))
                else:
                    runs = {}
                    for name in order:
                        other = sides[SIDES[1] if name == SIDES[0] else SIDES[0]]
                        runs[name] = measure(sides[name], other, texts, args.concurrency, args.max_new_tokens)
                for name in order:
                    r = runs[name]
                    print(
                        f"round {rnd + 1}/{args.rounds} {name:8s} {r['throughput']:6.2f} req/s  "
                        f"p50 {r['p50']:.3f}s  p99 {r['p99']:.3f}s  "
                        f"cpu {r['cpu_ms_per_req']:.1f} ms/req  "
                        f"sched P {r['prefill_us_per_iter']:.0f} D {r['decode_us_per_iter']:.0f} µs/busy pass "
                        f"({r['prefill_busy_passes']:.0f}+{r['decode_busy_passes']:.0f} passes, "
                        f"{r['prefill_idle_passes']:.0f}+{r['decode_idle_passes']:.0f} idle)  "
                        f"all {r['all_cpu_ms_per_req']:.1f} ms/req  load {loadavg()}",
                        flush=True,
                    )
                bad = token_mismatches(sides["fork"].outputs[-1], sides["upstream"].outputs[-1])
                mismatches += bad
                if bad:
                    print(f"round {rnd + 1}: output tokens differ for {bad} of {len(texts)} requests", flush=True)
        finally:
            for s in sides.values():
                s.cluster.teardown()

        fork_m, up_m = medians(sides["fork"].runs), medians(sides["upstream"].runs)
        rows = evaluate_rounds(sides["fork"].runs, sides["upstream"].runs)
        load_after = loadavg()
        block = "\n".join([
            f"Fork `{fork_version}` vs upstream `{prepared['version']}`, 1P1D + mini-lb on CPU, tiny Llama, "
            f"{args.requests} requests at concurrency {args.concurrency}, {args.max_new_tokens} output tokens, "
            f"median of {args.rounds} rounds ({'both sides loaded at once' if args.mode == 'together' else 'sides alternating'}); import stand-ins on {args.standins}; "
            f"bench probe plugin on both sides (passes accounted; idle polling paced {baseline.PACE_SECONDS * 1e3:g} ms: "
            "upstream's by the probe, the fork's by its own idle pacing)"
            + (f"; fork slowed by {args.inject_slowdown_us:g} µs per decode loop (injected)" if args.inject_slowdown_us else "")
            + ".",
            f"Machine: {mach['nproc']} CPUs, {mach['cpu']}, {mach['mem_gb']} GB RAM, Linux {mach['kernel']}, "
            f"Python {mach['python']}; load average (1/5/15 min) {load_before} at start, {load_after} at end "
            f"(shared machine). Run at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
            "",
            table(rows, fork_m, up_m),
            "",
            per_round(sides["fork"].runs, sides["upstream"].runs),
        ])
        outcome, lines = verdict(rows, mismatches, args.rounds)
        compared = args.rounds * args.requests
        block += (
            f"\n\nOutput tokens: {compared - mismatches} of {compared} requests identical between fork and "
            f"upstream (same prompts, greedy, same round).\n\n" + "\n".join(lines)
        )
        print("\n" + block + "\n")
        hooks_block = None
        if args.hooks == "run":
            hooks_block = run_hook_cost()
            print("\n" + hooks_block + "\n")
        if args.write_readme:
            write_readme(block)
            if hooks_block is not None:
                write_readme(hooks_block, HOOKS_BEGIN, HOOKS_END, "## Cost of each hook")
            print(f"wrote the figures to {README}")
        print(f"{outcome} ({time.monotonic() - t_start:.0f}s)")
        return EXIT[outcome]


if __name__ == "__main__":
    import bench

    bench.run(main)
