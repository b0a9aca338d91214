"""What recovery adds to a request's latency (`make bench-recovery`; docs/recovery.md).

One 1P1D deployment of the fork on CPU (tiny model, mini LB, mooncake over TCP on loopback; testing/pd_cluster.py)
with recovery on (`SGLANG_FORK_RECOVERY_ATTEMPTS=1`) and the test fault switch set on prefill for every cause of
`CAUSES` (each cause's requests are told apart by their rid prefix). N cycles, each sending one calm request and one
request of each cause, one at a time (nothing else in flight; the order rotated each cycle), non-streaming, greedy,
each with a prompt of its own (no cached prefix on the first attempt). Per cause:

- **added**: the recovered request's latency at the client minus the calm request's of the same cycle (median of the
  per-cycle differences and their spread);
- **detection**: from the client sending the request to decode's tokenizer holding back the failed attempt's end
  (decode's log line `Recovery of <rid>: its transfer failed ...`, stamped to the millisecond with `SGLANG_LOG_MS=1`,
  against the client's wall clock: same machine);
- **re-run**: from that hold-back to the client's answer (the new room's prefill, transfer and decode).

Every recovered request must answer 200 with `meta_info["recovery"]` naming one attempt of its cause, and the calm
ones 200 without it; else the bench stops (BENCH ERROR). A cause is one row of `CAUSES`: its fault entry on prefill
(`SGLANG_TEST_DISAGG_FAIL_CHUNKS`, `+first`: the first attempt only) and the cause `meta_info` names.

Usage: python -m bench.recovery [--requests N] [--max-new-tokens N] [--write-readme] [--keep-logs]
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Dict, List, Mapping, Sequence, Tuple

from bench.readme_block import write_block
from bench.release_gate import loadavg, machine
from bench.work_dir import work_dir
from testing.pd_cluster import PDCluster, generate, start_all
from testing.tiny_model import ensure_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "bench" / "README.md"
README_BEGIN = "<!-- bench-recovery:begin (written by `make bench-recovery ARGS=--write-readme`) -->"
README_END = "<!-- bench-recovery:end -->"
HEADING = "## Recovery's added latency (`make bench-recovery`)"
CALM = "calm"


@dataclass(frozen=True)
class Cause:
    """A recoverable failure the bench can make happen on a request's first attempt."""

    name: str  # as `meta_info["recovery"]["cause"]` names it
    label: str  # the table's words for it
    fault: str  # the prefill's SGLANG_TEST_DISAGG_FAIL_CHUNKS entry; {prefix}: the cause's rid prefix
    prefill_env: Mapping[str, str] = field(default_factory=dict)  # more env this cause needs on prefill
    decode_env: Mapping[str, str] = field(default_factory=dict)  # ... and on decode

    @property
    def prefix(self) -> str:
        return f"rec-{self.name}-"


# The stall's deadline, on both servers (decode's `decode_transfer` deadline is the one that fires), and the stall:
# longer than the deadline, so the first attempt is ended by it; the re-run's KV waits behind the stalled transfer
# worker (one transfer queue per decode session) until the stall is over, well inside the re-run's own deadline.
STALL_DEADLINE_S = 3.0
STALL_S = 4.0
_DEADLINE_ENV = {"SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": f"{STALL_DEADLINE_S:g}"}
CAUSES: Tuple[Cause, ...] = (
    Cause("chunk_failure", "a KV chunk write failed on the first attempt", "kv+first:rid={prefix}"),
    Cause("transfer_deadline", f"a KV transfer stalled {STALL_S:g} s on the first attempt, past a "
          f"{STALL_DEADLINE_S:g} s transfer deadline", f"kv+delay={STALL_S:g}+first:rid={{prefix}}",
          prefill_env=_DEADLINE_ENV, decode_env=_DEADLINE_ENV),
)
RECOVERY_ENV = {"SGLANG_FORK_RECOVERY_ATTEMPTS": "1", "SGLANG_FORK_RECOVERY_BUDGET": "30", "SGLANG_LOG_MS": "1"}

_HELD = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\.(\d{3})[^\]]*\] Recovery of (\S+): its transfer failed")


def deployment_env(causes: Sequence[Cause]) -> Tuple[Dict[str, str], Dict[str, str]]:
    """(prefill's env, decode's env) for one deployment serving every cause: the fault entries joined."""
    prefill = {"SGLANG_TEST_DISAGG_FAIL_CHUNKS": ",".join(c.fault.format(prefix=c.prefix) for c in causes)}
    decode = dict(RECOVERY_ENV)
    for c in causes:
        prefill.update(c.prefill_env)
        decode.update(c.decode_env)
    return prefill, decode


def parse_held_back(log_text: str) -> Dict[str, float]:
    """rid -> when decode's tokenizer held back its failed attempt's end (epoch seconds, the log's local time to the
    millisecond; the first such line of a rid)."""
    out: Dict[str, float] = {}
    for line in log_text.splitlines():
        m = _HELD.match(line)
        if m and m.group(3) not in out:
            stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
            out[m.group(3)] = stamp + int(m.group(2)) / 1000
    return out


def spread(values: Sequence[float]) -> Dict[str, float]:
    """Median, quartiles, min and max of `values` (ms)."""
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else [ordered[0]] * 3
    return {"median": statistics.median(ordered), "q1": q[0], "q3": q[2], "min": ordered[0], "max": ordered[-1],
            "n": len(ordered)}


def summarize(runs: Mapping[str, List[Dict[str, float]]], held: Mapping[str, float]) -> Dict[str, Dict[str, object]]:
    """Per cause, from the cycles' runs (`runs[CALM]` and `runs[cause]`, cycle by cycle: each a dict of `rid`,
    `sent` (epoch s), `latency` (s)) and the hold-back stamps: `added` (recovered - calm latency of the same cycle),
    `detection` (sent -> held back), `rerun` (held back -> answered), `calm` and `recovered` latencies; all in ms."""
    out: Dict[str, Dict[str, object]] = {}
    calm = runs[CALM]
    for cause, rows in runs.items():
        if cause == CALM:
            continue
        added, detection, rerun = [], [], []
        for calm_row, row in zip(calm, rows):
            added.append(1e3 * (row["latency"] - calm_row["latency"]))
            stamp = held.get(row["rid"])
            if stamp is None:
                raise ValueError(f"{row['rid']}: no hold-back line in decode's log")
            detection.append(1e3 * (stamp - row["sent"]))
            rerun.append(1e3 * (row["sent"] + row["latency"] - stamp))
        out[cause] = {"added": spread(added), "detection": spread(detection), "rerun": spread(rerun),
                      "calm": spread([1e3 * r["latency"] for r in calm[:len(rows)]]),
                      "recovered": spread([1e3 * r["latency"] for r in rows])}
    return out


def _cell(s: Mapping[str, float]) -> str:
    return f"{s['median']:.0f} ({s['q1']:.0f}-{s['q3']:.0f}; {s['min']:.0f}-{s['max']:.0f})"


def table(summary: Mapping[str, Mapping[str, Mapping[str, float]]]) -> str:
    """Markdown: one row per cause."""
    labels = {c.name: c.label for c in CAUSES}
    lines = ["| cause | requests | calm latency | recovered latency | added (recovered - calm, per cycle) | "
             "detection (sent -> held back) | re-run (held back -> answered) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for cause, s in summary.items():
        lines.append(f"| {labels.get(cause, cause)} (`{cause}`) | {s['added']['n']} | {_cell(s['calm'])} | "
                     f"{_cell(s['recovered'])} | **{_cell(s['added'])}** | {_cell(s['detection'])} | "
                     f"{_cell(s['rerun'])} |")
    return "\n".join(lines)


def summary_line(summary: Mapping[str, Mapping[str, Mapping[str, float]]], where: str = "") -> str:
    """README.md's one line for this bench; `where`: the run's date and machine, in brackets at its end."""
    labels = {c.name: c.label for c in CAUSES}
    parts = [f"{labels.get(cause, cause)}: +{s['added']['median']:.0f} ms over a calm request (median of "
             f"{s['added']['n']}, quartiles {s['added']['q1']:.0f}-{s['added']['q3']:.0f}; detection "
             f"{s['detection']['median']:.0f} ms, re-run {s['rerun']['median']:.0f} ms)"
             for cause, s in summary.items()]
    text = "- **Recovery** (`make bench-recovery`): a recovered request, " + "; ".join(parts)
    return text + (f" ({where})." if where else ".")


def one(url: str, text: str, rid: str, max_new_tokens: int, cause: str) -> Dict[str, float]:
    """One request through the balancer, checked (200; `meta_info` recovery as its cause says): its rid, when it
    was sent (epoch s) and its latency (s)."""
    sent = time.time()
    got = generate(url, text, max_new_tokens=max_new_tokens, rid=rid)
    if got["status"] != 200:
        raise RuntimeError(f"{rid}: answered {got['status']}: {str(got['error'])[:300]}")
    recovery = got["meta"].get("recovery")
    want = None if cause == CALM else {"attempts": 1, "cause": cause}
    if recovery != want:
        raise RuntimeError(f"{rid}: meta_info recovery {recovery}, expected {want}")
    return {"rid": rid, "sent": sent, "latency": got["latency"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20, help="cycles: one calm and one per cause each (20)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--model-dir", default=str(REPO_ROOT / ".cache" / "tiny-llama"))
    parser.add_argument("--write-readme", action="store_true", help="replace this bench's block in bench/README.md")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args(argv)
    if args.requests < 2:
        parser.error("--requests must be >= 2")

    t_start = time.monotonic()
    mach, load_before = machine(), loadavg()
    print(f"machine: nproc {mach['nproc']}, {mach['cpu']}; load average {load_before}", flush=True)
    with work_dir("sglang-bench-recovery-", args.keep_logs) as work:
        model = str(ensure_tiny_model(args.model_dir))
        prefill_env, decode_env = deployment_env(CAUSES)
        cluster = PDCluster(model, prefill_env=prefill_env, decode_env=decode_env, log_dir=str(work / "logs"))
        names = [CALM] + [c.name for c in CAUSES]
        prefixes = {CALM: "calm-", **{c.name: c.prefix for c in CAUSES}}
        runs: Dict[str, List[Dict[str, float]]] = {n: [] for n in names}
        tag = uuid.uuid4().hex[:6]
        try:
            t0 = time.monotonic()
            start_all(cluster)
            print(f"1P1D healthy in {time.monotonic() - t0:.0f}s", flush=True)
            one(cluster.url, "warm up", f"warmup-{tag}", args.max_new_tokens, CALM)
            for i in range(args.requests):
                for k, name in enumerate(names[i % len(names):] + names[:i % len(names)]):
                    text = f"cycle {i} request {k} {tag}: the quick brown fox jumps over the lazy dog"
                    runs[name].append(one(cluster.url, text, f"{prefixes[name]}{tag}-{i}", args.max_new_tokens,
                                          name))
                print(f"cycle {i + 1}/{args.requests}: " + ", ".join(
                    f"{n} {1e3 * runs[n][-1]['latency']:.0f} ms" for n in names) + f"; load {loadavg()}", flush=True)
            held = parse_held_back(cluster["decode"].log_path.read_text(errors="replace"))
        finally:
            cluster.teardown()

        summary = summarize(runs, held)
        where = f"{time.strftime('%Y-%m-%d', time.gmtime())}, {mach['nproc']} CPUs"
        block = "\n".join([
            f"The fork 1P1D + mini LB on CPU, tiny Llama, recovery on (`SGLANG_FORK_RECOVERY_ATTEMPTS=1`); "
            f"{args.requests} cycles of one calm request and one request per cause, one at a time, non-streaming, "
            f"greedy, {args.max_new_tokens} new tokens, each its own prompt. Milliseconds: median (quartiles; min-max). "
            f"Detection: from the client sending the request to decode's tokenizer holding back the failed "
            f"attempt's end (decode's log, `SGLANG_LOG_MS=1`); re-run: from then to the client's answer.",
            f"Machine: {mach['nproc']} CPUs, {mach['cpu']}, {mach['mem_gb']} GB RAM, Python {mach['python']}; load "
            f"average {load_before} at start, {loadavg()} at end (shared machine). Run at "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.monotonic() - t_start:.0f} s.",
            f"Command: `make bench-recovery ARGS=\"--requests {args.requests} --max-new-tokens "
            f"{args.max_new_tokens}\"`.",
            "",
            table(summary),
            "",
            "README line: " + summary_line(summary, where),
        ])
        print("\n" + block + "\n")
        if args.write_readme:
            write_block(README, README_BEGIN, README_END, block, HEADING)
            print(f"wrote the figures to {README}")
        print(f"done ({time.monotonic() - t_start:.0f}s)")
        return 0


if __name__ == "__main__":
    import bench

    bench.run(main)
