"""The transfer deadline knob: `--disaggregation-transfer-timeout` wins over
`SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT` (default 600 s); both validated while ServerArgs
resolve, with every other knob of the fork (`fork_core.knobs.check`). Light on purpose: imported by the arg parser.
"""

from __future__ import annotations

import argparse
from typing import Optional

from sglang.srt.managers.fork_core import knobs
from sglang.srt.managers.fork_core.knobs import positive_seconds

ENV = knobs.TRANSFER_TIMEOUT.name
ARG = "--disaggregation-transfer-timeout"
DEFAULT = knobs.TRANSFER_TIMEOUT.default
HELP = (
    "PD transfer deadline in seconds (float > 0, at most a day). Bounds a request's time in each "
    "PD queue: prefill bootstrap, waiting (after bootstrap) and inflight; decode "
    "prealloc and transfer. An overdue request is aborted with HTTP 504 and the "
    f"peer is told. Overrides ${ENV} (default {DEFAULT:g})."
)


def parse(value, source: str) -> float:
    """`value` as a deadline in seconds, or ValueError naming `source`."""
    knob = knobs.TRANSFER_TIMEOUT
    return positive_seconds(value, source, "a valid PD transfer deadline",
                            f"a finite number of seconds > 0 and <= {knob.maximum:g}, {knob.why_maximum} (e.g. 600)",
                            maximum=knob.maximum)


def parse_arg(text: str) -> float:
    """argparse type for ARG: the message names the flag and the accepted range."""
    try:
        return parse(text, ARG)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def validate(arg_value: Optional[float]) -> float:
    """Check every knob of the fork and the server argument (when set); the deadline in effect."""
    env_seconds = knobs.check()[ENV]
    return env_seconds if arg_value is None else parse(arg_value, ARG)


def configured() -> float:
    """The deadline in effect in this process (server argument, else env, else 600)."""
    from sglang.srt.runtime_context import get_disagg

    arg_value = getattr(get_disagg(), "disaggregation_transfer_timeout", None)
    return knobs.TRANSFER_TIMEOUT.get() if arg_value is None else parse(arg_value, ARG)
