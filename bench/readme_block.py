"""One block of figures in a markdown file, between a begin and an end marker: the
benches (`release_gate`, `rl_step`, `transfer`) write their tables into bench/README.md through this,
replacing only their own block; README.md's one-line summary of them is then made again from it
(`testing.doc_tables`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from testing import doc_tables


def write_block(path: Path, begin: str, end: str, block: str, heading: Optional[str] = None) -> None:
    """Replace what lies between `begin` and `end` in `path` with `block`. Without the
    markers: append them under `heading`, or raise when no heading is given."""
    text = path.read_text()
    new = f"{begin}\n{block}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + new + tail
    elif heading is None:
        raise RuntimeError(f"{path.name} has no {begin!r} marker")
    else:
        text = text.rstrip("\n") + f"\n\n{heading}\n" + new + "\n"
    path.write_text(text)
    if path.resolve() == doc_tables.BENCH_README:
        doc_tables.refresh_bench_summary()
