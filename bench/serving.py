"""Upstream's own benchmark client against the fork and stock upstream (`make bench-serving`).

`python -m sglang.benchmark.serving` -- the client upstream ships and a user runs first -- streams requests of its
`random` dataset (128 tokens in, 32 out by default, fixed lengths) at several concurrencies against two 1P1D
deployments on CPU (tiny model, mini LB, the same flags and env as the release gate, bench/baseline.py): the fork
and stock upstream 0.5.23, both up side by side, rounds alternated (fork first in odd rounds, upstream first in
even ones, every concurrency in each round). Reported per concurrency: output throughput, TTFT, TPOT and ITL
(p50, and TTFT p99) as fork/upstream ratios, the median of the per-round ratios with their min..max (the spread
between rounds). The ITL median counts the gaps between stream chunks, so it depends on how the server chunks
its stream (tokens per chunk), not only on decode speed; TPOT does not.

The lone request (`--lone N`): N cycles, each sending one streaming request to each of three deployments in turn
(fork, the fork with `SGLANG_FORK_PD_IDLE_PACE=0`, upstream; nothing else in flight), then reading the servers' own
per-request stage timestamps (upstream's `--enable-request-time-stats-logging` lines, scheduler thread,
perf_counter) and the CPU time each deployment spent. What the fork adds to a lone request's time to first token
is read from these, in milliseconds (see bench/README.md, "The lone request").

The dataset: upstream's `random` takes token ids from ShareGPT conversations (downloaded from the hub when no
`--dataset-path` is given); here a small ShareGPT-format file of the tiny model's own words is written and passed,
so the client runs offline with upstream's sampling unchanged.

Usage: python -m bench.serving [--rounds N] [--concurrency 1 4 16] [--prompts-per-slot N] [--lone N]
         [--input-len 128] [--output-len 32] [--write-readme] [--keep-logs]
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple
from urllib.parse import urlparse

from bench import baseline
from bench.readme_block import write_block
from bench.release_gate import cpu_delta, cpu_snapshot, loadavg, machine, se_of_median
from bench.work_dir import work_dir
from testing.pd_cluster import PDCluster, fork_python, start_all
from testing.tiny_model import ensure_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "bench" / "README.md"
README_BEGIN = "<!-- bench-serving:begin (written by `make bench-serving ARGS=--write-readme`) -->"
README_END = "<!-- bench-serving:end -->"
HEADING = "## Upstream's benchmark client (`make bench-serving`)"

SIDES = ("fork", "upstream")
LONE_SIDES = ("fork", "fork-pace0", "upstream")
TIME_STATS_ARG = "--enable-request-time-stats-logging"  # one ReqTimeStats line per finished request, both servers


@dataclass(frozen=True)
class Metric:
    """One figure of upstream's client result line (its JSON key), and which way is better for the fork."""

    key: str
    label: str
    higher_is_better: bool


METRICS = (
    Metric("output_throughput", "output throughput (tok/s)", True),
    Metric("median_ttft_ms", "TTFT p50 (ms)", False),
    Metric("p99_ttft_ms", "TTFT p99 (ms)", False),
    Metric("median_tpot_ms", "TPOT p50 (ms)", False),
    Metric("median_itl_ms", "ITL p50 (ms; counts stream chunks)", False),
    Metric("median_e2e_latency_ms", "E2E latency p50 (ms)", False),
)


# ----------------------------------------------------------------------------- upstream's client


def client_argv(python: str, base_url: str, model: str, dataset: Path, out_file: Path, *, concurrency: int,
                num_prompts: int, input_len: int, output_len: int, seed: int) -> List[str]:
    """The command line of upstream's client for one run: streaming (its default), `random` dataset of fixed
    lengths (range ratio 1) from the given ShareGPT-format file, all requests at once bounded by `concurrency`
    (request rate inf), one warm-up request, its result appended as one JSON line to `out_file`."""
    return [
        python, "-m", "sglang.benchmark.serving",
        "--backend", "sglang", "--base-url", base_url,
        "--model", model, "--tokenizer", model,
        "--dataset-name", "random", "--dataset-path", str(dataset),
        "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--random-range-ratio", "1",
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
        "--seed", str(seed), "--warmup-requests", "1", "--disable-tqdm",
        "--output-file", str(out_file),
    ]


def write_sharegpt(path: Path, n: int = 512) -> Path:
    """A ShareGPT-format file (the shape upstream's `random` dataset reads its token ids from) of the tiny
    model's words: `n` two-turn conversations, each opening with its own number (no two prompts share a cached
    prefix, as with real data)."""
    words = ("the quick brown fox jumps over the lazy dog hello world what is the capital of france paris london "
             "berlin rome madrid tokyo river mountain ocean forest server client request response prefill decode "
             "cache memory transfer token model layer attention batch queue").split()
    rows = []
    for i in range(n):
        ask = f"{i} " + " ".join(words[(i * 7 + k) % len(words)] for k in range(24 + i % 17))
        answer = " ".join(words[(i * 3 + k) % len(words)] for k in range(12))
        rows.append({"id": f"bench-{i}", "conversations": [{"from": "human", "value": ask},
                                                          {"from": "gpt", "value": answer}]})
    path.write_text(json.dumps(rows))
    return path


def read_result(out_file: Path) -> Dict[str, float]:
    """The last result line upstream's client appended to `out_file`, reduced to the figures compared (plus
    completed/duration); ValueError when a figure is missing (the run failed)."""
    lines = [l for l in out_file.read_text().splitlines() if l.strip()]
    if not lines:
        raise ValueError(f"{out_file}: upstream's client wrote no result line")
    raw = json.loads(lines[-1])
    out = {}
    for key in [m.key for m in METRICS] + ["completed", "duration", "max_concurrency"]:
        value = raw.get(key)
        if not isinstance(value, (int, float)):
            raise ValueError(f"{out_file}: no numeric {key!r} in upstream's result line")
        out[key] = float(value)
    return out


def run_client(argv: Sequence[str], log: Path, timeout: float) -> None:
    with log.open("ab") as f:
        done = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO_ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"upstream's client failed ({done.returncode}); its output: {log}")


# ----------------------------------------------------------------------------- ratios

CHUNKED_MS = 0.05  # an ITL p50 below this: the stream delivered most tokens in bursts; no ratio is shown


def compare(results: Mapping[str, Mapping[int, List[Dict[str, float]]]]) -> Dict[int, Dict[str, Dict[str, object]]]:
    """Per concurrency and metric: each side's median over rounds, the per-round fork/upstream ratios (round i of
    the fork against round i of upstream: back to back in one round), their median and (min, max)."""
    out: Dict[int, Dict[str, Dict[str, object]]] = {}
    for conc in sorted(results["fork"]):
        fork, up = results["fork"][conc], results["upstream"][conc]
        rounds = min(len(fork), len(up))
        row = {}
        for m in METRICS:
            per_round = [fork[i][m.key] / up[i][m.key] for i in range(rounds)]
            row[m.key] = {
                "fork": statistics.median(r[m.key] for r in fork[:rounds]),
                "upstream": statistics.median(r[m.key] for r in up[:rounds]),
                "ratio": statistics.median(per_round),
                "spread": (min(per_round), max(per_round)),
                "per_round": per_round,
            }
        out[conc] = row
    return out


def ratio_table(cmp: Mapping[int, Mapping[str, Mapping[str, object]]]) -> str:
    """Markdown: one row per concurrency and metric."""
    lines = ["| concurrency | metric | fork | upstream | fork/upstream (median of rounds) | min..max per round | better |",
             "|---:|---|---:|---:|---:|---|---|"]
    for conc, row in cmp.items():
        for m in METRICS:
            c = row[m.key]
            lo, hi = c["spread"]  # type: ignore[misc]
            better = "higher" if m.higher_is_better else "lower"
            ratio, spread = f"{c['ratio']:.2f}", f"{lo:.2f}..{hi:.2f}"
            if m.key == "median_itl_ms" and min(c["fork"], c["upstream"]) < CHUNKED_MS:  # type: ignore[type-var]
                ratio, spread = "n/a", "a p50 of 0: most gaps between chunks were 0 (tokens arrived together)"
            lines.append(f"| {conc} | {m.label} | {c['fork']:.1f} | {c['upstream']:.1f} | {ratio} | {spread} | {better} |")
    return "\n".join(lines)


def summary_line(cmp: Mapping[int, Mapping[str, Mapping[str, object]]], lone: Optional[Mapping[str, object]],
                 where: str = "") -> str:
    """README.md's one line for this bench; `where`: the run's date and machine, in brackets at its end."""
    loaded = [c for c in cmp if c > 1]

    def span(key: str, concs: Sequence[int]) -> str:
        lo = min(cmp[c][key]["spread"][0] for c in concs)  # type: ignore[index]
        hi = max(cmp[c][key]["spread"][1] for c in concs)  # type: ignore[index]
        return f"{lo:.2f}-{hi:.2f}x"

    def medians(key: str, concs: Sequence[int]) -> str:
        return "/".join(f"{cmp[c][key]['ratio']:.2f}" for c in concs) + "x"  # type: ignore[index]

    parts = []
    if loaded:
        parts.append(f"at concurrency {'/'.join(map(str, loaded))} fork/upstream output throughput "
                     f"{medians('output_throughput', loaded)}, TTFT p50 {medians('median_ttft_ms', loaded)}, TPOT p50 "
                     f"{medians('median_tpot_ms', loaded)} (median of rounds; per round "
                     f"{span('output_throughput', loaded)}, {span('median_ttft_ms', loaded)}, "
                     f"{span('median_tpot_ms', loaded)})")
    if 1 in cmp:
        parts.append(f"alone, TTFT p50 {medians('median_ttft_ms', [1])} (per round {span('median_ttft_ms', [1])})")
    text = "- **Upstream's client** (`make bench-serving`): " + "; ".join(parts)
    if lone:
        text += (f"; a lone request: the fork adds {lone['thread_added_ms']:+.2f} ± {lone['thread_added_se']:.2f} ms on "
                 f"the scheduler-thread stages ({thread_verdict(lone)}), {lone['fork_added_ms']:+.2f} ± "
                 f"{lone['fork_added_se']:.2f} ms to its TTFT at the client")
    return text + (f" ({where})." if where else ".")


# ----------------------------------------------------------------------------- the lone request


_TIME_STATS = re.compile(r"ReqTimeStats\(rid=([^,]+),.*?type=(prefill|decode)\): (.*)$")
_DURATION = re.compile(r"(\w+_duration)=([\d.]+)ms")


def parse_time_stats(log_text: str) -> Dict[str, Dict[str, float]]:
    """rid -> {stage duration name: ms} from a server log's ReqTimeStats lines (upstream's format)."""
    out: Dict[str, Dict[str, float]] = {}
    for line in log_text.splitlines():
        m = _TIME_STATS.search(line)
        if m:
            out[m.group(1)] = {k: float(v) for k, v in _DURATION.findall(m.group(3))}
    return out


def stream_ttft(base_url: str, text: str, max_new_tokens: int, rid: str, timeout: float = 60.0) -> Tuple[float, float]:
    """One streaming /generate through the balancer: (seconds to the first chunk carrying text, to the end)."""
    url = urlparse(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    body = json.dumps({"text": text, "rid": rid, "stream": True, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}})
    t0 = time.perf_counter()
    conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"lone request {rid}: HTTP {resp.status}: {resp.read()[:300]!r}")
    first = None
    for raw in resp:
        line = raw.strip()
        if first is None and line.startswith(b"data:") and line != b"data: [DONE]" and b'"text"' in line:
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    conn.close()
    if first is None:
        raise RuntimeError(f"lone request {rid}: no token streamed")
    return first, total


# stages on the path to the first token, by server: upstream's ReqTimeStats names
PREFILL_STAGES = ("bootstrap_duration", "queue_duration", "forward_duration")
DECODE_STAGES = ("bootstrap_duration", "alloc_wait_duration", "transfer_duration", "queue_duration")
# the stages spent on one scheduler thread alone (no wait on another thread, process or the peer): what the fork's
# own code adds to a lone request shows here; the others wait for decode's handshake, the forward or the transfer
THREAD_STAGES = ("prefill queue", "decode bootstrap", "decode alloc_wait", "decode queue")
THREAD_STAGES_GOAL_MS = 0.5


def paired(a: Sequence[Optional[float]], b: Sequence[Optional[float]]) -> Tuple[float, float, int]:
    """Median of the per-cycle differences a - b (cycles where both were measured), its robust standard error
    (release_gate.se_of_median), and how many cycles."""
    diffs = [x - y for x, y in zip(a, b) if x is not None and y is not None]
    if not diffs:
        return float("nan"), float("inf"), 0
    return statistics.median(diffs), se_of_median(diffs), len(diffs)


def lone_summary(ttft: Mapping[str, List[float]], stages: Mapping[str, Mapping[str, List[Optional[float]]]],
                 cpu_ms: Mapping[str, float]) -> Dict[str, object]:
    """The lone requests' figures, in ms. Each cycle sent one request to every side back to back, so per-cycle
    differences cancel the load that drifts over seconds: fork - upstream and fork - fork-pace0, as the median of the
    per-cycle differences ± its robust standard error, for the client's TTFT and for each server stage; each side's
    median TTFT and stage durations; CPU ms per request of each deployment (servers and balancer)."""
    ms = {s: [1e3 * x for x in v] for s, v in ttft.items()}
    added, added_se, n = paired(ms["fork"], ms["upstream"])
    pace, pace_se, _ = paired(ms["fork"], ms["fork-pace0"]) if "fork-pace0" in ms else (float("nan"), float("inf"), 0)
    keys = sorted({k for per in stages.values() for k in per}, key=_stage_order)
    diffs = {k: {"vs upstream": paired(stages["fork"].get(k, []), stages["upstream"].get(k, [])),
                 "vs pace 0": paired(stages["fork"].get(k, []), stages.get("fork-pace0", {}).get(k, []))}
             for k in keys}

    def thread_sum(side: str) -> List[Optional[float]]:  # per cycle; None where a stamp is missing
        per = [stages[side].get(k, []) for k in THREAD_STAGES]
        cycles = max(map(len, per), default=0)
        cols = [[col[i] if i < len(col) else None for col in per] for i in range(cycles)]
        return [None if None in c else sum(c) for c in cols]  # type: ignore[arg-type]

    thread, thread_se, thread_n = paired(thread_sum("fork"), thread_sum("upstream"))
    return {
        "n": n,
        "fork_added_ms": added, "fork_added_se": added_se,
        "pace_ms": pace, "pace_se": pace_se,
        "ttft_ms": {s: statistics.median(v) for s, v in ms.items()},
        "stages": {s: {k: statistics.median([x for x in v if x is not None]) for k, v in per.items()
                       if any(x is not None for x in v)} for s, per in stages.items()},
        "stage_diffs": diffs,
        "thread_added_ms": thread, "thread_added_se": thread_se, "thread_n": thread_n,
        "cpu_ms": dict(cpu_ms),
    }


def thread_verdict(lone: Mapping[str, object]) -> str:
    """Whether the fork's addition on the scheduler-thread stages is within the goal (decided by its upper bound)."""
    added, se = float(lone["thread_added_ms"]), float(lone["thread_added_se"])  # type: ignore[arg-type]
    if not lone["thread_n"]:
        return "not measured"
    if added + 2 * se <= THREAD_STAGES_GOAL_MS:
        return f"within the {THREAD_STAGES_GOAL_MS:g} ms goal"
    return f"OVER the {THREAD_STAGES_GOAL_MS:g} ms goal" if added - 2 * se > THREAD_STAGES_GOAL_MS else "undecided"


def _stage_order(key: str) -> int:
    names = [f"prefill {n.replace('_duration', '')}" for n in PREFILL_STAGES]
    names += [f"decode {n.replace('_duration', '')}" for n in DECODE_STAGES]
    return names.index(key) if key in names else len(names)


def lone_table(lone: Mapping[str, object]) -> str:
    """Markdown: each side's medians, then the paired differences (fork - upstream, fork - fork with pace 0)."""
    sides = list(lone["ttft_ms"])  # type: ignore[arg-type]
    diffs = lone["stage_diffs"]  # type: ignore[assignment]

    def d(value: Tuple[float, float, int]) -> str:
        return f"{value[0]:+.2f} ± {value[1]:.2f}" if value[2] else "-"

    lines = ["| ms, median over the lone requests | " + " | ".join(sides)
             + " | fork - upstream (paired ± SE) | fork - pace 0 (paired ± SE) |",
             "|---|" + "---:|" * (len(sides) + 2),
             "| TTFT at the client | " + " | ".join(f"{lone['ttft_ms'][s]:.2f}" for s in sides)  # type: ignore[index]
             + f" | {lone['fork_added_ms']:+.2f} ± {lone['fork_added_se']:.2f} | {lone['pace_ms']:+.2f} ± "
             f"{lone['pace_se']:.2f} |"]
    for key, per in diffs.items():  # type: ignore[union-attr]
        cells = " | ".join(f"{lone['stages'][s][key]:.2f}" if key in lone["stages"][s] else "-"  # type: ignore[index]
                           for s in sides)
        lines.append(f"| {key} (server stamps) | {cells} | {d(per['vs upstream'])} | {d(per['vs pace 0'])} |")
    lines.append("| CPU per request, both servers + LB | " + " | ".join(
        f"{lone['cpu_ms'][s]:.1f}" for s in sides) + " | | |")  # type: ignore[index]
    return "\n".join(lines)


def lone_prompts(model: str, dataset: Path, cycles: int, input_len: int, output_len: int, seed: int) -> List[str]:
    """One prompt a cycle, drawn by upstream's own `random` sampling from the dataset file (as its client does)."""
    import random

    import numpy as np
    from transformers import AutoTokenizer

    from sglang.benchmark.datasets.random import sample_random_requests

    random.seed(seed)
    np.random.seed(seed)
    rows = sample_random_requests(input_len, output_len, cycles, 1.0, AutoTokenizer.from_pretrained(model), str(dataset))
    return [r.prompt for r in rows]


def run_lone(clusters: Mapping[str, PDCluster], texts: Sequence[str], max_new_tokens: int) -> Dict[str, object]:
    """One cycle per text: one lone request per side (the same text; order rotated each cycle), then the servers'
    stamps."""
    cycles = len(texts)
    ttft: Dict[str, List[float]] = {s: [] for s in clusters}
    rids: Dict[str, List[str]] = {s: [] for s in clusters}
    names = list(clusters)
    before = {s: cpu_snapshot(c) for s, c in clusters.items()}
    for i in range(cycles):
        for s in names[i % len(names):] + names[:i % len(names)]:
            rid = f"lone-{s}-{i}-{uuid.uuid4().hex[:8]}"
            first, _ = stream_ttft(clusters[s].url, texts[i], max_new_tokens, rid)
            ttft[s].append(first)
            rids[s].append(rid)
    after = {s: cpu_snapshot(c) for s, c in clusters.items()}
    cpu_ms = {s: 1e3 * sum(sum(v.values()) for v in cpu_delta(before[s], after[s]).values()) / cycles for s in names}
    stages: Dict[str, Dict[str, List[Optional[float]]]] = {}
    for s, cluster in clusters.items():
        per: Dict[str, List[Optional[float]]] = {}
        for server, wanted in (("prefill", PREFILL_STAGES), ("decode", DECODE_STAGES)):
            stamps = parse_time_stats(cluster[server].log_path.read_text(errors="replace"))
            for name in wanted:
                per[f"{server} {name.replace('_duration', '')}"] = [stamps.get(rid, {}).get(name) for rid in rids[s]]
        stages[s] = per
    return lone_summary(ttft, stages, cpu_ms)


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running every concurrency on both sides")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompts-per-slot", type=int, default=4,
                        help="requests per run = this x concurrency, at least --min-prompts (default 4)")
    parser.add_argument("--min-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--lone", type=int, default=60, help="lone-request cycles (0: skip; default 60)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--client-timeout", type=float, default=300.0)
    parser.add_argument("--model-dir", default=str(REPO_ROOT / ".cache" / "tiny-llama"))
    parser.add_argument("--write-readme", action="store_true", help="replace this bench's block in bench/README.md")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args(argv)
    if args.rounds < 0 or min(args.concurrency) < 1 or args.lone < 0 or not (args.rounds or args.lone):
        parser.error("--concurrency must be >= 1, --rounds and --lone >= 0, and one of them > 0")

    t_start = time.monotonic()
    mach, load_before = machine(), loadavg()
    print(f"machine: nproc {mach['nproc']}, {mach['cpu']}; load average {load_before}", flush=True)
    with work_dir("sglang-bench-serving-", args.keep_logs) as work:
        model = str(ensure_tiny_model(args.model_dir))
        python = fork_python()
        prepared = baseline.prepare(work, python)
        dataset = write_sharegpt(work / "sharegpt-tiny.json")
        shared = (*baseline.SHARED_ARGS, TIME_STATS_ARG)
        decode_args = (*shared, *baseline.DECODE_ARGS)
        fork_env = baseline.fork_env(prepared, standins=True, probe=False)
        envs = {"fork": fork_env, "upstream": baseline.upstream_env(prepared, probe=False)}
        if args.lone:
            envs["fork-pace0"] = {**fork_env, "SGLANG_FORK_PD_IDLE_PACE": "0"}
        lb_env = baseline.fork_env(prepared, standins=False, probe=False)
        clusters = {name: PDCluster(model, prefill_env=env, decode_env=env, lb_env=lb_env, prefill_args=shared,
                                    decode_args=decode_args, log_dir=str(work / f"logs-{name}"))
                    for name, env in envs.items()}
        results: Dict[str, Dict[int, List[Dict[str, float]]]] = {s: {c: [] for c in args.concurrency} for s in SIDES}
        lone = None
        try:
            t0 = time.monotonic()
            start_all(*clusters.values())
            print(f"{len(clusters)} 1P1D deployments healthy in {time.monotonic() - t0:.0f}s", flush=True)
            for rnd in range(args.rounds):
                order = SIDES if rnd % 2 == 0 else SIDES[::-1]
                for conc in args.concurrency:
                    n = max(args.min_prompts, args.prompts_per_slot * conc)
                    for side in order:
                        out = work / f"{side}-c{conc}.jsonl"
                        run_client(client_argv(python, clusters[side].url, model, dataset, out, concurrency=conc,
                                               num_prompts=n, input_len=args.input_len, output_len=args.output_len,
                                               seed=args.seed + rnd), work / f"client-{side}.log", args.client_timeout)
                        r = read_result(out)
                        if r["completed"] != n:
                            raise RuntimeError(f"{side} c={conc}: {r['completed']:.0f} of {n} requests completed")
                        results[side][conc].append(r)
                        print(f"round {rnd + 1}/{args.rounds} c={conc:<3d} {side:8s} "
                              f"{r['output_throughput']:7.1f} tok/s  TTFT p50 {r['median_ttft_ms']:6.1f} ms  "
                              f"TPOT p50 {r['median_tpot_ms']:5.1f} ms  ITL p50 {r['median_itl_ms']:5.1f} ms  "
                              f"load {loadavg()}", flush=True)
            if args.lone:
                texts = lone_prompts(model, dataset, args.lone, args.input_len, args.output_len, args.seed + 1000)
                lone = run_lone(clusters, texts, args.output_len)
        finally:
            for c in clusters.values():
                c.teardown()

        cmp = compare(results) if args.rounds else {}
        block = [
            f"Fork `{prepared['fork_version']}` vs upstream `{prepared['version']}`, each 1P1D + mini LB on CPU, tiny "
            f"Llama; upstream's client `python -m sglang.benchmark.serving --backend sglang --dataset-name random "
            f"--random-input-len {args.input_len} --random-output-len {args.output_len} --random-range-ratio 1` "
            f"(streaming), {args.prompts_per_slot} requests per concurrency slot (at least {args.min_prompts}), "
            f"{args.rounds} rounds alternated (fork first, then upstream first, ...); both deployments up side by side, "
            f"identical flags (bench/baseline.py, plus `{TIME_STATS_ARG}`).",
            f"Machine: {mach['nproc']} CPUs, {mach['cpu']}, {mach['mem_gb']} GB RAM, Python {mach['python']}; load "
            f"average {load_before} at start, {loadavg()} at end (shared machine). Run at "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.monotonic() - t_start:.0f} s.",
            f"Command: `make bench-serving ARGS=\"--rounds {args.rounds} --concurrency "
            f"{' '.join(map(str, args.concurrency))} --lone {args.lone}\"`.",
        ]
        if cmp:
            block += ["", ratio_table(cmp)]
        if lone is not None:
            block += [
                "",
                f"The lone request: {lone['n']} cycles of one streaming request ({args.input_len} in, {args.output_len} "
                f"out) to each of fork, fork with `SGLANG_FORK_PD_IDLE_PACE=0` and upstream in turn, nothing else in "
                f"flight. TTFT the fork adds (median of the per-cycle fork - upstream differences ± robust SE): "
                f"**{lone['fork_added_ms']:+.2f} ± {lone['fork_added_se']:.2f} ms**; of it the idle pace (fork - fork "
                f"with pace 0): {lone['pace_ms']:+.2f} ± {lone['pace_se']:.2f} ms. On the stages that run on one "
                f"scheduler thread alone ({', '.join(THREAD_STAGES)}; summed per cycle, paired the same way) the fork "
                f"adds **{lone['thread_added_ms']:+.2f} ± {lone['thread_added_se']:.2f} ms**: {thread_verdict(lone)} "
                f"(decided when the figure ± 2 SE is on one side of it).",
                "",
                lone_table(lone),
            ]
        if cmp:
            where = f"{time.strftime('%Y-%m-%d', time.gmtime())}, {mach['nproc']} CPUs, {args.rounds} rounds"
            block += ["", "README line: " + summary_line(cmp, lone, where)]
        text = "\n".join(block)
        print("\n" + text + "\n")
        if args.write_readme:
            write_block(README, README_BEGIN, README_END, text, HEADING)
            print(f"wrote the figures to {README}")
        print(f"done ({time.monotonic() - t_start:.0f}s)")
        return 0


if __name__ == "__main__":
    import bench

    bench.run(main)
