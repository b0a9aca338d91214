"""cpu_only_host: the CPU-engine default and deferred sgl_kernel loading."""

import importlib.util
import sys
import types

import pytest
import torch

from sglang.srt.utils import cpu_only_host as h

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def fresh_caches():
    h.host_has_accelerator.cache_clear()
    h._load_sgl_kernel.cache_clear()
    yield
    h.host_has_accelerator.cache_clear()
    h._load_sgl_kernel.cache_clear()


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), ("yes", False)])
def test_explicit_value_wins(monkeypatch, value, expected):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", value)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: not expected)
    assert h.cpu_engine_enabled() is expected


def test_unset_on_a_host_without_accelerator(monkeypatch):
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(h, "entry_points", lambda group: [])
    assert h.cpu_engine_enabled() is True


def test_unset_with_a_torch_accelerator(monkeypatch):
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert h.cpu_engine_enabled() is False


@pytest.mark.parametrize("package", h.OUT_OF_TREE_DEVICE_PACKAGES)
def test_unset_with_an_out_of_tree_device_package(monkeypatch, package):
    # e.g. torch_npu: installed but not imported yet, so torch.accelerator sees nothing
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: name == package or None
    )
    assert h.cpu_engine_enabled() is False


def test_unset_with_a_platform_plugin(monkeypatch):
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(h, "entry_points", lambda group: ["vendor"])
    assert h.cpu_engine_enabled() is False


def test_missing_sgl_kernel_fails_on_call_naming_the_kernel(monkeypatch):
    monkeypatch.setitem(sys.modules, "sgl_kernel", None)  # import raises ImportError
    kernel = h.cpu_kernel("copy_all_layer_kv_cache_cpu")
    assert kernel.__name__ == "copy_all_layer_kv_cache_cpu"
    with pytest.raises(ImportError, match="sgl_kernel.copy_all_layer_kv_cache_cpu"):
        kernel()


def test_loaded_sgl_kernel_returns_the_real_kernel(monkeypatch):
    def real(*args):
        return "ran"

    fake = types.ModuleType("sgl_kernel")
    fake.assign_req_to_token_pool_cpu = real
    monkeypatch.setitem(sys.modules, "sgl_kernel", fake)
    assert h.cpu_kernel("assign_req_to_token_pool_cpu") is real
    with pytest.raises(ImportError, match="does not provide it"):
        h.cpu_kernel("not_in_this_build")()
