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
KV bytes/s = bytes / transfer time. The limits, measured on the same link before the servers start (LinkLimits): bulk
raw TCP, a Python socket sender in the prefill namespace and a receiver in the decode namespace moving as many bytes
as the largest KV (4 MiB sends and receives); per KV size, raw TCP of one message of that size after an idle gap as
between requests (on a connection kept open, and on a fresh one), and mooncake's TCP transport alone writing that size
in 8 blocks after the same gap, with mooncake's synchronous write and with the fork's paced write. The table compares
each row with the bulk limit, with the one message of its own size, and with mooncake alone at its size and wait.

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
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from bench import baseline, cpu_window
from bench.readme_block import write_block
from bench.work_dir import work_dir
from testing import hosts as hosts_mod
from testing.pd_cluster import PDCluster, fork_python, http_post_json, metric_sum, start_all
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


def tcp_msg_sink(port: int) -> None:
    """Serve messages on `port` until one of length 0: each is an 8-byte length then that many bytes, answered by
    one byte once the last byte is in; a thread per connection (fresh ones per message, and one kept warm)."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(8)
    print("ready", flush=True)
    done = threading.Event()

    def serve(conn: socket.socket) -> None:
        buf = memoryview(bytearray(TCP_BLOCK))
        with conn:
            while True:
                head = _recv_exact(conn, 8)
                if head is None:
                    return  # the source closed this connection
                size = int.from_bytes(head, "little")
                if size == 0:
                    done.set()
                    return
                got = 0
                while got < size:
                    n = conn.recv_into(buf, min(TCP_BLOCK, size - got))
                    if n == 0:
                        raise RuntimeError(f"source closed after {got} of {size} bytes")
                    got += n
                conn.sendall(b"k")

    srv.settimeout(0.2)
    while not done.is_set():
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            continue
        conn.settimeout(None)
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _recv_exact(conn: socket.socket, n: int) -> Optional[bytes]:
    out = b""
    while len(out) < n:
        part = conn.recv(n - len(out))
        if not part:
            if out:
                raise RuntimeError("connection closed inside a message header")
            return None
        out += part
    return out


def tcp_msg_source(address: str, port: int, sizes: Sequence[int], repeats: int, gap: float) -> None:
    """One message of each size, `repeats` rounds, each message after `gap` seconds of idle: on a fresh connection
    (timed from the connect) and on a warm one (one connection for the whole run, opened by a first message of the
    largest size; timed from the first send); each timed until the sink's answer (all bytes in). Prints the bytes/s
    per mode and size."""
    payload = memoryview(bytes(max(sizes)))
    warm = socket.create_connection((address, port), timeout=60)

    def message(conn: socket.socket, size: int) -> None:
        conn.sendall(size.to_bytes(8, "little"))
        conn.sendall(payload[:size])
        if conn.recv(1) != b"k":
            raise RuntimeError("tcp sink did not answer")

    message(warm, max(sizes))
    rates: Dict[str, Dict[int, List[float]]] = {"fresh": {n: [] for n in sizes}, "warm": {n: [] for n in sizes}}
    for _ in range(repeats):
        for size in sizes:
            time.sleep(gap)
            t0 = time.perf_counter()
            with socket.create_connection((address, port), timeout=60) as fresh:
                message(fresh, size)
                rates["fresh"][size].append(size / (time.perf_counter() - t0))
            time.sleep(gap)
            t0 = time.perf_counter()
            message(warm, size)
            rates["warm"][size].append(size / (time.perf_counter() - t0))
    warm.sendall((0).to_bytes(8, "little"))
    warm.close()
    print(json.dumps({mode: {str(n): r for n, r in by.items()} for mode, by in rates.items()}), flush=True)


def raw_tcp_messages(hosts: hosts_mod.TestHosts, src: str, dst: str, sizes: Sequence[int], repeats: int = 3,
                     gap: float = 0.3) -> Dict[str, Dict[int, List[float]]]:
    """Bytes/s of one message of each of `sizes` from host `src` to host `dst` over TCP, timed by the sender until
    the receiver has every byte: {"fresh": {size: rates}, "warm": {...}} (tcp_msg_source)."""
    port = 23457
    sink = subprocess.Popen(hosts[dst].exec_argv([fork_python(), "-m", "bench.transfer", "--tcp-msg-sink", str(port)]),
                            stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        if sink.stdout.readline().strip() != "ready":
            raise RuntimeError("tcp message sink did not start")
        out = subprocess.run(hosts[src].exec_argv([fork_python(), "-m", "bench.transfer", "--tcp-msg-source",
                                                   hosts[dst].address, str(port), ",".join(map(str, sizes)),
                                                   str(repeats), str(gap)]),
                             check=True, timeout=300, cwd=REPO_ROOT, capture_output=True, text=True)
    finally:
        sink.wait(timeout=60)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return {mode: {int(n): r for n, r in by.items()} for mode, by in got.items()}


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
              polls: Sequence[float] = (0.0,), sizes: Optional[Sequence[int]] = None, gap: float = 0.0) -> None:
    """Write into the peer's buffer as `blocks` contiguous blocks in one write (what sglang's mooncake sender does
    with one chunk's KV: a block per layer and K/V), `nbytes` or each of `sizes`, `repeats` rounds in which each wait
    of `polls` takes its turn, each write after `gap` seconds of idle; print each wait's bytes/s per size and round. A
    poll of 0: mooncake's synchronous `batch_transfer_sync_write` (upstream's sender); > 0: the fork's paced write
    (fork_transfer.paced_write: a transfer per block, status checks `poll` seconds apart)."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.fork_transfer.paced_write import PacedWrite, mooncake_timeout_s

    sizes = list(sizes or [nbytes])
    engine = _mc_engine(hostname)
    buf, ptr = _mc_buffer(engine, max(sizes))  # held: the engine reads it
    writes = {poll: PacedWrite(SimpleNamespace(engine=engine), engine.batch_transfer_sync_write, poll,
                               mooncake_timeout_s()) if poll > 0 else engine.batch_transfer_sync_write
              for poll in polls}
    rates: Dict[float, Dict[int, List[float]]] = {poll: {n: [] for n in sizes} for poll in polls}
    cores: Dict[float, List[float]] = {poll: [] for poll in polls}  # the source process's CPU-s per second of write
    for round_ in range(repeats + 1):  # the first round opens the connection
        for total in sizes:
            size = total // blocks
            for poll, write in writes.items():
                if round_ and gap:
                    time.sleep(gap)
                t0, c0 = time.perf_counter(), time.process_time()
                ret = write(session, [ptr + i * size for i in range(blocks)],
                            [peer_addr + i * size for i in range(blocks)], [size] * blocks)
                took, cpu = time.perf_counter() - t0, time.process_time() - c0
                if ret < 0:
                    raise RuntimeError(f"mooncake write (poll {poll}) -> {ret}")
                if round_:
                    rates[poll][total].append(size * blocks / took)
                    cores[poll].append(cpu / took)
    del buf
    print(json.dumps({"rates": {str(p): {str(n): r for n, r in by.items()} for p, by in rates.items()},
                      "cores": {str(p): c for p, c in cores.items()}}), flush=True)


def mooncake_alone(hosts: hosts_mod.TestHosts, src: str, dst: str, sizes: Sequence[int], blocks: int = 8,
                   repeats: int = 3, polls: Sequence[float] = (0.0,), gap: float = 0.0,
                   cores: Optional[Dict[float, List[float]]] = None,
                   env: Optional[Mapping[str, str]] = None) -> Dict[float, Dict[int, List[float]]]:
    """Bytes/s of mooncake's TCP transport alone (no sglang) from host `src` to host `dst`, per wait of `polls` (0:
    mooncake's synchronous write, > 0: the fork's paced write with that poll) and per size: one write of each of
    `sizes` in `blocks` blocks, `repeats` rounds after a first one, the waits taking turns, each write after `gap`
    seconds of idle. `cores`, if given, gets the writing process's CPU-s per second of each write, per wait; `env`:
    more environment for both processes (mooncake's MC_* settings)."""
    child_env = {**os.environ, **(env or {})}
    sink = subprocess.Popen(hosts[dst].exec_argv([fork_python(), "-m", "bench.transfer", "--mc-sink",
                                                  hosts[dst].address, str(max(sizes))]),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=child_env)
    try:
        peer = json.loads(sink.stdout.readline())
        out = subprocess.run(hosts[src].exec_argv([fork_python(), "-m", "bench.transfer", "--mc-source",
                                                   hosts[src].address, peer["session"], str(peer["addr"]),
                                                   str(max(sizes)), str(blocks), str(repeats),
                                                   "--mc-polls", ",".join(map(str, polls)),
                                                   "--mc-sizes", ",".join(map(str, sizes)), "--mc-gap", str(gap)]),
                             timeout=300, cwd=REPO_ROOT, capture_output=True, text=True, env=child_env)
        if out.returncode != 0:
            raise RuntimeError(f"mooncake source failed: {out.stderr[-2000:]}")
    finally:
        sink.stdin.close()
        sink.wait(timeout=60)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if cores is not None:
        cores.update({float(poll): c for poll, c in got["cores"].items()})
    return {float(poll): {int(n): r for n, r in by.items()} for poll, by in got["rates"].items()}


# ----------------------------------------------------------------------------- one request


def _stage_sums(metrics: Mapping[str, float]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for key, value in metrics.items():
        if key.startswith(STAGE + "{"):
            stage = key.split('stage="', 1)[1].split('"', 1)[0]
            out[stage] = out.get(stage, 0.0) + value
    for name in ("sglang:kv_transfer_total_mb_sum", "sglang:kv_transfer_latency_ms_sum",
                 "sglang:kv_transfer_total_mb_count"):
        out[name] = metric_sum(metrics, name)
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


MSG_GAP = 0.3  # s of idle before each one-message limit: more than TCP's minimum RTO (200 ms), as between requests


@dataclass
class LinkLimits:
    """The limits of one link, measured between the prefill and the decode host with no server running: `bulk`, one
    TCP stream as long as the longest KV (bytes/s); per KV size (bytes): one TCP message of that size after an idle
    gap, on a connection kept warm (`tcp_warm`) and on a fresh one (`tcp_fresh`), and mooncake alone writing that size
    in 8 blocks after the same gap, per wait (`mooncake`: poll -> size -> bytes/s; poll 0 the synchronous write).
    Medians."""

    bulk: float
    tcp_warm: Dict[int, float]
    tcp_fresh: Dict[int, float]
    mooncake: Dict[float, Dict[int, float]]


def measure_limits(hosts: hosts_mod.TestHosts, sizes: Sequence[int], polls: Sequence[float], repeats: int,
                   label: str) -> LinkLimits:
    """LinkLimits of the link from the prefill host to the decode host, printing each round."""
    bulk = raw_tcp(hosts, "prefill", "decode", max(sizes), repeats=repeats)
    msgs = raw_tcp_messages(hosts, "prefill", "decode", sizes, repeats=repeats, gap=MSG_GAP)
    mc = mooncake_alone(hosts, "prefill", "decode", sizes, repeats=repeats, polls=polls, gap=MSG_GAP)
    print(f"{label}: raw TCP stream of {max(sizes) / 2**20:.0f} MiB {[round(r / 1e6) for r in bulk]} MB/s", flush=True)
    for n in sizes:
        print(f"{label}, {n / 2**20:.1f} MiB: raw TCP one message warm {[round(r / 1e6) for r in msgs['warm'][n]]}, "
              f"fresh {[round(r / 1e6) for r in msgs['fresh'][n]]}; mooncake alone " + ", ".join(
                  f"{'synchronous' if poll == 0 else f'paced {poll * 1e3:g} ms'} {[round(r / 1e6) for r in by[n]]}"
                  for poll, by in mc.items()) + " MB/s", flush=True)
    med = statistics.median
    return LinkLimits(bulk=med(bulk), tcp_warm={n: med(r) for n, r in msgs["warm"].items()},
                      tcp_fresh={n: med(r) for n, r in msgs["fresh"].items()},
                      mooncake={poll: {n: med(r) for n, r in by.items()} for poll, by in mc.items()})


def table(results: Dict[str, Dict[tuple, List[Dict[str, float]]]], limits: Mapping[str, LinkLimits],
          links: Sequence[str], pacing: Mapping[str, str], waits: Mapping[str, float]) -> str:
    """Markdown: per link and prompt length, each side's median figures; KV bytes/s against the link's limits: the
    bulk raw TCP stream, one raw TCP message of the same size, and mooncake alone writing the same size with the
    side's own wait (`waits`: side -> poll, 0 the synchronous write); `pacing`: who paces each side's idle passes.
    Then the limits per link and size."""
    lines = ["| link | prompt tokens | KV moved | side | idle passes paced by | TTFT (s) | prefill compute (s) | "
             "transfer (s) | KV MB/s | of raw TCP, bulk | of raw TCP, one message this size | "
             "of mooncake alone, this size | fork/upstream KV rate |",
             "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for link in links:
        lim = limits[link]
        lengths = sorted({n for side in results for (l, n) in results[side] if l == link})
        for n in lengths:
            size = n * WIDE_KV_BYTES_PER_TOKEN
            rows = {side: results[side][(link, n)] for side in results if (link, n) in results[side]}
            rates = {side: _median(r, "kv_rate") for side, r in rows.items()}
            for side, r in rows.items():
                ratio = (f"{rates['fork'] / rates['upstream']:.2f}" if side == "fork" and "upstream" in rates
                         else "")
                lines.append(
                    f"| {link} | {n} | {_median(r, 'kv_bytes') / 2**20:.0f} MiB | {side} | {pacing[side]} | "
                    f"{_median(r, 'ttft'):.2f} | "
                    f"{_median(r, 'compute'):.2f} | {_median(r, 'transfer'):.3f} | {rates[side] / 1e6:.0f} | "
                    f"{rates[side] / lim.bulk:.0%} | {rates[side] / lim.tcp_warm[size]:.0%} | "
                    f"{rates[side] / lim.mooncake[waits[side]][size]:.0%} | {ratio} |")
    lines += ["", "The limits (no server running; medians, MB/s):", "",
              "| link | KV | raw TCP, bulk | raw TCP, one message, warm connection | "
              "raw TCP, one message, fresh connection | mooncake alone, synchronous write | "
              "mooncake alone, paced write |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for link in links:
        lim = limits[link]
        paced = max(lim.mooncake)
        for size in sorted(lim.tcp_warm):
            lines.append(f"| {link} | {size / 2**20:.1f} MiB | {lim.bulk / 1e6:.0f} | {lim.tcp_warm[size] / 1e6:.0f} | "
                         f"{lim.tcp_fresh[size] / 1e6:.0f} | {lim.mooncake[0.0][size] / 1e6:.0f} | "
                         f"{lim.mooncake[paced][size] / 1e6:.0f} |")
    lines.append("")
    lines.append(f"Raw TCP, bulk: one Python socket stream from the prefill host to the decode host as long as the "
                 f"longest KV (4 MiB writes, timed by the receiver). One message: that many bytes, each after "
                 f"{MSG_GAP * 1e3:g} ms of idle as between requests, timed by the sender until the receiver has "
                 f"every byte, on a connection kept open (warm) or a new one (fresh, the connect included). Mooncake "
                 f"alone: its TCP transport without sglang writing that many bytes in 8 blocks (as sglang sends one "
                 f"chunk's KV) after the same idle, with mooncake's synchronous batch write (upstream's) or the "
                 f"fork's paced write (polling every {paced * 1e3:g} ms); \"of mooncake alone\" compares each "
                 f"side with its own wait.")
    return "\n".join(lines)


def limits_only(sizes: Sequence[int], polls: Sequence[float], repeats: int, blocks: int) -> int:
    """`--limits-only`: on one link between two fresh test hosts, per size: raw TCP (bulk and one message) and
    mooncake alone per wait of `polls` in `blocks` blocks, printed."""
    with hosts_mod.TestHosts(("prefill", "decode")) as hosts:
        bulk = raw_tcp(hosts, "prefill", "decode", max(sizes), repeats=repeats)
        msgs = raw_tcp_messages(hosts, "prefill", "decode", sizes, repeats=repeats, gap=MSG_GAP)
        cores: Dict[float, List[float]] = {}
        mc = mooncake_alone(hosts, "prefill", "decode", sizes, blocks=blocks, repeats=repeats, polls=polls,
                            gap=MSG_GAP, cores=cores)
    med = statistics.median
    print(f"raw TCP stream of {max(sizes) / 2**20:.0f} MiB: {[round(r / 1e6) for r in bulk]} MB/s (median "
          f"{med(bulk) / 1e6:.0f})")
    for n in sizes:
        warm = med(msgs["warm"][n])
        print(f"{n / 2**20:.1f} MiB: raw TCP one message after {MSG_GAP * 1e3:g} ms idle, warm connection "
              f"{warm / 1e6:.0f} MB/s {[round(r / 1e6) for r in msgs['warm'][n]]}, fresh "
              f"{med(msgs['fresh'][n]) / 1e6:.0f} MB/s {[round(r / 1e6) for r in msgs['fresh'][n]]}")
        for poll, by in mc.items():
            wait = f"paced, poll {poll * 1e3:g} ms" if poll > 0 else "synchronous write"
            print(f"  mooncake alone in {blocks} blocks, {wait}: median {med(by[n]) / 1e6:.0f} MB/s "
                  f"({med(by[n]) / warm:.0%} of the message, {med(by[n]) / med(bulk):.0%} of bulk), rounds "
                  f"{[round(r / 1e6) for r in by[n]]}")
    for poll, c in cores.items():
        print(f"writing process, {'paced ' + format(poll * 1e3, 'g') + ' ms' if poll else 'synchronous'}: "
              f"{med(c):.2f} cores (median)")
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
    parser.add_argument("--write-readme", action="store_true", help="write the table into bench/README.md")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--tcp-sink", nargs=2, type=int, metavar=("PORT", "BYTES"), help=argparse.SUPPRESS)
    parser.add_argument("--tcp-source", nargs=3, metavar=("ADDR", "PORT", "BYTES"), help=argparse.SUPPRESS)
    parser.add_argument("--tcp-msg-sink", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--tcp-msg-source", nargs=5, metavar=("ADDR", "PORT", "SIZES", "REPEATS", "GAP"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--mc-sink", nargs=2, metavar=("HOST", "BYTES"), help=argparse.SUPPRESS)
    parser.add_argument("--mc-source", nargs=6, metavar=("HOST", "SESSION", "ADDR", "BYTES", "BLOCKS", "REPEATS"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--mc-polls", default="0", help=argparse.SUPPRESS)
    parser.add_argument("--mc-sizes", default="", help=argparse.SUPPRESS)
    parser.add_argument("--mc-gap", type=float, default=0.0, help=argparse.SUPPRESS)
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
        mc_source(host, session, *(int(x) for x in nums), polls=[float(x) for x in args.mc_polls.split(",")],
                  sizes=[int(x) for x in args.mc_sizes.split(",") if x], gap=args.mc_gap)
        return 0
    if args.tcp_msg_sink:
        tcp_msg_sink(args.tcp_msg_sink)
        return 0
    if args.tcp_msg_source:
        addr, port, sizes, repeats, gap = args.tcp_msg_source
        tcp_msg_source(addr, int(port), [int(x) for x in sizes.split(",")], int(repeats), float(gap))
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
        return limits_only([n * WIDE_KV_BYTES_PER_TOKEN for n in lengths],
                           [float(x) for x in args.limits_only.split(",")], args.repeats, args.blocks)
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
            sizes = [n * WIDE_KV_BYTES_PER_TOKEN for n in lengths]
            polls = (0.0, write_poll)
            limits: Dict[str, LinkLimits] = {"veth": measure_limits(hosts, sizes, polls, 3, "veth")}
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
                        limits[link] = measure_limits(hosts, sizes, polls, 1, link)
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
        waits = {side: 0.0 if side in ("upstream", "fork-syncwrite") else write_poll for side in args.sides}
        text = table(results, limits, links, pacing, waits)
        print()
        print(text)
        print(f"\nwall time {time.monotonic() - t_start:.0f}s")
        if args.write_readme:
            write_block(REPO_ROOT / "bench" / "README.md", README_BEGIN, README_END, text)
        return 0


if __name__ == "__main__":
    sys.exit(main())
