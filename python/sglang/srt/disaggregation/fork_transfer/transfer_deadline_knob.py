"""The transfer deadline knob: `--disaggregation-transfer-timeout` wins over
`SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT` (default 600 s); both validated while ServerArgs
resolve. Light on purpose: imported by the arg parser. Also the fork's `positive_seconds`.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Optional

ENV = "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT"
ARG = "--disaggregation-transfer-timeout"
DEFAULT = 600.0
HELP = (
    "PD transfer deadline in seconds (float > 0). Bounds a request's time in each "
    "PD queue: prefill bootstrap, waiting (after bootstrap) and inflight; decode "
    "prealloc and transfer. An overdue request is aborted with HTTP 504 and the "
    f"peer is told. Overrides ${ENV} (default {DEFAULT:g})."
)


def positive_seconds(value, source: str, what: str, accepted: str, zero: bool = False) -> float:
    """`value` as finite seconds > 0 (>= 0 with `zero`), else ValueError naming the knob `source`."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and (seconds > 0 or (zero and seconds == 0))):
        raise ValueError(f"{source}={value!r} is not {what}: expected {accepted}.")
    return seconds


def parse(value, source: str) -> float:
    """`value` as a deadline in seconds, or ValueError naming `source`."""
    return positive_seconds(value, source, "a valid PD transfer deadline", "a finite number of seconds > 0 (e.g. 600)")


def parse_arg(text: str) -> float:
    """argparse type for ARG: the message names the flag and the accepted range."""
    try:
        return parse(text, ARG)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def validate(arg_value: Optional[float]) -> float:
    """Check the env variable and the server argument (both, when set); the deadline in effect."""
    env_value = os.environ.get(ENV)
    env_seconds = DEFAULT if env_value is None else parse(env_value, ENV)
    return env_seconds if arg_value is None else parse(arg_value, ARG)


def configured() -> float:
    """The deadline in effect in this process (server argument, else env, else 600)."""
    from sglang.srt.runtime_context import get_disagg

    return validate(getattr(get_disagg(), "disaggregation_transfer_timeout", None))
