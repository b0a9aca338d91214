"""`make bench-rl`: how long each call of an RL step takes, fork vs stock upstream 0.5.23.

Both 1P1D deployments (tiny model, CPU, behind the Rust gateway with health checks
every 2 s, or `--balancer mini`; flags and env as the release gate, bench/baseline.py)
start once, side by side. For each number of requests in flight
(default 64 and 256) and each side, the loops of issue 14 run while that many greedy
`ignore_eos` requests are in flight through the balancer, and every call is timed as
the RL framework makes it (one engine after the other: prefill, then decode):

- partial rollout, per pause mode (abort with an empty body = upstream's default,
  retract, in_place): pause_generation -> update_weights_from_disk -> continue_generation;
  after a retract or in_place pause the update passes `flush_cache: false`, as RL
  frameworks do there (upstream refuses to flush a cache that held requests still use:
  with the default the update answers 400 "Weights were updated, but the cache was not
  flushed", on upstream and the fork alike);
- colocated step, once the rollout has ended: flush_cache until it answers 200 (as
  frameworks poll it: it answers 400 while the engine still settles what the ended
  rollout held, e.g. decode's KV awaiting prefill's drain acks; timed to the 200, the
  number of calls in brackets when more than one) -> release_memory_occupation {}
  -> resume_memory_occupation ["weights"] -> update_weights_from_disk ->
  resume_memory_occupation ["kv_cache"] (no continue).

A call that does not answer 200 is reported with its status ("409", "500", "dead" when
the server died). Requests left in flight after a loop are ended with abort_all before
the next. Every loop runs `--repeats` times (default 3) per side and number in flight,
each loop's repeats (at every number in flight) before the next loop, the sides
alternating per repeat; a cell is the
median (min-max); a loop whose requests were all refused before the pause (the balancer took
the side's workers out) says "not serving (<status>)" instead of timing an idle server. Each pause also
records the CPU time the paused server's HTTP process (its main thread: the event loop
that answers every aborted request) and its scheduler spent during the call: on 2
shared cores the wall time of an abort-mode pause follows the machine's load, while
that CPU is the work the pause must wait for (upstream's contract: every in-flight
request answered), its floor. Not a timed test: a benchmark (exit 0 when every figure
was measured, 2 when the bench itself failed). Targets (issue 14): pause <= 0.25 s,
release + resume <= 0.5 s beside the weight load, continue <= 0.1 s.

Usage: python -m bench.rl_step [--inflight 64 256] [--max-new-tokens 256] [--write-readme]
       [--modes abort] [--sides fork upstream] [--no-colocated] [--profile DIR] [--balancer router|mini]
       [--cpu-window]
(--modes/--sides/--no-colocated run a part of the loops; --profile DIR writes a py-spy
speedscope profile of each abort-mode pause's HTTP process and scheduler, py-spy on PATH;
--cpu-window adds what ran on the whole machine during each abort-mode pause.)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import psutil

from bench import baseline, cpu_window
from bench.readme_block import write_block
from bench.release_gate import loadavg, machine
from bench.work_dir import work_dir
from testing.pd_cluster import (
    PDCluster,
    fork_python,
    generate,
    http_get,
    http_post_json,
    prompts,
    start_all,
)
from testing.tiny_model import ensure_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "bench" / "README.md"  # the figures of record; README.md summarises them (testing/doc_tables.py)
README_BEGIN = "<!-- rl-bench:begin (written by `make bench-rl ARGS=--write-readme`) -->"
README_END = "<!-- rl-bench:end -->"
SIDES = ("fork", "upstream")
ROLES = ("prefill", "decode")
MODES = ("abort", "retract", "in_place")
CALL_TIMEOUT = 120.0


def timed(server, path: str, payload=None) -> Tuple[str, float]:
    """One call; ('ok' or the status, seconds)."""
    t0 = time.monotonic()
    try:
        if payload is None:
            status, _ = http_get(server.url + path, timeout=CALL_TIMEOUT)
        else:
            status, _ = http_post_json(server.url + path, payload, timeout=CALL_TIMEOUT)
    except OSError:
        status = "dead" if not server.is_alive() else "error"
    return ("ok" if status == 200 else str(status)), time.monotonic() - t0


class Rollout:
    """n requests in flight through the balancer, one thread each."""

    def __init__(self, url: str, n: int, max_new_tokens: int):
        texts = prompts(n)
        self.statuses: List[object] = []  # each answered request's HTTP status (None: no answer)
        self.threads = [
            threading.Thread(target=self._one, args=(url, texts[i], max_new_tokens), daemon=True)
            for i in range(n)
        ]
        for t in self.threads:
            t.start()

    def _one(self, url: str, text: str, max_new_tokens: int) -> None:
        r = generate(url, text, max_new_tokens, timeout=600, sampling={"ignore_eos": True})
        self.statuses.append(r["status"])  # list.append: atomic across threads

    def unanswered(self) -> int:
        """Requests whose answer the client has not got yet."""
        return sum(t.is_alive() for t in self.threads)

    def refused(self) -> Optional[str]:
        """'not serving (<status>)' when every request was already answered, not all with 200 (e.g. the
        balancer's 503 once it took the side's workers out): a pause then would time an idle server."""
        if self.unanswered() or all(s == 200 for s in self.statuses):
            return None
        return f"not serving ({next(s for s in self.statuses if s != 200)})"

    def join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)


FLUSH_POLLS = 60  # frameworks poll /flush_cache up to 60 times
FLUSH_POLL_S = 0.05


def server_procs(server) -> Dict[str, psutil.Process]:
    """The HTTP process (launch_server: HTTP server + tokenizer) and the scheduler."""
    procs: Dict[str, psutil.Process] = {}
    for pid in server.pids():
        try:
            proc = psutil.Process(pid)
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "sglang.launch_server" in cmd and "http" not in procs:
            procs["http"] = proc
        elif "scheduler" in cmd:
            procs["scheduler"] = proc
    return procs


def cpu_seconds(procs: Dict[str, psutil.Process]) -> Dict[str, float]:
    """CPU seconds so far: the HTTP process's main thread (its event loop), the scheduler."""
    out: Dict[str, float] = {}
    for name, proc in procs.items():
        try:
            if name == "http":
                main = [t for t in proc.threads() if t.id == proc.pid]
                out[name] = main[0].user_time + main[0].system_time if main else 0.0
            else:
                t = proc.cpu_times()
                out[name] = t.user + t.system
        except psutil.Error:
            pass
    return out


PROFILE: Dict[str, object] = {"dir": None, "n": 0}  # --profile: py-spy over each abort-mode pause


def profiled(procs: Dict[str, psutil.Process], name: str, role: str):
    """py-spy record (CPU samples) of the server's scheduler and HTTP process during one call (--profile)."""
    import subprocess

    out = PROFILE["dir"]
    if out is None or not name.startswith("pause abort"):
        return []
    PROFILE["n"] = int(PROFILE["n"]) + 1
    spies = []
    for part, proc in procs.items():
        path = Path(out) / f"{PROFILE['n']:02d}-{role}-{part}.speedscope.json"
        spies.append(subprocess.Popen(
            [shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(proc.pid), "-r", "200",
             "--format", "speedscope", "-o", str(path), "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(0.5)  # py-spy attaches before the call (not a sync: a profile starting late misses the start)
    return spies


# --cpu-window: the deployments up (name -> PDCluster), to label what ran during each abort-mode pause
WINDOW: Dict[str, object] = {"deployments": None}


def machine_window(cluster, role: str, name: str, row: Dict[str, str], before, after, wall: float) -> None:
    """--cpu-window: rows of what ran on the machine during one pause call (bench/cpu_window.py), and a line
    naming the processes that ran longest: the paused deployment's CPU and time waiting for a core, the other
    deployment's CPU, and the CPU of every process of neither (nor the bench's clients)."""
    deployments: Dict[str, object] = WINDOW["deployments"]  # type: ignore[assignment]
    win = cpu_window.window(before[0], after, before[1], wall)
    own = next(n for n, c in deployments.items() if c is cluster)
    row[f"{name} ({role}): its deployment's CPU during it"] = f"{win.total(own + ' '):.3f}"
    row[f"{name} ({role}): its deployment's time waiting for a core during it"] = f"{win.waited(own + ' '):.3f}"
    row[f"{name} ({role}): the other deployment's CPU during it"] = \
        f"{sum(win.total(n + ' ') for n in deployments if n != own):.3f}"
    row[f"{name} ({role}): CPU of the rest of the machine during it"] = f"{win.total('other: '):.3f}"
    print(f"  {own} {name} ({role}) {wall:.3f}s, ran (run/wait s): {win.top(8)}", flush=True)


def both(cluster, path: str, payload, row: Dict[str, str], name: str, cpu: bool = False) -> None:
    """The call on prefill then decode, each timed (with `cpu`: also the CPU the
    server's event loop and scheduler spent during it, and with --cpu-window what ran on
    the whole machine during an abort-mode pause)."""
    import signal

    for role in ROLES:
        procs = server_procs(cluster[role]) if cpu else {}
        spies = profiled(procs, name, role)
        watch = cpu and name.startswith("pause abort") and WINDOW["deployments"] is not None
        snap = (cpu_window.snapshot(), cpu_window.labels(WINDOW["deployments"])) if watch else None
        before = cpu_seconds(procs)
        status, seconds = timed(cluster[role], path, payload)
        after_snap = cpu_window.snapshot() if snap is not None else None
        for spy in spies:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
        row[f"{name} ({role})"] = f"{seconds:.3f}" if status == "ok" else status
        if snap is not None and status == "ok":
            machine_window(cluster, role, name, row, snap, after_snap, seconds)
        if cpu and status == "ok":
            after = cpu_seconds(procs)
            for part, label in (("http", "HTTP event loop"), ("scheduler", "scheduler")):
                if part in before and part in after:
                    row[f"{name} ({role}): {label} CPU during it"] = f"{after[part] - before[part]:.3f}"


def flush_until_200(cluster, row: Dict[str, str]) -> None:
    """GET /flush_cache on prefill then decode until it answers 200, as frameworks do
    before a release; the time to the 200 (and the number of calls if more than one),
    or the last status after FLUSH_POLLS calls."""
    for role in ROLES:
        t0 = time.monotonic()
        for calls in range(1, FLUSH_POLLS + 1):
            status, _ = timed(cluster[role], "/flush_cache")
            if status == "ok" or status in ("dead", "error"):
                break
            time.sleep(FLUSH_POLL_S)
        seconds = time.monotonic() - t0
        shown = f"{seconds:.3f}" + (f" ({calls} calls)" if calls > 1 else "")
        row[f"flush_cache until 200 ({role})"] = shown if status == "ok" else status


def settle(cluster, rollout: Rollout) -> None:
    for role in ROLES:
        timed(cluster[role], "/abort_request", {"abort_all": True})
    rollout.join(120)


def one_side(cluster, model: str, inflight: int, max_new_tokens: int,
             modes: Sequence[str] = MODES, colocated: bool = True) -> Dict[str, str]:
    row: Dict[str, str] = {}
    update = {"model_path": model}
    for mode in modes:
        rollout = Rollout(cluster.url, inflight, max_new_tokens)
        time.sleep(2.0)  # the requests reach both servers (this is load, not a sync)
        payload = {} if mode == "abort" else {"mode": mode}
        row[f"requests unanswered at pause {mode}"] = str(rollout.unanswered())
        refused = rollout.refused()
        if refused:
            row[f"pause {mode}, prefill + decode"] = refused
            settle(cluster, rollout)
            continue
        both(cluster, "/pause_generation", payload, row, f"pause {mode}", cpu=True)
        calls = [row.get(f"pause {mode} ({role})", "") for role in ROLES]
        if all("." in c for c in calls):  # the step's pause: prefill's ending can move work to decode's
            row[f"pause {mode}, prefill + decode"] = f"{sum(map(float, calls)):.3f}"
        # requests held by a retract/in_place pause still use the cache: no flush
        held = update if mode == "abort" else {**update, "flush_cache": False}
        both(cluster, "/update_weights_from_disk", held, row, f"update_weights_from_disk after pause {mode}")
        both(cluster, "/continue_generation", {}, row, f"continue after pause {mode}")
        settle(cluster, rollout)
    if not colocated:
        return row
    # colocated: the rollout ended (requests aborted), engine idle, no pause
    rollout = Rollout(cluster.url, inflight, max_new_tokens)
    time.sleep(2.0)
    settle(cluster, rollout)
    if rollout.refused():
        row["colocated step"] = rollout.refused()
        return row
    flush_until_200(cluster, row)
    both(cluster, "/release_memory_occupation", {}, row, "release {}")
    both(cluster, "/resume_memory_occupation", {"tags": ["weights"]}, row, "resume [weights]")
    both(cluster, "/update_weights_from_disk", update, row, "update_weights_from_disk after resume")
    both(cluster, "/resume_memory_occupation", {"tags": ["kv_cache"]}, row, "resume [kv_cache]")
    after = generate(cluster.url, "hello world", 4, timeout=60)
    row["serves after the step"] = "yes" if after["status"] == 200 else f"no ({after['status']})"
    return row


def merge(rows: List[Dict[str, str]]) -> Dict[str, str]:
    """Repeats of one side's loops, per call: the median (min-max) of the times, and
    any status a repeat got instead (refused, dead) with how many repeats got it."""
    merged: Dict[str, str] = {}
    keys: List[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    for k in keys:
        values = [row[k] for row in rows if k in row]
        times = [float(v.split(" ")[0]) for v in values if "." in v.split(" ")[0]]
        others = [v for v in values if "." not in v.split(" ")[0]]
        parts = []
        if len(times) == 1:
            parts.append(next(v for v in values if "." in v.split(" ")[0]))
        elif times:
            parts.append(f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f})")
        for v in sorted(set(others)):
            n = others.count(v)
            parts.append(v if n == len(values) else f"{v} x{n}")
        merged[k] = "; ".join(parts)
    return merged


def table(results: Dict[Tuple[str, int], Dict[str, str]], inflight: Sequence[int]) -> str:
    keys: List[str] = []
    for row in results.values():
        keys += [k for k in row if k not in keys]
    cols = [(side, n) for n in inflight for side in SIDES]
    head = "| call (seconds, or HTTP status) | " + " | ".join(f"{s} @{n}" for s, n in cols) + " |"
    lines = [head, "|---|" + "---:|" * len(cols)]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(results.get(c, {}).get(k, "n/a") for c in cols) + " |")
    return "\n".join(lines)


BALANCER_TEXT = {
    "router": "the Rust gateway (workers self-registered, health checks every 2 s)",
    "mini": "the mini LB",
}
CPU_WINDOW_TEXT = (
    " The abort-mode pause's other rows (bench/cpu_window.py, /proc schedstat of every thread on the machine "
    "before and after the call): CPU seconds the paused deployment (both servers, balancer) used and its time "
    "runnable but waiting for a core; CPU of the other side's deployment; CPU of every process of neither "
    "(the machine's other tenants)."
)


def write_readme(block: str) -> None:
    write_block(README, README_BEGIN, README_END, block)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inflight", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="loops per side and number in flight")
    parser.add_argument("--model-dir", default=str(REPO_ROOT / ".cache" / "tiny-llama"))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="pause modes to run (e.g. --modes abort)")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--no-colocated", action="store_true", help="skip the colocated step")
    parser.add_argument("--balancer", choices=("mini", "router"), default="router",
                        help="the Rust gateway (default: workers self-registered, health checks every 2 s), "
                             "or the mini LB")
    parser.add_argument("--profile", metavar="DIR", help="py-spy record each abort-mode pause's server into DIR")
    parser.add_argument("--cpu-window", action="store_true",
                        help="also record what ran on the whole machine during each pause call (bench/cpu_window.py)")
    parser.add_argument("--write-readme", action="store_true")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args(argv)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        PROFILE["dir"] = args.profile
    mach, load_before = machine(), loadavg()
    with work_dir("sglang-bench-rl-", args.keep_logs) as work:
        model = str(ensure_tiny_model(args.model_dir))
        prepared = baseline.prepare(work, fork_python())
        up_env = baseline.upstream_env(prepared)
        fk_env = baseline.fork_env(prepared, standins=True)
        lb_env = baseline.fork_env(prepared, standins=False)
        decode_args = (*baseline.SHARED_ARGS, *baseline.DECODE_ARGS)
        clusters = {
            name: PDCluster(model, prefill_env=env, decode_env=env, lb_env=lb_env,
                            prefill_args=baseline.SHARED_ARGS, decode_args=decode_args,
                            balancer=args.balancer,
                            lb_args=("--health-check-interval-secs", "2") if args.balancer == "router" else (),
                            log_dir=str(work / f"logs-{name}"))
            for name, env in (("fork", fk_env), ("upstream", up_env)) if name in args.sides
        }
        results: Dict[Tuple[str, int], Dict[str, str]] = {}
        try:
            start_all(*clusters.values())
            if args.cpu_window:
                WINDOW["deployments"] = clusters
            steps = [*args.modes] + ([] if args.no_colocated else ["colocated"])
            # each loop's repeats at every number in flight before the next loop: a loop that breaks a side
            # (upstream's gateway takes its workers out for a while after the retract loop's abort_all) spoils
            # only the loops after it; the sides alternate per repeat, so both see the machine's load alike
            rows: Dict[Tuple[str, int], List[Dict[str, str]]] = {
                (name, n): [{} for _ in range(args.repeats)] for name in clusters for n in args.inflight}
            t0 = time.monotonic()
            for step in steps:
                for n in args.inflight:
                    for repeat in range(args.repeats):
                        for name, cluster in clusters.items():
                            if not all(cluster[r].is_alive() for r in ROLES):
                                print(f"{name} @{n}: a server died earlier, skipped", flush=True)
                                continue
                            rows[(name, n)][repeat].update(one_side(
                                cluster, model, n, args.max_new_tokens, [step] if step in MODES else [],
                                colocated=step == "colocated"))
                    print(f"{step} @{n} done ({time.monotonic() - t0:.0f}s)", flush=True)
            for key, repeats in rows.items():
                if any(repeats):
                    results[key] = merge([row for row in repeats if row])
                    print(f"{key[0]} @{key[1]} in flight: {results[key]}", flush=True)
        finally:
            for c in clusters.values():
                c.teardown()
        block = "\n".join([
            f"Fork `{prepared['fork_version']}` vs upstream `{prepared['version']}`, 1P1D on CPU behind "
            f"{BALANCER_TEXT[args.balancer]}, "
            f"tiny Llama, {' and '.join(map(str, args.inflight))} greedy requests in flight "
            f"({args.max_new_tokens} output tokens, ignore_eos), each call timed on prefill then decode; "
            f"median (min-max) of {args.repeats} repeats (fork and upstream alternate per repeat; each loop's repeats "
            f"at every number in flight run before the next loop). \"CPU during it\": CPU seconds the paused "
            f"server's HTTP event loop (main thread of the HTTP/tokenizer process) and scheduler used during "
            f"the pause call." + (CPU_WINDOW_TEXT if args.cpu_window else ""),
            f"Command: `make bench-rl ARGS=\"{' '.join(a for a in (argv if argv is not None else sys.argv[1:]) if a not in ('--write-readme', '--keep-logs'))}\"`.",
            f"Machine: {mach['nproc']} CPUs, {mach['cpu']}, {mach['mem_gb']} GB RAM, Python {mach['python']}; "
            f"load average {load_before} at start, {loadavg()} at end (shared machine). "
            f"Run at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
            "",
            table(results, args.inflight),
        ])
        print("\n" + block + "\n")
        if args.write_readme:
            write_readme(block)
            print(f"wrote the table to {README}")
        return 0


if __name__ == "__main__":
    import bench

    bench.run(main)
