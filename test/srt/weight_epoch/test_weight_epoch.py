"""weight_epoch over upstream's own RadixCache and token allocator (no server, fast): after a weight
update no lookup matches KV cached before it, what no request holds is freed at once, and what a
request held is freed when it lets go. The end-to-end proof (greedy outputs after an update equal
a fresh server's, every pause mode) is test_pause_greedy_e2e.py."""

from __future__ import annotations

import inspect
from array import array
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.managers.fork_cache import weight_epoch
from sglang.srt.managers.schedule_batch import ReqKvInfo
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

pytestmark = pytest.mark.unit

SIZE = 64
PREFIX = list(range(100, 110))


def _tree():
    allocator = TokenToKVPoolAllocator(SIZE, torch.float32, "cpu", None, need_sort=False)
    return RadixCache.create_simulated(mock_allocator=allocator), allocator


def _insert(tree, allocator, tokens, extra_key=None):
    values = allocator.alloc(len(tokens))
    result = tree.insert(InsertParams(key=RadixKey(array("q", tokens), extra_key), value=values))
    allocator.free(values[: result.prefix_len])  # the duplicate of what was cached already (upstream's rule)
    return tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), extra_key))).last_device_node


def _matched(tree, tokens, extra_key=None) -> int:
    return tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), extra_key))).device_prefix_len


def _request(extra_key=None, holds_kv=False):
    return SimpleNamespace(extra_key=extra_key, kv=ReqKvInfo(req_pool_idx=0 if holds_kv else None))


def test_an_update_evicts_what_no_request_holds_and_hides_what_one_holds():
    tree, allocator = _tree()
    _insert(tree, allocator, PREFIX + [1, 2, 3, 4])
    held = _insert(tree, allocator, PREFIX + [7, 8, 9])
    tree.inc_lock_ref(held)  # a paused request holds the prefix and its own tail
    assert allocator.available_size() == SIZE - 17

    state = weight_epoch.on_weights_changed(tree)
    assert (state.epoch, state.evicted_at_update, state.stale_held) == (1, 4, True)
    assert allocator.available_size() == SIZE - 13  # the unheld tail is free; the held path stays

    # A request that holds no KV matches in the new epoch: nothing of the old weights.
    new = _request()
    weight_epoch.before_match(new, tree)
    assert new.extra_key == "fork-weights=1"
    assert _matched(tree, PREFIX + [7, 8, 9], new.extra_key) == 0
    # Without the epoch the old KV would be read (what the fork prevents).
    assert _matched(tree, PREFIX + [7, 8, 9]) == 13
    # The holder keeps its epoch: its KV is its own and stays as it is.
    holder = _request(holds_kv=True)
    weight_epoch.before_match(holder, tree)
    assert holder.extra_key is None

    # New KV under the new epoch never shares a node with the old.
    fresh = _insert(tree, allocator, PREFIX + [7], new.extra_key)
    assert _matched(tree, PREFIX + [7], new.extra_key) == 11 and fresh.key.extra_key == "fork-weights=1"
    assert allocator.available_size() == SIZE - 13 - 11

    # While the holder holds, a sweep frees nothing; once it lets go, the old path is freed.
    assert weight_epoch.sweep(tree) == 0 and state.stale_held
    tree.dec_lock_ref(held)
    assert weight_epoch.sweep(tree) == 13
    assert allocator.available_size() == SIZE - 11
    assert _matched(tree, PREFIX + [7], new.extra_key) == 11  # the new epoch's KV is untouched
    assert weight_epoch.sweep(tree) == 0 and not state.stale_held  # nothing of an earlier epoch left
    assert state.swept == 13


def test_the_epoch_is_appended_to_a_request_s_own_key_once_per_match():
    tree, _ = _tree()
    req = _request(extra_key="lora-7")
    weight_epoch.before_match(req, tree)
    assert req.extra_key == "lora-7"  # no update yet: upstream's keys unchanged
    weight_epoch.on_weights_changed(tree)
    weight_epoch.on_weights_changed(tree)
    weight_epoch.before_match(req, tree)
    weight_epoch.before_match(req, tree)
    assert req.extra_key == "lora-7|fork-weights=2"
    assert weight_epoch.epoch_of(req.extra_key) == 2
    assert weight_epoch.epoch_of("lora-7") == 0 and weight_epoch.epoch_of("xfork-weights=3") == 0


def test_a_helper_tree_without_an_update_leaves_the_key_alone():
    """upstream's scheduling policy matches waiting requests in a helper tree of its own."""
    tree, _ = _tree()
    helper, _ = _tree()
    weight_epoch.on_weights_changed(tree)
    req = _request()
    weight_epoch.before_match(req, tree)
    weight_epoch.before_match(req, helper)
    assert req.extra_key == "fork-weights=1"


def _updater(tree, flushed: bool):
    """What upstream's flush_cache_after_weight_update reads on its manager: the flush and, for the
    fork, the scheduler (its tree, its requests: none here, no PD queues)."""
    scheduler = SimpleNamespace(tree_cache=tree, running_batch=SimpleNamespace(reqs=[]), waiting_queue=[],
                                last_batch=None, chunked_req=None, disaggregation_mode="null")
    return SimpleNamespace(flush_cache=lambda empty_cache=True: flushed, scheduler=scheduler)


def test_a_flush_refused_for_held_requests_is_answered_as_done_and_names_what_stays():
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

    # upstream's own (unwrapped: another test module may have loaded the fork's hooks in this process)
    upstream_step = inspect.unwrap(SchedulerWeightUpdaterManager.flush_cache_after_weight_update)
    tree, allocator = _tree()
    tree.inc_lock_ref(_insert(tree, allocator, PREFIX))
    request = SimpleNamespace(flush_cache=True, torch_empty_cache=False)
    # upstream alone: 400 "Weights were updated, but the cache was not flushed"
    assert upstream_step(_updater(tree, False), request, True, "Succeeded.")[0] is False

    ok, message = weight_epoch.around_flush_after_update(upstream_step, _updater(tree, False), request, True,
                                                         "Succeeded.")
    assert ok and message.startswith("Succeeded. The cache was not reset because requests are paused or running")
    assert "no request admitted from now on reads KV cached under the earlier weights (10 cached token(s)" in message
    assert weight_epoch.state_of(tree).flushes_answered == 1
    # An idle flush, a failed load and flush_cache false keep upstream's answer.
    assert weight_epoch.around_flush_after_update(upstream_step, _updater(tree, True), request, True, "S.") == (
        True, "S.")
    assert weight_epoch.around_flush_after_update(upstream_step, _updater(tree, True), request, False, "bad") == (
        False, "bad")
    no_flush = SimpleNamespace(flush_cache=False, torch_empty_cache=False)
    assert weight_epoch.around_flush_after_update(upstream_step, _updater(tree, False), no_flush, True, "S.") == (
        True, "S.")
    assert weight_epoch.state_of(tree).epoch == 4  # every update that changed weights starts an epoch


def test_a_tree_the_fork_cannot_walk_is_evicted_once_when_the_last_holder_lets_go():
    """0.5.23's default tree (UnifiedRadixCache) keeps its nodes in a Rust core: what the update's holders held is
    freed by one more whole eviction once none of them holds KV (stood in by a RadixCache subclass, which the
    targeted sweep does not walk)."""

    class OtherTree(RadixCache):
        pass

    allocator = TokenToKVPoolAllocator(SIZE, torch.float32, "cpu", None, need_sort=False)
    tree = RadixCache.create_simulated(mock_allocator=allocator)
    tree.__class__ = OtherTree  # create_simulated builds the base class
    held = _insert(tree, allocator, PREFIX + [1, 2])
    tree.inc_lock_ref(held)
    holder = _request(holds_kv=True)
    state = weight_epoch.on_weights_changed(tree, [holder, _request()])  # the second holds no KV: not waited for
    assert state.stale_held and len(state.holders) == 1 and state.as_dict()["holders"] == 1
    fresh_key = weight_epoch.namespaced(None, state.epoch)
    _insert(tree, allocator, PREFIX + [3], fresh_key)  # a new request's cache, after the update
    assert weight_epoch.sweep(tree) == 0 and allocator.available_size() == SIZE - 12 - 11
    tree.dec_lock_ref(held)
    holder.kv.req_pool_idx = None  # the holder ended
    assert weight_epoch.sweep(tree) == 12 + 11 and allocator.available_size() == SIZE
    assert not state.stale_held and weight_epoch.sweep(tree) == 0
