"""A closed-loop soak that mixes faults on a real 1P1D, and judges every answer.

Clients send greedy requests through the deployment's balancer, each its next one as
soon as the last is answered. Meanwhile a seeded schedule applies one fault at a time,
each with the calls reaching the two servers at different moments: pause cycles in
every mode with the servers continued in either order, aborts of single requests by
rid on both servers, `abort_all`, aborts of requests held at one paused server's gate
while the other serves them, a frozen decode, a frozen prefill. Every fault is a
window [start, end] in time.

Every answer is judged against the windows its request overlapped (sent before the
window ended, answered after it began):
- a completion: 200, finish `length` with exactly max_new_tokens tokens (or `stop`),
  output equal to the request's reference (taken before the soak) unless it
  overlapped a retract pause;
- upstream's abort answer (200, finish `abort`, no error status) naming why: only if
  it overlapped an abort-mode pause, `abort_all`, or an abort of its own rid, and its
  message names one of those (docs/aborts.md: the pause, or the client);
- nothing else (no 4xx/5xx: none of these faults may cost a request an error), and
  no request open longer than `answer_bound_s`.

Used by test/srt/verdict/test_room_ledger_e2e.py (bounded, through the mini LB),
test/srt/gateway/test_gateway.py (bounded, through the Rust gateway) and `python -m
testing.soak [--balancer router]` (longer runs against a fresh deployment).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from testing.pd_cluster import generate, http_post_json, prompts, wait_until

FAULTS = ("abort_pause", "in_place_pause", "retract_pause", "rid_aborts", "abort_all", "freeze_decode",
          "freeze_prefill", "abort_at_gate")
ABORTING = {"abort_pause", "abort_all", "abort_at_gate"}  # may end any request they overlap as an abort
# What an abort answer's message says for each fault that may end a request (docs/aborts.md,
# docs/pause-release-resume.md "How each kind of end is answered"): the pause, or the client
# (at a paused server's gate: "Aborted by the client/abort_all while the engine was paused").
CLIENT_NAMES = ("Aborted by the client", "Aborted by abort_all")
ABORT_NAMES = {
    "abort_pause": ("pause_generation",),
    "abort_all": CLIENT_NAMES,
    "rid_aborts": CLIENT_NAMES,  # of its own rid
    "abort_at_gate": ("pause_generation", *CLIENT_NAMES),
}
FREEZE_S = 1.5


@dataclass
class Window:
    fault: str
    start: float
    end: float = float("inf")
    rids: frozenset = frozenset()  # rid_aborts: the requests it aborted


@dataclass
class Answer:
    rid: str
    prompt: int
    sent: float
    answered: float
    result: dict

    @property
    def finish(self) -> Optional[str]:
        meta = self.result.get("meta") or {}
        return (meta.get("finish_reason") or {}).get("type")


@dataclass
class SoakReport:
    answers: List[Answer] = field(default_factory=list)
    windows: List[Window] = field(default_factory=list)
    wrong: List[tuple] = field(default_factory=list)
    diverged_after_retract: int = 0

    def summary(self) -> Dict[str, int]:
        c = Counter(f"{a.result['status']}/{a.finish}" for a in self.answers)
        c["faults"] = len(self.windows)
        return dict(c)


class Soak:
    def __init__(self, cluster, clients: int = 6, max_new_tokens: int = 16, n_prompts: int = 8,
                 answer_bound_s: float = 30.0, seed: int = 0):
        self.cluster, self.clients, self.max_new_tokens = cluster, clients, max_new_tokens
        self.answer_bound_s = answer_bound_s
        self.rng = random.Random(seed)
        self.texts = prompts(n_prompts)
        self.reference: List[list] = []
        self.report = SoakReport()
        self._lock = threading.Lock()
        self._open: Dict[str, tuple] = {}  # rid -> (prompt index, sent)
        self._halt = threading.Event()
        self._threads: List[threading.Thread] = []

    # ------------------------------------------------------------------ clients

    def _client(self, k: int) -> None:
        i = 0
        while not self._halt.is_set():
            p = (k + i) % len(self.texts)
            rid = f"soak-{k}-{i}-{time.monotonic_ns()}"
            sent = time.monotonic()
            with self._lock:
                self._open[rid] = (p, sent)
            r = generate(self.cluster.url, self.texts[p], max_new_tokens=self.max_new_tokens,
                         timeout=self.answer_bound_s + 60, rid=rid)
            with self._lock:
                self._open.pop(rid, None)
                self.report.answers.append(Answer(rid, p, sent, time.monotonic(), r))
            i += 1

    def answered(self) -> int:
        with self._lock:
            return len(self.report.answers)

    def open_rids(self) -> List[str]:
        with self._lock:
            return list(self._open)

    def stuck(self) -> List[str]:
        now = time.monotonic()
        with self._lock:
            return [rid for rid, (_, sent) in self._open.items() if now - sent > self.answer_bound_s]

    # ------------------------------------------------------------------ faults

    def _call(self, role: str, endpoint: str, body: Optional[dict] = None) -> None:
        status, reply = http_post_json(f"{self.cluster[role].url}/{endpoint}", body or {}, timeout=60)
        assert status == 200, (role, endpoint, status, reply)

    def _pause_cycle(self, mode: str) -> None:
        first, second = self.rng.sample(["prefill", "decode"], 2)
        self._call(first, "pause_generation", {"mode": mode})
        self._call(second, "pause_generation", {"mode": mode})
        first, second = self.rng.sample(["prefill", "decode"], 2)  # continued in either order
        self._call(first, "continue_generation")
        self._call(second, "continue_generation")

    def apply(self, fault: str) -> Window:
        w = Window(fault, time.monotonic())
        with self._lock:
            self.report.windows.append(w)
        if fault.endswith("_pause"):
            self._pause_cycle(fault[: -len("_pause")])
        elif fault == "rid_aborts":
            rids = self.rng.sample(self.open_rids(), min(2, len(self.open_rids())))
            w.rids = frozenset(rids)
            for rid in rids:
                for role in self.rng.sample(["prefill", "decode"], 2):
                    self._call(role, "abort_request", {"rid": rid})
        elif fault == "abort_at_gate":
            # one server paused (either), requests pile up at its gate while the other
            # serves them; then everything on the paused one is aborted and it continues
            role = self.rng.choice(["prefill", "decode"])
            self._call(role, "pause_generation", {"mode": "abort"})
            other = self.cluster["decode" if role == "prefill" else "prefill"]

            def every_client_waits_at_the_gate():
                # each open request's other copy waits in the serving server's PD
                # queues (for the paused one's handshake or KV): all are at the gate
                with self._lock:
                    n_open = len(self._open)
                q = other.resources()["queues"]
                waiting = q["prefill_bootstrap"] if role == "decode" else q["decode_prealloc"] + q["decode_transfer"]
                return n_open == self.clients and waiting == n_open

            wait_until(every_client_waits_at_the_gate, 30, f"requests held at {role}'s gate",
                       on_timeout=lambda: str(other.resources()["queues"]))
            self._call(role, "abort_request", {"abort_all": True})
            self._call(role, "continue_generation")
        elif fault == "abort_all":
            for role in self.rng.sample(["prefill", "decode"], 2):
                self._call(role, "abort_request", {"abort_all": True})
        elif fault.startswith("freeze_"):
            server = self.cluster[fault[len("freeze_"):]]
            server.freeze()
            try:
                # the fault's duration, not a synchronisation: requests pile up meanwhile
                threading.Event().wait(FREEZE_S)
            finally:
                server.resume()
        else:
            raise ValueError(fault)
        w.end = time.monotonic()
        return w

    # ------------------------------------------------------------------ run

    def take_reference(self) -> None:
        results = [generate(self.cluster.url, t, max_new_tokens=self.max_new_tokens) for t in self.texts]
        assert all(r["status"] == 200 for r in results), [r["error"] for r in results]
        self.reference = [r["output_ids"] for r in results]

    def run(self, faults: Sequence[str]) -> SoakReport:
        if not self.reference:
            self.take_reference()
        self._threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(self.clients)]
        for t in self._threads:
            t.start()
        try:
            for n, fault in enumerate(faults):
                # traffic in flight before each fault (a fault on an idle engine proves little)
                done = self.answered()
                wait_until(lambda: self.answered() >= done + self.clients // 2 and self.open_rids(), 120,
                           f"traffic before fault {n} ({fault})")
                self.apply(fault)
                assert not self.stuck(), (fault, self.stuck())
            done = self.answered()
            wait_until(lambda: self.answered() >= done + self.clients, 120, "traffic after the last fault")
        finally:
            self._halt.set()
            for t in self._threads:
                t.join(self.answer_bound_s + 60)
            for role in ("prefill", "decode"):  # never leave the deployment paused or frozen
                self.cluster[role].resume()
                http_post_json(f"{self.cluster[role].url}/continue_generation", {}, timeout=60)
        assert not [t for t in self._threads if t.is_alive()], f"a request hangs: {self.open_rids()}"
        self.judge()
        return self.report

    def judge(self) -> None:
        rep = self.report
        for a in rep.answers:
            over = [w for w in rep.windows if a.sent <= w.end and a.answered >= w.start]
            r = a.result
            why = None
            if a.answered - a.sent > self.answer_bound_s:
                why = f"answered after {a.answered - a.sent:.1f} s"
            elif r["status"] != 200:
                why = f"status {r['status']}: {str(r['error'])[:200]}"
            elif a.finish == "abort":
                reason = r["meta"]["finish_reason"]
                causes = [w.fault for w in over if w.fault in ABORTING or a.rid in w.rids]
                names = [n for c in causes for n in ABORT_NAMES[c]]
                if not causes:
                    why = f"abort answer outside any aborting fault: {reason}"
                elif reason.get("status_code") is not None:
                    why = f"abort answer with an error status: {reason}"
                elif not any(n in str(reason.get("message")) for n in names):
                    why = f"abort answer naming none of {causes}: {reason}"
            elif a.finish == "length":
                if len(r["output_ids"]) != self.max_new_tokens:
                    why = f"length finish with {len(r['output_ids'])} tokens"
                elif r["output_ids"] != self.reference[a.prompt]:
                    if any(w.fault == "retract_pause" for w in over):
                        rep.diverged_after_retract += 1
                    else:
                        why = "output differs from the reference"
            elif a.finish != "stop":
                why = f"finish {a.finish}"
            if why:
                rep.wrong.append((a.rid, [w.fault for w in over], why))


def schedule(rounds: int, seed: int = 0) -> List[str]:
    """Every fault `rounds` times, in a seeded random order."""
    faults = list(FAULTS) * rounds
    random.Random(seed).shuffle(faults)
    return faults


if __name__ == "__main__":  # a longer soak on a fresh deployment (mini LB or the Rust gateway)
    import argparse
    import json

    from testing.pd_cluster import PDCluster
    from testing.tiny_model import ensure_tiny_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--balancer", choices=("mini", "router"), default="mini")
    args = ap.parse_args()
    cluster = PDCluster(str(ensure_tiny_model(".cache/tiny-llama")), balancer=args.balancer)
    cluster.start()
    try:
        soak = Soak(cluster, clients=args.clients, seed=args.seed)
        report = soak.run(schedule(args.rounds, args.seed))
        out = {"summary": report.summary(), "wrong": report.wrong,
               "diverged_after_retract": report.diverged_after_retract}
        if cluster.gateway is not None:  # none of the faults may cost an engine a failure
            out["gateway_failures"] = cluster.gateway.failures()
            out["gateway_circuit_opens"] = cluster.gateway.circuit_opens()
        print(json.dumps(out, indent=1))
        raise SystemExit(1 if report.wrong or any(out.get("gateway_failures", {}).values()) else 0)
    finally:
        cluster.teardown()
