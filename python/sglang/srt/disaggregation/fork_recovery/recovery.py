"""Recovery instead of failure (docs/recovery.md): decode's tokenizer holds back the end of a request whose transfer
failed on prefill's side (a failed chunk write or a stalled transfer, prefill alive) before its first token, and runs the request again
under a new bootstrap room: the same request re-submitted to decode's scheduler (a fresh scheduler request, the
client's rid kept) past the pause gate, then the prefill leg re-sent to the same prefill (its rid
`recovery_attempt.attempt_rid`). A request whose prefill decode declared lost (a partition between them) is re-run
the same way on another prefill this tokenizer saw serve since (`known_prefills`), or answered as today when none
or when that prefill refuses connections (it died: a balancer's retry serves it). Past the attempts
(`SGLANG_FORK_RECOVERY_ATTEMPTS`), the budget (`SGLANG_FORK_RECOVERY_BUDGET`, from the first failure) or a changed
weight version the failure is answered as without recovery; an abort between attempts is answered as upstream answers
an abort.

Thread: the tokenizer's event loop only (the patched line in `_handle_batch_output`, the re-run task, the abort hook);
each request's recovery is `recovery_life.Attempts` on its ReqState (request_record), moved only along
`recovery_life.TRANSITIONS`; no lock.
Invariant: an end is held back only while nothing of the request reached the client (no output token) and only for
a cause that leaves prefill alive; a held-back request (HELD, in no scheduler) is ended by exactly one of: its
re-submission (its answer then the scheduler's), an abort (answered here), an attempt that cannot start or a changed
weight version (the held-back failure answered here). It reaches decode's scheduler only through the open pause
gate, and its prefill leg is sent only once decode's scheduler has it."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, Callable, Dict, Optional

from sglang.srt.disaggregation.fork_ending import recovery_attempt, recovery_rule, request_end_cause, request_record, verdict
from sglang.srt.disaggregation.fork_ending.verdict_wording import CLIENT_ABORT_MESSAGE
from sglang.srt.disaggregation.fork_peers import peer_monitor
from sglang.srt.disaggregation.fork_recovery import known_prefills, recovery_faults
from sglang.srt.disaggregation.fork_recovery.recovery_life import OUTCOMES, Attempts, Event, Phase
from sglang.srt.managers.fork_core import knobs
from sglang.srt.managers.fork_core.fork_touch import upstream
from sglang.srt.managers.fork_pause import pause_gate
from sglang.srt.managers.fork_pause.engine_pause_state import PAUSE, state_of

logger = logging.getLogger(__name__)

CAUSE_CHUNK = recovery_rule.CAUSE_CHUNK
CAUSE_DEADLINE = recovery_rule.CAUSE_DEADLINE
CAUSE_LOST_PREFILL = recovery_rule.CAUSE_LOST_PREFILL
CAUSES = (CAUSE_CHUNK, CAUSE_DEADLINE, CAUSE_LOST_PREFILL)  # the `cause` label's values
# Asking prefill's bootstrap server for its address, or prefill for its weight version: a live server answers in
# milliseconds; one that does not answer within this (a frozen prefill's kernel accepts the connection and nobody
# answers: a stalled transfer's cause may be that) is treated as unreachable (the failure answered). Upstream's own
# fetches from the bootstrap server wait 5 s too.
ASK_PREFILL_S = 5.0
# ... and a connect to it that is not accepted within the peer monitor's own bound is silent: a prefill host cut off
# from decode (a partition between them) gives up the attempt after this, not after ASK_PREFILL_S (a kernel that
# accepts, as a frozen prefill's does, answers a connect in milliseconds).
ASK_CONNECT_S = peer_monitor.CONNECT_TIMEOUT
# A lost prefill whose host refuses a connect within this has no process behind its bootstrap port: it died, and a
# balancer's own retry serves its requests (the Rust gateway's: its prefill leg failed too), so its failure is
# answered at once, not re-run (docs/recovery.md, "What never is"). A refused connect on a network answers in
# milliseconds; a silent host (a partition) never does, and one that accepts is not dead.
GONE_PROBE_S = 0.25
_TASKS: set = set()  # re-runs in flight (kept referenced until done)
_ZEROED: set = set()  # the tokenizers (id) that exported the counter's series at 0 (before their first count)


def _eligible(tm: Any, obj: Any) -> bool:
    """Requests recovery may re-run: decode's, with its prefill's bootstrap address, of a shape the rule takes
    (`recovery_rule.excluded`: the same rule prefill's verdict reads)."""
    if getattr(tm.server_args, "disaggregation_mode", "null") != "decode":
        return False
    if not obj.bootstrap_host or obj.bootstrap_port is None:
        return False
    return recovery_rule.excluded(recovery_rule.input_shape(obj)) is None


# ----------------------------------------------------------------------------- the counter

def _labels(tm: Any) -> Optional[Dict[str, str]]:
    """The tokenizer's metric labels (upstream's), or None when its metrics are off."""
    return dict(tm.metrics_collector.labels) if getattr(tm, "enable_metrics", False) else None


def _step(tm: Any, record: Attempts, event: Event):
    """Take `event`'s row for `record` and count its outcome (`sglang:pd_request_recoveries_total`)."""
    row = record.move(event)
    if row.outcome is not None:
        request_end_cause.inc("recovery", _labels(tm), cause=record.cause, outcome=row.outcome)
    return row


def _zero(tm: Any) -> None:
    """Export every series of the counter at 0 (once per decode tokenizer, at the first request's end; recovery on
    or off, as the scheduler's counters are exported whatever happens)."""
    _ZEROED.add(id(tm))
    if getattr(tm.server_args, "disaggregation_mode", "null") != "decode":
        return
    for cause in CAUSES:
        for outcome in OUTCOMES:
            request_end_cause.zero("recovery", _labels(tm), cause=cause, outcome=outcome)


# ----------------------------------------------------------------------------- the patched line

def _holds(tm: Any, state: Any, recv_obj: Any, i: int, record: Attempts, reason: Any) -> Optional[str]:
    """The recoverable cause if this end may be held back (`recovery_rule`: a cause it takes, answered with that
    cause's status; an attempt left; within the budget), else None."""
    cause = recovery_rule.cause_of_answer(reason)
    if cause is None or recv_obj.completion_tokens[i] or state.obj is None or not _eligible(tm, state.obj):
        return None
    if cause == CAUSE_LOST_PREFILL:
        lost = known_prefills.address(state.obj)
        known_prefills.of(tm).saw_lost(lost)
        if known_prefills.of(tm).other_than(lost) is None:
            logger.warning("Recovery of %s: its prefill %s is lost and no other prefill served here since; answering "
                           "the failure", state.obj.rid, lost)
            return None
    if not recovery_rule.another_attempt(record.made):
        logger.warning("Recovery of %s: %d attempt(s) made, none left; answering the failure", state.obj.rid,
                       record.made)
        return None
    if record.first_failure is not None and time.monotonic() - record.first_failure >= knobs.RECOVERY_BUDGET.get():
        logger.warning("Recovery of %s: budget spent; answering the failure", state.obj.rid)
        return None
    return cause


def holds_back(tm: Any, state: Any, recv_obj: Any, i: int, meta_info: Dict[str, Any],
               start: Optional[Callable[[Any, Any, int], None]] = None) -> bool:
    """The patched line in `TokenizerManager._handle_batch_output`, for output `i` of `recv_obj` (its `meta_info`
    built): True when this end is held back and the request re-run (the caller skips the output); else annotates
    a recovered request's `meta_info`, counts how its recovery ended, and returns False. `start(tm, state, attempt)`
    starts the attempt (default `_start`: a task on the tokenizer's loop; the lifecycle model passes its own, which
    re-submits to its harnesses)."""
    record = request_record.peek(state, Attempts)
    if record.made:
        meta_info["recovery"] = {"attempts": record.made, "cause": record.cause}
    reason = recv_obj.finished_reasons[i]
    if reason is None:  # not its end: one check
        return False
    if id(tm) not in _ZEROED:
        _zero(tm)
    completed = not isinstance(reason, dict) or reason.get("type") != "abort"
    if completed and state.obj is not None and recovery_rule.enabled():  # its prefill served it through this decode
        known_prefills.of(tm).saw_served(known_prefills.address(state.obj))
    if record.phase is Phase.IDLE and completed:
        return False  # a completion recovery never touched
    if not recovery_rule.enabled():  # off (the default): nothing more is read or decided
        return False
    if record.phase is Phase.ENDED:  # an abort reached it while in a scheduler: this end is the client's
        return False
    cause = _holds(tm, state, recv_obj, i, record, reason)
    if cause is None:
        if record.phase is Phase.RUNNING:  # the re-run's answer is the client's
            aborted = isinstance(reason, dict) and reason.get("type") == "abort"
            _step(tm, record, Event.ABORTED if aborted and reason.get("status_code") is None
                  else Event.FAILED_AGAIN if aborted else Event.COMPLETED)
        return False
    record = request_record.of(state, Attempts)
    if record.first_failure is None:
        record.first_failure, record.cause = time.monotonic(), cause
        record.weight_version = tm.config_value("weight_version")
    record.failure = reason
    _step(tm, record, Event.FAILED)
    (start or _start)(tm, state, record.made)
    logger.warning("Recovery of %s: its transfer failed (%s) before its first token; attempt %d under a new room",
                   state.obj.rid, cause, record.made)
    return True


# ----------------------------------------------------------------------------- answers of a held-back request

def _answer(tm: Any, rid: str, finish_reason: Dict[str, Any]) -> None:
    """Answer a held-back request by upstream's own abort answer path (what the scheduler's abort output does)."""
    from sglang.srt.managers.io_struct import AbortReq

    upstream(tm, "_handle_abort_req")(AbortReq(rid=rid, finished_reason=finish_reason,
                                               abort_message=finish_reason.get("message")))


def _end_held(tm: Any, state: Any, record: Attempts, event: Event, why: str) -> None:
    """End a held-back request by `event` (no attempt runs): the held-back failure answered, as without recovery."""
    if _step(tm, record, event).answers_failure:
        logger.warning("Recovery of %s: %s; answering the failure", state.obj.rid, why)
        _answer(tm, state.obj.rid, record.failure or {})


def after_abort_request(result, tm, rid: str = "", abort_all: bool = False, *args, **kwargs) -> None:
    """AFTER TokenizerManager.abort_request (outermost: after the pause gate's AROUND; an AFTER, so that upstream's
    hook registry sees one AROUND on the target): a request between attempts (HELD, in no scheduler: the abort
    upstream sends reaches nothing) is answered here at once with the answer the scheduler gives an abort (200,
    finish_reason abort): the abort-mode pause's message for its abort_all, else the client's; its re-run stops
    before it re-submits anything. A request the abort reaches in a scheduler (IDLE or RUNNING) is never held back
    after (`Event.ABORTED`: its end, whatever verdict the scheduler gives it, is the client's). Returns None:
    upstream's result stands."""
    if not recovery_rule.enabled():
        return None
    if abort_all:
        reached = list(tm.rid_to_state.items())
    else:
        reached = [(rid, tm.rid_to_state[rid])] if rid in tm.rid_to_state else []
    answered = False
    for r, s in reached:
        if request_record.peek(s, Attempts).phase is Phase.ENDED:
            continue
        if _step(tm, request_record.of(s, Attempts), Event.ABORTED).answers_abort:  # it was HELD
            reason = _abort_reason(tm, abort_all)
            logger.warning("Recovery of %s: aborted between attempts (%s)", r, reason["message"])
            _answer(tm, r, reason)
            answered = True
    if answered and tm.is_pause:  # a re-run waiting at the gate looks again
        asyncio.get_running_loop().create_task(pause_gate.gate_of(tm).set())
    return None


def _abort_reason(tm: Any, abort_all: bool) -> Dict[str, Any]:
    """The answer of an abort that reached a held-back request: the abort-mode pause's message for its abort_all,
    else the client's (200, finish_reason abort, as the scheduler answers an abort)."""
    call = state_of(tm).call
    pausing = abort_all and call is not None and call.op == PAUSE and call.mode == "abort"
    return verdict.pause_finish_reason() if pausing else verdict.pause_finish_reason(CLIENT_ABORT_MESSAGE)


def before_handle_abort_req(tm, recv_obj, *args, **kwargs):
    """BEFORE TokenizerManager._handle_abort_req: a re-run the scheduler ended by an abort output (one still in its
    queues: not a batch output, so not seen by `holds_back`) counts how its recovery ended."""
    state = tm.rid_to_state.get(getattr(recv_obj, "rid", None))
    record = request_record.peek(state, Attempts) if state is not None else None
    if record is None or record.phase is not Phase.RUNNING:
        return
    reason = recv_obj.finished_reason
    failed = isinstance(reason, dict) and reason.get("status_code") is not None
    _step(tm, record, Event.FAILED_AGAIN if failed else Event.ABORTED)


# ----------------------------------------------------------------------------- the re-run (the carrier)

def _start(tm: Any, state: Any, attempt: int) -> None:
    """Attempt `attempt` of `state`'s request as a task on the tokenizer's event loop (kept referenced until done)."""
    task = asyncio.get_running_loop().create_task(_rerun(tm, state, request_record.of(state, Attempts), attempt))
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


async def _test_hold(record: Attempts, rid: str) -> None:
    """The test switch's hold (recovery_faults): wait its seconds, or until the request is no longer held."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + recovery_faults.hold_s(rid)
    while record.phase is Phase.HELD and loop.time() < deadline:
        await asyncio.sleep(0.02)


def _asking_session() -> Any:
    """The HTTP session an attempt asks prefill with (its bootstrap server's `/route`, its weight version): each ask
    bounded by ASK_PREFILL_S, its connect by ASK_CONNECT_S (a silent prefill host: docs/recovery.md, "A partition
    between prefill and decode")."""
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ASK_PREFILL_S, sock_connect=ASK_CONNECT_S))


async def _ask(session: Any, url: str, **params: Any) -> Dict[str, Any]:
    async with session.get(url, params=params or None) as response:
        response.raise_for_status()
        return await response.json()


async def _prefill_url(session: Any, obj: Any) -> str:
    """The prefill's HTTP base URL, from its bootstrap server (as upstream's retract re-send finds it). Asked on each
    attempt (a rare path), not kept: a prefill restarted behind the same bootstrap port may serve on another port."""
    from sglang.srt.utils.network import NetworkAddress

    closed = recovery_faults.route_port(obj.rid)
    host, port = (obj.bootstrap_host, obj.bootstrap_port) if closed is None else ("127.0.0.1", closed)
    route = await _ask(session, NetworkAddress(host, port).to_url() + "/route", prefill_dp_rank=-1,
                       prefill_cp_rank=-1, target_tp_rank=-1, target_pp_rank=-1)
    return NetworkAddress(obj.bootstrap_host, int(route["prefill_http_port"])).to_url()


async def _submit(tm: Any, state: Any, record: Attempts, tokenized: Any, session: Any, url: str) -> bool:
    """Re-submit to decode's scheduler through the pause gate (waiting while paused or released, as a new request
    does), under the weight version of the first failure on both sides; True once the scheduler has it. The gate's
    check and the send are one step under upstream's `is_pause_cond`, which a pause takes to close the gate."""
    states = {state.obj.rid: state}
    cond = tm.is_pause_cond
    while True:
        async with cond:
            await cond.wait_for(lambda: record.phase is not Phase.HELD or pause_gate.gate_open(tm, states))
        if record.phase is not Phase.HELD:
            return False
        prefill_version = (await _ask(session, url + "/get_weight_version"))["weight_version"]
        async with cond:
            if record.phase is not Phase.HELD:
                return False
            if tm.is_pause:  # closed again meanwhile: back to the gate
                continue
            versions = {"decode": tm.config_value("weight_version"), "prefill": prefill_version}
            if any(v != record.weight_version for v in versions.values()):
                _end_held(tm, state, record, Event.WEIGHTS_CHANGED,
                          f"weight version {versions} is not the first failure's {record.weight_version!r}")
                return False
            await upstream(tm, "_send_one_request")(tokenized)
            _step(tm, record, Event.SUBMITTED)
            return True


def _prefill_leg(obj: Any, rid: str) -> Dict[str, Any]:
    leg: Dict[str, Any] = {"sampling_params": obj.sampling_params, "rid": rid, "stream": False,
                           "bootstrap_host": obj.bootstrap_host, "bootstrap_port": obj.bootstrap_port,
                           "bootstrap_room": obj.bootstrap_room}
    leg["input_ids" if obj.text is None else "text"] = obj.input_ids if obj.text is None else obj.text
    return leg


async def _post_leg(session: Any, url: str, leg: Dict[str, Any]) -> None:
    async with session.post(url + "/generate", json=leg) as response:
        if response.status >= 300:
            logger.warning("Recovery: prefill leg %s answered %s: %s", leg["rid"], response.status,
                           (await response.text())[:256])


async def _refuses(addr: Optional[known_prefills.Addr]) -> bool:
    """Whether the host at `addr` refuses a connect within GONE_PROBE_S (a dead process); False for a silent host, one
    that accepts, or an unreachable network."""
    if addr is None:
        return False
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*addr), GONE_PROBE_S)
    except ConnectionRefusedError:
        return True
    except (asyncio.TimeoutError, OSError):
        return False
    writer.close()
    return False


def _move_to_another_prefill(tm: Any, obj: Any) -> bool:
    """For a request whose prefill is lost: point it at the prefill `known_prefills` picks (its bootstrap address;
    the attempt then asks it for its HTTP address as for any attempt). False: none left to pick."""
    lost = known_prefills.address(obj)
    other = known_prefills.of(tm).other_than(lost)
    if other is None:
        return False
    logger.warning("Recovery of %s: prefill %s lost; the attempt runs on prefill %s", obj.rid, lost, other)
    obj.bootstrap_host, obj.bootstrap_port = other
    return True


async def _rerun(tm: Any, state: Any, record: Attempts, attempt: int) -> None:
    """Attempt `attempt` of `state`'s request: a new room (on another prefill when its prefill was lost), the request
    re-submitted to decode's scheduler, then its prefill leg sent. Before the re-submission it stops at any abort; it
    answers the held-back failure when the attempt cannot start (no other prefill for a lost one, prefill's address
    or weight version not found, re-tokenizing fails) or the weight version changed. Once re-submitted, a prefill leg
    that is refused leaves the attempt to decode's own path (its transfer deadline)."""
    import aiohttp

    obj = state.obj
    try:
        await _test_hold(record, obj.rid)
        if record.phase is not Phase.HELD:
            return
        if recovery_rule.cause_of_answer(record.failure) == CAUSE_LOST_PREFILL:
            gone = known_prefills.address(obj)
            if await _refuses(gone):
                _end_held(tm, state, record, Event.NOT_STARTED, f"attempt {attempt}: prefill {gone} refuses "
                          "connections (it died: a balancer's retry serves the request)")
                return
            if not _move_to_another_prefill(tm, obj):
                _end_held(tm, state, record, Event.NOT_STARTED, f"attempt {attempt}: no other prefill served here "
                          "since")
                return
        obj.bootstrap_room = random.randint(0, 2**63 - 1)
        async with _asking_session() as asking:
            url = await _prefill_url(asking, obj)
            tokenized = await upstream(tm, "_tokenize_one_request")(obj)
            if not await _submit(tm, state, record, tokenized, asking, url):
                return
        if state.finished:  # answered since (an abort the scheduler took): no leg for prefill to hold
            return
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:  # as long as prefill
            await _post_leg(session, url, _prefill_leg(obj, recovery_attempt.attempt_rid(obj.rid, attempt)))
    except Exception as e:  # aiohttp's and the tokenizer's errors alike
        if record.phase is Phase.HELD:
            _end_held(tm, state, record, Event.NOT_STARTED, f"attempt {attempt} could not start: {e!r}")
        else:
            logger.error("Recovery of %s: attempt %d's prefill leg: %r", obj.rid, attempt, e)


def after_internal_state(result, tm, *args, **kwargs):
    """AFTER TokenizerControlMixin.get_internal_state (a coroutine function: `result` is its coroutine, handed back
    wrapped; an AFTER, so that upstream's hook registry sees one AROUND on the target): each resource report counts
    the requests held between recovery attempts (`recovery_held`: in no scheduler, so no queue shows them)."""
    return _with_held(result, tm)


async def _with_held(pending, tm):
    states = await pending
    held = sum(1 for s in list(tm.rid_to_state.values()) if request_record.peek(s, Attempts).phase is Phase.HELD)
    for state in states:
        report = state.get("fork_pd_resources") if isinstance(state, dict) else None
        if isinstance(report, dict):
            report["recovery_held"] = held
    return states
