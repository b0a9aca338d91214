"""Bounded tables, one rule: every per-room and per-peer table the fork keeps has a cap declared once, beside the table
in the module that owns it, as a `Cap` (the number and why it is that number), and shows in the resource report
(`pd_resource_report.fork_tables`) through `entry` (its size, its cap and the cap's reason, what it holds).
test/srt/fork_boundary/test_bounded_tables.py checks both. Any thread (values only); no lock. A leaf: imports no
fork module."""

from __future__ import annotations

from typing import Any, Dict, Union


class Cap(int):
    """A table's cap: the number (an int: compare and count with it as with one) and `why` it is that number."""

    why: str

    def __new__(cls, limit: int, why: str) -> "Cap":
        if not why.strip():
            raise ValueError("a cap needs its reason")
        cap = super().__new__(cls, limit)
        cap.why = why
        return cap

    def __getnewargs__(self):  # pickle (a report crosses processes as ints: `entry`)
        return int(self), self.why


def entry(size: int, cap: Union[Cap, str, None], what: str, **marks: bool) -> Dict[str, Any]:
    """A `fork_tables` entry: `size` now, `cap` (a Cap: its number, and its reason as `cap_why`; or the words for
    what bounds a table without a number; None for a counter), `what` it holds (`why`), and its marks (`per_peer`,
    `memory`, `counter`: pd_resource_report.fork_tables)."""
    out: Dict[str, Any] = {"size": size, "cap": int(cap) if isinstance(cap, Cap) else cap, "why": what}
    if isinstance(cap, Cap):
        out["cap_why"] = cap.why
    out.update(marks)
    return out
