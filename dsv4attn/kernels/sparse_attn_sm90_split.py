"""Warp-specialised Hopper sparse MLA attention with split consumers (fp8 pages), in Gluon.

Same grid, arguments and outputs as :mod:`dsv4attn.kernels.sparse_attn_sm90_ws`, with the
same producer partition; the two consumer warpgroups are separate partitions with separate
jobs (FlashMLA's division of labour, written here from its description):

- **warpgroup 0** (the default partition) computes all of ``S = q K^T`` for a chunk (one
  64 x 64 x 512 wgmma: q is read from shared memory once, not once per warpgroup), runs the
  online softmax alone (row maxima within the warpgroup: no exchange), keeps P in registers for
  its half of ``O += P V`` (V columns 0-255, register-operand wgmma) and hands P and the rescale
  factors of the chunk to warpgroup 1 through shared memory (one buffer per K stage);
- **warpgroup 1** waits for them and runs the other half (V columns 256-511);
- both release the K stage to the producer (the empty barrier counts two arrivals).

Warpgroup 0 can then compute S of chunk c+1 while warpgroup 1 still multiplies chunk c. At the
end warpgroup 0 publishes each row's normalisation factor; each warpgroup writes its half of
the output.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

from dsv4attn.kernels.sparse_attn_sm90 import (
    BLOCK_H, BLOCK_N, HEAD_DIM, LN2, MMA_SMEM, VEC_SMEM, _cta_barrier, _extent,
)
from dsv4attn.kernels.sparse_attn_sm90_ws import PRODUCER_REGS, PRODUCER_WARPS, _producer

#: Warps of the default partition (warpgroup 0); warpgroup 1 and the producer run on top.
NUM_WARPS = 4
WG1_REGS = gl.constexpr(160)
HALF_V = gl.constexpr(256)
S4_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
O4_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
P_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O4_L, k_width=2))
Q4_L = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0]))
ROW_O = gl.constexpr(gl.SliceLayout(1, O4_L))


@gluon.jit
def _store_half_o(o, f, t64, pid_h, split, num_heads, col0, out_ptr, stride_o_t, stride_o_h, part_o_ptr,
                  split_base, total_splits, WRITE_PARTIAL: gl.constexpr, OUT_BF16: gl.constexpr):
    """Write ``o * f`` (rows = heads, 256 columns starting at ``col0``) to the output or the
    split-KV partial."""
    h = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_O)
    d = col0 + gl.arange(0, HALF_V, layout=gl.SliceLayout(0, O4_L))
    h_ok = h < num_heads
    hc = gl.where(h_ok, h, 0)
    mask2 = gl.expand_dims(h_ok, 1)
    res = o * gl.expand_dims(f, 1)
    if WRITE_PARTIAL:
        part_row = (t64 * total_splits + split_base + split) * num_heads + hc
        gl.store(part_o_ptr + gl.expand_dims(part_row * HEAD_DIM, 1) + gl.expand_dims(d, 0), res, mask=mask2)
    else:
        optr = out_ptr + t64 * stride_o_t + gl.expand_dims(hc * stride_o_h, 1) + gl.expand_dims(d, 0)
        if OUT_BF16:
            gl.store(optr, res.to(gl.bfloat16), mask=mask2)
        else:
            gl.store(optr, res, mask=mask2)


@gluon.jit
def _wg0_set(it, o, m_i, l_i, q_smem, k_bufs, p_bufs, a_bufs, valid_bufs, empty, full, p_ready, t, split,
             num_splits, block_size, width, len_ptr, max_blocks, num_reqs, req_ptr, start_ptr, qk_scale,
             IS_RANGE: gl.constexpr, HAS_LEN: gl.constexpr):
    start, length, req = _extent(t, width, len_ptr, req_ptr, start_ptr, num_reqs, max_blocks, block_size, IS_RANGE,
                                 HAS_LEN)
    for c in range(split, gl.cdiv(length, BLOCK_N), num_splits):
        st = it % 2
        mbarrier.wait(full.index(st), (it // 2) & 1)
        k_cur = k_bufs.index(st)
        s = warpgroup_mma(q_smem, k_cur.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S4_L),
                          use_acc=False)
        ok = gl.expand_dims(valid_bufs.index(st).load(gl.SliceLayout(0, S4_L)) != 0, 0)
        s = gl.where(ok, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - gl.expand_dims(m_safe, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p16 = p.to(gl.bfloat16)
        # Hand P and alpha of this chunk to warpgroup 1 (its buffers of stage st are free: the
        # producer refilled stage st, so warpgroup 1 released it after its last use of them).
        p_bufs.index(st).store(p16)
        a_bufs.index(st).store(alpha)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(p_ready.index(st))
        o = o * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
        o = warpgroup_mma(gl.convert_layout(p16, P_A), k_cur.slice(0, HALF_V, dim=1), o)
        _cta_barrier()
        mbarrier.arrive(empty.index(st))
        it += 1
    return it, o, m_i, l_i


@gluon.jit
def _wg0(q_ptr, stride_q_t, stride_q_h, num_heads, t64, pid_h, q_smem, k_bufs, p_bufs, a_bufs, f_smem, valid_bufs,
         empty, full, p_ready, fin, t, split, num_splits, qk_scale,
         out_ptr, stride_o_t, stride_o_h, lse_ptr, stride_lse_t, max_ptr, stride_max_t, part_o_ptr, part_lse_ptr,
         sink_ptr, split_base, total_splits,
         a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
         b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
         A_RANGE: gl.constexpr, A_LEN: gl.constexpr, HAS_B: gl.constexpr, B_RANGE: gl.constexpr, B_LEN: gl.constexpr,
         HAS_SINK: gl.constexpr, WRITE_PARTIAL: gl.constexpr, OUT_BF16: gl.constexpr, WRITE_MAX: gl.constexpr):
    """Warpgroup 0: q, S, softmax, the first half of O, the row statistics and the epilogue's
    normalisation factors."""
    dq = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, Q4_L))
    for r in gl.static_range(0, BLOCK_H, 16):
        hq = pid_h * BLOCK_H + r + gl.arange(0, 16, layout=gl.SliceLayout(1, Q4_L))
        hq_ok = hq < num_heads
        q = gl.load(q_ptr + t64 * stride_q_t + gl.expand_dims(gl.where(hq_ok, hq, 0) * stride_q_h, 1)
                    + gl.expand_dims(dq, 0), mask=gl.expand_dims(hq_ok, 1), other=0.0)
        q_smem.slice(r, 16, dim=0).store(q.to(gl.bfloat16))
    fence_async_shared()
    _cta_barrier()
    o = gl.zeros([BLOCK_H, HALF_V], gl.float32, O4_L)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, S4_L))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, S4_L))
    it, o, m_i, l_i = _wg0_set(t * 0, o, m_i, l_i, q_smem, k_bufs, p_bufs, a_bufs, valid_bufs, empty, full, p_ready,
                               t, split, num_splits, a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs,
                               a_req_ptr, a_start_ptr, qk_scale, A_RANGE, A_LEN)
    if HAS_B:
        it, o, m_i, l_i = _wg0_set(it, o, m_i, l_i, q_smem, k_bufs, p_bufs, a_bufs, valid_bufs, empty, full,
                                   p_ready, t, split, num_splits, b_block_size, b_width, b_len_ptr, b_max_blocks,
                                   b_num_reqs, b_req_ptr, b_start_ptr, qk_scale, B_RANGE, B_LEN)
    # Row statistics -> normalisation factor f (published for warpgroup 1) and lse / max logits.
    m_o = gl.convert_layout(m_i, ROW_O)
    l_o = gl.convert_layout(l_i, ROW_O)
    h = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_O)
    h_ok = h < num_heads
    hc = gl.where(h_ok, h, 0)
    is_empty = l_o == 0.0
    l_safe = gl.where(is_empty, 1.0, l_o)
    lse2 = gl.where(is_empty, float("-inf"), m_o + gl.log2(l_safe))
    f = 1.0 / l_safe
    if WRITE_PARTIAL:
        part_row = (t64 * total_splits + split_base + split) * num_heads + hc
        gl.store(part_lse_ptr + part_row, lse2, mask=h_ok)
    else:
        lse = gl.where(is_empty, float("inf"), lse2 * LN2)
        if HAS_SINK:
            sink = gl.load(sink_ptr + hc, mask=h_ok, other=float("-inf"))
            f = f / (1.0 + gl.exp(sink - gl.where(is_empty, 0.0, lse)))
        f = gl.where(is_empty, 0.0, f)
        gl.store(lse_ptr + t64 * stride_lse_t + hc, lse, mask=h_ok)
        if WRITE_MAX:
            gl.store(max_ptr + t64 * stride_max_t + hc, m_o * LN2, mask=h_ok)
    f_smem.store(f)
    _cta_barrier()
    mbarrier.arrive(fin.index(0))
    _store_half_o(o, f, t64, pid_h, split, num_heads, 0, out_ptr, stride_o_t, stride_o_h, part_o_ptr,
                  split_base, total_splits, WRITE_PARTIAL, OUT_BF16)
    return (m_i,)


@gluon.jit
def _wg1_set(it, o, k_bufs, p_bufs, a_bufs, empty, full, p_ready, t, split, num_splits,
             block_size, width, len_ptr, max_blocks, num_reqs, req_ptr, start_ptr,
             IS_RANGE: gl.constexpr, HAS_LEN: gl.constexpr):
    start, length, req = _extent(t, width, len_ptr, req_ptr, start_ptr, num_reqs, max_blocks, block_size, IS_RANGE,
                                 HAS_LEN)
    for c in range(split, gl.cdiv(length, BLOCK_N), num_splits):
        st = it % 2
        ph = (it // 2) & 1
        mbarrier.wait(full.index(st), ph)
        mbarrier.wait(p_ready.index(st), ph)
        alpha = a_bufs.index(st).load(ROW_O)
        o = o * gl.expand_dims(alpha, 1)
        o = warpgroup_mma(p_bufs.index(st), k_bufs.index(st).slice(HALF_V, HALF_V, dim=1), o)
        _cta_barrier()
        mbarrier.arrive(empty.index(st))
        it += 1
    return it, o


@gluon.jit
def _wg1(k_bufs, p_bufs, a_bufs, f_smem, empty, full, p_ready, fin, t64, pid_h, t, split, num_splits, num_heads,
         out_ptr, stride_o_t, stride_o_h, part_o_ptr, split_base, total_splits,
         a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
         b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
         A_RANGE: gl.constexpr, A_LEN: gl.constexpr, HAS_B: gl.constexpr, B_RANGE: gl.constexpr, B_LEN: gl.constexpr,
         WRITE_PARTIAL: gl.constexpr, OUT_BF16: gl.constexpr):
    """Warpgroup 1: the second half of O from warpgroup 0's P and rescale factors."""
    o = gl.zeros([BLOCK_H, HALF_V], gl.float32, O4_L)
    it, o = _wg1_set(t * 0, o, k_bufs, p_bufs, a_bufs, empty, full, p_ready, t, split, num_splits, a_block_size,
                     a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr, A_RANGE, A_LEN)
    if HAS_B:
        it, o = _wg1_set(it, o, k_bufs, p_bufs, a_bufs, empty, full, p_ready, t, split, num_splits, b_block_size,
                         b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr, B_RANGE, B_LEN)
    mbarrier.wait(fin.index(0), 0)
    f = f_smem.load(ROW_O)
    _store_half_o(o, f, t64, pid_h, split, num_heads, HALF_V, out_ptr, stride_o_t, stride_o_h, part_o_ptr,
                  split_base, total_splits, WRITE_PARTIAL, OUT_BF16)


@gluon.jit
def _sparse_mla_attn_sm90_split_kernel(
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
    A_LEN: gl.constexpr, B_LEN: gl.constexpr, WRITE_MAX: gl.constexpr = False, SKIP: gl.constexpr = 0,
    PREFETCH: gl.constexpr = True,
):
    """Grid as the other sm90 kernels; launched with ``NUM_WARPS`` (4) warps, warpgroup 1 and
    the producer on top. ``SKIP`` is accepted for the launcher's sake and must be 0."""
    tiles = gl.cdiv(num_heads, BLOCK_H)
    t = gl.program_id(0) // tiles
    pid_h = gl.program_id(0) % tiles
    split = gl.program_id(1)
    t64 = t.to(gl.int64)

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, HEAD_DIM], MMA_SMEM)
    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HEAD_DIM], MMA_SMEM)
    p_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_H, BLOCK_N], MMA_SMEM)
    a_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], VEC_SMEM)
    f_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], VEC_SMEM)
    valid_bufs = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N], VEC_SMEM)
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    fin = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(empty.index(i), count=2)
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(p_ready.index(i), count=1)
    mbarrier.init(fin.index(0), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_wg0, (q_ptr, stride_q_t, stride_q_h, num_heads, t64, pid_h, q_smem, k_bufs, p_bufs, a_bufs, f_smem,
                valid_bufs, empty, full, p_ready, fin, t, split, num_splits, qk_scale,
                out_ptr, stride_o_t, stride_o_h, lse_ptr, stride_lse_t, max_ptr, stride_max_t, part_o_ptr,
                part_lse_ptr, sink_ptr, split_base, total_splits,
                a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
                b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
                A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN, HAS_SINK, WRITE_PARTIAL, OUT_BF16, WRITE_MAX)),
        (_wg1, (k_bufs, p_bufs, a_bufs, f_smem, empty, full, p_ready, fin, t64, pid_h, t, split, num_splits,
                num_heads, out_ptr, stride_o_t, stride_o_h, part_o_ptr, split_base, total_splits,
                a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
                b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
                A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN, WRITE_PARTIAL, OUT_BF16)),
        (_producer, (k_bufs, valid_bufs, empty, full, t, split, num_splits,
                     a_cache_ptr, a_stride_blk, a_block_size, a_capacity,
                     a_idx_ptr, a_stride_idx, a_width, a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs,
                     a_req_ptr, a_start_ptr,
                     b_cache_ptr, b_stride_blk, b_block_size, b_capacity,
                     b_idx_ptr, b_stride_idx, b_width, b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs,
                     b_req_ptr, b_start_ptr,
                     A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN, 0, PREFETCH)),
    ], [4, PRODUCER_WARPS], [WG1_REGS, PRODUCER_REGS])
