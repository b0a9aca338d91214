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
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import psutil

from bench import baseline
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
README = REPO_ROOT / "README.md"
README_BEGIN = "<!-- release-gate:begin (written by `make bench ARGS=--write-readme`) -->"
README_END = "<!-- release-gate:end -->"

SIDES = ("fork", "upstream")
SCHEDULER_ROLES = ("prefill", "decode")
_ITER_LINE = re.compile(rb"(?:Prefill|Decode) batch \[(\d+)\]")


# ----------------------------------------------------------------------------- gate logic


@dataclass(frozen=True)
class Bound:
    """fork vs upstream for one metric: `ratio` is oriented so that bigger is better
    for the fork when higher_is_better, and the gate is ratio >= lo or ratio <= hi."""

    metric: str
    label: str
    higher_is_better: bool  # of the raw metric
    lo: Optional[float] = None  # ratio must be >= lo
    hi: Optional[float] = None  # ratio must be <= hi
    ratio_name: str = "fork/upstream"

    def ratio(self, fork: float, upstream: float) -> float:
        if self.ratio_name == "upstream/fork":
            return upstream / fork
        return fork / upstream

    def ok(self, ratio: float) -> bool:
        return (self.lo is None or ratio >= self.lo) and (self.hi is None or ratio <= self.hi)

    def bound_text(self) -> str:
        return f"{self.ratio_name} >= {self.lo}" if self.lo is not None else f"{self.ratio_name} <= {self.hi}"


BOUNDS = (
    Bound("throughput", "throughput (req/s)", True, lo=0.97),
    Bound("p50", "latency p50 (s)", False, lo=0.97, ratio_name="upstream/fork"),
    Bound("p99", "latency p99 (s)", False, lo=0.97, ratio_name="upstream/fork"),
    Bound("sched_us_per_iter", "scheduler µs/iteration", False, hi=1.03),
)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n*q/100), at least 1
    return ordered[int(rank) - 1]


def medians(runs: Sequence[Dict[str, float]]) -> Dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def evaluate(fork: Dict[str, float], upstream: Dict[str, float]) -> List[Dict[str, object]]:
    """One row per bound: values, ratio, pass/fail."""
    rows = []
    for b in BOUNDS:
        r = b.ratio(fork[b.metric], upstream[b.metric])
        rows.append({"bound": b, "fork": fork[b.metric], "upstream": upstream[b.metric], "ratio": r, "ok": b.ok(r)})
    return rows


def evaluate_rounds(fork_runs: Sequence[Dict[str, float]], up_runs: Sequence[Dict[str, float]]) -> List[Dict[str, object]]:
    """One row per bound, judged on the median of the per-round ratios: each round
    measures the two sides back to back, so a ratio within a round cancels load that
    drifts over minutes (a ratio of medians over rounds does not). Values are the
    per-side medians; `spread` is the (min, max) per-round ratio."""
    rows = []
    for b in BOUNDS:
        per_round = [b.ratio(f[b.metric], u[b.metric]) for f, u in zip(fork_runs, up_runs)]
        r = statistics.median(per_round)
        rows.append({
            "bound": b,
            "fork": statistics.median(f[b.metric] for f in fork_runs),
            "upstream": statistics.median(u[b.metric] for u in up_runs),
            "ratio": r, "spread": (min(per_round), max(per_round)), "ok": b.ok(r),
        })
    return rows


EXIT = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}


def verdict(rows: List[Dict[str, object]], max_spread: float):
    """PASS or FAIL only when the rounds agree closely enough to resolve a 3% bound:
    if any gated metric's per-round ratios span more than max_spread (max - min), the
    machine's noise is larger than what the gate must detect, and the verdict is
    INCONCLUSIVE whatever the medians say. Returns (outcome, lines to print)."""
    lines = []
    noisy = [r for r in rows if r["spread"][1] - r["spread"][0] > max_spread]  # type: ignore[index]
    for r in noisy:
        b: Bound = r["bound"]  # type: ignore[assignment]
        lo, hi = r["spread"]  # type: ignore[misc]
        lines.append(f"TOO NOISY: {b.label}: per-round {b.ratio_name} {lo:.3f}..{hi:.3f} spans more than {max_spread}")
    failed = [r for r in rows if not r["ok"]]
    for r in failed:
        b = r["bound"]  # type: ignore[assignment]
        lines.append(f"GATE FAILED: {b.label}: {b.ratio_name} = {r['ratio']:.3f}, bound {b.bound_text()}")
    if noisy:
        lines.append("Verdict: INCONCLUSIVE (rerun on a quieter machine or with more rounds).")
        return "INCONCLUSIVE", lines
    outcome = "FAIL" if failed else "PASS"
    lines.append(f"Verdict: {outcome}.")
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
    tokens = len(body.get("output_ids") or []) if ok else 0
    return {"status": status, "latency": latency, "tokens": tokens, "error": None if ok else str(body)[:300]}


def run_load(url: str, texts: Sequence[str], concurrency: int, max_new_tokens: int) -> Dict[str, object]:
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda t: one_request(url, t, max_new_tokens), texts))
    wall = time.monotonic() - t0
    failed = [r for r in results if r["status"] != 200 or r["tokens"] != max_new_tokens]
    return {"results": results, "wall": wall, "failed": failed}


# ----------------------------------------------------------------------------- one side


@dataclass
class Side:
    name: str
    cluster: PDCluster
    runs: List[Dict[str, float]] = field(default_factory=list)
    version: str = ""

    def scheduler_procs(self) -> Dict[str, psutil.Process]:
        out = {}
        for role in SCHEDULER_ROLES:
            server: Server = self.cluster[role]
            procs = [
                psutil.Process(pid) for pid in server.pids()
                if "sglang::scheduler" in " ".join(psutil.Process(pid).cmdline())
            ]
            if len(procs) != 1:
                raise RuntimeError(f"{self.name} {role}: expected one scheduler process, found {procs}")
            out[role] = procs[0]
        return out

    def counters(self) -> Dict[str, Dict[str, float]]:
        """Per scheduler role: cpu seconds so far and forward_ct so far."""
        out = {}
        for role, proc in self.scheduler_procs().items():
            t = proc.cpu_times()
            log = self.cluster[role].log_path.read_bytes()
            out[role] = {"cpu": t.user + t.system, "iters": max_forward_iter(log)}
        return out

    def settled_counters(self) -> Dict[str, Dict[str, float]]:
        """Counters once the iteration counts stopped moving (the last batch's log
        line can land just after the last response)."""
        last = {"c": self.counters()}

        def stable():
            time.sleep(0.5)
            now = self.counters()
            same = all(now[r]["iters"] == last["c"][r]["iters"] for r in SCHEDULER_ROLES)
            last["c"] = now
            return now if same else None

        return wait_until(stable, 30, f"{self.name}: scheduler iteration count to settle", interval=0)


def tree_cpu(cluster: PDCluster) -> float:
    """CPU seconds so far of every process of a deployment (servers, their children, LB)."""
    total = 0.0
    for pid in cluster.all_pids():
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def measure(side: Side, idle: Side, texts: Sequence[str], concurrency: int, max_new_tokens: int) -> Dict[str, float]:
    """One run on `side`; `idle` is the other deployment, whose CPU use during the run
    is recorded (it should be near zero: it must not compete with the side measured)."""
    before = side.settled_counters()
    all_before, idle_before = tree_cpu(side.cluster), tree_cpu(idle.cluster)
    load = run_load(side.cluster.url, texts, concurrency, max_new_tokens)
    all_after, idle_after = tree_cpu(side.cluster), tree_cpu(idle.cluster)
    after = side.settled_counters()
    if load["failed"]:
        first = load["failed"][0]
        raise RuntimeError(
            f"{side.name}: {len(load['failed'])}/{len(texts)} requests failed, e.g. "
            f"status {first['status']} tokens {first['tokens']}: {first['error']}"
        )
    lat = [r["latency"] for r in load["results"]]
    cpu = {r: after[r]["cpu"] - before[r]["cpu"] for r in SCHEDULER_ROLES}
    iters = {r: after[r]["iters"] - before[r]["iters"] for r in SCHEDULER_ROLES}
    if min(iters.values()) <= 0:
        raise RuntimeError(f"{side.name}: no scheduler iterations counted ({iters}); logs in {side.cluster.log_dir}")
    run = {
        "throughput": len(texts) / load["wall"],
        "tokens_per_s": len(texts) * max_new_tokens / load["wall"],
        "p50": percentile(lat, 50),
        "p99": percentile(lat, 99),
        "sched_us_per_iter": 1e6 * sum(cpu.values()) / sum(iters.values()),
        "prefill_us_per_iter": 1e6 * cpu["prefill"] / iters["prefill"],
        "decode_us_per_iter": 1e6 * cpu["decode"] / iters["decode"],
        "prefill_iters": iters["prefill"],
        "decode_iters": iters["decode"],
        "deployment_cpu_ms_per_req": 1e3 * (all_after - all_before) / len(texts),
        "idle_side_cpu_s": idle_after - idle_before,
    }
    side.runs.append(run)
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
        "| metric (median of rounds) | fork | upstream | ratio (median of rounds) | min..max per round | bound | |",
        "|---|---:|---:|---:|---|---|---|",
    ]
    for row in rows:
        b: Bound = row["bound"]  # type: ignore[assignment]
        lo, hi = row["spread"]  # type: ignore[misc]
        lines.append(
            f"| {b.label} | {fmt(row['fork'])} | {fmt(row['upstream'])} | "
            f"{row['ratio']:.3f} | {lo:.3f}..{hi:.3f} | {b.bound_text()} | {'ok' if row['ok'] else 'FAIL'} |"
        )
    for key, label in (
        ("tokens_per_s", "output tokens/s"),
        ("prefill_us_per_iter", "prefill scheduler µs/iteration"),
        ("decode_us_per_iter", "decode scheduler µs/iteration"),
        ("prefill_iters", "prefill iterations per run"),
        ("decode_iters", "decode iterations per run"),
        ("deployment_cpu_ms_per_req", "CPU ms per request, whole deployment"),
        ("idle_side_cpu_s", "CPU s used by the idle side during a run"),
    ):
        ratio = f"{fork[key] / upstream[key]:.3f}" if upstream[key] else "-"
        lines.append(f"| {label} | {fmt(fork[key])} | {fmt(upstream[key])} | {ratio} | | (info) | |")
    return "\n".join(lines)


def per_round(fork_runs: List[Dict[str, float]], up_runs: List[Dict[str, float]]) -> str:
    """One line: each round's throughput and scheduler cost, fork / upstream."""
    parts = [
        f"{f['throughput']:.2f}/{u['throughput']:.2f} req/s, {f['sched_us_per_iter']:.0f}/{u['sched_us_per_iter']:.0f} µs"
        for f, u in zip(fork_runs, up_runs)
    ]
    return "Per round (fork/upstream): " + "; ".join(parts) + "."


def write_readme(block: str) -> None:
    text = README.read_text()
    new = f"{README_BEGIN}\n{block}\n{README_END}"
    if README_BEGIN in text and README_END in text:
        head, rest = text.split(README_BEGIN, 1)
        _, tail = rest.split(README_END, 1)
        text = head + new + tail
    else:
        text = text.rstrip("\n") + "\n\n## Release gate\n" + new + "\n"
    README.write_text(text)


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of (fork, upstream) runs (default 5)")
    parser.add_argument("--requests", type=int, default=200, help="requests per run (default 200)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=16, help="requests per side before measuring")
    parser.add_argument("--model-dir", default=str(REPO_ROOT / ".cache" / "tiny-llama"))
    parser.add_argument("--write-readme", action="store_true", help="replace the figures in README.md")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument(
        "--max-spread", type=float, default=0.10,
        help="largest max-min of a gated metric's per-round ratios for a PASS/FAIL verdict (default 0.10)",
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
    work = Path(tempfile.mkdtemp(prefix="sglang-bench-"))
    ok = False
    try:
        model = ensure_tiny_model(args.model_dir)
        prepared = baseline.prepare(work, fork_python())
        print(f"upstream baseline: {Path(prepared['wheel']).name} (sha256 per upstream.lock) "
              f"unpacked in {work}", flush=True)
        fork_version = prepared["fork_version"]
        up_env = baseline.upstream_env(prepared)
        fk_env = baseline.fork_env(prepared, standins=args.standins == "both")
        lb_env = baseline.fork_env(prepared, standins=False)
        decode_args = (*baseline.SHARED_ARGS, *baseline.DECODE_ARGS)
        sides = {
            "fork": Side("fork", PDCluster(
                str(model), prefill_env=fk_env, decode_env=fk_env, lb_env=lb_env,
                prefill_args=baseline.SHARED_ARGS, decode_args=decode_args,
                log_dir=str(work / "logs-fork"))),
            "upstream": Side("upstream", PDCluster(
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
            for rnd in range(args.rounds):
                order = SIDES if rnd % 2 == 0 else SIDES[::-1]
                for name in order:
                    other = sides[SIDES[1] if name == SIDES[0] else SIDES[0]]
                    r = measure(sides[name], other, texts, args.concurrency, args.max_new_tokens)
                    print(
                        f"round {rnd + 1}/{args.rounds} {name:8s} {r['throughput']:6.2f} req/s  "
                        f"p50 {r['p50']:.3f}s  p99 {r['p99']:.3f}s  "
                        f"sched {r['sched_us_per_iter']:.0f} µs/iter "
                        f"({r['prefill_iters']:.0f}+{r['decode_iters']:.0f} iters)  "
                        f"idle side {r['idle_side_cpu_s']:.1f} cpu-s  load {loadavg()}",
                        flush=True,
                    )
        finally:
            for s in sides.values():
                s.cluster.teardown()

        fork_m, up_m = medians(sides["fork"].runs), medians(sides["upstream"].runs)
        rows = evaluate_rounds(sides["fork"].runs, sides["upstream"].runs)
        load_after = loadavg()
        block = "\n".join([
            f"Fork `{fork_version}` vs upstream `{prepared['version']}`, 1P1D + mini-lb on CPU, tiny Llama, "
            f"{args.requests} requests at concurrency {args.concurrency}, {args.max_new_tokens} output tokens, "
            f"median of {args.rounds} interleaved rounds; import stand-ins on {args.standins}.",
            f"Machine: {mach['nproc']} CPUs, {mach['cpu']}, {mach['mem_gb']} GB RAM, Linux {mach['kernel']}, "
            f"Python {mach['python']}; load average (1/5/15 min) {load_before} at start, {load_after} at end "
            f"(shared machine). Run at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
            "",
            table(rows, fork_m, up_m),
            "",
            per_round(sides["fork"].runs, sides["upstream"].runs),
        ])
        outcome, lines = verdict(rows, args.max_spread)
        block += "\n\n" + "\n".join(lines)
        print("\n" + block + "\n")
        if args.write_readme:
            write_readme(block)
            print(f"wrote the figures to {README}")
        print(f"{outcome} ({time.monotonic() - t_start:.0f}s)")
        ok = True
        return EXIT[outcome]
    finally:
        if args.keep_logs or not ok:
            print(f"logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # the bench could not measure: not a gate verdict
        print(f"BENCH ERROR: {e}", file=sys.stderr)
        sys.exit(2)
