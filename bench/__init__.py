"""The fork's benchmarks against stock upstream (bench/README.md)."""

import sys
from typing import Callable, NoReturn


def run(main: Callable[[], int]) -> NoReturn:
    """A bench's entry point: its exit code, or 2 with `BENCH ERROR: ...` on stderr when it could not measure (an
    error, not a verdict: a gate's FAIL is its own exit code)."""
    try:
        sys.exit(main())
    except Exception as e:
        print(f"BENCH ERROR: {e!r}", file=sys.stderr)
        sys.exit(2)
