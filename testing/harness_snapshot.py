"""What a harness holds at one instant (`Snapshot`), compared with an idle baseline."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Tuple



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

    def held(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("kv_evictable")
        d["queues"] = dict(self.queues)
        return d

    def diff(self, other: "Snapshot") -> Dict[str, Tuple[Any, Any]]:
        a, b = self.held(), other.held()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}


