"""Reads upstream.lock and pyproject's [tool.sglang-fork]: the pinned upstream
release, the fork's local version label, one sha256 per supported wheel tag, and
the entry points the fork adds."""

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from . import BuildError

_LOCAL = re.compile(r"^[a-z0-9]+(\.[a-z0-9]+)*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_TAG = re.compile(r"^cp3\d+-cp3\d+-manylinux_\d+_\d+_(x86_64|aarch64)$")


@dataclass(frozen=True)
class Lock:
    name: str
    version: str
    local: str
    wheels: dict[str, str]  # wheel tag -> sha256
    entry_points: dict[str, dict[str, str]]  # group -> name -> "module:attr"

    @property
    def fork_version(self) -> str:
        return f"{self.version}+{self.local}"


def _toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise BuildError(f"{path.name}: file missing") from None
    except tomllib.TOMLDecodeError as e:
        raise BuildError(f"{path.name}: not valid TOML: {e}") from None


def read_lock(root: Path) -> Lock:
    data = _toml(root / "upstream.lock")
    try:
        name = data["upstream"]["name"]
        version = data["upstream"]["version"]
        local = data["fork"]["local"]
        wheels = dict(data["wheels"])
    except KeyError as e:
        raise BuildError(f"upstream.lock: missing key {e}") from None
    if not _LOCAL.match(local):
        raise BuildError(f"upstream.lock: [fork] local = {local!r} is not a PEP 440 local label")
    for tag, digest in wheels.items():
        if not _TAG.match(tag):
            raise BuildError(f"upstream.lock: {tag!r} is not a supported wheel tag")
        if not _SHA256.match(digest):
            raise BuildError(f"upstream.lock: sha256 for {tag} is not 64 hex digits")
    tool = _toml(root / "pyproject.toml").get("tool", {}).get("sglang-fork", {})
    entry_points = {g: dict(eps) for g, eps in tool.get("entry-points", {}).items()}
    return Lock(name, version, local, wheels, entry_points)
