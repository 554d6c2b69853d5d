"""Argument validation shared by the public ops: clear errors before any kernel runs."""

from __future__ import annotations

import math
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
    """Return the common device of the given tensors (``None`` entries ignored); ``ValueError``
    naming every tensor that is not on the device most of them share."""
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if not devices:
        raise ValueError("no tensor given")
    values = list(devices.values())
    common = max(values, key=values.count)  # ties: the first argument's device
    odd = [f"{name} is on {d}" for name, d in devices.items() if d != common]
    if odd:
        raise ValueError(f"all tensors must be on one device ({common}): " + ", ".join(odd))
    return common


#: Largest int32 value: slots and lengths written as int32 must stay at or below it.
INT32_MAX = 2**31 - 1


def check_int(name: str, v: object, lo: int | None = None, hi: int | None = None) -> int:
    """``TypeError`` unless ``v`` is an int (bools refused); ``ValueError`` outside ``[lo, hi]``."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return v


def check_float(name: str, v: object, *, positive: bool = False) -> float:
    """``TypeError`` unless ``v`` is a real number; ``ValueError`` unless finite (and > 0)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    if not math.isfinite(v) or (positive and not v > 0):
        raise ValueError(f"{name} must be a finite{' positive' if positive else ''} number, got {v!r}")
    return float(v)


def check_values(name: str, t: torch.Tensor, lo: int | None = None, hi: int | None = None) -> None:
    """``ValueError`` naming ``name`` unless every element of the integer tensor ``t`` lies in
    ``[lo, hi]`` (one host sync; nothing for an empty tensor)."""
    if t.numel() == 0:
        return
    mn, mx = (int(x) for x in torch.aminmax(t.reshape(-1)))
    if lo is not None and mn < lo:
        raise ValueError(f"{name} holds {mn}, below the smallest allowed value {lo}")
    if hi is not None and mx > hi:
        raise ValueError(f"{name} holds {mx}, above the largest allowed value {hi}")


def as_device(name: str, device: object) -> torch.device:
    """A canonical ``torch.device`` (``cuda`` -> ``cuda:N``); ``ValueError``/``TypeError`` naming
    ``name`` for anything torch does not accept as a device."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name} must be a str or torch.device, got {type(device).__name__}")
    try:
        return torch.empty(0, device=device).device
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{name} {device!r} is not a usable device: {e}") from None
