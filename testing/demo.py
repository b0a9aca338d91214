"""`make demo`: 1 prefill + 1 decode + mini load balancer on the tiny model, 20
concurrent greedy requests through the balancer, per-request status and latency, a
summary line, everything shut down (also on Ctrl-C or failure). Exit 1 if any
request failed.

Usage: python -m testing.demo [--requests N] [--max-new-tokens N] [--balancer mini|router]
       [--tp N] [--decode-tp N] [--model-dir DIR] [--hosts]
(`--tp 2`: both servers with tensor parallelism 2, one scheduler rank per core; `--decode-tp 1` beside it:
prefill TP 2, decode TP 1.)
`--hosts` (root): prefill, decode and the balancer each on a test host of its own (a network namespace with its
own address on one switch, testing/hosts.py), as on three machines; then the prefill-decode link is cut
silently for a while (no reset, nothing refused) and healed, and the demo shows each side declaring the other
lost, the requests sent meanwhile ending, and the pair serving again without a restart.
Servers run under $SGLANG_FORK_PYTHON (default: this interpreter).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from testing.pd_cluster import PDCluster, generate, generate_concurrently, metric_sum, prompts, wait_until
from testing.tiny_model import ensure_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--balancer", choices=("mini", "router"), default="mini",
                        help="mini LB, or the Rust gateway with self-registered engines")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size of both servers")
    parser.add_argument("--decode-tp", type=int, default=None, help="decode's tensor parallel size (default: --tp)")
    parser.add_argument("--model-dir", default=str(REPO_ROOT / ".cache" / "tiny-llama"))
    parser.add_argument("--hosts", action="store_true", help="each server on its own test host; then a partition")
    args = parser.parse_args(argv)
    if not args.hosts:
        return _run(args, None)
    from testing import hosts as hosts_mod

    why = hosts_mod.unavailable()
    if why:
        print(f"--hosts: {why}", file=sys.stderr)
        return 2
    with hosts_mod.TestHosts(("prefill", "decode", "lb")) as hosts:
        print(f"switch {hosts.subnet}: " + ", ".join(f"{r} {h.address} (netns {h.netns})" for r, h in hosts.hosts.items())
              + f"; this process {hosts.client.address}", flush=True)
        return _run(args, hosts)


# --hosts: a short heartbeat and deadline, so that the partition story takes seconds
PARTITION_ENV = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2", "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": "15"}
LOSSES = "sglang:pd_peer_losses_total"


def _run(args, hosts) -> int:
    """Start the deployment (on `hosts` if given), tell its story, stop everything (also on Ctrl-C or failure)."""
    t0 = time.monotonic()
    model = ensure_tiny_model(args.model_dir)
    print(f"model: {model} ({time.monotonic() - t0:.1f}s)", flush=True)
    env = PARTITION_ENV if hosts else None
    cluster = PDCluster(str(model), balancer=args.balancer, tp=args.tp, decode_tp=args.decode_tp,
                        hosts=hosts.hosts if hosts else None, prefill_env=env, decode_env=env)
    print(f"logs: {cluster.log_dir}", flush=True)
    try:
        t0 = time.monotonic()
        cluster.start()
        print(f"prefill {cluster['prefill'].url}, decode {cluster['decode'].url}: 1P1D + LB healthy in "
              f"{time.monotonic() - t0:.1f}s at {cluster.url}", flush=True)
        if hosts is None:
            return 1 if _round(cluster, args, verbose=True) else 0
        return _partition(cluster, hosts, args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        cluster.teardown()
        print("all servers stopped", flush=True)


def _round(cluster, args, verbose: bool = False, when: str = "") -> int:
    """`--requests` concurrent requests through the balancer; returns how many failed."""
    t0 = time.monotonic()
    results = generate_concurrently(cluster.url, prompts(args.requests), max_new_tokens=args.max_new_tokens)
    wall = time.monotonic() - t0
    for i, r in enumerate(results if verbose else ()):
        ok = r["status"] == 200
        detail = f"{len(r['output_ids'])} tokens" if ok else f"error: {str(r['error'])[:200]}"
        print(f"req {i:2d}  status {r['status']}  {r['latency']:6.2f}s  {detail}")
    failed = sum(r["status"] != 200 for r in results)
    latencies = sorted(r["latency"] for r in results)
    p50 = latencies[len(latencies) // 2]
    print(f"SUMMARY{when}: {len(results) - failed}/{len(results)} ok, {failed} failed, "
          f"wall {wall:.2f}s, p50 {p50:.2f}s, max {latencies[-1]:.2f}s", flush=True)
    return failed


def _partition(cluster, hosts, args) -> int:
    """Requests; a silent cut between prefill and decode (each declares the other lost; a request sent meanwhile
    ends); the heal (served again, no restart); requests again."""
    failed = _round(cluster, args, when=" before the partition")
    losses = {role: metric_sum(cluster[role].metrics(), LOSSES) for role in ("prefill", "decode")}
    t_cut = time.monotonic()
    hosts.cut("prefill", "decode")
    print("cut: the switch stops forwarding between prefill and decode (no reset, nothing refused; both still "
          "reach the balancer)", flush=True)
    for role in ("prefill", "decode"):
        wait_until(lambda: metric_sum(cluster[role].metrics(), LOSSES) > losses[role], 30,
                   f"{role} to declare its peer lost", interval=0.1)
        print(f"  {role} declared its peer lost {time.monotonic() - t_cut:.1f}s after the cut", flush=True)
    r = generate(cluster.url, "sent during the partition", 8, timeout=60)
    print(f"  a request sent during the partition: {r['status']} after {r['latency']:.1f}s: {str(r['error'])[:200]}",
          flush=True)
    t_heal = time.monotonic()
    hosts.heal()
    wait_until(lambda: generate(cluster.url, "served again?", 4, timeout=60)["status"] == 200, 60,
               "a request served after the heal", interval=0.1)
    print(f"healed: served again {time.monotonic() - t_heal:.1f}s later, without a restart", flush=True)
    return 1 if failed + _round(cluster, args, when=" after the heal") else 0


if __name__ == "__main__":
    sys.exit(main())
