"""What a harness holds at one instant (`Snapshot`), compared with an idle baseline."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional, Tuple


def fork_tables_held(tables: Optional[Mapping[str, Any]]) -> Dict[str, int]:
    """The fork's tables (a resource report's `fork_tables`) that are empty when idle: all but the per-peer ones
    (back to baseline for live peers), the memories (kept by design until they expire) and the counters."""
    return {f"fork.{name}": t["size"] for name, t in (tables or {}).items()
            if not (t.get("per_peer") or t.get("memory") or t.get("counter"))}


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Everything a request can hold, at one instant. `kv_evictable` is cache content,
    not a hold, so `held()` leaves it out."""

    kv_held: int  # KV tokens neither free nor evictable cache
    kv_evictable: int
    req_slots_held: int
    metadata_held: int
    queues: Tuple[Tuple[str, int], ...]
    rooms: Tuple[int, ...]  # rooms the transfer manager still tracks
    # the kv manager's per-room tables (pd_resource_report.room_tables: failure records, transfer infos, ...), sizes
    room_tables: Tuple[Tuple[str, int], ...] = ()
    # the fork's per-room tables that are empty when idle (pd_resource_report.fork_tables, `fork_tables_held`)
    fork: Tuple[Tuple[str, int], ...] = ()

    def held(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("kv_evictable")
        d["queues"] = dict(self.queues)
        d["fork"] = dict(self.fork)
        d["room_tables"] = dict(self.room_tables)
        return d

    def diff(self, other: "Snapshot") -> Dict[str, Tuple[Any, Any]]:
        a, b = self.held(), other.held()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}


