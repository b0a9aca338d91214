"""Transfer deadline: what it costs and how late it fires (CPU, queue harness).

1. Per-pass cost of the prefill inflight-queue poll with 1k and 10k requests held in
   `Transferring`, fork vs upstream in the same process and run:
   - upstream: `process_disagg_prefill_inflight_queue` as upstream ships it (the
     function the plugin registry wrapped, kept as the wrapper's `__wrapped__`);
   - fork: the same method with the fork's BEFORE hook (transfer_deadline), deadline
     600 s, as it runs in production (a queue is scanned at most every
     min(deadline/50, 1 s));
   - fork, scan every pass: the worst case (the scan schedule forced each pass),
     reported for information.
   Passes alternate upstream/fork so that drift hits both; medians are compared.
   The ratio fork/upstream must stay <= 1.05.
2. Time-to-504 vs the configured deadline: requests stuck in Transferring, added at
   staggered times, on the real clock; time from `add` to the 504.

    python bench/transfer_deadline_bench.py [--sizes 1000 10000] [--passes 60]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang.srt.disaggregation.fork_transfer import transfer_deadline as td  # noqa: E402
from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin  # noqa: E402
from sglang.srt.managers.fork_core import fork_plugin  # noqa: E402
from testing.queue_harness import PrefillHarness  # noqa: E402

TARGET = (
    "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin."
    "process_disagg_prefill_inflight_queue"
)


def upstream_and_fork_polls():
    """(upstream's function, the fork's hooked one). The plugin registry wraps the
    method and keeps upstream's function as the wrapper's `__wrapped__`; checked by
    calling both: only the fork's touches the deadline's scan schedule."""
    assert fork_plugin.hooks_applied()[TARGET], "the fork's hook is not installed"
    hooked = SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue
    return hooked.__wrapped__, hooked


def fill_inflight(n: int, deadline: float) -> PrefillHarness:
    h = PrefillHarness(
        kv_tokens=4 * n + 64, req_slots=n + 8, metadata_slots=n + 8, max_context_len=16,
        server_args={"disaggregation_transfer_timeout": deadline},
    )
    for i in range(n):
        req = h.add(h.make_req(tokens=(i % 997 + 1, i // 997 + 1)))
        h.faults.hold_transfer(req.bootstrap_room)
    h.tick()
    assert len(h.inflight) == n, (len(h.inflight), n)
    return h


def per_pass(n: int, passes: int) -> dict:
    h = fill_inflight(n, deadline=600.0)
    s = h.scheduler
    UPSTREAM_POLL, hooked = upstream_and_fork_polls()
    times = {"upstream": [], "fork": [], "fork_scan_every_pass": []}
    with h.active():
        td.reset_scan_schedule()
        UPSTREAM_POLL(s)
        assert not td._next_scan, "upstream's poll ran the fork's hook"
        hooked(s)
        assert td._next_scan, "the fork's poll did not run its hook"
        for _ in range(3):  # warm-up
            UPSTREAM_POLL(s)
            s.process_disagg_prefill_inflight_queue()
        for _ in range(passes):
            t0 = time.perf_counter()
            UPSTREAM_POLL(s)
            t1 = time.perf_counter()
            s.process_disagg_prefill_inflight_queue()
            t2 = time.perf_counter()
            td.reset_scan_schedule()
            s.process_disagg_prefill_inflight_queue()
            t3 = time.perf_counter()
            times["upstream"].append(t1 - t0)
            times["fork"].append(t2 - t1)
            times["fork_scan_every_pass"].append(t3 - t2)
    assert len(h.inflight) == n and not h.outputs.items  # nothing expired, nothing done
    h.close()
    return {k: statistics.median(v) for k, v in times.items()}


def time_to_504(deadline: float, waves: int, per_wave: int) -> list:
    """The scheduler ticks back to back (as a busy prefill does); every
    deadline/waves seconds a wave of requests is added and held in Transferring."""
    h = PrefillHarness(
        kv_tokens=64 * waves * per_wave + 64, req_slots=waves * per_wave + 8,
        metadata_slots=waves * per_wave + 8, max_context_len=32,
        server_args={"disaggregation_transfer_timeout": deadline},
    )
    added, seen, read, ticks = {}, {}, 0, []
    td.reset_scan_schedule()  # the per-pass runs booked scans for a 600 s deadline
    start = time.monotonic()
    end = start + 3 * deadline + 5
    next_wave, wave = start, 0
    while time.monotonic() < end and (wave < waves or len(seen) < len(added)):
        if wave < waves and time.monotonic() >= next_wave:
            for _ in range(per_wave):
                req = h.add(h.make_req(prompt_len=4))
                h.faults.hold_transfer(req.bootstrap_room)
                added[req.rid] = time.monotonic()
            wave += 1
            next_wave += deadline / waves
        t_tick = time.monotonic()
        h.tick()
        now = time.monotonic()
        ticks.append(now - t_tick)
        for item in h.outputs.items[read:]:
            if item.finished:
                assert h.outputs.status_code(item.rid) == 504
                seen[item.rid] = now - added[item.rid]
        read = len(h.outputs.items)
    assert len(seen) == len(added), f"{len(added) - len(seen)} never expired"
    h.close()
    return sorted(seen.values()), ticks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--passes", type=int, default=60)
    ap.add_argument("--deadline", type=float, default=1.0, help="for time-to-504")
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # one warning per expired request otherwise

    ok = True
    print("inflight-queue poll, median per pass (all requests Transferring)")
    print(f"{'queued':>8} {'upstream ms':>12} {'fork ms':>10} {'ratio':>7} {'scan-every-pass ms':>19} {'ratio':>7}")
    for n in args.sizes:
        m = per_pass(n, args.passes)
        ratio = m["fork"] / m["upstream"]
        worst = m["fork_scan_every_pass"] / m["upstream"]
        ok &= ratio <= 1.05
        print(f"{n:>8} {m['upstream'] * 1e3:>12.3f} {m['fork'] * 1e3:>10.3f} {ratio:>7.3f} "
              f"{m['fork_scan_every_pass'] * 1e3:>19.3f} {worst:>7.3f}")

    d = args.deadline
    lat, ticks = time_to_504(d, waves=10, per_wave=20)
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]  # noqa: E731
    print(f"\ntime from add to 504, deadline {d:g}s, {len(lat)} requests in 10 waves:")
    print(f"  min {lat[0]:.3f}s  p50 {q(0.5):.3f}s  p99 {q(0.99):.3f}s  max {lat[-1]:.3f}s")
    print(f"  lateness over the deadline: p50 {q(0.5) - d:+.3f}s  max {lat[-1] - d:+.3f}s "
          f"(scan interval {min(d / td.SCAN_DIVISOR, td.MAX_SCAN_INTERVAL):.3f}s, "
          f"scheduler tick median {statistics.median(ticks) * 1e3:.1f}ms, max {max(ticks) * 1e3:.1f}ms)")
    early = [t for t in lat if t < d]
    ok &= not early
    print("OK" if ok else "FAIL: ratio above 1.05 or a request expired early")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
