"""The test-only recovery fault switch, `SGLANG_TEST_FORK_RECOVERY_FAULTS` (decode; docs/recovery.md, "Testing
recovery"): comma-separated entries, each for the requests whose rid starts with PREFIX:
- `hold=S:rid=PREFIX`: each recovery attempt waits S seconds (or until the request is answered) before it starts,
  so a test can reach the window between the held-back end and the re-submission (an abort, a pause, a weight update);
- `route:rid=PREFIX`: the attempt asks a closed port for prefill's address (as an unreachable bootstrap server).
Unset, nothing is parsed and no attempt waits. Read on the tokenizer's event loop (no lock); a bad entry is a
ValueError naming the switch, at the first attempt."""

from __future__ import annotations

import re
import socket
from typing import List, NamedTuple, Optional

from sglang.srt.environ import envs

_ENTRY = re.compile(r"(?:hold=(\d+(?:\.\d*)?)|(route)):rid=(.+)")


class _Fault(NamedTuple):
    hold: float  # seconds an attempt waits before it starts (0: none)
    route: bool  # prefill's address is asked of a closed port
    rid: str  # a rid prefix


def _faults() -> List[_Fault]:
    out = []
    for item in filter(None, (s.strip() for s in envs.SGLANG_TEST_FORK_RECOVERY_FAULTS.get().split(","))):
        match = _ENTRY.fullmatch(item)
        if match is None:
            raise ValueError(f"SGLANG_TEST_FORK_RECOVERY_FAULTS: bad entry {item!r}; expected hold=S:rid=PREFIX or "
                             "route:rid=PREFIX")
        hold, route, rid = match.groups()
        out.append(_Fault(float(hold or 0.0), bool(route), rid))
    return out


def hold_s(rid: str) -> float:
    """How long an attempt of `rid` waits before it starts (0: at once)."""
    return max((f.hold for f in _faults() if rid.startswith(f.rid)), default=0.0)


def route_port(rid: str) -> Optional[int]:
    """A closed local port to ask for prefill's address instead of its bootstrap server's, or None."""
    if not any(f.route and rid.startswith(f.rid) for f in _faults()):
        return None
    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
