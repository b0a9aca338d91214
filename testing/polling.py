"""The harness's one bounded wait and its error: every helper that waits for a server polls
through `wait_until` (a deadline, never a bare sleep) and fails with `ClusterError`.
The bottom of the harness: imports nothing of testing/."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

POLL_INTERVAL = 0.25


class ClusterError(RuntimeError):
    pass


def wait_until(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = POLL_INTERVAL,
    on_timeout: Optional[Callable[[], str]] = None,
) -> Any:
    """Poll predicate until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    last_exc: Optional[BaseException] = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except ClusterError:
            raise
        except Exception as e:  # the thing polled is allowed to be not ready yet
            last_exc = e
        if time.monotonic() >= deadline:
            detail = on_timeout() if on_timeout else ""
            raise ClusterError(
                f"timed out after {timeout:.0f}s waiting for {what}"
                + (f" (last error: {last_exc!r})" if last_exc else "")
                + (f"\n{detail}" if detail else "")
            )
        time.sleep(interval)
