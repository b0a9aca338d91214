"""The fork's frames on the wire between prefill and decode (docs/layout.md, "How a room ends"): decode's ABORT with
the pause's message and the cause (`abort_frames`, read back by `split_abort`), and prefill's cause message sent
right before a Failed status (`PEER_CAUSE`, `cause_frames` / `parsed_cause`). Pure functions over frames: any thread,
no lock, no state. Invariant: the fork's frames follow upstream's, so a peer of an older build or stock upstream
reads upstream's frames as they are."""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple

from sglang.srt.disaggregation.fork_ending.teller import CAUSE_FRAME, told_frames, told_in
from sglang.srt.disaggregation.fork_ending.verdict import told_for
from sglang.srt.disaggregation.fork_ending.verdict_rows import Told

logger = logging.getLogger(__name__)

# Decode appends [WHY_FRAME, message] to the ABORT of a room its pause or a release ended (read by older fork builds),
# then its cause (teller.CAUSE_FRAME, to every ABORT: `abort_frames`); prefill strips them before upstream's handler.
WHY_FRAME = b"fork-why"
# Prefill tells decode a room's cause as a message of its own, right before the Failed status (upstream's frame, left
# as it is) on the same socket: [PEER_CAUSE, room, prefill rank, cause name, message] (`RoomLedger.tell_cause`). A decode of
# an older build or stock upstream drops it as an unparsable status (mooncake logs a warning; nixl/mori: a tag mismatch).
PEER_CAUSE = b"~fork-cause"
FORK_FRAMES = (WHY_FRAME, CAUSE_FRAME)


def cause_frames(room: int, rank: int, told: Told) -> List[bytes]:
    """Prefill's `PEER_CAUSE` message: `told` for its rank `rank`'s next Failed status of `room`."""
    return [PEER_CAUSE, str(room).encode("ascii"), str(rank).encode("ascii"), *told.frames()]


def parsed_cause(msg: List[bytes]) -> Optional[Tuple[Optional[int], int, Optional[Told]]]:
    """(room, prefill rank, the cause) of a `PEER_CAUSE` message, None for any other message (upstream's); room None
    for a malformed one (logged, dropped)."""
    if not (msg and msg[0] == PEER_CAUSE and len(msg) >= 5):
        return None
    try:
        room, rank = int(msg[1].decode("ascii")), int(msg[2].decode("ascii"))
    except ValueError:
        logger.warning("room_ledger: dropping a malformed cause message %r", msg[:3])
        return None, -1, None
    return room, rank, Told.from_frames(msg[3:5])


def abort_frames(frames: List[bytes], why: Optional[str]) -> List[bytes]:
    """Decode's ABORT (upstream's frames) with what the fork tells prefill: the pause's message `why` (WHY_FRAME, as
    older fork builds read it) and the cause (teller.CAUSE_FRAME: `told_for(why)`), the same to every prefill rank.
    Stock upstream prefill parses only its first five frames (room, return address, generation): an ABORT that has
    all five is handled as if nothing followed; one without a generation or return address has a frame of ours read
    as one, logs upstream's "Malformed ABORT message" warning and is handled as a room-only ABORT."""
    extra = [WHY_FRAME, why.encode("utf-8")] if why else []
    return list(frames) + extra + told_frames(told_for(why))


def split_abort(msg: List[bytes]) -> Tuple[List[bytes], Optional[str], Optional[Told]]:
    """(upstream's frames, the why, the cause) of decode's ABORT: the fork's frames follow upstream's (from the first
    of `FORK_FRAMES` on); a peer that sends none (older fork build: no cause; stock upstream: neither) gives None."""
    at = next((i for i, frame in enumerate(msg) if i >= 2 and frame in FORK_FRAMES), len(msg))
    ours = msg[at:]
    why = None
    if WHY_FRAME in ours:
        i = ours.index(WHY_FRAME)
        why = b"".join(ours[i + 1:i + 2]).decode("utf-8", "replace") or None
    return msg[:at], why, told_in(ours)
