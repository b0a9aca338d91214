"""A prefill KV write that waits for completion sleeping between checks, not spinning.

Why: upstream's sender (`MooncakeKVManager._transfer_data`, and the head-sliced send) writes through
`MooncakeTransferEngine.batch_transfer_sync`, which calls mooncake's `batch_transfer_sync_write`: it submits one batch
and polls its status on the calling thread, without a pause, until the batch completes. A prefill server runs one
such sender per transfer worker and rank; on a few cores the spinners take the cores the receiving side needs to
finish the very write they wait for (two of them held ~95% of both cores of the test machine for seconds, stalling
decode), and on loopback they hold KV transfer to about half of what mooncake moves when the waiting thread sleeps
(docs/peer-liveness.md, "Transfer speed").

What: the same write, submitted one transfer per block (mooncake's `transfer_submit_write`) and waited for with
`transfer_check_status` and a sleep of `SGLANG_FORK_KV_WRITE_POLL` seconds between checks (default 0.0005; 0 keeps
upstream's synchronous write; validated at start with every knob). Checks go in submission order and stop at the
first block still running, so a round costs one check plus one per block that finished. The first sleeps of a write
are shorter: an eighth of the poll, doubling up to the poll (62, 125, 250 µs, then 0.5 ms by default), so a write that
ends within a fraction of a poll (a request's metadata: a few small blocks, done in about 0.1 ms) is not held a whole
poll; a long write costs three checks more.

Invariant (upstream's contract, unchanged): 0 once every block completed; -1 as soon as a block failed or timed out,
or when the wall-clock bound passed (mooncake's own: `MC_TRANSFER_TIMEOUT` seconds, at least 5, default 30, plus one
nanosecond a byte), with the other blocks possibly still running (as upstream's -1 leaves its batch running: the
fork's `_poison_unsettled_send` and chunk_failures take it from there); any exception from mooncake is -1; the same
debug line on a failure. Where a block cannot be submitted, the blocks left go through upstream's synchronous write,
which answers -1 for a bad segment and drops it from mooncake's cache as before; but where the failed submit waited on
the peer (its segment could not be opened: a handshake that timed out), -1 at once, as upstream's write answers after
that same wait (asking upstream's write would wait for a second handshake). Mismatched or empty lists, a knob of 0
and a mooncake without the per-block calls take upstream's write unchanged. mooncake's TCP transport timeouts still
end a stuck block (it reports FAILED). Transfers left running by a failed write are checked again (never waited for)
at the start of the next write on the same engine, so the ones that end are freed.

Called by: upstream's send path on prefill's transfer worker threads (and their executors), through the instance
swap of the kv manager's engine's `batch_transfer_sync` (fork_plugin.SWAPS), made by the AFTER hook on
`PrefillBootstrapQueue._init_kv_manager` (`on_prefill_manager_init`). Thread-safe: a write owns its blocks; the
leftovers list has its own lock.

Upstream: worth proposing to mooncake (a sleeping wait in `batch_transfer_sync_write`, or a non-blocking batch status
in its Python binding) and to sglang (this wait in `MooncakeTransferEngine.batch_transfer_sync`).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import Any, Callable, List, Optional

from sglang.srt.managers.fork_core import fork_touch, knobs

logger = logging.getLogger(__name__)

MOONCAKE_ENGINE = "sglang.srt.distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine"

# What `transfer_submit_write` returns when nothing was submitted (0; -1 as an unsigned batch id in some releases)
_NOT_SUBMITTED = (0, -1, (1 << 64) - 1)
# A submit that failed after this long waited on the peer: mooncake opens a session's segment (a handshake with the
# peer) on its first write, and an open that fails takes its handshake timeout (about 60 s with a frozen peer).
# Upstream's write would open (and wait) again: the write answers -1 at once instead.
SLOW_SUBMIT_S = 1.0
_DONE, _RUNNING = 1, 0  # `transfer_check_status`: 1 completed (freed), 0 running, -1 failed (freed), -2 timed out


def mooncake_timeout_s(environ: Optional[dict] = None) -> float:
    """The base of mooncake's wall-clock bound of a synchronous write, as its Python engine reads it at construction:
    `MC_TRANSFER_TIMEOUT` (C atoi: leading digits, else 0) but at least 5 s; 30 s when unset."""
    value = (os.environ if environ is None else environ).get("MC_TRANSFER_TIMEOUT")
    if value is None:
        return 30.0
    match = re.match(r"\s*([+-]?\d+)", value)
    return float(max(5, int(match.group(1)) if match else 0))


class PacedWrite:
    """The swapped `batch_transfer_sync` of one `MooncakeTransferEngine` (see the module docstring)."""

    def __init__(self, wrapper: Any, original: Callable[..., int], poll: float, timeout_s: float):
        self.original = original  # upstream's bound method: the synchronous write
        self.poll = poll
        self.timeout_s = timeout_s
        raw = fork_touch.upstream(wrapper, "engine")  # mooncake.engine.TransferEngine
        self._submit = getattr(raw, "transfer_submit_write", None)
        self._check = getattr(raw, "transfer_check_status", None)
        self._leftover_lock = threading.Lock()
        self._leftovers: List[int] = []  # batch ids of blocks a failed write left running

    @property
    def paced(self) -> bool:
        return self.poll > 0 and self._submit is not None and self._check is not None

    def __call__(self, session_id: str, buffers: List[int], peer_buffer_addresses: List[int],
                 lengths: List[int]) -> int:
        if not self.paced or not buffers or not len(buffers) == len(peer_buffer_addresses) == len(lengths):
            return self.original(session_id, buffers, peer_buffer_addresses, lengths)
        try:
            self._sweep_leftovers()
            ret, logged = self._write(session_id, buffers, peer_buffer_addresses, lengths)
        except Exception:  # upstream: whatever mooncake raises is a failed write
            ret, logged = -1, False
        if ret < 0 and not logged:  # upstream's line (`logged`: upstream's write already said it)
            logger.debug("Failed to batch transfer data. Buffers: %s, Session: %s, Peer addresses: %s",
                         buffers, session_id, peer_buffer_addresses)
        return ret

    def _write(self, session_id: str, buffers: List[int], peers: List[int], lengths: List[int]) -> tuple:
        """(return code, whether upstream's write answered it)."""
        deadline = time.monotonic() + self.timeout_s + sum(lengths) * 1e-9
        pending: List[int] = []
        for i, (buffer, peer, length) in enumerate(zip(buffers, peers, lengths)):
            submitted = time.monotonic()
            batch_id = self._submit(session_id, buffer, peer, length)
            if batch_id in _NOT_SUBMITTED:
                if time.monotonic() - submitted > SLOW_SUBMIT_S:  # it waited on the peer: opening its segment failed
                    self._leave(pending)
                    return -1, False
                rest = self.original(session_id, buffers[i:], peers[i:], lengths[i:])
                if rest != 0:
                    self._leave(pending)
                    return rest, True
                break
            pending.append(batch_id)
        done, wait = 0, self.poll / 8  # the first waits short, doubling up to the poll (module docstring)
        while done < len(pending):
            status = self._check(pending[done])
            if status == _DONE:
                done += 1
                continue
            if status != _RUNNING or time.monotonic() > deadline:  # failed (freed), timed out, or past the bound
                self._leave(pending[done + (status == -1):])
                return -1, False
            time.sleep(wait)
            wait = min(wait * 2, self.poll)
        return 0, False

    def _leave(self, batch_ids: List[int]) -> None:
        if batch_ids:
            with self._leftover_lock:
                self._leftovers.extend(batch_ids)

    def _sweep_leftovers(self) -> None:
        """One check of each block a failed write left running: the ones that ended are freed by the check and
        forgotten; a timed-out one (mooncake frees it never, as upstream's write leaves its batch) is forgotten."""
        with self._leftover_lock:
            if not self._leftovers:
                return
            left, self._leftovers = self._leftovers, []
        still = [b for b in left if self._check(b) == _RUNNING]
        self._leave(still)

    def leftovers(self) -> int:
        """How many blocks of failed writes are still running (tests)."""
        with self._leftover_lock:
            return len(self._leftovers)


def pace(wrapper: Any, poll: Optional[float] = None) -> Optional[PacedWrite]:
    """Swap `wrapper.batch_transfer_sync` (a MooncakeTransferEngine) for a PacedWrite (SWAPS); None for another
    engine class. `poll` None: the knob."""
    if isinstance(getattr(wrapper, "batch_transfer_sync", None), PacedWrite):  # a second manager on this engine
        return getattr(wrapper, "batch_transfer_sync")
    poll = knobs.KV_WRITE_POLL.get() if poll is None else poll
    timeout_s = mooncake_timeout_s()
    paced = fork_touch.swap(wrapper, "batch_transfer_sync",
                            lambda original: PacedWrite(wrapper, original, poll, timeout_s), by=__name__)
    if paced is not None and poll > 0 and not paced.paced:
        logger.warning("mooncake has no transfer_submit_write/transfer_check_status: KV writes stay synchronous")
    return paced


def on_prefill_manager_init(mgr: Any, queue: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER PrefillBootstrapQueue._init_kv_manager: a mooncake manager's engine writes paced."""
    engine = fork_touch.upstream_on(mgr, "engine", fork_touch.MOONCAKE_MANAGER)
    if engine is not None:
        pace(engine)
