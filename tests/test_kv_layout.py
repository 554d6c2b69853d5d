"""fp8_ds_mla page format: byte-exact against an encoder written here from the format text,
and round-trip error bounds per 64-wide tile.

The independent encoder below uses only the format description (docs/cache-format.md): e4m3fn
codes are decoded from their bit fields into a table of values and a value is encoded as the
nearest table entry (ties to the even code); nothing from torch's float8 support is used.
"""

from __future__ import annotations

import bisect
import math
import struct

import pytest
import torch

from dsv4attn.kv_cache.layout import (
    FP8DSMLALayout,
    alloc_fp8_ds_mla_cache,
    dequantize_fp8_ds_mla,
    pages_of,
    quantize_fp8_ds_mla,
)
from dsv4attn.ops.cache_ops import insert_kv

# Positive finite e4m3fn values, indexed by code 0..126 (0x7F is NaN): e = code >> 3, m = code & 7.
E4M3_VALUES = [(c & 7) * 2.0**-9 if c >> 3 == 0 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7) for c in range(127)]


def encode_e4m3(v: float) -> int:
    """Nearest e4m3fn code to v (saturating at 448, ties to even), from the value table."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = min(abs(v), 448.0)
    i = bisect.bisect_left(E4M3_VALUES, a)
    if E4M3_VALUES[i] == a:
        return sign | i
    lo, hi = i - 1, i
    dlo, dhi = a - E4M3_VALUES[lo], E4M3_VALUES[hi] - a
    code = lo if dlo < dhi else hi if dhi < dlo else (lo if lo % 2 == 0 else hi)
    return sign | code


def tile_exponent(values: list[float]) -> int:
    """Smallest e with 448 * 2^e >= max(max|x|, 1e-4) (the float32 1e-4 floor)."""
    amax = max(max(abs(v) for v in values), struct.unpack("<f", struct.pack("<f", 1e-4))[0])
    e = math.ceil(math.log2(amax / 448.0))
    while 448.0 * 2.0**e < amax:
        e += 1
    while 448.0 * 2.0 ** (e - 1) >= amax:
        e -= 1
    return e


def encode_pages_independent(x: torch.Tensor, nope: int, rope: int) -> bytes:
    """x (num_blocks, bs, nope + rope) bf16 -> the page bytes of all blocks, concatenated."""
    nb, bs, _ = x.shape
    tiles = nope // 64
    data_b, scale_b = nope + 2 * rope, -(-tiles // 8) * 8
    page = -(-(bs * (data_b + scale_b)) // data_b) * data_b
    out = bytearray()
    for b in range(nb):
        buf = bytearray(page)
        for i in range(bs):
            vals = x[b, i].float().tolist()
            for t in range(tiles):
                tile = vals[64 * t : 64 * t + 64]
                e = tile_exponent(tile)
                for j, v in enumerate(tile):
                    buf[i * data_b + 64 * t + j] = encode_e4m3(v / 2.0**e)
                buf[bs * data_b + i * scale_b + t] = e + 127
            buf[i * data_b + nope : (i + 1) * data_b] = x[b, i, nope:].contiguous().view(torch.uint8).numpy().tobytes()
        out += buf
    return bytes(out)


def awkward_tokens(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    """bf16 rows mixing scales per tile: zeros, sub-floor, power-of-two amax, ties, huge."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g) * torch.exp2(torch.randint(-20, 20, (n, 1), generator=g).float())
    x = x.to(torch.bfloat16)
    x[0] = 0
    if n > 1:
        x[1, :64] = 1e-30
        x[1, 64:128] = -0.0
    if n > 2:
        x[2, :64] = torch.linspace(-448, 448, 64)  # amax exactly 448 -> e = 0
        x[2, 64:128] = 448 * 2.0**-10 * (1 + 2.0**-7)  # just above a power-of-two boundary
        if dim >= 192:
            x[2, 128:192] = torch.arange(64) * 0.0625 + 0.03125  # y lands on e4m3 ties
    if n > 3:
        x[3, :64] = 3.0e38
    return x


@pytest.mark.parametrize("block_size,num_blocks,stride", [(64, 1, 37440), (2, 3, 1728)])
def test_production_layout_byte_exact(block_size, num_blocks, stride, device):
    layout = FP8DSMLALayout()
    assert (layout.entry_bytes, layout.data_bytes, layout.scale_bytes) == (584, 576, 8)
    assert layout.page_bytes(block_size) == stride
    x = awkward_tokens(num_blocks * block_size, 512).reshape(num_blocks, block_size, 512)
    want = encode_pages_independent(x, 448, 64)

    cache = quantize_fp8_ds_mla(x)
    assert cache.shape == (num_blocks, block_size, 584) and cache.stride() == (stride, 584, 1)
    assert pages_of(cache).contiguous().numpy().tobytes() == want

    # Spot-check the placement rules directly on the bytes.
    page0 = want[:stride]
    assert page0[block_size * 576 + 7] == 0  # pad byte after the 7 scales of entry 0
    assert page0[block_size * 584 :] == bytes(stride - block_size * 584)  # page padding
    assert page0[block_size * 576] == 127 - 22  # entry 0 is all zeros: amax floor 1e-4 -> e = -22

    # The writers (reference and Triton) produce the same pages in a zero-filled cache.
    slots = torch.arange(num_blocks * block_size)
    for impl in ("reference", "triton"):
        dst = alloc_fp8_ds_mla_cache(num_blocks, block_size, device=device, fill=0)
        insert_kv(x.reshape(-1, 512).to(device), slots.to(device), dst, impl=impl)
        assert pages_of(dst).contiguous().cpu().numpy().tobytes() == want, impl


@pytest.mark.parametrize("nope,rope", [(64, 64), (128, 32), (448, 64)])
def test_small_layouts_byte_exact(nope, rope):
    layout = FP8DSMLALayout(nope, rope)
    x = awkward_tokens(6, nope + rope, seed=nope).reshape(2, 3, nope + rope)
    cache = quantize_fp8_ds_mla(x, layout)
    assert cache.stride(0) == layout.page_bytes(3) and layout.page_bytes(3) % layout.data_bytes == 0
    assert pages_of(cache, layout).contiguous().numpy().tobytes() == encode_pages_independent(x, nope, rope)


def test_roundtrip_error_bounds_per_tile():
    """Per element, |dequant - x| <= 2^-4 |x| + 2^-10 s for the tile scale s = 2^e.

    Why: e is the smallest with 448 s >= amax, so x/s never saturates and 224 s < amax. In
    e4m3's normal range (|x/s| >= 2^-6) values have 3 mantissa bits, so round-to-nearest moves
    them by at most half a unit in the last place <= 2^-4 |x/s|; below it the code step is 2^-9,
    so the error is at most 2^-10. Scaling by the exact power of two s adds no error. The tile's
    largest element therefore has relative error <= 2^-4, and every error is <= 2^-4 * 448 s.
    RoPE dims are stored as bf16 and come back bit-exact.
    """
    x = awkward_tokens(64, 512, seed=3)
    x[3] = torch.randn(512).to(torch.bfloat16)  # keep the huge row finite after dequant
    cache = quantize_fp8_ds_mla(x.reshape(1, 64, 512))
    deq = dequantize_fp8_ds_mla(cache).float().reshape(64, 512)
    xf = x.float()
    assert torch.equal(deq[:, 448:], xf[:, 448:])
    tiles_x = xf[:, :448].reshape(64, 7, 64).double()
    tiles_d = deq[:, :448].reshape(64, 7, 64).double()
    amax = tiles_x.abs().amax(-1).clamp_min(float(torch.tensor(1e-4)))
    sbytes = pages_of(cache)[0, 64 * 576 : 64 * 584].reshape(64, 8)[:, :7].double()
    s = torch.exp2(sbytes - 127)
    assert torch.all(448 * s >= amax) and torch.all(224 * s < amax)
    err = (tiles_d - tiles_x).abs()
    assert torch.all(err <= 2.0**-4 * tiles_x.abs() + 2.0**-10 * s.unsqueeze(-1))
    assert torch.all(err <= 2.0**-4 * 448 * s.unsqueeze(-1))
    big = tiles_x.abs().argmax(-1, keepdim=True)
    top_err = err.gather(-1, big) / tiles_x.abs().gather(-1, big).clamp_min(1e-300)
    assert torch.all(top_err[amax > 1e-4] <= 2.0**-4)
