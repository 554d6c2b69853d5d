"""Triton prefill kernel for range-form candidate sets: one gather serves BLOCK_M tokens.

Consecutive query tokens of one request see overlapping ranges (SWA windows slide by one
entry; C128A is a dense prefix), so a program owns ``BLOCK_M`` consecutive tokens x
``BLOCK_H`` heads as the rows of one tile, loads the union range of their entries once per
chunk (dequantised once) and masks per row, like sliding-window flash attention. Rows whose
tokens belong to different requests are handled one request after another (each row exactly
once), so any token order is correct; sorted prefill batches take one pass. Indices-form sets
(per-token top-k) are not shared; the op runs them through the per-token kernel and merges.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4attn.kernels.sparse_attn import _attend_chunk, _finish, _load_q_part
from dsv4attn.kernels.sparse_attn_gather import _clip_range

#: Larger than any entry position (int32); constexpr because compiled Triton reads only those.
_BIG = tl.constexpr(2147483647)


@triton.jit
def _shared_range_pass(
    q0, q1, q2, q3, a0, a1, a2, a3, m_i, l_i, tok, row_ok, t0, num_tokens,
    cache_ptr, stride_blk, stride_entry, block_size, capacity,
    len_ptr, bt_ptr, stride_bt, max_blocks, num_reqs, req_ptr, start_ptr, qk_scale,
    IS_FP8: tl.constexpr, NOPE: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
    TAIL: tl.constexpr, R: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CPU_INTERP: tl.constexpr,
):
    """Attend the rows ``tok`` (one token per row) to their ranges of one range-form set.

    Each row's range is clipped to its block-table row (:func:`_clip_range`); entries of the
    union that are no candidate of a row only meet it through zero probabilities on sanitized
    values, and a row one of whose own candidates holds a non-finite value gets NaN ``l_i``
    (out and lse NaN, as the reference gives)."""
    r_len = tl.load(len_ptr + tok, mask=row_ok, other=0)
    r_req = tl.load(req_ptr + tok, mask=row_ok, other=-1)
    r_start, r_len = _clip_range(tl.load(start_ptr + tok, mask=row_ok, other=0), tl.where(row_ok, r_len, 0), r_req,
                                 num_reqs, max_blocks * block_size)
    r_end = r_start + r_len
    done = (r_len <= 0).to(tl.int32)
    row_bad = tl.zeros((ROWS,), tl.int32)
    jn = tl.arange(0, BLOCK_N)
    for i in range(BLOCK_M):
        req = tl.load(req_ptr + tl.minimum(t0 + i, num_tokens - 1))
        rows = (r_req == req) & (done == 0)  # rows of this request not handled yet
        if tl.max(rows.to(tl.int32), axis=0) > 0:
            lo = tl.maximum(tl.min(tl.where(rows, r_start, _BIG), axis=0), 0)
            hi = tl.max(tl.where(rows, r_end, 0), axis=0)
            for c in range(0, tl.cdiv(hi - lo, BLOCK_N)):
                e = lo + c * BLOCK_N + jn
                ok = e < hi
                col = e // block_size
                ok = ok & (col < max_blocks)
                blk = tl.load(bt_ptr + req.to(tl.int64) * stride_bt + tl.where(ok, col, 0), mask=ok, other=-1)
                ok = ok & (blk >= 0)
                slot = blk.to(tl.int64) * block_size + e % block_size
                ok = ok & (slot < capacity)
                slot = tl.where(ok, slot, 0)
                mask = (rows[:, None] & ok[None, :] & (e[None, :] >= r_start[:, None])
                        & (e[None, :] < r_end[:, None]))
                a0, a1, a2, a3, m_i, l_i, bad = _attend_chunk(
                    q0, q1, q2, q3, a0, a1, a2, a3, m_i, l_i, mask,
                    cache_ptr, slot // block_size, slot % block_size, ok, stride_blk, stride_entry, block_size,
                    qk_scale, IS_FP8, NOPE, P0, P1, P2, TAIL, R, DATA_BYTES, SCALE_BYTES, ROWS, BLOCK_N, False,
                    CPU_INTERP, 15, True)
                row_bad = row_bad | tl.max((mask & (bad[None, :] != 0)).to(tl.int32), axis=1)
            done = done | rows.to(tl.int32)
    l_i = tl.where(row_bad != 0, float("nan"), l_i)
    return a0, a1, a2, a3, m_i, l_i


@triton.jit
def _sparse_mla_prefill_kernel(
    q_ptr, stride_q_t, stride_q_h,
    out_ptr, stride_o_t, stride_o_h,
    lse_ptr, stride_lse_t,
    part_o_ptr, part_lse_ptr,
    sink_ptr,
    a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity,
    a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
    b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity,
    b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
    num_tokens, num_heads, qk_scale, split_base, total_splits,
    HEAD_DIM: tl.constexpr, NOPE: tl.constexpr,
    P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, Z0: tl.constexpr, Z1: tl.constexpr, Z2: tl.constexpr,
    TAIL: tl.constexpr, R: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
    A_FP8: tl.constexpr, HAS_B: tl.constexpr, B_FP8: tl.constexpr,
    HAS_SINK: tl.constexpr, WRITE_PARTIAL: tl.constexpr, OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, CPU_INTERP: tl.constexpr,
):
    """Grid ``(cdiv(num_tokens, BLOCK_M), cdiv(num_heads, BLOCK_H))``; rows = BLOCK_M tokens x
    BLOCK_H heads. Writes final outputs, or partials at split ``split_base`` (see _finish)."""
    ROWS: tl.constexpr = BLOCK_M * BLOCK_H
    t0 = tl.program_id(0) * BLOCK_M
    r = tl.arange(0, ROWS)
    tok = t0 + r // BLOCK_H
    head = tl.program_id(1) * BLOCK_H + r % BLOCK_H
    row_ok = (tok < num_tokens) & (head < num_heads)
    tok = tl.where(row_ok, tok, 0)
    head = tl.where(row_ok, head, 0)
    tok64 = tok.to(tl.int64)
    q_off = tok64 * stride_q_t + head * stride_q_h
    q0 = _load_q_part(q_ptr, q_off, row_ok, 0, P0, Z0, CPU_INTERP)
    q1 = _load_q_part(q_ptr, q_off, row_ok, P0, P1, Z1, CPU_INTERP)
    q2 = _load_q_part(q_ptr, q_off, row_ok, P0 + P1, P2, Z2, CPU_INTERP)
    q3 = _load_q_part(q_ptr, q_off, row_ok, NOPE, TAIL, R, CPU_INTERP)
    a0 = tl.zeros((ROWS, Z0), tl.float32)
    a1 = tl.zeros((ROWS, Z1), tl.float32)
    a2 = tl.zeros((ROWS, Z2), tl.float32)
    a3 = tl.zeros((ROWS, R), tl.float32)
    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    a0, a1, a2, a3, m_i, l_i = _shared_range_pass(
        q0, q1, q2, q3, a0, a1, a2, a3, m_i, l_i, tok, row_ok, t0, num_tokens,
        a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity,
        a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr, qk_scale,
        A_FP8, NOPE, P0, P1, P2, TAIL, R, DATA_BYTES, SCALE_BYTES, ROWS, BLOCK_M, BLOCK_N, CPU_INTERP)
    if HAS_B:
        a0, a1, a2, a3, m_i, l_i = _shared_range_pass(
            q0, q1, q2, q3, a0, a1, a2, a3, m_i, l_i, tok, row_ok, t0, num_tokens,
            b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity,
            b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr, qk_scale,
            B_FP8, NOPE, P0, P1, P2, TAIL, R, DATA_BYTES, SCALE_BYTES, ROWS, BLOCK_M, BLOCK_N, CPU_INTERP)
    _finish(a0, a1, a2, a3, m_i, l_i, row_ok, tok64 * stride_o_t + head * stride_o_h, tok64 * stride_lse_t + head,
            tok64 * stride_lse_t + head, (tok64 * total_splits + split_base) * num_heads + head,
            sink_ptr + head, out_ptr, lse_ptr, lse_ptr, part_o_ptr, part_lse_ptr,
            HEAD_DIM, NOPE, P0, P1, P2, Z0, Z1, Z2, TAIL, R, HAS_SINK, False, WRITE_PARTIAL, OUT_BF16, CPU_INTERP)
