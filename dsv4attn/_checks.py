"""Argument validation shared by the public ops: clear errors before any kernel runs."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``t`` fits; return it.

    ``shape`` entries that are ``None`` are free.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise TypeError(f"{name} must have dtype {want}, got {t.dtype} (shape {tuple(t.shape)})")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want_shape = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name} must have shape {want_shape}, got {tuple(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    return t


def same_device(**tensors: torch.Tensor | None) -> torch.device:
    """Return the common device of the given tensors (``None`` entries ignored)."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if not devices:
        raise ValueError("no tensor given")
    first = next(iter(devices.values()))
    for name, d in devices.items():
        if d != first:
            raise ValueError(f"all tensors must be on one device: {name} is on {d}, expected {first}")
    return first
