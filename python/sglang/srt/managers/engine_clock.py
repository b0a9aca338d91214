"""A monotonic clock that stands still while the engine is paused (one per scheduler process): PD deadlines
read `now()`; `pd_pause` calls `pause()` and `resume()` (both idempotent) on pause_generation / continue_generation.
"""

import time
from typing import Callable, Optional


class EngineClock:
    def __init__(self, monotonic: Callable[[], float] = time.monotonic):
        self._monotonic = monotonic
        self._paused_at: Optional[float] = None
        self._paused_total = 0.0

    @property
    def paused(self) -> bool:
        return self._paused_at is not None

    def now(self) -> float:
        """Monotonic seconds, not counting paused time; constant while paused."""
        t = self._paused_at if self._paused_at is not None else self._monotonic()
        return t - self._paused_total

    def pause(self) -> None:
        if self._paused_at is None:
            self._paused_at = self._monotonic()

    def resume(self) -> float:
        """Restart the clock; returns how long it stood still (0.0 if it was running)."""
        paused = 0.0 if self._paused_at is None else self._monotonic() - self._paused_at
        self._paused_total += paused
        self._paused_at = None
        return paused


engine_clock = EngineClock()
