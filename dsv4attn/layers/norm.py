"""RMSNorm variants of DeepSeek-V4 attention (fp32 statistics, fp32 weight multiply).

The math lives in :mod:`dsv4attn.reference.norm_rope` (shared with the fused norm + RoPE op).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4attn.reference.norm_rope import rms_norm, rms_norm_unweighted

__all__ = ["RMSNorm", "rms_norm_unweighted"]


class RMSNorm(nn.Module):
    """``y = (weight * x / sqrt(mean(x^2) + eps)).to(x.dtype)``; stats and multiply in fp32.

    Parameter ``weight [dim]`` (name as in the checkpoint).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
