"""Cost of each of the fork's hooks, in process (`make bench-hooks`, < 2 min).

Over upstream's real PD queues (testing/queue_harness.py: the real
PrefillBootstrapQueue, prefill waiting/inflight processing, DecodePreallocQueue and
DecodeTransferQueue over real CPU pools, a one-rank gloo group and the scripted
`fake` transfer backend), with 100, 1,000 and 10,000 requests parked at each stage,
it times one scheduler pass of that stage with the fork's hooks applied and with them
not applied:

    prefill  bootstrap  PrefillBootstrapQueue.pop_bootstrapped   (rooms held Bootstrapping)
             waiting    resolve_waiting_queue_bootstrap          (admission held)
             inflight   process_disagg_prefill_inflight_queue    (KV transfers held)
    decode   prealloc   DecodePreallocQueue.pop_preallocated     (rooms held Bootstrapping)
             transfer   DecodeTransferQueue.pop_transferred      (KV transfers held)

"Not applied" is upstream: every target of `fork_plugin.HOOKS` gets back the callable
HookRegistry wrapped (one `__wrapped__` per hook registered on it, checked to be
HookRegistry's wrappers), in the classes and in every module that holds it. One
harness per side is built at the largest count (with the hooks, as in production; the
hooks that run when a queue builds its transfer manager only attach handlers for peer
messages, which no pass calls) and a smaller count queues the first n requests of
each stage; passes over the same queues run interleaved
(on/off, off/on, ...) in the same process; each pass is timed in CPU time of this
thread (co-tenants of a shared machine move it far less than wall time) and the
figure is the median over repetitions of the on/off ratio of a pair. The
mean ratio (total on / total off) is printed too: it includes work a hook does only
every so often (the transfer deadline scans a queue at most once a second).

Also: the peer monitors' (fork_peers prefill_side_monitor / decode_side_monitor) cost per probe with 1, 8 and
64 peers listening on loopback, prefill (decode sessions) and decode (prefill
bootstrap servers) side; its manager is a stand-in holding the tables it reads.

Usage: python -m bench.hook_cost [--budget-s 2.0] [--counts 100,1000,10000] [--markdown-only]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import pkgutil
import selectors
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from testing.queue_harness import DecodeHarness, KVPoll, PrefillHarness

from sglang.srt.managers.fork_core import fork_plugin
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry

GOAL = 1.05  # hooks-on / hooks-off time of one pass at 10,000 queued requests
COUNTS = (100, 1000, 10000)
PEERS = (1, 8, 64)
PROMPT_LEN = 4
STAGES = (
    ("prefill", "bootstrap", "PrefillBootstrapQueue.pop_bootstrapped"),
    ("prefill", "waiting", "resolve_waiting_queue_bootstrap"),
    ("prefill", "inflight", "process_disagg_prefill_inflight_queue"),
    ("decode", "prealloc", "DecodePreallocQueue.pop_preallocated"),
    ("decode", "transfer", "DecodeTransferQueue.pop_transferred"),
)


# ----------------------------------------------------------------------------- hooks on/off


class HookSwitch:
    """Swaps every `fork_plugin.HOOKS` target between HookRegistry's wrapper (on) and
    the callable it wrapped (off), on the owning class/module and in every module that
    holds a `from X import name` copy (HookRegistry propagated the patch there)."""

    def __init__(self) -> None:
        load_plugins()  # as a scheduler process does: the fork's hooks, applied
        per_target = Counter(target for target, _, _ in fork_plugin.HOOKS)
        self.slots: List[Tuple[object, str, object, object]] = []  # (owner, attr, on, off)
        self.targets: Dict[str, Tuple[object, object]] = {}
        missing = [t for t in per_target if t not in HookRegistry._patched]
        if missing:
            raise RuntimeError(f"hooks not applied in this process: {missing}")
        for target, n in per_target.items():
            owner_path, attr = target.rsplit(".", 1)
            owner = pkgutil.resolve_name(owner_path)
            raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
            fn = raw.__func__ if kind else raw
            orig = fn
            for _ in range(n):
                if not orig.__code__.co_filename.endswith("hook_registry.py"):
                    raise RuntimeError(f"{target}: expected {n} HookRegistry wrappers, found fewer")
                orig = orig.__wrapped__
            off = kind(orig) if kind else orig
            self.targets[target] = (raw, off)
            self.slots.append((owner, attr, raw, off))
            if not isinstance(owner, type):
                for mod in list(sys.modules.values()):
                    if mod is None or mod is owner:
                        continue
                    try:
                        names = [k for k, v in vars(mod).items() if v is raw]
                    except TypeError:
                        continue
                    self.slots.extend((mod, k, raw, off) for k in names)

    def set(self, on: bool, only: Optional[str] = None) -> None:
        """All hooks on or off; with `only`, just that target's slots."""
        for owner, attr, raw, off in self.slots:
            if only is None or self._target_of(owner, attr, raw) == only:
                setattr(owner, attr, raw if on else off)

    def _target_of(self, owner, attr, raw) -> Optional[str]:
        for target, (r, _) in self.targets.items():
            if r is raw:
                return target
        return None

    def called(self, fn: Callable[[], object]) -> Dict[str, int]:
        """Targets called during fn() (hooks on), with call counts."""
        counts: Counter = Counter()
        saved = []
        for owner, attr, raw, off in self.slots:
            target = self._target_of(owner, attr, raw)
            inner = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw

            def counting(*a, _t=target, _f=inner, **kw):
                counts[_t] += 1
                return _f(*a, **kw)

            wrapped = type(raw)(counting) if isinstance(raw, (classmethod, staticmethod)) else counting
            saved.append((owner, attr, raw))
            setattr(owner, attr, wrapped)
        try:
            fn()
        finally:
            for owner, attr, raw in saved:
                setattr(owner, attr, raw)
        return dict(counts)


# ----------------------------------------------------------------------------- queues


def build_prefill(n: int) -> Tuple[PrefillHarness, Dict[str, Callable[[], object]]]:
    """A prefill harness with n requests inflight (transfer held), n in the waiting
    queue (admission held) and n in the bootstrap queue (rooms held Bootstrapping)."""
    h = PrefillHarness(
        kv_tokens=n * PROMPT_LEN + 256, req_slots=n + 16, metadata_slots=2 * n + 16,
        max_context_len=PROMPT_LEN + 16,
    )
    reqs = [h.add(h.make_req(prompt_len=PROMPT_LEN)) for _ in range(n)]
    for r in reqs:
        h.faults.hold_transfer(r.bootstrap_room)
    h.run_until(lambda: len(h.inflight) == n, max_ticks=20)
    h.hold_admission = True
    for _ in range(n):
        h.add(h.make_req(prompt_len=PROMPT_LEN))
    h.run_until(lambda: len(h.waiting) == n, max_ticks=20)
    for _ in range(n):
        r = h.add(h.make_req(prompt_len=PROMPT_LEN))
        h.faults.set(r.bootstrap_room, KVPoll.Bootstrapping)
    s = h.scheduler
    # looked up at call time, so that switching the hooks reaches the pass itself
    passes = {
        "bootstrap": lambda: h.queue.pop_bootstrapped(),
        "waiting": lambda: s.resolve_waiting_queue_bootstrap(),
        "inflight": lambda: s.process_disagg_prefill_inflight_queue(),
    }
    return h, passes


def build_decode(n: int) -> Tuple[DecodeHarness, Dict[str, Callable[[], object]]]:
    """A decode harness with n requests in the transfer queue (transfer held) and n in
    the prealloc queue (rooms held Bootstrapping)."""
    h = DecodeHarness(
        kv_tokens=n * (PROMPT_LEN + 24) + 512, req_slots=n + 16, metadata_slots=n + 16,
        max_context_len=PROMPT_LEN + 32,
    )
    reqs = [h.add(h.make_req(prompt_len=PROMPT_LEN, max_new_tokens=4)) for _ in range(n)]
    for r in reqs:
        h.faults.hold_transfer(r.bootstrap_room)
    h.run_until(lambda: len(h.transfer_queue.queue) == n, max_ticks=50)
    for _ in range(n):
        r = h.add(h.make_req(prompt_len=PROMPT_LEN, max_new_tokens=4))
        h.faults.set(r.bootstrap_room, KVPoll.Bootstrapping)
    passes = {
        "prealloc": lambda: h.queue.pop_preallocated(),
        "transfer": lambda: h.transfer_queue.pop_transferred(),
    }
    return h, passes


def _queued(h, stage: str) -> int:
    lengths = h.snapshot().held()["queues"]
    return {"bootstrap": lengths.get("bootstrap"), "waiting": lengths.get("waiting"),
            "inflight": lengths.get("inflight"), "prealloc": lengths.get("prealloc"),
            "transfer": lengths.get("transfer")}[stage]


def timed(h, fn: Callable[[], object]) -> float:
    """CPU seconds of this thread for one pass."""
    with h.active():
        t0 = time.thread_time()
        fn()
        return time.thread_time() - t0


def compare(switch: HookSwitch, on: Tuple[object, Callable], off: Tuple[object, Callable],
            budget_s: float, min_pairs: int = 41, max_pairs: int = 400) -> Dict[str, float]:
    """Interleaved on/off passes; median of per-pair ratios, medians of each side."""
    t_on, t_off, ratios = [], [], []
    deadline = time.monotonic() + budget_s
    i = 0
    while i < max_pairs and (i < min_pairs or time.monotonic() < deadline):
        order = (True, False) if i % 2 == 0 else (False, True)
        got = {}
        for flag in order:
            switch.set(flag)
            h, fn = on if flag else off
            got[flag] = timed(h, fn)
        switch.set(True)
        t_on.append(got[True])
        t_off.append(got[False])
        if got[False] > 0:
            ratios.append(got[True] / got[False])
        i += 1
    return {
        "on_us": 1e6 * statistics.median(t_on), "off_us": 1e6 * statistics.median(t_off),
        "ratio": statistics.median(ratios), "mean_ratio": sum(t_on) / sum(t_off), "pairs": i,
    }


def attribute(switch: HookSwitch, h, fn, targets: Sequence[str], budget_s: float) -> Dict[str, float]:
    """For a stage over its goal: per hook target called in the pass, the median
    ratio of the pass with all hooks on vs all on but that one."""
    out = {}
    for target in targets:
        ratios = []
        deadline = time.monotonic() + budget_s
        while len(ratios) < 15 or time.monotonic() < deadline:
            switch.set(True)
            a = timed(h, fn)
            switch.set(False, only=target)
            b = timed(h, fn)
            switch.set(True)
            if b > 0:
                ratios.append(a / b)
            if len(ratios) >= 200:
                break
        out[target] = statistics.median(ratios)
    return out


# The object each stage's pass is a method of (what a hook on it receives first).
PASS_SELF = {
    "bootstrap": lambda h: h.queue, "waiting": lambda h: h.scheduler, "inflight": lambda h: h.scheduler,
    "prealloc": lambda h: h.queue, "transfer": lambda h: h.transfer_queue,
}


def deadline_scan_ms(h, stage: str, called: Dict[str, int], repeats: int = 5) -> Optional[float]:
    """CPU ms of the transfer deadline's full scan of this stage's queue (its hook
    scans at most once a second; every other pass takes the one-lookup fast path),
    forced with transfer_deadline.reset_scan_schedule()."""
    from sglang.srt.disaggregation.fork_transfer import transfer_deadline as td

    fns = [
        getattr(sys.modules[ref.split(":")[0]], ref.split(":")[1])
        for target, ref, _ in fork_plugin.HOOKS
        if target in called and ref.startswith(td.__name__ + ":")
    ]
    if not fns:
        return None
    times = []
    with h.active():
        for _ in range(repeats):
            td.reset_scan_schedule()
            t0 = time.thread_time()
            for fn in fns:
                fn(PASS_SELF[stage](h))
            times.append(time.thread_time() - t0)
    return 1e3 * statistics.median(times)


def growth_exponent(counts: Sequence[int], times: Sequence[float]) -> float:
    """Slope of log(time) over log(count) between the two largest counts (1.0 = linear)."""
    (c1, t1), (c2, t2) = list(zip(counts, times))[-2:]
    return math.log(t2 / t1) / math.log(c2 / c1)


class AlwaysOn:
    """A switch that leaves the hooks on whatever it is asked (and still does the same
    attribute writes): the A/A control, whose ratio is the method's own noise."""

    def __init__(self, switch: HookSwitch) -> None:
        self.switch = switch

    def set(self, on: bool, only: Optional[str] = None) -> None:
        self.switch.set(True)


# Where each stage's queue lives: (object getter, attribute).
QUEUE_OF = {
    "bootstrap": (lambda h: h.queue, "queue"),
    "waiting": (lambda h: h.scheduler, "waiting_queue"),
    "inflight": (lambda h: h.scheduler, "disagg_prefill_inflight_queue"),
    "prealloc": (lambda h: h.queue, "queue"),
    "transfer": (lambda h: h.transfer_queue, "queue"),
}


class parked:
    """Within the block, only the first n requests of a stage's queue are queued (the
    others stay built and holding what they hold): one harness built at the largest
    count serves every count."""

    def __init__(self, h, stage: str, n: int) -> None:
        getter, self.attr = QUEUE_OF[stage]
        self.owner = getter(h)
        self.n = n

    def __enter__(self):
        self.full = getattr(self.owner, self.attr)
        setattr(self.owner, self.attr, self.full[: self.n])

    def __exit__(self, *exc):
        setattr(self.owner, self.attr, self.full)


def run_passes(counts: Sequence[int], budget_s: float, log) -> Tuple[List[Dict], Dict[str, Dict[str, float]]]:
    switch = HookSwitch()
    results: List[Dict] = []
    attributions: Dict[str, Dict[str, float]] = {}
    top = max(counts)
    for side, build in (("prefill", build_prefill), ("decode", build_decode)):
        t0 = time.monotonic()
        switch.set(True)
        h, passes = build(top)  # built with the hooks, as in production
        log(f"  {side}: harness with {top:,} requests per stage built in {time.monotonic() - t0:.1f}s")
        for s_side, stage, label in STAGES:
            if s_side != side:
                continue
            for n in counts:
                with parked(h, stage, n):
                    if _queued(h, stage) != n:
                        raise RuntimeError(f"{side} {stage}: {_queued(h, stage)} queued, expected {n}")
                    gc.collect()
                    gc.disable()
                    try:
                        # the same queues with and without the hooks
                        r = compare(switch, (h, passes[stage]), (h, passes[stage]), budget_s)
                        called = switch.called(lambda: timed(h, passes[stage]))
                        r["scan_ms"] = deadline_scan_ms(h, stage, called)
                        if n == top:
                            r["aa_ratio"] = compare(AlwaysOn(switch), (h, passes[stage]), (h, passes[stage]), budget_s)["ratio"]
                        if n == top and r["ratio"] > GOAL:
                            attributions[f"{side} {stage}"] = attribute(
                                switch, h, passes[stage], sorted(called), budget_s / 2
                            )
                    finally:
                        gc.enable()
                    if _queued(h, stage) != n:  # the pass must not have moved anything
                        raise RuntimeError(f"{side} {stage}: queue moved during the benchmark")
                results.append({"side": side, "stage": stage, "pass": label, "n": n, "called": called, **r})
                log(f"    {stage:9s} n={n:>6}: on {r['on_us']:9.1f} µs  off {r['off_us']:9.1f} µs  "
                    f"ratio {r['ratio']:.3f} (mean {r['mean_ratio']:.3f}, {r['pairs']} pairs)  "
                    f"deadline scan {r['scan_ms'] or 0:.2f} ms")
        h.close()
        del h, passes
        gc.collect()
    return results, attributions


# ----------------------------------------------------------------------------- peer monitor


class Listeners:
    """n TCP listeners on loopback that accept and close every connection (peers
    that are alive), served by one thread."""

    def __init__(self, n: int) -> None:
        self.sel = selectors.DefaultSelector()
        self.socks = []
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(128)
            s.setblocking(False)
            self.sel.register(s, selectors.EVENT_READ)
            self.socks.append(s)
        self.ports = [s.getsockname()[1] for s in self.socks]
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop:
            for key, _ in self.sel.select(0.2):
                try:
                    conn, _ = key.fileobj.accept()
                    conn.close()
                except BlockingIOError:
                    pass

    def close(self) -> None:
        self._stop = True
        self.thread.join(2)
        for s in self.socks:
            s.close()


def peer_monitor_cost(peers: Sequence[int], repeats: int, log) -> List[Dict[str, float]]:
    from sglang.srt.disaggregation.fork_peers.decode_side_monitor import DecodeSideMonitor
    from sglang.srt.disaggregation.fork_peers.prefill_side_monitor import PrefillSideMonitor

    out = []
    for n in peers:
        lis = Listeners(n)
        try:
            prefill_mgr = SimpleNamespace(
                session_lock=threading.Lock(), failed_sessions=set(), _socket_cache={},
                _deferred_ack_poisoned_rooms=set(), transfer_infos={}, request_status={},
                decode_kv_args_table={
                    f"session-{i}": SimpleNamespace(endpoint="127.0.0.1", dst_port=port)
                    for i, port in enumerate(lis.ports)
                },
            )
            decode_mgr = SimpleNamespace(
                connection_lock=threading.Lock(), session_pool_lock=threading.Lock(), session_pool={},
                prefill_info_table={f"127.0.0.1:{port}": None for port in lis.ports},
                _handle_node_failure=lambda addr: None,
            )
            sides = (("prefill", PrefillSideMonitor, prefill_mgr), ("decode", DecodeSideMonitor, decode_mgr))
            for role, side, mgr in sides:
                monitor = side(mgr, {}, metrics=False)  # not started: ticked here
                monitor.tick()  # first pass registers the sessions
                cpu, wall = [], []
                for _ in range(repeats):
                    w0, c0 = time.perf_counter(), time.thread_time()
                    monitor.tick()
                    cpu.append(time.thread_time() - c0)
                    wall.append(time.perf_counter() - w0)
                lost = monitor.gauges()["lost"]
                if lost:
                    raise RuntimeError(f"peer monitor ({role}) lost {lost} live peers")
                row = {
                    "role": role, "peers": n, "interval_s": monitor.interval,
                    "cpu_us_per_probe": 1e6 * statistics.median(cpu) / n,
                    "wall_us_per_probe": 1e6 * statistics.median(wall) / n,
                    "cpu_us_per_tick": 1e6 * statistics.median(cpu),
                }
                out.append(row)
                log(f"  peer monitor {role:7s} {n:3d} peers: {row['cpu_us_per_probe']:.1f} µs CPU / "
                    f"{row['wall_us_per_probe']:.1f} µs wall per probe")
        finally:
            lis.close()
    return out


# ----------------------------------------------------------------------------- output


def markdown(results: List[Dict], attributions: Dict, monitor: List[Dict], counts: Sequence[int], elapsed: float) -> str:
    top = counts[-1]
    lines = [
        f"Hooks applied vs not, same process, interleaved; one scheduler pass over real PD queues with "
        f"{', '.join(f'{c:,}' for c in counts)} requests parked at the stage; thread CPU time, median of "
        f"per-pair on/off ratios; the A/A control times on/on the same way (the method's own noise). The transfer deadline's full scan of a queue runs at most once a second "
        f"(other passes: one lookup); its cost is the last column. "
        f"Machine load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {elapsed:.0f}s.",
        "",
        "| stage: pass | " + " | ".join(f"µs on/off at {c:,}" for c in counts)
        + f" | growth ({counts[-2]:,}→{top:,}, 1 = linear) | ratio at {top:,} (A/A control) | goal ≤ {GOAL} | fork hooks run in the pass "
        f"| deadline scan ms at " + "/".join(f"{c:,}" for c in counts) + " (≤ 1/s) |",
        "|---|" + "---:|" * len(counts) + "---:|---:|---|---|---:|",
    ]
    by = {(r["side"], r["stage"], r["n"]): r for r in results}
    for side, stage, label in STAGES:
        rows = [by[(side, stage, c)] for c in counts]
        exp_on = growth_exponent(counts, [r["on_us"] for r in rows])
        exp_off = growth_exponent(counts, [r["off_us"] for r in rows])
        last = rows[-1]
        ok = last["ratio"] <= GOAL
        hooks = ", ".join(
            f"{t.rsplit('.', 1)[-1]}×{c}" for t, c in sorted(last["called"].items())
        ) or "none"
        lines.append(
            f"| {side} {stage}: `{label}` | "
            + " | ".join(f"{r['on_us']:.0f}/{r['off_us']:.0f}" for r in rows)
            + f" | {exp_on:.2f} (upstream {exp_off:.2f}) | {last['ratio']:.3f} ({last.get('aa_ratio', float('nan')):.3f}) | "
            f"{'ok' if ok else 'OVER'} | {hooks} | "
            + "/".join("-" if r["scan_ms"] is None else f"{r['scan_ms']:.2f}" for r in rows) + " |"
        )
    for stage, per in attributions.items():
        worst = max(per.items(), key=lambda kv: kv[1]) if per else None
        if worst is None:
            continue
        lines.append("")
        detail = ", ".join(f"`{t.rsplit('.', 2)[-2]}.{t.rsplit('.', 1)[-1]}` {v:.3f}" for t, v in sorted(per.items()))
        aa = next((r.get("aa_ratio") for r in results if f"{r['side']} {r['stage']}" == stage and r["n"] == top), None)
        aa_text = f"; A/A control {aa:.3f}" if aa is not None else ""
        if worst[1] > GOAL:
            lines.append(f"Over the goal: {stage}: the hook on `{worst[0]}` costs it (pass with it / without "
                         f"it, all others on: {detail}{aa_text}).")
        else:
            lines.append(f"Over the goal: {stage}, but no hook accounts for it: with each hook / without it, all "
                         f"others on, {detail}{aa_text}, all within the goal: the pairs' noise on a loaded machine.")
    lines += [
        "",
        "| peer monitor (one heartbeat pass) | " + " | ".join(f"{p} peers" for p in PEERS) + " |",
        "|---|" + "---:|" * len(PEERS) + "",
    ]
    for role in ("prefill", "decode"):
        rows = [m for m in monitor if m["role"] == role]
        lines.append(
            f"| {role}: µs CPU (wall) per probe | "
            + " | ".join(f"{m['cpu_us_per_probe']:.0f} ({m['wall_us_per_probe']:.0f})" for m in rows) + " |"
        )
    interval = monitor[0]["interval_s"] if monitor else 0
    worst = max(monitor, key=lambda m: m["cpu_us_per_tick"]) if monitor else None
    if worst:
        lines.append("")
        lines.append(
            f"One pass every {interval:g} s (heartbeat interval), in its own thread: at {worst['peers']} peers "
            f"{worst['cpu_us_per_tick'] / 1e3:.1f} ms CPU per pass, {100 * worst['cpu_us_per_tick'] / 1e6 / interval:.3f}% "
            f"of one core."
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default=",".join(map(str, COUNTS)))
    parser.add_argument("--budget-s", type=float, default=1.0, help="seconds of interleaved passes per stage and count")
    parser.add_argument("--probe-repeats", type=int, default=15)
    parser.add_argument("--markdown-only", action="store_true", help="print only the markdown block on stdout")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.markdown_only else (lambda m: print(m, flush=True))
    t0 = time.monotonic()
    log("hook cost: scheduler passes over the real PD queues")
    results, attributions = run_passes(counts, args.budget_s, log)
    log("hook cost: peer monitor")
    monitor = peer_monitor_cost(PEERS, args.probe_repeats, log)
    block = markdown(results, attributions, monitor, counts, time.monotonic() - t0)
    print(block if args.markdown_only else "\n" + block)
    over = [r for r in results if r["n"] == counts[-1] and r["ratio"] > GOAL]
    return 0 if not over else 1


if __name__ == "__main__":
    sys.exit(main())
