"""Interleaved (GPT-J) rotary embedding on the trailing ``rope_dim`` channels.

Pair ``i`` is channels ``(nope + 2i, nope + 2i + 1)`` with ``nope = D - rope_dim``:
``e' = e*cos_i - o*sin_i``, ``o' = e*sin_i + o*cos_i``. The inverse rotation (used on the
attention output, whose V == K carries the rotated part) is the same with ``-sin``.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4attn.config import RopeConfig


class RotaryTable(nn.Module):
    """cos/sin of one rotary table (one ``RopeConfig``) at arbitrary integer positions.

    ``inv_freq`` is a non-persistent fp32 buffer ``[rope_dim // 2]`` (not part of the state dict,
    like the reference's rotary buffers).
    """

    def __init__(self, rope: RopeConfig, rope_dim: int) -> None:
        super().__init__()
        self.rope: RopeConfig = rope
        self.rope_dim = rope_dim
        self.register_buffer("inv_freq", rope.inv_freq(rope_dim), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[N]`` (any int dtype) -> ``(cos, sin)`` fp32 ``[N, rope_dim // 2]``."""
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]  # a registered buffer
        freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)
        scale = self.rope.attention_factor
        return freqs.cos() * scale, freqs.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` channels of ``x`` pairwise; returns a new tensor.

    x ``[N, ..., D]`` (any float dtype); cos/sin fp32 ``[N, rope_dim // 2]`` broadcast over the
    middle dims. Math in fp32, result in ``x.dtype``. ``inverse=True`` rotates by ``-angle``.
    """
    half = cos.shape[-1]
    rope_dim = 2 * half
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        s = -s
    rot = x[..., -rope_dim:].float()
    even, odd = rot[..., 0::2], rot[..., 1::2]
    out_even = even * c - odd * s
    out_odd = odd * c + even * s
    rotated = torch.stack((out_even, out_odd), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rope_dim], rotated], dim=-1)
