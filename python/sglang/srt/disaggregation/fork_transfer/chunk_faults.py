"""The test-only chunk fault switch, `SGLANG_TEST_DISAGG_FAIL_CHUNKS` (docs/chunk-failures.md): a matching room's
first write of a kind reports -1 once (or, `+delay=S`, holds its transfer worker S seconds); `@R` aims an entry at
attention TP rank R alone; `+first` fires a `rid=` entry only on a request's first attempt (not on a recovery
attempt's room, `recovery_attempt.is_first_attempt`). Parsed once per prefill kv manager (`chunk_failures.on_prefill_manager_init`, kept as
`fork_chunk_faults` on it), bound to rooms by rid (`chunk_failures.on_prefill_add`, the scheduler thread), taken by
`chunk_failures.checked` (transfer workers).

Threads: the scheduler (`bind`), transfer workers (`take`). Lock: `FaultPlan._lock` (a leaf) over its room -> rid
map and the faults fired. Invariant: each entry fires at most once per room; unset, no plan exists (no cost).
Imports only `fork_ending.recovery_attempt` (the rid naming of recovery attempts)."""

from __future__ import annotations

import re
import threading
from typing import Dict, List, NamedTuple, Optional, Set, Tuple

from sglang.srt.disaggregation.fork_ending import recovery_attempt


class _Fault(NamedTuple):
    kind: str  # kv | aux | state
    rid: Optional[str]  # a rid prefix, or None
    room: Optional[int]  # a room number, or None
    mark_failed_first: bool  # the room is Failed locally before the write reports
    delay: float = 0.0  # > 0: the write succeeds, its transfer worker reports it this many seconds late
    rank: Optional[int] = None  # only on this attention TP rank (None: every rank)
    first_only: bool = False  # `+first`: only a request's first attempt (no recovery attempt's rid, recovery_attempt)


_FAULT = re.compile(r"(kv|aux|state)(\+failed|\+delay=(\d+(?:\.\d*)?))?(\+first)?(?:@(\d+))?:(?:rid=(.+)|room=(\d+))")


class FaultPlan:
    """`SGLANG_TEST_DISAGG_FAIL_CHUNKS`: a matching room's first write of a kind reports -1 once (or, `+delay=S`,
    holds its transfer worker S seconds); `@R` aims an entry at attention TP rank R alone. A `rid=` entry fires once
    per room, so on a recovery attempt's new room too; with `+first` it fires only on the request's first attempt
    (a rid that is no recovery attempt's, `recovery_attempt.is_first_attempt`)."""

    def __init__(self, faults: List[_Fault]):
        self.faults = faults
        self._rids: Dict[int, str] = {}  # room -> rid, for rooms a rid selector matches
        self._fired: Set[Tuple[int, int]] = set()  # (fault index, room)
        self._lock = threading.Lock()

    @classmethod
    def parse(cls, spec: str, rank: Optional[int] = None) -> Optional["FaultPlan"]:
        """The entries of `spec` for attention TP rank `rank` (None: every entry); None if there are none."""
        faults = []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            match = _FAULT.fullmatch(item)
            if match is None:
                raise ValueError(f"SGLANG_TEST_DISAGG_FAIL_CHUNKS: bad entry {item!r}; expected "
                                 "kind[+failed|+delay=S][+first][@RANK]:rid=PREFIX or ...:room=N, kind in kv/aux/state")
            kind, option, delay, first, on_rank, rid, room = match.groups()
            if first and rid is None:
                raise ValueError(f"SGLANG_TEST_DISAGG_FAIL_CHUNKS: bad entry {item!r}; +first needs rid=PREFIX "
                                 "(a room number is never a request's second attempt)")
            fault = _Fault(kind, rid, None if room is None else int(room), option == "+failed",
                           float(delay or 0.0), None if on_rank is None else int(on_rank), bool(first))
            if rank is None or fault.rank is None or fault.rank == rank:
                faults.append(fault)
        return cls(faults) if faults else None

    def bind(self, rid: str, room: int) -> None:
        if isinstance(rid, str) and any(f.rid is not None and rid.startswith(f.rid) for f in self.faults):
            with self._lock:
                self._rids[room] = rid

    def take(self, room: int, kind: str) -> Optional[_Fault]:
        with self._lock:
            rid = self._rids.get(room)
            for i, f in enumerate(self.faults):
                hit = f.room == room if f.rid is None else rid is not None and rid.startswith(f.rid) and (
                    not f.first_only or recovery_attempt.is_first_attempt(rid))
                if f.kind == kind and hit and (i, room) not in self._fired:
                    self._fired.add((i, room))
                    return f
        return None
