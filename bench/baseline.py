"""The stock upstream baseline for the release gate: upstream's pinned wheel, unpacked
into a temporary folder that goes first on PYTHONPATH, plus the two import-only
stand-ins stock 0.5.23 needs to start on a CPU-only host.

Bench-only. Nothing here is used by the fork itself:

- The wheel is the one `upstream.lock` pins, found and sha256-checked by the
  build backend (`fork_build.upstream.upstream_wheel`: $SGLANG_FORK_UPSTREAM_WHEEL,
  the build cache, or pip's configured index). Its `sglang/` package and its
  dist-info are unpacked, so `import sglang` and `importlib.metadata` both resolve to
  stock upstream in a baseline server; the fork's dist-info (and its
  `sglang.srt.plugins` entry point) is shadowed, and SGLANG_PLUGINS names no
  installed plugin so none is loaded even if it were visible.
- `sgl_kernel`: the runtime set has no sgl_kernel (PyPI's build is CUDA-only), and
  stock 0.5.23 imports `..._cpu` kernels from it at module level on CPU. The
  stand-in resolves any name to a function that raises when called; on a CPU
  without AMX no sgl_kernel function is called (torch-native paths), so a call
  would be a visible crash, not a silent change of results.
- `torchvision`: stock 0.5.23 imports it at module level on the launch path (image
  preprocessing of two VL models), and transformers then imports it too. The
  stand-in provides any submodule and any name as a placeholder; using one raises.
  The tiny text model never preprocesses an image.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, List

REPO_ROOT = Path(__file__).resolve().parents[1]

# Same env for both sides where stock upstream needs a knob the fork defaults
# (see docs in bench/README.md): the values equal the fork's own CPU defaults or
# select the same code path on both sides.
SHARED_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",  # fork: default on a host without accelerator
    "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1",  # CPU-safe send path on both
    "SGLANG_LOG_FORWARD_ITERS": "1",  # "[forward_ct]" in batch log lines (iteration count)
}
SHARED_ARGS = (
    "--disable-overlap-schedule",  # stock upstream crashes with overlap on CPU
    "--decode-log-interval", "1",  # a log line per decode iteration (iteration count)
)
DECODE_ARGS = ("--disaggregation-decode-retraction-backup", "cpu_tensor")  # fork's CPU default
NO_PLUGIN = "none-bench-baseline"  # SGLANG_PLUGINS whitelist matching no plugin

_SGL_KERNEL = '''"""Bench-only import stand-in for sgl_kernel (see bench/baseline.py)."""
__version__ = "0.0.0+bench-standin"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{name} called: bench stand-in has no kernels")

    missing.__name__ = name
    return missing
'''

_TORCHVISION = '''"""Bench-only import stand-in for torchvision (see bench/baseline.py).

Any submodule imports, any attribute is a placeholder class (also subclassable and
usable in annotations and defaults); calling or instantiating one raises.
"""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+bench-standin"


class _MissingMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _missing(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"torchvision.{cls.__qualname__} used: bench stand-in")


def _missing(name):
    return _MissingMeta(name, (), {"__qualname__": name})


def _module_getattr(module_name):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _missing(name)
        setattr(sys.modules[module_name], name, value)
        return value
    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__getattr__ = _module_getattr(__name__)
'''


def _fork_build():
    sys.path.insert(0, str(REPO_ROOT / "build_backend"))
    try:
        from fork_build.lock import read_lock
        from fork_build.upstream import select_tag, upstream_wheel
    finally:
        sys.path.remove(str(REPO_ROOT / "build_backend"))
    return read_lock, select_tag, upstream_wheel


def write_standins(folder: Path) -> Path:
    """The import-only sgl_kernel and torchvision stand-ins, as packages in folder."""
    files = {
        "sgl_kernel/__init__.py": _SGL_KERNEL,
        "torchvision/__init__.py": _TORCHVISION,
    }
    for rel, text in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


def _python_version(python: str) -> tuple:
    out = subprocess.run(
        [python, "-c", "import sys; print(*sys.version_info[:2])"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    return int(out[0]), int(out[1])


def prepare(workdir: Path, python: str) -> Dict[str, object]:
    """Unpack upstream (the wheel for `python`, the servers' interpreter) and write
    the stand-ins under workdir; returns the wheel, versions and PYTHONPATH entries
    for the baseline servers."""
    read_lock, select_tag, upstream_wheel = _fork_build()
    lock = read_lock(REPO_ROOT)
    tag = select_tag(lock, python=_python_version(python))
    wheel = upstream_wheel(lock, tag)  # sha256-checked against upstream.lock
    site = workdir / "upstream-site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    standins = write_standins(workdir / "standins")
    probe = write_probe_plugin(workdir / "probe-plugin", workdir / "probe")
    # the fork paces its own idle passes (idle_pacing): its side's probe only accounts, so no side is paced twice
    accounting = write_probe_plugin(workdir / "probe-plugin-accounting", workdir / "probe", pace_s=0.0)
    return {
        "wheel": wheel,
        "version": lock.version,
        "fork_version": lock.fork_version,
        "pythonpath": [str(site), str(standins)],
        "probe": str(probe),
        "probe_accounting": str(accounting),
        "probe_dir": str(workdir / "probe"),
    }


def upstream_env(prepared: Dict[str, object], probe: bool = True) -> Dict[str, str]:
    """Stock upstream first on PYTHONPATH; no plugin but the bench's probe (which paces its idle passes)."""
    paths: List[str] = list(prepared["pythonpath"])  # type: ignore[arg-type]
    if probe:
        paths.append(prepared["probe"])  # type: ignore[arg-type]
    return {**SHARED_ENV, "PYTHONPATH": ":".join(paths), "SGLANG_PLUGINS": PROBE_PLUGIN if probe else NO_PLUGIN}


def fork_env(prepared: Dict[str, object], standins: bool, probe: bool = True) -> Dict[str, str]:
    """The fork comes from the interpreter's site-packages; with standins, the same
    import stand-ins as the baseline are on its PYTHONPATH too (the fork does not
    need them, but then both sides see the same sgl_kernel/torchvision); with probe,
    the bench's probe plugin, as on the upstream side, but only its pass accounting: the fork paces its idle
    passes itself (disaggregation/fork_transfer/idle_pacing.py, `SGLANG_FORK_PD_IDLE_PACE`, 1 ms by default)."""
    paths: List[str] = list(prepared["pythonpath"])[1:] if standins else []  # type: ignore[arg-type]
    if probe:
        paths.append(prepared["probe_accounting"])  # type: ignore[arg-type]
    return {**SHARED_ENV, "PYTHONPATH": ":".join(paths)}


_SLOWDOWN_PLUGIN = '''"""Bench/test-only plugin (bench/baseline.py): a deliberately slower fork.

Registered through the same `sglang.srt.plugins` entry point group as the fork's own
plugin, it adds one BEFORE hook on DecodeTransferQueue.pop_transferred (a hook the
fork already has, called once per decode scheduler loop) that busy-loops on the CPU.
Never shipped: the bench writes it into a temporary folder on the fork side's
PYTHONPATH when asked (`--inject-slowdown-us`)."""
import time

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

BUSY_SECONDS = {seconds!r}


def busy_loop(*args, **kwargs):
    # CPU time, not wall time: on a loaded machine a wall-clock loop is preempted and
    # spends less CPU than asked (the gate judges CPU)
    end = time.thread_time() + BUSY_SECONDS
    while time.thread_time() < end:
        pass


def register():
    HookRegistry.register(
        "sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred", busy_loop, HookType.BEFORE
    )
'''


def _write_plugin(folder: Path, module: str, source: str) -> Path:
    """A one-module plugin distribution (dist-info with its `sglang.srt.plugins`
    entry point `module = module:register`) under folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}.py").write_text(source)
    info = folder / f"{module}-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{module} = {module}:register\n")
    (info / "RECORD").write_text("")
    return folder


def write_slowdown_plugin(folder: Path, busy_us: float) -> Path:
    """A plugin distribution under folder that makes the fork's decode scheduler spend
    `busy_us` µs of CPU per loop (test/bench only)."""
    return _write_plugin(folder, "fork_bench_slowdown", _SLOWDOWN_PLUGIN.format(seconds=busy_us / 1e6))


PROBE_PLUGIN = "fork_bench_probe"
PACE_SECONDS = 0.001

_PROBE = '''"""Bench-only plugin (bench/baseline.py), loaded by BOTH sides of the release gate
(the same code on both, so whatever it costs, it costs both alike).

1. Pacing (upstream's side; {pace_ms:g} ms here, 0 = none: the fork paces itself). A PD
   scheduler with requests in its transfer queues but no batch to run does not sleep in
   stock upstream: `Scheduler.on_idle` returns after `time.sleep(0)` and the loop
   polls again at once, for as long as a transfer or the next request takes in wall
   time. This AROUND hook on `on_idle` sleeps the pace after such a pass (not
   when the server is fully idle: upstream's idle sleeper handles that), as the fork's
   own idle pacing (idle_pacing.py) does.
2. Pass accounting. A BEFORE hook on the method each scheduler loop calls once per
   pass (decode: process_decode_queue; prefill: get_next_disagg_prefill_batch_to_run)
   splits the scheduler thread's CPU time (time.thread_time) into passes that ran a
   batch ("busy") and passes that found nothing to run ("idle": on_idle was called).
   The totals are written to {out!r}/<pid>.json on every fully idle pass (about once
   a second when the server has nothing to do), which the bench reads after a run.
   Idle passes poll for as long as the wall clock makes them: the gate judges the
   busy passes.
"""
import json
import os
import time

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

PACE = {pace!r}
OUT = {out!r}
_s = {{"mark": None, "idle": False, "busy_cpu": 0.0, "idle_cpu": 0.0, "busy_passes": 0, "idle_passes": 0}}


def pass_boundary(*args, **kwargs):
    now = time.thread_time()
    if _s["mark"] is not None:
        kind = "idle" if _s["idle"] else "busy"
        _s[kind + "_cpu"] += now - _s["mark"]
        _s[kind + "_passes"] += 1
    _s["mark"] = now
    _s["idle"] = False


def _dump():
    path = os.path.join(OUT, f"{{os.getpid()}}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({{k: v for k, v in _s.items() if k not in ("mark", "idle")}} | {{"t": time.time()}}, f)
    os.replace(tmp, path)


def paced_on_idle(original, scheduler, *args, **kwargs):
    _s["idle"] = True
    result = original(scheduler, *args, **kwargs)
    if scheduler.is_fully_idle():
        _dump()
    elif PACE:
        time.sleep(PACE)
    return result


def register():
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.on_idle", paced_on_idle, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.process_decode_queue",
        pass_boundary, HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.get_next_disagg_prefill_batch_to_run",
        pass_boundary, HookType.BEFORE,
    )
'''


def write_probe_plugin(folder: Path, out_dir: Path, pace_s: float = PACE_SECONDS) -> Path:
    """The pacing + pass-accounting plugin, writing its totals to out_dir (pace_s 0: accounting only)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return _write_plugin(
        folder, PROBE_PLUGIN, _PROBE.format(pace=pace_s, pace_ms=pace_s * 1e3, out=str(out_dir))
    )
