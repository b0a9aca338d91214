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
    # pd_pause: pause/release/resume/continue with PD requests in flight.
    (
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.pause_generation",
        "sglang.srt.managers.pd_pause:tm_pause_generation",
        HookType.AROUND,
    ),
    (
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.continue_generation",
        "sglang.srt.managers.pd_pause:tm_continue_generation",
        HookType.AROUND,
    ),
    (
        "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.release_memory_occupation",
        "sglang.srt.managers.pd_pause:tm_release_memory_occupation",
        HookType.AROUND,
    ),
    (
        "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.resume_memory_occupation",
        "sglang.srt.managers.pd_pause:tm_resume_memory_occupation",
        HookType.AROUND,
    ),
    (
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.abort_request",
        "sglang.srt.managers.pd_pause:tm_abort_request",
        HookType.AFTER,
    ),
    (
        "sglang.srt.managers.scheduler.Scheduler.pause_generation",
        "sglang.srt.managers.pd_pause:scheduler_pause_generation",
        HookType.AROUND,
    ),
    (
        "sglang.srt.managers.scheduler.Scheduler.continue_generation",
        "sglang.srt.managers.pd_pause:scheduler_continue_generation",
        HookType.AFTER,
    ),
    (
        "sglang.srt.managers.scheduler.Scheduler.abort_request",
        "sglang.srt.managers.pd_pause:after_abort",
        HookType.AFTER,
    ),
    (
        "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager.release_memory_occupation",
        "sglang.srt.managers.pd_pause:weight_updater_release",
        HookType.AROUND,
    ),
    (
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.release_memory_occupation",
        "sglang.srt.managers.pd_pause:queue_release",
        HookType.AROUND,
    ),
    (
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.resume_memory_occupation",
        "sglang.srt.managers.pd_pause:queue_resume",
        HookType.AROUND,
    ),
    (
        "sglang.srt.disaggregation.decode.DecodePreallocQueue.release_memory_occupation",
        "sglang.srt.managers.pd_pause:queue_release",
        HookType.AROUND,
    ),
    (
        "sglang.srt.disaggregation.decode.DecodePreallocQueue.resume_memory_occupation",
        "sglang.srt.managers.pd_pause:queue_resume",
        HookType.AROUND,
    ),
    (
        "sglang.srt.managers.scheduler.Scheduler._record_scheduler_state_for_paused_engine",
        "sglang.srt.managers.pd_pause:paused_loop_tick",
        HookType.AFTER,
    ),
    (
        "sglang.srt.disaggregation.utils.prepare_abort",
        "sglang.srt.managers.pd_pause:pause_abort_status",
        HookType.AROUND,
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
