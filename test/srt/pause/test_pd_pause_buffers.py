"""Release/resume with KV buffers that move (real mooncake over TCP, two processes):
the side that moved re-registers its new addresses and the next transfer goes between
the new buffers, byte for byte: decode's moved buffers receive it (nothing is written
to the old ones), prefill's moved buffers are what is sent (its old ones, filled with
a constant as reused memory would be, are not read)."""

import pytest

from testing.pd_checks import assert_pair_idle, pair_fixture

pytestmark = pytest.mark.pair


def _transfer(pair, prompt_len: int) -> int:
    room = pair.submit(prompt_len=prompt_len)
    took = pair.run_until(lambda: pair.decode.call("transferred", room)
                          and pair.prefill.call("status", room) is not None, timeout=60)
    assert took < 30
    assert pair.prefill.call("status", room) == 200
    sent = pair.prefill.call("kv_sent", room)
    assert len(sent) > 0 and any(sent)
    assert pair.decode.call("kv_bytes", room) == sent
    pair.decode.call("finish", room)
    assert_pair_idle(pair)
    return room


# One request before, so the decode side has registered with prefill already.
pair = pair_fixture(prepare=lambda p: _transfer(p, prompt_len=12))


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_transfer_after_resume_uses_moved_buffers(pair, side):
    moved = getattr(pair, side).call("move_kv_buffers", poison_old=side == "prefill")
    assert moved["after"] == moved["buffers"]               # kv_args follow the buffers
    assert set(moved["after"]).isdisjoint(moved["before"])  # and they really moved
    _transfer(pair, prompt_len=20)  # read from / written to the new buffers, byte check
    assert getattr(pair, side).call("old_kv_unchanged")      # the old ones untouched
