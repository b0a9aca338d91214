"""The teller: tells prefill's bootstrap thread of a room that ended before that side's scheduler saw it.

Invariant: a tell never blocks its caller (the tokenizer's event loop, the scheduler thread): it is queued (at most
4096; a full queue drops the tell, logged) and sent by one daemon thread per process, `ForkRoomLedgerTeller`, which
alone reads and writes the prefill rank endpoints it caches (no lock). Best effort: prefill's deadline remains the
fallback. Callers: `room_ledger.ended_at_gate` and `room_ledger.after_ensure_abort_notified`."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import Dict, List, Optional, Sequence, Tuple

from sglang.srt.disaggregation.fork_ending.verdict import Told, told_for

logger = logging.getLogger(__name__)

# A prefill-side end sent to prefill's own bootstrap thread: [ABORT_TAG, room, mark, reason, CAUSE_FRAME, cause,
# message]. A manager without our ABORT wrapper parses it as upstream's ABORT with a bad return address (logged) and
# only fails the room.
ENDED_ON_PREFILL = b"~fork-ended-on-prefill"
# What the fork's frames tell the peer of why a room ended: [CAUSE_FRAME, the verdict.Cause's name, its message],
# appended to the fork's own frames and to decode's ABORT (room_ledger.abort_frames). A receiver reads it as a field
# (`told_in`); one of an older build ignores what follows its own frames.
CAUSE_FRAME = b"fork-cause"
MAX_QUEUED = 4096


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


class Teller:
    """One per process: the queue of tells and the thread sending them (started at the first tell, under `_lock`);
    `_endpoints` (prefill bootstrap address -> its ranks' endpoints) belongs to the thread alone."""

    def __init__(self):
        self._tells: "queue.Queue[Tuple[str, int, str, Optional[str], Optional[Told]]]" = queue.Queue(maxsize=MAX_QUEUED)
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._endpoints: Dict[str, List[dict]] = {}

    def tell(self, host: Optional[str], port: Optional[int], room: Optional[int], why: str,
             reason: Optional[str] = None, told: Optional[Told] = None) -> None:
        """Queue the tell that `room` ended before that side's scheduler saw it: `reason` None: decode's ABORT for
        it (its frames as decode's other ABORTs: room_ledger.abort_frames); else prefill's own end of it, `told` its
        cause (answered at decode's handshake)."""
        if host is None or port is None or room is None:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ForkRoomLedgerTeller", daemon=True)
                self._thread.start()
        try:
            self._tells.put_nowait((f"{host}:{port}", int(room), why, reason, told))
        except queue.Full:
            logger.warning("room_ledger: cannot tell prefill %s:%s that room %s ended (queue full)", host, port, room)

    def _run(self) -> None:
        from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification, CommonKVReceiver

        while True:
            addr, room, why, reason, told = self._tells.get()
            try:
                if addr not in self._endpoints:
                    self._endpoints[addr] = rank_endpoints(addr)
                # one message, the same to every prefill rank (they agree on its cause)
                message = (AbortNotification(room=room).to_zmq() if reason is None
                           else [ABORT_TAG, str(room).encode("ascii"), ENDED_ON_PREFILL, reason.encode("utf-8"),
                                 *told_frames(told or told_for(why))])
                for info in self._endpoints[addr]:
                    sock, lock = CommonKVReceiver._connect_to_bootstrap_server(info)
                    with lock:
                        sock.send_multipart(message)
                logger.info("room_ledger: told prefill %s that room %s ended on %s (%s)",
                            addr, room, "decode" if reason is None else "prefill", why)
            except Exception as e:  # best effort: prefill's deadline remains the fallback
                self._endpoints.pop(addr, None)
                logger.warning("room_ledger: could not tell prefill %s that room %s ended: %r", addr, room, e)


def rank_endpoints(addr: str) -> List[dict]:
    """Every prefill rank's {rank_ip, rank_port} from its bootstrap server's /route."""
    import requests

    def route(dp: int, cp: int, tp: int, pp: int) -> dict:
        r = requests.get(f"http://{addr}/route?prefill_dp_rank={dp}&prefill_cp_rank={cp}"
                         f"&target_tp_rank={tp}&target_pp_rank={pp}", timeout=5)
        r.raise_for_status()
        return r.json()

    info = route(-1, -1, -1, -1)
    sizes = (int(info.get(k) or 1) for k in ("dp_size", "attn_cp_size", "attn_tp_size", "pp_size"))
    ranks = {}
    for dp, cp, tp, pp in itertools.product(*(range(n) for n in sizes)):
        rank = route(dp, cp, tp, pp)
        ranks.setdefault((rank["rank_ip"], rank["rank_port"]), rank)
    return list(ranks.values())


teller = Teller()
tell_prefill = teller.tell
