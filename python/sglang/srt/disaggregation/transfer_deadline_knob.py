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
ACCEPTED = "a finite number of seconds > 0 (e.g. 600)"
HELP = (
    "PD transfer deadline in seconds (float > 0). Bounds a request's time in each "
    "PD queue: prefill bootstrap, waiting (after bootstrap) and inflight; decode "
    "prealloc and transfer. An overdue request is aborted with HTTP 504 and the "
    f"peer is told. Overrides ${ENV} (default {DEFAULT:g})."
)


class TransferTimeoutError(ValueError):
    pass


def positive_seconds(value, source: str, what: str, accepted: str, error: type = ValueError,
                     zero: bool = False) -> float:
    """`value` as finite seconds > 0 (>= 0 with `zero`), else `error` naming the knob `source`."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and (seconds > 0 or (zero and seconds == 0))):
        raise error(f"{source}={value!r} is not {what}: expected {accepted}.")
    return seconds


def parse(value, source: str) -> float:
    """`value` as a deadline in seconds, or TransferTimeoutError naming `source`."""
    return positive_seconds(value, source, "a valid PD transfer deadline", ACCEPTED, TransferTimeoutError)


def parse_arg(text: str) -> float:
    """argparse type for ARG: the message names the flag and the accepted range."""
    try:
        return parse(text, ARG)
    except TransferTimeoutError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def validate(arg_value: Optional[float]) -> float:
    """Check the server argument and the env variable (both, when set); the deadline in effect."""
    env_value = os.environ.get(ENV)
    env_seconds = None if env_value is None else parse(env_value, ENV)
    if arg_value is not None:
        return parse(arg_value, ARG)
    return DEFAULT if env_seconds is None else env_seconds


def configured() -> float:
    """The deadline in effect in this process (server argument, else env, else 600)."""
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_disagg

    arg_value = getattr(get_disagg(), "disaggregation_transfer_timeout", None)
    if arg_value is not None:
        return float(arg_value)
    return float(envs.SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT.get())
