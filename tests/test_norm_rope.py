"""Fused RMSNorm + RoPE (``ops.norm_rope``): the Triton kernel against the reference (bf16: the
same roundings at the same places, so at most one bf16 ulp where the fp32 statistics differ in
the last bit; fp32: within 4 ulp, from the mean's summation order and the rsqrt), the reference
against a float64 oracle written from the formulas, in-place use, and bad input. The cos/sin
table (``ops.norm_rope.rope_cos_sin``) against float64 math at positions up to 4M."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4attn.ops.norm_rope import norm_rope, rope_cos_sin as rope_cos_sin_op
from dsv4attn.reference.norm_rope import rope_cos_sin

IMPLS = ["reference", "triton"]


def _tables(n: int, half: int, seed: int, factor: float = 1.25):
    g = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 2 * half, 2).float() / (2 * half)))
    pos = torch.randint(0, 200_000, (n,), generator=g)
    return rope_cos_sin(pos, inv_freq, factor)


def oracle(x, cos, sin, eps, weight, inverse):
    """float64, one token/row at a time, straight from the formulas (no rounding in between)."""
    x = x.double()
    out = x.clone()
    D = x.shape[-1]
    for idx in torch.cartesian_prod(*[torch.arange(s) for s in x.shape[:-1]]).reshape(-1, x.dim() - 1).tolist():
        v = x[tuple(idx)].clone()
        if eps is not None:
            v = v / math.sqrt(float((v * v).mean()) + eps)
            if weight is not None:
                v = v * weight.double()
        if cos is not None:
            half = cos.shape[1]
            n = idx[0]
            for i in range(half):
                e, o = float(v[D - 2 * half + 2 * i]), float(v[D - 2 * half + 2 * i + 1])
                c, s = float(cos[n, i]), float(sin[n, i]) * (-1 if inverse else 1)
                v[D - 2 * half + 2 * i] = e * c - o * s
                v[D - 2 * half + 2 * i + 1] = o * c + e * s
        out[tuple(idx)] = v
    return out


CASES = [  # (shape, half, norm): norm 0 none, 1 weightless, 2 weighted
    ((5, 3, 80), 8, 1), ((5, 80), 8, 2), ((4, 2, 64), 32, 0), ((6, 48), 0, 2), ((3, 4, 24), 4, 1), ((7, 1, 40), 4, 2),
    # 8+ heads per token: several rows per program, with a partial last program (33 and 18 rows)
    ((3, 11, 64), 16, 1), ((2, 9, 48), 8, 2), ((5, 8, 32), 16, 0),
]


@pytest.mark.parametrize("shape,half,norm", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("in_fp32", [False, True])
@pytest.mark.parametrize("inverse", [False, True])
def test_kernel_matches_reference_and_oracle(shape, half, norm, dtype, in_fp32, inverse, device):
    g = torch.Generator().manual_seed(sum(shape) + half)
    x = (torch.randn(shape, generator=g) * 3).to(torch.float32 if in_fp32 else dtype)
    weight = torch.randn(shape[-1], generator=g).to(dtype) if norm == 2 else None
    eps = 1e-6 if norm else None
    cos, sin = _tables(shape[0], half, seed=half) if half else (None, None)
    kw = dict(eps=eps, weight=weight, inverse=inverse, dtype=dtype)

    def run(impl):
        return norm_rope(x.to(device), None if cos is None else cos.to(device), None if sin is None else sin.to(device),
                         **{**kw, "weight": None if weight is None else weight.to(device)}, impl=impl).cpu()

    ref, tri = run("reference"), run("triton")
    assert tri.dtype == ref.dtype == dtype and tri.shape == x.shape
    if dtype == torch.bfloat16:
        # same roundings at the same places; the fp32 statistics may differ in the last bit,
        # which can flip a bf16 rounding: at most one bf16 ulp, on a few elements
        diff = (tri.float() - ref.float()).abs()
        assert torch.all(diff <= 2 ** -7 * ref.float().abs() + 1e-30)
        assert (diff > 0).float().mean() < 0.02
    else:
        torch.testing.assert_close(tri, ref, rtol=4 * 2 ** -23, atol=1e-6)
    # the reference against the float64 oracle: bf16 results within the roundings of the chain
    # (input cast, norm output, rotation output: 3 x 2^-8 relative of the row's scale)
    want = oracle(x.to(dtype).float(), cos, sin, eps, None if weight is None else weight.float(), inverse)
    scale = want.abs().amax(dim=-1, keepdim=True)
    tol = 3 * 2 ** -8 if dtype == torch.bfloat16 else 1e-5
    assert torch.all((ref.double() - want).abs() <= tol * scale + 1e-12)


@pytest.mark.parametrize("inplace", [False, True])
def test_rows_do_not_depend_on_the_batch(inplace, device):
    """Batch invariance: a token's rows come out bit for bit the same computed alone, in a slice
    of the batch or in the whole batch (programs take several head rows, across tokens)."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(7, 9, 64, generator=g) * 3).to(device)
    w = torch.randn(64, generator=g).to(device)
    cos, sin = (t.to(device) for t in _tables(7, 16, seed=2))

    def run(lo, hi):
        if inplace:
            y = x[lo:hi].to(torch.bfloat16)
            return norm_rope(y, cos[lo:hi], sin[lo:hi], inverse=True, out=y, impl="triton").cpu()
        return norm_rope(x[lo:hi], cos[lo:hi], sin[lo:hi], eps=1e-6, weight=w, dtype=torch.bfloat16,
                         impl="triton").cpu()

    whole = run(0, 7)
    assert torch.equal(run(2, 3), whole[2:3]) and torch.equal(run(3, 6), whole[3:6])


@pytest.mark.parametrize("impl", IMPLS)
def test_in_place_rotation_touches_only_rope_channels(impl, device):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, 40, generator=g).to(torch.bfloat16).to(device)
    cos, sin = (t.to(device) for t in _tables(4, 8, seed=1, factor=1.0))
    want = norm_rope(x.clone(), cos, sin, inverse=True, impl="reference")
    before = x.clone()
    out = norm_rope(x, cos, sin, inverse=True, out=x, impl=impl)
    assert out.data_ptr() == x.data_ptr()
    assert torch.equal(x[..., :24], before[..., :24])
    assert torch.equal(x.cpu(), want.cpu())
    # and back (a pure rotation, factor 1): rotating forward restores the input within one bf16 rounding per step
    norm_rope(x, cos, sin, out=x, impl=impl)
    torch.testing.assert_close(x.float(), before.float(), rtol=2 ** -6, atol=2 ** -6 * before.abs().max().item())


def test_bad_inputs_raise(device):
    x = torch.zeros(2, 8, device=device)
    cos = torch.zeros(2, 2, device=device)
    cases = [
        (dict(x=x.long()), TypeError, "x must have dtype"),
        (dict(x=x.t()), ValueError, "contiguous last dim"),
        (dict(cos=cos), ValueError, "cos and sin must be given together"),
        (dict(cos=cos, sin=torch.zeros(3, 2, device=device)), ValueError, "sin must have shape"),
        (dict(cos=torch.zeros(2, 5, device=device), sin=torch.zeros(2, 5, device=device)), ValueError, "half <= 4"),
        (dict(cos=cos.double(), sin=cos), TypeError, "cos must have dtype"),
        (dict(eps=-1.0), ValueError, "eps must be"),
        (dict(weight=torch.ones(8, device=device)), ValueError, "weight needs eps"),
        (dict(eps=1e-6, weight=torch.ones(7, device=device)), ValueError, "weight must have shape"),
        (dict(inverse=1), TypeError, "inverse must be a bool"),
        (dict(dtype=torch.int32), TypeError, "dtype must be"),
        (dict(out=torch.zeros(2, 8, dtype=torch.bfloat16, device=device)), TypeError, "out must have dtype"),
        (dict(impl="cuda"), ValueError, "impl must be"),
    ]
    big = torch.zeros(3, 8, device=device)
    with pytest.raises(ValueError, match="shares memory with x"):
        norm_rope(big[:2], eps=1e-6, out=big[1:])
    with pytest.raises(ValueError, match="shares memory with x"):
        norm_rope(big[:, :4], eps=1e-6, out=big[:, 4:])
    assert torch.all(big == 0)
    for kw, exc, msg in cases:
        args = {"x": x, **kw}
        with pytest.raises(exc, match=msg):
            norm_rope(args.pop("x"), args.pop("cos", None), args.pop("sin", None), **args)


@pytest.mark.parametrize("ratio", [1, 4, 128])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_cos_sin_table_matches_float64(ratio, pos_dtype, device):
    """Angles up to ~4e6 rad: the kernel reduces them in float64, so cos/sin stay within 2 fp32
    ulp of the float64 values of the same fp32 angle (the reference's own error is ~1 ulp)."""
    g = torch.Generator().manual_seed(ratio)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    pos = torch.cat([torch.arange(-3, 60), torch.randint(0, 1 << 22, (150,), generator=g),
                     torch.tensor([(1 << 22) - 1, 1 << 20])]).to(pos_dtype)
    factor = 1.3
    got = [t.cpu() for t in rope_cos_sin_op(pos.to(device), inv_freq.to(device), factor, ratio=ratio, impl="triton")]
    ref = rope_cos_sin_op(pos, inv_freq, factor, ratio=ratio, impl="reference")
    first = (pos.long().clamp(min=0) // ratio) * ratio if ratio > 1 else pos.long()
    angle = (first.float()[:, None] * inv_freq).double()  # the fp32 angle, exactly as both compute it
    for t, r, want in zip(got, ref, (angle.cos() * factor, angle.sin() * factor)):
        assert t.shape == (pos.shape[0], 32) and t.dtype == torch.float32
        assert (t.double() - want).abs().max() <= 2 * 2 ** -23 * factor
        assert (r.double() - want).abs().max() <= 2 * 2 ** -23 * factor


def test_cos_sin_bad_inputs_raise(device):
    pos = torch.zeros(3, dtype=torch.int32, device=device)
    inv = torch.ones(4, device=device)
    with pytest.raises(TypeError, match="positions must have dtype"):
        rope_cos_sin_op(pos.float(), inv, 1.0)
    with pytest.raises(TypeError, match="inv_freq must have dtype"):
        rope_cos_sin_op(pos, inv.long(), 1.0)
    with pytest.raises(ValueError, match="ratio must be"):
        rope_cos_sin_op(pos, inv, 1.0, ratio=0)
    with pytest.raises(TypeError, match="factor must be"):
        rope_cos_sin_op(pos, inv, None)
