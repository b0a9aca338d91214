"""The fork's knobs: each declared once, in upstream's `Envs` (sglang.srt.environ: typed, with its default; the
fork's lines are its environ patches), and read here strictly: a value that is not valid raises ValueError naming the
knob and what it accepts (upstream's `EnvField.get` warns and takes the default: a typo in a deadline must not
silently become 600 s).

`check()` reads every one; it runs while ServerArgs resolve (`transfer_deadline_knob.validate`, called by the patched
line at the top of `handle_pd_disaggregation`), so a bad value stops the server before any process starts.
Light on purpose (standard library and sglang.srt.environ): the arg parser imports it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

from sglang.srt.environ import envs


def positive_seconds(value: Any, source: str, what: str, accepted: str, zero: bool = False,
                     maximum: float = math.inf) -> float:
    """`value` as finite seconds > 0 (>= 0 with `zero`) and <= `maximum`, else ValueError naming the knob `source`."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and (seconds > 0 or (zero and seconds == 0)) and seconds <= maximum):
        raise ValueError(f"{source}={value!r} is not {what}: expected {accepted}.")
    return seconds


@dataclass(frozen=True)
class Seconds:
    """A duration knob declared in upstream's `Envs` as an `EnvFloat`."""

    name: str
    maximum: float  # the largest value accepted
    why_maximum: str  # why nothing larger is: said in the error
    zero: Optional[str] = None  # what 0 means, where 0 is accepted

    @property
    def default(self) -> float:
        return float(getattr(envs, self.name).default)  # its declaration: a missing one raises AttributeError

    @property
    def accepted(self) -> str:
        if self.zero is None:
            low = "a finite number of seconds > 0"
        else:
            low = f"a finite number of seconds >= 0, 0 {self.zero},"
        return f"{low} and <= {self.maximum:g} ({self.why_maximum}) (default {self.default:g})"

    def get(self) -> float:
        value = os.environ.get(self.name)
        if value is None:
            return self.default
        return positive_seconds(value, self.name, "valid", self.accepted, zero=self.zero is not None,
                                maximum=self.maximum)

    def show(self, value: float) -> str:
        return f"{value:g} s"


@dataclass(frozen=True)
class Count:
    """A count knob declared in upstream's `Envs` as an `EnvInt` (0 accepted: what it means is `zero`)."""

    name: str
    maximum: int  # the largest value accepted
    why_maximum: str  # why nothing larger is: said in the error
    zero: str  # what 0 means

    @property
    def default(self) -> int:
        return int(getattr(envs, self.name).default)  # its declaration: a missing one raises AttributeError

    @property
    def accepted(self) -> str:
        return (f"a whole number >= 0, 0 {self.zero}, and <= {self.maximum} ({self.why_maximum}) "
                f"(default {self.default})")

    def get(self) -> int:
        value = os.environ.get(self.name)
        if value is None:
            return self.default
        try:
            count = int(value.strip())
        except ValueError:
            count = -1
        if not 0 <= count <= self.maximum:
            raise ValueError(f"{self.name}={value!r} is not valid: expected {self.accepted}.")
        return count

    def show(self, value: int) -> str:
        return f"{value}"


DAY = 86400.0
# Each knob's upper bound, and why (docs/layout.md, "The fork's knobs"): a value past it is a typo or a unit slip
# (milliseconds for seconds), never a setting that works.
TRANSFER_TIMEOUT = Seconds(  # transfer_deadline (its server arg wins, with the same bound)
    "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT", DAY,
    "a day: a longer deadline holds a lost transfer's KV and slots for longer than any client waits")
LOST_DECODE_HANDSHAKE_TIMEOUT = Seconds(  # lost_handshake, gateway.md
    "SGLANG_FORK_LOST_DECODE_HANDSHAKE_TIMEOUT", 600.0,
    "the default transfer deadline: longer, the deadline ends the request first and the rule never acts",
    zero="turns the rule off")
SESSION_PROBE_TIMEOUT = Seconds(  # chunk_failures.bounded_probe
    "SGLANG_FORK_SESSION_PROBE_TIMEOUT", 60.0,
    "a probe holds a transfer worker: every room queued on it waits as long")
DEPARTED_DECODE_AFTER = Seconds(  # fork_peers' monitors: a lost peer left for good
    "SGLANG_FORK_DEPARTED_DECODE_AFTER", DAY,
    "a day: a departed peer's entries (and the lost-decode rule's count of it) last as long")
GLOO_TIMEOUT = Seconds(  # rank_agreement
    "SGLANG_FORK_GLOO_TIMEOUT", DAY,
    "a day: a rank stuck longer in a collective is never noticed, and huge values overflow timedelta",
    zero="keeps upstream's 120 minutes")
PD_IDLE_PACE = Seconds(  # idle_pacing
    "SGLANG_FORK_PD_IDLE_PACE", 0.1,
    "ranks > 0 sleep it whole on each idle pass: every step they join waits as long",
    zero="turns pacing off")
KV_WRITE_POLL = Seconds(  # paced_write
    "SGLANG_FORK_KV_WRITE_POLL", 0.1,
    "a finished KV write is noticed up to one poll late, on every write",
    zero="keeps upstream's synchronous write")
TRANSFER_HANDOFF = Seconds(  # worker_handoff
    "SGLANG_FORK_TRANSFER_HANDOFF", 0.1,
    "the scheduler thread waits up to it after each chunk it hands to a parked worker",
    zero="keeps upstream's hand-off")
RECOVERY_ATTEMPTS = Count(  # fork_recovery (docs/recovery.md)
    "SGLANG_FORK_RECOVERY_ATTEMPTS", 3,
    "each attempt is one more prefill of the whole prompt: a fault that persists is answered, not retried",
    zero="keeps the failure's answer (no recovery)")
RECOVERY_BUDGET = Seconds(  # fork_recovery (docs/recovery.md): counted from the request's first transfer failure
    "SGLANG_FORK_RECOVERY_BUDGET", 600.0,
    "the default transfer deadline: the client waits the failure's answer up to that much longer")
KNOBS = (TRANSFER_TIMEOUT, LOST_DECODE_HANDSHAKE_TIMEOUT, SESSION_PROBE_TIMEOUT, GLOO_TIMEOUT, PD_IDLE_PACE,
         KV_WRITE_POLL, TRANSFER_HANDOFF, DEPARTED_DECODE_AFTER, RECOVERY_ATTEMPTS, RECOVERY_BUDGET)


def check() -> Dict[str, float]:
    """Every knob's value; ValueError naming the first one that is not valid."""
    return {knob.name: knob.get() for knob in KNOBS}
