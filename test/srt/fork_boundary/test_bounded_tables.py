"""Bounded tables, one rule (managers/fork_core/bounded.py): every cap of a fork table is a `Cap` with its reason,
declared once in the module that owns the table, and every table shows in the resource report
(`pd_resource_report.fork_tables`) with its size, its cap and the cap's reason."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.unit

from sglang.srt.managers.fork_core.bounded import Cap

ROOT = Path(__file__).resolve().parents[3]
SRT = ROOT / "python" / "sglang" / "srt"
# Limits that bound no table (a size, a count of calls, seconds), each with its reason beside it in its module.
NOT_TABLES = {"teller.MAX_ROUTE_BYTES", "teller.MAX_RANKS", "transfer_deadline.MAX_SCAN_INTERVAL"}


def _module_constants():
    """(module's dotted name, constant name, value node) of every module-level assignment in the fork's modules."""
    for path in sorted(SRT.glob("*/fork_*/*.py")):
        dotted = "sglang.srt." + ".".join(path.relative_to(SRT).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                yield dotted, node.targets[0].id, node.value


def declared_caps():
    """{module.NAME: the Cap} of every module-level Cap the fork's modules declare."""
    out = {}
    for dotted, name, value in _module_constants():
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "Cap":
            out[f"{dotted.rsplit('.', 1)[1]}.{name}"] = getattr(importlib.import_module(dotted), name)
    return out


def test_every_cap_is_declared_with_its_reason():
    """A module-level MAX_* of the fork's is a Cap (a number and why), unless it bounds no table (NOT_TABLES)."""
    plain = [f"{dotted.rsplit('.', 1)[1]}.{name}" for dotted, name, value in _module_constants()
             if name.startswith("MAX_") and not (isinstance(value, ast.Call) and getattr(value.func, "id", None) == "Cap")]
    assert sorted(plain) == sorted(NOT_TABLES), "a table's cap without its reason: make it a bounded.Cap"
    caps = declared_caps()
    assert caps and all(isinstance(c, Cap) and len(c.why) > 30 for c in caps.values()), caps


def _manager_with_every_table():
    """A kv manager as the fork's components see one, each of them attached (ledger, peer monitor)."""
    from sglang.srt.disaggregation.fork_ending import room_ledger
    from sglang.srt.disaggregation.fork_peers.peer_monitor import _MONITOR
    from sglang.srt.disaggregation.fork_peers.prefill_side_monitor import PrefillSideMonitor

    mgr = SimpleNamespace()
    room_ledger.ledger_for(mgr)
    mgr.__dict__[_MONITOR] = PrefillSideMonitor(mgr, {}, False)
    return mgr


def test_every_cap_shows_in_the_resource_report_with_its_reason():
    from sglang.srt.managers.fork_report import pd_resource_report

    tables = pd_resource_report.fork_tables(_manager_with_every_table())
    shown = {t.get("cap_why") for t in tables.values()}
    missing = [name for name, cap in declared_caps().items() if cap.why not in shown]
    assert not missing, f"caps no resource report entry shows: {missing}"
    for name, table in tables.items():
        assert {"size", "cap", "why"} <= set(table), name
        if isinstance(table["cap"], int):  # a number: a Cap's, its reason beside it, sent as a plain int
            assert type(table["cap"]) is int and table.get("cap_why"), (name, table)
        else:  # what bounds it, in words (or a counter's None)
            assert table["cap"] is None and table.get("counter") or isinstance(table["cap"], str), (name, table)


def test_a_cap_is_an_int_that_pickles_with_its_reason():
    import pickle

    cap = Cap(7, "seven, because")
    assert cap == 7 and cap + 1 == 8 and f"{cap:d}" == "7"
    back = pickle.loads(pickle.dumps(cap))
    assert (back, back.why) == (7, "seven, because")
    with pytest.raises(ValueError):
        Cap(7, " ")
