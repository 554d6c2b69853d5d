"""Ping-pong Hopper (sm90) sparse MLA attention kernel in Gluon, for bf16 pages (prefill).

Same grid, arguments and outputs as the warp-specialised kernel
(:func:`dsv4attn.kernels.sparse_attn_sm90_ws._sparse_mla_attn_sm90_ws_kernel`) on bf16 pages,
i.e. the inputs of FlashMLA's ``flash_mla_sparse_fwd``. One CTA of 12 warps in three partitions
(docs/design.md, "Attention kernel"):

- the **producer** (4 warps) copies each 64-candidate chunk with ``cp.async`` straight into a K
  stage, in two column halves [64, 256] with a full / empty mbarrier each, so a half is refilled
  as soon as the last warpgroup that reads it is done. Chunk ``c`` goes to stage ``c % 2``;
  slot lookups run one pair of chunks ahead; invalid candidates are zero-filled, never read;
- the two **consumer warpgroups** take turns: warpgroup 0 computes ``S = q K^T`` and the
  softmax of the even chunks, warpgroup 1 of the odd ones, so both run the same amount of
  tensor-core work (in the warp-specialised kernel warpgroup 0 computes every S alone and is
  the bottleneck). Each warpgroup owns half of the output columns (warpgroup 0 columns 0-255,
  warpgroup 1 columns 256-511): it multiplies its own P from registers with its half of its own
  chunk, then the other warpgroup's P, read from shared memory, with its half of the other
  chunk. The row maxima are exchanged through shared memory (warpgroup 0 publishes the maximum
  after chunk 2j, warpgroup 1 the one after chunk 2j+1, which is the pair's running maximum),
  and warpgroup 0 rescales its P to that maximum before publishing it, so both accumulators
  and both partial row sums stay relative to one running maximum. At the end warpgroup 1
  publishes its row sums, warpgroup 0 the normalisation factors, and each writes its half.

fp8 pages keep the warp-specialised kernel: their producer needs 128 registers to dequantise,
which leaves too few for two consumers that each hold S, P and a [64, 256] accumulator.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

from dsv4attn.kernels.sparse_attn_gather import _candidate_entry, _candidate_place
from dsv4attn.kernels.sparse_attn_sm90 import BLOCK_H, BLOCK_N, HEAD_DIM, MMA_SMEM, VEC_SMEM, _async_load, _cta_barrier, _extent
from dsv4attn.kernels.sparse_attn_sm90_ws import (
    HALF_V, KB4_L, O4_L, P_A, Q4_L, ROW_O, S4_L, _chunk_rows, _n_mine, _n_total, _row_factors, _store_half_o,
)

#: Warps of the default partition (warpgroup 0); warpgroup 1 and the producer run on top with
#: these registers per thread (warpgroup 0 gets what is left of the register file).
NUM_WARPS = 4
WG1_REGS = gl.constexpr(208)
PRODUCER_WARPS = gl.constexpr(4)
PRODUCER_REGS = gl.constexpr(88)
ROW_S = gl.constexpr(gl.SliceLayout(1, S4_L))


@gluon.jit
def _entries(c, n_a, t, split, num_splits,
             a_idx_ptr, a_stride_idx, a_bt_ptr, a_stride_bt, a_max_blocks, a_block_size, a_start, a_length, a_req,
             b_idx_ptr, b_stride_idx, b_bt_ptr, b_stride_bt, b_max_blocks, b_block_size, b_start, b_length, b_req,
             A_RANGE: gl.constexpr, HAS_B: gl.constexpr, B_RANGE: gl.constexpr):
    """Slot-lookup reads of the split's chunk ``c`` over both sets (set A's ``n_a`` chunks first)."""
    if HAS_B:
        if c < n_a:
            x = _candidate_entry(t, _chunk_rows(c, split, num_splits), a_idx_ptr, a_stride_idx, a_length, a_bt_ptr,
                                 a_stride_bt, a_max_blocks, a_start, a_req, a_block_size, A_RANGE)
        else:
            x = _candidate_entry(t, _chunk_rows(c - n_a, split, num_splits), b_idx_ptr, b_stride_idx, b_length,
                                 b_bt_ptr, b_stride_bt, b_max_blocks, b_start, b_req, b_block_size, B_RANGE)
    else:
        x = _candidate_entry(t, _chunk_rows(c, split, num_splits), a_idx_ptr, a_stride_idx, a_length, a_bt_ptr,
                             a_stride_bt, a_max_blocks, a_start, a_req, a_block_size, A_RANGE)
    return x


@gluon.jit
def _rows(x, c, n_a, split, num_splits,
          a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity, a_start,
          b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity, b_start,
          A_RANGE: gl.constexpr, HAS_B: gl.constexpr, B_RANGE: gl.constexpr):
    """Row pointers and validity of chunk ``c`` from its slot-lookup reads ``x``."""
    if HAS_B:
        if c < n_a:
            blk, off, valid = _candidate_place(x, _chunk_rows(c, split, num_splits), a_start, a_block_size,
                                               a_capacity, A_RANGE)
            ptr = a_cache_ptr + blk * a_stride_blk + off * a_stride_entry
        else:
            blk, off, valid = _candidate_place(x, _chunk_rows(c - n_a, split, num_splits), b_start, b_block_size,
                                               b_capacity, B_RANGE)
            ptr = b_cache_ptr + blk * b_stride_blk + off * b_stride_entry
    else:
        blk, off, valid = _candidate_place(x, _chunk_rows(c, split, num_splits), a_start, a_block_size, a_capacity,
                                           A_RANGE)
        ptr = a_cache_ptr + blk * a_stride_blk + off * a_stride_entry
    return ptr, valid


@gluon.jit
def _copy_half(k_half, ptr, valid, col0, empty_bar, full_bar, phase, valid_buf, WITH_VALID: gl.constexpr):
    """Wait until half ``k_half`` [64, 256] of a stage is free, start its ``cp.async`` copy
    (columns ``col0 ..`` of the rows; invalid rows zero-filled) and make ``full_bar`` complete
    when the copies land: every thread's pending copies are counted on the barrier, then one
    arrive (barrier count 1) after the partition's barrier, which also publishes the chunk's
    validity vector (``WITH_VALID``: the stage's first half)."""
    mbarrier.wait(empty_bar, phase)
    d = col0 + gl.expand_dims(gl.arange(0, HALF_V, layout=gl.SliceLayout(0, KB4_L)), 0)
    _async_load(k_half, gl.expand_dims(ptr, 1) + d, mask=gl.expand_dims(valid, 1))
    cp.mbarrier_arrive(full_bar)
    if WITH_VALID:
        valid_buf.store(valid.to(gl.int8))
    _cta_barrier()
    mbarrier.arrive(full_bar)


@gluon.jit
def _producer(k_bufs, valid_bufs, kempty, kfull, t, split, num_splits,
              a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity,
              a_idx_ptr, a_stride_idx, a_width, a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs, a_req_ptr,
              a_start_ptr,
              b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity,
              b_idx_ptr, b_stride_idx, b_width, b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs, b_req_ptr,
              b_start_ptr,
              A_RANGE: gl.constexpr, A_LEN: gl.constexpr, HAS_B: gl.constexpr, B_RANGE: gl.constexpr,
              B_LEN: gl.constexpr):
    """Per pair of chunks (2j on stage 0, 2j+1 on stage 1): the halves in the order the
    consumers release them (chunk 2j's left half and chunk 2j+1's right half are released after
    the owners' own products, the other two after the partners')."""
    a_start, a_length, a_req = _extent(t, a_width, a_len_ptr, a_req_ptr, a_start_ptr, a_num_reqs, a_max_blocks,
                                       a_block_size, A_RANGE, A_LEN)
    n_a = _n_mine(a_length, split, num_splits)
    n = n_a
    b_start = a_start
    b_length = a_length
    b_req = a_req
    if HAS_B:
        b_start, b_length, b_req = _extent(t, b_width, b_len_ptr, b_req_ptr, b_start_ptr, b_num_reqs, b_max_blocks,
                                           b_block_size, B_RANGE, B_LEN)
        n += _n_mine(b_length, split, num_splits)
    x0 = _entries(0, n_a, t, split, num_splits,
                  a_idx_ptr, a_stride_idx, a_bt_ptr, a_stride_bt, a_max_blocks, a_block_size, a_start, a_length, a_req,
                  b_idx_ptr, b_stride_idx, b_bt_ptr, b_stride_bt, b_max_blocks, b_block_size, b_start, b_length, b_req,
                  A_RANGE, HAS_B, B_RANGE)
    x1 = _entries(1, n_a, t, split, num_splits,
                  a_idx_ptr, a_stride_idx, a_bt_ptr, a_stride_bt, a_max_blocks, a_block_size, a_start, a_length, a_req,
                  b_idx_ptr, b_stride_idx, b_bt_ptr, b_stride_bt, b_max_blocks, b_block_size, b_start, b_length, b_req,
                  A_RANGE, HAS_B, B_RANGE)
    for j in range(gl.cdiv(n, 2)):
        c = 2 * j
        ptr0, ok0 = _rows(x0, c, n_a, split, num_splits,
                          a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity, a_start,
                          b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity, b_start,
                          A_RANGE, HAS_B, B_RANGE)
        ptr1, ok1 = _rows(x1, c + 1, n_a, split, num_splits,
                          a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity, a_start,
                          b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity, b_start,
                          A_RANGE, HAS_B, B_RANGE)
        ok1 = ok1 & (c + 1 < n)
        x0 = _entries(c + 2, n_a, t, split, num_splits,
                      a_idx_ptr, a_stride_idx, a_bt_ptr, a_stride_bt, a_max_blocks, a_block_size, a_start, a_length,
                      a_req, b_idx_ptr, b_stride_idx, b_bt_ptr, b_stride_bt, b_max_blocks, b_block_size, b_start,
                      b_length, b_req, A_RANGE, HAS_B, B_RANGE)
        x1 = _entries(c + 3, n_a, t, split, num_splits,
                      a_idx_ptr, a_stride_idx, a_bt_ptr, a_stride_bt, a_max_blocks, a_block_size, a_start, a_length,
                      a_req, b_idx_ptr, b_stride_idx, b_bt_ptr, b_stride_bt, b_max_blocks, b_block_size, b_start,
                      b_length, b_req, A_RANGE, HAS_B, B_RANGE)
        ph = (j & 1) ^ 1  # a fresh barrier passes parity 1
        k0 = k_bufs.index(0)
        k1 = k_bufs.index(1)
        has1 = c + 1 < n
        _copy_half(k0.slice(0, HALF_V, dim=1), ptr0, ok0, 0, kempty.index(0), kfull.index(0), ph,
                   valid_bufs.index(0), True)
        if has1:
            _copy_half(k1.slice(HALF_V, HALF_V, dim=1), ptr1, ok1, HALF_V, kempty.index(3), kfull.index(3), ph,
                       valid_bufs.index(1), True)
        _copy_half(k0.slice(HALF_V, HALF_V, dim=1), ptr0, ok0, HALF_V, kempty.index(1), kfull.index(1), ph,
                   valid_bufs.index(0), False)
        if has1:
            _copy_half(k1.slice(0, HALF_V, dim=1), ptr1, ok1, 0, kempty.index(2), kfull.index(2), ph,
                       valid_bufs.index(1), False)


@gluon.jit
def _wait_k(bar, phase):
    """Wait for a K half; its rows were written by ``cp.async`` (generic proxy) and are read by
    wgmma (async proxy), hence the fence after the wait."""
    mbarrier.wait(bar, phase)
    fence_async_shared()


@gluon.jit
def _publish_done(bar):
    """Signal ``bar`` once the whole warpgroup's shared-memory stores are done (fenced for wgmma
    readers)."""
    fence_async_shared()
    _cta_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _publish(buf, x, bar):
    """Store ``x`` into shared ``buf`` and signal ``bar``."""
    buf.store(x)
    _publish_done(bar)


@gluon.jit
def _logits(q_smem, k, valid_buf, qk_scale):
    """Masked, scaled logits ``S = q K^T`` (base 2) of one chunk."""
    s = warpgroup_mma(q_smem, k.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S4_L), use_acc=False)
    ok = gl.expand_dims(valid_buf.load(gl.SliceLayout(0, S4_L)) != 0, 0)
    return gl.where(ok, s * qk_scale, float("-inf"))


@gluon.jit
def _consume(ME: gl.constexpr, n, o, m_i, l_i, q_smem, k_bufs, p_bufs, m_bufs, valid_bufs, kempty, kfull, bars,
             qk_scale):
    """Warpgroup ``ME``'s walk over the split's ``n`` chunks in pairs: its own chunk ``2j + ME``
    (stage ``ME``) and the partner's. Per pair: ``S`` of its own chunk and the row maxima
    exchanged with the partner (both then hold the pair's maximum, so each P is computed once,
    relative to it); its P published for the partner; ``O += P V`` over its output columns
    (``ME * 256 ..``) with its own P from registers, then with the partner's P from shared
    memory. ``bars``: q, m 0/1, P ready 0/1, P free 0/1, l, fin."""
    k_mine = k_bufs.index(ME)
    k_other = k_bufs.index(1 - ME)
    for j in range(gl.cdiv(n, 2)):
        ph = j & 1
        mine = 2 * j + ME < n
        other = 2 * j + 1 - ME < n
        s = gl.full([BLOCK_H, BLOCK_N], float("-inf"), gl.float32, S4_L)
        if mine:
            _wait_k(kfull.index(2 * ME), ph)
            _wait_k(kfull.index(2 * ME + 1), ph)
            s = _logits(q_smem, k_mine, valid_bufs.index(ME), qk_scale)
            _publish(m_bufs.index(ME), gl.max(s, axis=1), bars.index(1 + ME))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        if other:
            mbarrier.wait(bars.index(2 - ME), ph)
            m_new = gl.maximum(m_new, m_bufs.index(1 - ME).load(ROW_S))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        o = o * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
        l_i = l_i * alpha
        if mine:
            p = gl.exp2(s - gl.expand_dims(m_safe, 1))
            l_i = l_i + gl.sum(p, axis=1)
            p16 = p.to(gl.bfloat16)
            mbarrier.wait(bars.index(5 + ME), ph ^ 1)  # the partner is done with the previous one
            _publish(p_bufs.index(ME), p16, bars.index(3 + ME))
            o = warpgroup_mma(gl.convert_layout(p16, P_A), k_mine.slice(ME * HALF_V, HALF_V, dim=1), o)
            _cta_barrier()
            mbarrier.arrive(kempty.index(3 * ME))  # own chunk, own columns: done
        if other:
            mbarrier.wait(bars.index(4 - ME), ph)
            _wait_k(kfull.index(2 * (1 - ME) + ME), ph)
            o = warpgroup_mma(p_bufs.index(1 - ME), k_other.slice(ME * HALF_V, HALF_V, dim=1), o)
            _cta_barrier()
            mbarrier.arrive(bars.index(6 - ME))
            mbarrier.arrive(kempty.index(2 * (1 - ME) + ME))  # partner's chunk, own columns: done
        m_i = m_new
    return o, m_i, l_i


@gluon.jit
def _wg0(q_ptr, stride_q_t, stride_q_h, num_heads, t64, pid_h, q_smem, k_bufs, p_bufs, m_bufs, l_smem, f_smem,
         valid_bufs, kempty, kfull, bars, t, split, num_splits, qk_scale,
         out_ptr, stride_o_t, stride_o_h, lse_ptr, stride_lse_t, max_ptr, stride_max_t, part_o_ptr, part_lse_ptr,
         sink_ptr, split_base, total_splits,
         a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
         b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
         A_RANGE: gl.constexpr, A_LEN: gl.constexpr, HAS_B: gl.constexpr, B_RANGE: gl.constexpr, B_LEN: gl.constexpr,
         HAS_SINK: gl.constexpr, WRITE_PARTIAL: gl.constexpr, OUT_BF16: gl.constexpr, WRITE_MAX: gl.constexpr):
    """Warpgroup 0: loads q; the even chunks; output columns 0-255; the epilogue's row statistics
    (its row sums plus warpgroup 1's)."""
    n = _n_total(t, split, num_splits, a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr,
                 a_start_ptr, b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
                 A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN)
    dq = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, Q4_L))
    for r in gl.static_range(0, BLOCK_H, 8):
        hq = pid_h * BLOCK_H + r + gl.arange(0, 8, layout=gl.SliceLayout(1, Q4_L))
        hq_ok = hq < num_heads
        q = gl.load(q_ptr + t64 * stride_q_t + gl.expand_dims(gl.where(hq_ok, hq, 0) * stride_q_h, 1)
                    + gl.expand_dims(dq, 0), mask=gl.expand_dims(hq_ok, 1), other=0.0)
        q_smem.slice(r, 8, dim=0).store(q.to(gl.bfloat16))
    _publish_done(bars.index(0))
    o = gl.zeros([BLOCK_H, HALF_V], gl.float32, O4_L)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
    l_i = gl.zeros([BLOCK_H], gl.float32, ROW_S)
    o, m_i, l_i = _consume(0, n, o, m_i, l_i, q_smem, k_bufs, p_bufs, m_bufs, valid_bufs, kempty, kfull, bars,
                           qk_scale)
    mbarrier.wait(bars.index(7), 0)
    l_i = l_i + l_smem.load(ROW_S)
    f = _row_factors(m_i, l_i, t64, pid_h, split, num_heads, lse_ptr, stride_lse_t, max_ptr, stride_max_t,
                     part_lse_ptr, sink_ptr, split_base, total_splits, HAS_SINK, WRITE_PARTIAL, WRITE_MAX)
    _publish(f_smem, f, bars.index(8))
    _store_half_o(o, f, t64, pid_h, split, num_heads, 0, out_ptr, stride_o_t, stride_o_h, part_o_ptr,
                  split_base, total_splits, WRITE_PARTIAL, OUT_BF16)


@gluon.jit
def _wg1(q_smem, k_bufs, p_bufs, m_bufs, l_smem, f_smem, valid_bufs, kempty, kfull, bars, t64, pid_h, t, split,
         num_splits, num_heads, qk_scale, out_ptr, stride_o_t, stride_o_h, part_o_ptr, split_base, total_splits,
         a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
         b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
         A_RANGE: gl.constexpr, A_LEN: gl.constexpr, HAS_B: gl.constexpr, B_RANGE: gl.constexpr, B_LEN: gl.constexpr,
         WRITE_PARTIAL: gl.constexpr, OUT_BF16: gl.constexpr):
    """Warpgroup 1: the odd chunks; output columns 256-511; its row sums for the epilogue."""
    n = _n_total(t, split, num_splits, a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr,
                 a_start_ptr, b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
                 A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN)
    o = gl.zeros([BLOCK_H, HALF_V], gl.float32, O4_L)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
    l_i = gl.zeros([BLOCK_H], gl.float32, ROW_S)
    mbarrier.wait(bars.index(0), 0)  # q is in shared memory
    o, m_i, l_i = _consume(1, n, o, m_i, l_i, q_smem, k_bufs, p_bufs, m_bufs, valid_bufs, kempty, kfull, bars,
                           qk_scale)
    _publish(l_smem, l_i, bars.index(7))
    mbarrier.wait(bars.index(8), 0)
    f = f_smem.load(ROW_O)
    _store_half_o(o, f, t64, pid_h, split, num_heads, HALF_V, out_ptr, stride_o_t, stride_o_h, part_o_ptr,
                  split_base, total_splits, WRITE_PARTIAL, OUT_BF16)


@gluon.jit
def _sparse_mla_attn_sm90_pp_kernel(
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
    A_RANGE: gl.constexpr, HAS_B: gl.constexpr, B_RANGE: gl.constexpr,
    HAS_SINK: gl.constexpr, WRITE_PARTIAL: gl.constexpr, OUT_BF16: gl.constexpr,
    A_LEN: gl.constexpr, B_LEN: gl.constexpr, WRITE_MAX: gl.constexpr = False,
):
    """Grid ``(num_tokens * cdiv(num_heads, 64), num_splits)``, head tiles fastest, as the other
    sm90 kernels; bf16 pages in both sets; launched with ``NUM_WARPS`` (4) warps, warpgroup 1
    and the producer on top. Shared memory: q and two K stages (64 KiB each), two P buffers."""
    tiles = gl.cdiv(num_heads, BLOCK_H)
    t = gl.program_id(0) // tiles
    pid_h = gl.program_id(0) % tiles
    split = gl.program_id(1)
    t64 = t.to(gl.int64)

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, HEAD_DIM], MMA_SMEM)
    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HEAD_DIM], MMA_SMEM)
    p_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_H, BLOCK_N], MMA_SMEM)
    m_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], VEC_SMEM)
    l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], VEC_SMEM)
    f_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], VEC_SMEM)
    valid_bufs = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N], VEC_SMEM)
    # K halves: index 2 * stage + (0 left, 1 right).
    kempty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    kfull = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [9, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        mbarrier.init(kempty.index(i), count=1)
        mbarrier.init(kfull.index(i), count=1)
    for i in gl.static_range(9):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_wg0, (q_ptr, stride_q_t, stride_q_h, num_heads, t64, pid_h, q_smem, k_bufs, p_bufs, m_bufs, l_smem, f_smem,
                valid_bufs, kempty, kfull, bars, t, split, num_splits, qk_scale,
                out_ptr, stride_o_t, stride_o_h, lse_ptr, stride_lse_t, max_ptr, stride_max_t, part_o_ptr,
                part_lse_ptr, sink_ptr, split_base, total_splits,
                a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
                b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
                A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN, HAS_SINK, WRITE_PARTIAL, OUT_BF16, WRITE_MAX)),
        (_wg1, (q_smem, k_bufs, p_bufs, m_bufs, l_smem, f_smem, valid_bufs, kempty, kfull, bars, t64, pid_h, t, split,
                num_splits, num_heads, qk_scale, out_ptr, stride_o_t, stride_o_h, part_o_ptr, split_base,
                total_splits,
                a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
                b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
                A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN, WRITE_PARTIAL, OUT_BF16)),
        (_producer, (k_bufs, valid_bufs, kempty, kfull, t, split, num_splits,
                     a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity,
                     a_idx_ptr, a_stride_idx, a_width, a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs,
                     a_req_ptr, a_start_ptr,
                     b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity,
                     b_idx_ptr, b_stride_idx, b_width, b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs,
                     b_req_ptr, b_start_ptr,
                     A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN)),
    ], [4, PRODUCER_WARPS], [WG1_REGS, PRODUCER_REGS])
