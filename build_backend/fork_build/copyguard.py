"""The repository's one rule, checked: no file of ours is a copy or near-copy of a
file in the upstream wheel. Whole files are compared by sha256, the rest by 6-line
shingles (whitespace folded, blank lines dropped). Patches are exempt: their context
lines are upstream's by design."""

import hashlib
import subprocess
import zipfile
from pathlib import Path

SHINGLE = 6
NEAR_COPY = 0.5  # share of a file's shingles found upstream that makes it a near-copy
TEXT_SUFFIXES = (".py", ".md", ".txt", ".json", ".yaml", ".toml", ".sh", ".jinja")
NOT_OURS = {".git", ".upstream", ".venv", ".cache", "__pycache__", ".pytest_cache", "dist", "build"}


def shingles(data: bytes) -> set[int]:
    lines = [" ".join(l.split()) for l in data.decode("utf-8", "replace").splitlines() if l.strip()]
    return {hash("\n".join(lines[i:i + SHINGLE])) for i in range(len(lines) - SHINGLE + 1)}


def upstream_index(wheel: Path) -> tuple[set[str], set[int]]:
    digests, runs = set(), set()
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            data = zf.read(name)
            digests.add(hashlib.sha256(data).hexdigest())
            if name.endswith(TEXT_SUFFIXES):
                runs |= shingles(data)
    return digests, runs


def verdict(data: bytes, index: tuple[set[str], set[int]]) -> str | None:
    """Why `data` counts as upstream's, or None."""
    digests, runs = index
    if hashlib.sha256(data).hexdigest() in digests:
        return "identical to an upstream file"
    mine = shingles(data)
    if len(mine) >= 3:
        share = len(mine & runs) / len(mine)
        if share >= NEAR_COPY:
            return f"{share:.0%} of its 6-line runs are upstream's"
    return None


def our_files(root: Path) -> list[str]:
    """Tracked and not-ignored files of a git checkout; elsewhere every file but build output."""
    proc = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "-co", "--exclude-standard"],
                          capture_output=True)
    if proc.returncode == 0 and (root / ".git").exists():
        return sorted(f for f in proc.stdout.decode().split("\0") if f)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and not NOT_OURS & set(p.relative_to(root).parts) and p.suffix != ".pyc")


def upstream_copies(root: Path, wheel: Path) -> dict[str, str]:
    """Our files (patches/ exempt) that copy an upstream file, with the reason."""
    index = upstream_index(wheel)
    offenders = {}
    for rel in our_files(root):
        path = root / rel
        if rel.startswith("patches/") or not path.is_file() or path.stat().st_size == 0:
            continue
        found = verdict(path.read_bytes(), index)
        if found:
            offenders[rel] = found
    return offenders
