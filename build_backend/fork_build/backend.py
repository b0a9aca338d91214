"""PEP 517 / PEP 660 hooks: build_wheel, build_editable, build_sdist.

A regular wheel is built from a throwaway patched repo. An editable install keeps
that repo at `.upstream/` (git-ignored; tag `upstream/<version>`, branch
`patch-queue` with the series as commits, our files symlinked in) and points a
.pth file at it, so edits there can be exported back with `tools/fork pq export`.
"""

import gzip
import io
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from . import BuildError
from .lock import Lock, read_lock
from .patchqueue import apply_series, git, init_repo, overlay, overlay_files, read_series
from .upstream import select_tag, upstream_wheel
from .wheel import dist_info, version_module, write_wheel

ROOT = Path(__file__).resolve().parents[2]
SDIST_FILES = ("pyproject.toml", "upstream.lock", "README.md", "CHANGELOG.md")
SDIST_DIRS = ("build_backend", "patches", "python")


def get_requires_for_build_wheel(config_settings=None):
    return []


get_requires_for_build_editable = get_requires_for_build_sdist = get_requires_for_build_wheel


def prepare_patched_repo(root: Path, repo: Path) -> tuple[Lock, str, Path]:
    """Fresh upstream repo at `repo` with the series applied. Returns (lock, tag, upstream wheel)."""
    lock = read_lock(root)
    tag = select_tag(lock)
    patches = read_series(root)
    wheel = upstream_wheel(lock, tag)
    init_repo(repo, wheel, lock)
    apply_series(repo, patches)
    return lock, tag, wheel


def _wheel_name(lock: Lock, tag: str) -> str:
    return f"{lock.name}-{lock.fork_version}-{tag}.whl"


def _dist_info_entries(lock: Lock, wheel: Path) -> tuple[str, list]:
    di = f"{lock.name}-{lock.fork_version}.dist-info"
    return di, [(f"{di}/{n}", data, 0o644) for n, data in dist_info(lock, wheel).items()]


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None, root: Path = ROOT):
    """Only the dist-info: needs the verified upstream wheel, not the patched tree."""
    lock = read_lock(root)
    read_series(root)
    di = f"{lock.name}-{lock.fork_version}.dist-info"
    for name, data in dist_info(lock, upstream_wheel(lock, select_tag(lock))).items():
        path = Path(metadata_directory) / di / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return di


prepare_metadata_for_build_editable = prepare_metadata_for_build_wheel


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None, root: Path = ROOT):
    with tempfile.TemporaryDirectory(prefix="sglang-fork-") as tmp:
        repo = Path(tmp)
        lock, tag, wheel = prepare_patched_repo(root, repo)
        overlay(root, repo)
        (repo / "python" / lock.name / "_version.py").write_bytes(version_module(lock))
        entries = []
        base = repo / "python"
        for path in base.rglob("*"):
            if path.is_file():
                mode = 0o755 if os.stat(path).st_mode & 0o100 else 0o644
                entries.append((path.relative_to(base).as_posix(), path.read_bytes(), mode))
        di, meta = _dist_info_entries(lock, wheel)
        name = _wheel_name(lock, tag)
        write_wheel(Path(wheel_directory) / name, entries + meta, di)
    return name


def ensure_upstream_checkout(root: Path) -> tuple[Lock, str, Path]:
    """`.upstream/`: created on first use, never rebuilt over local edits."""
    repo = root / ".upstream"
    lock = read_lock(root)
    if not (repo / ".git").exists():
        tmp = Path(tempfile.mkdtemp(prefix=".upstream-", dir=root))
        try:
            prepare_patched_repo(root, tmp)
        except BaseException:
            shutil.rmtree(tmp)
            raise
        os.replace(tmp, repo)
    elif git(repo, "tag", "-l", f"upstream/{lock.version}").stdout.strip() == "":
        raise BuildError(
            f".upstream/ holds another upstream version than {lock.version}; "
            "move it away (after exporting your edits to patches/) and reinstall"
        )
    tag = select_tag(lock)
    return lock, tag, upstream_wheel(lock, tag)


def link_editable(root: Path, repo: Path, lock: Lock) -> None:
    """Make `repo` importable as the fork: our files symlinked in (git-excluded) and
    _version.py generated (skip-worktree), so the patch queue stays clean."""
    overlay(root, repo, link=True)
    version_file = f"python/{lock.name}/_version.py"
    git(repo, "update-index", "--skip-worktree", version_file)
    (repo / version_file).write_bytes(version_module(lock))
    (repo / ".git" / "info" / "exclude").write_text(
        "# the fork's own files, symlinked in by build_editable\n"
        + "".join(f"/python/{p.as_posix()}\n" for p in overlay_files(root))
    )


def build_editable(wheel_directory, config_settings=None, metadata_directory=None, root: Path = ROOT):
    lock, tag, wheel = ensure_upstream_checkout(root)
    repo = root / ".upstream"
    link_editable(root, repo, lock)
    di, meta = _dist_info_entries(lock, wheel)
    pth = (f"__editable__.{lock.name}_fork.pth", f"{(repo / 'python').resolve()}\n".encode(), 0o644)
    name = _wheel_name(lock, tag)
    write_wheel(Path(wheel_directory) / name, [pth] + meta, di)
    return name


def build_sdist(sdist_directory, config_settings=None, root: Path = ROOT):
    lock = read_lock(root)
    base = f"{lock.name}-{lock.fork_version}"
    paths = [root / f for f in SDIST_FILES if (root / f).is_file()]
    for d in SDIST_DIRS:
        paths += [p for p in (root / d).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]
    pkg_info = f"Metadata-Version: 2.1\nName: {lock.name}\nVersion: {lock.fork_version}\n".encode()
    name = f"{base}.tar.gz"
    with open(Path(sdist_directory) / name, "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
            members = [(f"{base}/PKG-INFO", pkg_info)] + [
                (f"{base}/{p.relative_to(root).as_posix()}", p.read_bytes()) for p in paths
            ]
            for arcname, data in sorted(members):
                info = tarfile.TarInfo(arcname)
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tar.addfile(info, io.BytesIO(data))
    return name
