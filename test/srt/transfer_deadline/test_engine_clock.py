"""The engine clock excludes paused time and is idempotent under repeated calls."""

import pytest

from sglang.srt.disaggregation.fork_ending.engine_clock import EngineClock

pytestmark = pytest.mark.unit


class Wall:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_paused_time_does_not_count():
    wall = Wall()
    clock = EngineClock(wall)
    start = clock.now()
    wall.t += 5
    clock.pause()
    wall.t += 1000
    assert clock.paused and clock.now() - start == 5
    clock.resume()
    wall.t += 2
    assert not clock.paused and clock.now() - start == 7


def test_pause_and_resume_are_idempotent():
    wall = Wall()
    clock = EngineClock(wall)
    start = clock.now()
    clock.pause()
    wall.t += 3
    clock.pause()  # a second pause must not restart the paused interval
    wall.t += 3
    clock.resume()
    clock.resume()  # nor may a second resume subtract it twice
    wall.t += 1
    assert clock.now() - start == 1
