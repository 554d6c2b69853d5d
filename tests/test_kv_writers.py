"""Cache writers: Triton vs reference byte for byte, NaN/0xFF-poisoned pages (exactly the
addressed slots change), writer -> reader agreement, exhaustive e4m3 rounding, bad input and
the int64 page-offset arithmetic."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4attn.kernels.common import page_offset
from dsv4attn.kv_cache.allocator import NULL_BLOCK, KVCacheManager
from dsv4attn.kv_cache.layout import (
    FP8DSMLALayout,
    alloc_fp8_ds_mla_cache,
    alloc_indexer_k_cache,
    dequantize_fp8_ds_mla,
    dequantize_indexer_k,
    encode_pages,
    indexer_pages_of,
    pages_of,
    quantize_fp8_ds_mla,
    quantize_indexer_k,
)
from dsv4attn.kv_cache.specs import CacheConfig, cache_groups
from dsv4attn.ops.cache_ops import insert_indexer_k, insert_kv, write_compressor_state

IMPLS = ["reference", "triton"]
POISON = 0xFF  # an e4m3 NaN byte, an impossible scale byte


def random_slots(num_tokens: int, capacity: int, holes: int, seed: int) -> torch.Tensor:
    """Distinct random slots with ``holes`` entries set to -1."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(capacity, generator=g)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=g)[:holes]] = -1
    return slots


def tokens(num_tokens: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-12, 12, (num_tokens, 1), generator=g).float())
    return (torch.randn(num_tokens, dim, generator=g) * scale).to(dtype)


def fp8_slot_byte_mask(layout: FP8DSMLALayout, num_blocks: int, bs: int, slots) -> torch.Tensor:
    """(num_blocks, page) bool: the bytes that belong to the given slots (data + 8 scale bytes)."""
    mask = torch.zeros(num_blocks, layout.page_bytes(bs), dtype=torch.bool)
    for s in slots:
        if s < 0:
            continue
        b, o = divmod(int(s), bs)
        mask[b, o * layout.data_bytes : (o + 1) * layout.data_bytes] = True
        so = layout.scale_offset(bs) + o * layout.scale_bytes
        mask[b, so : so + layout.scale_bytes] = True
    return mask


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("nope,rope,bs,num_blocks", [(448, 64, 64, 2), (448, 64, 2, 9), (64, 64, 16, 3), (128, 32, 5, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_insert_fp8_poisoned_pages(impl, nope, rope, bs, num_blocks, dtype, device):
    """Only the addressed entries' bytes change, and they equal the layout.py encoding."""
    layout = FP8DSMLALayout(nope, rope)
    n = min(13, num_blocks * bs)
    x = tokens(n, layout.head_dim, dtype, seed=bs)
    slots = random_slots(n, num_blocks * bs, holes=3, seed=nope + bs)
    if dtype == torch.bfloat16:
        slots = slots.to(torch.int32)
    cache = alloc_fp8_ds_mla_cache(num_blocks, bs, layout, device=device, fill=POISON)
    insert_kv(x.to(device), slots.to(device), cache, layout=layout, impl=impl)
    pages = pages_of(cache, layout).cpu()

    mask = fp8_slot_byte_mask(layout, num_blocks, bs, slots.tolist())
    assert torch.all(pages[~mask] == POISON), "bytes outside the addressed slots changed"
    # Expected bytes: layout.encode_pages of each token put at its slot.
    want = torch.full_like(pages, POISON)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        b, o = divmod(s, bs)
        one = torch.zeros(bs, layout.head_dim, dtype=dtype)
        one[o] = x[t]
        enc = encode_pages(one.unsqueeze(0), layout)[0]
        m1 = fp8_slot_byte_mask(layout, 1, bs, [o])[0]
        want[b, m1] = enc[m1]
    assert torch.equal(pages, want)


@pytest.mark.parametrize("bs,num_blocks", [(64, 3), (2, 40)])
def test_triton_writer_matches_reference_and_reader(bs, num_blocks, device):
    """Triton writer == reference writer byte for byte; layout.dequantize reads back what was
    written (the writer/gatherer agreement whose absence produced NaNs in one engine)."""
    x = tokens(50, 512, torch.float32, seed=7)
    slots = random_slots(50, num_blocks * bs, holes=5, seed=11)
    caches = {}
    for impl in IMPLS:
        caches[impl] = alloc_fp8_ds_mla_cache(num_blocks, bs, device=device, fill=0)
        insert_kv(x.to(device), slots.to(device), caches[impl], impl=impl)
    assert torch.equal(pages_of(caches["triton"]), pages_of(caches["reference"]))
    deq = dequantize_fp8_ds_mla(caches["triton"]).float().cpu().reshape(-1, 512)
    valid = slots >= 0
    got = deq[slots[valid]]
    xb = x[valid].to(torch.bfloat16).float()
    assert torch.equal(got[:, 448:], xb[:, 448:])
    # Error bound of tests/test_kv_layout.py: <= 2^-4 |x| + 2^-10 s, with s <= amax / 224.
    amax = xb[:, :448].reshape(-1, 7, 64).abs().amax(-1, keepdim=True)
    err = (got[:, :448] - xb[:, :448]).reshape(-1, 7, 64).abs()
    assert torch.all(err <= 2.0**-4 * xb[:, :448].reshape(-1, 7, 64).abs() + 2.0**-10 * amax / 224)
    assert torch.isfinite(deq).all()


def test_e4m3_rounding_exhaustive_over_bf16(device):
    """Every finite bf16 value in [-448, 448] (incl. subnormal-range and ties) encodes to the
    reference byte; each tile carries 448 so its scale is 1 and y = x."""
    pos = torch.arange(0, 0x43E1, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    vals = torch.cat([pos, -pos])
    per_tile = 63
    ntiles = -(-vals.numel() // per_tile)
    vals = torch.cat([vals, torch.zeros(ntiles * per_tile - vals.numel(), dtype=torch.bfloat16)])
    tiles = torch.cat([torch.full((ntiles, 1), 448.0, dtype=torch.bfloat16), vals.reshape(ntiles, per_tile)], 1)
    ntok = -(-ntiles // 7)
    nope = torch.zeros(ntok * 7, 64, dtype=torch.bfloat16)
    nope[:ntiles] = tiles
    x = torch.cat([nope.reshape(ntok, 448), torch.zeros(ntok, 64, dtype=torch.bfloat16)], 1)
    slots = torch.arange(ntok)
    caches = {}
    for impl in IMPLS:
        caches[impl] = alloc_fp8_ds_mla_cache(-(-ntok // 64), 64, device=device)
        insert_kv(x.to(device), slots.to(device), caches[impl], impl=impl)
    assert torch.equal(pages_of(caches["triton"]), pages_of(caches["reference"]))
    data = pages_of(caches["triton"]).cpu()[:, : 64 * 576].reshape(-1, 576)[:ntok, :448]
    assert torch.equal(data.reshape(-1), nope.float().clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1))


@pytest.mark.parametrize("impl", IMPLS)
def test_fp32_input_rounds_to_bf16_first(impl, device):
    """fp32 rows are rounded to bf16 (RNE) before quantising; exact ties included."""
    g = torch.Generator().manual_seed(0)
    # Rows 0-3: exact bf16 ties (low half = 0x8000) of either sign, exponents 0..252 per row
    # band; rows 4-7: ordinary fp32 values.
    hi = torch.randint(0, 0x7E00, (4, 512), generator=g, dtype=torch.int32)
    sign = torch.randint(0, 2, (4, 512), generator=g, dtype=torch.int32) << 31
    ties = ((hi << 16) | 0x8000 | sign).view(torch.float32)
    x = torch.cat([ties, torch.randn(4, 512, generator=g) * 1e3])
    slots = torch.arange(8)
    a = alloc_fp8_ds_mla_cache(1, 8, device=device)
    b = alloc_fp8_ds_mla_cache(1, 8, device=device)
    insert_kv(x.to(device), slots.to(device), a, impl=impl)
    insert_kv(x.to(torch.bfloat16).to(device), slots.to(device), b, impl=impl)
    assert torch.equal(pages_of(a), pages_of(b))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_insert_auto_rows_nan_poisoned(impl, cache_dtype, device):
    x = tokens(11, 96, torch.float32, seed=5)
    slots = random_slots(11, 4 * 8, holes=2, seed=5)
    cache = torch.full((4, 8, 96), float("nan"), dtype=cache_dtype, device=device)
    insert_kv(x.to(device), slots.to(device), cache, "auto", impl=impl)
    flat = cache.cpu().reshape(-1, 96)
    valid = slots >= 0
    assert torch.equal(flat[slots[valid]], x[valid].to(cache_dtype))
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots[valid]] = False
    assert torch.isnan(flat[untouched]).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dim,bs", [(128, 64), (64, 3)])
def test_insert_indexer_k_fp8(impl, dim, bs, device):
    nb = 4
    k = tokens(10, dim, torch.float32, seed=dim)
    k[0] = 0
    slots = random_slots(10, nb * bs, holes=2, seed=bs)
    cache = alloc_indexer_k_cache(nb, bs, dim, device=device, fill=POISON)
    insert_indexer_k(k.to(device), slots.to(device), cache, impl=impl)
    pages = indexer_pages_of(cache).cpu()
    want = torch.full_like(pages, POISON)
    q8, scale = quantize_indexer_k(k)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            b, o = divmod(s, bs)
            want[b, o * dim : (o + 1) * dim] = q8[t]
            want[b, bs * dim + 4 * o : bs * dim + 4 * o + 4] = scale[t : t + 1].view(torch.uint8)
    assert torch.equal(pages, want)
    # Scale is a power of two with 224 s < max(amax, 1e-4) <= 448 s; the reader gets x back.
    kb = k.to(torch.bfloat16).float()
    amax = kb.abs().amax(-1).clamp_min(1e-4)
    assert torch.all(torch.frexp(scale).mantissa == 0.5)
    assert torch.all((448 * scale >= amax) & (224 * scale < amax))
    deq = dequantize_indexer_k(cache).cpu().reshape(-1, dim)
    valid = slots >= 0
    err = (deq[slots[valid]] - kb[valid]).abs()
    assert torch.all(err <= 2.0**-4 * kb[valid].abs() + 2.0**-10 * scale[valid, None])


def test_indexer_k_triton_equals_reference_and_auto(device):
    k = tokens(20, 128, torch.bfloat16, seed=1)
    slots = random_slots(20, 2 * 64, holes=4, seed=2)
    out = {}
    for impl in IMPLS:
        out[impl] = alloc_indexer_k_cache(2, 64, device=device, fill=POISON)
        insert_indexer_k(k.to(device), slots.to(device), out[impl], impl=impl)
    assert torch.equal(indexer_pages_of(out["triton"]), indexer_pages_of(out["reference"]))
    assert out["triton"].stride(0) == 8640
    rows = {}
    for impl in IMPLS:
        rows[impl] = torch.full((2, 64, 128), float("nan"), dtype=torch.bfloat16, device=device)
        insert_indexer_k(k.to(device), slots.to(device), rows[impl], "auto", impl=impl)
    assert torch.equal(rows["triton"].view(torch.int16), rows["reference"].view(torch.int16))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ratio,coff,dim", [(4, 2, 16), (128, 1, 24)])
def test_write_compressor_state_nan_poisoned(impl, ratio, coff, dim, device):
    """Rows land at their slots as [kv | score + ape[p % r]]; pages padded like the 576-aligned
    state pages (block stride > block_size * row) keep their padding untouched."""
    width = coff * dim
    bs, nb, n = 4, 5, 12
    row = 2 * width
    stride = bs * row + 16  # padded page
    flat = torch.full((nb * stride,), float("nan"), device=device)
    state = flat.as_strided((nb, bs, row), (stride, row, 1))
    g = torch.Generator().manual_seed(ratio)
    kv, score = torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)
    ape = torch.randn(ratio, width, generator=g)
    positions = torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32)
    slots = random_slots(n, nb * bs, holes=3, seed=ratio)
    args = [t.to(device) for t in (kv, score, ape, positions, slots)]
    write_compressor_state(*args, state, impl=impl)
    got = flat.cpu()
    want = torch.full_like(got, float("nan"))
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            b, o = divmod(s, bs)
            base = b * stride + o * row
            want[base : base + width] = kv[t]
            want[base + width : base + row] = score[t] + ape[positions[t] % ratio]
    assert torch.equal(got.nan_to_num(1234.5), want.nan_to_num(1234.5))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_write_compressor_state_slots_from_table(impl, in_dtype, device):
    """``slot_mapping=None``: token t lands at entry ``positions[t]`` of request ``token_to_req[t]``
    through the block table (plain-Python oracle of the slot formula); holes (-1 blocks), columns
    past the table, negative positions and requests outside the table write nothing. bf16 inputs
    are widened exactly (fp32 sum with the bias)."""
    ratio, width, bs, nb, n = 4, 6, 4, 6, 14
    row = 2 * width
    state = torch.full((nb, bs, row), float("nan"), device=device)
    table = torch.tensor([[3, -1, 0], [5, 1, -1]], dtype=torch.int32)
    g = torch.Generator().manual_seed(7)
    kv, score = torch.randn(n, width, generator=g).to(in_dtype), torch.randn(n, width, generator=g).to(in_dtype)
    ape = torch.randn(ratio, width, generator=g).to(in_dtype)
    positions = torch.tensor([0, 3, 4, 5, 9, 11, 12, -1, 2, 6, 7, 8, 13, 1], dtype=torch.int32)
    t2r = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2], dtype=torch.int32)  # 2: no such request
    args = [t.to(device) for t in (kv, score, ape, positions)]
    write_compressor_state(*args, None, state, block_table=table.to(device), token_to_req=t2r.to(device),
                           impl=impl)
    want = torch.full((nb, bs, row), float("nan"))
    for t in range(n):
        p, r = int(positions[t]), int(t2r[t])
        if p < 0 or r >= table.shape[0] or p // bs >= table.shape[1] or table[r, p // bs] < 0:
            continue
        b, o = int(table[r, p // bs]), p % bs
        want[b, o, :width] = kv[t].float()
        want[b, o, width:] = score[t].float() + ape[p % ratio].float()
    assert torch.equal(state.cpu().nan_to_num(1234.5), want.nan_to_num(1234.5))


def test_write_compressor_state_slot_arguments_raise(device):
    kv = torch.zeros(2, 4, device=device)
    pos = torch.zeros(2, dtype=torch.int32, device=device)
    state = torch.zeros(2, 4, 8, device=device)
    table = torch.zeros(1, 2, dtype=torch.int32, device=device)
    t2r = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="needs block_table and token_to_req"):
        write_compressor_state(kv, kv, kv[:1], pos, None, state, block_table=table)
    with pytest.raises(ValueError, match="not both"):
        write_compressor_state(kv, kv, kv[:1], pos, pos, state, block_table=table, token_to_req=t2r)
    with pytest.raises(TypeError, match="token_to_req"):
        write_compressor_state(kv, kv, kv[:1], pos, None, state, block_table=table, token_to_req=t2r.long())
    with pytest.raises(ValueError, match="block_table ids"):
        write_compressor_state(kv, kv, kv[:1], pos, None, state, block_table=table + 5, token_to_req=t2r)
    assert torch.all(state == 0)


def test_empty_and_all_skipped(device):
    for impl in IMPLS:
        cache = alloc_fp8_ds_mla_cache(2, 4, device=device, fill=POISON)
        insert_kv(torch.zeros(0, 512, device=device), torch.zeros(0, dtype=torch.int32, device=device), cache, impl=impl)
        insert_kv(torch.ones(3, 512, device=device), torch.full((3,), -1, device=device), cache, impl=impl)
        assert torch.all(pages_of(cache) == POISON)


def test_unvalidated_out_of_range_slots_are_skipped(device):
    """With validate_slots=False (CUDA-graph capture) a bad slot writes nothing, anywhere."""
    for impl in IMPLS:
        cache = alloc_fp8_ds_mla_cache(2, 4, device=device, fill=POISON)
        slots = torch.tensor([8, 100, -7, 3], device=device)
        insert_kv(torch.ones(4, 512, device=device), slots, cache, validate_slots=False, impl=impl)
        mask = fp8_slot_byte_mask(FP8DSMLALayout(), 2, 4, [3])
        assert torch.all(pages_of(cache).cpu()[~mask] == POISON)


def test_bad_inputs_raise_before_launch():
    cache = alloc_fp8_ds_mla_cache(2, 4)
    x = torch.zeros(3, 512)
    s = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="capacity"):
        insert_kv(x, torch.tensor([0, 1, 8]), cache, impl="triton")
    with pytest.raises(ValueError, match="slot_mapping"):
        insert_kv(x, torch.tensor([0, -2, 1]), cache)
    with pytest.raises(TypeError, match="slot_mapping"):
        insert_kv(x, s.float(), cache)
    with pytest.raises(ValueError, match="slot_mapping"):
        insert_kv(x, s[:2], cache)
    with pytest.raises(TypeError, match="kv"):
        insert_kv(x.to(torch.int32), s, cache)
    with pytest.raises(ValueError, match="head_dim"):
        insert_kv(torch.zeros(3, 256), s, cache)
    with pytest.raises(TypeError, match="cache"):
        insert_kv(x, s, torch.zeros(2, 4, 584, dtype=torch.int8))
    with pytest.raises(ValueError, match="block stride"):
        insert_kv(x, s, torch.zeros(8000, dtype=torch.uint8).as_strided((2, 4, 584), (2000, 584, 1)))  # < 4 * 584
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        insert_kv(x, s, cache, "int8")
    with pytest.raises(ValueError, match="cache"):
        insert_kv(x, s, torch.zeros(2, 4, 256, dtype=torch.bfloat16), "auto")
    with pytest.raises(ValueError, match="contiguous"):
        insert_kv(torch.zeros(512, 3).t(), s, cache)
    with pytest.raises(ValueError, match="impl"):
        insert_kv(x, s, cache, impl="cuda")
    with pytest.raises(TypeError, match="cache"):
        insert_kv(x, s, None)
    with pytest.raises(TypeError, match="slot_mapping"):
        insert_kv(x, [0, 1, 2], cache)
    icache = alloc_indexer_k_cache(2, 4)
    with pytest.raises(ValueError, match="cache"):
        insert_indexer_k(torch.zeros(3, 64), s, icache)
    with pytest.raises(ValueError, match="capacity"):
        insert_indexer_k(torch.zeros(3, 128), torch.tensor([0, 1, 9]), icache)
    st = torch.zeros(2, 4, 32)
    kv = torch.zeros(3, 16)
    ape = torch.zeros(4, 16)
    with pytest.raises(TypeError, match="score"):
        write_compressor_state(kv, kv.double(), ape, s, s, st)
    with pytest.raises(ValueError, match="ape"):
        write_compressor_state(kv, kv, torch.zeros(4, 8), s, s, st)
    with pytest.raises(ValueError, match="state_cache"):
        write_compressor_state(kv, kv, ape, s, s, torch.zeros(2, 4, 30))
    with pytest.raises(ValueError, match="positions"):
        write_compressor_state(kv, kv, ape, s[:2], s, st)
    with pytest.raises(ValueError, match="capacity"):
        write_compressor_state(kv, kv, ape, s, torch.tensor([0, 1, 8]), st)


@triton.jit
def _page_offset_probe_kernel(slot_ptr, out_ptr, block_size, stride_block):
    i = tl.program_id(0)
    page, off = page_offset(tl.load(slot_ptr + i), block_size, stride_block)
    tl.store(out_ptr + 2 * i, page)
    tl.store(out_ptr + 2 * i + 1, off)


def test_page_offset_is_int64(device):
    """The writers' address helper keeps block * stride in int64 past 2^31 (~57K blocks of a
    37,440 B page) even for int32 slot mappings."""
    slots = torch.tensor([0, 57_000 * 64 + 5, 100_000 * 64 + 63, 2**31 - 1], dtype=torch.int32, device=device)
    out = torch.empty(8, dtype=torch.int64, device=device)
    _page_offset_probe_kernel[(4,)](slots, out, 64, 37440)
    want = [v for s in slots.tolist() for v in ((s // 64) * 37440, s % 64)]
    assert out.tolist() == want
    assert max(want) > 2**31


@pytest.mark.gpu
@pytest.mark.slow
def test_insert_past_int32_byte_offsets_on_gpu():
    """A real 60K-block SWA cache (2.2 GB): writes to the last block land there."""
    nb, bs = 60_000, 64
    cache = alloc_fp8_ds_mla_cache(nb, bs, device="cuda", fill=POISON)
    x = tokens(3, 512, torch.bfloat16, seed=0).cuda()
    slots = torch.tensor([nb * bs - 1, (nb - 2) * bs, -1], device="cuda", dtype=torch.int32)
    insert_kv(x, slots, cache, impl="triton")
    ref = alloc_fp8_ds_mla_cache(1, bs, device="cuda", fill=POISON)
    insert_kv(x[:1], torch.tensor([bs - 1], device="cuda"), ref, impl="reference")
    assert torch.equal(pages_of(cache)[nb - 1], pages_of(ref)[0])
    assert torch.all(pages_of(cache)[: nb - 2] == POISON)


@settings(max_examples=12, deadline=None)
@given(
    bs=st.integers(1, 9),
    num_blocks=st.integers(1, 5),
    data=st.data(),
)
def test_triton_equals_reference_random_geometry(bs, num_blocks, data, device):
    """Awkward block sizes / token counts / hole patterns: both paths write the same bytes."""
    cap = bs * num_blocks
    n = data.draw(st.integers(0, cap))
    holes = data.draw(st.integers(0, n))
    seed = data.draw(st.integers(0, 2**16))
    x = tokens(n, 160, torch.float32, seed=seed)
    slots = random_slots(n, cap, holes, seed).to(torch.int32)
    layout = FP8DSMLALayout(128, 32)
    out = []
    for impl in IMPLS:
        cache = alloc_fp8_ds_mla_cache(num_blocks, bs, layout, device=device, fill=POISON)
        insert_kv(x.to(device), slots.to(device), cache, layout=layout, impl=impl)
        out.append(pages_of(cache, layout))
    assert torch.equal(out[0], out[1])


def test_allocator_slots_round_trip_through_writer_and_block_table(device):
    """Slots built from a request's block tables (SWA with freed -1 columns, C128A compressed
    entries at column e // 2) write entries that read back by the same mapping."""
    cfg = CacheConfig(compress_ratios=(128,))
    groups = cache_groups(cfg)
    m = KVCacheManager(groups, 64)
    m.add_request("r", 300)
    m.advance("r", 300)
    m.grow("r", 520)  # a 220-token chunk at positions 300..519
    pos = torch.arange(300, 520)
    swa = torch.tensor(m.block_ids("r", "swa"))
    assert swa[0] == NULL_BLOCK and swa[1] == NULL_BLOCK  # positions < 173 were released
    swa_slots = swa[pos // 64] * 64 + pos % 64
    mla = torch.tensor(m.block_ids("r", "full_mla"))
    done = (pos + 1) % 128 == 0  # tokens that complete a compressed entry (383 and 511)
    c = pos // 128
    comp_slots = torch.where(done, mla[c // 2] * 2 + c % 2, torch.full_like(c, -1))
    x = tokens(220, 512, torch.bfloat16, seed=9)
    swa_cache = alloc_fp8_ds_mla_cache(64, 64, device=device, fill=POISON)
    comp_cache = alloc_fp8_ds_mla_cache(64, 2, device=device, fill=POISON)
    insert_kv(x.to(device), swa_slots.to(device), swa_cache, impl="triton")
    insert_kv(x.to(device), comp_slots.to(device), comp_cache, impl="triton")
    want = dequantize_fp8_ds_mla(quantize_fp8_ds_mla(x.reshape(1, 220, 512))).reshape(220, 512)
    got = dequantize_fp8_ds_mla(swa_cache).cpu().reshape(-1, 512)[swa_slots]
    assert torch.equal(got, want)
    got_c = dequantize_fp8_ds_mla(comp_cache).cpu().reshape(-1, 512)[comp_slots[done]]
    assert torch.equal(got_c, want[done])


@pytest.mark.parametrize("impl", IMPLS)
def test_contiguous_fp8_cache_as_the_engine_tests_allocate(impl, device):
    """Block stride block_size * 584 (no page padding) is accepted and holds the same entry bytes
    as the padded layout; "fp8" is an alias of "fp8_ds_mla"; a one-block cache dequantises."""
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(4))
    slots = torch.tensor([0, 3, 4, 7, 6])
    padded = alloc_fp8_ds_mla_cache(2, 4, device=device)
    flat = torch.zeros(2, 4, 584, dtype=torch.uint8, device=device)
    insert_kv(x.to(device), slots.to(device), padded, impl=impl)
    insert_kv(x.to(device), slots.to(device), flat, "fp8", impl=impl)
    assert torch.equal(pages_of(flat)[:, : 4 * 584], pages_of(padded)[:, : 4 * 584])
    assert torch.equal(dequantize_fp8_ds_mla(flat), dequantize_fp8_ds_mla(padded))
    one = torch.zeros(1, 4, 584, dtype=torch.uint8, device=device)
    insert_kv(x[:2].to(device), torch.tensor([1, 2], device=device), one, impl=impl)
    assert torch.equal(dequantize_fp8_ds_mla(one)[0, 1:3], dequantize_fp8_ds_mla(padded)[0, [0, 3]])
