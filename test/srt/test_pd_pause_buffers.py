"""Release/resume with KV buffers that move (real mooncake over TCP, two processes):
the decode side re-registers its new addresses and the next transfer lands in the new
buffers, byte for byte; nothing is written to the old ones."""

from testing.mooncake_pair import MooncakePair


def test_transfer_after_resume_lands_in_moved_buffers():
    with MooncakePair() as pair:
        idle = (pair.prefill.call("snapshot"), pair.decode.call("snapshot"))
        # One request before, so the decode side has registered with prefill already.
        room = pair.submit(prompt_len=12)
        pair.run_until(lambda: pair.decode.call("transferred", room)
                       and pair.prefill.call("status", room) is not None, timeout=60)
        pair.decode.call("finish", room)

        moved = pair.decode.call("move_kv_buffers")
        assert moved["after"] == moved["buffers"]          # kv_args follow the buffers
        assert set(moved["after"]).isdisjoint(moved["before"])  # and they really moved

        room = pair.submit(prompt_len=20)
        took = pair.run_until(lambda: pair.decode.call("transferred", room)
                              and pair.prefill.call("status", room) is not None, timeout=60)
        assert took < 30
        assert pair.prefill.call("status", room) == 200
        sent = pair.prefill.call("kv_sent", room)
        assert len(sent) > 0 and any(sent)
        assert pair.decode.call("kv_bytes", room) == sent   # read from the new buffers
        assert pair.decode.call("old_kv_unchanged")          # nothing went to the old ones
        pair.decode.call("finish", room)
        assert (pair.prefill.call("snapshot"), pair.decode.call("snapshot")) == idle
