"""A failed chunk write poison-marks its room's drain ACK (upstream's `_deferred_ack_poisoned_rooms`); prefill forgets
the mark once decode's release deadline passed. That costs no thread per failed write (it was a 30 s
`threading.Timer` each), and the deadline is read on the engine clock (a paused engine does not expire it), checked on
the scheduler's bootstrap-queue pass (`poison_expiry.expire_poison`, the hook on `pop_bootstrapped`).
Stock upstream 0.5.23 never drops the mark (the room's number stays poisoned until a new request reuses it)."""

import threading
from types import SimpleNamespace

import pytest

from sglang.srt.disaggregation.fork_ending.engine_clock import EngineClock
from sglang.srt.disaggregation.fork_transfer import chunk_failures, poison_expiry
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
from sglang.srt.managers.fork_core import fork_plugin
from sglang.srt.plugins import load_plugins

pytestmark = pytest.mark.unit

FAILED = 200
POISON_HOOK = "sglang.srt.disaggregation.common.conn.CommonKVManager.poison_deferred_ack_room"
DELAY_S = 30.0  # SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT's default


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    clock = EngineClock(monotonic=lambda: now[0])
    monkeypatch.setattr(poison_expiry, "engine_clock", clock, raising=False)  # was: none (a Timer each)
    clock.advance = lambda s: now.__setitem__(0, now[0] + s)
    return clock


@pytest.fixture(autouse=True)
def hooks():
    load_plugins()  # as run_scheduler_process does: the fork's hook on poison_deferred_ack_room
    assert fork_plugin.hooks_applied()[POISON_HOOK]


def _prefill_manager():
    """A MooncakeKVManager with what a failed write's path reads: deferred release on, no poisoned room yet."""
    mgr = object.__new__(MooncakeKVManager)
    mgr.enable_deferred_decode_kv_release = True
    mgr._deferred_ack_poisoned_rooms = set()
    mgr._deferred_ack_targets = {}
    return mgr


def _failed_write(mgr, room):
    """What a transfer worker does when a KV write of `room` fails, in its order: the fork's `checked` counts the
    failure, then upstream poisons the drain ACK (`_poison_unsettled_send`) and the fork's hook notes its expiry."""
    assert chunk_failures.checked(mgr, room, "kv", -1) == -1
    mgr.poison_deferred_ack_room(room)


def test_poison_marks_expire_on_the_engine_clock_without_a_thread_each(clock):
    mgr = _prefill_manager()
    queue = SimpleNamespace(kv_manager=mgr)
    threads = threading.active_count()
    for room in range(FAILED):
        _failed_write(mgr, room)
    assert threading.active_count() - threads < 5, threading.active_count() - threads
    assert len(mgr._deferred_ack_poisoned_rooms) == FAILED
    assert poison_expiry.poison_table(mgr)["size"] == FAILED

    clock.pause()  # a paused engine: its time does not count
    clock.advance(2 * DELAY_S)
    poison_expiry.expire_poison(queue)
    assert len(mgr._deferred_ack_poisoned_rooms) == FAILED
    clock.resume()

    clock.advance(DELAY_S - 1)
    poison_expiry.expire_poison(queue)
    assert len(mgr._deferred_ack_poisoned_rooms) == FAILED
    clock.advance(1)
    poison_expiry.expire_poison(queue)
    assert mgr._deferred_ack_poisoned_rooms == set()
    assert poison_expiry.poison_table(mgr)["size"] == 0


def test_a_mark_dropped_another_way_leaves_no_pending_expiry(clock):
    """The peer monitor drops a lost decode session's poison marks itself (`_drop_incarnation`); their expiries are
    forgotten at the next pass, so the report holds nothing once the loss is handled (not 30 s later)."""
    mgr = _prefill_manager()
    queue = SimpleNamespace(kv_manager=mgr)
    for room in (1, 2, 3):
        _failed_write(mgr, room)
    mgr._deferred_ack_poisoned_rooms.difference_update({1, 2})  # as `_drop_incarnation` does
    poison_expiry.expire_poison(queue)
    assert poison_expiry.poison_table(mgr)["size"] == 1 and mgr._deferred_ack_poisoned_rooms == {3}
    clock.advance(DELAY_S)
    poison_expiry.expire_poison(queue)
    assert poison_expiry.poison_table(mgr)["size"] == 0 and mgr._deferred_ack_poisoned_rooms == set()


def test_a_bootstrap_pass_between_the_failed_write_and_its_mark_keeps_the_expiry(clock):
    """The worker's `checked` runs a few lines before upstream marks the room; the scheduler's pass may fall between.
    Found by the metrics e2e under CI load: the expiry was noted in `checked`, the pass forgot it (room not marked
    yet), then the mark came and stayed for the server's life (`_deferred_ack_poisoned_rooms` 1 an hour later)."""
    mgr = _prefill_manager()
    queue = SimpleNamespace(kv_manager=mgr)
    assert chunk_failures.checked(mgr, 7, "kv", -1) == -1
    poison_expiry.expire_poison(queue)  # the scheduler's pass, before upstream's mark
    mgr.poison_deferred_ack_room(7)
    poison_expiry.expire_poison(queue)
    assert mgr._deferred_ack_poisoned_rooms == {7} and poison_expiry.poison_table(mgr)["size"] == 1
    clock.advance(DELAY_S)
    poison_expiry.expire_poison(queue)
    assert mgr._deferred_ack_poisoned_rooms == set() and poison_expiry.poison_table(mgr)["size"] == 0


def test_the_transfer_workers_own_crash_mark_expires_too(clock):
    """Upstream marks a room when its transfer worker raises (mooncake's `transfer_worker` except path), with no
    failed write counted: that mark expires as well."""
    mgr = _prefill_manager()
    mgr.poison_deferred_ack_room(9)
    clock.advance(DELAY_S)
    poison_expiry.expire_poison(SimpleNamespace(kv_manager=mgr))
    assert mgr._deferred_ack_poisoned_rooms == set()
