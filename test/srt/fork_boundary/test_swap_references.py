"""A kv manager the fork swapped attributes on is freed once upstream drops it (a role switch or a re-init builds a
new one): the table of swaps made (fork_touch, read by the start-up check and the resource report's
`swaps_applied`) holds no strong reference to the manager, nor to what was swapped onto it."""

import gc
import weakref

import pytest

from sglang.srt.disaggregation.fork_ending import room_kv_hooks
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.fork_core import fork_touch

pytestmark = pytest.mark.unit

TARGET = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._handle_abort_notification <- " \
         "sglang.srt.disaggregation.fork_ending.room_kv_hooks:on_manager_init"


def _prefill_manager():
    """A MooncakeKVManager as the ledger's hook sees it (no engine: only what `on_manager_init` reads)."""
    mgr = object.__new__(MooncakeKVManager)
    mgr.disaggregation_mode = DisaggregationMode.PREFILL
    room_kv_hooks.on_manager_init(mgr, None)  # the real hook: the ledger, the ABORT handler swapped (SWAPS)
    return mgr


def test_the_swap_is_seen_in_place_while_the_manager_lives():
    mgr = _prefill_manager()
    assert fork_touch.swaps_applied(mgr, "prefill")[TARGET] is True


def test_a_replaced_manager_is_freed():
    old = _prefill_manager()
    gone = weakref.ref(old)
    new = _prefill_manager()  # upstream builds the next one; nothing of ours keeps the old
    del old
    gc.collect()
    assert gone() is None, [type(r).__name__ for r in gc.get_referrers(gone())]
    assert fork_touch.swaps_applied(new, "prefill")[TARGET] is True
