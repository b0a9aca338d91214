"""The fork's `sglang.srt.plugins` entry point.

Every hook the fork applies through upstream's HookRegistry is listed once in
HOOKS. Upstream only logs a hook that fails to apply, so `hooks_applied()` lets
tests (and the resource dump) assert that each target really was patched.
"""

import importlib

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

# (dotted target in upstream, "our_module:function", hook type)
HOOKS: list[tuple[str, str, HookType]] = [
    (
        "sglang.srt.managers.scheduler_components.internal_state."
        "SchedulerInternalStateController.get_internal_state",
        "sglang.srt.managers.pd_resource_report:add_to_internal_state",
        HookType.AFTER,
    ),
    # Transfer deadlines: expire overdue requests before each PD queue polls.
    (
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.pop_bootstrapped",
        "sglang.srt.disaggregation.transfer_deadline:before_pop_bootstrapped",
        HookType.BEFORE,
    ),
    (
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin."
        "resolve_waiting_queue_bootstrap",
        "sglang.srt.disaggregation.transfer_deadline:before_resolve_waiting",
        HookType.BEFORE,
    ),
    (
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin."
        "process_disagg_prefill_inflight_queue",
        "sglang.srt.disaggregation.transfer_deadline:before_prefill_inflight",
        HookType.BEFORE,
    ),
    (
        "sglang.srt.disaggregation.decode.DecodePreallocQueue.pop_preallocated",
        "sglang.srt.disaggregation.transfer_deadline:before_pop_preallocated",
        HookType.BEFORE,
    ),
    (
        "sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred",
        "sglang.srt.disaggregation.transfer_deadline:before_pop_transferred",
        HookType.BEFORE,
    ),
    # Decode's late handshake for a room prefill's deadline expired: answer Failed.
    (
        "sglang.srt.disaggregation.common.conn.CommonKVManager.update_status",
        "sglang.srt.disaggregation.transfer_deadline:around_update_status",
        HookType.AROUND,
    ),
    # A transfer worker that raises fails its in-flight room and starts again
    # (installed on MooncakeKVManager when the prefill queue builds its manager).
    (
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
        "sglang.srt.disaggregation.transfer_worker_guard:install",
        HookType.BEFORE,
    ),
]


def register() -> None:
    for target, ref, hook_type in HOOKS:
        module_name, fn_name = ref.split(":")
        hook = getattr(importlib.import_module(module_name), fn_name)
        HookRegistry.register(target, hook, hook_type)


def hooks_applied() -> dict[str, bool]:
    """Target -> whether HookRegistry patched it in this process."""
    return {target: target in HookRegistry._patched for target, _, _ in HOOKS}
