"""How a recovery attempt's prefill leg is named (docs/recovery.md): the client's rid with `RID_MARK` and the attempt's
number appended, so prefill never sees a rid twice (it refuses a duplicate while it may still hold the first leg), the
logs tie each attempt to its request, and a test fault can tell a first attempt from a re-run
(`SGLANG_TEST_DISAGG_FAIL_CHUNKS`'s `+first`). Which failures recovery re-runs is `recovery_rule`'s. Pure
functions, any thread, no lock; imports nothing of the fork."""

from __future__ import annotations

import re
from typing import Tuple

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
