"""Triton cache writers: fp8_ds_mla insert, plain-row insert, indexer-key insert, state rows.

One program per token; a slot < 0 or >= num_slots writes nothing. Byte offsets are int64.
float8 e4m3fn and bf16 are encoded with integer operations on the fp32 bits (exact
round-to-nearest-even, subnormals included), so the kernels need no fp8 hardware support and
give the same bytes under the interpreter, on sm80 and on sm90 as the PyTorch reference.
Launchers live in dsv4attn/ops/cache_ops.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4attn.kernels.common import (
    bf16_bits, e4m3_encode, entry_slot, page_offset, pow2, pow2_exponent_for, round_to_bf16,
)


@triton.jit
def _insert_kv_fp8_kernel(
    kv_ptr, slot_ptr, cache_ptr,
    stride_kv_t, stride_cache_block, block_size, num_slots,
    NOPE_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, TILE: tl.constexpr,
    NUM_TILES: tl.constexpr, NUM_TILES_P2: tl.constexpr, SCALE_BYTES: tl.constexpr,
    SCALE_P2: tl.constexpr, ROPE_P2: tl.constexpr, INPUT_IS_BF16: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    DATA_BYTES: tl.constexpr = NOPE_DIM + 2 * ROPE_DIM
    page_off, off = page_offset(slot, block_size, stride_cache_block)
    page = cache_ptr + page_off
    data = page + off * DATA_BYTES
    scales = page + block_size * DATA_BYTES + off * SCALE_BYTES
    row = kv_ptr + t.to(tl.int64) * stride_kv_t

    # NoPE: [NUM_TILES_P2, TILE] tiles -> fp8 bytes + one UE8M0 byte per tile.
    r = tl.arange(0, NUM_TILES_P2)[:, None]
    c = tl.arange(0, TILE)[None, :]
    d = r * TILE + c
    tmask = (r < NUM_TILES) & (c < TILE)
    x = tl.load(row + d, mask=tmask, other=0.0).to(tl.float32)
    if not INPUT_IS_BF16:
        x = round_to_bf16(x)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)               # [NUM_TILES_P2]
    e = pow2_exponent_for(amax)
    y = x * pow2(-e)[:, None]
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    tl.store(data + d, e4m3_encode(y).to(tl.uint8), mask=tmask)
    tv = tl.arange(0, NUM_TILES_P2)
    sbyte = tl.minimum(tl.maximum(e + 127, 0), 255).to(tl.uint8)
    tl.store(scales + tv, sbyte, mask=tv < NUM_TILES)
    pad = tl.arange(0, SCALE_P2)
    tl.store(scales + pad, tl.zeros([SCALE_P2], dtype=tl.uint8),
             mask=(pad >= NUM_TILES) & (pad < SCALE_BYTES))

    # RoPE: bf16, stored unquantised after the NoPE bytes.
    if ROPE_DIM > 0:
        rd = tl.arange(0, ROPE_P2)
        rmask = rd < ROPE_DIM
        xr = tl.load(row + NOPE_DIM + rd, mask=rmask, other=0.0).to(tl.float32)
        if not INPUT_IS_BF16:
            xr = round_to_bf16(xr)
        rope_ptr = (data + NOPE_DIM).to(tl.pointer_type(tl.int16))
        tl.store(rope_ptr + rd, bf16_bits(xr).to(tl.int16), mask=rmask)


@triton.jit
def _insert_rows_kernel(
    src_ptr, slot_ptr, cache_ptr,
    stride_src_t, stride_cache_block, stride_cache_entry, block_size, num_slots, dim,
    BLOCK_D: tl.constexpr, ROUND_TO_BF16: tl.constexpr,
):
    """Plain rows ("auto" caches): cache[slot // bs, slot % bs, :dim] = src[t] in cache dtype."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    page_off, off = page_offset(slot, block_size, stride_cache_block)
    dst = cache_ptr + page_off + off * stride_cache_entry
    src = src_ptr + t.to(tl.int64) * stride_src_t
    for d0 in range(0, dim, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = d < dim
        x = tl.load(src + d, mask=m, other=0.0)
        if ROUND_TO_BF16:
            bits = bf16_bits(round_to_bf16(x.to(tl.float32))).to(tl.int16)
            tl.store(dst.to(tl.pointer_type(tl.int16)) + d, bits, mask=m)
        else:
            tl.store(dst + d, x.to(cache_ptr.dtype.element_ty), mask=m)


@triton.jit
def _insert_indexer_k_fp8_kernel(
    k_ptr, slot_ptr, cache_ptr,
    stride_k_t, stride_cache_block, block_size, num_slots,
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, INPUT_IS_BF16: tl.constexpr,
):
    """fp8 indexer key: DIM e4m3fn bytes at off*DIM, fp32 scale 2^e at bs*DIM + off*4."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    page_off, off = page_offset(slot, block_size, stride_cache_block)
    page = cache_ptr + page_off
    d = tl.arange(0, BLOCK_D)
    m = d < DIM
    x = tl.load(k_ptr + t.to(tl.int64) * stride_k_t + d, mask=m, other=0.0).to(tl.float32)
    if not INPUT_IS_BF16:
        x = round_to_bf16(x)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-4)
    e = pow2_exponent_for(amax)
    y = tl.minimum(tl.maximum(x * pow2(-e), -448.0), 448.0)
    tl.store(page + off * DIM + d, e4m3_encode(y).to(tl.uint8), mask=m)
    i4 = tl.arange(0, 4)
    sbits = (e + 127) << 23                                          # fp32 bits of 2^e
    sbytes = ((sbits >> (8 * i4)) & 0xFF).to(tl.uint8)              # little endian
    tl.store(page + block_size * DIM + off * 4 + i4, sbytes)


@triton.jit
def _write_compressor_state_kernel(
    kv_ptr, score_ptr, ape_ptr, pos_ptr, slot_ptr, state_ptr, bt_ptr, t2r_ptr,
    stride_kv_t, stride_score_t, stride_ape_r, stride_state_block, stride_state_entry,
    block_size, num_slots, ratio, width, stride_bt, num_reqs, max_blocks,
    BLOCK_W: tl.constexpr, SLOTS_FROM_TABLE: tl.constexpr,
):
    """state[slot] = [kv[t] | score[t] + ape[pos[t] % ratio]] (fp32, width = coff*D each; inputs
    of any float dtype, widened to fp32). The slot is ``slot_ptr[t]``, or with SLOTS_FROM_TABLE
    entry ``pos[t]`` of request ``t2r[t]`` in the block table (the slot formula; a hole, a
    negative position or a request outside the table writes nothing)."""
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t).to(tl.int64)
    if SLOTS_FROM_TABLE:
        req = tl.load(t2r_ptr + t)
        ok = (req >= 0) & (req < num_reqs)
        slot, _ = entry_slot(bt_ptr, tl.where(ok, req, 0), p, ok, stride_bt, 1, max_blocks, block_size)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    rr = ((p % ratio) + ratio) % ratio
    page_off, off = page_offset(slot, block_size, stride_state_block)
    dst = state_ptr + page_off + off * stride_state_entry
    t64 = t.to(tl.int64)
    for w0 in range(0, width, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        m = w < width
        kv = tl.load(kv_ptr + t64 * stride_kv_t + w, mask=m, other=0.0).to(tl.float32)
        sc = tl.load(score_ptr + t64 * stride_score_t + w, mask=m, other=0.0).to(tl.float32)
        ap = tl.load(ape_ptr + rr * stride_ape_r + w, mask=m, other=0.0).to(tl.float32)
        tl.store(dst + w, kv, mask=m)
        tl.store(dst + width + w, sc + ap, mask=m)
