"""RL weight-update steps behind the production Rust gateway, over the shared 1P1D.

The partial-rollout loop of RL frameworks (docs/pause-release-resume.md, "Using the fork
from an RL framework"), driven one engine after the other as frameworks do (prefill
first, then decode, or the reverse): `pause_generation {}` (abort, upstream's default)
-> `update_weights_from_disk` (with and without `flush_cache`) -> `continue_generation`,
while closed-loop clients send through the gateway (`sglang_router.launch_router
--pd-disaggregation`, its defaults, engines registered with `POST /workers`). Upstream
answers every call 200 on an engine its abort-mode pause emptied; so must the fork.

The gateway is started in front of the shared default 1P1D (conftest.shared_pd), which
is handed back serving the same checkpoint.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from contextlib import nullcontext

import pytest

from conftest import assert_idle
from testing.pd_checks import ClosedLoop
from testing.pd_cluster import (
    HOST,
    Deployment,
    fork_python,
    free_ports,
    http_get,
    http_post_json,
    wait_until,
    _role_env,
)

pytestmark = pytest.mark.e2e

PD_ROLES = ("prefill", "decode")
CLIENTS = 8
CALL_TIMEOUT_S = 120.0
# An RL client waits on each answer: none may take longer, pause or not (measured: < 3 s).
ANSWER_BOUND_S = 20.0
# Each step: which engine gets each call first, and the update's flush_cache.
STEPS = (("prefill", True), ("decode", True), ("prefill", False), ("decode", False),
         *((("prefill", True), ("decode", True)) * 4))


class Gateway(Deployment):
    """The Rust gateway (role 'gateway', no --mini-lb, its defaults) in front of engines
    that already run, each registered with POST /workers as RL frameworks do."""

    def __init__(self, cluster, *, log_dir=None):
        super().__init__(log_dir)
        self.cluster = cluster
        port, self.prometheus_port = free_ports(2)
        self._add("gateway", [
            fork_python(), "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--host", HOST, "--port", str(port),
            "--prometheus-host", HOST, "--prometheus-port", str(self.prometheus_port),
        ], _role_env(None), port)

    @property
    def url(self) -> str:
        return self.servers["gateway"].url

    def register(self) -> None:
        for role in PD_ROLES:
            payload = {"url": self.cluster[role].url, "worker_type": role}
            if role == "prefill":
                payload["bootstrap_port"] = self.cluster.bootstrap_port
            status, body = http_post_json(self.url + "/workers", payload, timeout=30)
            assert status in (200, 201, 202), (payload, status, body)
        wait_until(lambda: len(self.workers()) == len(PD_ROLES), 60, "the gateway to list both engines")

    def workers(self) -> list:
        status, body = http_get(self.url + "/workers")
        assert status == 200, body
        return json.loads(body)["workers"]

    def failures(self) -> dict:
        from testing.pd_cluster import parse_prometheus

        status, body = http_get(f"http://{HOST}:{self.prometheus_port}/metrics")
        assert status == 200
        metrics = parse_prometheus(body.decode())
        return {role: metrics.get(
            f'smg_worker_cb_outcomes_total{{worker="{self.cluster[role].url}",outcome="failure"}}', 0.0)
            for role in PD_ROLES}


@pytest.fixture(scope="module")
def cluster(shared_pd):
    return shared_pd.deployment


@pytest.fixture(scope="module")
def gateway(cluster):
    gw = Gateway(cluster, log_dir=str(cluster.log_dir))
    try:
        gw.start()
        gw.register()
        yield gw
    finally:
        gw.teardown()


class Preempted:
    """While active, the server's scheduler process runs in short bursts (SIGSTOP /
    SIGCONT: RUN_S running, STOP_S stopped), as a scheduler on a loaded 2-core box is
    preempted, while its HTTP process runs freely. The abort-mode pause's race needs
    the scheduler preempted right after it answered the aborted requests and before its
    loop's next pass; on an idle box the scheduler always wins it. Always continued on exit."""

    RUN_S, STOP_S = 0.0005, 0.01

    def __init__(self, server):
        procs = [p for p in server._tree() if p.name().startswith("sglang::schedul")]
        assert len(procs) == 1, [p.name() for p in server._tree()]
        self.proc = procs[0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.proc.send_signal(signal.SIGSTOP)
            self._stop.wait(self.STOP_S)
            self.proc.send_signal(signal.SIGCONT)
            self._stop.wait(self.RUN_S)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)
        self.proc.send_signal(signal.SIGCONT)


def weight_versions(cluster) -> dict:
    out = {}
    for role in PD_ROLES:
        status, body = http_get(f"{cluster[role].url}/model_info")
        assert status == 200, (role, body)
        out[role] = json.loads(body)["weight_version"]
    return out


def test_abort_pause_update_continue_one_engine_after_the_other(cluster, gateway, tiny_model):
    """Per step, each call on one engine then the other (the order alternates): pause {}
    -> update_weights_from_disk (flush_cache true, then false) -> continue, with 8
    closed-loop clients through the gateway; each pause call meets a scheduler
    preempted as on a loaded box (`Preempted`). Every call is 200 (the update `success`),
    both engines report the step's weight_version, every client answer is a completion
    or upstream's abort answer naming the pause, within the bound; the gateway charges
    no failure to either engine; nothing is held afterwards and serving continues."""
    baseline = assert_idle(cluster, PD_ROLES)
    failures_before = gateway.failures()
    calls, refused = [], []
    t_start = time.monotonic()
    loop = ClosedLoop(gateway.url, CLIENTS, max_new_tokens=16, timeout=CALL_TIMEOUT_S).start()
    try:
        for step, (first, flush) in enumerate(STEPS):
            order = (first, "decode" if first == "prefill" else "prefill")
            done = loop.completed()
            wait_until(lambda: loop.completed() >= done + CLIENTS // 2, 120, f"completions before step {step}")
            version = f"gw-rl-{step}"
            for path, payload in (("pause_generation", {}),
                                  ("update_weights_from_disk", {"model_path": str(tiny_model),
                                                                "weight_version": version,
                                                                "flush_cache": flush}),
                                  ("continue_generation", {})):
                for role in order:
                    t0 = time.monotonic()
                    calls.append((step, role, path, "sent", round(t0 - t_start, 2)))
                    preempted = Preempted(cluster[role]) if path == "pause_generation" else nullcontext()
                    with preempted:
                        status, body = http_post_json(f"{cluster[role].url}/{path}", payload,
                                                      timeout=CALL_TIMEOUT_S)
                    calls.append((step, role, path, status, round(time.monotonic() - t_start, 2)))
                    if status != 200 or (isinstance(body, dict) and body.get("success") is False):
                        # what each server still holds right after the refusal
                        refused.append((step, role, path, status, body,
                                        {r: cluster.resources(r) for r in PD_ROLES}))
            assert not refused, [(s, r, p, st, b, {role: (rep["not_idle"], rep["queues"], rep["transfer_rooms"])
                                                    for role, rep in reports.items()})
                                 for s, r, p, st, b, reports in refused]
            assert weight_versions(cluster) == {r: version for r in PD_ROLES}, step
        done = loop.completed()
        wait_until(lambda: loop.completed() >= done + CLIENTS, 120, "completions after the last step")
    finally:
        loop.stop()
        for role in PD_ROLES:  # never hand the shared deployment back paused
            http_post_json(f"{cluster[role].url}/continue_generation", {}, timeout=CALL_TIMEOUT_S)
    print(f"calls {calls}; answers {dict(loop.summary())}")

    # Every control call answered 200 (the update succeeded, cache flushed when asked):
    # asserted after each step above, with what each server held right after a refusal.
    # What the clients saw: completions and the pause's abort answers, each in time.
    wrong = [(r["status"], r["finish"], round(r["t"] - t_start, 2), (r["meta"] or {}).get("id"),
              str(r["error"] or (r["meta"] or {}).get("finish_reason"))[:200])
             for r in loop.results
             if not (r["status"] == 200 and (r["finish"] == "length" or (
                 r["finish"] == "abort" and r["meta"]["finish_reason"].get("status_code") is None
                 and "pause_generation" in r["meta"]["finish_reason"]["message"])))]
    assert not wrong, wrong
    slow = sorted(round(r["latency"], 1) for r in loop.results if r["latency"] > ANSWER_BOUND_S)
    assert not slow, slow
    assert any(r["finish"] == "abort" for r in loop.results), "no request was in flight at a pause"
    # What was counted: the gateway charged no failure to either engine.
    assert gateway.failures() == failures_before
    # What is left held: nothing; and serving continues (asserted above: completions after).
    assert_idle(cluster, PD_ROLES, baseline=baseline)
