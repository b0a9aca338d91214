"""Finds the upstream wheel for this interpreter and proves it is the locked one.

The wheel comes from SGLANG_FORK_UPSTREAM_WHEEL (a file or a folder, for offline
builds), else from a sha256-checked cache, else through `pip download`, so the
user's index, mirrors and proxies apply. No file is used before its sha256
matches upstream.lock.
"""

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from . import BuildError
from .lock import Lock


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _glibc() -> tuple[int, int] | None:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    except (AttributeError, ValueError, OSError):
        return None
    major, minor = version.split(".")[:2]
    return (int(major), int(minor)) if name == "glibc" else None


def select_tag(lock: Lock, python=None, machine=None, glibc=None, implementation=None) -> str:
    """The locked wheel tag this interpreter can run, or BuildError listing the supported ones."""
    python = python or sys.version_info[:2]
    machine = machine or platform.machine()
    implementation = implementation or sys.implementation.name
    glibc = glibc if glibc is not None else _glibc()
    py = f"cp{python[0]}{python[1]}"
    for tag in sorted(lock.wheels):
        interp, abi, plat = tag.split("-")
        m = re.match(r"manylinux_(\d+)_(\d+)_(.+)$", plat)
        if (
            implementation == "cpython"
            and interp == py
            and m.group(3) == machine
            and glibc is not None
            and glibc >= (int(m.group(1)), int(m.group(2)))
        ):
            return tag
    libc = "glibc %d.%d" % glibc if glibc else "no glibc"
    raise BuildError(
        f"unsupported platform or Python: {implementation} {python[0]}.{python[1]} on "
        f"{machine} with {libc}; sglang {lock.version} is locked for: "
        + ", ".join(sorted(lock.wheels))
    )


def _verified(path: Path, expected: str) -> Path:
    actual = sha256(path)
    if actual != expected:
        raise BuildError(
            f"sha256 mismatch for {path.name}: upstream.lock says {expected}, "
            f"the file has {actual}"
        )
    return path


def _pip_env() -> dict[str, str]:
    """The caller's environment minus a PEP 517 build sandbox's path overrides, which
    hide pip's own package; PIP_* settings (index, mirrors, proxies) are kept."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}


def _pip() -> list[str]:
    if os.environ.get("SGLANG_FORK_PIP"):
        return os.environ["SGLANG_FORK_PIP"].split()
    candidates = [[sys.executable, "-m", "pip"]] + [[p] for p in map(shutil.which, ("pip3", "pip")) if p]
    for cmd in candidates:
        probe = subprocess.run(cmd + ["--version"], capture_output=True, env=_pip_env())
        if probe.returncode == 0:
            return cmd
    raise BuildError("cannot fetch the upstream wheel: no working pip (set SGLANG_FORK_PIP or SGLANG_FORK_UPSTREAM_WHEEL)")


def _cache_dir() -> Path:
    base = os.environ.get("SGLANG_FORK_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sglang-fork"
    )
    return Path(base) / "wheels"


def upstream_wheel(lock: Lock, tag: str) -> Path:
    expected = lock.wheels[tag]
    filename = f"{lock.name}-{lock.version}-{tag}.whl"
    given = os.environ.get("SGLANG_FORK_UPSTREAM_WHEEL")
    if given:
        path = Path(given)
        path = path / filename if path.is_dir() else path
        if not path.is_file():
            raise BuildError(f"SGLANG_FORK_UPSTREAM_WHEEL: {path} does not exist")
        return _verified(path, expected)

    cached = _cache_dir() / filename
    if cached.is_file() and sha256(cached) == expected:
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    interp, abi, plat = tag.split("-")
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        cmd = _pip() + [
            "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
            "--platform", plat, "--implementation", "cp", "--abi", abi,
            "--python-version", f"{interp[2]}.{interp[3:]}",
            "--dest", tmp, f"{lock.name}=={lock.version}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_pip_env())
        fetched = Path(tmp) / filename
        if proc.returncode != 0 or not fetched.is_file():
            raise BuildError(
                f"could not fetch {filename} through pip (exit {proc.returncode}):\n"
                + (proc.stderr + proc.stdout)[-2000:]
            )
        _verified(fetched, expected)
        os.replace(fetched, cached)
    return cached
