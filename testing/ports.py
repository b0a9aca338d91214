"""Ports for test servers: free on 127.0.0.1, outside the kernel's ephemeral range, and
reserved machine-wide for this process (an flock per port) until it exits."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from pathlib import Path
from typing import Dict, List

from testing.polling import ClusterError

HOST = "127.0.0.1"


def _port_window() -> range:
    """Ports to hand out: below the kernel's ephemeral range.

    A port the kernel handed us (bind to 0) lies in the ephemeral range, where every
    outgoing connection and every `bind(0)` of the servers themselves (mooncake, torch,
    the gateway's clients) draws its local port too. A server takes ~35 s on a loaded
    2-core machine to bind its HTTP port, so such a port was seen taken by then (CI:
    `[Errno 98] address already in use`). Ports below that range are only ever taken
    by whoever asks for them by number.
    """
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    if lo >= 22000:
        # 22000-29999 is where upstream draws its own below-ephemeral ports
        # (sglang.srt.utils.network.get_free_port_below_ephemeral); mooncake's RPC
        # ports lie at 15000-17000.
        return range(17100, 22000)
    if 65535 - hi >= 2000:
        return range(hi + 1, 65536)
    raise ClusterError(f"no port window outside the ephemeral range {lo}-{hi}")


_PORT_LOCK_DIR = Path(tempfile.gettempdir()) / "sglang-fork-test-ports"
_held_ports: Dict[int, int] = {}  # port -> fd of its lock file, held until this process exits
_ports_lock = threading.Lock()


def free_ports(n: int) -> List[int]:
    """n distinct ports, free on 127.0.0.1 now and reserved for this process.

    Drawn outside the ephemeral range (see _port_window) and reserved machine-wide by
    an flock on a per-port file, held until this process exits, so two test processes
    on one machine never hand out the same port, and one process never hands a port
    out twice (a killed server restarts on its own ports; those stay ours).
    """
    import fcntl
    import random

    window = _port_window()
    _PORT_LOCK_DIR.mkdir(parents=True, exist_ok=True)
    ports: List[int] = []
    with _ports_lock:
        start = random.randrange(len(window))
        for i in range(len(window)):
            if len(ports) == n:
                break
            port = window[(start + i) % len(window)]
            if port in _held_ports:
                continue
            fd = os.open(_PORT_LOCK_DIR / f"{port}.lock", os.O_CREAT | os.O_RDWR, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((HOST, port))
            except OSError:
                os.close(fd)  # taken by someone outside this scheme; leave it
                continue
            finally:
                s.close()
            _held_ports[port] = fd
            ports.append(port)
    if len(ports) < n:
        raise ClusterError(f"only {len(ports)} of {n} free ports in {window.start}-{window.stop - 1}")
    return ports



def free_port() -> int:
    """One port of `free_ports`."""
    return free_ports(1)[0]
