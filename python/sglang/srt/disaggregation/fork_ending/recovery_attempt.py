"""How a recovery attempt's prefill leg is named (docs/recovery.md): the client's rid with `RID_MARK` and the attempt's
number appended, so prefill never sees a rid twice (it refuses a duplicate while it may still hold the first leg), the
logs tie each attempt to its request, and a test fault can tell a first attempt from a re-run
(`SGLANG_TEST_DISAGG_FAIL_CHUNKS`'s `+first`); and which stages' transfer deadlines recovery re-runs
(`DEADLINE_STAGES`, `hands_over`). Pure functions and the knob read, any thread, no lock; imports pd_queues' stage
names and the knobs alone."""

from __future__ import annotations

import re
from typing import Optional, Tuple

from sglang.srt.disaggregation.fork_ending.pd_queues import DECODE_TRANSFER, PREFILL_INFLIGHT
from sglang.srt.managers.fork_core import knobs

# The stages whose transfer deadline is a recoverable cause (docs/recovery.md, "What is recovered"): both sides past
# the handshake, decode waiting for prefill's KV and prefill alive. decode_transfer: decode's own deadline (it cannot
# tell a stalled transfer from a prefill slow to compute; either way a new room on a live prefill can serve it);
# prefill_inflight: prefill's KV sent but not concluded (a stalled transfer), told to decode by prefill, so alive.
# Not: decode_prealloc (decode's own handshake or memory: a decode-side cause), prefill_bootstrap (decode's handshake
# never came), prefill_waiting (prefill itself could not compute it in time: a re-run joins the same queue).
DEADLINE_STAGES = frozenset((DECODE_TRANSFER, PREFILL_INFLIGHT))

RID_MARK = "~recovery-"
_ATTEMPT = re.compile(re.escape(RID_MARK) + r"(\d+)$")


def attempt_rid(rid: str, attempt: int) -> str:
    """The prefill leg's rid of recovery attempt `attempt` (1, 2, ...) of the request `rid`."""
    if attempt < 1:
        raise ValueError(f"recovery attempts count from 1, not {attempt}")
    return f"{first_rid(rid)}{RID_MARK}{attempt}"


def split(rid: str) -> Tuple[str, int]:
    """(the request's own rid, the attempt: 0 for the first, n for recovery attempt n)."""
    match = _ATTEMPT.search(rid)
    if match is None:
        return rid, 0
    return rid[:match.start()], int(match.group(1))


def first_rid(rid: str) -> str:
    return split(rid)[0]


def is_first_attempt(rid: str) -> bool:
    return split(rid)[1] == 0


def recovers_deadline_of(stage: Optional[str]) -> bool:
    """Whether a transfer deadline in `stage` is a recoverable cause (`DEADLINE_STAGES`)."""
    return stage in DEADLINE_STAGES


def hands_over(stage: str) -> bool:
    """Whether decode's own deadline in `stage` ends its room by `hand_to_recovery` (recovery on, a recoverable
    stage) instead of `fail_and_abort`: the room ends the same way (failed, prefill told by the ABORT) and is
    remembered as ended; the request's tokenizer then re-runs it or answers the deadline's 504, as it decides."""
    return recovers_deadline_of(stage) and knobs.RECOVERY_ATTEMPTS.get() > 0
