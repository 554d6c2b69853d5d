"""Triton helpers of the attention kernels that read the caches: candidate slots, raw loads,
fp8_ds_mla decoding (@triton.jit functions only; used by :mod:`dsv4attn.kernels.sparse_attn`
and :mod:`dsv4attn.kernels.sparse_attn_prefill`).

A chunk of candidates is read in two steps so that callers can put other work between the
issue of the loads and their first use: :func:`_load_raw` issues every load of the chunk (fp8
NoPE bytes as coalesced byte rows, the bf16 RoPE tail, the UE8M0 scale bytes as two 32-bit
words per entry) and :func:`_decode_nope` turns the bytes into bf16 (integer bit operations:
e4m3 -> fp32 bits, times 2^120, times the tile scale). Masked lanes load zeros; a -1 or
out-of-range slot is never dereferenced, even in address arithmetic. Byte offsets are int64.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4attn.kernels.common import block_id


@triton.jit
def _candidate_entry(t, j, idx_ptr, stride_idx, length, bt_ptr, stride_bt, max_blocks, start, req, block_size,
                     IS_RANGE: tl.constexpr):
    """The one global read of candidates ``j`` of token ``t``'s slot lookup (int32, -1 when
    invalid): the index entry (indices form) or the block id of entry ``start + j`` in the
    request's block-table row (range form, :func:`dsv4attn.kernels.common.block_id`). Issued
    early by pipelined kernels; :func:`_candidate_place` finishes the lookup."""
    valid = j < length
    if IS_RANGE:
        e = start + j
        valid = valid & (e >= 0)
        e = tl.where(valid, e, 0)
        x = block_id(bt_ptr, req, e // block_size, valid, stride_bt, 1, max_blocks)
    else:
        x = tl.load(idx_ptr + t.to(tl.int64) * stride_idx + tl.where(valid, j, 0), mask=valid, other=-1)
    return x


@triton.jit
def _candidate_place(x, j, start, block_size, capacity, IS_RANGE: tl.constexpr):
    """Block id (int64), offset in block (int64) and validity from :func:`_candidate_entry`'s
    ``x`` (a slot inside ``[0, capacity)`` is valid; -1 and holes are not). The block / offset
    split is one unsigned 32-bit division (slots < capacity < 2^31; the offset is what the
    quotient leaves): no 64-bit or signed division in the gather."""
    if IS_RANGE:
        e = tl.where(x >= 0, start + j, 0).to(tl.uint32)  # start + j >= 0 wherever x >= 0
        bs = tl.cast(block_size, tl.uint32)  # tl.cast: block_size may be a 1 that Triton specialised
        off = (e - (e // bs) * bs).to(tl.int32)
        valid = (x >= 0) & (x.to(tl.int64) * block_size + off < capacity)
        blk = x
    else:
        valid = (x >= 0) & (x < capacity)
        xs = tl.where(valid, x, 0).to(tl.uint32)
        bs = tl.cast(block_size, tl.uint32)  # tl.cast: block_size may be a 1 that Triton specialised
        q = xs // bs
        blk = q.to(tl.int32)
        off = (xs - q * bs).to(tl.int32)
    blk = tl.where(valid, blk, 0)
    off = tl.where(valid, off, 0)
    return blk.to(tl.int64), off.to(tl.int64), valid


@triton.jit
def _candidate_slots(
    t, j, idx_ptr, stride_idx, length, bt_ptr, stride_bt, max_blocks, req, start, block_size, capacity,
    IS_RANGE: tl.constexpr,
):
    """Block id (int64), offset in block (int64) and validity of candidates ``j`` of token ``t``."""
    x = _candidate_entry(t, j, idx_ptr, stride_idx, length, bt_ptr, stride_bt, max_blocks, start, req, block_size,
                         IS_RANGE)
    return _candidate_place(x, j, start, block_size, capacity, IS_RANGE)


@triton.jit
def _clip_range(start, length, req, num_reqs, cap):
    """A range-form token's entries ``[start, start + length)`` cut to the block table's
    ``[0, cap)`` (entries outside are invalid anyway), empty when ``req`` is no block-table
    row: the work per token is bounded by the table and no tile count can overflow int32.
    Returns (start, length) as int32."""
    lo = tl.maximum(start, 0).to(tl.int64)
    hi = tl.minimum(start.to(tl.int64) + length.to(tl.int64), cap)
    n = tl.where((req >= 0) & (req < num_reqs), tl.maximum(hi - lo, 0), 0)
    return lo.to(tl.int32), n.to(tl.int32)


@triton.jit
def _raw_nope(cache_ptr, data, valid, D0: tl.constexpr, P: tl.constexpr):
    """Raw page values of candidate dims ``D0 .. D0+P-1`` (fp8 bytes, or bf16/fp32 values)."""
    dd = tl.arange(0, P)
    return tl.load(cache_ptr + data[:, None] + (D0 + dd)[None, :], mask=valid[:, None], other=0)


@triton.jit
def _raw_tail(cache_ptr, data, valid, NOPE: tl.constexpr, TAIL: tl.constexpr, R: tl.constexpr,
              IS_FP8: tl.constexpr):
    """Candidate dims ``NOPE .. NOPE+TAIL-1`` (RoPE: bf16 in fp8 pages) -> ``[n, R]``, zeros
    past TAIL."""
    rr = tl.arange(0, R)
    if IS_FP8:
        base = (cache_ptr + data + NOPE).to(tl.pointer_type(tl.bfloat16))
    else:
        base = cache_ptr + data + NOPE
    if TAIL == R:
        k = tl.load(base[:, None] + rr[None, :], mask=valid[:, None], other=0.0)
    else:
        ok = rr < TAIL
        k = tl.load(base[:, None] + tl.where(ok, rr, 0)[None, :], mask=valid[:, None] & ok[None, :], other=0.0)
    return k


@triton.jit
def _load_raw(cache_ptr, blk, off, valid, stride_blk, stride_entry, block_size,
              IS_FP8: tl.constexpr, NOPE: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
              TAIL: tl.constexpr, R: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """Issue every load of one chunk of candidates (``blk``, ``off``, ``valid`` ``[n]``) and
    return the raw values ``(r0, r1, r2, r3, s_lo, s_hi)``: NoPE parts (fp8 bytes or page
    values), the tail, and for fp8 the UE8M0 scale bytes of tiles 0-3 / 4-7 as 32-bit words.
    Unused parts are returned as ``valid`` (a placeholder). Nothing here waits for the data,
    so the caller can issue the next chunk's loads before decoding this one."""
    if IS_FP8:
        data = blk * stride_blk + off * DATA_BYTES
        sc = blk * stride_blk + block_size * DATA_BYTES + off * SCALE_BYTES
        # Masked lanes read byte 127 = 2^0 (their values are zeros anyway).
        s_lo = tl.load((cache_ptr + sc).to(tl.pointer_type(tl.uint32)), mask=valid, other=0x7F7F7F7F)
        if NOPE > 256:
            s_hi = tl.load((cache_ptr + sc + 4).to(tl.pointer_type(tl.uint32)), mask=valid, other=0x7F7F7F7F)
        else:
            s_hi = s_lo
    else:
        data = blk * stride_blk + off * stride_entry
        s_lo = valid
        s_hi = valid
    r0 = _raw_nope(cache_ptr, data, valid, 0, P0) if P0 > 0 else valid
    r1 = _raw_nope(cache_ptr, data, valid, P0, P1) if P1 > 0 else valid
    r2 = _raw_nope(cache_ptr, data, valid, P0 + P1, P2) if P2 > 0 else valid
    r3 = _raw_tail(cache_ptr, data, valid, NOPE, TAIL, R, IS_FP8) if TAIL > 0 else valid
    return r0, r1, r2, r3, s_lo, s_hi


@triton.jit
def _tile_scale(s_lo, s_hi, T: tl.constexpr):
    """fp32 ``2^(byte-127)`` of 64-dim tile ``T`` from the scale words ``[n]``."""
    w = s_lo if T < 4 else s_hi
    b = (w.to(tl.uint32) >> (8 * (T % 4))) & 0xFF
    return (b << 23).to(tl.float32, bitcast=True)


@triton.jit
def _decode_nope(x, s_lo, s_hi, D0: tl.constexpr, P: tl.constexpr, IS_FP8: tl.constexpr):
    """Raw NoPE part ``x [n, P]`` (dims ``D0 ..``; D0 and P multiples of 64) -> bf16."""
    if IS_FP8:
        x = x.to(tl.uint32)
        # e4m3fn byte -> fp32 bits with the sign at bit 31 and exponent+mantissa at bits 20..26;
        # those bits times 2^120 equal the e4m3fn value exactly (subnormals included).
        f = (((x & 0x80) << 24) | ((x & 0x7F) << 20)).to(tl.float32, bitcast=True) * 1.329227995784916e36
        # Per-64-dim tile scale (a separate multiply: 2^120 x 2^(byte-127) overflows fp32 for
        # bytes > 134). Multi-tile parts select their tile's scale per column.
        scl = _tile_scale(s_lo, s_hi, D0 // 64)[:, None]
        if P > 64:
            tile = (tl.arange(0, P) // 64)[None, :]
            scl = tl.where(tile == 1, _tile_scale(s_lo, s_hi, D0 // 64 + 1)[:, None], scl)
            if P > 128:
                scl = tl.where(tile == 2, _tile_scale(s_lo, s_hi, D0 // 64 + 2)[:, None], scl)
                scl = tl.where(tile == 3, _tile_scale(s_lo, s_hi, D0 // 64 + 3)[:, None], scl)
        k = (f * scl).to(tl.bfloat16)  # exact: e4m3 x 2^k fits bf16
    else:
        k = x.to(tl.bfloat16)  # no-op for bf16 pages; fp32 pages go to the bf16 tensor cores too
    return k


@triton.jit
def _sanitize(k, bad):
    """Zero the non-finite values of ``k [n, P]``; ``bad [n]`` |= entry had one."""
    x = k.to(tl.float32)
    nonfinite = (x - x) != 0.0  # inf - inf and NaN - NaN are NaN
    bad = bad | tl.max(nonfinite.to(tl.int32), axis=1)
    return tl.where(nonfinite, 0.0, x).to(k.dtype), bad
