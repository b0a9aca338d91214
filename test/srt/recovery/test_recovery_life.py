"""A recovery's life (fork_recovery.recovery_life): the table's rows are the only moves, each ending row names how
the request is answered and what is counted; the test fault switch parses its entries or names itself."""

from __future__ import annotations

import pytest

from sglang.srt.disaggregation.fork_recovery import recovery_faults
from sglang.srt.disaggregation.fork_recovery.recovery_life import (OUTCOMES, STARTED, TRANSITIONS, Attempts, Event,
                                                                   Phase, RecoveryStateError)

pytestmark = pytest.mark.unit


def test_every_row_counts_a_known_outcome_and_a_held_request_is_answered_by_whoever_ends_it():
    for (phase, event), row in TRANSITIONS.items():
        assert row.outcome is None or row.outcome in OUTCOMES, (phase, event)
        if phase is Phase.HELD and row.to is Phase.ENDED:  # in no scheduler: the caller must answer it
            assert row.answers_failure != row.answers_abort, (phase, event)
        else:
            assert not (row.answers_failure or row.answers_abort), (phase, event)
    assert {row.to for (phase, _), row in TRANSITIONS.items() if phase is Phase.ENDED} == set()  # answered: final


def test_a_recovered_request_moves_held_running_ended_and_counts_each_attempt():
    record = Attempts()
    assert record.move(Event.FAILED).outcome == STARTED and record.phase is Phase.HELD and record.made == 1
    assert record.move(Event.SUBMITTED).outcome is None and record.phase is Phase.RUNNING
    assert record.move(Event.FAILED).outcome == STARTED and record.made == 2
    record.move(Event.SUBMITTED)
    assert record.move(Event.COMPLETED).outcome == "recovered" and record.phase is Phase.ENDED


@pytest.mark.parametrize("phase,event", [(Phase.IDLE, Event.SUBMITTED), (Phase.RUNNING, Event.NOT_STARTED),
                                         (Phase.ENDED, Event.ABORTED), (Phase.HELD, Event.COMPLETED)])
def test_a_move_without_a_row_is_refused_and_changes_nothing(phase, event):
    record = Attempts(phase=phase)
    with pytest.raises(RecoveryStateError):
        record.move(event)
    assert record.phase is phase


def test_the_fault_switch_holds_or_fails_only_the_rids_it_names(monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_FORK_RECOVERY_FAULTS", "hold=2.5:rid=a-,route:rid=b-")
    assert recovery_faults.hold_s("a-1") == 2.5 and recovery_faults.hold_s("b-1") == 0.0
    assert recovery_faults.route_port("a-1") is None and isinstance(recovery_faults.route_port("b-1"), int)
    monkeypatch.setenv("SGLANG_TEST_FORK_RECOVERY_FAULTS", "hold:rid=a-")
    with pytest.raises(ValueError, match="SGLANG_TEST_FORK_RECOVERY_FAULTS"):
        recovery_faults.hold_s("a-1")
