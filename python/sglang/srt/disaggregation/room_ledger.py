"""The room ledger: one record per PD room a kv manager holds for the fork, one lock.

Invariant: an end the fork decides reaches every party that holds the room, whatever
its state: a room decode aborted and parked for prefill's drain ack is settled when
that prefill is declared lost (nobody will ack; no write of it can still land), and a
request decode ends before its scheduler created the room (tokenizer pause gate,
client abort at the tokenizer, a room whose prefill info was never fetched) still
tells prefill, which then ends its copy at once (`cancelled_rooms`).
Who calls: the hook `on_manager_init` (AFTER each PD queue's `_init_kv_manager`)
creates it as `mgr.fork_room_ledger`; peer_liveness notes drains and settles a lost
peer; pd_pause_gate and the decode receiver's abort call `tell_prefill`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Dict, List, Optional, Tuple

logger = logging.getLogger(__name__)

ATTR = "fork_room_ledger"
MAX_RECORDS = 65536


@dataclass
class Drain:
    """A room decode failed/aborted, held until prefill acks its drain."""

    peer: str  # prefill bootstrap address
    generation: int
    ranks: int  # acks upstream waits for


class RoomLedger:
    """Per kv manager. Threads: the scheduler notes drains; the peer monitor (or
    upstream's heartbeat thread) settles a lost peer. One lock guards `drains`;
    upstream is never called while it is held."""

    def __init__(self, mgr: Any):
        self.mgr = mgr
        self.lock = threading.Lock()
        self.drains: "OrderedDict[int, Drain]" = OrderedDict()

    # -- drains (decode)

    def note_drain(self, room: int, peer: str, generation: int, ranks: int) -> None:
        tracker = self.mgr._deferred_abort_ack_tracker
        with self.lock:
            self.drains.pop(room, None)
            self.drains[room] = Drain(peer, generation, ranks)
            # forget rooms upstream released meanwhile (`clear_deferred_abort_state`)
            while self.drains:
                old, drain = next(iter(self.drains.items()))
                state = tracker.get(old)
                if len(self.drains) <= MAX_RECORDS and state is not None and state.generation == drain.generation:
                    break
                self.drains.popitem(last=False)

    def settle_peer(self, peer: str) -> List[int]:
        """Ack, on behalf of the lost `peer`, every drain it still owes; returns the rooms."""
        with self.lock:
            owed = [(room, d) for room, d in self.drains.items() if d.peer == peer]
            for room, _ in owed:
                del self.drains[room]
        settled = []
        for room, drain in owed:
            for i in range(max(drain.ranks, 1)):
                self.mgr.note_abort_ack(room, -1 - i, drain.generation)  # ranks no live prefill uses
            settled.append(room)
        if settled:
            logger.info("room_ledger: prefill peer %s lost; drains of %d rooms acked on its behalf", peer, len(settled))
        return settled

    def report(self) -> Dict[str, int]:
        with self.lock:
            return {"drains": len(self.drains)}


def on_manager_init(mgr: Any, queue_: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `PrefillBootstrapQueue/DecodePreallocQueue._init_kv_manager` (result: the
    manager): the one place a ledger is created."""
    if mgr is not None and ATTR not in getattr(mgr, "__dict__", {}):
        mgr.__dict__[ATTR] = RoomLedger(mgr)
    return None


def ledger_of(mgr: Any) -> Optional[RoomLedger]:
    return getattr(mgr, "__dict__", {}).get(ATTR)


# ----------------------------------------------------------------------------- the verdict

# Per request, set by the module that decided its end (read only here).
PAUSE_ABORT = "_fork_pause_abort"  # pd_pause: the pause/release message
REQUESTED_ABORT = "fork_abort_verdict"  # abort_retirement: (message, status) the AbortReq asked for
DEADLINE_EXPIRED = "fork_transfer_deadline_message"  # transfer_deadline: its message

# What the client is answered when a PD request ends on a failure path, first match
# wins. Each row: (cause, HTTP status or None for "the one the row carries"), why:
#  - deadline (504): the request outlived its transfer deadline; whatever failed
#    meanwhile is a consequence of waiting too long.
#  - pause (upstream's abort answer: 200, finish_reason "abort", the pause/release
#    message): pause/release ended it, as upstream answers a request its pause
#    aborted; RL clients recycle exactly that as a partial rollout. The transfer
#    failure it caused is not the client's problem.
#  - requested abort (the AbortReq's own): a client abort (200 abort), an SLA abort
#    (503): the failure of its room is the abort's consequence.
#  - peer abort (client abort answer): the peer ended the room because its request was
#    aborted there (a pause or release there: its message, counted "pause").
#  - the failure itself: its message; status 504 / 503 / 502 if the reason names a
#    deadline (504), a lost peer (502) or a release (the abort answer: the peer's
#    reason crossed the wire), else the caller's (500).
# Statuses are HTTPStatus members, never plain ints: upstream's OpenAI streaming path
# treats an abort as an error event only when isinstance(status_code, HTTPStatus); a
# plain 504 there ends the stream as a graceful abort.
VERDICT_TABLE = (
    ("deadline", HTTPStatus.GATEWAY_TIMEOUT),
    ("pause", None),
    ("requested_abort", None),
    ("peer_abort", None),
    ("failure", None),
)
# Reasons that, carried in a message, set the status of the row that kept it.
MESSAGE_STATUS = (("deadline_tag", HTTPStatus.GATEWAY_TIMEOUT), ("release", None))


def _markers():
    from sglang.srt.disaggregation import abort_retirement, peer_liveness, transfer_deadline
    from sglang.srt.managers import pd_pause

    return {
        "deadline_tag": (transfer_deadline.TAG,),
        "release": pd_pause.PAUSE_MARKERS,  # the pause's or a release's message
        "peer_abort": abort_retirement.ABORT_REASONS,
        "peer_lost": (peer_liveness.TAG, peer_liveness.UPSTREAM_PREFILL_LOST),
    }


def verdict(req: Any, error_message: str, status_code: Any) -> Tuple[str, Any]:
    """(message, status) `prepare_abort` reports for `req`, by VERDICT_TABLE."""
    from sglang.srt.disaggregation import abort_retirement, request_end_cause

    text = str(error_message or "")
    markers = _markers()
    found = {
        "deadline": getattr(req, DEADLINE_EXPIRED, None),
        "pause": getattr(req, PAUSE_ABORT, None),
        "requested_abort": getattr(req, REQUESTED_ABORT, None),
        "peer_abort": any(t in text for t in markers["peer_abort"]) or None,
        "failure": True,
    }
    for cause, status in VERDICT_TABLE:
        if found[cause] is None:
            continue
        if cause == "deadline":
            return found[cause], status
        if cause == "pause":
            message, status = found[cause], status
        elif cause == "requested_abort":
            message, status = found[cause]
        elif cause == "peer_abort" and any(t in text for t in markers["release"]):
            # the peer's pause or release ended it: its message (abort_retirement.peer_reason)
            message, status = text.rsplit(abort_retirement.PEER_WHY, 1)[-1], None
        elif cause == "peer_abort":
            request_end_cause.tag_req(req, request_end_cause.CLIENT_ABORT)
            message, status = abort_retirement.CLIENT_ABORT_MESSAGE, None
        else:
            message = error_message
            if any(t in text for t in markers["peer_lost"]):
                status = HTTPStatus.BAD_GATEWAY
            else:
                status = status_code
        for name, by_message in MESSAGE_STATUS:
            if any(t in str(message or "") for t in markers[name]):
                if name == "release":  # counted as the pause's end, not a failure
                    request_end_cause.tag_req(req, request_end_cause.PAUSE)
                return message, by_message
        return message, status
    raise AssertionError("VERDICT_TABLE ends with the failure row")


def prepare_abort_verdict(original, req, error_message, status_code=None, *args, **kwargs):
    """AROUND `disaggregation.utils.prepare_abort`: the one verdict hook."""
    error_message, status_code = verdict(req, error_message, status_code)
    return original(req, error_message, status_code, *args, **kwargs)


# ----------------------------------------------------------------------------- telling prefill


def tell_prefill(host: Optional[str], port: Optional[int], room: Optional[int], why: str) -> bool:
    """Tell the prefill at bootstrap `host:port` that decode ended `room` (never created
    on decode's scheduler, or created before prefill's info was fetched). Returns at
    once; a worker thread fetches prefill's rank endpoints from its bootstrap server
    (cached) and sends upstream's ABORT to each rank, so prefill fails its copy at once
    or, if it has not created it yet, at creation (cancelled_rooms)."""
    if host is None or port is None or room is None:
        return False
    _teller().submit(f"{host}:{port}", int(room), why)
    return True


def ended_at_gate(role: Any, obj: Any, why: str) -> None:
    """A request decode's tokenizer ended before sending it to the scheduler (pause
    gate): its prefill copy must not wait for a handshake that will never come."""
    if str(getattr(role, "value", role)) != "decode":
        return
    rooms = obj.bootstrap_room if isinstance(obj.bootstrap_room, list) else [obj.bootstrap_room]
    hosts = obj.bootstrap_host if isinstance(obj.bootstrap_host, list) else [obj.bootstrap_host] * len(rooms)
    ports = obj.bootstrap_port if isinstance(obj.bootstrap_port, list) else [obj.bootstrap_port] * len(rooms)
    for host, port, room in zip(hosts, ports, rooms):
        tell_prefill(host, port, room, why)


def after_ensure_abort_notified(result: Any, receiver: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER `CommonKVReceiver.ensure_abort_notified` (decode): a room decode ended
    before it knew prefill's rank endpoints (the first request to that prefill) sent no
    ABORT; tell prefill through its bootstrap server instead (once per receiver)."""
    if (
        receiver.abort_notified
        or getattr(receiver, "bootstrap_infos", None) is not None
        or getattr(receiver, "_fork_told_prefill", False)
        or not getattr(receiver, "_owns_bootstrap_room", True)
    ):
        return result
    receiver._fork_told_prefill = True
    host, _, port = str(receiver.bootstrap_addr).rpartition(":")
    tell_prefill(host.strip("[]"), int(port), receiver.bootstrap_room, "ended on decode before prefill's info was fetched")
    return result


class _Teller:
    """One daemon thread per process; a bounded queue (a full one drops, logged)."""

    def __init__(self):
        self.q: "queue.Queue[Tuple[str, int, str]]" = queue.Queue(maxsize=4096)
        self.endpoints: Dict[str, List[dict]] = {}
        self.thread = threading.Thread(target=self._run, name="ForkRoomLedgerTeller", daemon=True)
        self.thread.start()

    def submit(self, addr: str, room: int, why: str) -> None:
        try:
            self.q.put_nowait((addr, room, why))
        except queue.Full:
            logger.warning("room_ledger: cannot tell prefill %s that room %s ended (queue full)", addr, room)

    def _run(self) -> None:
        while True:
            addr, room, why = self.q.get()
            try:
                self._send(addr, room)
                logger.info("room_ledger: told prefill %s that room %s ended on decode (%s)", addr, room, why)
            except Exception as e:  # best effort: prefill's deadline remains the fallback
                self.endpoints.pop(addr, None)
                logger.warning("room_ledger: could not tell prefill %s that room %s ended: %r", addr, room, e)

    def _send(self, addr: str, room: int) -> None:
        from sglang.srt.disaggregation.common.conn import AbortNotification, CommonKVReceiver

        infos = self.endpoints.get(addr)
        if infos is None:
            infos = self.endpoints[addr] = _rank_endpoints(addr)
        message = AbortNotification(room=room).to_zmq()
        for info in infos:
            sock, lock = CommonKVReceiver._connect_to_bootstrap_server(info)
            with lock:
                sock.send_multipart(message)


_teller_lock = threading.Lock()
_teller_instance: Optional[_Teller] = None


def _teller() -> _Teller:
    global _teller_instance
    with _teller_lock:
        if _teller_instance is None:
            _teller_instance = _Teller()
        return _teller_instance


def _rank_endpoints(addr: str) -> List[dict]:
    """Every prefill rank's {rank_ip, rank_port} from its bootstrap server (upstream's
    /route: first the parallel layout, then each rank)."""
    import requests

    layout = requests.get(
        f"http://{addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1",
        timeout=5,
    )
    layout.raise_for_status()
    info = layout.json()
    out, seen = [], set()
    for dp in range(int(info.get("dp_size") or 1)):
        for cp in range(int(info.get("attn_cp_size") or 1)):
            for tp in range(int(info.get("attn_tp_size") or 1)):
                for pp in range(int(info.get("pp_size") or 1)):
                    r = requests.get(
                        f"http://{addr}/route?prefill_dp_rank={dp}&prefill_cp_rank={cp}"
                        f"&target_tp_rank={tp}&target_pp_rank={pp}",
                        timeout=5,
                    )
                    r.raise_for_status()
                    rank = r.json()
                    key = (rank["rank_ip"], rank["rank_port"])
                    if key not in seen:
                        seen.add(key)
                        out.append(rank)
    return out
