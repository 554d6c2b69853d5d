"""Triton kernels of the sparse MLA attention with attention sink over paged caches.

One program owns one query token, a tile of ``BLOCK_H`` heads and (with split-KV) every
``num_splits``-th chunk of ``BLOCK_N`` candidates of each set. A chunk is gathered by slot,
dequantised in registers (fp8_ds_mla: e4m3 decoded with integer bit operations, UE8M0 tile
scale folded in; RoPE dims read as bf16), and fed to ``tl.dot`` twice (QK^T and PV, bf16 in,
fp32 accumulate) under an online softmax in base 2 shared by both sets. All ``BLOCK_H`` heads
of the program share one dequantisation of each entry.

Addresses of masked lanes are clamped to valid ones (a -1 index is never dereferenced, even
in address arithmetic), and masked lanes load zeros, so NaN in unused pages never reaches the
accumulators. Byte offsets are int64.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: log2(e) (host side: folded into the softmax scale) and ln(2) (kernel side; a constexpr, as
#: compiled Triton only reads constexpr globals): the online softmax runs in base 2.
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _candidate_slots(
    t, j, idx_ptr, stride_idx, length, bt_ptr, stride_bt, max_blocks, req, start, block_size, capacity,
    IS_RANGE: tl.constexpr,
):
    """Block id (int64), offset in block (int64) and validity of candidates ``j`` of token ``t``."""
    valid = j < length
    if IS_RANGE:
        e = tl.where(valid, start + j, 0)
        col = e // block_size
        valid = valid & (col < max_blocks) & (e >= 0)
        col = tl.where(valid, col, 0)
        blk = tl.load(bt_ptr + req.to(tl.int64) * stride_bt + col, mask=valid, other=-1)
        valid = valid & (blk >= 0)
        slot = blk.to(tl.int64) * block_size + e % block_size
    else:
        jj = tl.where(valid, j, 0)
        slot = tl.load(idx_ptr + t.to(tl.int64) * stride_idx + jj, mask=valid, other=-1).to(tl.int64)
        valid = valid & (slot >= 0)
    valid = valid & (slot < capacity)
    slot = tl.where(valid, slot, 0)
    return slot // block_size, slot % block_size, valid


@triton.jit
def _load_k(
    cache_ptr, blk, off, valid, stride_blk, stride_entry, block_size,
    IS_FP8: tl.constexpr, HEAD_DIM: tl.constexpr, NOPE: tl.constexpr, D_PAD: tl.constexpr,
    DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, NUM_TILES: tl.constexpr, TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Candidate rows ``[BLOCK_N, D_PAD]`` bf16 (zeros for invalid rows and pad dims)."""
    d = tl.arange(0, D_PAD)
    if IS_FP8:
        # Work on [BLOCK_N, NT_PAD, TILE]: tile t < NUM_TILES holds NoPE dims 64t..64t+63 (fp8
        # x UE8M0 scale), tile NUM_TILES holds the RoPE dims (bf16), later tiles are zero
        # padding. The caller guarantees ROPE <= TILE and 4-byte aligned entries. Bytes are
        # read as 32-bit words (4 fp8 / 2 bf16 values per load: a quarter of the per-element
        # 64-bit addresses) and unpacked with shifts and tl.join.
        NT_PAD: tl.constexpr = D_PAD // TILE
        WPT: tl.constexpr = TILE // 4
        tt = tl.arange(0, NT_PAD)
        ww = tl.arange(0, WPT)
        in_sc = tt < NUM_TILES
        base = blk * stride_blk + off * DATA_BYTES  # int64 byte offset of the entry's data
        nope_off = tl.where(in_sc, tt, 0)[None, :, None] * TILE + ww[None, None, :] * 4
        wp = (cache_ptr + base[:, None, None] + nope_off).to(tl.pointer_type(tl.uint32))
        w = tl.load(wp, mask=valid[:, None, None] & in_sc[None, :, None], other=0)  # [N, NT_PAD, WPT]
        # e4m3fn byte i of a word -> fp32 bits with the sign at bit 31 and exponent+mantissa at
        # bits 20..26; those bits times 2^120 equal the e4m3fn value exactly.
        f0 = ((w & 0x80) << 24) | ((w & 0x7F) << 20)
        f1 = ((w & 0x8000) << 16) | ((w & 0x7F00) << 12)
        f2 = ((w & 0x800000) << 8) | ((w & 0x7F0000) << 4)
        f3 = (w & 0x80000000) | ((w & 0x7F000000) >> 4)
        # join(join(f0, f2), join(f1, f3)) flattens to the byte order f0, f1, f2, f3.
        f = tl.reshape(tl.join(tl.join(f0, f2), tl.join(f1, f3)), (BLOCK_N, NT_PAD, TILE))
        f = f.to(tl.float32, bitcast=True) * 1.329227995784916e36
        # UE8M0 tile scales 2^(byte-127) built as fp32 exponent fields (exact for bytes 1..254; the
        # quantiser never writes 0 or 255). Folding 2^120 into this factor would overflow fp32
        # for bytes > 134, so it stays a separate multiply.
        sc_off = blk * stride_blk + block_size * DATA_BYTES + off * SCALE_BYTES
        sb = tl.load(cache_ptr + sc_off[:, None] + tl.where(in_sc, tt, 0)[None, :],
                     mask=valid[:, None] & in_sc[None, :], other=127).to(tl.uint32)
        sc = (sb << 23).to(tl.float32, bitcast=True)
        # RoPE: bf16 pairs per word; bf16 -> fp32 is the 16-bit pattern moved to the top half.
        rw = tl.arange(0, TILE // 2)
        in_rope = rw * 2 < HEAD_DIM - NOPE
        rp = (cache_ptr + base[:, None] + NOPE + 4 * tl.where(in_rope, rw, 0)[None, :]).to(tl.pointer_type(tl.uint32))
        rv = tl.load(rp, mask=valid[:, None] & in_rope[None, :], other=0)  # [N, TILE // 2]
        r = tl.reshape(tl.join(rv << 16, rv & 0xFFFF0000), (BLOCK_N, TILE)).to(tl.float32, bitcast=True)
        k3 = tl.where((tt == NUM_TILES)[None, :, None], r[:, None, :], f * sc[:, :, None])
        k = tl.reshape(k3, (BLOCK_N, D_PAD)).to(tl.bfloat16)
    else:
        in_d = d < HEAD_DIM
        ptr = cache_ptr + (blk * stride_blk + off * stride_entry)[:, None] + tl.where(in_d, d, 0)[None, :]
        k = tl.load(ptr, mask=valid[:, None] & in_d[None, :], other=0.0)
    return k


# ``CPU_INTERP`` (true only for CPU tensors, i.e. under Triton's interpreter) works around two
# interpreter defects seen in Triton 3.9: ``tl.dot`` of bf16 operands returns garbage, and the
# fp32 -> bf16 cast truncates instead of rounding to nearest-even. Compiled GPU code takes the
# native paths.


@triton.jit
def _dot(a, b, CPU_INTERP: tl.constexpr):
    """``tl.dot`` of bf16 operands with fp32 accumulation (interpreter: widened to fp32 first,
    exact since the operands are bf16 values)."""
    if CPU_INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _to_bf16(x, CPU_INTERP: tl.constexpr):
    """fp32 -> bf16 rounded to nearest-even (interpreter: by integer bit operations)."""
    if CPU_INTERP:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _online_update(q, k, mask, m_i, l_i, acc, qk_scale, CPU_INTERP: tl.constexpr):
    """One chunk of the base-2 online softmax (``mask`` broadcasts to ``[rows, BLOCK_N]``);
    returns updated (m_i, l_i, acc)."""
    s = _dot(q, tl.trans(k), CPU_INTERP) * qk_scale  # [rows, BLOCK_N] fp32, log2 units
    s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(_to_bf16(p, CPU_INTERP), k, CPU_INTERP)
    return m_new, l_i, acc


@triton.jit
def _finish(acc, m_i, l_i, row_ok, o_off, lse_off, max_off, part_row, sink_ptrs,
            out_ptr, lse_ptr, max_ptr, part_o_ptr, part_lse_ptr, d, d_ok,
            HAS_SINK: tl.constexpr, WRITE_MAX: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
            D_PAD: tl.constexpr, CPU_INTERP: tl.constexpr):
    """Normalise and write one tile of rows (a row = one (token, head); offsets are int64).

    Final: out bf16 (sink applied, 0 for empty rows), lse natural log (+inf when empty), max
    logits (optional). Partial: fp32 normalised out at ``part_row * D_PAD`` and base-2 lse
    (-inf when empty) for ``_sparse_mla_combine_kernel``.
    """
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))  # base 2
    if WRITE_PARTIAL:
        tl.store(part_o_ptr + part_row[:, None] * D_PAD + d[None, :], o, mask=row_ok[:, None])
        tl.store(part_lse_ptr + part_row, lse2, mask=row_ok)
    else:
        lse = tl.where(empty, float("inf"), lse2 * LN2)
        if HAS_SINK:
            sink = tl.load(sink_ptrs, mask=row_ok, other=float("-inf"))
            o = o * (1.0 / (1.0 + tl.exp(sink - tl.where(empty, 0.0, lse))))[:, None]
        o = tl.where(empty[:, None], 0.0, o)
        tl.store(out_ptr + o_off[:, None] + tl.where(d_ok, d, 0)[None, :], _to_bf16(o, CPU_INTERP),
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + lse_off, lse, mask=row_ok)
        if WRITE_MAX:
            tl.store(max_ptr + max_off, m_i * LN2, mask=row_ok)


@triton.jit
def _sparse_mla_attn_kernel(
    q_ptr, stride_q_t, stride_q_h,
    out_ptr, stride_o_t, stride_o_h,
    lse_ptr, stride_lse_t,
    max_ptr, stride_max_t,
    part_o_ptr, part_lse_ptr,
    sink_ptr,
    a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity,
    a_idx_ptr, a_stride_idx, a_width, a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_req_ptr, a_start_ptr,
    b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity,
    b_idx_ptr, b_stride_idx, b_width, b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_req_ptr, b_start_ptr,
    num_heads, qk_scale, split_base, total_splits, num_splits,
    HEAD_DIM: tl.constexpr, NOPE: tl.constexpr, D_PAD: tl.constexpr,
    DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, NUM_TILES: tl.constexpr, TILE: tl.constexpr,
    A_FP8: tl.constexpr, A_RANGE: tl.constexpr,
    HAS_B: tl.constexpr, B_FP8: tl.constexpr, B_RANGE: tl.constexpr,
    HAS_SINK: tl.constexpr, WRITE_MAX: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, CPU_INTERP: tl.constexpr,
):
    """Grid ``(num_tokens, cdiv(num_heads, BLOCK_H), num_splits)``.

    Split ``s`` takes every num_splits-th chunk of each set. Without WRITE_PARTIAL it writes
    the final out / lse (/ max logits); with it, fp32 partials ``part_o [T, total_splits, H,
    D_PAD]`` and ``part_lse [T, total_splits, H]`` at split index ``split_base + s`` for
    ``_sparse_mla_combine_kernel`` (other passes, e.g. the prefill kernel, fill the rest).
    """
    t = tl.program_id(0)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    t64 = t.to(tl.int64)
    q = tl.load(q_ptr + t64 * stride_q_t + tl.where(h_ok, h, 0)[:, None] * stride_q_h + tl.where(d_ok, d, 0)[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D_PAD), tl.float32)
    jn = tl.arange(0, BLOCK_N)

    a_len = tl.minimum(tl.load(a_len_ptr + t), a_width)  # indices form: never past the row
    a_req = 0
    a_start = 0
    if A_RANGE:
        a_req = tl.load(a_req_ptr + t)
        a_start = tl.load(a_start_ptr + t)
    for c in range(split, tl.cdiv(a_len, BLOCK_N), num_splits):
        blk, off, valid = _candidate_slots(t, c * BLOCK_N + jn, a_idx_ptr, a_stride_idx, a_len, a_bt_ptr, a_stride_bt,
                                           a_max_blocks, a_req, a_start, a_block_size, a_capacity, A_RANGE)
        k = _load_k(a_cache_ptr, blk, off, valid, a_stride_blk, a_stride_entry, a_block_size, A_FP8, HEAD_DIM, NOPE,
                    D_PAD, DATA_BYTES, SCALE_BYTES, NUM_TILES, TILE, BLOCK_N)
        m_i, l_i, acc = _online_update(q, k, valid[None, :], m_i, l_i, acc, qk_scale, CPU_INTERP)
    if HAS_B:
        b_len = tl.minimum(tl.load(b_len_ptr + t), b_width)
        b_req = 0
        b_start = 0
        if B_RANGE:
            b_req = tl.load(b_req_ptr + t)
            b_start = tl.load(b_start_ptr + t)
        for c in range(split, tl.cdiv(b_len, BLOCK_N), num_splits):
            blk, off, valid = _candidate_slots(t, c * BLOCK_N + jn, b_idx_ptr, b_stride_idx, b_len, b_bt_ptr,
                                               b_stride_bt, b_max_blocks, b_req, b_start, b_block_size, b_capacity,
                                               B_RANGE)
            k = _load_k(b_cache_ptr, blk, off, valid, b_stride_blk, b_stride_entry, b_block_size, B_FP8, HEAD_DIM,
                        NOPE, D_PAD, DATA_BYTES, SCALE_BYTES, NUM_TILES, TILE, BLOCK_N)
            m_i, l_i, acc = _online_update(q, k, valid[None, :], m_i, l_i, acc, qk_scale, CPU_INTERP)

    hc = tl.where(h_ok, h, 0)
    _finish(acc, m_i, l_i, h_ok, t64 * stride_o_t + hc * stride_o_h, t64 * stride_lse_t + hc,
            t64 * stride_max_t + hc, (t64 * total_splits + split_base + split) * num_heads + hc,
            sink_ptr + hc, out_ptr, lse_ptr, max_ptr, part_o_ptr, part_lse_ptr, d, d_ok,
            HAS_SINK, WRITE_MAX, WRITE_PARTIAL, D_PAD, CPU_INTERP)


@triton.jit
def _sparse_mla_combine_kernel(
    part_o_ptr, part_lse_ptr, sink_ptr,
    out_ptr, stride_o_t, stride_o_h,
    lse_ptr, stride_lse_t,
    num_heads, num_splits,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, HAS_SINK: tl.constexpr,
    BLOCK_H: tl.constexpr, CPU_INTERP: tl.constexpr,
):
    """Grid ``(num_tokens, cdiv(num_heads, BLOCK_H))``: merge split partials, apply the sink."""
    t = tl.program_id(0)
    pid_h = tl.program_id(1)
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    hc = tl.where(h_ok, h, 0)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    t64 = t.to(tl.int64)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    for s in range(num_splits):
        ls = tl.load(part_lse_ptr + (t64 * num_splits + s) * num_heads + hc, mask=h_ok, other=float("-inf"))
        m = tl.maximum(m, ls)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros((BLOCK_H,), tl.float32)
    o = tl.zeros((BLOCK_H, D_PAD), tl.float32)
    for s in range(num_splits):
        row = (t64 * num_splits + s) * num_heads + hc
        ls = tl.load(part_lse_ptr + row, mask=h_ok, other=float("-inf"))
        w = tl.exp2(ls - m_safe)  # 0 for empty splits
        po = tl.load(part_o_ptr + row[:, None] * D_PAD + d[None, :], mask=h_ok[:, None] & (w > 0.0)[:, None],
                     other=0.0)
        o += po * w[:, None]
        den += w
    empty = den == 0.0
    o = o / tl.where(empty, 1.0, den)[:, None]
    lse = tl.where(empty, float("inf"), (m_safe + tl.log2(tl.where(empty, 1.0, den))) * LN2)
    if HAS_SINK:
        sink = tl.load(sink_ptr + hc, mask=h_ok, other=float("-inf"))
        o = o * (1.0 / (1.0 + tl.exp(sink - tl.where(empty, 0.0, lse))))[:, None]
    o = tl.where(empty[:, None], 0.0, o)
    tl.store(out_ptr + t64 * stride_o_t + hc[:, None] * stride_o_h + tl.where(d_ok, d, 0)[None, :],
             _to_bf16(o, CPU_INTERP), mask=h_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + t64 * stride_lse_t + hc, lse, mask=h_ok)
