"""The upstream tree as a private git repo with the patch series applied as commits.

Layout inside the repo mirrors upstream's own git repo (wheel path `sglang/x` lives
at `python/sglang/x`), so patches apply unchanged upstream. The base is tagged
`upstream/<version>`; the series is applied with `git am` (exact context, no fuzz)
on branch `patch-queue`. A patch that does not apply is reported by patch, file
and hunk.
"""

import os
import re
import subprocess
import zipfile
from pathlib import Path

from . import BuildError
from .lock import Lock

IDENTITY = {
    "GIT_AUTHOR_NAME": "sglang-pd-fork",
    "GIT_AUTHOR_EMAIL": "fork@sglang-pd.invalid",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "sglang-pd-fork",
    "GIT_COMMITTER_EMAIL": "fork@sglang-pd.invalid",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+0000",
}
REQUIRED_HEADERS = ("Why:", "Upstream-Status:")


def git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, **IDENTITY, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
    # No auto gc: committing upstream's tree leaves thousands of loose objects, and a detached
    # `gc --auto` after `git am` kept writing into the build's temp dir while it was removed.
    proc = subprocess.run(["git", "-c", "gc.auto=0", "-c", "maintenance.auto=false", "-C", str(repo), *args],
                          capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise BuildError(f"git {' '.join(args)} failed in {repo}:\n{proc.stderr.strip()}")
    return proc


def read_series(root: Path) -> list[Path]:
    """Patches in series order; every patches/*.patch listed exactly once, each with its headers."""
    pdir = root.resolve() / "patches"
    series = pdir / "series"
    if not series.is_file():
        raise BuildError("patches/series: file missing")
    names = [
        line.strip()
        for line in series.read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    seen = set()
    for name in names:
        if name in seen:
            raise BuildError(f"patches/series lists {name} twice")
        seen.add(name)
        if not (pdir / name).is_file():
            raise BuildError(f"patches/series lists {name}, which does not exist in patches/")
    for path in sorted(pdir.glob("*.patch")):
        if path.name not in seen:
            raise BuildError(f"patches/{path.name} is not listed in patches/series")
    for name in names:
        text = (pdir / name).read_text()
        message = text.split("\n---\n", 1)[0]
        for header in REQUIRED_HEADERS:
            if not re.search(rf"^{re.escape(header)}", message, re.M):
                raise BuildError(f"patches/{name}: header {header!r} missing from its message")
    return [pdir / n for n in names]


def unpack_wheel(wheel: Path, dest: Path, name: str, version: str) -> None:
    """The wheel's package files under dest/python/ (its dist-info left out)."""
    dist_info = f"{name}-{version}.dist-info/"
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if info.is_dir() or info.filename.startswith(dist_info):
                continue
            path = dest / "python" / info.filename
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(zf.read(info))
            os.chmod(path, 0o755 if (info.external_attr >> 16) & 0o100 else 0o644)


def init_repo(repo: Path, wheel: Path, lock: Lock) -> None:
    """Unpack the wheel's package files under python/ and commit them as upstream/<version>."""
    unpack_wheel(wheel, repo, lock.name, lock.version)
    git(repo, "init", "-q", "-b", "patch-queue")
    git(repo, "add", "-A", "-f")
    git(repo, "commit", "-q", "--no-verify", "-m", f"upstream {lock.name} {lock.version}")
    git(repo, "tag", f"upstream/{lock.version}")


def _hunk_of(patch: Path, file: str, line: int) -> str:
    """'hunk K/N (@@ header @@)' of `patch` that starts at old line `line` of `file`."""
    section, hunks = None, []
    for text in patch.read_text().splitlines():
        if text.startswith("diff --git "):
            section = text.split(" b/", 1)[-1]
        elif text.startswith("@@") and section == file:
            hunks.append(text)
    for i, header in enumerate(hunks, 1):
        m = re.match(r"@@ -(\d+)", header)
        if m and int(m.group(1)) == line:
            return f"hunk {i}/{len(hunks)} ({header.split(' @@')[0]} @@)"
    return f"a hunk at line {line}"


def apply_series(repo: Path, patches: list[Path]) -> None:
    for patch in patches:
        proc = git(repo, "am", "--quiet", "--keep-cr", str(patch), check=False)
        if proc.returncode == 0:
            continue
        err = proc.stderr + proc.stdout
        git(repo, "am", "--abort", check=False)
        m = re.search(r"patch failed: (.+):(\d+)", err)
        if m:
            where = f"{m.group(1)}, {_hunk_of(patch, m.group(1), int(m.group(2)))}"
        else:
            m = re.search(r"error: (\S+): (does not exist in index|already exists in index)", err)
            where = f"{m.group(1)} ({m.group(2)})" if m else err.strip()[-500:]
        raise BuildError(f"patch {patch.name} does not apply: {where}")


def overlay_files(root: Path) -> list[Path]:
    """The fork's own files under python/, relative to python/ (no caches)."""
    base = root / "python"
    return sorted(
        p.relative_to(base)
        for p in base.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )


def overlay(root: Path, repo: Path, link: bool = False) -> None:
    """Add our files to the patched tree; an overlay may never replace an upstream file."""
    for rel in overlay_files(root):
        src, dest = root / "python" / rel, repo / "python" / rel
        if dest.is_symlink():
            dest.unlink()
        elif dest.exists():
            raise BuildError(
                f"python/{rel} would replace an upstream file; change upstream files "
                "through a patch in patches/ instead"
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        if link:
            dest.symlink_to(src.resolve())
        else:
            dest.write_bytes(src.read_bytes())
            os.chmod(dest, 0o644)
