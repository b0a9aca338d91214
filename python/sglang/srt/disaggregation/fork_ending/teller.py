"""The teller: tells prefill's bootstrap thread of a room that ended before that side's scheduler saw it.

Invariant: a tell never blocks its caller (the tokenizer's event loop, the scheduler thread), and a target (a prefill
bootstrap address, chosen by the request's client) costs only its own tells: each target with tells pending has one
daemon thread sending them in turn (`ForkRoomLedgerTeller-<addr>`, gone once its tells are), every call to it ends
within a deadline, and what it answers is read up to a cap. The tables (`_targets`, `_endpoints`, the counts) are
guarded by `Teller._lock` (a leaf: no call, no send under it); each cap drops a tell with a warning. Best effort:
prefill's deadline remains the fallback. Callers: `room_telling.ended_at_gate` and
`room_kv_hooks.after_ensure_abort_notified`."""

from __future__ import annotations

import collections
import itertools
import json
import logging
import socket
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from sglang.srt.disaggregation.fork_ending.verdict import told_for
from sglang.srt.disaggregation.fork_ending.verdict_rows import Told
from sglang.srt.managers.fork_core.bounded import Cap, entry

logger = logging.getLogger(__name__)

# A prefill-side end sent to prefill's own bootstrap thread: [ABORT_TAG, room, mark, reason, CAUSE_FRAME, cause,
# message]. A manager without our ABORT wrapper parses it as upstream's ABORT with a bad return address (logged) and
# only fails the room.
ENDED_ON_PREFILL = b"~fork-ended-on-prefill"
# What the fork's frames tell the peer of why a room ended: [CAUSE_FRAME, the verdict.Cause's name, its message],
# appended to the fork's own frames and to decode's ABORT (room_frames.abort_frames). A receiver reads it as a field
# (`told_in`); one of an older build ignores what follows its own frames.
CAUSE_FRAME = b"fork-cause"

# The tables' caps, each with its reason (the resource report shows them: `Teller.tables`).
MAX_QUEUED = Cap(4096, "one tell is a room number and a short reason; more pending is a flood of rooms ended at a "
                       "gate while prefill cannot be reached, which prefill's deadline ends anyway")
MAX_TARGETS = Cap(64, "one thread each; a deployment has a handful of prefill servers, and the address is the "
                      "client's to choose: without a cap a client naming many silent hosts would start a thread each")
MAX_CACHED_ENDPOINTS = Cap(256, "one /route lookup per prefill, not per tell, for far more prefills than a "
                                "deployment has (least recently used dropped)")
# Other limits, each with its reason:
# One HTTP call to a target, all of it (connect, request, every read of the answer): a bootstrap server on the
# local network answers /route in milliseconds; a silent or trickling target is given up at this bound.
ROUTE_TIMEOUT_S = 2.0
# A whole lookup of a target's ranks (one call, then one per rank).
LOOKUP_TIMEOUT_S = 10.0
# A target whose host does not accept the connect (a partition between the two servers: nothing answers, nothing
# refuses) may come back with the rooms it holds: its tells are tried again, every RETRY_PAUSE_S, for this long
# after the first such try, so that a link that heals within it still ends those rooms on prefill (its leg
# answered as decode's abort, not at its own deadline). A target that refuses (a dead process: its rooms are gone)
# or accepts and does not answer is given up at once, as before. Longer than a heartbeat-detected partition
# usually lasts in tests, far shorter than a transfer deadline.
SILENT_RETRY_S = 30.0
RETRY_PAUSE_S = 1.0
# A /route answer is a JSON object of a few hundred bytes; a longer one is not a prefill bootstrap server's.
MAX_ROUTE_BYTES = 64 * 1024
# Ranks of one prefill server (dp x cp x tp x pp), each one /route call: far above any deployment.
MAX_RANKS = 1024


def told_frames(told: Told) -> List[bytes]:
    return [CAUSE_FRAME, *told.frames()]


def told_in(frames: Sequence[bytes], start: int = 0) -> Optional[Told]:
    """The Told a message's frames carry after `CAUSE_FRAME` (at or after `start`), or None: a peer that sends none
    (an older fork build, stock upstream) is read from its reason's text."""
    frames = list(frames)
    if CAUSE_FRAME not in frames[start:]:
        return None
    at = frames.index(CAUSE_FRAME, start)
    return Told.from_frames(frames[at + 1:at + 3])


Tell = Tuple[int, str, Optional[str], Optional[Told]]  # (room, why, prefill's reason or None, its cause)


class ConnectTimeout(TimeoutError):
    """The target's host did not accept the connect in time (silent: a partition), as opposed to a refused connect or
    a target that accepts and does not answer."""


class Teller:
    """One per process: each target's pending tells and the thread sending them; the targets' cached rank
    endpoints; how many tells were dropped. All under `_lock` (a leaf)."""

    def __init__(self):
        self._lock = threading.Lock()
        # prefill bootstrap address -> its pending tells; present while its thread runs (the thread removes it)
        self._targets: Dict[str, Deque[Tell]] = {}
        self._queued = 0
        self._endpoints: "collections.OrderedDict[str, List[dict]]" = collections.OrderedDict()
        self.dropped = 0  # a counter: tells dropped by a cap or given up with their target
        # decode's peer monitor (`watch_lost`): whether a prefill bootstrap address is declared lost now
        self.lost: Optional[Callable[[str], bool]] = None

    def watch_lost(self, lost: Callable[[str], bool]) -> None:
        """decode_side_monitor, when its monitor starts: `lost(addr)` says whether that prefill is declared lost. A
        tell to a lost prefill is never sent on a socket from before its loss: its ranks are looked up afresh and
        each told on a socket of its own (`send_to_ranks`' `fresh`)."""
        self.lost = lost

    def tell(self, host: Optional[str], port: Optional[int], room: Optional[int], why: str,
             reason: Optional[str] = None, told: Optional[Told] = None) -> None:
        """Queue the tell that `room` ended before that side's scheduler saw it: `reason` None: decode's ABORT for
        it (its frames as decode's other ABORTs: room_frames.abort_frames); else prefill's own end of it, `told` its
        cause (answered at decode's handshake)."""
        if host is None or port is None or room is None:
            return
        addr = f"{host}:{port}"
        start = False
        with self._lock:
            pending = self._targets.get(addr)
            full = self._queued >= MAX_QUEUED or (pending is None and len(self._targets) >= MAX_TARGETS)
            if full:
                self.dropped += 1
            else:
                start = pending is None
                if start:
                    pending = self._targets[addr] = collections.deque()
                pending.append((int(room), why, reason, told))
                self._queued += 1
            queued, targets = self._queued, len(self._targets)
        if full:
            logger.warning("room_ledger: cannot tell prefill %s that room %s ended (%d tells pending to %d targets)",
                           addr, room, queued, targets)
        elif start:
            threading.Thread(target=self._run, args=(addr,), name=f"ForkRoomLedgerTeller-{addr}", daemon=True).start()

    def _run(self, addr: str) -> None:
        """The target's thread: its tells in turn; gone (with its entry) once none is pending. A tell that fails
        gives up the target's other pending tells too (each would wait out the same deadline)."""
        from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification

        silent_since: Optional[float] = None  # the first silent connect of the tells now pending
        while True:
            with self._lock:
                pending = self._targets[addr]
                if not pending:
                    del self._targets[addr]
                    return
                room, why, reason, told = pending.popleft()
                self._queued -= 1
                endpoints = self._endpoints.get(addr)
                if endpoints is not None:
                    self._endpoints.move_to_end(addr)
            lost = self.lost is not None and self.lost(addr)
            try:
                if endpoints is None or lost:  # a lost target is looked up afresh: a refused lookup gives it up
                    endpoints = rank_endpoints(addr)
                    with self._lock:
                        self._endpoints[addr] = endpoints
                        while len(self._endpoints) > MAX_CACHED_ENDPOINTS:
                            self._endpoints.popitem(last=False)
                # one message, the same to every prefill rank (they agree on its cause)
                message = (AbortNotification(room=room).to_zmq() if reason is None
                           else [ABORT_TAG, str(room).encode("ascii"), ENDED_ON_PREFILL, reason.encode("utf-8"),
                                 *told_frames(told or told_for(why))])
                send_to_ranks(endpoints, message, fresh=lost)
                logger.info("room_ledger: told prefill %s that room %s ended on %s (%s)",
                            addr, room, "decode" if reason is None else "prefill", why)
                silent_since = None
            except ConnectTimeout as e:  # silent, or not back yet: tried again while it may heal (SILENT_RETRY_S)
                now = time.monotonic()
                if silent_since is None:
                    silent_since = now
                    logger.warning("room_ledger: prefill %s cannot be told now (%r); its tells are tried again for "
                                   "%gs", addr, e, SILENT_RETRY_S)
                with self._lock:
                    self._endpoints.pop(addr, None)
                    if now - silent_since < SILENT_RETRY_S:
                        pending.appendleft((room, why, reason, told))
                        self._queued += 1
                        retry = True
                    else:
                        given_up = len(pending) + 1
                        self._queued -= len(pending)
                        pending.clear()
                        self.dropped += given_up
                        retry = False
                if retry:
                    time.sleep(RETRY_PAUSE_S)
                else:
                    logger.warning("room_ledger: could not tell prefill %s that room %s ended: silent for %gs "
                                   "(%d tells to it given up)", addr, room, SILENT_RETRY_S, given_up)
            except Exception as e:  # best effort: prefill's deadline remains the fallback
                with self._lock:
                    self._endpoints.pop(addr, None)
                    given_up = len(pending)
                    pending.clear()
                    self._queued -= given_up
                    self.dropped += given_up
                logger.warning("room_ledger: could not tell prefill %s that room %s ended: %r%s", addr, room, e,
                               f" ({given_up} more tells to it given up)" if given_up else "")

    def tables(self) -> Dict[str, Dict[str, Any]]:
        """The resource report's view (pd_resource_report `fork_tables`): each table's size, cap and why the cap;
        `per_peer`: one entry per live peer may stay while idle; `counter`: a count, not a table."""
        with self._lock:
            return {
                "teller_targets": entry(len(self._targets), MAX_TARGETS, "prefill targets with tells pending"),
                "teller_queued": entry(self._queued, MAX_QUEUED, "tells pending in all; prefill's deadline ends a "
                                                                 "room whose tell is dropped"),
                "teller_endpoints": entry(len(self._endpoints), MAX_CACHED_ENDPOINTS,
                                          "prefill targets whose rank endpoints are kept", per_peer=True),
                "teller_dropped": entry(self.dropped, None, "tells dropped by a cap or given up with their target",
                                        counter=True),
            }

    def report(self) -> Dict[str, int]:
        """{table: size} of `tables`, without the prefix."""
        return {name.removeprefix("teller_"): t["size"] for name, t in self.tables().items()}


# How long a socket made for one tell (`send_to_ranks`' `fresh`) keeps trying to deliver it after it is closed.
FRESH_LINGER_MS = 5000


def send_to_ranks(endpoints: List[dict], message: List[bytes], fresh: bool = False) -> None:
    """`message` to each rank's bootstrap socket (upstream's cached one), never blocking: a rank whose socket's
    queue is full (a peer not there) fails the tell instead of holding the target's thread. `fresh`: on a socket of
    its own per rank, connected now and closed at once (it delivers within FRESH_LINGER_MS): a prefill declared lost
    may have a cached socket connected before the cut, where a message would wait behind the cut's retransmissions."""
    import zmq

    from sglang.srt.disaggregation.common.conn import CommonKVReceiver
    from sglang.srt.utils.network import NetworkAddress

    if fresh:
        for info in endpoints:
            sock = zmq.Context.instance().socket(zmq.PUSH)
            try:
                sock.connect(NetworkAddress(info["rank_ip"], info["rank_port"]).to_tcp())
                sock.send_multipart(message, flags=zmq.NOBLOCK)
            finally:
                sock.close(linger=FRESH_LINGER_MS)
        return
    for info in endpoints:
        sock, lock = CommonKVReceiver._connect_to_bootstrap_server(info)
        with lock:
            sock.send_multipart(message, flags=zmq.NOBLOCK)


def get_json(addr: str, path: str, timeout_s: float = ROUTE_TIMEOUT_S) -> Any:
    """GET http://`addr``path` and its JSON answer: the whole exchange within `timeout_s`, at most MAX_ROUTE_BYTES
    read (a library client's timeout bounds each read, so a trickling answer would hold it without end, and it reads
    an answer whole). Raises on anything but a 200 with a complete JSON body of a declared length or up to close."""
    deadline = time.monotonic() + timeout_s
    host, _, port = addr.rpartition(":")

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no complete answer from {addr}{path} within {timeout_s}s")
        return remaining

    data, length, body_at = bytearray(), None, None
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=left())
    except TimeoutError as e:
        raise ConnectTimeout(f"{addr} did not accept a connect within {timeout_s}s") from e
    with sock:
        sock.settimeout(left())
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: application/json\r\n"
                     f"Connection: close\r\n\r\n".encode("ascii"))
        while length is None or len(data) - body_at < length:
            sock.settimeout(left())
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_ROUTE_BYTES:
                raise ValueError(f"answer from {addr}{path} longer than {MAX_ROUTE_BYTES} bytes")
            if body_at is None and b"\r\n\r\n" in data:
                body_at = data.index(b"\r\n\r\n") + 4
                status, headers = _head(bytes(data[:body_at]))
                if status != 200:
                    raise ValueError(f"{addr}{path} answered {status}")
                if "chunked" in headers.get("transfer-encoding", ""):
                    raise ValueError(f"{addr}{path} answered in chunks")
                length = int(headers["content-length"]) if "content-length" in headers else None
                if length is not None and length > MAX_ROUTE_BYTES:
                    raise ValueError(f"answer from {addr}{path} of {length} bytes")
    if body_at is None or (length is not None and len(data) - body_at < length):
        raise ValueError(f"incomplete answer from {addr}{path}")
    return json.loads(bytes(data[body_at:] if length is None else data[body_at:body_at + length]))


def _head(head: bytes) -> Tuple[int, Dict[str, str]]:
    """(status, lower-cased headers) of an HTTP answer's head."""
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers


def rank_endpoints(addr: str) -> List[dict]:
    """Every prefill rank's {rank_ip, rank_port} from its bootstrap server's /route: each call within `get_json`'s
    bounds, the whole lookup within LOOKUP_TIMEOUT_S, at most MAX_RANKS ranks."""
    deadline = time.monotonic() + LOOKUP_TIMEOUT_S

    def route(dp: int, cp: int, tp: int, pp: int) -> dict:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{addr}'s ranks not looked up within {LOOKUP_TIMEOUT_S}s")
        answer = get_json(addr, f"/route?prefill_dp_rank={dp}&prefill_cp_rank={cp}&target_tp_rank={tp}"
                                f"&target_pp_rank={pp}", min(ROUTE_TIMEOUT_S, left))
        if not isinstance(answer, dict):
            raise ValueError(f"{addr}/route answered a {type(answer).__name__}, not an object")
        return answer

    info = route(-1, -1, -1, -1)
    sizes = [int(info.get(k) or 1) for k in ("dp_size", "attn_cp_size", "attn_tp_size", "pp_size")]
    total = 1
    for n in sizes:
        total *= n
    if min(sizes) < 1 or total > MAX_RANKS:
        raise ValueError(f"{addr}/route names {sizes} (dp, cp, tp, pp) ranks: none, or more than {MAX_RANKS}")
    ranks = {}
    for dp, cp, tp, pp in itertools.product(*(range(n) for n in sizes)):
        rank = route(dp, cp, tp, pp)
        ranks.setdefault((str(rank["rank_ip"]), int(rank["rank_port"])), rank)
    return list(ranks.values())


teller = Teller()
tell_prefill = teller.tell
