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
    # chunk_failures: failed chunk writes fail only their room, on both sides
    (
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
        "sglang.srt.disaggregation.chunk_failures:on_prefill_manager_init",
        HookType.AFTER,
    ),
    (
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.add",
        "sglang.srt.disaggregation.chunk_failures:on_prefill_add",
        HookType.AFTER,
    ),
    (
        "sglang.srt.disaggregation.common.conn.CommonKVSender.clear",
        "sglang.srt.disaggregation.chunk_failures:on_sender_clear",
        HookType.AFTER,
    ),
    (
        "sglang.srt.disaggregation.decode.DecodeTransferQueue._record_transfer_failure",
        "sglang.srt.disaggregation.chunk_failures:on_decode_transfer_failure",
        HookType.AFTER,
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
