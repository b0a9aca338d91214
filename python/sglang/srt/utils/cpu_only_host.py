"""Stock sglang on a host without an accelerator: `--device cpu` needs no knobs.

Invariant: with no accelerator, SGLANG_USE_CPU_ENGINE defaults to on (an explicit
value still wins), and the CPU build of sgl_kernel is optional: a kernel it lacks
fails when called, naming itself, not when its module is imported. Called from
upstream's `is_cpu()` / `_is_cpu_available()` and its `if _is_cpu:` kernel imports.
"""

import importlib
import importlib.util
import logging
import os
from functools import lru_cache
from importlib.metadata import entry_points
from typing import Callable

import torch

logger = logging.getLogger(__name__)

# Device extensions that register their torch backend only once imported, so
# torch.accelerator cannot see them before (Ascend's torch_npu registers
# PrivateUse1 on import). Installed means "not a CPU-only host".
OUT_OF_TREE_DEVICE_PACKAGES = (
    "torch_npu",
    "torch_musa",
    "torch_mlu",
    "habana_frameworks",
)
# Upstream's entry-point group for out-of-tree sglang platforms (vendor devices).
PLATFORM_PLUGINS_GROUP = "sglang.srt.platforms"


@lru_cache(maxsize=1)
def host_has_accelerator() -> bool:
    """A device torch sees, or an installed device extension or sglang platform."""
    if torch.accelerator.is_available():
        return True
    if any(importlib.util.find_spec(p) for p in OUT_OF_TREE_DEVICE_PACKAGES):
        return True
    return len(entry_points(group=PLATFORM_PLUGINS_GROUP)) > 0


def cpu_engine_enabled() -> bool:
    """SGLANG_USE_CPU_ENGINE: "1" on, else off; unset: on when no accelerator."""
    value = os.environ.get("SGLANG_USE_CPU_ENGINE")
    if value is not None:
        return value == "1"
    return not host_has_accelerator()


def _first_line(error: BaseException) -> str:
    text = str(error).strip().split("\n", 1)[0]
    return f"{type(error).__name__}: {text}"


@lru_cache(maxsize=1)
def _load_sgl_kernel():
    """sgl_kernel, or the error that kept it from loading (logged once)."""
    try:
        return importlib.import_module("sgl_kernel")
    except (ImportError, OSError) as error:
        # Not installed, or the CUDA build (needs libcuda.so.1). A CPU without
        # AMX takes torch-native paths and never calls these kernels.
        logger.info(
            "sgl_kernel is unavailable (%s); its CPU kernels raise if called.",
            _first_line(error),
        )
        return error


def cpu_kernel(name: str) -> Callable:
    """`from sgl_kernel import <name>`, deferring a failure to the first call."""
    loaded = _load_sgl_kernel()
    if isinstance(loaded, BaseException):
        cause = loaded
        reason = f"sgl_kernel could not be loaded ({_first_line(loaded)})"
    elif hasattr(loaded, name):
        return getattr(loaded, name)
    else:
        cause, reason = None, "this sgl_kernel build does not provide it"

    def unavailable(*args, **kwargs):
        raise ImportError(f"sgl_kernel.{name} is needed here, but {reason}") from cause

    unavailable.__name__ = unavailable.__qualname__ = name
    return unavailable
