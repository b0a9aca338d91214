"""Real mooncake over TCP between a prefill and a decode process: the KV lands intact and
both managers forget the room once the request succeeded."""

import pytest

from testing.pd_checks import assert_pair_idle as _assert_idle
from testing.pd_checks import pair_fixture

pytestmark = pytest.mark.pair

pair = pair_fixture()


def _finish_transfer(pair, room):
    return pair.run_until(
        lambda: pair.decode.call("transferred", room)
        and pair.prefill.call("status", room) is not None,
        timeout=60,
    )


def test_transfer_lands_byte_identical(pair):
    _assert_idle(pair)
    room = pair.submit(prompt_len=12)
    assert _finish_transfer(pair, room) < 30

    sent = pair.prefill.call("kv_sent", room)
    assert len(sent) > 0 and any(sent)
    assert pair.decode.call("kv_bytes", room) == sent
    assert pair.prefill.call("status", room) == 200
    # the first token sampled on prefill arrives through the metadata buffer
    assert pair.decode.call("output_ids", room) == [7]

    pair.decode.call("finish", room)
    _assert_idle(pair)


def test_room_state_cleaned_after_success(pair):
    _assert_idle(pair)
    # shares its first 12 tokens with the previous request: prefill sends them from cache
    room = pair.submit(prompt_len=20)
    assert "request_status" in pair.prefill.call("room_entries", room)
    assert "request_status" in pair.decode.call("room_entries", room)
    _finish_transfer(pair, room)

    assert pair.decode.call("kv_bytes", room) == pair.prefill.call("kv_sent", room)
    assert pair.prefill.call("room_entries", room) == []
    assert pair.decode.call("room_entries", room) == []

    pair.decode.call("finish", room)
    _assert_idle(pair)
