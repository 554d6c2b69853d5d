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
  tensor-core work (in the warp-specialised kernel warpgroup 0 computes every S alone). Each
  warpgroup owns half of the output columns (warpgroup 0 columns 0-255, warpgroup 1 columns
  256-511): it multiplies its own P from registers with its half of its own chunk, and the
  other warpgroup's P, read from shared memory, with its half of the other chunk. Per pair of
  chunks the row maximum goes round once through shared memory: warpgroup 0 publishes the
  maximum after chunk 2j and goes on with its own product; warpgroup 1 takes the maximum over
  chunk 2j+1 too (the pair's) and publishes it; warpgroup 0 then rescales its P to it before
  publishing P, so both accumulators and both partial row sums stay relative to one running
  maximum. The products are asynchronous wgmma: warpgroup 0 issues the next pair's logits
  behind its last product of this pair, and each warpgroup computes its logits half by half
  (256 dims each), starting with the half it released first, which is refilled first;
- at the end warpgroup 1 publishes its row sums, warpgroup 0 the normalisation factors, and
  each writes its half of the output.

fp8 pages keep the warp-specialised kernel: their producer needs 128 registers to dequantise,
which leaves too few for two consumers that each hold S, P and a [64, 256] accumulator.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait,
)

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
def _fill_half(x, c, STAGE: gl.constexpr, HALF: gl.constexpr, WITH_VALID: gl.constexpr, phase, k_bufs, valid_bufs,
               kempty, kfull, n_a, split, num_splits,
               a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity, a_start,
               b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity, b_start,
               A_RANGE: gl.constexpr, HAS_B: gl.constexpr, B_RANGE: gl.constexpr):
    """Copy column half ``HALF`` of chunk ``c`` (slot reads ``x``) into K stage ``STAGE``. The row
    addresses are derived here, per half, from the slot reads (cheap integer arithmetic):
    holding both chunks' 64-bit row pointers across the loop made the producer spill."""
    ptr, ok = _rows(x, c, n_a, split, num_splits,
                    a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity, a_start,
                    b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity, b_start,
                    A_RANGE, HAS_B, B_RANGE)
    _copy_half(k_bufs.index(STAGE).slice(HALF * HALF_V, HALF_V, dim=1), ptr, ok, HALF * HALF_V,
               kempty.index(2 * STAGE + HALF), kfull.index(2 * STAGE + HALF), phase, valid_bufs.index(STAGE),
               WITH_VALID)


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
        y0 = _entries(c + 2, n_a, t, split, num_splits,
                      a_idx_ptr, a_stride_idx, a_bt_ptr, a_stride_bt, a_max_blocks, a_block_size, a_start, a_length,
                      a_req, b_idx_ptr, b_stride_idx, b_bt_ptr, b_stride_bt, b_max_blocks, b_block_size, b_start,
                      b_length, b_req, A_RANGE, HAS_B, B_RANGE)
        y1 = _entries(c + 3, n_a, t, split, num_splits,
                      a_idx_ptr, a_stride_idx, a_bt_ptr, a_stride_bt, a_max_blocks, a_block_size, a_start, a_length,
                      a_req, b_idx_ptr, b_stride_idx, b_bt_ptr, b_stride_bt, b_max_blocks, b_block_size, b_start,
                      b_length, b_req, A_RANGE, HAS_B, B_RANGE)
        ph = (j & 1) ^ 1  # a fresh barrier passes parity 1
        has1 = c + 1 < n
        _fill_half(x0, c, 0, 0, True, ph, k_bufs, valid_bufs, kempty, kfull, n_a, split, num_splits,
                   a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity, a_start,
                   b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity, b_start,
                   A_RANGE, HAS_B, B_RANGE)
        if has1:
            _fill_half(x1, c + 1, 1, 1, True, ph, k_bufs, valid_bufs, kempty, kfull, n_a, split, num_splits,
                       a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity, a_start,
                       b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity, b_start,
                       A_RANGE, HAS_B, B_RANGE)
        _fill_half(x0, c, 0, 1, False, ph, k_bufs, valid_bufs, kempty, kfull, n_a, split, num_splits,
                   a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity, a_start,
                   b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity, b_start,
                   A_RANGE, HAS_B, B_RANGE)
        if has1:
            _fill_half(x1, c + 1, 1, 0, False, ph, k_bufs, valid_bufs, kempty, kfull, n_a, split, num_splits,
                       a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity, a_start,
                       b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity, b_start,
                       A_RANGE, HAS_B, B_RANGE)
        x0 = y0
        x1 = y1


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


# Hand-overs between the two consumer warpgroups on named hardware barriers (ids above the ones
# Triton uses; 256 threads: the 128 that arrive and the 128 that wait). Cheaper than an mbarrier
# round trip; ``bar.arrive`` orders the arriving threads' earlier shared-memory writes before
# the waiters' reads. Each barrier is arrived at and waited on once per pair of chunks, in an
# order that never lets one side arrive twice before the other waited.
NB_L = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))
M0_ARRIVE = gl.constexpr("bar.arrive 8, 256;\n mov.u32 $0, $1;")
M0_WAIT = gl.constexpr("bar.sync 8, 256;\n mov.u32 $0, $1;")
M1_ARRIVE = gl.constexpr("bar.arrive 9, 256;\n mov.u32 $0, $1;")
M1_WAIT = gl.constexpr("bar.sync 9, 256;\n mov.u32 $0, $1;")
P0_ARRIVE = gl.constexpr("bar.arrive 10, 256;\n mov.u32 $0, $1;")
P0_WAIT = gl.constexpr("bar.sync 10, 256;\n mov.u32 $0, $1;")
P1_ARRIVE = gl.constexpr("bar.arrive 11, 256;\n mov.u32 $0, $1;")
P1_WAIT = gl.constexpr("bar.sync 11, 256;\n mov.u32 $0, $1;")


@gluon.jit
def _named(ASM: gl.constexpr):
    """One named-barrier instruction, once per thread of the warpgroup."""
    gl.inline_asm_elementwise(ASM, "=r,r", [gl.arange(0, 128, layout=NB_L)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _mask(s, valid_buf, qk_scale):
    """Scaled logits (base 2), -inf for invalid candidates."""
    ok = gl.expand_dims(valid_buf.load(gl.SliceLayout(0, S4_L)) != 0, 0)
    return gl.where(ok, s * qk_scale, float("-inf"))


@gluon.jit
def _logits_half(q_smem, k, bar, phase, acc, HALF: gl.constexpr, USE_ACC: gl.constexpr):
    """Wait for column half ``HALF`` of a K stage and issue (asynchronously) its part of
    ``S = q K^T``: the logits start on the half that lands first."""
    _wait_k(bar, phase)
    if not USE_ACC:
        acc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S4_L)
    return warpgroup_mma(q_smem.slice(HALF * HALF_V, HALF_V, dim=1),
                         k.slice(HALF * HALF_V, HALF_V, dim=1).permute((1, 0)), acc, use_acc=USE_ACC,
                         is_async=True)


@gluon.jit
def _safe(m):
    return gl.where(m == float("-inf"), 0.0, m)


@gluon.jit
def _wg0_loop(n, q_smem, k_bufs, p_bufs, m_bufs, valid_bufs, kempty, kfull, bars, qk_scale):
    """Warpgroup 0 over the pairs of chunks (2j its own, 2j+1 warpgroup 1's), output columns
    0-255. Per pair: softmax of chunk 2j against the running maximum, which it publishes; its
    own ``P V`` (register P); then the pair's maximum from warpgroup 1, its P rescaled to it and
    published; warpgroup 1's P times this warpgroup's half of chunk 2j+1, issued together with
    the next pair's logits (left half first: it is the half this warpgroup released first).
    ``bars`` (mbarriers): q, l, fin."""
    o = gl.zeros([BLOCK_H, HALF_V], gl.float32, O4_L)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
    l_i = gl.zeros([BLOCK_H], gl.float32, ROW_S)
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S4_L)
    if n > 0:
        s_acc = _logits_half(q_smem.index(0), k_bufs.index(0), kfull.index(0), 0, None, 0, False)
        s_acc = _logits_half(q_smem.index(0), k_bufs.index(0), kfull.index(1), 0, s_acc, 1, True)
        s = warpgroup_mma_wait(0, deps=[s_acc])
    for j in range(gl.cdiv(n, 2)):
        ph = j & 1
        # Shared-memory views indexed by a zero the compiler cannot prove (j < 2^30): their wgmma
        # descriptors are then computed in the loop instead of hoisted out of it, where ptxas
        # spilled them and reloaded them from local memory before every product.
        z = j >> 30
        q_cur = q_smem.index(z)
        k0 = k_bufs.index(z)
        k1 = k_bufs.index(z + 1)
        s = _mask(s, valid_bufs.index(0), qk_scale)
        m0 = gl.maximum(m_i, gl.max(s, axis=1))
        m_bufs.index(0).store(m0)
        _named(M0_ARRIVE)
        m0_safe = _safe(m0)
        alpha = gl.exp2(m_i - m0_safe)
        p = gl.exp2(s - gl.expand_dims(m0_safe, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        o = o * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
        pa = gl.convert_layout(p.to(gl.bfloat16), P_A)
        o = warpgroup_mma(pa, k0.slice(0, HALF_V, dim=1), o, is_async=True)
        o, pa = warpgroup_mma_wait(0, deps=[o, pa])
        _cta_barrier()
        mbarrier.arrive(kempty.index(0))  # chunk 2j, columns 0-255: done
        _named(M1_WAIT)
        m1 = m_bufs.index(1).load(ROW_S)
        # P of chunk 2j relative to the pair's maximum (m0 = -inf: P is zero, any finite factor).
        sc = gl.where(m0 == float("-inf"), 1.0, gl.exp2(m0 - _safe(m1)))
        p_bufs.index(0).store((p * gl.expand_dims(sc, 1)).to(gl.bfloat16))
        fence_async_shared()
        _named(P0_ARRIVE)
        o = o * gl.expand_dims(gl.convert_layout(sc, ROW_O), 1)
        l_i = l_i * sc
        m_i = m1
        _named(P1_WAIT)  # also after the last, odd chunk: warpgroup 1 arrives once per pair
        if 2 * j + 1 < n:
            _wait_k(kfull.index(2), ph)
            acc = warpgroup_mma(p_bufs.index(z + 1), k1.slice(0, HALF_V, dim=1), o, is_async=True)
            if 2 * j + 2 < n:
                s_acc = _logits_half(q_cur, k0, kfull.index(0), ph ^ 1, None, 0, False)
                o = warpgroup_mma_wait(1, deps=[acc])
                _cta_barrier()
                mbarrier.arrive(kempty.index(2))  # chunk 2j+1, columns 0-255: done
                s_acc = _logits_half(q_cur, k0, kfull.index(1), ph ^ 1, s_acc, 1, True)
                s = warpgroup_mma_wait(0, deps=[s_acc])
            else:
                o = warpgroup_mma_wait(0, deps=[acc])
                _cta_barrier()
                mbarrier.arrive(kempty.index(2))
                s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S4_L)  # (no next pair: the old s dies)
        else:
            s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S4_L)
    return o, m_i, l_i


@gluon.jit
def _wg1_loop(n, q_smem, k_bufs, p_bufs, m_bufs, valid_bufs, kempty, kfull, bars, qk_scale):
    """Warpgroup 1 over the pairs, output columns 256-511: the logits of chunk 2j+1 (right half
    first: the half it released first), the pair's maximum from warpgroup 0's, its softmax, its
    own ``P V`` and warpgroup 0's P times its half of chunk 2j. Without a chunk 2j+1 (odd count,
    last pair) it only rescales and multiplies warpgroup 0's P."""
    o = gl.zeros([BLOCK_H, HALF_V], gl.float32, O4_L)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
    l_i = gl.zeros([BLOCK_H], gl.float32, ROW_S)
    mbarrier.wait(bars.index(0), 0)  # q is in shared memory
    for j in range(gl.cdiv(n, 2)):
        ph = j & 1
        z = j >> 30  # as in _wg0_loop: wgmma descriptors computed in the loop, not spilled
        q_cur = q_smem.index(z)
        k0 = k_bufs.index(z)
        k1 = k_bufs.index(z + 1)
        has1 = 2 * j + 1 < n
        if has1:
            s_acc = _logits_half(q_cur, k1, kfull.index(3), ph, None, 1, False)
            s_acc = _logits_half(q_cur, k1, kfull.index(2), ph, s_acc, 0, True)
            s = _mask(warpgroup_mma_wait(0, deps=[s_acc]), valid_bufs.index(1), qk_scale)
        else:
            s = gl.full([BLOCK_H, BLOCK_N], float("-inf"), gl.float32, S4_L)
        _named(M0_WAIT)
        m1 = gl.maximum(m_bufs.index(0).load(ROW_S), gl.max(s, axis=1))
        m_bufs.index(1).store(m1)
        _named(M1_ARRIVE)
        m1_safe = _safe(m1)
        alpha = gl.exp2(m_i - m1_safe)
        o = o * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
        l_i = l_i * alpha
        m_i = m1
        if has1:
            p = gl.exp2(s - gl.expand_dims(m1_safe, 1))
            l_i = l_i + gl.sum(p, axis=1)
            p16 = p.to(gl.bfloat16)
            pa = gl.convert_layout(p16, P_A)
            acc = warpgroup_mma(pa, k1.slice(HALF_V, HALF_V, dim=1), o, is_async=True)
            p_bufs.index(1).store(p16)
            _named(P0_WAIT)
            _wait_k(kfull.index(1), ph)
            acc = warpgroup_mma(p_bufs.index(z), k0.slice(HALF_V, HALF_V, dim=1), acc, is_async=True)
            fence_async_shared()
            _named(P1_ARRIVE)
            acc, pa = warpgroup_mma_wait(1, deps=[acc, pa])
            _cta_barrier()
            mbarrier.arrive(kempty.index(3))  # chunk 2j+1, columns 256-511: done
            o = warpgroup_mma_wait(0, deps=[acc])
        else:
            _named(P1_ARRIVE)  # no P of chunk 2j+1: warpgroup 0 waits once per pair all the same
            _named(P0_WAIT)
            _wait_k(kfull.index(1), ph)
            acc_r = warpgroup_mma(p_bufs.index(z), k0.slice(HALF_V, HALF_V, dim=1), o, is_async=True)
            o = warpgroup_mma_wait(0, deps=[acc_r])
        _cta_barrier()
        mbarrier.arrive(kempty.index(1))  # chunk 2j, columns 256-511: done
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
        q_smem.index(0).slice(r, 8, dim=0).store(q.to(gl.bfloat16))
    _publish_done(bars.index(0))
    o, m_i, l_i = _wg0_loop(n, q_smem, k_bufs, p_bufs, m_bufs, valid_bufs, kempty, kfull, bars, qk_scale)
    mbarrier.wait(bars.index(1), 0)
    l_i = l_i + l_smem.load(ROW_S)
    f = _row_factors(m_i, l_i, t64, pid_h, split, num_heads, lse_ptr, stride_lse_t, max_ptr, stride_max_t,
                     part_lse_ptr, sink_ptr, split_base, total_splits, HAS_SINK, WRITE_PARTIAL, WRITE_MAX)
    _publish(f_smem, f, bars.index(2))
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
    o, m_i, l_i = _wg1_loop(n, q_smem, k_bufs, p_bufs, m_bufs, valid_bufs, kempty, kfull, bars, qk_scale)
    _publish(l_smem, l_i, bars.index(1))
    mbarrier.wait(bars.index(2), 0)
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

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_H, HEAD_DIM], MMA_SMEM)
    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HEAD_DIM], MMA_SMEM)
    p_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_H, BLOCK_N], MMA_SMEM)
    m_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], VEC_SMEM)
    l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], VEC_SMEM)
    f_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], VEC_SMEM)
    valid_bufs = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N], VEC_SMEM)
    # K halves: index 2 * stage + (0 left, 1 right).
    kempty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    kfull = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        mbarrier.init(kempty.index(i), count=1)
        mbarrier.init(kfull.index(i), count=1)
    for i in gl.static_range(3):
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
