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


def positive_seconds(value: Any, source: str, what: str, accepted: str, zero: bool = False) -> float:
    """`value` as finite seconds > 0 (>= 0 with `zero`), else ValueError naming the knob `source`."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and (seconds > 0 or (zero and seconds == 0))):
        raise ValueError(f"{source}={value!r} is not {what}: expected {accepted}.")
    return seconds


@dataclass(frozen=True)
class Seconds:
    """A duration knob declared in upstream's `Envs` as an `EnvFloat`."""

    name: str
    zero: Optional[str] = None  # what 0 means, where 0 is accepted

    @property
    def default(self) -> float:
        return float(getattr(envs, self.name).default)  # its declaration: a missing one raises AttributeError

    @property
    def accepted(self) -> str:
        if self.zero is None:
            return f"a finite number of seconds > 0 (default {self.default:g})"
        return f"a finite number of seconds >= 0, 0 {self.zero} (default {self.default:g})"

    def get(self) -> float:
        value = os.environ.get(self.name)
        if value is None:
            return self.default
        return positive_seconds(value, self.name, "valid", self.accepted, zero=self.zero is not None)


TRANSFER_TIMEOUT = Seconds("SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT")  # transfer_deadline (its server arg wins)
LOST_DECODE_HANDSHAKE_TIMEOUT = Seconds("SGLANG_FORK_LOST_DECODE_HANDSHAKE_TIMEOUT",  # peer_liveness, gateway.md
                                        zero="turns the rule off")
SESSION_PROBE_TIMEOUT = Seconds("SGLANG_FORK_SESSION_PROBE_TIMEOUT")  # chunk_failures.bounded_probe
DEPARTED_DECODE_AFTER = Seconds("SGLANG_FORK_DEPARTED_DECODE_AFTER")  # peer_liveness: a lost peer left for good
GLOO_TIMEOUT = Seconds("SGLANG_FORK_GLOO_TIMEOUT", zero="keeps upstream's 120 minutes")  # rank_agreement
PD_IDLE_PACE = Seconds("SGLANG_FORK_PD_IDLE_PACE", zero="turns pacing off")  # idle_pacing
KV_WRITE_POLL = Seconds("SGLANG_FORK_KV_WRITE_POLL", zero="keeps upstream's synchronous write")  # paced_write
TRANSFER_HANDOFF = Seconds("SGLANG_FORK_TRANSFER_HANDOFF", zero="keeps upstream's hand-off")  # worker_handoff
KNOBS = (TRANSFER_TIMEOUT, LOST_DECODE_HANDSHAKE_TIMEOUT, SESSION_PROBE_TIMEOUT, GLOO_TIMEOUT, PD_IDLE_PACE,
         KV_WRITE_POLL, TRANSFER_HANDOFF, DEPARTED_DECODE_AFTER)


def check() -> Dict[str, float]:
    """Every knob's value; ValueError naming the first one that is not valid."""
    return {knob.name: knob.get() for knob in KNOBS}
