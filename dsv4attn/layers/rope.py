"""Interleaved (GPT-J) rotary embedding on the trailing ``rope_dim`` channels.

Pair ``i`` is channels ``(nope + 2i, nope + 2i + 1)`` with ``nope = D - rope_dim``:
``e' = e*cos_i - o*sin_i``, ``o' = e*sin_i + o*cos_i``. The inverse rotation (used on the
attention output, whose V == K carries the rotated part) is the same with ``-sin``. The math
lives in :mod:`dsv4attn.reference.norm_rope`; this module holds the per-layer table.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4attn.config import RopeConfig
from dsv4attn.ops.norm_rope import rope_cos_sin
from dsv4attn.reference.norm_rope import apply_rope

__all__ = ["RotaryTable", "apply_rope"]


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

    def forward(
        self, positions: torch.Tensor, ratio: int = 1, impl: str = "reference"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[N]`` (int32/int64) -> ``(cos, sin)`` fp32 ``[N, rope_dim // 2]``.

        ``ratio > 1``: at the first position ``floor(max(p, 0) / r) * r`` of each position's
        compressed entry. ``impl`` picks the one-launch kernel (``ops.norm_rope.rope_cos_sin``)
        or the reference."""
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]  # a registered buffer
        return rope_cos_sin(positions, inv_freq, self.rope.attention_factor, ratio=ratio, impl=impl)
