"""The fork's `sglang.srt.plugins` entry point: every way the fork touches upstream (docs/layout.md "Ways the fork
touches upstream"). Hooks on one target wrap in table order: the last is outermost. Module level is standard
library only, so tools/fork and the tests read the tables without importing sglang."""

import importlib

SRT = "sglang.srt."
# The fork's modules that hold hooks, by the short name the tables below use.
OURS = {name.rpartition(".")[2]: SRT + name for name in (
    "disaggregation.fork_ending.room_kv_hooks", "disaggregation.fork_ending.room_scheduler_hooks",
    "disaggregation.fork_ending.room_telling", "disaggregation.fork_ending.pd_queues",
    "disaggregation.fork_ending.request_end_cause", "disaggregation.fork_ending.room_agreement",
    "disaggregation.fork_ending.bootstrap_door",
    "disaggregation.fork_peers.prefill_side_monitor", "disaggregation.fork_peers.decode_side_monitor",
    "disaggregation.fork_peers.lost_handshake",
    "disaggregation.fork_transfer.transfer_deadline", "disaggregation.fork_transfer.chunk_failures",
    "disaggregation.fork_transfer.poison_expiry",
    "disaggregation.fork_transfer.idle_pacing", "disaggregation.fork_transfer.paced_write",
    "disaggregation.fork_transfer.worker_handoff",
    "managers.fork_pause.pd_pause", "managers.fork_pause.scheduler_pause", "managers.fork_pause.queue_buffers",
    "managers.fork_pause.pause_gate", "managers.fork_pause.tokenizer_pause", "managers.fork_pause.resend_wait",
    "managers.fork_core.fork_touch", "managers.fork_report.pd_resource_report", "managers.fork_report.pd_metrics",
    "managers.fork_cache.weight_epoch", "managers.fork_core.rank_agreement", "disaggregation.fork_recovery.recovery")}
AFTER, AROUND, BEFORE = "AFTER", "AROUND", "BEFORE"  # upstream's HookType names


def _full(target: str, ref: str) -> tuple[str, str]:
    module, _, fn = ref.partition(":")
    return SRT + target, f"{OURS[module]}:{fn}"


# (upstream target under sglang.srt, our "module:function", HookType name), sorted by target: the hooks on one
# target sit together (tools/fork check rejects them apart), in wrap order: the first is innermost, the last
# outermost (its BEFORE runs first, its AFTER last).
HOOKS: list[tuple[str, str, str]] = [_full(target, ref) + (kind,) for target, ref, kind in [
    ("disaggregation.common.conn.AbortNotification.to_zmq", "pd_pause:abort_notification_with_why", AROUND),
    ("disaggregation.common.conn.CommonKVManager._fail_prefill_recompute",
     "room_kv_hooks:around_fail_prefill_recompute", AROUND),
    ("disaggregation.common.conn.CommonKVManager._get_prefill_recompute_session",
     "resend_wait:fresh_connection_per_resend", AFTER),
    ("disaggregation.common.conn.CommonKVManager._handle_node_failure",
     "decode_side_monitor:around_handle_node_failure", AROUND),
    ("disaggregation.common.conn.CommonKVManager._send_multipart_locked",
     "prefill_side_monitor:around_send_multipart_locked", AROUND),
    # the ledger's AROUND (inner), then decode's scheduler is woken from its idle pace (idle_pacing's AFTER, outer)
    ("disaggregation.common.conn.CommonKVManager.apply_prefill_status", "room_kv_hooks:around_apply_prefill_status",
     AROUND),
    ("disaggregation.common.conn.CommonKVManager.apply_prefill_status", "idle_pacing:after_apply_prefill_status",
     AFTER),
    ("disaggregation.common.conn.CommonKVManager.conclude_transfer", "prefill_side_monitor:around_conclude_transfer",
     AROUND),
    ("disaggregation.common.conn.CommonKVManager.parse_kv_status_message",
     "room_kv_hooks:around_parse_kv_status_message", AROUND),
    ("disaggregation.common.conn.CommonKVManager.record_failure", "room_kv_hooks:around_record_failure", AROUND),
    # a poison mark (every path upstream adds one) expires with decode's release deadline, noted once it exists
    ("disaggregation.common.conn.CommonKVManager.poison_deferred_ack_room", "poison_expiry:after_poison", AFTER),
    # decode_side_monitor's AFTER (inner): a lost prefill fetched again is back; transfer_deadline's AROUND (outer): the
    # scheduler takes a pool thread's fetched outcome
    ("disaggregation.common.conn.CommonKVManager.try_ensure_parallel_info",
     "decode_side_monitor:after_try_ensure_parallel_info", AFTER),
    ("disaggregation.common.conn.CommonKVManager.try_ensure_parallel_info",
     "transfer_deadline:around_try_ensure_parallel_info", AROUND),
    # the ledger's AROUND (inner); then a room another thread made WaitingForInput (prefill: decode's handshake
    # arrived) wakes the scheduler from its idle pace (idle_pacing's AFTER, outer)
    ("disaggregation.common.conn.CommonKVManager.update_status", "room_kv_hooks:around_update_status", AROUND),
    ("disaggregation.common.conn.CommonKVManager.update_status", "idle_pacing:after_update_status", AFTER),
    ("disaggregation.common.conn.CommonKVReceiver._get_bootstrap_info_from_server",
     "transfer_deadline:around_get_bootstrap_info_from_server", AROUND),
    ("disaggregation.common.conn.CommonKVReceiver.ensure_abort_notified",
     "room_kv_hooks:after_ensure_abort_notified", AFTER),
    # a room concluded Success takes a failure record written before its clear with it
    ("disaggregation.common.conn.CommonKVReceiver.clear", "room_kv_hooks:after_receiver_clear", AFTER),
    # decode claims the room with prefill as the request enters its prealloc queue (the lost-decode handshake rule)
    ("disaggregation.common.conn.CommonKVReceiver.init", "decode_side_monitor:after_receiver_init", AFTER),
    # room_kv_hooks' AFTER runs first (a failed room remembered as ended), then chunk_failures'
    ("disaggregation.common.conn.CommonKVSender.clear", "room_kv_hooks:on_sender_clear", AFTER),
    ("disaggregation.common.conn.CommonKVSender.clear", "chunk_failures:on_sender_clear", AFTER),
    ("disaggregation.common.conn.CommonKVSender.clear", "prefill_side_monitor:on_sender_clear", AFTER),
    # prefill's scheduler lets a parked transfer worker take the chunk it just queued before going on (worker_handoff;
    # on the sender, not on mooncake's add_transfer_request: loading the hooks must not import mooncake/conn.py)
    ("disaggregation.common.conn.CommonKVSender.send", "worker_handoff:after_send", AFTER),
    ("disaggregation.decode.DecodePreallocQueue._ensure_prefill_info",
     "transfer_deadline:around_ensure_prefill_info", AROUND),
    # the ledger first (decode's monitor registers with it: RoomLedger.watch_peers); the start-up check of SWAPS last
    ("disaggregation.decode.DecodePreallocQueue._init_kv_manager", "room_kv_hooks:on_manager_init", AFTER),
    ("disaggregation.decode.DecodePreallocQueue._init_kv_manager", "decode_side_monitor:on_decode_manager_init",
     AFTER),
    ("disaggregation.decode.DecodePreallocQueue._init_kv_manager", "fork_touch:check_at_start", AFTER),
    ("disaggregation.decode.DecodePreallocQueue._init_receiver", "transfer_deadline:around_init_receiver", AROUND),
    ("disaggregation.decode.DecodePreallocQueue.pop_preallocated", "transfer_deadline:before_pop_preallocated", BEFORE),
    ("disaggregation.decode.DecodePreallocQueue.release_memory_occupation", "queue_buffers:queue_release", AROUND),
    ("disaggregation.decode.DecodePreallocQueue.resume_memory_occupation", "queue_buffers:queue_resume", AROUND),
    ("disaggregation.decode.DecodeTransferQueue._record_transfer_failure",
     "chunk_failures:on_decode_transfer_failure", AFTER),
    ("disaggregation.decode.DecodeTransferQueue.pop_transferred", "transfer_deadline:before_pop_transferred", BEFORE),
    ("disaggregation.decode._bootstrap_addr", "pd_queues:fake_bootstrap_addr", AROUND),
    # the ledger first; guard_transfer_worker's BEFORE patches the class before
    # upstream builds the manager; the start-up check of SWAPS last, after every AFTER hook that makes a swap
    ("disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager", "room_kv_hooks:on_manager_init", AFTER),
    ("disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager", "chunk_failures:guard_transfer_worker", BEFORE),
    ("disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager", "chunk_failures:on_prefill_manager_init", AFTER),
    ("disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager", "prefill_side_monitor:on_prefill_manager_init",
     AFTER),
    ("disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager", "paced_write:on_prefill_manager_init", AFTER),
    ("disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager", "fork_touch:check_at_start", AFTER),
    ("disaggregation.prefill.PrefillBootstrapQueue.add", "chunk_failures:on_prefill_add", AFTER),
    ("disaggregation.prefill.PrefillBootstrapQueue.create_sender", "room_kv_hooks:on_prefill_create_sender", AFTER),
    # outermost first: expired poison marks dropped (poison_expiry), a lost decode's handshake (lost_handshake),
    # then the deadlines
    ("disaggregation.prefill.PrefillBootstrapQueue.pop_bootstrapped",
     "transfer_deadline:before_pop_bootstrapped", BEFORE),
    ("disaggregation.prefill.PrefillBootstrapQueue.pop_bootstrapped", "lost_handshake:before_pop_bootstrapped", BEFORE),
    ("disaggregation.prefill.PrefillBootstrapQueue.pop_bootstrapped", "poison_expiry:expire_poison", BEFORE),
    ("disaggregation.prefill.PrefillBootstrapQueue.release_memory_occupation", "queue_buffers:queue_release", AROUND),
    ("disaggregation.prefill.PrefillBootstrapQueue.resume_memory_occupation", "queue_buffers:queue_resume", AROUND),
    ("disaggregation.prefill.SchedulerDisaggregationPrefillMixin._retire_aborted_prefill_result",
     "room_scheduler_hooks:after_retire_aborted", AFTER),
    ("disaggregation.prefill.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue",
     "transfer_deadline:before_prefill_inflight", BEFORE),
    ("disaggregation.prefill.SchedulerDisaggregationPrefillMixin.release_aborted_prefill_waiting_req",
     "room_scheduler_hooks:after_release_aborted_waiting", AFTER),
    ("disaggregation.prefill.SchedulerDisaggregationPrefillMixin.resolve_waiting_queue_bootstrap",
     "transfer_deadline:before_resolve_waiting", BEFORE),
    # a room one rank failed: every rank answers, counts and remembers it alike (one all-gather after the poll's)
    ("disaggregation.utils.poll_and_all_reduce", "room_agreement:around_poll_and_all_reduce", AROUND),
    ("disaggregation.utils.poll_and_all_reduce_attn_cp_tp_group", "room_agreement:around_poll_cp_tp", AROUND),
    ("disaggregation.utils.poll_and_all_reduce_with_staging", "room_agreement:around_poll_with_staging", AROUND),
    ("disaggregation.utils.prepare_abort", "room_scheduler_hooks:prepare_abort_verdict", AROUND),
    # a short gloo timeout where SGLANG_FORK_GLOO_TIMEOUT asks for one (tests: a rank stuck in a collective fails)
    ("distributed.parallel_state.GroupCoordinator.__init__", "rank_agreement:gloo_timeout", BEFORE),
    ("managers.scheduler.Scheduler._record_scheduler_state_for_paused_engine", "scheduler_pause:paused_loop_tick", AFTER),
    # room_scheduler_hooks' BEFORE (outermost: first) marks the PD requests the abort reaches; then, while paused,
    # pd_pause answers it at once
    ("managers.scheduler.Scheduler.abort_request", "scheduler_pause:abort_while_paused", AROUND),
    ("managers.scheduler.Scheduler.abort_request", "room_scheduler_hooks:before_abort_request", BEFORE),
    ("managers.scheduler.Scheduler.continue_generation", "scheduler_pause:scheduler_continue_generation", AFTER),
    # a PD server's idle pass waits up to SGLANG_FORK_PD_IDLE_PACE instead of spinning (docs/peer-liveness.md)
    ("managers.scheduler.Scheduler.on_idle", "idle_pacing:paced_on_idle", AROUND),
    ("managers.scheduler.Scheduler.pause_generation", "scheduler_pause:scheduler_pause_generation", AROUND),
    ("managers.scheduler.Scheduler.process_batch_result", "request_end_cause:after_process_batch_result", AFTER),
    ("managers.scheduler.Scheduler.process_input_requests", "weight_epoch:after_process_input_requests", AFTER),
    # the fork's gauges, set every second (paused or not), with --enable-metrics (docs/metrics.md)
    ("managers.scheduler.Scheduler.process_input_requests", "pd_metrics:after_process_input_requests", AFTER),
    ("managers.scheduler.Scheduler.process_pending_chunked_abort", "room_scheduler_hooks:around_pending_chunked_abort", AROUND),
    # outermost first: decode counts a tagged request's end cause (request_end_cause), a pause's answer is kept
    # (pd_pause), upstream sends, then the ledger tells the other side of a rejection (room_scheduler_hooks' AFTER)
    ("managers.scheduler.Scheduler.send_abort_output", "pd_pause:pause_answer_kept", BEFORE),
    ("managers.scheduler.Scheduler.send_abort_output", "room_scheduler_hooks:after_send_abort_output", AFTER),
    ("managers.scheduler.Scheduler.send_abort_output", "request_end_cause:before_send_abort_output", BEFORE),
    ("managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state",
     "pd_resource_report:add_to_internal_state", AFTER),
    # KV cached under earlier weights is never matched after an update (weight_epoch, also on match_kv_cache and
    # process_input_requests), and freed once no request holds it
    ("managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager.flush_cache_after_weight_update",
     "weight_epoch:around_flush_after_update", AROUND),
    ("managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager.release_memory_occupation",
     "queue_buffers:weight_updater_release", AROUND),
    ("managers.tokenizer_control_mixin.TokenizerControlMixin.get_internal_state", "tokenizer_pause:tm_internal_state", AROUND),
    ("managers.tokenizer_control_mixin.TokenizerControlMixin.get_internal_state", "recovery:after_internal_state", AFTER),
    ("managers.tokenizer_control_mixin.TokenizerControlMixin.release_memory_occupation",
     "tokenizer_pause:tm_release_memory_occupation", AROUND),
    ("managers.tokenizer_control_mixin.TokenizerControlMixin.resume_memory_occupation",
     "tokenizer_pause:tm_resume_memory_occupation", AROUND),
    ("managers.tokenizer_manager.TokenizerManager._handle_abort_req", "recovery:before_handle_abort_req", BEFORE),
    ("managers.tokenizer_manager.TokenizerManager._release_req_states_on_failure",
     "room_telling:before_release_on_failure", BEFORE),
    # the pause gate's answers (inner), then a request between recovery attempts is answered (outer)
    ("managers.tokenizer_manager.TokenizerManager.abort_request", "pause_gate:tm_abort_request", AROUND),
    ("managers.tokenizer_manager.TokenizerManager.abort_request", "recovery:after_abort_request", AFTER),
    ("managers.tokenizer_manager.TokenizerManager.continue_generation", "tokenizer_pause:tm_continue_generation", AROUND),
    # a failed rank takes its server down at once: upstream's crash diagnostics only where they can run
    ("managers.tokenizer_manager.TokenizerManager.dump_requests_before_crash",
     "rank_agreement:crash_diagnostics_that_can_run", AROUND),
    # a bad bootstrap field is a 400 naming it before anything starts (bootstrap_door, outermost: first)
    ("managers.tokenizer_manager.TokenizerManager.generate_request", "resend_wait:tm_generate_request", AROUND),
    ("managers.tokenizer_manager.TokenizerManager.generate_request", "bootstrap_door:before_generate_request", BEFORE),
    ("managers.tokenizer_manager.TokenizerManager.pause_generation", "tokenizer_pause:tm_pause_generation", AROUND),
    ("mem_cache.common.match_kv_cache", "weight_epoch:before_match", BEFORE),
    ("utils.aio_rwlock.RWLock.is_locked", "tokenizer_pause:around_is_locked", AROUND),
]]

# (upstream "module.Class.attribute" under sglang.srt, our "module:function" making it through fork_touch.swap(),
#  kind "instance" (each object of the class) or "class", role whose kv manager gets it); why each: docs/layout.md
SWAPS: list[tuple[str, str, str, str]] = [_full(target, ref) + (kind, role) for target, ref, kind, role in [
    ("disaggregation.mooncake.conn.MooncakeKVManager._publish_peer_registration",
     "prefill_side_monitor:on_prefill_manager_init", "instance", "prefill"),
    ("disaggregation.mooncake.conn.MooncakeKVManager._handle_abort_notification",
     "room_kv_hooks:on_manager_init", "instance", "prefill"),
    # decode's claims, read beside its ABORTs (outside the ledger's handler)
    ("disaggregation.mooncake.conn.MooncakeKVManager._handle_abort_notification",
     "prefill_side_monitor:on_prefill_manager_init", "instance", "prefill"),
    ("disaggregation.nixl.conn.NixlKVManager._handle_abort_notification",
     "room_kv_hooks:on_manager_init", "instance", "prefill"),
    ("disaggregation.mooncake.conn.MooncakeKVManager.failed_sessions",
     "chunk_failures:on_prefill_manager_init", "instance", "prefill"),
    ("disaggregation.mooncake.conn.MooncakeKVManager._send_probe",
     "chunk_failures:on_prefill_manager_init", "instance", "prefill"),
    ("disaggregation.mooncake.conn.MooncakeKVManager.transfer_worker",
     "chunk_failures:guard_transfer_worker", "class", "prefill"),
    # a KV write that sleeps between status checks instead of spinning on mooncake's synchronous batch write
    ("distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine.batch_transfer_sync",
     "paced_write:on_prefill_manager_init", "instance", "prefill"),
]]


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, ref, kind in HOOKS:
        module_name, fn_name = ref.split(":")
        hook = getattr(importlib.import_module(module_name), fn_name)
        HookRegistry.register(target, hook, HookType[kind])


def hooks_applied() -> dict[str, bool]:
    """Target -> whether HookRegistry patched it in this process."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return {target: target in HookRegistry._patched for target, _, _ in HOOKS}
