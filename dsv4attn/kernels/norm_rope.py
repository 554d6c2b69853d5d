"""Triton fused RMSNorm + interleaved RoPE over rows (the per-layer glue of the attention step).

Grid ``(cdiv(N * G, BLOCK_R),)``: each program takes ``BLOCK_R`` rows ``(n, g)`` of
``x [N, G, D]`` (the op gives 8 where a token has 8+ heads, so that decode's thousands of 1 KB
head rows are not one small program each). It loads its rows once for the RMS statistics,
writes the normed NoPE channels, then reloads the rope channels as even/odd halves
(``nope + 2i``, ``nope + 2i + 1``), normalises and rounds them as the reference does, rotates
them by cos/sin row ``n`` and writes them. Every rounding of the reference
(:mod:`dsv4attn.reference.norm_rope`) happens at the same place, with the integer bf16 rounding
of ``kernels/common.py`` (identical under the interpreter), and the launcher turns off FMA
contraction so the rotation's products round as PyTorch's separate kernels do. In place
(``out`` = ``x``) is safe: a row is read before its program writes it. With no norm and
``ROPE_ONLY``, only the rope channels are read and written.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4attn.kernels.common import round_to_bf16


@triton.jit
def _round(x, ROUND_BF16: tl.constexpr):
    if ROUND_BF16:
        x = round_to_bf16(x)
    return x


@triton.jit
def _normed(x, w_ptr, idx, mask, rs, NORM: tl.constexpr, ROUND_BF16: tl.constexpr):
    """The norm's output for channels ``idx`` (``[1, n]``; ``rs`` ``[rows, 1]``), already rounded
    to the out dtype."""
    if NORM == 1:  # weightless: x * rsqrt(...) with the multiply in the out dtype
        x = x * _round(rs, ROUND_BF16)
    if NORM == 2:  # weighted: weight * (x * rsqrt(...)) in fp32
        w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        x = w * (x * rs)
    return _round(x, ROUND_BF16)


@triton.jit
def _norm_rope_kernel(
    x_ptr, out_ptr, w_ptr, cos_ptr, sin_ptr,
    stride_xn, stride_xg, stride_on, stride_og, stride_cn, NG, G, D, eps,
    NORM: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, INVERSE: tl.constexpr,
    ROUND_IN: tl.constexpr, ROUND_BF16: tl.constexpr, ROPE_ONLY: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """NORM: 0 none, 1 weightless, 2 weighted. HALF: rope pairs (0 = no rope). ROUND_IN: the
    input is rounded to bf16 first (fp32 input, bf16 out). ROUND_BF16: the out dtype is bf16.
    Rows ``BLOCK_R * program .. + BLOCK_R - 1`` of the ``NG = N * G`` rows; each row's sums stay
    within that row, so its result does not depend on the rows beside it."""
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = (row < NG)[:, None]
    row = tl.where(row < NG, row, 0)
    n = (row // G).to(tl.int64)[:, None]
    g = (row % G).to(tl.int64)[:, None]
    src = x_ptr + n * stride_xn + g * stride_xg  # [BLOCK_R, 1]
    dst = out_ptr + n * stride_on + g * stride_og
    nope = D - 2 * HALF
    rs = tl.zeros([BLOCK_R, 1], tl.float32)
    if not ROPE_ONLY:
        d = tl.arange(0, BLOCK_D)[None, :]
        m = d < D
        x = _round(tl.load(src + d, mask=rm & m, other=0.0).to(tl.float32), ROUND_IN)
        if NORM != 0:
            rs = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1, keep_dims=True) / D + eps)
        y = _normed(x, w_ptr, d, m, rs, NORM, ROUND_BF16)
        tl.store(dst + d, y.to(out_ptr.dtype.element_ty), mask=rm & (d < nope))
    if HALF > 0:
        i = tl.arange(0, HALF_P2)[None, :]
        mi = i < HALF
        pe = nope + 2 * i
        xe = _round(tl.load(src + pe, mask=rm & mi, other=0.0).to(tl.float32), ROUND_IN)
        xo = _round(tl.load(src + pe + 1, mask=rm & mi, other=0.0).to(tl.float32), ROUND_IN)
        ye = _normed(xe, w_ptr, pe, mi, rs, NORM, ROUND_BF16)
        yo = _normed(xo, w_ptr, pe + 1, mi, rs, NORM, ROUND_BF16)
        c = tl.load(cos_ptr + n * stride_cn + i, mask=rm & mi, other=0.0)
        s = tl.load(sin_ptr + n * stride_cn + i, mask=rm & mi, other=0.0)
        if INVERSE:
            s = -s
        oe = _round(ye * c - yo * s, ROUND_BF16)
        oo = _round(yo * c + ye * s, ROUND_BF16)
        tl.store(dst + pe, oe.to(out_ptr.dtype.element_ty), mask=rm & mi)
        tl.store(dst + pe + 1, oo.to(out_ptr.dtype.element_ty), mask=rm & mi)


@triton.jit
def _rope_cos_sin_kernel(
    pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, N, half, factor, ratio,
    FIRST: tl.constexpr, BLOCK_N: tl.constexpr, HALF_P2: tl.constexpr,
):
    """cos/sin ``[N, half]`` of angle ``float32(p) * inv_freq`` (times ``factor``); with FIRST, at
    ``p' = floor(max(p, 0) / ratio) * ratio``. The angle (up to ~1e6 rad at 1M positions) is
    reduced by pi/2 in float64 (exact to ~2^-33 rad), so the fp32 cos/sin run on [-pi/4, pi/4]
    where even the hardware's approximate instructions are accurate to ~1e-7."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    i = tl.arange(0, HALF_P2)
    mn = n < N
    mi = i < half
    p = tl.load(pos_ptr + n, mask=mn, other=0).to(tl.int64)
    if FIRST:
        p = (tl.maximum(p, 0) // ratio) * ratio
    f = p.to(tl.float32)[:, None] * tl.load(inv_freq_ptr + i, mask=mi, other=0.0).to(tl.float32)[None, :]
    fd = f.to(tl.float64)
    k = tl.floor(fd * 0.6366197723675814 + 0.5)  # nearest multiple of pi/2
    r = ((fd - k * 1.5707963267948966) - k * 6.123233995736766e-17).to(tl.float32)
    c0 = tl.cos(r)
    s0 = tl.sin(r)
    q = k.to(tl.int64) & 3
    c = tl.where(q == 0, c0, tl.where(q == 1, -s0, tl.where(q == 2, -c0, s0)))
    s = tl.where(q == 0, s0, tl.where(q == 1, c0, tl.where(q == 2, -s0, -c0)))
    off = n.to(tl.int64)[:, None] * half + i[None, :]
    m = mn[:, None] & mi[None, :]
    tl.store(cos_ptr + off, c * factor, mask=m)
    tl.store(sin_ptr + off, s * factor, mask=m)
