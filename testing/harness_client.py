"""What a harness's client saw (`Outputs`: streamed outputs and abort answers) and what
its scheduler counted (`Counters`: the metrics collector's calls)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Tuple



@dataclasses.dataclass(frozen=True)
class Streamed:
    rid: str
    finished: bool
    reason: Optional[Dict[str, Any]]  # finished_reason.to_json()
    output_ids: Tuple[int, ...]
    via: str = "stream"  # "stream" (output streamer) or "abort_req" (send_abort_output)
    room: Optional[int] = None  # the request's bootstrap room (decode: a recovery attempt keeps the rid, not the room)


class Outputs:
    """What the client would receive: `output_streamer.stream_output` calls and the
    `AbortReq`s the scheduler sends to the tokenizer (`send_abort_output`)."""

    def __init__(self) -> None:
        self.items: List[Streamed] = []

    def stream_output(self, reqs, return_logprob=False, *args, **kwargs) -> None:
        for req in reqs:
            reason = req.finished_reason
            self.items.append(
                Streamed(
                    req.rid,
                    req.finished(),
                    None if reason is None else reason.to_json(),
                    tuple(req.output_ids),
                    room=req.bootstrap_room,
                )
            )

    def send_output(self, abort_req, req) -> None:  # ipc_channels.send_to_tokenizer
        reason = dict(abort_req.finished_reason or {"type": "abort", "status_code": None})
        self.items.append(Streamed(req.rid, True, reason, tuple(req.output_ids), "abort_req",
                                   req.bootstrap_room))

    def of(self, rid: str) -> List[Streamed]:
        return [s for s in self.items if s.rid == rid]

    def final(self, rid: str) -> Optional[Streamed]:
        done = [s for s in self.of(rid) if s.finished]
        return done[-1] if done else None

    def status_code(self, rid: str) -> Optional[int]:
        """Status an abort carries (None if it carries none); 200 for a normal finish;
        None while unfinished."""
        final = self.final(rid)
        return None if final is None else reason_status(final.reason)


def reason_status(reason: Optional[dict]) -> Optional[int]:
    """The status a final finish reason answers with: 200 for a normal finish, the status an abort carries, None for
    an abort that carries none (upstream's client abort)."""
    if reason and reason.get("type") == "abort":
        code = reason.get("status_code")
        return None if code is None else int(code)
    return 200


class Counters:
    """A metrics collector that counts every call by method name (`increment_*` by the
    amount passed, if any)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("_"):
            raise AttributeError(name)

        def record(*args, **kwargs) -> None:
            self.counts[name] += args[0] if args and isinstance(args[0], int) else 1

        return record

