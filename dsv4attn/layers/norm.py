"""RMSNorm variants of DeepSeek-V4 attention (fp32 statistics, fp32 weight multiply)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``y = (weight * x / sqrt(mean(x^2) + eps)).to(x.dtype)``; stats and multiply in fp32.

    Parameter ``weight [dim]`` (name as in the checkpoint).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm over the last dim (per-head q norm): fp32 statistics, ``x.dtype`` out."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
