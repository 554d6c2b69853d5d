"""Triton kernels of the sparse MLA attention with attention sink over paged caches.

One program owns one query token, a tile of ``BLOCK_H`` heads and (with split-KV) every
``num_splits``-th chunk of ``BLOCK_N`` candidates of each set. The head dim is cut into up to
four power-of-two *parts* that follow the page layout: NoPE dims ``[0, P0)``, ``[P0, P0+P1)``,
``[P0+P1, NOPE)`` (e.g. 448 = 256 + 128 + 64) and the tail ``[NOPE, HEAD_DIM)`` (the RoPE dims,
padded to ``R``). q, the dequantised candidates and the accumulators are separate tensors per
part, so no 512-wide tile is ever built by join/reshape: a chunk's logits are the sum of the
parts' dots and each part's accumulator gets its own ``P @ K_part`` (bf16 in, fp32 accumulate),
under an online softmax in base 2 shared by both sets. Pages are read and decoded by the
helpers of :mod:`dsv4attn.kernels.sparse_attn_gather`. All ``BLOCK_H`` heads of the program
share one dequantisation of each entry. A program reads only its own token's candidates
(masked lanes load zeros, -1 is never dereferenced), so NaN in other pages never reaches it.

Variants (constexprs, measured on the H200 and off by default, see docs/design.md):
``PREFETCH`` software-pipelines the gather one chunk ahead; ``V_MASK`` keeps only some of the
accumulators, so that the 512-wide d_v can be split across two launches.

Geometry constexprs (host: ``dsv4attn.ops.sparse_attn_launch.geometry``): ``P0, P1, P2`` NoPE part
widths (0 = unused) and ``Z0, Z1, Z2`` their tensor widths (= P, or 16 when unused); ``TAIL``
= HEAD_DIM - NOPE (0 = none) and ``R`` its padded width (>= 16).
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4attn.kernels.sparse_attn_gather import _candidate_slots, _clip_range, _decode_nope, _load_raw, _sanitize

#: log2(e) (host side: folded into the softmax scale) and ln(2) (kernel side; a constexpr, as
#: compiled Triton only reads constexpr globals): the online softmax runs in base 2.
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)


# ``CPU_INTERP`` (true only for CPU tensors, i.e. under Triton's interpreter) works around two
# interpreter defects seen in Triton 3.9: ``tl.dot`` of bf16 operands returns garbage, and the
# fp32 -> bf16 cast truncates instead of rounding to nearest-even. Compiled GPU code takes the
# native paths.


@triton.jit
def _dot(a, b, acc, CPU_INTERP: tl.constexpr):
    """``acc + a @ b`` of bf16 operands with fp32 accumulation (interpreter: widened to fp32
    first, exact since the operands are bf16 values)."""
    if CPU_INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _to_bf16(x, CPU_INTERP: tl.constexpr):
    """fp32 -> bf16 rounded to nearest-even (interpreter: by integer bit operations)."""
    if CPU_INTERP:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _load_q_part(q_ptr, row_off, row_ok, D0: tl.constexpr, P: tl.constexpr, Z: tl.constexpr,
                 CPU_INTERP: tl.constexpr):
    """q dims ``D0 .. D0+P-1`` of the rows -> ``[rows, Z]`` bf16 (zeros past P; fp32 q is
    rounded to bf16 for the tensor cores)."""
    dd = tl.arange(0, Z)
    if P == Z:
        x = tl.load(q_ptr + row_off[:, None] + D0 + dd[None, :], mask=row_ok[:, None], other=0.0)
    else:
        ok = dd < P
        x = tl.load(q_ptr + row_off[:, None] + D0 + tl.where(ok, dd, 0)[None, :], mask=row_ok[:, None] & ok[None, :],
                    other=0.0)
    return _to_bf16(x.to(tl.float32), CPU_INTERP)


@triton.jit
def _attend_chunk(
    q0, q1, q2, q3, a0, a1, a2, a3, m_i, l_i, mask,
    cache_ptr, blk, off, valid, stride_blk, stride_entry, block_size, qk_scale,
    IS_FP8: tl.constexpr, NOPE: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
    TAIL: tl.constexpr, R: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, LAZY: tl.constexpr, CPU_INTERP: tl.constexpr,
    V_MASK: tl.constexpr = 15, SANITIZE: tl.constexpr = False,
):
    """Gather + dequantise one chunk of candidates (``blk``, ``off``, ``valid`` ``[BLOCK_N]``)
    and run one step of the online softmax (see :func:`_attend_raw`)."""
    r0, r1, r2, r3, s_lo, s_hi = _load_raw(cache_ptr, blk, off, valid, stride_blk, stride_entry, block_size,
                                           IS_FP8, NOPE, P0, P1, P2, TAIL, R, DATA_BYTES, SCALE_BYTES)
    return _attend_raw(q0, q1, q2, q3, a0, a1, a2, a3, m_i, l_i, mask, r0, r1, r2, r3, s_lo, s_hi, qk_scale,
                       IS_FP8, P0, P1, P2, TAIL, ROWS, BLOCK_N, LAZY, CPU_INTERP, V_MASK, SANITIZE)


@triton.jit
def _attend_raw(
    q0, q1, q2, q3, a0, a1, a2, a3, m_i, l_i, mask, r0, r1, r2, r3, s_lo, s_hi, qk_scale,
    IS_FP8: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, TAIL: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, LAZY: tl.constexpr, CPU_INTERP: tl.constexpr,
    V_MASK: tl.constexpr, SANITIZE: tl.constexpr = False,
):
    """Decode one chunk's raw values (from :func:`_load_raw`) and run one step of the base-2
    online softmax for ``ROWS`` query rows (``mask`` broadcasts to ``[ROWS, BLOCK_N]``).
    Returns the updated (a0, a1, a2, a3, m_i, l_i); only the accumulators whose bit is set in
    ``V_MASK`` (1: a0, 2: a1, 4: a2, 8: a3) are updated (d_v split across programs). With
    LAZY, m_i is a lower bound of the running max within 8 (log2 units), not the max itself.

    SANITIZE (tiles whose entries are candidates of some rows only, i.e. shared prefill
    gathers): non-finite values are zeroed before the MMAs, so a NaN entry cannot reach rows
    it is no candidate of through ``0 * NaN``; the extra last return value ``bad [BLOCK_N]``
    (int32) marks the entries that held one, for the caller to poison the rows they belong
    to. Without SANITIZE it is all zeros."""
    s = tl.zeros((ROWS, BLOCK_N), tl.float32)
    bad = tl.zeros((BLOCK_N,), tl.int32)
    if P0 > 0:
        k0 = _decode_nope(r0, s_lo, s_hi, 0, P0, IS_FP8)
        if SANITIZE:
            k0, bad = _sanitize(k0, bad)
        s = _dot(q0, tl.trans(k0), s, CPU_INTERP)
    if P1 > 0:
        k1 = _decode_nope(r1, s_lo, s_hi, P0, P1, IS_FP8)
        if SANITIZE:
            k1, bad = _sanitize(k1, bad)
        s = _dot(q1, tl.trans(k1), s, CPU_INTERP)
    if P2 > 0:
        k2 = _decode_nope(r2, s_lo, s_hi, P0 + P1, P2, IS_FP8)
        if SANITIZE:
            k2, bad = _sanitize(k2, bad)
        s = _dot(q2, tl.trans(k2), s, CPU_INTERP)
    if TAIL > 0:
        k3 = r3.to(tl.bfloat16)
        if SANITIZE:
            k3, bad = _sanitize(k3, bad)
        s = _dot(q3, tl.trans(k3), s, CPU_INTERP)
    s = tl.where(mask, s * qk_scale, float("-inf"))  # log2 units
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.full((ROWS,), 1.0, tl.float32)
    if LAZY:
        # Rescale only when some row's max grew by more than 2^8 (then every row moves to its
        # new max); otherwise keep the stale max, so p <= 2^8 (fine for bf16 p and fp32 sums).
        # m_i is then not the running max, but lse = m_i + log2(l_i) stays exact.
        grow = tl.max(tl.where(m_new > m_i, m_new - m_i, 0.0), axis=0)
        if grow > 8.0:
            alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
        else:
            m_new = m_i
    else:
        alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pb = _to_bf16(p, CPU_INTERP)
    if P0 > 0 and (V_MASK & 1) != 0:
        a0 = _dot(pb, k0, a0 * alpha[:, None], CPU_INTERP)
    if P1 > 0 and (V_MASK & 2) != 0:
        a1 = _dot(pb, k1, a1 * alpha[:, None], CPU_INTERP)
    if P2 > 0 and (V_MASK & 4) != 0:
        a2 = _dot(pb, k2, a2 * alpha[:, None], CPU_INTERP)
    if TAIL > 0 and (V_MASK & 8) != 0:
        a3 = _dot(pb, k3, a3 * alpha[:, None], CPU_INTERP)
    return a0, a1, a2, a3, m_new, l_i, bad


@triton.jit
def _store_part(ptr, row_off, row_ok, x, D0: tl.constexpr, P: tl.constexpr, Z: tl.constexpr,
                TO_BF16: tl.constexpr, CPU_INTERP: tl.constexpr):
    """Store ``x [rows, Z]`` (columns < P) at ``ptr + row_off + D0 + col``."""
    dd = tl.arange(0, Z)
    if TO_BF16:
        x = _to_bf16(x, CPU_INTERP)
    if P == Z:
        tl.store(ptr + row_off[:, None] + D0 + dd[None, :], x, mask=row_ok[:, None])
    else:
        ok = dd < P
        tl.store(ptr + row_off[:, None] + D0 + tl.where(ok, dd, 0)[None, :], x, mask=row_ok[:, None] & ok[None, :])


@triton.jit
def _store_parts(ptr, off, row_ok, a0, a1, a2, a3, f,
                 NOPE: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                 Z0: tl.constexpr, Z1: tl.constexpr, Z2: tl.constexpr, TAIL: tl.constexpr, R: tl.constexpr,
                 TO_BF16: tl.constexpr, CPU_INTERP: tl.constexpr, V_MASK: tl.constexpr = 15):
    """Store the parts' accumulators (those in ``V_MASK``) times the row factor ``f`` at
    ``ptr + off[row] + dim``."""
    if P0 > 0 and (V_MASK & 1) != 0:
        _store_part(ptr, off, row_ok, a0 * f[:, None], 0, P0, Z0, TO_BF16, CPU_INTERP)
    if P1 > 0 and (V_MASK & 2) != 0:
        _store_part(ptr, off, row_ok, a1 * f[:, None], P0, P1, Z1, TO_BF16, CPU_INTERP)
    if P2 > 0 and (V_MASK & 4) != 0:
        _store_part(ptr, off, row_ok, a2 * f[:, None], P0 + P1, P2, Z2, TO_BF16, CPU_INTERP)
    if TAIL > 0 and (V_MASK & 8) != 0:
        _store_part(ptr, off, row_ok, a3 * f[:, None], NOPE, TAIL, R, TO_BF16, CPU_INTERP)


@triton.jit
def _finish(a0, a1, a2, a3, m_i, l_i, row_ok, o_off, lse_off, max_off, part_row, sink_ptrs,
            out_ptr, lse_ptr, max_ptr, part_o_ptr, part_lse_ptr,
            HEAD_DIM: tl.constexpr, NOPE: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
            Z0: tl.constexpr, Z1: tl.constexpr, Z2: tl.constexpr, TAIL: tl.constexpr, R: tl.constexpr,
            HAS_SINK: tl.constexpr, WRITE_MAX: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
            OUT_BF16: tl.constexpr, CPU_INTERP: tl.constexpr, V_MASK: tl.constexpr = 15):
    """Normalise and write one tile of rows (a row = one (token, head); offsets are int64).

    Final: out (bf16 with OUT_BF16, else fp32; sink applied, 0 for empty rows), lse natural
    log (+inf when empty), max logits (optional). Partial: fp32 normalised out at ``part_row *
    HEAD_DIM`` and base-2 lse (-inf when empty) for ``_sparse_mla_combine_kernel``. Only the
    parts in ``V_MASK`` are written; lse / max only by the program that owns part 0.
    """
    OWNS_LSE: tl.constexpr = (V_MASK & 1) != 0
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))  # base 2
    if WRITE_PARTIAL:
        if OWNS_LSE:
            tl.store(part_lse_ptr + part_row, lse2, mask=row_ok)
        _store_parts(part_o_ptr, part_row * HEAD_DIM, row_ok, a0, a1, a2, a3, 1.0 / l_safe,
                     NOPE, P0, P1, P2, Z0, Z1, Z2, TAIL, R, False, CPU_INTERP, V_MASK)
    else:
        lse = tl.where(empty, float("inf"), lse2 * LN2)
        f = 1.0 / l_safe
        if HAS_SINK:
            sink = tl.load(sink_ptrs, mask=row_ok, other=float("-inf"))
            f = f / (1.0 + tl.exp(sink - tl.where(empty, 0.0, lse)))
        f = tl.where(empty, 0.0, f)
        if OWNS_LSE:
            tl.store(lse_ptr + lse_off, lse, mask=row_ok)
            if WRITE_MAX:
                tl.store(max_ptr + max_off, m_i * LN2, mask=row_ok)
        _store_parts(out_ptr, o_off, row_ok, a0, a1, a2, a3, f, NOPE, P0, P1, P2, Z0, Z1, Z2, TAIL, R,
                     OUT_BF16, CPU_INTERP, V_MASK)


@triton.jit
def _set_pass(
    t, split, num_splits, q0, q1, q2, q3, a0, a1, a2, a3, m_i, l_i,
    cache_ptr, stride_blk, stride_entry, block_size, capacity,
    idx_ptr, stride_idx, width, len_ptr, bt_ptr, stride_bt, max_blocks, num_reqs, req_ptr, start_ptr, qk_scale,
    IS_FP8: tl.constexpr, IS_RANGE: tl.constexpr, NOPE: tl.constexpr,
    P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, TAIL: tl.constexpr, R: tl.constexpr,
    DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, LAZY: tl.constexpr, CPU_INTERP: tl.constexpr,
    V_MASK: tl.constexpr, PREFETCH: tl.constexpr, HAS_LEN: tl.constexpr,
):
    """Attend token ``t``'s head tile to chunks ``split, split + num_splits, ...`` of one set.

    PREFETCH software-pipelines the gather: while chunk c is decoded and multiplied, the page
    loads of chunk c+1 (whose slots were read one iteration earlier) and the slot reads of
    chunk c+2 are already in flight, so neither dependent latency (slot -> bytes) stalls the
    MMAs. Chunks past the end are fully masked (no memory is touched for them)."""
    if HAS_LEN:
        length = tl.minimum(tl.load(len_ptr + t), width)  # indices form: never past the row
    else:
        length = t * 0 + width  # no lengths (indices form): whole rows, len_ptr unused
    req = 0
    start = 0
    if IS_RANGE:
        req = tl.load(req_ptr + t)
        start, length = _clip_range(tl.load(start_ptr + t), length, req, num_reqs, max_blocks * block_size)
    jn = tl.arange(0, BLOCK_N)
    if PREFETCH:
        step = num_splits * BLOCK_N
        blk, off, valid = _candidate_slots(t, split * BLOCK_N + jn, idx_ptr, stride_idx, length, bt_ptr, stride_bt,
                                           max_blocks, req, start, block_size, capacity, IS_RANGE)
        r0, r1, r2, r3, s_lo, s_hi = _load_raw(cache_ptr, blk, off, valid, stride_blk, stride_entry, block_size,
                                               IS_FP8, NOPE, P0, P1, P2, TAIL, R, DATA_BYTES, SCALE_BYTES)
        nblk, noff, nvalid = _candidate_slots(t, split * BLOCK_N + step + jn, idx_ptr, stride_idx, length, bt_ptr,
                                              stride_bt, max_blocks, req, start, block_size, capacity, IS_RANGE)
        for c in range(split, tl.cdiv(length, BLOCK_N), num_splits):
            n0, n1, n2, n3, ns_lo, ns_hi = _load_raw(cache_ptr, nblk, noff, nvalid, stride_blk, stride_entry,
                                                     block_size, IS_FP8, NOPE, P0, P1, P2, TAIL, R, DATA_BYTES,
                                                     SCALE_BYTES)
            b2, o2, v2 = _candidate_slots(t, c * BLOCK_N + 2 * step + jn, idx_ptr, stride_idx, length, bt_ptr,
                                          stride_bt, max_blocks, req, start, block_size, capacity, IS_RANGE)
            a0, a1, a2, a3, m_i, l_i, _ = _attend_raw(
                q0, q1, q2, q3, a0, a1, a2, a3, m_i, l_i, valid[None, :], r0, r1, r2, r3, s_lo, s_hi, qk_scale,
                IS_FP8, P0, P1, P2, TAIL, BLOCK_H, BLOCK_N, LAZY, CPU_INTERP, V_MASK)
            r0, r1, r2, r3, s_lo, s_hi, valid = n0, n1, n2, n3, ns_lo, ns_hi, nvalid
            nblk, noff, nvalid = b2, o2, v2
    else:
        for c in range(split, tl.cdiv(length, BLOCK_N), num_splits):
            blk, off, valid = _candidate_slots(t, c * BLOCK_N + jn, idx_ptr, stride_idx, length, bt_ptr, stride_bt,
                                               max_blocks, req, start, block_size, capacity, IS_RANGE)
            a0, a1, a2, a3, m_i, l_i, _ = _attend_chunk(
                q0, q1, q2, q3, a0, a1, a2, a3, m_i, l_i, valid[None, :],
                cache_ptr, blk, off, valid, stride_blk, stride_entry, block_size, qk_scale,
                IS_FP8, NOPE, P0, P1, P2, TAIL, R, DATA_BYTES, SCALE_BYTES, BLOCK_H, BLOCK_N, LAZY, CPU_INTERP,
                V_MASK)
    return a0, a1, a2, a3, m_i, l_i


@triton.jit
def _sparse_mla_attn_kernel(
    q_ptr, stride_q_t, stride_q_h,
    out_ptr, stride_o_t, stride_o_h,
    lse_ptr, stride_lse_t,
    max_ptr, stride_max_t,
    part_o_ptr, part_lse_ptr,
    sink_ptr,
    a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity,
    a_idx_ptr, a_stride_idx, a_width, a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
    b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity,
    b_idx_ptr, b_stride_idx, b_width, b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
    num_heads, qk_scale, split_base, total_splits, num_splits,
    HEAD_DIM: tl.constexpr, NOPE: tl.constexpr,
    P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, Z0: tl.constexpr, Z1: tl.constexpr, Z2: tl.constexpr,
    TAIL: tl.constexpr, R: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
    A_FP8: tl.constexpr, A_RANGE: tl.constexpr,
    HAS_B: tl.constexpr, B_FP8: tl.constexpr, B_RANGE: tl.constexpr,
    HAS_SINK: tl.constexpr, WRITE_MAX: tl.constexpr, WRITE_PARTIAL: tl.constexpr, OUT_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, LAZY: tl.constexpr, CPU_INTERP: tl.constexpr,
    V_MASK: tl.constexpr = 15, PREFETCH: tl.constexpr = False, A_LEN: tl.constexpr = True, B_LEN: tl.constexpr = True,
):
    """Grid ``(num_tokens * cdiv(num_heads, BLOCK_H), num_splits)``, head tiles fastest: the
    tiles of one token run together, so the second tile's gathers hit L2 (h = 128).

    Split ``s`` takes every num_splits-th chunk of each set. Without WRITE_PARTIAL it writes
    the final out / lse (/ max logits); with it, fp32 partials ``part_o [T, total_splits, H,
    HEAD_DIM]`` and ``part_lse [T, total_splits, H]`` at split index ``split_base + s`` for
    ``_sparse_mla_combine_kernel`` (other passes, e.g. the prefill kernel, fill the rest).
    LAZY (not with WRITE_MAX): online-softmax rescaling only when a max grows by > 2^8.
    A_LEN / B_LEN False: that (indices-form) set has no lengths vector, every row is whole.
    """
    tiles = tl.cdiv(num_heads, BLOCK_H)
    t = tl.program_id(0) // tiles
    pid_h = tl.program_id(0) % tiles
    split = tl.program_id(1)
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    hc = tl.where(h_ok, h, 0)
    t64 = t.to(tl.int64)
    q_off = t64 * stride_q_t + hc * stride_q_h
    q0 = _load_q_part(q_ptr, q_off, h_ok, 0, P0, Z0, CPU_INTERP)
    q1 = _load_q_part(q_ptr, q_off, h_ok, P0, P1, Z1, CPU_INTERP)
    q2 = _load_q_part(q_ptr, q_off, h_ok, P0 + P1, P2, Z2, CPU_INTERP)
    q3 = _load_q_part(q_ptr, q_off, h_ok, NOPE, TAIL, R, CPU_INTERP)
    a0 = tl.zeros((BLOCK_H, Z0), tl.float32)
    a1 = tl.zeros((BLOCK_H, Z1), tl.float32)
    a2 = tl.zeros((BLOCK_H, Z2), tl.float32)
    a3 = tl.zeros((BLOCK_H, R), tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    a0, a1, a2, a3, m_i, l_i = _set_pass(
        t, split, num_splits, q0, q1, q2, q3, a0, a1, a2, a3, m_i, l_i,
        a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity,
        a_idx_ptr, a_stride_idx, a_width, a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
        qk_scale, A_FP8, A_RANGE, NOPE, P0, P1, P2, TAIL, R, DATA_BYTES, SCALE_BYTES, BLOCK_H, BLOCK_N, LAZY, CPU_INTERP,
        V_MASK, PREFETCH, A_LEN)
    if HAS_B:
        a0, a1, a2, a3, m_i, l_i = _set_pass(
            t, split, num_splits, q0, q1, q2, q3, a0, a1, a2, a3, m_i, l_i,
            b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity,
            b_idx_ptr, b_stride_idx, b_width, b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
            qk_scale, B_FP8, B_RANGE, NOPE, P0, P1, P2, TAIL, R, DATA_BYTES, SCALE_BYTES, BLOCK_H, BLOCK_N, LAZY, CPU_INTERP,
            V_MASK, PREFETCH, B_LEN)
    _finish(a0, a1, a2, a3, m_i, l_i, h_ok, t64 * stride_o_t + hc * stride_o_h, t64 * stride_lse_t + hc,
            t64 * stride_max_t + hc, (t64 * total_splits + split_base + split) * num_heads + hc,
            sink_ptr + hc, out_ptr, lse_ptr, max_ptr, part_o_ptr, part_lse_ptr,
            HEAD_DIM, NOPE, P0, P1, P2, Z0, Z1, Z2, TAIL, R, HAS_SINK, WRITE_MAX, WRITE_PARTIAL, OUT_BF16,
            CPU_INTERP, V_MASK)


@triton.jit
def _sparse_mla_combine_kernel(
    part_o_ptr, part_lse_ptr, sink_ptr,
    out_ptr, stride_o_t, stride_o_h,
    lse_ptr, stride_lse_t,
    num_heads, num_splits,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, HAS_SINK: tl.constexpr, OUT_BF16: tl.constexpr,
    S_PAD: tl.constexpr, CPU_INTERP: tl.constexpr,
):
    """Grid ``(num_tokens, num_heads)``: merge one row's split partials (all ``num_splits <=
    S_PAD`` of them loaded at once: one memory round trip per program, not one per split),
    apply the sink."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, S_PAD)
    s_ok = sp < num_splits
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    t64 = t.to(tl.int64)
    row = (t64 * num_splits + sp) * num_heads + h
    ls = tl.load(part_lse_ptr + row, mask=s_ok, other=float("-inf"))
    m = tl.max(ls, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(ls - m_safe)  # 0 for empty splits (their partial rows are never read)
    po = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=(w > 0.0)[:, None] & d_ok[None, :],
                 other=0.0)
    den = tl.sum(w, axis=0)
    empty = den == 0.0
    o = tl.sum(po * w[:, None], axis=0) / tl.where(empty, 1.0, den)
    lse = tl.where(empty, float("inf"), (m_safe + tl.log2(tl.where(empty, 1.0, den))) * LN2)
    if HAS_SINK:
        sink = tl.load(sink_ptr + h)
        o = o * (1.0 / (1.0 + tl.exp(sink - tl.where(empty, 0.0, lse))))
    o = tl.where(empty, 0.0, o)
    if OUT_BF16:
        o = _to_bf16(o, CPU_INTERP)
    tl.store(out_ptr + t64 * stride_o_t + h * stride_o_h + d, o, mask=d_ok)
    tl.store(lse_ptr + t64 * stride_lse_t + h, lse)
