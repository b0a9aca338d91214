"""A bench run's temporary work dir (the unpacked upstream baseline, the servers' logs).

Invariant: the dir is removed when the run's block ends without an exception (a verdict, even a failing one, was
reached), and kept, its path printed on stderr, when the block raised or the caller asked to keep the logs
(`--keep-logs`). Used by the benches that start servers: `release_gate`, `rl_step`, `transfer`."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def work_dir(prefix: str, keep: bool) -> Iterator[Path]:
    """A new temporary dir named `prefix...`; removed at the end unless `keep` or the block raised."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    ok = False
    try:
        yield work
        ok = True
    finally:
        if keep or not ok:
            print(f"logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
