"""In-process tests that must tell a paced wait from an unpaced one on a loaded 2-core machine need a pace far
above the operator's bound (`knobs.Seconds.maximum`: 0.1 s for the pacing knobs). `widen` lifts one knob's bound
for a test, through the same declaration and the same strict read the server uses; the bound itself is tested in
test_knobs.py, the behaviour under a wide value here."""

from __future__ import annotations

import dataclasses

from sglang.srt.managers.fork_core import knobs


def widen(monkeypatch, attr: str, maximum: float) -> None:
    """knobs.<attr> accepts values up to `maximum` for the test (reverted with monkeypatch)."""
    monkeypatch.setattr(knobs, attr, dataclasses.replace(getattr(knobs, attr), maximum=maximum))
