"""Test set-up: Triton kernels run in the interpreter when no CUDA device exists.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection
start. On a GPU machine the kernels compile for the device and the interpreter stays off.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the tests run their kernels on: CUDA if present, else CPU (interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True, scope="session")
def _kernel_config_overrides():
    """``DSV4ATTN_TEST_KERNEL_CONFIG="field=value,..."`` runs the whole suite with those
    :class:`~dsv4attn.ops.sparse_attn_launch.KernelConfig` fields changed in every config that
    dispatch picks: a kernel variant is tested everywhere before it becomes a default (the GPU
    calls of scripts/gpu_vs_flashmla.sh, step ``tests2``). Unset: nothing changes."""
    spec = os.environ.get("DSV4ATTN_TEST_KERNEL_CONFIG")
    if not spec:
        yield
        return
    import dataclasses

    from dsv4attn.ops import sparse_attn_launch

    over = sparse_attn_launch.kernel_config_changes(spec)  # a bad spec fails here, once
    pick = sparse_attn_launch.kernel_config

    def patched(*args, **kwargs):
        return dataclasses.replace(pick(*args, **kwargs), **over)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sparse_attn_launch, "kernel_config", patched)
        yield


@pytest.fixture
def launches_through_cache(monkeypatch):
    """Every launch through :mod:`dsv4attn.ops.launch_cache` goes through the cache, launches on
    CPU tensors too (stand-in kernels, the interpreter), as attention launches do on a GPU."""
    from dsv4attn.ops import launch_cache

    monkeypatch.setattr(launch_cache, "ENABLED", True)
    monkeypatch.setattr(launch_cache, "DEVICE_TYPES", ("cpu", "cuda"))
    if not HAS_CUDA:
        monkeypatch.setattr(launch_cache, "current_device", lambda: 0)
    launch_cache.clear()
    yield
    launch_cache.clear()
