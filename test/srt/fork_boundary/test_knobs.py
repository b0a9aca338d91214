"""The fork's knobs (managers/fork_core/knobs.py): each declared once in upstream's `Envs` with its default, read
strictly (a bad value raises naming the knob and what it accepts, where upstream's `EnvField.get` would warn and take
the default), and all checked where ServerArgs resolve (`transfer_deadline_knob.validate`). A server started with a
bad knob: test_transfer_deadline_e2e.py::test_bad_deadline_stops_the_server_at_startup."""

from __future__ import annotations

import pytest

from sglang.srt.disaggregation.fork_transfer import transfer_deadline_knob
from sglang.srt.environ import EnvFloat, EnvInt, envs
from sglang.srt.managers.fork_core import knobs

pytestmark = pytest.mark.unit

DEFAULTS = {  # the documented defaults (README, docs/): a changed default is a user-visible change
    "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": 600.0,
    "SGLANG_FORK_LOST_DECODE_HANDSHAKE_TIMEOUT": 5.0,
    "SGLANG_FORK_SESSION_PROBE_TIMEOUT": 5.0,
    "SGLANG_FORK_GLOO_TIMEOUT": 0.0,
    "SGLANG_FORK_PD_IDLE_PACE": 0.001,
    "SGLANG_FORK_KV_WRITE_POLL": 0.0005,
    "SGLANG_FORK_TRANSFER_HANDOFF": 0.0005,
    "SGLANG_FORK_DEPARTED_DECODE_AFTER": 300.0,
    "SGLANG_FORK_RECOVERY_ATTEMPTS": 0,
    "SGLANG_FORK_RECOVERY_BUDGET": 30.0,
}
SECONDS = [k for k in knobs.KNOBS if isinstance(k, knobs.Seconds)]
COUNTS = [k for k in knobs.KNOBS if isinstance(k, knobs.Count)]


@pytest.fixture(autouse=True)
def _unset(monkeypatch):
    for knob in knobs.KNOBS:
        monkeypatch.delenv(knob.name, raising=False)


@pytest.mark.parametrize("knob", knobs.KNOBS, ids=lambda k: k.name)
def test_each_knob_is_declared_once_in_upstreams_envs_with_its_default(knob):
    field = getattr(envs, knob.name)
    assert isinstance(field, EnvFloat if isinstance(knob, knobs.Seconds) else EnvInt) and field.name == knob.name
    assert knob.get() == field.get() == DEFAULTS[knob.name]
    assert sorted(k.name for k in knobs.KNOBS) == sorted(DEFAULTS)


@pytest.mark.parametrize("knob", SECONDS, ids=lambda k: k.name)
@pytest.mark.parametrize("bad", ["soon", "-1", "nan", "inf", ""])
def test_a_bad_value_raises_naming_the_knob_where_upstream_would_take_the_default(monkeypatch, knob, bad):
    monkeypatch.setenv(knob.name, bad)
    with pytest.raises(ValueError, match=knob.name) as raised:
        knob.get()
    assert "expected a finite number of seconds" in str(raised.value)
    with pytest.raises(ValueError, match=knob.name):  # the start-up check finds it among the others
        transfer_deadline_knob.validate(None)


@pytest.mark.parametrize("knob", SECONDS, ids=lambda k: k.name)
def test_zero_is_accepted_only_where_it_means_something(monkeypatch, knob):
    monkeypatch.setenv(knob.name, "0")
    if knob.zero is None:
        with pytest.raises(ValueError, match=knob.name):
            knob.get()
    else:
        assert knob.get() == 0.0 and knob.zero in knob.accepted
    monkeypatch.setenv(knob.name, "0.05")
    assert knob.get() == 0.05


def test_the_server_argument_wins_over_the_env_and_both_are_checked(monkeypatch):
    monkeypatch.setenv(knobs.TRANSFER_TIMEOUT.name, "30")
    assert transfer_deadline_knob.validate(None) == 30.0
    assert transfer_deadline_knob.validate(7.5) == 7.5
    with pytest.raises(ValueError, match=transfer_deadline_knob.ARG):
        transfer_deadline_knob.validate(0)
    monkeypatch.setenv(knobs.TRANSFER_TIMEOUT.name, "-3")
    with pytest.raises(ValueError, match=knobs.TRANSFER_TIMEOUT.name):  # a bad env fails even under a good arg
        transfer_deadline_knob.validate(7.5)


MAXIMA = {  # the documented upper bounds (docs/layout.md, "The fork's knobs"): each knob has one, with its reason
    "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": 86400.0,
    "SGLANG_FORK_LOST_DECODE_HANDSHAKE_TIMEOUT": 600.0,
    "SGLANG_FORK_SESSION_PROBE_TIMEOUT": 60.0,
    "SGLANG_FORK_GLOO_TIMEOUT": 86400.0,
    "SGLANG_FORK_PD_IDLE_PACE": 0.1,
    "SGLANG_FORK_KV_WRITE_POLL": 0.1,
    "SGLANG_FORK_TRANSFER_HANDOFF": 0.1,
    "SGLANG_FORK_DEPARTED_DECODE_AFTER": 86400.0,
    "SGLANG_FORK_RECOVERY_BUDGET": 600.0,
}


@pytest.mark.parametrize("knob", SECONDS, ids=lambda k: k.name)
def test_each_knob_accepts_up_to_its_documented_maximum_and_the_error_names_the_range_and_why(monkeypatch, knob):
    """Before: SGLANG_FORK_GLOO_TIMEOUT=1e300 passed the check and overflowed timedelta when the first gloo group was
    made; SGLANG_FORK_PD_IDLE_PACE=30 passed and every idle pass of a rank > 0 slept 30 s."""
    maximum = MAXIMA[knob.name]
    assert knob.maximum == maximum and knob.default <= maximum and knob.why_maximum
    monkeypatch.setenv(knob.name, repr(maximum))
    assert knob.get() == maximum
    for beyond in (maximum * 1.001, maximum * 1000, 1e300):
        monkeypatch.setenv(knob.name, repr(beyond))
        with pytest.raises(ValueError) as raised:
            knob.get()
        message = str(raised.value)
        assert knob.name in message and f"<= {maximum:g}" in message and knob.why_maximum in message, message
        with pytest.raises(ValueError, match=knob.name):  # the start-up check finds it among the others
            transfer_deadline_knob.validate(None)


@pytest.mark.parametrize("name, value", [("SGLANG_FORK_GLOO_TIMEOUT", "1e300"), ("SGLANG_FORK_PD_IDLE_PACE", "30")])
def test_the_values_of_the_issue_stop_the_start_up_check(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}='{value}' is not valid"):
        transfer_deadline_knob.validate(None)


def test_the_deadline_server_argument_has_the_same_maximum(monkeypatch):
    assert transfer_deadline_knob.validate(86400) == 86400.0
    with pytest.raises(ValueError, match=f"{transfer_deadline_knob.ARG}=.*<= 86400"):
        transfer_deadline_knob.validate(86401)


@pytest.mark.parametrize("knob", COUNTS, ids=lambda k: k.name)
@pytest.mark.parametrize("bad", ["once", "-1", "1.5", "", "4", "1e9"])
def test_a_count_knob_takes_whole_numbers_from_0_to_its_maximum_and_names_itself_otherwise(monkeypatch, knob, bad):
    """SGLANG_FORK_RECOVERY_ATTEMPTS: 0 keeps the failure's answer; at most 3 (each attempt is a whole prefill)."""
    assert knob.maximum == 3 and knob.zero in knob.accepted and knob.why_maximum in knob.accepted
    for good in ("0", "1", " 3 "):
        monkeypatch.setenv(knob.name, good)
        assert knob.get() == int(good)
    monkeypatch.setenv(knob.name, bad)
    with pytest.raises(ValueError, match=f"{knob.name}=.*whole number >= 0.*<= 3"):
        knob.get()
    with pytest.raises(ValueError, match=knob.name):  # the start-up check finds it among the others
        transfer_deadline_knob.validate(None)
