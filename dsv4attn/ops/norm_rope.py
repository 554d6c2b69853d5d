"""Public fused RMSNorm + RoPE op: validate -> allocate -> dispatch (Triton kernel or reference).

One launch replaces the ~10-20 small PyTorch kernels of "norm, then rotate the rope channels"
on every row of the attention step (q, kv, compressed entries, indexer queries, the inverse
rotation of the output). Semantics: :func:`dsv4attn.reference.norm_rope.norm_rope_ref`;
kernel: :mod:`dsv4attn.kernels.norm_rope`.
"""

from __future__ import annotations

import torch
import triton

from dsv4attn._checks import check_tensor, same_device
from dsv4attn.device import resolve_impl
from dsv4attn.kernels.norm_rope import _norm_rope_kernel, _rope_cos_sin_kernel
from dsv4attn.reference.norm_rope import norm_rope_ref, rope_cos_sin as rope_cos_sin_ref

_POS_DTYPES = (torch.int32, torch.int64)
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
#: Out dtypes the kernel writes (it rounds to bf16 with integer operations); others -> reference.
_KERNEL_DTYPES = (torch.bfloat16, torch.float32)
#: Rows per program for tensors of 8 or more heads per token (scripts/norm_rope_variants.py;
#: docs/benchmarks.md, Table 45: 8 rows took the q norm + RoPE of a B256 step from 29 to 12 us).
_HEAD_ROWS = 8


def norm_rope(
    x: torch.Tensor,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    *,
    eps: float | None = None,
    weight: torch.Tensor | None = None,
    inverse: bool = False,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """``x`` cast to ``dtype`` -> RMSNorm (when ``eps`` is given; weighted when ``weight`` is) ->
    RoPE on the trailing ``2 * cos.shape[1]`` channels (when cos/sin are given; ``inverse``
    rotates by minus the angle).

    x: ``[N, D]`` or ``[N, G, D]`` (bf16/fp16/fp32, last dim contiguous; G rows share row n of
    cos/sin). cos, sin: fp32 ``[N, half]`` with ``2 * half <= D``. weight: ``[D]`` (needs ``eps``).
    dtype: the result dtype (default x's). out: optional result tensor of x's shape and ``dtype``
    (may be ``x`` itself: in place; any other overlap with x is refused). Returns the result.
    """
    check_tensor("x", x, dtype=_FLOATS)
    if x.dim() not in (2, 3) or x.shape[-1] < 1 or x.stride(-1) != 1:
        raise ValueError(f"x must be [N, D] or [N, G, D] with a contiguous last dim, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    N, D = x.shape[0], x.shape[-1]
    dtype = x.dtype if dtype is None else dtype
    if dtype not in _FLOATS:
        raise TypeError(f"dtype must be one of {_FLOATS}, got {dtype}")
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin must be given together")
    half = 0
    if cos is not None and sin is not None:
        check_tensor("cos", cos, dtype=torch.float32, ndim=2)
        half = cos.shape[1]
        check_tensor("sin", sin, dtype=torch.float32, shape=(N, half))
        if cos.shape[0] != N or 2 * half > D or cos.stride(1) != 1 or sin.stride() != cos.stride():
            raise ValueError(f"cos/sin must be [{N}, half <= {D // 2}] with contiguous rows and the same strides, "
                             f"got {tuple(cos.shape)} / {tuple(sin.shape)}")
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0):
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    if weight is not None:
        if eps is None:
            raise ValueError("weight needs eps (a weighted RMSNorm)")
        check_tensor("weight", weight, dtype=_FLOATS, shape=(D,))
    if not isinstance(inverse, bool):
        raise TypeError(f"inverse must be a bool, got {type(inverse).__name__}")
    if out is not None:
        check_tensor("out", out, dtype=dtype, shape=tuple(x.shape))
        if out.stride(-1) != 1:
            raise ValueError(f"out must have a contiguous last dim, got strides {out.stride()}")
        shares = out.device == x.device and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        if shares and (out.data_ptr() != x.data_ptr() or out.stride() != x.stride()):
            raise ValueError("out shares memory with x without being x itself: give x (in place) or a separate tensor")
    device = same_device(x=x, cos=cos, sin=sin, weight=weight, out=out)
    path = resolve_impl(impl, device)
    if path == "reference" or dtype not in _KERNEL_DTYPES:
        res = norm_rope_ref(x, cos, sin, None if eps is None else float(eps), weight, inverse, dtype)
        if out is None:
            return res
        out.copy_(res)
        return out
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=device)
    x3 = x if x.dim() == 3 else x[:, None, :]
    o3 = out if out.dim() == 3 else out[:, None, :]
    G = x3.shape[1]
    if N * G == 0:
        return out
    norm = 0 if eps is None else (2 if weight is not None else 1)
    c = cos if cos is not None else x  # placeholders never read when half == 0
    s = sin if sin is not None else x
    block_d = triton.next_power_of_2(D)
    half_p2 = triton.next_power_of_2(max(half, 1))
    rope_only = norm == 0 and half > 0 and out.data_ptr() == x.data_ptr() and x.dtype == dtype
    # Rows per program: _HEAD_ROWS where a token has many head rows (q, the indexer's queries, the
    # output's inverse rotation: thousands of rows per step), one otherwise (a step's few hundred
    # rows of kv or entries want as many programs as they can get). Chosen from the model's
    # shape, never from the token count: a row's sums then run in the same order whatever the
    # batch (batch-invariant).
    block_r = _HEAD_ROWS if G >= 8 else 1
    width = block_r * (2 * half_p2 if rope_only else block_d)
    _norm_rope_kernel[(triton.cdiv(N * G, block_r),)](
        x3, o3, weight if weight is not None else x, c, s,
        x3.stride(0), x3.stride(1), o3.stride(0), o3.stride(1), c.stride(0) if half else 0, N * G, G, D,
        0.0 if eps is None else float(eps),
        NORM=norm, HALF=half, HALF_P2=half_p2, INVERSE=inverse,
        ROUND_IN=x.dtype != torch.bfloat16 and dtype == torch.bfloat16,
        ROUND_BF16=dtype == torch.bfloat16, ROPE_ONLY=rope_only,
        BLOCK_D=block_d, BLOCK_R=block_r, num_warps=4 if width >= 512 else 1, enable_fp_fusion=False,
    )
    return out


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, factor: float, *, ratio: int = 1, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin fp32 ``[N, half]`` of the rotation at integer ``positions [N]`` (int32/int64):
    ``float32(p) * inv_freq`` (``[half]``, any float dtype, widened exactly) scaled by ``factor``. ``ratio > 1`` rotates at the
    first position of the compressed entry each position falls in, ``floor(max(p, 0) / r) * r``.

    One launch (the kernel reduces the angle in float64, then fp32 cos/sin within ~1e-7 of the
    reference's); the reference is :func:`dsv4attn.reference.norm_rope.rope_cos_sin`.
    """
    check_tensor("positions", positions, dtype=_POS_DTYPES, ndim=1)
    check_tensor("inv_freq", inv_freq, dtype=_FLOATS, ndim=1)  # a model cast may have made the buffer bf16
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise TypeError(f"factor must be a float, got {type(factor).__name__}")
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"ratio must be a positive int, got {ratio!r}")
    device = positions.device
    path = resolve_impl(impl, device)
    if path == "reference":
        pos = positions
        if ratio > 1:
            pos = torch.div(positions.long().clamp(min=0), ratio, rounding_mode="floor") * ratio
        return rope_cos_sin_ref(pos, inv_freq, float(factor))
    N, half = positions.shape[0], inv_freq.shape[0]
    out = torch.empty((2, N, half), dtype=torch.float32, device=device)
    if N and half:
        block_n = 2  # a latency-bound kernel: many small programs
        _rope_cos_sin_kernel[(triton.cdiv(N, block_n),)](
            positions.contiguous(), inv_freq.to(device).contiguous(), out[0], out[1], N, half, float(factor), ratio,
            FIRST=ratio > 1, BLOCK_N=block_n, HALF_P2=triton.next_power_of_2(half), num_warps=1,
        )
    return out[0], out[1]
