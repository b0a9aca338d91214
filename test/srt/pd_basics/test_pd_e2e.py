"""1P1D through the mini load balancer serves exactly what a plain server serves, and
gives every resource back.

The shared default 1P1D and control server (conftest.pd_deployment, handed on to
other modules: nothing here kills or reconfigures them); each test starts by checking
the deployment is idle rather than restarting it.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import psutil
import pytest

from testing.pd_checks import PD_ROLES, assert_idle, held
from testing.pd_cluster import (
    MiniLB,
    generate,
    generate_concurrently,
    http_get,
    http_post_json,
    metric_sum,
    prompts,
    wait_until,
)

pytestmark = pytest.mark.e2e

N_REQUESTS = 20
MAX_NEW_TOKENS = 32
# Generous for a 2-core machine (measured: ~2-12 s for the whole burst).
BURST_DEADLINE_S = 90.0
FORK_PLUGIN = Path(__file__).resolve().parents[3] / "python/sglang/srt/managers/fork_core/fork_plugin.py"
REPORT_HOOK = (
    "sglang.srt.managers.scheduler_components.internal_state."
    "SchedulerInternalStateController.get_internal_state"
)
COUNTED = "sglang:num_requests_total"
FAILURE_COUNTERS = (
    "sglang:num_aborted_requests_total",
    "sglang:num_bootstrap_failed_reqs_total",
    "sglang:num_transfer_failed_reqs_total",
)


def _counters(cluster) -> dict:
    out = {}
    for role in PD_ROLES:
        metrics = cluster.metrics(role)
        for name in (COUNTED, *FAILURE_COUNTERS):
            out[(role, name)] = metric_sum(metrics, name)
    return out


def _hook_targets_in_repo() -> set:
    """Targets listed in the repo's fork_plugin.HOOKS (the file run on its own: its module level
    imports no sglang, which would cost the test process ~10 s). The servers report the HOOKS of
    the installed build; comparing the two also catches a stale install."""
    spec = importlib.util.spec_from_file_location("fork_plugin_tables", FORK_PLUGIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {target for target, _, _ in module.HOOKS}


def test_hooks_applied_on_every_server(pd_cluster, single_server):
    expected = _hook_targets_in_repo()
    assert REPORT_HOOK in expected
    for deployment, role in ((pd_cluster, "prefill"), (pd_cluster, "decode"), (single_server, "single")):
        applied = deployment.resources(role)["hooks_applied"]
        assert set(applied) == expected, role
        assert all(applied.values()), (role, applied)


def test_burst_through_lb_matches_single_server_and_releases_everything(pd_cluster, single_server):
    baseline = assert_idle(pd_cluster, PD_ROLES)
    assert_idle(single_server, ("single",))
    counters_before = _counters(pd_cluster)
    texts = prompts(N_REQUESTS)

    t0 = time.monotonic()
    via_lb = generate_concurrently(pd_cluster.url, texts, max_new_tokens=MAX_NEW_TOKENS)
    burst_s = time.monotonic() - t0
    reference = generate_concurrently(single_server.url, texts, max_new_tokens=MAX_NEW_TOKENS)

    # What the client saw.
    failed = [(i, r["status"], r["error"]) for i, r in enumerate(via_lb) if r["status"] != 200]
    assert not failed, failed
    assert all(r["status"] == 200 for r in reference), [r["error"] for r in reference]
    for i, (pd, ref) in enumerate(zip(via_lb, reference)):
        assert pd["output_ids"], i
        assert pd["output_ids"] == ref["output_ids"], (i, texts[i], pd["output_ids"], ref["output_ids"])
        assert pd["meta"]["finish_reason"] == ref["meta"]["finish_reason"], i

    # How long it took.
    assert burst_s < BURST_DEADLINE_S, burst_s

    # What is left held: back to the idle baseline on both servers.
    after = assert_idle(pd_cluster, PD_ROLES, baseline=baseline)
    for role in PD_ROLES:
        assert held(after[role]) == held(baseline[role]), role

    # What was counted: each server saw every request once and no failure.
    def counted():
        now = _counters(pd_cluster)
        return all(
            now[(role, COUNTED)] - counters_before[(role, COUNTED)] == N_REQUESTS
            for role in PD_ROLES
        ) and now

    now = wait_until(counted, 30, f"{COUNTED} to grow by {N_REQUESTS} on prefill and decode",
                     on_timeout=lambda: str(_counters(pd_cluster)))
    for role in PD_ROLES:
        for name in FAILURE_COUNTERS:
            assert now[(role, name)] == counters_before[(role, name)], (role, name)


def test_harness_freeze_resume_control_server(single_server):
    """The controls fault-injection tests rely on: freeze/resume on the control server
    (a whole launch_server tree), left healthy on the same port."""
    server = single_server["single"]
    assert_idle(single_server, ("single",))
    pids = server.pids()
    assert len(pids) >= 3, pids  # launch_server + scheduler + detokenizer
    assert sorted(server.freeze()) == sorted(pids)
    try:
        assert all(psutil.Process(p).status() == psutil.STATUS_STOPPED for p in pids)
        with pytest.raises(OSError):  # a frozen server does not answer
            http_get(server.url + "/health", timeout=2)
    finally:
        server.resume()
    server.wait_healthy(timeout=60)
    assert generate(server.url, "hello world", max_new_tokens=4)["status"] == 200
    assert_idle(single_server, ("single",))


def test_harness_kill_restart_load_balancer(pd_cluster, deployments):
    """Kill/restart, on a load balancer (it restarts in seconds, where a server
    restart costs a full startup): gone, then serving again on the same port. A mini
    LB of its own in front of the shared engines, which stay as they were."""
    mini = MiniLB(pd_cluster["prefill"].url, pd_cluster.bootstrap_port, pd_cluster["decode"].url,
                  log_dir=str(pd_cluster.log_dir))
    deployments._start(mini)
    lb = mini["mini_lb"]
    lb_pids, port = lb.pids(), lb.port
    lb.kill()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in lb_pids)
    with pytest.raises(OSError):
        http_get(lb.url + "/health", timeout=2)
    restart_s = lb.restart(timeout=60)
    assert lb.port == port and not set(lb.pids()) & set(lb_pids)
    assert generate(mini.url, "hello world", max_new_tokens=4)["status"] == 200
    assert_idle(pd_cluster, PD_ROLES)
    print(f"load balancer restart: {restart_s:.1f}s")


def test_report_sees_a_request_parked_while_decode_is_frozen(pd_cluster):
    """The idle check above is not vacuous: with decode frozen, a request sits in the
    prefill bootstrap queue with a transfer room, and both go away after resume."""
    baseline = assert_idle(pd_cluster, PD_ROLES)
    decode = pd_cluster["decode"]
    result = {}
    sender = threading.Thread(
        target=lambda: result.update(generate(pd_cluster.url, "hello world", max_new_tokens=8)),
        daemon=True,
    )
    decode.freeze()
    try:
        sender.start()

        def parked():
            now = held(pd_cluster.resources("prefill"))
            return now["queue.prefill_bootstrap"] == 1 and now["rooms.request_status"] == 1

        wait_until(parked, 30, "the request to park in the prefill bootstrap queue",
                   on_timeout=lambda: str(held(pd_cluster.resources("prefill"))))
    finally:
        decode.resume()
    sender.join(timeout=60)
    assert not sender.is_alive(), "request did not finish within 60 s of resume"
    assert result["status"] == 200, result["error"]
    assert_idle(pd_cluster, PD_ROLES, baseline=baseline)


def test_memory_release_and_resume_on_idle_cpu_servers(pd_cluster, single_server):
    """Upstream synchronised CUDA on release and killed a CPU scheduler. Each server,
    idle, goes through pause -> release -> resume -> continue (the fork requires the
    pause, see pd_pause), stays alive and then serves what it served before."""
    baseline = assert_idle(pd_cluster, PD_ROLES)
    text = prompts(1)[0]
    before_pd = generate(pd_cluster.url, text, max_new_tokens=MAX_NEW_TOKENS)
    before_single = generate(single_server.url, text, max_new_tokens=MAX_NEW_TOKENS)
    assert before_pd["status"] == before_single["status"] == 200
    assert_idle(pd_cluster, PD_ROLES, baseline=baseline)
    for deployment, role in ((pd_cluster, "prefill"), (pd_cluster, "decode"), (single_server, "single")):
        server = deployment[role]
        pids = server.pids()
        for call, payload in (("pause_generation", {"mode": "in_place"}),
                              ("release_memory_occupation", {}),
                              ("resume_memory_occupation", {}),
                              ("continue_generation", {})):
            status, body = http_post_json(server.url + "/" + call, payload, timeout=60)
            assert status == 200, (role, call, body)
        assert sorted(server.pids()) == sorted(pids) and http_get(server.url + "/health", timeout=10)[0] == 200, role
    after_pd = generate(pd_cluster.url, text, max_new_tokens=MAX_NEW_TOKENS)
    after_single = generate(single_server.url, text, max_new_tokens=MAX_NEW_TOKENS)
    assert after_pd["status"] == after_single["status"] == 200
    assert after_pd["output_ids"] == before_pd["output_ids"] == before_single["output_ids"]
    assert after_single["output_ids"] == before_single["output_ids"]
    assert_idle(pd_cluster, PD_ROLES, baseline=baseline)
