"""The verdict table (disaggregation/fork_ending/verdict_rows.py, decided by verdict.py, its texts in
verdict_wording.py): docs/layout.md shows the code's table; each row is what the verdict answers; no fork module but
the verdict's three compares message wording; no fork module sets a
`fork_*` attribute on a request outside the one record."""

from __future__ import annotations

import ast
from http import HTTPStatus
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.unit

from sglang.srt.disaggregation.fork_ending import request_record, verdict, verdict_rows, verdict_wording
from sglang.srt.disaggregation.fork_ending.verdict_rows import Cause

ROOT = Path(__file__).resolve().parents[3]
SRT = ROOT / "python" / "sglang" / "srt"
VERDICT = tuple(SRT / "disaggregation" / "fork_ending" / f"{name}.py"  # the verdict's modules
                for name in ("verdict", "verdict_rows", "verdict_wording"))
RECORD = SRT / "disaggregation" / "fork_ending" / "request_record.py"  # sets the one attribute


def fork_modules():
    return sorted(p for p in SRT.glob("*/fork_*/*.py") if p not in VERDICT)


def test_the_doc_shows_the_code_table():
    doc = (ROOT / "docs" / "layout.md").read_text()
    start = doc.index("<!-- verdict table:")
    body = doc[doc.index("\n", start) + 1:doc.index("<!-- end verdict table -->")].strip()
    assert body == verdict_rows.markdown(), ("docs/layout.md's verdict table differs from verdict_rows.markdown(): "
                                            "paste it")


@pytest.fixture(autouse=True)
def recovery_on(monkeypatch):
    """Recovery on (one attempt), as both servers of a deployment that recovers read it: the HANDED_TO_RECOVERY row
    is reachable; every other row answers as with it off."""
    monkeypatch.setenv("SGLANG_FORK_RECOVERY_ATTEMPTS", "1")


def _req(**fields):
    req = SimpleNamespace(rid="r", to_finish=None, finished_reason=None, disagg_kv_sender=None)
    for name, value in fields.items():
        setattr(verdict.of(req), name, value)
    return req


# The failure reasons a room ends with, made by the code that makes them (upstream's and the fork's), not spelled here.


def _recorder(**fields):
    """A kv manager as far as upstream's failure paths touch it: they record into `failure_records`."""
    mgr = SimpleNamespace(failure_records={}, request_status={}, deferred_bootstrap=None, **fields)
    mgr.record_failure = lambda room, reason: mgr.failure_records.setdefault(room, reason)
    mgr.update_status = lambda room, status: mgr.request_status.__setitem__(room, status)
    mgr.check_status = mgr.request_status.get
    return mgr


def upstream_abort_reason() -> str:
    """What upstream's CommonKVSender.abort() records for a room an AbortReq reached."""
    from sglang.srt.disaggregation.common.conn import CommonKVSender

    mgr = _recorder()
    trace = SimpleNamespace(abort=lambda **kw: None, trace_req_finish=lambda: None)
    CommonKVSender.abort(SimpleNamespace(kv_mgr=mgr, bootstrap_room=5, _owns_bootstrap_room=True, trace_ctx=trace))
    return mgr.failure_records[5]


def upstream_prefill_lost_reason() -> str:
    """What upstream's decode heartbeat (CommonKVManager._handle_node_failure) records for a room of a lost prefill."""
    import threading

    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    addr = "10.0.0.1:8998"
    mgr = _recorder(connection_lock=threading.Lock(), connection_pool={}, prefill_info_table={},
                    heartbeat_failures={}, addr_to_rooms_tracker={addr: {5}})
    mgr.request_status[5] = KVPoll.WaitingForInput
    CommonKVManager._handle_node_failure(mgr, addr)
    return mgr.failure_records[5]


def fork_loss_reason() -> str:
    """What the fork's peer monitor records for a room of a lost decode."""
    from sglang.srt.disaggregation.fork_peers import peer_monitor

    return peer_monitor.loss_message("decode", "10.0.0.2:7000", "silent")


DEADLINE = f"{verdict_wording.DEADLINE_TAG}: request r (bootstrap_room=5) spent 31.0s in stage prefill_inflight"
LOST = fork_loss_reason()
PEER_PAUSE = verdict.peer_reason("r", 5, "prefill", verdict_wording.PAUSE_ABORT_MESSAGE)
REJECTION = verdict.peer_reason("r", 5, "decode", verdict.rejected_by("decode's scheduler", "too long"))
KV_FAILED = verdict_wording.UPSTREAM_CHUNK_FAILED["kv"] + " of 5 to 10.0.0.2:7000"  # mooncake's transfer worker
SLA = ("SLA exceeded", verdict_rows.SLA_ABORT_STATUS)


def _prefill_req(rid="r", **shape):
    """Prefill's copy of a plain request (it has a sender), as recovery_rule.req_shape reads it."""
    fields = {**dict(return_logprob=False, session_id=None, multimodal_inputs=None, lora_id=None, input_embeds=None,
                     sampling_params=SimpleNamespace(n=1)), **shape}
    req = SimpleNamespace(rid=rid, to_finish=None, finished_reason=None, disagg_kv_sender=object(), **fields)
    return req


def _prefill_told(told, rid="r", **shape):
    """Prefill's copy whose room's ender told `told` (a field: what the reason's text says is not read)."""
    req = _prefill_req(rid, **shape)
    verdict.of(req).told = told
    return req


def _prefill_deadline(stage="prefill_inflight", rid="r"):
    """Prefill's copy whose own deadline (transfer_deadline's whole message) fired in `stage`."""
    req = _prefill_req(rid)
    verdict.of(req).deadline = verdict_wording.DEADLINE_MESSAGE.format(
        rid=rid, room=5, spent=5.3, stage=stage, deadline=5.0, env="SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT",
        arg="--disaggregation-transfer-timeout")
    return req
# (row, request record, the room's failure reason): each row reached by what really ends a room that way
CASES = [
    # prefill's own deadline in a stage recovery re-runs, an attempt left: its leg handed over (a gateway keeps decode's)
    (Cause.DEADLINE_HANDED_TO_RECOVERY, _prefill_deadline(), LOST),
    (Cause.DEADLINE, _req(deadline=DEADLINE, pause=verdict_wording.PAUSE_ABORT_MESSAGE), LOST),
    (Cause.DEADLINE, _prefill_deadline(rid="r~recovery-1"), LOST),  # the last attempt the knob allows: its 504
    (Cause.DEADLINE, _prefill_deadline("prefill_waiting"), LOST),  # a stage recovery does not re-run
    (Cause.DEADLINE, _prefill_deadline("prefill_bootstrap"), LOST),
    (Cause.PAUSE, _req(pause=verdict_wording.PAUSE_ABORT_MESSAGE, requested=SLA), LOST),
    (Cause.PAUSE, _req(pause=verdict_wording.RELEASE_ABORT_MESSAGE.format(mode="in_place")), KV_FAILED),
    (Cause.REQUESTED_ABORT, _req(requested=SLA), LOST),
    (Cause.REQUESTED_ABORT, _req(requested=(verdict_wording.CLIENT_ABORT_MESSAGE, None)), KV_FAILED),
    (Cause.PEER_PAUSE, _req(), PEER_PAUSE),
    (Cause.PEER_REJECTION, _req(), REJECTION),
    (Cause.PEER_ABORT, _req(), upstream_abort_reason()),
    (Cause.PEER_ABORT, _req(), verdict.peer_reason("r", 5, "decode")),
    (Cause.PEER_DEADLINE, _req(), DEADLINE),
    (Cause.PAUSE_REASON, _req(), verdict_wording.PAUSE_ABORT_MESSAGE + " (room 5)"),
    # prefill's copy whose decode it lost (told by its monitor, or read), an attempt left: handed over, so that a
    # gateway keeps decode's answer (its recovery on another prefill, or its own 502)
    (Cause.LOST_PEER_HANDED_TO_RECOVERY, _prefill_req(), LOST),
    (Cause.LOST_PEER_HANDED_TO_RECOVERY, _prefill_told(verdict_rows.Told(Cause.LOST_PEER)), "PD request failed"),
    (Cause.LOST_PEER, _req(), LOST),  # decode's copy (no sender): its 502, which decode's recovery reads
    (Cause.LOST_PEER, _req(), upstream_prefill_lost_reason()),
    (Cause.LOST_PEER, _prefill_req("r~recovery-1"), LOST),  # the last attempt the knob allows answers the loss
    (Cause.LOST_PEER, _prefill_told(verdict_rows.Told(Cause.LOST_PEER), return_logprob=True), LOST),  # not taken
    (Cause.HANDED_TO_RECOVERY, _prefill_req(), KV_FAILED),
    (Cause.FAILURE, _req(), KV_FAILED),  # decode's copy (no sender): decode's own recovery holds its end back
    (Cause.FAILURE, _prefill_req("r~recovery-1"), KV_FAILED),  # the last attempt the knob allows answers the failure
    (Cause.FAILURE, _prefill_req(return_logprob=True), KV_FAILED),  # a shape recovery does not take
    (Cause.FAILURE, _prefill_req(), "KV transfer worker raised while sending room 5"),  # no cause recovery takes
]


def test_every_row_is_reached_in_table_order():
    reached = list(dict.fromkeys(c for c, *_ in CASES))
    assert reached == [row.cause for row in verdict_rows.TABLE]


def _row_status(row, req, caller):
    """What a row's status value means (the docs say the same: `verdict_rows.cells`)."""
    if isinstance(row.status, HTTPStatus):
        return row.status
    return {verdict_rows.From.ABORT_ANSWER: None, verdict_rows.From.CALLER: caller,
            verdict_rows.From.RECORD: verdict.peek(req).requested and verdict.peek(req).requested[1]}[row.status]


@pytest.mark.parametrize("cause,req,reason", CASES, ids=[f"{c.name}-{i}" for i, (c, *_) in enumerate(CASES)])
def test_each_row_answers_as_the_table_says(cause, req, reason):
    """The verdict finds the row, and answers with the row's values: its status, its message (a fixed one, or where
    it comes from: the record, the peer's, the reason; opening as the row says), the end cause it tags."""
    row = verdict_rows.ROWS[cause]
    assert verdict.find(req, reason) is cause
    message, status, tagged = verdict.verdict(req, reason, HTTPStatus.INTERNAL_SERVER_ERROR)
    assert status == _row_status(row, req, HTTPStatus.INTERNAL_SERVER_ERROR)
    assert status is None or isinstance(status, HTTPStatus)  # upstream's OpenAI stream checks the type
    assert tagged == row.end_cause
    if isinstance(row.message, str):
        assert message == row.message
    elif row.message is verdict_rows.From.REASON:
        assert message == reason
    elif row.message is verdict_rows.From.TOLD:
        assert message != reason and message in reason  # the peer's own message, out of its reason
    elif row.message is verdict_rows.From.HANDED:
        failure = getattr(verdict.peek(req), row.field) if row.field else reason  # a record row's: its field's
        assert message.endswith(failure) and message != failure  # the failure, said to be handed over
    assert not row.opens or message.startswith(tuple(o.split("{")[0] for o in row.opens)), (message, row.opens)


def test_a_message_naming_a_deadline_or_the_pause_is_answered_as_those_rows():
    """`RESTATED`: an AbortReq whose message names the pause (the pause's abort_all) answers as row PAUSE_REASON, one
    naming a deadline as row PEER_DEADLINE, whatever its asked status; the deadline's own row keeps its untagged
    end (transfer_deadline tagged the room, with its peer)."""
    req = _req(requested=(verdict_wording.PAUSE_ABORT_MESSAGE, verdict_rows.SLA_ABORT_STATUS))
    assert verdict.verdict(req, KV_FAILED, 500) == (verdict_wording.PAUSE_ABORT_MESSAGE, None, verdict_wording.PAUSE)
    req = _req(requested=(DEADLINE, None))
    assert verdict.verdict(req, KV_FAILED, 500) == (DEADLINE, HTTPStatus.GATEWAY_TIMEOUT, verdict_wording.TIMEOUT)
    assert verdict.verdict(_req(deadline=DEADLINE), KV_FAILED, 500) == (DEADLINE, HTTPStatus.GATEWAY_TIMEOUT, None)


# ----------------------------------------------------------------------------- the source checks


def _wording():
    """(name, value) of the verdict's wording constants: the texts the fork writes and the upstream texts it reads."""
    out = []
    for name in dir(verdict_wording):
        value = getattr(verdict_wording, name)
        if name.isupper() and (name.endswith(("_MESSAGE", "_TAG", "_REASON", "_MARKER", "_MARKERS", "_WHY"))
                               or name.startswith("UPSTREAM_") or name == "REJECTED"):
            for v in value.values() if isinstance(value, dict) else value if isinstance(value, tuple) else (value,):
                if isinstance(v, str):
                    out.append((name, v))
    return out


VERDICT_NAMES = tuple(path.stem for path in VERDICT)
VERDICT_MODULES = tuple(f"fork_ending.{name}" for name in VERDICT_NAMES)


def _verdict_refs(tree: ast.Module):
    """Names bound to verdict's wording in a module (`from ...verdict_wording import X`, or from the other verdict
    modules), and the verdict modules' aliases."""
    wording = {name for name, _ in _wording()}
    names, aliases = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith(VERDICT_MODULES):
            names |= {a.asname or a.name for a in node.names if a.name in wording}
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("fork_ending"):
            aliases |= {a.asname or a.name for a in node.names if a.name in VERDICT_NAMES}
    return names, aliases, wording


def _names_wording(node, names, aliases, wording) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in names:
            return True
        if (isinstance(sub, ast.Attribute) and sub.attr in wording and isinstance(sub.value, ast.Name)
                and sub.value.id in aliases):
            return True
    return False


def test_message_wording_is_compared_only_in_the_verdict_module():
    """No fork module but the verdict's (verdict, verdict_rows, verdict_wording) compares a text against the fork's or
    upstream's wording (`in`, `==`, startswith/endswith, rsplit on it), nor spells that wording itself."""
    found = []
    # whole messages and tags (the markers are words a hook's target names too: compared, they are caught above)
    spelled = [(n, v) for n, v in _wording() if len(v) >= 12 and not n.endswith(("_MARKER", "_MARKERS"))]
    for path in fork_modules():
        tree = ast.parse(path.read_text())
        names, aliases, wording = _verdict_refs(tree)
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for node in ast.walk(tree):
            compared = []
            if isinstance(node, ast.Compare) and any(
                    isinstance(op, (ast.In, ast.NotIn, ast.Eq, ast.NotEq)) for op in node.ops):
                compared = [node.left, *node.comparators]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("startswith", "endswith", "rsplit", "split", "index", "find")):
                compared = [node.func.value, *node.args]
            if any(_names_wording(c, names, aliases, wording) for c in compared):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} compares verdict wording")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                for name, value in spelled:
                    if value in node.value:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} spells verdict.{name}")
    assert not found, "\n".join(found)


def test_no_fork_attribute_is_set_on_a_request_outside_the_record():
    """A request (upstream's Req, `req` / `request` / `decode_req.req` in the fork's code; the tokenizer's ReqState,
    `s` / `state`) carries one attribute, `request_record.ATTR` (a record per owner), set by request_record alone: no
    other module sets another on it (setattr, an assignment, its __dict__)."""
    found = []
    assert verdict.ATTR == request_record.ATTR

    def is_request(node) -> bool:
        return ((isinstance(node, ast.Name) and node.id in ("req", "request", "r", "s", "state"))
                or (isinstance(node, ast.Attribute) and node.attr == "req"))

    for path in fork_modules():
        if path == RECORD:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                    and node.args and is_request(node.args[0])):
                found.append(f"{where} setattr on a request")
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and is_request(t.value) and "fork" in t.attr:
                    found.append(f"{where} sets {t.attr} on a request")
                if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute)
                        and t.value.attr == "__dict__" and is_request(t.value.value)):
                    found.append(f"{where} writes a request's __dict__")
    assert not found, "\n".join(found)


def test_only_the_ledger_records_or_drops_a_room_failure():
    """Every room ends through RoomLedger.make (docs/layout.md "How a room ends"): no fork module but room_ledger
    calls a kv manager's record_failure, pops its failure_records or writes one into it (upstream's per-room failure
    table has one owner on the fork's side: an agreed record and one decode's ABORT brings go through
    `room_ledger.write_failure`)."""
    ledger = SRT / "disaggregation" / "fork_ending" / "room_ledger.py"
    found = []
    for path in fork_modules():
        if path == ledger:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute)
                            and t.value.attr == "failure_records"):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} writes {ast.unparse(t)}")
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr == "record_failure" or (
                    node.func.attr == "pop" and isinstance(node.func.value, ast.Attribute)
                    and node.func.value.attr == "failure_records"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node.func)}")
    assert not found, "\n".join(found)


# ----------------------------------------------------------------------------- the cause as a field


def test_a_told_cause_decides_over_misleading_text():
    """The room's told cause (the record's `told`, moved there from the ledger) wins over a reason whose text reads as
    another row: a reason naming the peer's pause, told as the peer's abort, is a client abort."""
    req = _req(told=verdict_rows.Told(Cause.PEER_ABORT))
    assert verdict.find(req, PEER_PAUSE) is Cause.PEER_ABORT
    assert verdict.verdict(req, PEER_PAUSE, 500) == (verdict_wording.CLIENT_ABORT_MESSAGE, None,
                                                     verdict_wording.CLIENT_ABORT)
    # the message of a told pause is the field's, whatever the text says
    req = _req(told=verdict_rows.Told(Cause.PEER_PAUSE, verdict_wording.RELEASE_NO_PAUSE_MESSAGE))
    assert verdict.verdict(req, "Failed to send kv chunk", 500) == (verdict_wording.RELEASE_NO_PAUSE_MESSAGE, None,
                                                                    verdict_wording.PAUSE)
    # without a told cause, the same text is read as before (a peer of an older build, stock upstream)
    assert verdict.verdict(_req(), PEER_PAUSE, 500) == (verdict_wording.PAUSE_ABORT_MESSAGE, None,
                                                        verdict_wording.PAUSE)


def test_the_cause_frames_round_trip_and_an_older_peer_falls_back():
    from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification
    from sglang.srt.disaggregation.fork_ending import room_frames

    note = AbortNotification(room=7, decode_ip="10.0.0.2", decode_port=7000, generation=3)
    upstreams = [ABORT_TAG, b"7", b"10.0.0.2", b"7000", b"3"]  # upstream's to_zmq (the fork's hook may wrap it)
    frames = room_frames.abort_frames(upstreams, verdict_wording.PAUSE_ABORT_MESSAGE)
    # stock upstream prefill: the fork's frames after the generation are not read
    assert AbortNotification.from_zmq(frames) == note
    ours, why, told = room_frames.split_abort(frames)
    assert (ours, why, told) == (upstreams, verdict_wording.PAUSE_ABORT_MESSAGE,
                                 verdict_rows.Told(Cause.PEER_PAUSE, verdict_wording.PAUSE_ABORT_MESSAGE))
    assert room_frames.split_abort(room_frames.abort_frames(upstreams, None))[2] == verdict_rows.Told(Cause.PEER_ABORT)
    # an older fork build: the why, no cause; stock upstream: neither (the reason's text is read)
    older = list(upstreams) + [room_frames.WHY_FRAME, verdict_wording.PAUSE_ABORT_MESSAGE.encode()]
    assert room_frames.split_abort(older) == (upstreams, verdict_wording.PAUSE_ABORT_MESSAGE, None)
    assert room_frames.split_abort(upstreams) == (upstreams, None, None)
    # a cause this build does not know, or one only this side's record holds: read as none
    assert verdict_rows.Told.from_frames([b"NEWER_CAUSE", b""]) is None
    assert verdict_rows.Told.from_frames([b"DEADLINE", b""]) is None


def test_no_fork_attribute_is_set_on_a_receiver_or_request():
    """`grep -rn "_fork_\\w* = "` over the fork's modules finds no attribute set on a request or a receiver: what
    the fork keeps of one is in the request's record or the ledger's entry for it (pause_gate's mark on the
    tokenizer's request states is its own)."""
    import re

    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
             for p in fork_modules() + list(VERDICT) for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\b(req|request|receiver|sender|decode_req)\w*\._fork_\w* = ", line)]
    assert not found, "\n".join(found)


def test_the_record_holds_only_what_the_verdict_reads():
    """The verdict's record on a request has the fields its rows are found by, the cause told with the room (rows
    4-10) and the end cause tagged (`counted_cause`); the other per-request facts are their owners' records."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(verdict.ReqState)}
    assert fields == {row.field for row in verdict_rows.TABLE if row.field} | {"told", "end_cause"}
