"""Guard for the repository's one rule: no tracked file is a copy or near-copy of a
file in the upstream wheel. Patches are exempt (their context lines are upstream's
by design); everything else is compared by whole-file hash and by 6-line shingles."""

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from fork_build.lock import read_lock
from fork_build.upstream import select_tag, upstream_wheel

ROOT = Path(__file__).resolve().parents[2]
SHINGLE = 6
NEAR_COPY = 0.5  # share of a file's shingles found upstream that makes it a near-copy


def _lines(data: bytes) -> list[str]:
    text = data.decode("utf-8", "replace")
    return [" ".join(l.split()) for l in text.splitlines() if l.strip()]


def _shingles(data: bytes) -> set[int]:
    lines = _lines(data)
    return {hash("\n".join(lines[i:i + SHINGLE])) for i in range(len(lines) - SHINGLE + 1)}


@pytest.fixture(scope="module")
def upstream_index():
    lock = read_lock(ROOT)
    digests, shingles = set(), set()
    with zipfile.ZipFile(upstream_wheel(lock, select_tag(lock))) as zf:
        for name in zf.namelist():
            data = zf.read(name)
            digests.add(hashlib.sha256(data).hexdigest())
            if name.endswith((".py", ".md", ".txt", ".json", ".yaml", ".toml", ".sh", ".jinja")):
                shingles |= _shingles(data)
    return digests, shingles


def verdict(data: bytes, index) -> str | None:
    digests, shingles = index
    if hashlib.sha256(data).hexdigest() in digests:
        return "identical to an upstream file"
    mine = _shingles(data)
    if len(mine) >= 3:
        share = len(mine & shingles) / len(mine)
        if share >= NEAR_COPY:
            return f"{share:.0%} of its 6-line runs are upstream's"
    return None


def test_guard_catches_a_lightly_edited_upstream_file(upstream_index):
    lock = read_lock(ROOT)
    with zipfile.ZipFile(upstream_wheel(lock, select_tag(lock))) as zf:
        original = zf.read("sglang/srt/disaggregation/prefill.py")
    edited = b"# ours\n" + original.replace(b"PrefillBootstrapQueue", b"OurBootstrapQueue")
    assert verdict(original, upstream_index) == "identical to an upstream file"
    assert verdict(edited, upstream_index) is not None


def test_no_tracked_file_copies_upstream(upstream_index):
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True,
                             check=True).stdout.decode().split("\0")
    offenders = {}
    for rel in filter(None, tracked):
        path = ROOT / rel
        if rel.startswith("patches/") or not path.is_file() or path.stat().st_size == 0:
            continue
        found = verdict(path.read_bytes(), upstream_index)
        if found:
            offenders[rel] = found
    assert offenders == {}
    assert len([t for t in tracked if t.startswith("python/")]) > 0
