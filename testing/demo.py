"""`make demo`: 1 prefill + 1 decode + mini load balancer on the tiny model, 20
concurrent greedy requests through the balancer, per-request status and latency, a
summary line, everything shut down (also on Ctrl-C or failure). Exit 1 if any
request failed.

Usage: python -m testing.demo [--requests N] [--max-new-tokens N] [--balancer mini|router]
       [--tp N] [--decode-tp N] [--model-dir DIR]
(`--tp 2`: both servers with tensor parallelism 2, one scheduler rank per core; `--decode-tp 1` beside it:
prefill TP 2, decode TP 1.)
Servers run under $SGLANG_FORK_PYTHON (default: this interpreter).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from testing.pd_cluster import PDCluster, generate_concurrently, prompts
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
    args = parser.parse_args(argv)

    t0 = time.monotonic()
    model = ensure_tiny_model(args.model_dir)
    print(f"model: {model} ({time.monotonic() - t0:.1f}s)", flush=True)

    cluster = PDCluster(str(model), balancer=args.balancer, tp=args.tp, decode_tp=args.decode_tp)
    print(f"logs: {cluster.log_dir}", flush=True)
    try:
        t0 = time.monotonic()
        cluster.start()
        print(
            f"1P1D + LB healthy in {time.monotonic() - t0:.1f}s at {cluster.url}",
            flush=True,
        )

        texts = prompts(args.requests)
        t0 = time.monotonic()
        results = generate_concurrently(cluster.url, texts, max_new_tokens=args.max_new_tokens)
        wall = time.monotonic() - t0

        for i, r in enumerate(results):
            ok = r["status"] == 200
            detail = (
                f"{len(r['output_ids'])} tokens" if ok else f"error: {str(r['error'])[:200]}"
            )
            print(f"req {i:2d}  status {r['status']}  {r['latency']:6.2f}s  {detail}")
        failed = sum(r["status"] != 200 for r in results)
        latencies = sorted(r["latency"] for r in results)
        p50 = latencies[len(latencies) // 2]
        print(
            f"SUMMARY: {len(results) - failed}/{len(results)} ok, {failed} failed, "
            f"wall {wall:.2f}s, p50 {p50:.2f}s, max {latencies[-1]:.2f}s",
            flush=True,
        )
        return 1 if failed else 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        cluster.teardown()
        print("all servers stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
