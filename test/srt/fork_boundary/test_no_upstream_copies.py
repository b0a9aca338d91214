"""Guard for the repository's one rule: no tracked file is a copy or near-copy of a
file in the upstream wheel (fork_build.copyguard; `tools/fork check` runs it too)."""

import zipfile
from pathlib import Path

import pytest

from fork_build.copyguard import upstream_copies, upstream_index, verdict
from fork_build.lock import read_lock
from fork_build.upstream import select_tag, upstream_wheel

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def wheel() -> Path:
    lock = read_lock(ROOT)
    return upstream_wheel(lock, select_tag(lock))


def test_guard_catches_a_lightly_edited_upstream_file(wheel):
    index = upstream_index(wheel)
    with zipfile.ZipFile(wheel) as zf:
        original = zf.read("sglang/srt/disaggregation/prefill.py")
    edited = b"# ours\n" + original.replace(b"PrefillBootstrapQueue", b"OurBootstrapQueue")
    assert verdict(original, index) == "identical to an upstream file"
    assert verdict(edited, index) is not None
    assert verdict((ROOT / "build_backend/fork_build/copyguard.py").read_bytes(), index) is None


def test_no_tracked_file_copies_upstream(wheel):
    assert upstream_copies(ROOT, wheel) == {}
