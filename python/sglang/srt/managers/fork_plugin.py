"""The fork's `sglang.srt.plugins` entry point, and the table of every way the fork touches upstream (HOOKS, SWAPS;
docs/layout.md "Ways the fork touches upstream"). Hooks on one target wrap in table order: the last is outermost.
"""

import importlib

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

AFTER, AROUND, BEFORE = HookType.AFTER, HookType.AROUND, HookType.BEFORE

# (dotted target in upstream, then "our_module:function", hook type)
HOOKS: list[tuple[str, str, HookType]] = [
    # the resource report (fork_pd_resources), with the requests held at the tokenizer's pause gate
    ("sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state",
     "sglang.srt.managers.pd_resource_report:add_to_internal_state", AFTER),
    ("sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.get_internal_state",
     "sglang.srt.managers.pd_pause:tm_internal_state", AROUND),
    # pause/release/resume/continue with PD requests in flight (docs/pause-release-resume.md): the tokenizer
    # and scheduler sides, the PD queues' buffers (pd_pause)
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager.pause_generation",
     "sglang.srt.managers.pd_pause:tm_pause_generation", AROUND),
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager.continue_generation",
     "sglang.srt.managers.pd_pause:tm_continue_generation", AROUND),
    ("sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.release_memory_occupation",
     "sglang.srt.managers.pd_pause:tm_release_memory_occupation", AROUND),
    ("sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.resume_memory_occupation",
     "sglang.srt.managers.pd_pause:tm_resume_memory_occupation", AROUND),
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager._release_req_states_on_failure",
     "sglang.srt.disaggregation.room_ledger:before_release_on_failure", BEFORE),
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager.abort_request",
     "sglang.srt.managers.pd_pause:tm_abort_request", AROUND),
    ("sglang.srt.managers.scheduler.Scheduler.pause_generation",
     "sglang.srt.managers.pd_pause:scheduler_pause_generation", AROUND),
    ("sglang.srt.managers.scheduler.Scheduler.continue_generation",
     "sglang.srt.managers.pd_pause:scheduler_continue_generation", AFTER),
    ("sglang.srt.managers.scheduler.Scheduler.abort_request",
     "sglang.srt.managers.pd_pause:abort_while_paused", AROUND),
    ("sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager.release_memory_occupation",
     "sglang.srt.managers.pd_pause:weight_updater_release", AROUND),
    ("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.release_memory_occupation",
     "sglang.srt.managers.pd_pause:queue_release", AROUND),
    ("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.resume_memory_occupation",
     "sglang.srt.managers.pd_pause:queue_resume", AROUND),
    ("sglang.srt.disaggregation.decode.DecodePreallocQueue.release_memory_occupation",
     "sglang.srt.managers.pd_pause:queue_release", AROUND),
    ("sglang.srt.disaggregation.decode.DecodePreallocQueue.resume_memory_occupation",
     "sglang.srt.managers.pd_pause:queue_resume", AROUND),
    ("sglang.srt.managers.scheduler.Scheduler._record_scheduler_state_for_paused_engine",
     "sglang.srt.managers.pd_pause:paused_loop_tick", AFTER),
    ("sglang.srt.utils.aio_rwlock.RWLock.is_locked",
     "sglang.srt.managers.pd_pause:around_is_locked", AROUND),
    ("sglang.srt.disaggregation.common.conn.AbortNotification.to_zmq",
     "sglang.srt.managers.pd_pause:abort_notification_with_why", AROUND),
    ("sglang.srt.managers.scheduler.Scheduler.send_abort_output",
     "sglang.srt.managers.pd_pause:pause_answer_kept", BEFORE),
    # A fake-backend decode serves a request sent without bootstrap_host (upstream crashed).
    ("sglang.srt.disaggregation.decode._bootstrap_addr",
     "sglang.srt.disaggregation.pd_queues:fake_bootstrap_addr", AROUND),
    # room_ledger: one per kv manager, the one way a room ends (drains owed by a peer,
    # ended rooms, ends decode decided before its scheduler),
    # and the one verdict on how a PD request that ends on a failure path is answered
    ("sglang.srt.disaggregation.utils.prepare_abort",
     "sglang.srt.disaggregation.room_ledger:prepare_abort_verdict", AROUND),
    ("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
     "sglang.srt.disaggregation.room_ledger:on_manager_init", AFTER),
    ("sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager",
     "sglang.srt.disaggregation.room_ledger:on_manager_init", AFTER),
    ("sglang.srt.disaggregation.common.conn.CommonKVReceiver.ensure_abort_notified",
     "sglang.srt.disaggregation.room_ledger:after_ensure_abort_notified", AFTER),
    ("sglang.srt.managers.scheduler.Scheduler.send_abort_output",
     "sglang.srt.disaggregation.room_ledger:after_send_abort_output", AFTER),
    # its memory of ended rooms: a late handshake is answered Failed, a room decode
    # cancelled first fails at creation; and the one hook on record_failure
    ("sglang.srt.disaggregation.common.conn.CommonKVManager.update_status",
     "sglang.srt.disaggregation.room_ledger:around_update_status", AROUND),
    ("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.create_sender",
     "sglang.srt.disaggregation.room_ledger:on_prefill_create_sender", AFTER),
    ("sglang.srt.disaggregation.common.conn.CommonKVSender.clear",
     "sglang.srt.disaggregation.room_ledger:on_sender_clear", AFTER),
    ("sglang.srt.disaggregation.common.conn.CommonKVManager.record_failure",
     "sglang.srt.disaggregation.room_ledger:around_record_failure", AROUND),
    # Transfer deadlines: expire overdue requests before each PD queue polls.
    ("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.pop_bootstrapped",
     "sglang.srt.disaggregation.transfer_deadline:before_pop_bootstrapped", BEFORE),
    ("sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.resolve_waiting_queue_bootstrap",
     "sglang.srt.disaggregation.transfer_deadline:before_resolve_waiting", BEFORE),
    ("sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue",
     "sglang.srt.disaggregation.transfer_deadline:before_prefill_inflight", BEFORE),
    ("sglang.srt.disaggregation.decode.DecodePreallocQueue.pop_preallocated",
     "sglang.srt.disaggregation.transfer_deadline:before_pop_preallocated", BEFORE),
    ("sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred",
     "sglang.srt.disaggregation.transfer_deadline:before_pop_transferred", BEFORE),
    # A prefill request routed to a lost decode ends within seconds as peer loss (docs/gateway.md).
    ("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.pop_bootstrapped",
     "sglang.srt.disaggregation.peer_liveness:before_pop_bootstrapped", BEFORE),
    # A transfer worker that raises fails its in-flight room and starts again.
    ("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
     "sglang.srt.disaggregation.chunk_failures:guard_transfer_worker", BEFORE),
    # chunk_failures: failed chunk writes fail only their room, on both sides
    ("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
     "sglang.srt.disaggregation.chunk_failures:on_prefill_manager_init", AFTER),
    ("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.add",
     "sglang.srt.disaggregation.chunk_failures:on_prefill_add", AFTER),
    ("sglang.srt.disaggregation.common.conn.CommonKVSender.clear",
     "sglang.srt.disaggregation.chunk_failures:on_sender_clear", AFTER),
    ("sglang.srt.disaggregation.decode.DecodeTransferQueue._record_transfer_failure",
     "sglang.srt.disaggregation.chunk_failures:on_decode_transfer_failure", AFTER),
    # room_ledger (aborts): aborts end as aborts, never successes, and leave nothing behind.
    ("sglang.srt.managers.scheduler.Scheduler.abort_request",
     "sglang.srt.disaggregation.room_ledger:before_abort_request", BEFORE),
    ("sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin._retire_aborted_prefill_result",
     "sglang.srt.disaggregation.room_ledger:after_retire_aborted", AFTER),
    ("sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.release_aborted_prefill_waiting_req",
     "sglang.srt.disaggregation.room_ledger:after_release_aborted_waiting", AFTER),
    ("sglang.srt.managers.scheduler.Scheduler.process_pending_chunked_abort",
     "sglang.srt.disaggregation.room_ledger:around_pending_chunked_abort", AROUND),
    # peer_liveness: a crashed peer is noticed at once, its requests end (502), a restart is served.
    ("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
     "sglang.srt.disaggregation.peer_liveness:on_prefill_manager_init", AFTER),
    ("sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager",
     "sglang.srt.disaggregation.peer_liveness:on_decode_manager_init", AFTER),
    ("sglang.srt.disaggregation.common.conn.CommonKVManager._handle_node_failure",
     "sglang.srt.disaggregation.peer_liveness:around_handle_node_failure", AROUND),
    ("sglang.srt.disaggregation.common.conn.CommonKVManager._send_multipart_locked",
     "sglang.srt.disaggregation.peer_liveness:around_send_multipart_locked", AROUND),
    ("sglang.srt.disaggregation.common.conn.CommonKVManager.try_ensure_parallel_info",
     "sglang.srt.disaggregation.peer_liveness:after_try_ensure_parallel_info", AFTER),
    ("sglang.srt.disaggregation.common.conn.CommonKVManager.conclude_transfer",
     "sglang.srt.disaggregation.peer_liveness:around_conclude_transfer", AROUND),
    # transfer_deadline: decode fetches a prefill's info and endpoints on its pool, not the scheduler
    ("sglang.srt.disaggregation.decode.DecodePreallocQueue._ensure_prefill_info",
     "sglang.srt.disaggregation.transfer_deadline:around_ensure_prefill_info", AROUND),
    ("sglang.srt.disaggregation.common.conn.CommonKVManager.try_ensure_parallel_info",
     "sglang.srt.disaggregation.transfer_deadline:around_try_ensure_parallel_info", AROUND),
    ("sglang.srt.disaggregation.decode.DecodePreallocQueue._init_receiver",
     "sglang.srt.disaggregation.transfer_deadline:around_init_receiver", AROUND),
    ("sglang.srt.disaggregation.common.conn.CommonKVReceiver._get_bootstrap_info_from_server",
     "sglang.srt.disaggregation.transfer_deadline:around_get_bootstrap_info_from_server", AROUND),
    # The start-up check of SWAPS: last, after every AFTER hook above that makes a swap.
    ("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
     "sglang.srt.managers.fork_touch:check_at_start", AFTER),
    ("sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager",
     "sglang.srt.managers.fork_touch:check_at_start", AFTER),
    # decode's running requests an abort ends are counted by cause (request_end_cause)
    ("sglang.srt.managers.scheduler.Scheduler.process_batch_result",
     "sglang.srt.disaggregation.request_end_cause:after_process_batch_result", AFTER),
    ("sglang.srt.managers.scheduler.Scheduler.send_abort_output",
     "sglang.srt.disaggregation.request_end_cause:before_send_abort_output", BEFORE),
]

# (upstream "module.Class.attribute", then "our_module:function" making the swap through fork_touch.swap(), kind
#  "instance" (each object of that class) or "class" (the class itself), role whose kv manager gets it)
SWAPS: list[tuple[str, str, str, str]] = [
    # the bootstrap thread looks it up per message: a decode registration is seen at once
    ("sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._publish_peer_registration",
     "sglang.srt.disaggregation.peer_liveness:on_prefill_manager_init", "instance", "prefill"),
    # decode's ABORT, before upstream's handler: kept for a room prefill has not created
    # yet, the reason recorded for a live one (an abort, not a failure); mooncake and nixl
    ("sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._handle_abort_notification",
     "sglang.srt.disaggregation.room_ledger:on_manager_init", "instance", "prefill"),
    ("sglang.srt.disaggregation.nixl.conn.NixlKVManager._handle_abort_notification",
     "sglang.srt.disaggregation.room_ledger:on_manager_init", "instance", "prefill"),
    # a failed write nominates a session; only a failed probe blacklists it
    ("sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.failed_sessions",
     "sglang.srt.disaggregation.chunk_failures:on_prefill_manager_init", "instance", "prefill"),
    # a session comes back only once a read from it completes (docs/chunk-failures.md)
    ("sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._send_probe",
     "sglang.srt.disaggregation.chunk_failures:on_prefill_manager_init", "instance", "prefill"),
    # a transfer worker that raises fails its in-flight room and starts again
    ("sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.transfer_worker",
     "sglang.srt.disaggregation.chunk_failures:guard_transfer_worker", "class", "prefill"),
]


def register() -> None:
    for target, ref, hook_type in HOOKS:
        module_name, fn_name = ref.split(":")
        hook = getattr(importlib.import_module(module_name), fn_name)
        HookRegistry.register(target, hook, hook_type)


def hooks_applied() -> dict[str, bool]:
    """Target -> whether HookRegistry patched it in this process."""
    return {target: target in HookRegistry._patched for target, _, _ in HOOKS}
