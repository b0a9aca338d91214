"""Test hosts on one machine: each server in its own network namespace ("host") with its own address on a
Linux bridge (the "switch") that lives in a namespace of its own; this process reaches every host over one more
port of that switch (a veth from the current namespace). Partitions and slow links are made at the switch:

- `cut(a, b)`: the switch stops forwarding between the two hosts' ports (bridge port isolation). Both links keep
  their carrier, nothing is refused or reset: connects and reads between a and b simply time out, while this
  process (and every other host) still reaches both. `heal()` forwards again.
- `shape(role, rate)`: a token bucket (tbf) on the switch port towards `role`: everything sent to that host goes
  at `rate`. Its burst is kept well above the 64 KiB segments veth sends (a smaller one drops instead of shaping).

Every address is in one /24 picked from 198.18.0.0/15 (the benchmarking range) that no route of this namespace
covers, and every host has static neighbour entries, so a partition stays silent (no ARP failure answers a
connect with "no route to host"). Nothing outside these namespaces is addressed.

Lifetime: `TestHosts` is a context manager; a finalizer (and atexit) removes what it made if the owner never
exits; every namespace name carries the creating pid, so a new run removes the leftovers of a crashed one (pid
gone) and never another live run's. Deleting the switch namespace deletes every veth (they are all created
there). Needs root (CAP_NET_ADMIN) and `ip`/`bridge`/`tc`: `unavailable()` says why not, for a test skip.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import secrets
import shutil
import subprocess
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

PREFIX = "pdh"  # every namespace and interface this module makes starts with it
SUPERNET = ipaddress.ip_network("198.18.0.0/15")
SEGMENT_BYTES = 64 * 1024  # the largest segment veth/GSO hands a qdisc
MIN_BURST = 4 * SEGMENT_BYTES


class HostsError(RuntimeError):
    pass


def _ip(*args: str, netns: Optional[str] = None, check: bool = True) -> str:
    argv = ["ip", *(("-n", netns) if netns else ()), *args]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise HostsError(f"{' '.join(argv)}: {r.stderr.strip()}")
    return r.stdout


def _in(netns: str, *argv: str) -> str:
    r = subprocess.run(["ip", "netns", "exec", netns, *argv], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise HostsError(f"{netns}: {' '.join(argv)}: {r.stderr.strip()}")
    return r.stdout


def unavailable() -> Optional[str]:
    """Why test hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces, veth, bridge)"
    missing = [tool for tool in ("ip", "bridge", "tc") if shutil.which(tool) is None]
    if missing:
        return f"test hosts need {', '.join(missing)} (iproute2)"
    return None


def netns_list() -> List[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers() -> List[str]:
    """Remove the namespaces of runs whose process is gone (names `pdh-<pid>-...`); returns them."""
    removed = []
    for name in netns_list():
        parts = name.split("-")
        if parts[0] != PREFIX or len(parts) < 3 or not parts[1].isdigit() or _pid_alive(int(parts[1])):
            continue
        _ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of SUPERNET that no route or address of this namespace overlaps."""
    taken = []
    for line in _ip("-4", "route", "show", "table", "all").splitlines() + _ip("-4", "-o", "addr").splitlines():
        for word in line.split():
            try:
                taken.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                continue
    candidates = list(SUPERNET.subnets(new_prefix=24))
    start = secrets.randbelow(len(candidates))
    for i in range(len(candidates)):
        net = candidates[(start + i) % len(candidates)]
        if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
            return net
    raise HostsError(f"no free /24 in {SUPERNET}")


@dataclass(frozen=True)
class Host:
    """One test host: its namespace, its address and the switch port that leads to it."""

    role: str
    netns: str
    address: str
    port: str  # interface name on the switch (in the switch namespace)

    def exec_argv(self, argv: Sequence[str]) -> List[str]:
        """`argv` run on this host."""
        return ["ip", "netns", "exec", self.netns, *argv]


class TestHosts:
    """Hosts named by role (e.g. prefill, decode, gateway) on one switch; the current namespace is the client.

    Owns every namespace and link it makes; `close()` (context exit, finalizer, atexit) removes them all.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, roles: Sequence[str] = ("prefill", "decode", "gateway")):
        why = unavailable()
        if why:
            raise HostsError(why)
        clean_leftovers()
        self.run = f"{os.getpid()}-{secrets.token_hex(3)}"
        tag = self.run.split("-")[1]
        self.switch = f"{PREFIX}-{self.run}-switch"
        self.subnet = _free_subnet()
        addrs = list(self.subnet.hosts())
        self.client = Host("client", "", str(addrs[0]), f"{PREFIX}{tag}c")
        self.hosts: Dict[str, Host] = {
            role: Host(role, f"{PREFIX}-{self.run}-{role}", str(addrs[i + 1]), f"{PREFIX}{tag}{i}")
            for i, role in enumerate(roles)
        }
        self._client_if = f"{PREFIX}{tag}r"
        self._cut: Optional[Tuple[str, str]] = None
        self._namespaces: List[str] = []
        self._links: List[str] = []  # in this namespace
        self._finalizer = weakref.finalize(self, _remove, self._namespaces, self._links)
        atexit.register(self._finalizer)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "TestHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, role: str) -> Host:
        return self.hosts[role]

    def close(self) -> None:
        self._finalizer()

    # -- building

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("link", "set", "lo", "up", netns=name)

    def _build(self) -> None:
        prefix = self.subnet.prefixlen
        self._netns(self.switch)
        _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        _ip("link", "set", "br0", "up", netns=self.switch)
        macs: Dict[str, Tuple[str, str]] = {}  # address -> (mac, where)
        for host in self.hosts.values():
            self._netns(host.netns)
            # made in the switch namespace, so deleting it deletes both ends
            _ip("link", "add", host.port, "type", "veth", "peer", "name", "eth1", netns=self.switch)
            _ip("link", "set", "eth1", "netns", host.netns, netns=self.switch)
            _ip("addr", "add", f"{host.address}/{prefix}", "dev", "eth1", netns=host.netns)
            _ip("link", "set", "eth1", "up", netns=host.netns)
            macs[host.address] = (_mac("eth1", host.netns), host.netns)
        _ip("link", "add", self.client.port, "type", "veth", "peer", "name", self._client_if, netns=self.switch)
        _ip("link", "set", self._client_if, "netns", str(os.getpid()), netns=self.switch)
        self._links.append(self._client_if)
        _ip("addr", "add", f"{self.client.address}/{prefix}", "dev", self._client_if)
        _ip("link", "set", self._client_if, "up")
        macs[self.client.address] = (_mac(self._client_if, None), "")
        for port in [h.port for h in self.hosts.values()] + [self.client.port]:
            _ip("link", "set", port, "master", "br0", netns=self.switch)
            _ip("link", "set", port, "up", netns=self.switch)
        # static neighbours: a partition never turns into "no route to host"
        for address, (_, where) in macs.items():
            dev = "eth1" if where else self._client_if
            for other, (mac, _) in macs.items():
                if other != address:
                    _ip("neigh", "replace", other, "lladdr", mac, "dev", dev, "nud", "permanent", netns=where or None)

    # -- faults

    def cut(self, a: str, b: str) -> None:
        """Silent partition between hosts a and b (either may be "client"); everyone else still reaches both."""
        if self._cut is not None and set(self._cut) != {a, b}:
            raise HostsError(f"{self._cut} is cut already: heal() first")
        for role in (a, b):
            _bridge("link", "set", "dev", self._port(role), "isolated", "on", netns=self.switch)
        self._cut = (a, b)

    def heal(self) -> None:
        """Forward between every pair again."""
        if self._cut is None:
            return
        for role in self._cut:
            _bridge("link", "set", "dev", self._port(role), "isolated", "off", netns=self.switch)
        self._cut = None

    def shape(self, role: str, rate_bits: int, burst_bytes: int = MIN_BURST, latency_ms: int = 1000,
              drop_large: bool = False, src: Optional[str] = None) -> None:
        """What the switch sends to `role` (only what comes from host `src`, if given: one link of the switch)
        goes at `rate_bits` per second (tbf, burst > a segment). `drop_large`: a burst below the segment size is
        allowed; tbf then drops every packet larger than the burst (a burst below the MTU: every full-size
        packet), while small ones pass: a link on which bulk TCP transfers stall while connects, acks and small
        messages still work."""
        if burst_bytes < MIN_BURST and not drop_large:
            raise HostsError(f"burst {burst_bytes} B < {MIN_BURST} B: tbf would drop veth's 64 KiB segments")
        port = self._port(role)
        tbf = ["tbf", "rate", f"{rate_bits}bit", "burst", str(burst_bytes), "latency", f"{latency_ms}ms"]
        self.unshape(role)
        if src is None:
            _in(self.switch, "tc", "qdisc", "add", "dev", port, "root", *tbf)
            return
        # htb classifies by source address (u32): `src`'s packets into the shaped class, the rest unshaped
        _in(self.switch, "tc", "qdisc", "add", "dev", port, "root", "handle", "1:", "htb", "default", "1")
        _in(self.switch, "tc", "class", "add", "dev", port, "parent", "1:", "classid", "1:1", "htb", "rate", "10gbit")
        _in(self.switch, "tc", "class", "add", "dev", port, "parent", "1:", "classid", "1:10", "htb",
            "rate", "10gbit")
        _in(self.switch, "tc", "qdisc", "add", "dev", port, "parent", "1:10", "handle", "10:", *tbf)
        _in(self.switch, "tc", "filter", "add", "dev", port, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "src", f"{self.hosts[src].address}/32", "flowid", "1:10")

    def unshape(self, role: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.switch, "tc", "qdisc", "del", "dev", self._port(role), "root"],
                       capture_output=True, timeout=30)

    def _port(self, role: str) -> str:
        return self.client.port if role == "client" else self.hosts[role].port


def _bridge(*args: str, netns: str) -> None:
    _in(netns, "bridge", *args)


def _mac(dev: str, netns: Optional[str]) -> str:
    for line in _ip("-o", "link", "show", "dev", dev, netns=netns).split("\\"):
        words = line.split()
        if "link/ether" in words:
            return words[words.index("link/ether") + 1]
    raise HostsError(f"no MAC address on {dev}")


def _remove(namespaces: List[str], links: List[str]) -> None:
    """Delete our link in this namespace (at once: a namespace's own links go asynchronously) and the
    namespaces (the switch's last: its veths go with it); kills nothing (servers are the deployment's)."""
    for link in links:
        _ip("link", "del", link, check=False)
    links.clear()
    for name in reversed(namespaces):
        _ip("netns", "del", name, check=False)
    namespaces.clear()
