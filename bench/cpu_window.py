"""Who used the machine's cores during one call (bench-only; `make bench-rl ARGS=--cpu-window`).

A snapshot of every thread on the machine (/proc/<pid>/task/<tid>/schedstat: nanoseconds run on a CPU and
nanoseconds spent runnable, waiting for one) taken before and after a call; the difference per process, labelled
with the deployment and role it belongs to ("fork decode scheduler", "upstream lb", "bench", or "other: <comm>"
for the rest of the machine), is what ran and what waited during the call. Linux only; reads /proc, no sampling.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Tuple

import psutil

Snapshot = Dict[int, Tuple[int, int]]  # pid -> (run ns, runnable-wait ns), summed over its threads


def snapshot() -> Snapshot:
    """Run and wait nanoseconds of every process on the machine, summed over its threads."""
    out: Snapshot = {}
    for pid_s in os.listdir("/proc"):
        if not pid_s.isdigit():
            continue
        run = wait = 0
        try:
            for tid in os.listdir(f"/proc/{pid_s}/task"):
                with open(f"/proc/{pid_s}/task/{tid}/schedstat") as f:
                    r, w, _ = f.read().split()
                run, wait = run + int(r), wait + int(w)
        except (OSError, ValueError):
            continue  # the process or a thread ended meanwhile
        out[int(pid_s)] = (run, wait)
    return out


def process_kind(proc: psutil.Process) -> str:
    """scheduler / detokenizer / http (the launch process: HTTP server + tokenizer) / the command's name."""
    try:
        name = proc.name()
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return "?"
    for kind in ("scheduler", "detokenizer"):
        if kind in name or kind in cmd:
            return kind
    return "http" if "sglang.launch_server" in cmd else name


def labels(deployments: Mapping[str, object]) -> Dict[int, str]:
    """pid -> "<deployment> <role> <kind>" for every process of the given deployments (name -> Deployment)."""
    out: Dict[int, str] = {os.getpid(): "bench"}
    for name, dep in deployments.items():
        for role, server in dep.servers.items():  # type: ignore[attr-defined]
            for proc in server.processes():
                out[proc.pid] = f"{name} {role} {process_kind(proc)}"
    return out


@dataclass
class Window:
    """What ran and waited between two snapshots, per labelled process (seconds)."""

    wall: float
    run: Dict[str, float]
    wait: Dict[str, float]

    def top(self, n: int = 6, min_s: float = 0.005) -> str:
        """The n processes that ran longest, 'label run/wait', e.g. 'upstream decode scheduler 0.31/0.12'."""
        ranked = sorted(self.run, key=self.run.get, reverse=True)[:n]
        return ", ".join(f"{k} {self.run[k]:.2f}/{self.wait.get(k, 0.0):.2f}" for k in ranked if self.run[k] >= min_s)

    def total(self, prefix: str = "") -> float:
        """Seconds run by the processes whose label starts with prefix."""
        return sum(v for k, v in self.run.items() if k.startswith(prefix))

    def waited(self, prefix: str = "") -> float:
        """Seconds the processes whose label starts with prefix were runnable but waiting for a core."""
        return sum(v for k, v in self.wait.items() if k.startswith(prefix))


def window(before: Snapshot, after: Snapshot, names: Mapping[int, str], wall: float) -> Window:
    """Per label: run and wait seconds between the snapshots (processes not labelled: 'other: <comm>')."""
    run: Dict[str, float] = {}
    wait: Dict[str, float] = {}
    for pid, (r1, w1) in after.items():
        r0, w0 = before.get(pid, (0, 0))
        if r1 - r0 <= 0 and w1 - w0 <= 0:
            continue
        label = names.get(pid) or f"other: {_comm(pid)}"
        run[label] = run.get(label, 0.0) + (r1 - r0) / 1e9
        wait[label] = wait.get(label, 0.0) + (w1 - w0) / 1e9
    return Window(wall, run, wait)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def summed(windows: Iterable[Window]) -> List[Tuple[str, float, float]]:
    """(label, run, wait) summed over windows, longest run first."""
    run: Dict[str, float] = {}
    wait: Dict[str, float] = {}
    for w in windows:
        for k, v in w.run.items():
            run[k] = run.get(k, 0.0) + v
            wait[k] = wait.get(k, 0.0) + w.wait.get(k, 0.0)
    return sorted(((k, run[k], wait[k]) for k in run), key=lambda t: -t[1])
