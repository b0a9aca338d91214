"""The one attribute the fork sets on a request (`ATTR`: upstream's Req, decode's DecodeRequest.req, the tokenizer's
ReqState): a record per owner, each owner's a dataclass of its own module (the verdict's `verdict.ReqState`,
transfer_deadline's stage stamp, the lost-handshake rule's wait, the pause gate's marks, request_end_cause's count),
so each per-request fact lives with the module that writes and reads it and no module reads another's.

`of(req, Kind)` makes the owner's record at its first write; `peek(req, Kind)` reads it without adding state (a
shared empty one when there is none: never write to what `peek` returns). On the thread that holds the request
(scheduler thread; the tokenizer's event loop for its request states); no lock. A leaf: imports no fork module."""

from __future__ import annotations

from typing import Any, Dict, Type, TypeVar

ATTR = "fork_state"
T = TypeVar("T")
_EMPTY: Dict[type, Any] = {}  # Kind -> its empty record, for `peek`


def of(req: Any, kind: Type[T]) -> T:
    """`req`'s record of `kind`, made at first use."""
    records = req.__dict__.get(ATTR)
    if records is None:
        records = req.__dict__[ATTR] = {}
    record = records.get(kind)
    if record is None:
        record = records[kind] = kind()
    return record


def peek(req: Any, kind: Type[T]) -> T:
    """`req`'s record of `kind`, or an empty one (not stored): for reads that must not add state to a request."""
    records = getattr(req, "__dict__", {}).get(ATTR)
    record = records.get(kind) if records else None
    if record is None:
        record = _EMPTY.get(kind)
        if record is None:
            record = _EMPTY[kind] = kind()
    return record
