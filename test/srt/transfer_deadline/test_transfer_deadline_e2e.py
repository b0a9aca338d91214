"""Transfer deadline end to end: real 1P1D servers (mooncake over TCP), deadline 3 s.

The test plays the load balancer for the stuck request (same bootstrap room to both
legs), so it can freeze one server at the stage it wants (decode after its handshake
and before the KV arrives; prefill before or after decode's handshake) and see each
leg's answer. Each case asserts the answer, that it came no earlier than the deadline
and not much later, that nothing is held, the counters (the stage's timeout counter
and the end-cause counter, exactly), and that serving continues. One deployment for
the module; each test starts idle.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time

import psutil
import pytest

from conftest import TP2, TP2_DECODE_TP1, topology_params, topology_pd
from testing.http_client import post_stream
from testing.pd_checks import (
    PD_ROLES,
    Leg,
    assert_idle,
    assert_serves,
    cluster_end_causes,
    delta,
    held,
    leg_body,
    wait_end_causes,
)
from testing.pd_cluster import (
    HOST,
    fork_python,
    free_ports,
    http_post_json,
    metric_sum,
    wait_until,
)

pytestmark = pytest.mark.e2e

DEADLINE = 3.0
ENV = {"SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": str(DEADLINE)}
# "3 s + 2 scheduler ticks", generously: an idle CPU scheduler sleeps up to ~1 s per tick
# with --sleep-on-idle, and the deadline scan runs every deadline/50.
MARGIN = 2.5
COUNTER = "sglang:pd_transfer_timeouts_total"
# The deadline is measured on the server from when the request enters the stage, which
# is after the client sent it: an answer can never come before DEADLINE seconds.
EARLIEST = DEADLINE


@pytest.fixture(scope="module", params=topology_params(TP2, TP2_DECODE_TP1))
def cluster(deployments, request):
    """TP=1 behind the mini LB; TP=2 on both servers, and prefill TP=2 with decode TP=1, behind the Rust
    gateway (the legs go to the servers)."""
    balancer = "router" if request.param.multi_rank else "mini"
    yield from topology_pd(deployments, request.param, prefill_env=ENV, decode_env=ENV, balancer=balancer)


def _leg(cluster, room: int, path: str = "/generate", **body) -> dict:
    payload = {
        "bootstrap_host": HOST,
        "bootstrap_port": cluster.bootstrap_port,
        "bootstrap_room": room,
        **body,
    }
    return payload


def _post(url: str, payload: dict, out: dict, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    status, body = http_post_json(url, payload, timeout=timeout)
    out.update(status=status, body=body, seconds=time.monotonic() - t0)


def _stage_count(metrics: dict, stage: str) -> float:
    return metric_sum(metrics, COUNTER, stage=stage)


def _assert_deadline_504(leg: Leg, stage: str, room: int) -> None:
    """`leg` was answered 504 naming `stage`, its room and the deadline's knob, no earlier than the deadline."""
    assert leg.status == 504, leg.out
    detail = json.dumps(leg.response)
    for part in (stage, f"bootstrap_room={room}", "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT"):
        assert part in detail, (part, detail)
    assert leg.out["seconds"] >= EARLIEST, leg.out["seconds"]


def _generate_body(text: str) -> dict:
    return {"text": text, "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}}


def _serving(cluster, baseline, n: int = 20) -> None:
    # one after another: a 20-request burst on 2 CPU cores can itself outlast 3 s
    assert_serves(cluster.url, n)
    assert_idle(cluster, PD_ROLES, baseline)


# Decode's answer to a leg whose prefill is frozen comes within the deadline plus the
# stage scan interval and a few scheduler ticks. Upstream fetched prefill's info on
# decode's scheduler thread in HTTP calls with a 5 s timeout, so the answer came after
# 5.0 s (prefill known) or ~10 s (first contact) for a 3 s deadline.
FROZEN_PREFILL_MARGIN = 1.5
# A scheduler that is not blocked answers a control request (its resource report)
# within a tick; upstream's blocked scheduler answered after up to 5 s.
TICK_BOUND_S = 2.0
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # upstream's: decode runs the request without a prefill


def _fake_transfer_leg(decode, max_new_tokens: int = 16) -> Leg:
    """A request decode serves on its own (upstream's fake transfer, as /health_generate
    uses): it only completes if decode's scheduler keeps running batches."""
    return Leg(decode.url, {
        "text": "decode keeps serving", "bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": 0,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    })


def test_first_contact_with_frozen_prefill_does_not_block_decode(cluster):
    """Decode has never talked to the prefill, and the prefill is frozen: fetching its
    info (bootstrap server /route) hangs. Decode's scheduler keeps serving meanwhile
    (its resource report answers within a tick, a request it runs on its own completes),
    the leg waiting in decode_prealloc ends with 504 at the deadline, nothing is held,
    and once prefill runs again the fetch completes and serving continues. Runs first
    in the module: the other tests make decode know the prefill."""
    stage = "decode_prealloc"
    baseline = assert_idle(cluster, PD_ROLES)
    prefill, decode = cluster["prefill"], cluster["decode"]
    assert baseline["decode"]["peers"]["prefill_info_table"] == 0, "decode already knows the prefill"
    before = _stage_count(decode.metrics(), stage)
    causes = cluster_end_causes(cluster)
    room = random.randint(1, 2**62)
    prefill.freeze()
    try:
        leg = Leg(decode.url, leg_body(cluster, room, "the quick brown fox " * 40))
        t_stage = time.monotonic()
        leg.start()
        wait_until(lambda: decode.resources()["queues"][stage] == 1, 10, "the leg in decode_prealloc")
        # while the leg waits for prefill's info: decode's scheduler answers at once,
        # and runs another request to completion
        other = _fake_transfer_leg(decode)
        other.start()
        report_s = []
        while not leg.done() and time.monotonic() - t_stage < DEADLINE + 30:
            t0 = time.monotonic()
            decode.resources()
            report_s.append(time.monotonic() - t0)
        assert report_s and max(report_s) <= TICK_BOUND_S, report_s
        assert other.done() and other.status == 200, other.out
        assert other.out["ended"] < leg.out["ended"], (other.out, leg.out)
        assert len(other.response["output_ids"]) == 16, other.response

        _assert_deadline_504(leg, stage, room)
        assert leg.ended_at - t_stage <= DEADLINE + FROZEN_PREFILL_MARGIN, leg.ended_at - t_stage
        assert _stage_count(decode.metrics(), stage) == before + 1
        wait_end_causes(cluster, causes, {("decode", "timeout", stage): 1}, roles=("decode",))
        # the fetch to the frozen prefill times out after the leg ended: nobody collects its outcome, which goes
        # after transfer_deadline.STALE_S (10 s, engine clock); 10 s here raced it
        assert_idle(cluster, ("decode",), baseline, timeout=25)
    finally:
        prefill.resume()
    print(f"504 after {leg.ended_at - t_stage:.2f}s; resource report max {max(report_s):.2f}s "
          f"over {len(report_s)} calls; other request {other.out['seconds']:.2f}s")
    assert_idle(cluster, PD_ROLES, baseline, timeout=30)
    assert delta(causes, cluster_end_causes(cluster)) == {("decode", "timeout", stage): 1}
    _serving(cluster, baseline, n=3)
    assert decode.resources()["peers"]["prefill_info_table"] == 1


def test_frozen_decode_gets_504_releases_and_recovers(cluster):
    baseline = assert_idle(cluster, PD_ROLES)
    prefill, decode = cluster["prefill"], cluster["decode"]
    before = _stage_count(prefill.metrics(), "prefill_inflight")
    causes = cluster_end_causes(cluster)
    room = random.randint(1, 2**62)
    body = _generate_body("the quick brown fox " * 40)

    # decode leg first: it hands prefill its destination pages and waits for the KV
    decode_out: dict = {}
    decode_leg = threading.Thread(
        target=_post, args=(decode.url + "/generate", _leg(cluster, room, **body), decode_out), daemon=True
    )
    decode_leg.start()
    wait_until(lambda: decode.resources()["queues"]["decode_transfer"] == 1, 60, "decode handshake")
    decode.freeze()
    try:
        prefill_out: dict = {}
        _post(prefill.url + "/generate", _leg(cluster, room, **body), prefill_out)

        # the client of the stuck request: 504 naming stage, rid, room and the knob
        assert prefill_out["status"] == 504, prefill_out
        detail = json.dumps(prefill_out["body"])
        for part in ("prefill_inflight", f"bootstrap_room={room}", "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT"):
            assert part in detail, (part, detail)
        assert EARLIEST <= prefill_out["seconds"] <= DEADLINE + MARGIN, prefill_out["seconds"]
        # prefill gave back its KV pages and metadata slot while decode is still frozen
        base = held(baseline["prefill"])

        def prefill_released():
            now = held(prefill.resources())
            return all(now[k] == base[k] for k in ("kv_held", "kv_protected", "req_slots_in_use", "metadata_slots_in_use"))

        wait_until(prefill_released, 10, "prefill to release KV and metadata slots")
        assert _stage_count(prefill.metrics(), "prefill_inflight") == before + 1
    finally:
        decode.resume()
    t_resume = time.monotonic()

    # decode heard of it: its leg ends with 504 too, and it frees the room at once
    decode_leg.join(30)
    assert not decode_leg.is_alive()
    assert decode_out["status"] == 504, decode_out
    assert_idle(cluster, PD_ROLES, baseline, timeout=30)
    freed_after = time.monotonic() - t_resume
    assert freed_after < 10, freed_after
    # prefill's deadline ended it; decode ended it hearing prefill's Failed status
    # (the reason names prefill's stage, so decode counts the same cause)
    wait_end_causes(cluster, causes, {
        ("prefill", "timeout", "prefill_inflight"): 1,
        ("decode", "timeout", "decode_transfer"): 1,
    })
    _serving(cluster, baseline)


def test_504_reaches_every_client_kind(cluster):
    """Prefill legs whose decode never comes: the bootstrap stage expires. /generate
    and /v1/chat/completions answer 504; streams end with an error event carrying 504."""
    baseline = assert_idle(cluster, PD_ROLES)
    prefill = cluster["prefill"]
    before = _stage_count(prefill.metrics(), "prefill_bootstrap")
    causes = cluster_end_causes(cluster)
    chat = {"model": "default", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    cases = {
        "generate": ("/generate", _generate_body("hello world"), False),
        "generate_stream": ("/generate", {**_generate_body("hello world"), "stream": True}, True),
        "chat": ("/v1/chat/completions", chat, False),
        "chat_stream": ("/v1/chat/completions", {**chat, "stream": True}, True),
    }
    out = {}

    def run(name, path, body, stream):
        payload = _leg(cluster, random.randint(1, 2**62), **body)
        t0 = time.monotonic()
        out[name] = (*post_stream(prefill.url + path, payload), time.monotonic() - t0)

    threads = [threading.Thread(target=run, args=(n, *c)) for n, c in cases.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)

    for name, (status, text, seconds) in out.items():
        stream = cases[name][2]
        assert EARLIEST <= seconds <= DEADLINE + MARGIN, (name, seconds)
        assert "prefill_bootstrap" in text, (name, text)
        if stream:
            assert status == 200, (name, status, text)  # headers went out before the error
            events = [l[len("data: "):] for l in text.splitlines() if l.startswith("data: ")]
            assert events[-1] == "[DONE]", (name, text)
            last = json.loads(events[-2])
            if name == "chat_stream":  # OpenAI: an error event
                assert last["error"]["code"] == 504, (name, last)
            else:  # native: the final event's finish_reason is the abort, with its status
                reason = last["meta_info"]["finish_reason"]
                assert (reason["type"], reason["status_code"]) == ("abort", 504), (name, last)
        else:
            assert status == 504, (name, status, text)
    assert len(out) == 4
    assert _stage_count(prefill.metrics(), "prefill_bootstrap") == before + 4
    wait_end_causes(cluster, causes, {("prefill", "timeout", "prefill_bootstrap"): 4})
    assert_idle(cluster, PD_ROLES, baseline)
    _serving(cluster, baseline, n=3)


@pytest.mark.parametrize("frozen", ["before_decode_leg", "after_handshake"])
def test_frozen_prefill_decode_leg_gets_504(cluster, frozen):
    """Prefill frozen before decode's leg arrives (decode knows prefill from earlier
    requests: it preallocates, sends its metadata into the frozen peer's socket, and
    waits), or after decode's handshake was answered. Either way the KV never comes:
    decode's own deadline ends the leg with 504 in decode_transfer while prefill is
    still frozen, and once prefill runs again (and acks the drain) both are idle."""
    stage = "decode_transfer"
    baseline = assert_idle(cluster, PD_ROLES)
    prefill, decode = cluster["prefill"], cluster["decode"]
    # decode knows prefill (its bootstrap info is cached) whatever ran before: on a first
    # contact with a frozen prefill the leg would wait in decode_prealloc instead (the
    # first test)
    _serving(cluster, baseline, n=1)
    before = _stage_count(decode.metrics(), stage)
    causes = cluster_end_causes(cluster)
    room = random.randint(1, 2**62)
    body = leg_body(cluster, room, "the quick brown fox " * 40)
    if frozen == "after_handshake":
        # decode hands prefill its pages (prefill's bootstrap server answers) first
        leg = Leg(decode.url, body)
        leg.start()
        wait_until(lambda: decode.resources()["queues"]["decode_transfer"] == 1, 60, "decode handshake")
        prefill.freeze()
        t_stage = time.monotonic()  # the stage began before this
    else:
        prefill.freeze()
        leg = Leg(decode.url, body)
        t_stage = time.monotonic()
        leg.start()
    try:
        wait_until(leg.done, DEADLINE + MARGIN + 30, "decode's answer")
        _assert_deadline_504(leg, stage, room)
        print(f"{frozen}: 504 after {leg.ended_at - t_stage:.2f}s")
        assert leg.ended_at - t_stage <= DEADLINE + FROZEN_PREFILL_MARGIN, leg.ended_at - t_stage
        assert _stage_count(decode.metrics(), stage) == before + 1
        wait_end_causes(cluster, causes, {("decode", "timeout", stage): 1}, roles=("decode",))
    finally:
        prefill.resume()
    t_resume = time.monotonic()
    # decode keeps the pages until prefill acks that no write into them is running
    # (upstream's deferred release; the ack needs prefill running), then frees them;
    # prefill never had the request (no prefill leg was sent) and holds nothing
    assert_idle(cluster, PD_ROLES, baseline, timeout=30)
    assert time.monotonic() - t_resume < 10, time.monotonic() - t_resume
    assert delta(causes, cluster_end_causes(cluster)) == {("decode", "timeout", stage): 1}
    _serving(cluster, baseline, n=3)


# A bad deadline (or any other knob of the fork) stops the server at start-up: (id, env, args, the knob named,
# what the message says it accepts).
BAD_DEADLINES = [
    ("env-non-numeric", {"SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": "soon"}, [], "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT",
     "seconds > 0"),
    ("env-negative", {"SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": "-5"}, [], "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT",
     "seconds > 0"),
    ("arg-zero", {}, ["--disaggregation-transfer-timeout", "0"], "--disaggregation-transfer-timeout", "seconds > 0"),
    ("handshake-negative", {"SGLANG_FORK_LOST_DECODE_HANDSHAKE_TIMEOUT": "-1"}, [],
     "SGLANG_FORK_LOST_DECODE_HANDSHAKE_TIMEOUT", "seconds >= 0"),
    ("probe-non-numeric", {"SGLANG_FORK_SESSION_PROBE_TIMEOUT": "soon"}, [], "SGLANG_FORK_SESSION_PROBE_TIMEOUT",
     "seconds > 0"),
]


@pytest.fixture(scope="module")
def bad_deadline_starts(tiny_model, tmp_path_factory):
    """Every BAD_DEADLINES server started at once (each one's start-up is mostly
    imports, single-threaded: three at once on two cores take about half the time of
    three in a row), each waited for until it exits: {id: (returncode, output, pid,
    seconds)}. Nothing is timed here but the 180 s within which each must exit, and
    the rest of the module has run: no test runs beside them."""
    procs, logs = {}, tmp_path_factory.mktemp("bad-deadline")
    for case, env, args, _, _ in BAD_DEADLINES:
        port, nccl, bootstrap = free_ports(3)
        argv = [
            fork_python(), "-m", "sglang.launch_server", "--model-path", str(tiny_model),
            "--host", HOST, "--port", str(port), "--nccl-port", str(nccl), "--device", "cpu",
            "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap),
            *args,
        ]
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
        with open(logs / f"{case}.log", "wb") as log:  # a file: no pipe to fill while another is read
            procs[case] = (subprocess.Popen(argv, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True), time.monotonic())
    exited = {}

    def all_exited():
        for case, (proc, t0) in procs.items():
            if case not in exited and proc.poll() is not None:
                exited[case] = time.monotonic() - t0
        return len(exited) == len(procs)

    try:
        wait_until(all_exited, 180, "every server with a bad deadline to exit",
                   on_timeout=lambda: f"still running: {sorted(set(procs) - set(exited))}")
        out = {case: (proc.returncode, (logs / f"{case}.log").read_text(errors="replace"), proc.pid, exited[case])
               for case, (proc, _) in procs.items()}
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return out


@pytest.mark.parametrize("case,named,accepted", [(c[0], c[3], c[4]) for c in BAD_DEADLINES],
                         ids=[c[0] for c in BAD_DEADLINES])
def test_bad_deadline_stops_the_server_at_startup(bad_deadline_starts, case, named, accepted):
    returncode, text, pid, seconds = bad_deadline_starts[case]
    assert returncode != 0, text[-2000:]
    assert named in text and accepted in text, text[-2000:]
    # nothing half-started: no process of its session survives, no port was opened
    assert not [p for p in psutil.process_iter(["pid"]) if _sid(p) == pid]
    assert "Uvicorn running" not in text
    print(f"exited in {seconds:.1f}s")


def _sid(p) -> int:
    try:
        return os.getsid(p.pid)
    except (ProcessLookupError, PermissionError):
        return -1
