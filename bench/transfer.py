"""`make bench-transfer`: how fast the KV of a long prompt moves from prefill to decode over mooncake's TCP
transport between two hosts, fork vs stock upstream 0.5.23 in the same run, against the raw TCP throughput of the
same link.

Hosts: prefill, decode and the mini load balancer each in a network namespace of its own on one switch
(testing/hosts.py); the fork's and upstream's deployments run side by side on the same three hosts (bench/baseline.py
starts the stock one). Model: the wide-KV tiny model (testing/tiny_model.py, 32 KiB of KV a token, cheap to
compute). Prompts: random token ids (no prefix-cache hit), 400-4,000 tokens, one request at a time, one output
token, the sides alternating per request, the same prompts on both. Prefill runs the prompt as one chunk
(--chunked-prefill-size above the longest prompt): the whole KV leaves in one transfer once the forward is done, so
the transfer is timed on its own.

Per request, from upstream's own timing (the prefill server's Prometheus histograms, a delta over the request):
- `sglang:kv_transfer_total_mb`: the KV bytes moved;
- `sglang:per_stage_req_latency_seconds{stage="prefill_forward"}`: the prefill compute;
- `{stage="prefill_transfer_kv_cache"}`: from the forward's end to prefill seeing the transfer done (the send
  queue, mooncake's write, the poll that notices it): what the transfer adds to the time to first token;
- the client's time to first token (the whole request; one output token).
KV bytes/s = bytes / transfer time. The limit: a Python socket sender in the prefill namespace and a receiver in the
decode namespace moving the same number of bytes as the largest KV (4 MiB sends and receives), a few times.

Idle pacing: the fork's schedulers pace their idle passes themselves (SGLANG_FORK_PD_IDLE_PACE, 1 ms); upstream's
only with `--paced` (the release gate's probe plugin); side `fork-unpaced` is the fork with the knob at 0. The table
says who paces each side. The fork's KV write waits with sleeps (SGLANG_FORK_KV_WRITE_POLL); side `fork-syncwrite` is
the fork with mooncake's synchronous write (the knob at 0), as upstream writes.

`--rate MBIT`: also everything again with the switch port towards decode shaped to that rate (tbf), the raw TCP
limit measured through the same shaping.

Usage: make bench-transfer [ARGS="--lengths 400,1000,2000,4000 --repeats 2 --rate 400 --sides fork upstream
--write-readme --keep-logs"]. Needs root (network namespaces). bench/README.md ("Transfer speed") reads the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from bench import baseline, cpu_window
from bench.readme_block import write_block
from bench.work_dir import work_dir
from testing import hosts as hosts_mod
from testing.pd_cluster import PDCluster, fork_python, http_post_json, start_all
from testing.tiny_model import VOCAB_SIZE, WIDE_KV_BYTES_PER_TOKEN, ensure_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]
# fork-unpaced: the fork with SGLANG_FORK_PD_IDLE_PACE=0; fork-syncwrite: with SGLANG_FORK_KV_WRITE_POLL=0
SIDES = ("fork", "upstream", "fork-unpaced", "fork-syncwrite")
LENGTHS = (400, 1000, 2000, 4000)
CHUNK = 8192  # > the longest prompt: one prefill chunk, one transfer
SERVER_ARGS = ("--max-total-tokens", "16384", "--max-running-requests", "4", "--chunked-prefill-size", str(CHUNK),
               "--context-length", "4096")
STAGE = 'sglang:per_stage_req_latency_seconds_sum'
TCP_BLOCK = 4 << 20
README_BEGIN = "<!-- transfer-bench:begin (written by `make bench-transfer ARGS=--write-readme`) -->"
README_END = "<!-- transfer-bench:end -->"


# ----------------------------------------------------------------------------- raw TCP, the limit


def tcp_sink(port: int, nbytes: int) -> None:
    """Accept one connection on `port`, read `nbytes`, print the seconds from the first byte to the last."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    buf = memoryview(bytearray(TCP_BLOCK))
    got, t0 = 0, None
    while got < nbytes:
        n = conn.recv_into(buf)
        if n == 0:
            raise RuntimeError(f"sender closed after {got} of {nbytes} bytes")
        if t0 is None:
            t0 = time.perf_counter()
        got += n
    took = time.perf_counter() - t0
    conn.sendall(b"k")
    print(json.dumps({"bytes": got, "seconds": took}), flush=True)


def tcp_source(address: str, port: int, nbytes: int) -> None:
    """Connect to `address:port`, send `nbytes` in 4 MiB writes, wait for the sink's ack."""
    conn = socket.create_connection((address, port), timeout=60)
    block = memoryview(bytes(TCP_BLOCK))
    sent = 0
    while sent < nbytes:
        n = min(TCP_BLOCK, nbytes - sent)
        conn.sendall(block[:n])
        sent += n
    conn.recv(1)


def raw_tcp(hosts: hosts_mod.TestHosts, src: str, dst: str, nbytes: int, repeats: int = 3) -> List[float]:
    """Bytes/s of one TCP stream from host `src` to host `dst` (`repeats` runs), as the sink measured it."""
    rates = []
    port = 23456
    for _ in range(repeats):
        sink = subprocess.Popen(hosts[dst].exec_argv([fork_python(), "-m", "bench.transfer", "--tcp-sink", str(port),
                                                      str(nbytes)]), stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
        try:
            if sink.stdout.readline().strip() != "ready":
                raise RuntimeError("tcp sink did not start")
            subprocess.run(hosts[src].exec_argv([fork_python(), "-m", "bench.transfer", "--tcp-source",
                                                 hosts[dst].address, str(port), str(nbytes)]),
                           check=True, timeout=300, cwd=REPO_ROOT)
            out = json.loads(sink.stdout.readline())
        finally:
            sink.wait(timeout=60)
        rates.append(out["bytes"] / out["seconds"])
    return rates


# ----------------------------------------------------------------------------- mooncake alone on the same link


def _mc_engine(hostname: str):
    """A mooncake TransferEngine on TCP in P2P-handshake mode, as sglang initialises it."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake initialize failed")
    return engine


def _mc_buffer(engine, nbytes: int):
    import ctypes

    buf = (ctypes.c_char * nbytes)()
    ctypes.memset(buf, 1, nbytes)  # fault every page in
    if engine.register_memory(ctypes.addressof(buf), nbytes) != 0:
        raise RuntimeError("mooncake register_memory failed")
    return buf, ctypes.addressof(buf)


def mc_sink(hostname: str, nbytes: int) -> None:
    """Register `nbytes` with a mooncake engine, print its session and address, serve until stdin closes."""
    engine = _mc_engine(hostname)
    buf, ptr = _mc_buffer(engine, nbytes)
    print(json.dumps({"session": f"{hostname}:{engine.get_rpc_port()}", "addr": ptr}), flush=True)
    sys.stdin.read()
    del buf


def mc_source(hostname: str, session: str, peer_addr: int, nbytes: int, blocks: int, repeats: int,
              polls: Sequence[float] = (0.0,)) -> None:
    """Write `nbytes` into the peer's buffer as `blocks` contiguous blocks in one write (what sglang's mooncake sender
    does with one chunk's KV: a block per layer and K/V), `repeats` rounds in which each wait of `polls` takes its
    turn; print each wait's bytes/s per round. A poll of 0: mooncake's synchronous `batch_transfer_sync_write`
    (upstream's sender); > 0: the fork's paced write (fork_transfer.paced_write: a transfer per block, status checks
    `poll` seconds apart)."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.fork_transfer.paced_write import PacedWrite, mooncake_timeout_s

    engine = _mc_engine(hostname)
    buf, ptr = _mc_buffer(engine, nbytes)  # held: the engine reads it
    writes = {poll: PacedWrite(SimpleNamespace(engine=engine), engine.batch_transfer_sync_write, poll,
                               mooncake_timeout_s()) if poll > 0 else engine.batch_transfer_sync_write
              for poll in polls}
    size = nbytes // blocks
    rates: Dict[float, List[float]] = {poll: [] for poll in polls}
    cores: Dict[float, List[float]] = {poll: [] for poll in polls}  # the source process's CPU-s per second of write
    for round_ in range(repeats + 1):  # the first round opens the connection
        for poll, write in writes.items():
            t0, c0 = time.perf_counter(), time.process_time()
            ret = write(session, [ptr + i * size for i in range(blocks)],
                        [peer_addr + i * size for i in range(blocks)], [size] * blocks)
            took, cpu = time.perf_counter() - t0, time.process_time() - c0
            if ret < 0:
                raise RuntimeError(f"mooncake write (poll {poll}) -> {ret}")
            if round_:
                rates[poll].append(size * blocks / took)
                cores[poll].append(cpu / took)
    del buf
    print(json.dumps({"rates": {str(p): r for p, r in rates.items()}, "cores": {str(p): c for p, c in cores.items()}}),
          flush=True)


def raw_mooncake(hosts: hosts_mod.TestHosts, src: str, dst: str, nbytes: int, blocks: int = 8,
                 repeats: int = 3, polls: Sequence[float] = (0.0,),
                 cores: Optional[Dict[float, List[float]]] = None) -> Dict[float, List[float]]:
    """Bytes/s of mooncake's TCP transport alone (no sglang) from host `src` to host `dst`, per wait of `polls` (0:
    mooncake's synchronous write, > 0: the fork's paced write with that poll): one write of `nbytes` in `blocks`
    blocks, `repeats` rounds after a first one, the waits taking turns within a round. `cores`, if given, gets the
    writing process's CPU-s per second of each write, per wait."""
    sink = subprocess.Popen(hosts[dst].exec_argv([fork_python(), "-m", "bench.transfer", "--mc-sink",
                                                  hosts[dst].address, str(nbytes)]),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        peer = json.loads(sink.stdout.readline())
        out = subprocess.run(hosts[src].exec_argv([fork_python(), "-m", "bench.transfer", "--mc-source",
                                                   hosts[src].address, peer["session"], str(peer["addr"]),
                                                   str(nbytes), str(blocks), str(repeats),
                                                   "--mc-polls", ",".join(map(str, polls))]),
                             timeout=300, cwd=REPO_ROOT, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"mooncake source failed: {out.stderr[-2000:]}")
    finally:
        sink.stdin.close()
        sink.wait(timeout=60)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if cores is not None:
        cores.update({float(poll): c for poll, c in got["cores"].items()})
    return {float(poll): r for poll, r in got["rates"].items()}


# ----------------------------------------------------------------------------- one request


def _stage_sums(metrics: Mapping[str, float]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for key, value in metrics.items():
        if key.startswith(STAGE + "{"):
            stage = key.split('stage="', 1)[1].split('"', 1)[0]
            out[stage] = out.get(stage, 0.0) + value
    for name in ("sglang:kv_transfer_total_mb_sum", "sglang:kv_transfer_latency_ms_sum",
                 "sglang:kv_transfer_total_mb_count"):
        out[name] = sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))
    return out


def _delta(before: Mapping[str, float], after: Mapping[str, float]) -> Dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def one_request(cluster: PDCluster, ids: Sequence[int], names: Mapping[int, str]) -> Dict[str, float]:
    """One prompt of token ids, one output token; its figures from the servers' histograms and the client, and
    what ran on the machine meanwhile (bench/cpu_window.py; `names`: its labels of the deployments' processes)."""
    before = {r: _stage_sums(cluster[r].metrics()) for r in ("prefill", "decode")}
    snap = cpu_window.snapshot()
    t0 = time.monotonic()
    status, body = http_post_json(cluster.url + "/generate", {
        "input_ids": list(ids), "sampling_params": {"temperature": 0.0, "max_new_tokens": 1}}, timeout=300)
    ttft = time.monotonic() - t0
    win = cpu_window.window(snap, cpu_window.snapshot(), names, ttft)
    if status != 200 or not isinstance(body, dict):
        raise RuntimeError(f"request failed: {status} {str(body)[:300]}")
    # the histograms are exported by each scheduler's metrics loop: poll until the transfer shows
    deadline = time.monotonic() + 30
    while True:
        p = _delta(before["prefill"], _stage_sums(cluster["prefill"].metrics()))
        d = _delta(before["decode"], _stage_sums(cluster["decode"].metrics()))
        if p.get("sglang:kv_transfer_total_mb_count", 0) >= 1 and p.get("prefill_transfer_kv_cache", 0) > 0:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"no transfer in prefill's metrics: {p}")
        time.sleep(0.2)
    kv = p["sglang:kv_transfer_total_mb_sum"] * 2**20
    transfer = p["prefill_transfer_kv_cache"]
    return {
        "tokens": body["meta_info"]["prompt_tokens"],
        "kv_bytes": kv,
        "ttft": ttft,
        "compute": p.get("prefill_forward", 0.0),
        "transfer": transfer,
        "kv_rate": kv / transfer,
        "decode_transferred": d.get("decode_transferred", 0.0),
        "cpu": win,
    }


# ----------------------------------------------------------------------------- the run


def _median(rows: List[Dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def table(results: Dict[str, Dict[tuple, List[Dict[str, float]]]], limits: Dict[str, float],
          mooncake: Dict[str, float], mooncake_paced: Dict[str, float], links: Sequence[str],
          pacing: Mapping[str, str], write_poll: float) -> str:
    """Markdown: per link and prompt length, each side's median figures; KV bytes/s against the raw TCP limit and
    against mooncake's TCP transport alone (synchronous write) on the same link; `pacing`: who paces each side's
    idle passes; the footnote also gives mooncake alone with the fork's paced write (`write_poll`)."""
    lines = ["| link | prompt tokens | KV moved | side | idle passes paced by | TTFT (s) | prefill compute (s) | "
             "transfer (s) | KV MB/s | of raw TCP | of mooncake alone | fork/upstream KV rate |",
             "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for link in links:
        lengths = sorted({n for side in results for (l, n) in results[side] if l == link})
        for n in lengths:
            rows = {side: results[side][(link, n)] for side in results if (link, n) in results[side]}
            rates = {side: _median(r, "kv_rate") for side, r in rows.items()}
            for side, r in rows.items():
                ratio = (f"{rates['fork'] / rates['upstream']:.2f}" if side == "fork" and "upstream" in rates
                         else "")
                lines.append(
                    f"| {link} | {n} | {_median(r, 'kv_bytes') / 2**20:.0f} MiB | {side} | {pacing[side]} | "
                    f"{_median(r, 'ttft'):.2f} | "
                    f"{_median(r, 'compute'):.2f} | {_median(r, 'transfer'):.3f} | {rates[side] / 1e6:.0f} | "
                    f"{rates[side] / limits[link]:.0%} | {rates[side] / mooncake[link]:.0%} | {ratio} |")
    lines.append("")
    lines.append("Raw TCP on the same link (one Python socket stream, prefill host to decode host, 4 MiB writes), and "
                 "mooncake's TCP transport alone (one write of 8 blocks, as sglang sends one chunk's KV; mooncake's "
                 f"synchronous batch write, then the fork's paced write, polling every {write_poll * 1e3:g} ms): "
                 + "; ".join(f"{link} {limits[link] / 1e6:.0f} MB/s, {mooncake[link] / 1e6:.0f} MB/s and "
                             f"{mooncake_paced[link] / 1e6:.0f} MB/s" for link in links) + " (medians).")
    return "\n".join(lines)


def limits_only(nbytes: int, polls: Sequence[float], repeats: int, blocks: int) -> int:
    """`--limits-only`: raw TCP and mooncake alone per wait on one link between two fresh test hosts, printed."""
    with hosts_mod.TestHosts(("prefill", "decode")) as hosts:
        tcp = raw_tcp(hosts, "prefill", "decode", nbytes)
        cores: Dict[float, List[float]] = {}
        mc = raw_mooncake(hosts, "prefill", "decode", nbytes, blocks=blocks, repeats=repeats, polls=polls,
                          cores=cores)
    limit = statistics.median(tcp)
    print(f"{nbytes / 2**20:.0f} MiB in {blocks} blocks; raw TCP {[round(r / 1e6) for r in tcp]} MB/s (median "
          f"{limit / 1e6:.0f})")
    for poll, rates in mc.items():
        wait = f"paced, poll {poll * 1e3:g} ms" if poll > 0 else "synchronous write"
        print(f"mooncake alone, {wait}: median {statistics.median(rates) / 1e6:.0f} MB/s "
              f"({statistics.median(rates) / limit:.0%} of raw TCP), rounds {[round(r / 1e6) for r in rates]}; "
              f"writing process {statistics.median(cores[poll]):.2f} cores (median)")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths in tokens")
    parser.add_argument("--repeats", type=int, default=2, help="requests per length and side (default 2)")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES[:2]),
                        help="fork (paces its own idle passes), upstream, fork-unpaced (the fork with "
                             "SGLANG_FORK_PD_IDLE_PACE=0), fork-syncwrite (the fork with mooncake's synchronous "
                             "write: SGLANG_FORK_KV_WRITE_POLL=0); default fork upstream")
    parser.add_argument("--rate", type=int, default=0, help="also on a link shaped to RATE Mbit/s (tbf)")
    parser.add_argument("--paced", action="store_true",
                        help="upstream loads the release gate's probe plugin: a scheduler waiting on a transfer "
                             "sleeps 1 ms per idle pass instead of spinning (bench/baseline.py), as the fork's own "
                             "idle pacing does")
    parser.add_argument("--model-dir", default=str(REPO_ROOT / ".cache" / "tiny-llama-wide-kv"))
    parser.add_argument("--write-readme", action="store_true", help="write the table into README.md")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--tcp-sink", nargs=2, type=int, metavar=("PORT", "BYTES"), help=argparse.SUPPRESS)
    parser.add_argument("--tcp-source", nargs=3, metavar=("ADDR", "PORT", "BYTES"), help=argparse.SUPPRESS)
    parser.add_argument("--mc-sink", nargs=2, metavar=("HOST", "BYTES"), help=argparse.SUPPRESS)
    parser.add_argument("--mc-source", nargs=6, metavar=("HOST", "SESSION", "ADDR", "BYTES", "BLOCKS", "REPEATS"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--mc-polls", default="0", help=argparse.SUPPRESS)
    parser.add_argument("--limits-only", metavar="POLLS",
                        help="no servers: only the link's limits, mooncake alone once per wait of POLLS (seconds, "
                             "comma-separated; 0 its synchronous write), as many bytes as the longest prompt's KV, "
                             "--repeats rounds (to tune SGLANG_FORK_KV_WRITE_POLL)")
    parser.add_argument("--blocks", type=int, default=8, help="mooncake alone: blocks per write (default 8)")
    args = parser.parse_args(argv)
    if args.mc_sink:
        mc_sink(args.mc_sink[0], int(args.mc_sink[1]))
        return 0
    if args.mc_source:
        host, session, *nums = args.mc_source
        mc_source(host, session, *(int(x) for x in nums), polls=[float(x) for x in args.mc_polls.split(",")])
        return 0
    if args.tcp_sink:
        tcp_sink(*args.tcp_sink)
        return 0
    if args.tcp_source:
        tcp_source(args.tcp_source[0], int(args.tcp_source[1]), int(args.tcp_source[2]))
        return 0
    why = hosts_mod.unavailable()
    if why:
        print(f"bench-transfer: {why}", file=sys.stderr)
        return 2
    lengths = [int(x) for x in args.lengths.split(",")]
    t_start = time.monotonic()
    if args.limits_only:
        return limits_only(max(lengths) * WIDE_KV_BYTES_PER_TOKEN, [float(x) for x in args.limits_only.split(",")],
                           args.repeats, args.blocks)
    with work_dir("sglang-bench-transfer-", args.keep_logs) as work:
        model = str(ensure_tiny_model(args.model_dir, wide_kv=True))
        prepared = baseline.prepare(work, fork_python())
        # the fork paces its own idle passes (SGLANG_FORK_PD_IDLE_PACE, default 1 ms); upstream only with --paced
        envs = {"fork": baseline.fork_env(prepared, standins=True, probe=False),
                "fork-unpaced": {**baseline.fork_env(prepared, standins=True, probe=False),
                                 "SGLANG_FORK_PD_IDLE_PACE": "0"},
                "fork-syncwrite": {**baseline.fork_env(prepared, standins=True, probe=False),
                                   "SGLANG_FORK_KV_WRITE_POLL": "0"},
                "upstream": baseline.upstream_env(prepared, probe=args.paced)}
        pace_ms = float(os.environ.get("SGLANG_FORK_PD_IDLE_PACE", "0.001")) * 1e3
        write_poll = float(os.environ.get("SGLANG_FORK_KV_WRITE_POLL", "0.0005")) or 0.0005  # mooncake alone, paced
        pacing = {"fork": f"the fork itself ({pace_ms:g} ms)" if pace_ms else "nobody (pace 0)",
                  "fork-unpaced": "nobody (pace 0)",
                  "fork-syncwrite": f"the fork itself ({pace_ms:g} ms), synchronous write" if pace_ms
                  else "nobody (pace 0), synchronous write",
                  "upstream": f"bench probe ({baseline.PACE_SECONDS * 1e3:g} ms)" if args.paced else "nobody"}
        lb_env = baseline.fork_env(prepared, standins=False, probe=False)
        with hosts_mod.TestHosts(("prefill", "decode", "lb")) as hosts:
            print(f"hosts on {hosts.subnet}: " + ", ".join(f"{r} {h.address}" for r, h in hosts.hosts.items()),
                  flush=True)
            links = ["veth"] + ([f"tbf {args.rate} Mbit/s"] if args.rate else [])
            nbytes = max(lengths) * WIDE_KV_BYTES_PER_TOKEN
            limits: Dict[str, float] = {}
            rates = raw_tcp(hosts, "prefill", "decode", nbytes)
            limits["veth"] = statistics.median(rates)
            mc = raw_mooncake(hosts, "prefill", "decode", nbytes, polls=(0.0, write_poll))
            mooncake: Dict[str, float] = {"veth": statistics.median(mc[0.0])}
            mooncake_paced: Dict[str, float] = {"veth": statistics.median(mc[write_poll])}
            print(f"raw TCP prefill -> decode: {[round(r / 1e6) for r in rates]} MB/s; mooncake alone "
                  f"{[round(r / 1e6) for r in mc[0.0]]} MB/s, paced {[round(r / 1e6) for r in mc[write_poll]]} MB/s",
                  flush=True)
            clusters = {
                name: PDCluster(model, hosts=hosts.hosts, prefill_env=envs[name], decode_env=envs[name],
                                lb_env=lb_env, prefill_args=(*baseline.SHARED_ARGS, *SERVER_ARGS),
                                decode_args=(*baseline.SHARED_ARGS, *baseline.DECODE_ARGS, *SERVER_ARGS),
                                log_dir=str(work / f"logs-{name}"))
                for name in args.sides
            }
            results: Dict[str, Dict[tuple, List[Dict[str, float]]]] = {name: {} for name in clusters}
            try:
                start_all(*clusters.values())
                print(f"servers up ({time.monotonic() - t_start:.0f}s)", flush=True)
                rng = random.Random(0)
                names = cpu_window.labels(clusters)
                for name, cluster in clusters.items():  # warm-up: first-request costs out of the figures
                    one_request(cluster, [rng.randrange(3, VOCAB_SIZE) for _ in range(min(lengths))], names)
                for link in links:
                    if link != "veth":
                        hosts.shape("decode", args.rate * 1_000_000, src="prefill")
                        rates = raw_tcp(hosts, "prefill", "decode", nbytes, repeats=1)
                        limits[link] = statistics.median(rates)
                        mc = raw_mooncake(hosts, "prefill", "decode", nbytes, repeats=1, polls=(0.0, write_poll))
                        mooncake[link] = statistics.median(mc[0.0])
                        mooncake_paced[link] = statistics.median(mc[write_poll])
                        print(f"raw TCP on {link}: {[round(r / 1e6) for r in rates]} MB/s; mooncake alone "
                              f"{[round(r / 1e6) for r in mc[0.0]]} MB/s, paced "
                              f"{[round(r / 1e6) for r in mc[write_poll]]} MB/s", flush=True)
                    try:
                        for n in lengths:
                            for repeat in range(args.repeats):
                                ids = [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]
                                order = list(clusters.items())
                                if repeat % 2:
                                    order.reverse()
                                for name, cluster in order:
                                    row = one_request(cluster, ids, names)
                                    results[name].setdefault((link, n), []).append(row)
                                    win = row.pop("cpu")
                                    print(f"{link} {name} {n} tokens: " + ", ".join(
                                        f"{k} {v:.3f}" for k, v in row.items()) + f"; CPU run/wait s: {win.top(8)}",
                                          flush=True)
                    finally:
                        hosts.unshape("decode")
            finally:
                for c in clusters.values():
                    c.teardown()
        text = table(results, limits, mooncake, mooncake_paced, links, pacing, write_poll)
        print()
        print(text)
        print(f"\nwall time {time.monotonic() - t_start:.0f}s")
        if args.write_readme:
            write_block(REPO_ROOT / "README.md", README_BEGIN, README_END, text)
        return 0


if __name__ == "__main__":
    sys.exit(main())
