"""No PD request stays in one transfer stage longer than the deadline (504 through the ledger, from BEFORE hooks on
each PD queue's poll), and decode's scheduler never waits on a prefill's bootstrap server (its fetches run on a
pool; scheduler-thread AROUND hooks start them and take their outcomes). docs/transfer-deadline.md.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import types
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.fork_ending import recovery_rule, request_end_cause, request_record, room_ledger
from sglang.srt.disaggregation.fork_ending import verdict
from sglang.srt.disaggregation.fork_ending import verdict_rows, verdict_wording
from sglang.srt.disaggregation.fork_ending.pd_queues import (
    DECODE_PREALLOC, DECODE_TRANSFER, PREFILL_BOOTSTRAP, PREFILL_INFLIGHT, PREFILL_WAITING,
)
from sglang.srt.disaggregation.fork_ending.engine_clock import engine_clock
from sglang.srt.disaggregation.fork_transfer.transfer_deadline_knob import ARG, ENV, configured
from sglang.srt.managers.fork_core import fork_touch
from sglang.srt.managers.fork_core.bounded import Cap, entry
from sglang.srt.managers.fork_core.rank_agreement import answers

logger = logging.getLogger(__name__)

# Per request: its `Stamp` (this module's record) and, once overdue, the verdict's `deadline` (its message).
TAG = verdict_wording.DEADLINE_TAG  # opens every deadline message, the room's failure reason at the peer too
# What prefill tells decode with a room its deadline ended (a field: decode answers 504 without reading TAG); decode's
# own deadline reaches prefill as its receiver's ABORT, whose frames carry the cause prefill answers (the peer's abort).
TOLD = verdict_rows.Told(verdict_rows.Cause.PEER_DEADLINE)
# A queue is scanned at most every deadline/SCAN_DIVISOR s (capped): why in docs/transfer-deadline.md ("Cost").
SCAN_DIVISOR = 50
MAX_SCAN_INTERVAL = 1.0
COUNTS: Counter = Counter()
_next_scan: dict = {}


@dataclass
class Stamp:
    """This module's record on a request (`request_record`; scheduler thread): the stage it was first seen in at a
    scan, and when (engine clock). pd_metrics reads it (`stamp`) for the oldest request of each stage."""

    stage: Optional[Tuple[str, float]] = None


def stamp(req: Any) -> Optional[Tuple[str, float]]:
    """(stage, entered at) of `req` as the deadline stamped it, or None."""
    return request_record.peek(req, Stamp).stage


def _expire(scheduler, stage: str, queue: Sequence[Any], side: str, keep=None) -> None:
    """Stamp `queue`'s entries (Req / DecodeRequest) new to `stage`; end the overdue ones `keep` accepts."""
    now = engine_clock.now()
    if not queue or now < _next_scan.get(stage, float("-inf")) or not answers():  # the common case: one lookup
        return
    deadline = configured()
    _next_scan[stage] = now + min(deadline / SCAN_DIVISOR, MAX_SCAN_INTERVAL)
    for entry in list(queue):
        req = entry if side == "prefill" else entry.req
        record = request_record.of(req, Stamp)
        stamped = record.stage
        if stamped is None or stamped[0] != stage:
            record.stage = (stage, now)
            continue
        if now - stamped[1] <= deadline or verdict.peek(req).deadline is not None:
            continue
        endpoint = req.disagg_kv_sender if side == "prefill" else entry.kv_receiver
        # `keep` only for the overdue ones: upstream's is_aborted costs ~8 µs a request
        if endpoint is None or (keep is not None and not keep(entry)):
            continue
        text = verdict_wording.DEADLINE_MESSAGE.format(rid=req.rid, room=req.bootstrap_room, spent=now - stamped[1],
                                                       stage=stage, deadline=deadline, env=ENV, arg=ARG)
        verdict.of(req).deadline = text
        logger.warning(text)
        if room_ledger.has_room_tables(fork_touch.upstream(endpoint, "kv_mgr")):  # the peer told; prefill: a late handshake fails too
            if side == "prefill":
                room_ledger.end_room(endpoint.kv_mgr, room_ledger.Transition.FAIL_TELL_REMEMBER, req.bootstrap_room,
                                     text, cause=request_end_cause.TIMEOUT, told=TOLD)
            else:  # decode: a recoverable stage's room is handed to recovery (docs/recovery.md)
                transition = (room_ledger.Transition.HAND_TO_RECOVERY if recovery_rule.hands_over(stage)
                              else room_ledger.Transition.FAIL_AND_ABORT)
                room_ledger.end_room(endpoint.kv_mgr, transition, req.bootstrap_room, text,
                                     cause=request_end_cause.TIMEOUT, receiver=endpoint)
            if fork_touch.upstream(endpoint, "conclude_state") == KVPoll.Success:
                # this rank's part is done, another rank's is not (or decode's metadata has not landed): the poll
                # returns the endpoint's cached Success, so fail it here (its record stays the deadline's)
                endpoint.abort()
        else:  # fake transfer: no peer
            endpoint.abort()
        COUNTS[stage] += 1
        request_end_cause.inc("transfer_timeout", request_end_cause.scheduler_labels(scheduler), stage=stage)


def before_pop_bootstrapped(queue, *args, **kwargs):  # BEFORE PrefillBootstrapQueue.pop_bootstrapped
    _expire(queue.scheduler, PREFILL_BOOTSTRAP, queue.queue, "prefill")


def before_resolve_waiting(scheduler, *args, **kwargs):
    """BEFORE SchedulerDisaggregationPrefillMixin.resolve_waiting_queue_bootstrap (PD, not aborted)."""
    from sglang.srt.disaggregation.utils import is_aborted

    _expire(scheduler, PREFILL_WAITING, scheduler.waiting_queue, "prefill", keep=lambda r: not is_aborted(r))


def before_prefill_inflight(scheduler, *args, **kwargs):  # BEFORE process_disagg_prefill_inflight_queue
    _expire(scheduler, PREFILL_INFLIGHT, scheduler.disagg_prefill_inflight_queue, "prefill")


def _not_aborted(entry: Any) -> bool:
    """A decode entry the deadline may still end: not one an abort already ended this pass. The scheduler's abort
    (`room_scheduler_hooks.before_abort_request`, every rank: the AbortReq is broadcast) records it in the verdict
    and upstream's abort concludes the receiver Failed at once; the poll right after this scan ends it as the abort
    (the verdict's `requested` row). Without this the deadline, checked first in the same pass, would end it 504 and
    the client that aborted would get the deadline (and, with recovery on, a re-run)."""
    return not (verdict.peek(entry.req).requested is not None
                and fork_touch.upstream(entry.kv_receiver, "conclude_state") == KVPoll.Failed)


def before_pop_preallocated(queue, *args, **kwargs):  # BEFORE DecodePreallocQueue.pop_preallocated
    _expire(queue.scheduler, DECODE_PREALLOC, queue.queue, "decode", keep=_not_aborted)


def before_pop_transferred(queue, *args, **kwargs):  # BEFORE DecodeTransferQueue.pop_transferred
    _expire(queue.scheduler, DECODE_TRANSFER, queue.queue, "decode", keep=_not_aborted)


def reset_scan_schedule() -> None:
    """Forget when each stage was last scanned (tests that move the clock around)."""
    _next_scan.clear()


# Decode's bootstrap fetches: the scheduler starts them and takes their outcomes, the pool runs them.
ATTR = "fork_bootstrap_fetch"  # the one attribute on a decode kv manager
WORKERS = 4  # fetches in flight at once (one per prefill, or per prefill dp rank)
# An outcome nobody collected by then is dropped: a new request starts a fresh fetch.
STALE_S = 10.0
# Fetches running or outcomes waiting per decode manager, together (more are started at a later pass).
MAX_FETCHES = Cap(1024, "one per prefill address (the client's to choose) and rank route; a deployment has a "
                        "handful of prefills, each a few ranks")

Key = Tuple[Any, ...]  # ("info", addr) or ("routes", addr, prefill_dp_rank)


class Outcome(NamedTuple):
    value: Any  # info: upstream's bool; routes: {(addr, dp, cp, tp, pp): route or None}
    error: Optional[BaseException]
    done_at: float
    info: Any  # routes: the PrefillServerInfo they were fetched for


_local = threading.local()  # .routes: the endpoints served during one _init_receiver; .fetching: a pool thread


class BootstrapFetch:
    """Per decode kv manager: fetches running, their uncollected outcomes, and totals."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running: Dict[Key, float] = {}
        self.outcomes: Dict[Key, Outcome] = {}
        self.totals: Counter = Counter()
        self.pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="ForkBootstrapFetch")

    def start(self, key: Key, job: Callable[[], Any], info: Any = None) -> None:
        """Run `job` on the pool unless a fetch for `key` runs or its outcome waits; none while MAX_FETCHES run or
        wait (the scheduler asks again at its next pass)."""
        with self.lock:
            self.drop_stale()
            if key in self.running or key in self.outcomes:
                return
            if len(self.running) + len(self.outcomes) >= MAX_FETCHES:
                self.totals["refused_full"] += 1
                return
            self.running[key] = engine_clock.now()
            self.totals[f"{key[0]}_started"] += 1
        self.pool.submit(self._run, key, job, info)

    def _run(self, key: Key, job: Callable[[], Any], info: Any) -> None:  # pool thread
        _local.fetching = True
        try:
            value, error = job(), None
        except BaseException as e:  # handed to the scheduler thread, which raises it
            value, error = None, e
        _local.fetching = False
        failed = error is not None or not value
        if failed:
            logger.warning("bootstrap_fetch: %s from prefill %s failed: %r", key[0], key[1], error or value)
        with self.lock:
            self.running.pop(key, None)
            self.outcomes[key] = Outcome(value, error, engine_clock.now(), info)
            if failed:
                self.totals[f"{key[0]}_failed"] += 1

    def drop_stale(self) -> None:
        """Drop the outcomes no one collected within STALE_S (a client's bootstrap address asked once is not asked
        again: its outcome would stay). Caller holds `lock`."""
        now = engine_clock.now()
        for key in [k for k, o in self.outcomes.items() if now - o.done_at > STALE_S]:
            del self.outcomes[key]

    def outcome(self, key: Key, take: bool = False) -> Optional[Outcome]:
        """The outcome waiting for `key` (a stale one is dropped), removed with `take`."""
        with self.lock:
            outcome = self.outcomes.get(key)
            stale = outcome is not None and engine_clock.now() - outcome.done_at > STALE_S
            if stale or take:
                self.outcomes.pop(key, None)
            return None if stale else outcome


def fetch_of(mgr: Any, create: bool = False) -> Optional[BootstrapFetch]:
    """The manager's BootstrapFetch (made by the first hook that needs it); None but on decode."""
    fetch = getattr(mgr, "__dict__", {}).get(ATTR)  # the fork's own attribute
    if fetch is None and create and _decode_manager(mgr):
        fetch = mgr.__dict__.setdefault(ATTR, BootstrapFetch())
    return fetch


def _decode_manager(mgr: Any) -> bool:
    """Whether `mgr` is upstream's decode kv manager (it fetches prefill's info); not prefill's, not the fake one."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return (fork_touch.is_a(mgr, fork_touch.COMMON_MANAGER)
            and fork_touch.upstream(mgr, "disaggregation_mode") == DisaggregationMode.DECODE)


def fetch_tables(mgr: Any) -> Dict[str, Dict[str, Any]]:
    """The resource report's view of the manager's fetches (`fork_tables`; both zero before the first fetch, so
    the report's keys stay the same), stale outcomes dropped first."""
    fetch = fetch_of(mgr)
    with fetch.lock if fetch is not None else contextlib.nullcontext():
        if fetch is not None:
            fetch.drop_stale()
        running, outcomes = (0, 0) if fetch is None else (len(fetch.running), len(fetch.outcomes))
        return {"fetch_running": entry(running, MAX_FETCHES,
                                       "prefill info / endpoint fetches running (one per prefill address)"),
                "fetch_outcomes": entry(outcomes, MAX_FETCHES,
                                        f"fetch outcomes not collected yet, keyed by the client's bootstrap address "
                                        f"(dropped after {STALE_S:g} s, engine clock)")}


def fetch_report(mgr: Any) -> Optional[Dict[str, int]]:
    fetch = fetch_of(mgr)
    if fetch is None:
        return None
    with fetch.lock:
        return {"running": len(fetch.running), "outcomes": len(fetch.outcomes), **fetch.totals}


def _fetch_routes(receiver_cls: type, addr: str, dp: int, info: Any) -> Dict[Key, Optional[dict]]:
    """Every rank endpoint `receiver.init` will ask for, in upstream's order, up to the first
    that fails (as init does). Upstream's getter reads only the receiver's address."""
    get = receiver_cls._get_bootstrap_info_from_server
    peer, routes = types.SimpleNamespace(bootstrap_addr=addr), {}
    for cp in info.target_cp_ranks:
        for tp in info.target_tp_ranks:
            for pp in reversed(info.target_pp_ranks):
                route = routes[(addr, dp, cp, tp, pp)] = get(peer, dp, cp, tp, pp)
                if route is None:
                    return routes
    return routes


def around_ensure_prefill_info(original, queue, addr_to_reqs, *args, **kwargs):
    """AROUND DecodePreallocQueue._ensure_prefill_info: fetch unknown prefills' info on the pool; record the real
    reason (a lost peer, 502) before upstream's last attempt fails the requests as "Aborted by AbortReq.". With
    recovery on and another prefill serving this decode, a fetch that fails for a prefill decode's peer monitor has
    declared lost is that last attempt: its requests end now (502 naming it), so decode's recovery re-runs them on
    the other prefill instead of their waiting for upstream's retries or the deadline. Without another prefill
    they wait as before (the link may heal within the deadline, as upstream's retries allow)."""
    mgr = queue.kv_manager
    fetch = fetch_of(mgr, create=True)
    if fetch is None:
        return original(queue, addr_to_reqs, *args, **kwargs)
    table = fork_touch.upstream(mgr, "prefill_info_table")
    last_attempt = fork_touch.upstream(queue, "_ensure_last_attempt_time")
    interval = fork_touch.upstream(queue, "_ensure_retry_interval")
    counts = fork_touch.upstream(queue, "_ensure_retry_count")
    last = fork_touch.upstream(queue, "_max_ensure_retries")
    ledger = room_ledger.ledger_of(mgr)
    declared_lost = None if ledger is None else ledger.peer_lost  # decode's peer monitor (watch_peers)
    now = time.monotonic()
    asked, waiting = {}, []
    for addr, reqs in addr_to_reqs.items():
        outcome = None if addr in table else fetch.outcome(("info", addr))
        if addr not in table and outcome is None:
            if now - last_attempt.get(addr, float("-inf")) >= interval:  # upstream's fetch, with its hooks
                fetch.start(("info", addr), lambda addr=addr: mgr.try_ensure_parallel_info(addr))
            waiting.extend(reqs)
            continue
        asked[addr] = reqs
        n = counts.get(addr, 0) + 1
        if outcome is None or (outcome.error is None and outcome.value):
            continue
        lost = declared_lost is not None and declared_lost(addr) and _another_prefill(mgr, addr, declared_lost)
        if n < last and not lost:
            continue
        if lost:
            counts[addr] = last - 1  # upstream's attempt below is its last: it fails the requests
            why = "declared lost by decode's peer monitor, and its parallel info could not be fetched"
        else:
            why = f"could not fetch its parallel info after {n} attempts"
        reason = f"{verdict_wording.PEER_LOST_TAG}: prefill bootstrap server {addr} unreachable: {why}"
        for decode_req in reqs:
            if decode_req.kv_receiver is not None:  # recorded only: upstream's last attempt fails it
                room_ledger.end_room(mgr, room_ledger.Transition.RECORD_FOR_UPSTREAM, decode_req.req.bootstrap_room,
                                     reason)
    ready, remaining = original(queue, asked, *args, **kwargs)  # upstream's: ({}, []) for no addrs
    return ready, remaining + waiting


def _another_prefill(mgr: Any, addr: str, declared_lost: Callable[[str], bool]) -> bool:
    """Whether decode's recovery may re-run a request bound to `addr` elsewhere: recovery on, and another prefill's
    info fetched and that prefill not declared lost (decode's tokenizer then picks the one it saw serve)."""
    if not recovery_rule.enabled():
        return False
    with fork_touch.upstream(mgr, "connection_lock"):
        others = [a for a in fork_touch.upstream(mgr, "prefill_info_table") if a != addr]
    return any(not declared_lost(a) for a in others)


def around_try_ensure_parallel_info(original, mgr, bootstrap_addr, *args, **kwargs):
    """AROUND CommonKVManager.try_ensure_parallel_info: the scheduler takes a fetched outcome."""
    fetch = None if getattr(_local, "fetching", False) else fetch_of(mgr)  # a pool thread fetches
    outcome = None if fetch is None else fetch.outcome(("info", bootstrap_addr), take=True)
    if outcome is None:
        return original(mgr, bootstrap_addr, *args, **kwargs)
    if outcome.error is not None:
        raise outcome.error
    # the info may have been dropped since (upstream's heartbeat lost the prefill)
    return bool(outcome.value) and bootstrap_addr in mgr.prefill_info_table


def around_init_receiver(original, queue, decode_req, prefill_dp_rank, *args, **kwargs):
    """AROUND DecodePreallocQueue._init_receiver: wait (pending) for rank endpoints fetched here."""
    mgr = queue.kv_manager
    fetch = fetch_of(mgr, create=True)
    receiver = decode_req.kv_receiver
    addr = None if fetch is None else fork_touch.upstream(receiver, "bootstrap_addr")  # fetch: upstream's receiver
    info = None if fetch is None else fork_touch.upstream(mgr, "prefill_info_table").get(addr)
    if info is None or fork_touch.upstream(receiver, "conclude_state") is not None:  # failed: init returns
        return original(queue, decode_req, prefill_dp_rank, *args, **kwargs)
    # upstream's pool has this prefill dp rank's endpoints (keys of `_setup_bootstrap_infos`)
    pool = fork_touch.upstream(mgr, "connection_pool")
    with fork_touch.upstream(mgr, "connection_lock"):
        connected = all(f"{addr}_{prefill_dp_rank}_{cp}_{info.target_tp_rank}" in pool for cp in info.target_cp_ranks)
    if connected:
        return original(queue, decode_req, prefill_dp_rank, *args, **kwargs)
    key = ("routes", addr, prefill_dp_rank)
    outcome = fetch.outcome(key, take=True)
    if outcome is None or outcome.info is not info:  # none yet, or for a prefill since replaced
        fetch.start(key, lambda: _fetch_routes(type(receiver), addr, prefill_dp_rank, info), info)
        queue.pending_reqs.append(decode_req)
        return None
    if outcome.error is not None:
        logger.warning("bootstrap_fetch: endpoints of prefill %s: %r; upstream fetches them", addr, outcome.error)
    _local.routes = outcome.value  # None after an error
    try:
        return original(queue, decode_req, prefill_dp_rank, *args, **kwargs)
    finally:
        _local.routes = None


def around_get_bootstrap_info_from_server(original, receiver, prefill_dp_rank, prefill_cp_rank,
                                          target_tp_rank, target_pp_rank, *args, **kwargs):
    """AROUND CommonKVReceiver._get_bootstrap_info_from_server: the endpoint fetched on the pool."""
    routes = getattr(_local, "routes", None) or {}
    key = (receiver.bootstrap_addr, prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank)
    if key in routes:
        return None if routes[key] is None else dict(routes[key])
    return original(receiver, prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank,
                    *args, **kwargs)
