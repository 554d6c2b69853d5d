"""RMSNorm and interleaved RoPE of DeepSeek-V4 attention: the math, in plain PyTorch.

The one home of these formulas: the layers (``layers/norm.py``, ``layers/rope.py``) and the
fused op :func:`dsv4attn.ops.norm_rope.norm_rope` (whose reference path is :func:`norm_rope_ref`)
call them.

- weighted RMSNorm: ``(weight * x / sqrt(mean(x^2) + eps)).to(x.dtype)``, statistics and the
  weight multiply in fp32;
- weightless RMSNorm (the per-head q norm): ``x * rsqrt(mean(x^2) + eps).to(x.dtype)`` (fp32
  statistics, the multiply in x's dtype);
- RoPE (GPT-J interleaved) on the trailing ``rope_dim = 2 * half`` channels: pair ``i`` is
  channels ``(nope + 2i, nope + 2i + 1)``, ``e' = e*cos_i - o*sin_i``, ``o' = e*sin_i + o*cos_i``
  in fp32, result in x's dtype; the inverse rotation uses ``-sin``;
- cos/sin at integer positions: ``f = float32(p) * inv_freq``, ``cos(f) * factor``,
  ``sin(f) * factor``.
"""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, factor: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions ``[N]`` (any int dtype), inv_freq fp32 ``[half]`` -> (cos, sin) fp32 ``[N, half]``."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)
    return freqs.cos() * factor, freqs.sin() * factor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm over the last dim; fp32 statistics and multiply, ``x.dtype`` out."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm over the last dim (per-head q norm): fp32 statistics, ``x.dtype`` out."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


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


def norm_rope_ref(
    x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, eps: float | None,
    weight: torch.Tensor | None, inverse: bool, dtype: torch.dtype,
) -> torch.Tensor:
    """``x`` (cast to ``dtype`` first) -> optional RMSNorm (``eps`` given; weighted when ``weight``
    is) -> optional RoPE (``cos`` given). The reference path of ``ops.norm_rope``."""
    x = x.to(dtype)
    if eps is not None:
        x = rms_norm(x, weight, eps) if weight is not None else rms_norm_unweighted(x, eps)
    if cos is not None and sin is not None:
        x = apply_rope(x, cos, sin, inverse=inverse)
    return x
