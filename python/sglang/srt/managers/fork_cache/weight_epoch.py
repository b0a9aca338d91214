"""No request admitted after a weight update reads KV that earlier weights wrote (docs/pause-release-resume.md,
"After a weight update").

Every call that changes the served weights takes upstream's `flush_cache_after_weight_update` (update_weights_
from_disk / _from_tensor / _from_distributed / _from_ipc, once the target model changed). There the fork starts a
new *weight epoch* on the scheduler's prefix cache (`on_weights_changed`), whatever the pause mode and
`flush_cache`:

- a request's cache key carries the epoch it matched in, through upstream's own namespace mechanism
  (`RadixKey.extra_key`, as elastic EP's `_maybe_namespace_elastic_radix_cache` does): a node inserted under an
  earlier epoch is never matched again (`before_match`, at every match of a request that holds no KV);
- every node no request holds is evicted at once (upstream's `evict`);
- nodes a paused or running request still holds stay, unreachable, and are freed once their holders let go
  (`sweep`, each scheduler iteration while any are left): upstream's plain `RadixCache` frees each one as its last
  holder lets go; any other tree (0.5.23's default `UnifiedRadixCache`, whose nodes live in its Rust core) is
  evicted once more, whole, when the last request that held KV at the update ended (what requests cached since
  the update is recomputed once).

A request holding KV when the weights change keeps its epoch: its own KV and what it inserts on finish stay
under the old one (`in_place` continues on its old KV, as documented). A retracted or queued request holds none
and matches in the new epoch. With the cache invalidated so, the flush an update asks for (`flush_cache: true`)
is as done as it can be without dropping paused requests: the call answers success with a message saying so,
where upstream answers 400 "Weights were updated, but the cache was not flushed".

Thread: the scheduler's. Ranks: the update is one request broadcast to every rank and handled in the same
iteration, the trees are replicas, so every rank takes the same decisions; nothing here calls a collective.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

from sglang.srt.managers.fork_core.fork_touch import upstream

TAG = "fork-weights="  # the epoch's part of a RadixKey's extra_key, appended as upstream's elastic EP does
_STATE = "_fork_weight_epoch"  # on the scheduler's tree cache (the one object the match sees)
_BASE = "_fork_extra_key"  # on a Req: its extra_key before any epoch was added


@dataclasses.dataclass
class WeightEpoch:
    epoch: int = 0
    stale_held: bool = False  # nodes of an earlier epoch may remain (held at the update, or by then)
    holders: list = dataclasses.field(default_factory=list, repr=False)  # requests holding KV at the update
    updates: int = 0
    evicted_at_update: int = 0  # tokens, last update
    swept: int = 0  # tokens of earlier epochs freed after their holders ended, in all
    flushes_answered: int = 0  # updates whose refused flush the fork answered as done

    def as_dict(self) -> Dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "holders"}
        out["holders"] = len(self.holders)
        return out


def namespaced(base: Optional[str], epoch: int) -> Optional[str]:
    if epoch == 0:
        return base  # before any update: upstream's keys, unchanged
    tag = f"{TAG}{epoch}"
    return f"{base}|{tag}" if base else tag


def epoch_of(extra_key: Optional[str]) -> int:
    head, sep, number = (extra_key or "").rpartition(TAG)
    if not sep or (head and not head.endswith("|")) or not number.isdigit():
        return 0
    return int(number)


def state_of(tree_cache) -> Optional[WeightEpoch]:
    """The tree's epoch; None for a tree whose weights never changed (or a helper tree of upstream's)."""
    return vars(tree_cache).get(_STATE)


def before_match(req, tree_cache, *args, **kwargs) -> None:
    """BEFORE mem_cache.common.match_kv_cache: a request holding no KV matches in the tree's current epoch."""
    state = state_of(tree_cache)
    if state is None or req.kv.holds_kv:
        return
    base = vars(req).setdefault(_BASE, req.extra_key)
    req.extra_key = namespaced(base, state.epoch)


def _evict_all_unheld(tree_cache) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    evictable = int(tree_cache.evictable_size())
    if evictable == 0:
        return 0
    return int(tree_cache.evict(EvictParams(num_tokens=evictable)).num_tokens_evicted or 0)


def on_weights_changed(tree_cache, holders: Sequence[Any] = ()) -> WeightEpoch:
    """A new epoch: nothing cached so far is matched again; what no request holds is freed now. `holders`: the
    requests holding KV now (their cached prefixes stay until they let go)."""
    state = vars(tree_cache).setdefault(_STATE, WeightEpoch())
    state.epoch += 1
    state.updates += 1
    if not tree_cache.supports_prefix_sharing():
        return state
    state.evicted_at_update = _evict_all_unheld(tree_cache)
    state.holders = [req for req in holders if req.kv.holds_kv] + state.holders
    state.stale_held = bool(state.holders) or int(tree_cache.protected_size()) > 0
    return state


def kv_holders(scheduler) -> List[Any]:
    """The scheduler's requests that hold KV now (running or last batch, chunked, queued with KV; PD queues)."""
    from sglang.srt.disaggregation.fork_ending import pd_queues

    reqs = pd_queues.held_reqs(scheduler)  # waiting queue, PD queues, running and last batch (any mode)
    if scheduler.chunked_req is not None:
        reqs.append(scheduler.chunked_req)  # held_reqs names it for a prefill only
    unique = {id(req): req for req in reqs}
    return [req for req in unique.values() if req.kv.holds_kv]


def around_flush_after_update(original, weight_updater, recv_req, success: bool, message: str,
                              *args, **kwargs) -> Tuple[bool, str]:
    """AROUND SchedulerWeightUpdaterManager.flush_cache_after_weight_update (every update that changed weights)."""
    scheduler = upstream(weight_updater, "scheduler")
    tree_cache = upstream(scheduler, "tree_cache")
    state = on_weights_changed(tree_cache, kv_holders(scheduler))
    ok, answer = original(weight_updater, recv_req, success, message, *args, **kwargs)
    if success and not ok:  # upstream refused the flush (requests running or queued); the epoch stands for it
        state.flushes_answered += 1
        held = int(tree_cache.protected_size()) if tree_cache.supports_prefix_sharing() else 0
        answer = (f"{message} The cache was not reset because requests are paused or running; no request "
                  f"admitted from now on reads KV cached under the earlier weights ({held} cached token(s) are "
                  "still held by those requests, which continue on them, and are freed when they end).")
        return True, answer
    return ok, answer


def sweep(tree_cache) -> int:
    """Evict nodes of earlier epochs that no request holds any more; returns the tokens freed."""
    state = state_of(tree_cache)
    if state is None or not state.stale_held:
        return 0
    from sglang.srt.mem_cache.radix_cache import RadixCache

    state.holders = [req for req in state.holders if req.kv.holds_kv]
    if type(tree_cache) is not RadixCache:  # nodes we cannot walk: the whole tree once, when no holder is left
        if state.holders:
            return 0
        state.stale_held = False
        freed = _evict_all_unheld(tree_cache)
        state.swept += freed
        return freed
    root = upstream(tree_cache, "root_node")
    if not any(epoch_of(child.key.extra_key) != state.epoch for child in root.children.values()):
        state.stale_held = False
        return 0
    stack = [leaf for leaf in upstream(tree_cache, "evictable_leaves")
             if epoch_of(leaf.key.extra_key) != state.epoch]
    freed = 0
    while stack:  # upstream's evict loop, over these leaves only
        node = stack.pop()
        tree_cache.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
        freed += len(node.value)
        upstream(tree_cache, "_delete_leaf")(node)
        upstream(tree_cache, "kv_events").record_remove(node)
        parent = node.parent
        if parent is not root and not parent.children and parent.lock_ref == 0:
            stack.append(parent)
    state.swept += freed
    return freed


def after_process_input_requests(result, scheduler, *args, **kwargs):
    """AFTER Scheduler.process_input_requests (every iteration, paused or not): free what holders let go."""
    sweep(scheduler.tree_cache)
    return result


def report(scheduler) -> Optional[Dict[str, Any]]:
    state = state_of(scheduler.tree_cache)
    return None if state is None else state.as_dict()
