"""The queue harness's one stand-in: upstream's `Scheduler` without a model, GPU or sockets."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin
from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm



def _borrowed(name: str) -> Callable[..., Any]:
    """`Scheduler.<name>`, looked up at call time so that a hook the fork's plugin put
    on it applies to the stand-in too."""

    def method(self, *args, **kwargs):
        return getattr(Scheduler, name)(self, *args, **kwargs)

    method.__name__ = name
    return method


class SchedulerStandIn(SchedulerDisaggregationPrefillMixin, SchedulerDisaggregationDecodeMixin):
    """The one stand-in: a `Scheduler` without a model, a GPU or sockets.

    The PD mixins are upstream's own (inherited, not copied), and the `Scheduler`
    methods the queues call back into, plus `abort_request`, are borrowed below.
    Class attributes: features that are off for a plain CPU MHA model. Instance
    attributes, set by `_Harness.__init__` and each side's `_build`: the real pools,
    cache and queues, and stubs only for what needs a model (`tp_worker`,
    `model_config`), the tokenizer link (`output_streamer` / `ipc_channels` ->
    `Outputs`) and metrics (`metrics_collector` -> `Counters`).
    To exercise another `Scheduler` method, borrow it here the same way.
    """

    _release_aborted_request = _borrowed("_release_aborted_request")
    retire_unadmitted_request = _borrowed("retire_unadmitted_request")
    abort_request = _borrowed("abort_request")
    collect_inflight_reqs = _borrowed("collect_inflight_reqs")
    _collect_inflight_batches = _borrowed("_collect_inflight_batches")
    send_abort_output = _borrowed("send_abort_output")
    process_pending_chunked_abort = _borrowed("process_pending_chunked_abort")
    pause_generation = _borrowed("pause_generation")
    continue_generation = _borrowed("continue_generation")

    # features that are off
    enable_overlap = False
    enable_overlap_mlx = False
    cur_batch_for_debug = None
    kv_events_publisher = SimpleNamespace(publish_kv_events=lambda: None)
    enable_staging = False
    enable_lora = False
    enable_hisparse = False
    enable_decode_hicache = False
    enable_priority_scheduling = False
    hisparse_coordinator = None
    decode_offload_manager = None
    rust_server = None
    pp_group = None
    chunked_req = None
    # the other role's PD queue (each side's _build sets its own)
    disagg_prefill_bootstrap_queue = None
    disagg_decode_prealloc_queue = None
    _pending_chunked_abort_req = None
    last_batch = None
    _engine_paused = False  # set True to stand for a paused event loop
    _pause_started_at = None  # upstream's pause_generation / continue_generation (`_pause_intervals`: per instance)
    kv_checksum_computer = None
    sliding_window_size = None
    scheduler_stage_metrics = None
    return_health_check_ipcs = None
    kv_shard_widening = 1
    random_seed = 0
    spec_algorithm = SpeculativeAlgorithm.NONE
    enable_continuous_input_polling = False
    # components the borrowed methods touch, with nothing to do here
    result_queue = ()
    mm_receiver = None
    dllm_config = None
    beam_coordinator = SimpleNamespace(retire_group=lambda req: None)
    grammar_manager = SimpleNamespace(abort_requests=lambda recv_req: None, grammar_queue=())

    def maybe_send_health_check_signal(self) -> None:
        pass


def _model_stub(num_layers: int, num_kv_heads: int, vocab_size: int) -> SimpleNamespace:
    return SimpleNamespace(
        num_hidden_layers=num_layers,
        num_key_value_heads=num_kv_heads,
        get_total_num_kv_heads=lambda: num_kv_heads,
        vocab_size=vocab_size,
        is_encoder_decoder=False,
        hf_config=SimpleNamespace(),
        hf_text_config=SimpleNamespace(),
    )


