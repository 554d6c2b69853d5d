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
