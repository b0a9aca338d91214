"""The prefills decode's tokenizer may re-run a request on when the prefill it was bound to is lost (docs/recovery.md,
"A partition between prefill and decode"): each prefill bootstrap address a request of this decode completed
through, with when, and each one a request of it was lost with (decode declared that prefill lost), with when.
A prefill is another place to run a request while it served a request after its last loss, within `FRESH_S`: decode
saw that prefill's KV arrive, so the link between them worked then. Nothing here asks the network: the attempt then
asks the chosen prefill's bootstrap server for its address (bounded as every attempt's ask), and a prefill gone
since answers the held-back failure then.

Thread: the tokenizer's event loop only (`recovery.holds_back` and the re-run). No lock. Bounded: at most `CAP`
addresses each (the oldest forgotten first; a deployment has a handful of prefills)."""

from __future__ import annotations

import time
from typing import Any, Dict, Optional, Tuple

Addr = Tuple[str, int]  # a prefill's bootstrap (host, port), as the request carries it
ATTR = "_fork_known_prefills"
# A completion older than this is no evidence that the prefill still serves: a balancer sends each prefill
# requests all the time while it is healthy, and one that served nothing for this long is not chosen.
FRESH_S = 120.0
CAP = 64


def address(obj: Any) -> Optional[Addr]:
    """The prefill bootstrap address a tokenizer's request carries, or None (no PD bootstrap, or not one address)."""
    host, port = getattr(obj, "bootstrap_host", None), getattr(obj, "bootstrap_port", None)
    if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, (int, str)):
        return None
    try:
        return host, int(port)
    except ValueError:
        return None


class KnownPrefills:
    """What decode's tokenizer saw of each prefill (see the module)."""

    def __init__(self) -> None:
        self.served: Dict[Addr, float] = {}  # addr -> the last completion through it (monotonic)
        self.lost: Dict[Addr, float] = {}  # addr -> the last request lost with it (decode declared it lost)

    @staticmethod
    def _put(table: Dict[Addr, float], addr: Addr, at: float) -> None:
        table.pop(addr, None)  # re-inserted last: the dict's order is the age order
        table[addr] = at
        while len(table) > CAP:
            del table[next(iter(table))]

    def saw_served(self, addr: Optional[Addr], at: Optional[float] = None) -> None:
        if addr is not None:
            self._put(self.served, addr, time.monotonic() if at is None else at)

    def saw_lost(self, addr: Optional[Addr], at: Optional[float] = None) -> None:
        if addr is not None:
            self._put(self.lost, addr, time.monotonic() if at is None else at)

    def other_than(self, addr: Optional[Addr], now: Optional[float] = None) -> Optional[Addr]:
        """The prefill to re-run a request lost with `addr` on: the one that served most recently, within `FRESH_S`,
        after its own last loss; never `addr`. None: no such prefill (the lost prefill's failure is answered)."""
        now = time.monotonic() if now is None else now
        alive = [(at, a) for a, at in self.served.items()
                 if a != addr and now - at <= FRESH_S and at > self.lost.get(a, float("-inf"))]
        return max(alive)[1] if alive else None

    def sizes(self) -> Dict[str, int]:
        return {"served": len(self.served), "lost": len(self.lost)}


def of(tm: Any) -> KnownPrefills:
    """Decode's tokenizer's table (made at first use)."""
    known = tm.__dict__.get(ATTR)
    if known is None:
        known = tm.__dict__[ATTR] = KnownPrefills()
    return known
