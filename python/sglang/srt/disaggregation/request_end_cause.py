"""Why a PD request ended without a completion, and the count of it: one place.

Invariant: every PD request that ends without a completion is counted exactly once,
under exactly one cause -- "client_abort", "pause" (pause_generation in abort mode or a
memory release ended it), "timeout", "transport" or "peer_failure" --
by role ("prefill"/"decode") and stage. A failure site `tag()`s the room with its
cause *before* it moves the room to `KVPoll.Failed`; the first tag wins (a client
abort that later sees the transport fail stays a client abort). The queue that
retires the request calls `record_end()`, which reads the tag (or the request's own
abort), counts it, and forgets the tag, so nothing per-room outlives the request.

Decode's running requests (the waiting queue of transferred requests and the running
batch, stage "decode_running") end outside the PD queues: an abort ends them after
their next forward pass (`after_process_batch_result`) or answers them at once from
the waiting queue or a retract's re-bootstrap hold (`before_send_abort_output`); each
is counted there once, if an abort reached it (a client abort, the pause, a release, an
SLA timeout), never for a completion or a rejection.

Counted in-process in `COUNTS[(role, cause, stage)]` (the queue harness reads it) and,
when metrics are on, in the Prometheus counter `sglang:num_pd_request_end_causes_total`
(labels: the scheduler's labels + role, cause, stage; `fork_metrics`).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from typing import Any, Optional, Tuple

logger = logging.getLogger(__name__)

CLIENT_ABORT = "client_abort"
TIMEOUT = "timeout"
TRANSPORT = "transport"
PEER_FAILURE = "peer_failure"
PAUSE = "pause"
CAUSES = (CLIENT_ABORT, TIMEOUT, TRANSPORT, PEER_FAILURE, PAUSE)

PROMETHEUS_NAME = "sglang:num_pd_request_end_causes_total"  # declared in fork_metrics

# (role, cause, stage) -> requests ended so in this process.
COUNTS: Counter = Counter()

# Per kv manager: room -> (cause, peer), newest last; bounded so a room whose request
# never reaches a queue that records its end cannot grow it without limit.
_ROOMS_ATTR = "fork_end_causes"
MAX_TAGGED_ROOMS = 4096
# Per request: (cause, peer) once known; and whether its end was already counted.
_REQ_CAUSE = "fork_end_cause"
_REQ_COUNTED = "fork_end_counted"
# Guards the per-manager room tags: written by whichever thread ends a room (scheduler,
# transfer workers, the peer monitor), popped by the scheduler. A leaf lock.
_lock = threading.Lock()


def _check(cause: str) -> None:
    if cause not in CAUSES:
        raise ValueError(f"unknown PD request end cause {cause!r}; expected one of {CAUSES}")


# ----------------------------------------------------------------------------- tagging


def tag(kv_manager: Any, room: int, cause: str, peer: Optional[str] = None) -> None:
    """Record why `room` is about to fail (call before marking it Failed). First tag wins."""
    _check(cause)
    if kv_manager is None or room is None:
        return
    with _lock:
        rooms = kv_manager.__dict__.setdefault(_ROOMS_ATTR, OrderedDict())
        if room in rooms:
            return
        rooms[room] = (cause, peer)
        while len(rooms) > MAX_TAGGED_ROOMS:
            rooms.popitem(last=False)


def tag_req(req: Any, cause: str, peer: Optional[str] = None) -> None:
    """Record why `req` is ending, for sites that hold the request rather than the room.
    First tag wins."""
    _check(cause)
    if getattr(req, _REQ_CAUSE, None) is None:
        setattr(req, _REQ_CAUSE, (cause, peer))


def room_cause(kv_manager: Any, room: int) -> Optional[Tuple[str, Optional[str]]]:
    """(cause, peer) tagged for `room`, or None."""
    rooms = getattr(kv_manager, "__dict__", {}).get(_ROOMS_ATTR)
    return rooms.get(room) if rooms else None


def forget(kv_manager: Any, room: int) -> None:
    """Drop `room`'s tag (its state is being cleared)."""
    rooms = getattr(kv_manager, "__dict__", {}).get(_ROOMS_ATTR)
    if rooms:
        with _lock:
            rooms.pop(room, None)


def tagged_rooms(kv_manager: Any) -> int:
    """How many rooms carry a tag (the resource report lists it as per-room state)."""
    rooms = getattr(kv_manager, "__dict__", {}).get(_ROOMS_ATTR)
    return len(rooms) if rooms else 0


# ----------------------------------------------------------------------------- classify


def _is_client_abort(req: Any) -> bool:
    """A request the client (or /abort_request) aborted: upstream sets `to_finish` or
    `finished_reason` to FINISH_ABORT with no error status (a deadline or failure
    carries one)."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    for reason in (getattr(req, "to_finish", None), getattr(req, "finished_reason", None)):
        if isinstance(reason, FINISH_ABORT) and getattr(reason, "status_code", None) is None:
            return True
    return False


def cause_of(req: Any, kv_manager: Any = None, default: str = TRANSPORT) -> Tuple[str, Optional[str]]:
    """(cause, peer) for `req`: its own tag, else its room's tag, else a client abort if
    the client aborted it, else `default`."""
    _check(default)
    own = getattr(req, _REQ_CAUSE, None)
    if own is not None:
        return own
    if kv_manager is not None:
        tagged = room_cause(kv_manager, getattr(req, "bootstrap_room", None))
        if tagged is not None:
            return tagged
    if _is_client_abort(req):
        return CLIENT_ABORT, None
    return default, None


# ----------------------------------------------------------------------------- count


def count(scheduler: Any, role: str, cause: str, stage: str) -> None:
    """Count one PD request that ended with `cause` in `stage` on `role`."""
    from sglang.srt.disaggregation import fork_metrics

    _check(cause)
    COUNTS[(role, cause, stage)] += 1
    fork_metrics.inc("end_cause", fork_metrics.scheduler_labels(scheduler), role=role, cause=cause, stage=stage)


def record_end(
    scheduler: Any, req: Any, role: str, stage: str, kv_manager: Any = None,
    default: str = TRANSPORT,
) -> Optional[str]:
    """Classify and count `req`'s end once (later calls for the same request return
    None and count nothing); forget its room's tag. Returns the cause counted."""
    if getattr(req, _REQ_COUNTED, False):
        return None
    cause, _peer = cause_of(req, kv_manager, default)
    setattr(req, _REQ_COUNTED, True)
    if kv_manager is not None:
        forget(kv_manager, getattr(req, "bootstrap_room", None))
    count(scheduler, role, cause, stage)
    return cause


def is_client_abort(req: Any, kv_manager: Any = None) -> bool:
    """Whether `req` ends as a client abort (not a failure)."""
    return cause_of(req, kv_manager)[0] == CLIENT_ABORT


# ----------------------------------------------------------------------------- decode running

DECODE_RUNNING = "decode_running"  # pd_queues.DECODE_RUNNING


def _is_decode(scheduler: Any) -> bool:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return getattr(scheduler, "disaggregation_mode", None) == DisaggregationMode.DECODE


def _count_running_end(scheduler: Any, req: Any) -> None:
    """Count the end of a decode running request an abort reached (tagged by the abort,
    or upstream's client abort), once."""
    if getattr(req, _REQ_COUNTED, False):
        return
    if getattr(req, _REQ_CAUSE, None) is None and not _is_client_abort(req):
        return
    record_end(scheduler, req, "decode", DECODE_RUNNING)


def after_process_batch_result(result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER Scheduler.process_batch_result: on decode, a request of the batch an abort
    ended (finish reason FINISH_ABORT) is counted under its cause."""
    if batch is None or not _is_decode(scheduler):
        return result
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    for req in batch.reqs:
        if isinstance(req.finished_reason, FINISH_ABORT):
            _count_running_end(scheduler, req)
    return result


def before_send_abort_output(scheduler: Any, abort_req: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE Scheduler.send_abort_output: on decode, a transferred request an abort
    answers from the waiting queue (or a retracted one held for re-bootstrap) is
    counted under its cause; a request the scheduler rejects carries no abort and is not."""
    if _is_decode(scheduler) and getattr(req, _REQ_CAUSE, None) is not None:
        _count_running_end(scheduler, req)
    return None
