"""A PD request's bootstrap fields checked where it enters the engine (disaggregation/fork_ending/bootstrap_door.py),
without a server (fast): each bad value of each field, single and batch form, is a 400 naming the field; what the
gateways send passes; a server that is not PD is unaffected. Over HTTP on real servers: test_bad_input_door_e2e.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang.srt.disaggregation.fork_ending import bootstrap_door
from sglang.srt.managers.io_struct import GenerateReqInput

pytestmark = pytest.mark.unit

GOOD = {"bootstrap_room": 12345, "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998}
# (field, bad value): what no transfer can use. Upstream's JSON contract gate already refuses a string room or port
# on /generate (not 2**70: the tokenizer's send to the scheduler fails on it); the Engine API has no such gate.
BAD = [
    ("bootstrap_room", -5), ("bootstrap_room", -1), ("bootstrap_room", 2**63), ("bootstrap_room", 2**70),
    ("bootstrap_room", "7"), ("bootstrap_room", True), ("bootstrap_room", 1.5),
    ("bootstrap_host", ""), ("bootstrap_host", "  "), ("bootstrap_host", 5),
    ("bootstrap_port", 0), ("bootstrap_port", -1), ("bootstrap_port", 65536), ("bootstrap_port", 70000),
    ("bootstrap_port", "8998"), ("bootstrap_port", False),
    ("bootstrap_pair_key", 5),
]


def _tm(role: str):
    return SimpleNamespace(disaggregation_mode=SimpleNamespace(value=role))


def _req(batch: bool, **fields):
    text = ["a", "b"] if batch else "a"
    body = {k: ([v, GOOD.get(k)] if batch else v) for k, v in {**GOOD, **fields}.items()}
    return GenerateReqInput(text=text, sampling_params={"max_new_tokens": 1}, **body)


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
@pytest.mark.parametrize("field, value", BAD, ids=lambda v: repr(v))
def test_each_bad_bootstrap_field_is_a_400_naming_it(role, batch, field, value):
    with pytest.raises(bootstrap_door.BootstrapFieldError) as err:
        bootstrap_door.before_generate_request(_tm(role), _req(batch, **{field: value}))
    where = f"{field}[0]" if batch else field
    assert err.value.status_code == 400 and isinstance(err.value, ValueError)
    assert f"{where}={value!r} is not valid" in str(err.value) and f"on the {role} server" in str(err.value)


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("room", [0, 1, 2**62, 2**63 - 1])
@pytest.mark.parametrize("port", [None, 1, 8998, 65535])
def test_what_the_gateways_send_passes(role, room, port):
    """sglang-router's generate_room_id (`rand::random::<u64>() & i64::MAX`) and the mini LB's
    (`random.randint(0, 2**63 - 1)`) draw rooms in [0, 2**63); the router sends `bootstrap_port: Option<u16>` (null
    where the prefill has none); fields left out or null keep upstream's rules (its scheduler's 400 for no room)."""
    for batch in (False, True):
        bootstrap_door.before_generate_request(_tm(role), _req(batch, bootstrap_room=room, bootstrap_port=port))
    bootstrap_door.before_generate_request(_tm(role), GenerateReqInput(text="a"))
    bootstrap_door.before_generate_request(_tm(role), _req(False, bootstrap_pair_key="k"))
    bootstrap_door.before_generate_request(_tm(role), GenerateReqInput(text=["a", "b"], bootstrap_room=[room, None]))


def test_every_bad_field_is_named_at_once():
    with pytest.raises(bootstrap_door.BootstrapFieldError) as err:
        bootstrap_door.check(_tm("decode"), _req(False, bootstrap_room=-5, bootstrap_port=0, bootstrap_host=""))
    for field in ("bootstrap_room=-5", "bootstrap_host=''", "bootstrap_port=0"):
        assert field in str(err.value)


@pytest.mark.parametrize("field, value", BAD, ids=lambda v: repr(v))
def test_a_server_that_is_not_pd_is_unaffected(field, value):
    """Upstream ignores bootstrap fields without disaggregation: so does the fork."""
    bootstrap_door.before_generate_request(_tm("null"), _req(False, **{field: value}))


@pytest.mark.parametrize("field, value", [("bootstrap_room", "7"), ("bootstrap_port", "8998"),
                                          ("bootstrap_room", [1, "x"]), ("bootstrap_pair_key", 5)])
def test_upstreams_contract_400_names_the_field_it_refuses(field, value):
    """Upstream's /generate contract gate refuses what is not an int64 before the tokenizer; its decoder's words name
    no field. The http_server patch puts the field first; status unchanged (upstream's 400)."""
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    body = {"text": "a", **GOOD, field: value}
    upstream = generate_contract_error(body)
    assert upstream is not None and field not in upstream
    named = bootstrap_door.name_the_field(upstream, body)
    assert named.startswith(field) and upstream in named
    assert bootstrap_door.name_the_field("other", {"text": "a", **GOOD}) == "other"
