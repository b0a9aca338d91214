"""The engine clock: monotonic seconds that do not count the time the engine stood paused, one per process.

Invariant: `now()` never advances while paused, so a PD deadline or the ledger's memory of ended rooms never expires
because of a pause. Read by any thread (`transfer_deadline`, `lost_handshake`, `RoomLedger`); moved only by the
scheduler thread (`scheduler_pause`: `pause()` on pause_generation, `resume()` on continue_generation, both
idempotent). No lock: one writer, and a reader racing a pause reads either side of it."""

from __future__ import annotations

import time
from typing import Callable, Optional


class EngineClock:
    """Monotonic seconds not counting paused time (one per scheduler process): PD deadlines and the ledger's memory
    read `now()`; scheduler_pause calls `pause()` / `resume()` (both idempotent) on pause_generation /
    continue_generation."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic):
        self._monotonic = monotonic
        self._paused_at: Optional[float] = None
        self._paused_total = 0.0

    @property
    def paused(self) -> bool:
        return self._paused_at is not None

    def now(self) -> float:
        return (self._paused_at if self._paused_at is not None else self._monotonic()) - self._paused_total

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
