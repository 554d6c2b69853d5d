"""Which kernel path runs where: a pure function of the tensors' device (no env knobs of ours).

Paths:
- ``"triton"``: the Triton kernels. Real GPUs of compute capability >= 8.0 (sm80, sm89, sm90,
  sm100, sm120); e4m3 is decoded with integer bit operations, so no ``fp8e4nv`` support is
  needed to *read* caches. On CPU tensors it runs only under Triton's interpreter
  (``TRITON_INTERPRET=1``, set by the test suite), which is how CPU tests exercise the kernels.
- ``"reference"``: the plain PyTorch implementations; run on any device and serve as the spec.

``impl="auto"`` (the default of every op) picks ``"triton"`` for CUDA tensors on a capable device
and ``"reference"`` otherwise.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

Impl = Literal["auto", "triton", "reference"]

#: Minimum compute capability of the Triton path (Ampere; bf16 MMA and cp.async).
MIN_TRITON_CAPABILITY = (8, 0)


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when the ``triton`` package imports."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True


def triton_interpreter_on() -> bool:
    """True when Triton's own interpreter mode is on (Triton reads this variable, not us)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def supported_paths(device: torch.device | str) -> tuple[str, ...]:
    """Kernel paths that can run on ``device``, fastest first.

    ``("triton", "reference")`` on CUDA devices of capability >= 8.0 (and on CPU under the Triton
    interpreter); ``("reference",)`` elsewhere.
    """
    device = torch.device(device)
    if device.type == "cuda" and triton_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.get_device_capability(index) >= MIN_TRITON_CAPABILITY:
            return ("triton", "reference")
        return ("reference",)
    if device.type == "cpu" and triton_available() and triton_interpreter_on():
        return ("triton", "reference")
    return ("reference",)


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (asked once per device): what the kernels'
    split choices size their grids by."""
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


def resolve_impl(impl: str, device: torch.device | str) -> str:
    """Map ``impl`` ("auto" | "triton" | "reference") to the path that runs on ``device``.

    "auto" gives "triton" only for CUDA devices that support it (never the interpreter, which is
    for tests). Asking for "triton" where it cannot run raises ``ValueError``.
    """
    device = torch.device(device)
    if impl == "reference":
        return "reference"
    if impl == "auto":
        return "triton" if device.type == "cuda" and "triton" in supported_paths(device) else "reference"
    if impl == "triton":
        if "triton" not in supported_paths(device):
            raise ValueError(
                f"impl='triton' cannot run on device {device}: needs a CUDA device of compute "
                f"capability >= {MIN_TRITON_CAPABILITY} or TRITON_INTERPRET=1 on CPU"
            )
        return "triton"
    raise ValueError(f"impl must be 'auto', 'triton' or 'reference', got {impl!r}")
