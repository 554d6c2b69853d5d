"""Triton kernels of the per-step metadata ops (only @triton.jit functions; no policy).

Semantics are those of ``dsv4attn/reference/metadata.py``. Every block-table read goes through
:func:`dsv4attn.kernels.common.entry_slot` (masked, column clamped into the table, holes -1), so no
lane ever forms an out-of-bounds address (SM12x + Triton 3.6 raise IMA on masked out-of-range
addresses).
Slots are formed in int64 and narrowed only where the output is int32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4attn.kernels.common import block_slot, entry_slot


@triton.jit
def _compressed_slot_mapping_kernel(
    out_ptr,  # int64 [out_len]
    qsl_ptr,  # int32 [num_reqs + 1]
    seq_lens_ptr,  # int32 [num_reqs]
    bt_ptr,  # int32 [num_reqs, max_blocks]
    stride_bt_req,
    stride_bt_col,
    num_tokens,
    out_len,
    num_reqs,
    max_blocks,
    block_size,
    ratio,
    cp_world,
    cp_rank,
    cp_interleave,
    SEARCH_ITERS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One lane per entry of `out`: the whole buffer is written (tail -1) by this one launch.
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_out = t < out_len
    total = tl.load(qsl_ptr + num_reqs)
    active = in_out & (t < num_tokens) & (t < total)
    # Binary search: req = last index in [0, num_reqs) with query_start_loc[req] <= t.
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = tl.zeros([BLOCK], dtype=tl.int32) + num_reqs
    for _ in tl.static_range(SEARCH_ITERS):
        mid = (lo + hi) // 2
        go = (hi - lo) > 1
        le = tl.load(qsl_ptr + mid) <= t
        lo = tl.where(go & le, mid, lo)
        hi = tl.where(go & (~le), mid, hi)
    req = lo
    start = tl.load(qsl_ptr + req)
    qlen = tl.load(qsl_ptr + req + 1) - start
    p = tl.load(seq_lens_ptr + req) - qlen + (t - start)
    pp = tl.maximum(p, 0)
    valid = active & (p >= 0) & ((pp + 1) % ratio == 0)
    # The engine's formula (dsv4attn.reference.metadata documents it): entry c = p // r is dealt
    # within each virtual block of block_size * cp_world entries.
    c = pp // ratio
    vbs = block_size * cp_world
    voff = c % vbs
    valid = valid & (((voff // cp_interleave) % cp_world) == cp_rank)
    off = (voff // (cp_world * cp_interleave)) * cp_interleave + voff % cp_interleave
    slot, valid = block_slot(bt_ptr, req, c // vbs, off, valid, stride_bt_req, stride_bt_col, max_blocks,
                             block_size)
    tl.store(out_ptr + t, slot, mask=in_out)


@triton.jit
def _c128a_topk_kernel(
    pos_ptr,  # int32/int64 [T]
    t2r_ptr,  # int32 [T]
    bt_ptr,  # int32 [num_reqs, max_blocks]
    stride_bt_req,
    stride_bt_col,
    max_blocks,
    block_size,
    slot_mapping_ptr,  # int32/int64 [T]
    gdec_ptr,  # int32 [>= num_decode_tokens, W]
    stride_gdec,
    dlens_ptr,  # int32 [>= num_decode_tokens]
    pref_ptr,  # int32 [>= T - num_decode_tokens, W]
    stride_pref,
    num_decode_tokens,
    ratio,
    max_ct,
    FULL_WIDTH: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per token; it writes only columns [0, end) of its own row, end <= max_ct <= W.
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t).to(tl.int64)
    n = tl.minimum(tl.maximum((p + 1) // ratio, 0), max_ct).to(tl.int32)
    if FULL_WIDTH:
        end = max_ct
    else:
        end = tl.minimum((n + ALIGN - 1) // ALIGN * ALIGN, max_ct)
    offs = tl.arange(0, BLOCK)
    if t < num_decode_tokens:
        req = tl.load(t2r_ptr + t).to(tl.int64)
        sm = tl.load(slot_mapping_ptr + t)
        tl.store(dlens_ptr + t, tl.where(sm >= 0, n, 0))
        row = gdec_ptr + t.to(tl.int64) * stride_gdec
        for j0 in range(0, end, BLOCK):
            j = j0 + offs
            m = j < end
            slot, v = entry_slot(bt_ptr, req, j, m & (j < n), stride_bt_req, stride_bt_col, max_blocks, block_size)
            tl.store(row + j, slot.to(tl.int32), mask=m)
    else:
        row = pref_ptr + (t - num_decode_tokens).to(tl.int64) * stride_pref
        for j0 in range(0, end, BLOCK):
            j = j0 + offs
            m = j < end
            tl.store(row + j, tl.where(j < n, j, -1).to(tl.int32), mask=m)


@triton.jit
def _swa_indices_kernel(
    pos_ptr,  # int32/int64 [T]
    t2r_ptr,  # int32 [T]
    bt_ptr,  # int32 [num_reqs, max_blocks]
    stride_bt_req,
    stride_bt_col,
    max_blocks,
    block_size,
    slot_mapping_ptr,  # int32/int64 [T]
    idx_ptr,  # int32 [>= T, >= window]
    stride_idx,
    lens_ptr,  # int32 [>= T]
    window,
    BLOCK_W: tl.constexpr,
):
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t).to(tl.int64)
    sm = tl.load(slot_mapping_ptr + t)
    req = tl.load(t2r_ptr + t).to(tl.int64)
    start = tl.maximum(p - window + 1, 0)
    length = tl.where(sm >= 0, tl.maximum(p + 1 - start, 0), 0)
    tl.store(lens_ptr + t, length.to(tl.int32))
    j = tl.arange(0, BLOCK_W)
    m = j < window
    e = start + j
    slot, v = entry_slot(bt_ptr, req, e, m & (j < length), stride_bt_req, stride_bt_col, max_blocks, block_size)
    tl.store(idx_ptr + t.to(tl.int64) * stride_idx + j, slot.to(tl.int32), mask=m)


@triton.jit
def _global_topk_kernel(
    local_ptr,  # int32 [T, K]
    stride_local,
    t2r_ptr,  # int32 [T]
    bt_ptr,  # int32 [num_reqs, max_blocks]
    stride_bt_req,
    stride_bt_col,
    max_blocks,
    block_size,
    valid_ptr,  # bool [T]
    out_ptr,  # int32 [>= T, >= K]
    stride_out,
    lens_ptr,  # int32 [>= T]
    K,
    limit_ptr,  # int32 [T]: entries >= limit[t] are holes (read only when HAS_LIMIT)
    HAS_LIMIT: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    req = tl.load(t2r_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    count = tl.zeros([BLOCK_K], dtype=tl.int32)
    if HAS_LIMIT:
        lim = tl.load(limit_ptr + t)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs
        m = k < K
        i = tl.load(local_ptr + t.to(tl.int64) * stride_local + k, mask=m, other=-1)
        ok = i >= 0
        if HAS_LIMIT:
            ok = ok & (i < lim)
        count += (m & ok).to(tl.int32)
        slot, v = entry_slot(bt_ptr, req, i, m & ok, stride_bt_req, stride_bt_col, max_blocks, block_size)
        tl.store(out_ptr + t.to(tl.int64) * stride_out + k, slot.to(tl.int32), mask=m)
    ok = tl.load(valid_ptr + t).to(tl.int1)
    tl.store(lens_ptr + t, tl.where(ok, tl.sum(count, axis=0), 0))


@triton.jit
def _ranges_kernel(
    pos_ptr,  # int32/int64 [T]
    slot_mapping_ptr,  # int32/int64 [T]
    starts_ptr,  # int32 [>= T] (written only when IS_WINDOW)
    lengths_ptr,  # int32 [>= T]
    num_tokens,
    window,
    ratio,
    IS_WINDOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = t < num_tokens
    p = tl.load(pos_ptr + t, mask=m, other=0).to(tl.int64)
    ok = tl.load(slot_mapping_ptr + t, mask=m, other=-1) >= 0
    if IS_WINDOW:
        start = tl.maximum(p - window + 1, 0)
        length = tl.maximum(p + 1 - start, 0)
        tl.store(starts_ptr + t, start.to(tl.int32), mask=m)
    else:
        length = tl.maximum((p + 1) // ratio, 0)
    tl.store(lengths_ptr + t, tl.where(ok, length, 0).to(tl.int32), mask=m)
