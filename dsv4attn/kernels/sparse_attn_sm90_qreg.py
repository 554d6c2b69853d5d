"""Hopper (sm90) sparse MLA attention on bf16 pages with q in registers (Gluon).

Same grid, arguments and outputs as
:func:`dsv4attn.kernels.sparse_attn_sm90_ws._sparse_mla_attn_sm90_ws_kernel` on bf16 pages
(FlashMLA's prefill API, ``flash_mla_sparse_fwd``), another division of the work
(docs/design.md, "Attention kernel"). One CTA of 12 warps in three partitions that share
**three** K stages (they fit because q has no 64 KiB shared buffer):

- **warpgroup 0** (the default partition) holds q's dims 0-383 in registers as the A operand
  of ``S = q K^T`` (so most of a logits product reads only K from shared memory, 64 bytes a
  cycle instead of 128; dims 384-511 come from a 16 KiB buffer), issues chunk c+1's logits
  before it runs chunk c's online softmax (the logits run on the tensor cores while the softmax
  does not), and hands P and the rescale factors to the other two through shared memory;
- **warpgroups 1 and 2** each own half of O (V columns 0-255 / 256-511, a 64 x 256
  accumulator), add ``P V`` from shared memory and release the P buffer and the stage; each
  also copies half the rows of every chunk with ``cp.async``, chunk c+3 into chunk c's stage
  once both have multiplied chunk c. A stage's full barrier tracks the copies themselves
  (``cp.async.mbarrier.arrive``), so warpgroup 0 can start a chunk's logits as soon as its rows
  have landed, wherever the copying warpgroups are in their loop. With ``COL_COPIES``
  (``KernelConfig.sm90_qreg_col_copies``) each copies its own 256 columns of every row instead,
  as soon as it has multiplied them.

Invalid candidates are never read (``cp.async`` zero-fills them) and get -inf logits from the
per-chunk validity vector, as in every kernel of the library. Bit-identical to the
warp-specialised kernel. On an H100 (docs/benchmarks.md, Tables 56-59) it is 3-8% faster than that
kernel at 8 chunks per CTA on pages of 64 rows (5-9% with ``COL_COPIES``) and 1-6%
slower at 32, and 5-10% slower on FlashMLA's prefill rows (pages of one row) through
``flash_mla_sparse_fwd``, so the launcher runs it only with ``KernelConfig.sm90_bf16_qreg``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait,
)

from dsv4attn.kernels.sparse_attn_gather import _candidate_entry, _candidate_place
from dsv4attn.kernels.sparse_attn_sm90 import (
    BLOCK_H, BLOCK_N, HEAD_DIM, MMA_SMEM, VEC_SMEM, _async_load, _cta_barrier, _extent, _row_stats,
)
from dsv4attn.kernels.sparse_attn_sm90_ws import (
    HALF_V, KB4_L, KB4_ROW, O4_L, Q4_L, ROW_O, S4_L, _n_mine, _n_total,
    _chunk_valid, _softmax_step, _store_half_o,
)

#: Warps of the default partition (warpgroup 0); the two P V warpgroups run on top with these
#: registers per thread (warpgroup 0 gets what is left: 3 x 168 - 2 x PV_REGS = 184). Below 160
#: ptxas ignores the split (a 64 x 256 wgmma needs 158) and serialises every wgmma.
NUM_WARPS = 4
PV_REGS = gl.constexpr(160)
#: K stages [64, 512] bf16 (64 KiB each).
STAGES = gl.constexpr(3)
#: Rows of each chunk that one P V warpgroup copies (all 512 columns of them).
ROWS = gl.constexpr(32)
#: ``COL_COPIES``: each P V warpgroup copies its own 256 columns of all 64 rows instead, in this
#: layout of [64, 256] (a warp covers 4 rows x 64 columns, 128 contiguous bytes of a row per 8
#: lanes; each thread 4 rows x 4 vectors of 16 bytes).
CB_L = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
CB_ROW = gl.constexpr(gl.SliceLayout(1, CB_L))
#: q dims 0-383 as the A operand of the logits product (registers; dims 384-511 are read from a
#: shared buffer of their own: all 512 in registers spill next to the logits in 184 registers).
Q_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=S4_L, k_width=2))


@gluon.jit
def _half_chunk_rows(g, W: gl.constexpr, split, num_splits, COLS: gl.constexpr):
    """Candidate positions of the rows of this split's chunk ``g`` (chunk ``split + g *
    num_splits``) that P V warpgroup ``W`` copies: rows ``32 W ..``, or with ``COLS`` all 64."""
    if COLS:
        rows = (split + g * num_splits) * BLOCK_N + gl.arange(0, BLOCK_N, layout=CB_ROW)
    else:
        rows = (split + g * num_splits) * BLOCK_N + W * ROWS + gl.arange(0, ROWS, layout=KB4_ROW)
    return rows


@gluon.jit
def _lookup(t, g, n_a, split, num_splits,
            a_idx_ptr, a_stride_idx, a_length, a_bt_ptr, a_stride_bt, a_max_blocks, a_start, a_req, a_block_size,
            b_idx_ptr, b_stride_idx, b_length, b_bt_ptr, b_stride_bt, b_max_blocks, b_start, b_req, b_block_size,
            W: gl.constexpr, A_RANGE: gl.constexpr, HAS_B: gl.constexpr, B_RANGE: gl.constexpr,
            COLS: gl.constexpr):
    """Slot-lookup reads of warpgroup ``W``'s rows (:func:`_half_chunk_rows`) of the split's chunk
    ``g`` over both sets (set A's ``n_a`` chunks first); past the last chunk every row is invalid
    (no read)."""
    if HAS_B:
        if g < n_a:
            x = _candidate_entry(t, _half_chunk_rows(g, W, split, num_splits, COLS), a_idx_ptr, a_stride_idx, a_length,
                                 a_bt_ptr, a_stride_bt, a_max_blocks, a_start, a_req, a_block_size, A_RANGE)
        else:
            x = _candidate_entry(t, _half_chunk_rows(g - n_a, W, split, num_splits, COLS), b_idx_ptr, b_stride_idx,
                                 b_length, b_bt_ptr, b_stride_bt, b_max_blocks, b_start, b_req, b_block_size, B_RANGE)
    else:
        x = _candidate_entry(t, _half_chunk_rows(g, W, split, num_splits, COLS), a_idx_ptr, a_stride_idx, a_length,
                             a_bt_ptr, a_stride_bt, a_max_blocks, a_start, a_req, a_block_size, A_RANGE)
    return x


@gluon.jit
def _bf16_row_place(x, j, start, block_size, capacity, stride_blk, stride_entry, IS_RANGE: gl.constexpr):
    """Element offsets in a bf16 cache of candidates ``j``'s rows (from their slot lookups
    ``x``) and their validity: the row formula of :func:`_copy_half`'s three cases."""
    blk, off, valid = _candidate_place(x, j, start, block_size, capacity, IS_RANGE)
    return blk * stride_blk + off * stride_entry, valid


@gluon.jit
def _copy_half(x, g, n_a, k_buf, valid_buf, split, num_splits,
               a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity, a_start,
               b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity, b_start,
               W: gl.constexpr, A_RANGE: gl.constexpr, HAS_B: gl.constexpr, B_RANGE: gl.constexpr,
               COLS: gl.constexpr):
    """Issue the ``cp.async`` copies of warpgroup ``W``'s part of chunk ``g`` (``x``: its rows'
    lookups) into ``k_buf`` (invalid candidates zero-filled, never read) and store their
    validity: rows ``32 W ..``, or with ``COLS`` columns ``256 W ..`` of all rows (warpgroup 0
    stores the validity)."""
    if HAS_B:
        if g < n_a:
            rows, valid = _bf16_row_place(x, _half_chunk_rows(g, W, split, num_splits, COLS), a_start, a_block_size,
                                          a_capacity, a_stride_blk, a_stride_entry, A_RANGE)
            base = a_cache_ptr
        else:
            rows, valid = _bf16_row_place(x, _half_chunk_rows(g - n_a, W, split, num_splits, COLS), b_start, b_block_size,
                                          b_capacity, b_stride_blk, b_stride_entry, B_RANGE)
            base = b_cache_ptr
    else:
        rows, valid = _bf16_row_place(x, _half_chunk_rows(g, W, split, num_splits, COLS), a_start, a_block_size,
                                      a_capacity, a_stride_blk, a_stride_entry, A_RANGE)
        base = a_cache_ptr
    if COLS:
        d = W * HALF_V + gl.expand_dims(gl.arange(0, HALF_V, layout=gl.SliceLayout(0, CB_L)), 0)
        _async_load(k_buf.slice(W * HALF_V, HALF_V, dim=1), base + gl.expand_dims(rows, 1) + d,
                    mask=gl.expand_dims(valid, 1))
        if W == 0:
            valid_buf.store(valid.to(gl.int8))
    else:
        d = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, KB4_L)), 0)
        _async_load(k_buf.slice(W * ROWS, ROWS, dim=0), base + gl.expand_dims(rows, 1) + d,
                    mask=gl.expand_dims(valid, 1))
        valid_buf.slice(W * ROWS, ROWS, dim=0).store(valid.to(gl.int8))


@gluon.jit
def _logits(q_a, q_b, q_tail, k_cur):
    """Issue ``S = q K^T`` of one stage (three asynchronous wgmmas: q's dims 0-255 and 256-383
    from registers, 384-511 from shared memory); the caller waits."""
    s = warpgroup_mma(q_a, k_cur.slice(0, 256, dim=1).permute((1, 0)),
                      gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S4_L), use_acc=False, is_async=True)
    s = warpgroup_mma(q_b, k_cur.slice(256, 128, dim=1).permute((1, 0)), s, is_async=True)
    return warpgroup_mma(q_tail, k_cur.slice(384, 128, dim=1).permute((1, 0)), s, is_async=True)


@gluon.jit
def _hand_over(s, c, valid_bufs, p_bufs, a_bufs, p_ready, p_free, qk_scale, m_i, l_i):
    """The online softmax of chunk ``c``'s logits ``s``; P and the rescale factors to the P V
    warpgroups (buffer ``c % 2``, once they have multiplied chunk c - 2)."""
    p, alpha, m_i, l_i = _softmax_step(s, _chunk_valid(valid_bufs.index(c % STAGES)), qk_scale, m_i, l_i)
    pb = c % 2
    mbarrier.wait(p_free.index(pb), ((c // 2) & 1) ^ 1)  # a fresh barrier passes parity 1
    p_bufs.index(pb).store(p.to(gl.bfloat16))
    a_bufs.index(pb).store(alpha)
    fence_async_shared()
    _cta_barrier()
    mbarrier.arrive(p_ready.index(pb))
    return m_i, l_i


@gluon.jit
def _copies_to(bar):
    """Arrive on ``bar`` for this partition's copies just issued: each thread's arrival waits for
    its copies (``cp.async.mbarrier.arrive``, which raises the pending count first), the
    partition's one ordinary arrival for its validity stores."""
    cp.mbarrier_arrive(bar)
    _cta_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _s_wg(q_ptr, stride_q_t, stride_q_h, num_heads, t64, pid_h, q_tail, k_bufs, p_bufs, a_bufs, f_smem, valid_bufs,
          full, q_done, p_ready, p_free, fin, t, split, num_splits, qk_scale,
          lse_ptr, stride_lse_t, max_ptr, stride_max_t, part_lse_ptr, sink_ptr, split_base, total_splits,
          a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
          b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
          A_RANGE: gl.constexpr, A_LEN: gl.constexpr, HAS_B: gl.constexpr, B_RANGE: gl.constexpr,
          B_LEN: gl.constexpr, HAS_SINK: gl.constexpr, WRITE_PARTIAL: gl.constexpr, WRITE_MAX: gl.constexpr):
    """Warpgroup 0: q in registers, ``S = q K^T``, the online softmax, P and the rescale factors
    for the P V warpgroups, the row statistics."""
    n = _n_total(t, split, num_splits, a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr,
                 a_start_ptr, b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
                 A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN)
    # q: dims 0-383 through stage 2 (the P V warpgroups copy chunk 2 there after q_done) into
    # registers (two tensors: register tensors have power-of-two shapes), dims 384-511 into a
    # shared buffer of their own.
    hq = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, Q4_L))
    hq_ok = hq < num_heads
    q_row = q_ptr + t64 * stride_q_t + gl.expand_dims(gl.where(hq_ok, hq, 0) * stride_q_h, 1)
    q_ok = gl.expand_dims(hq_ok, 1)
    d256 = gl.expand_dims(gl.arange(0, 256, layout=gl.SliceLayout(0, Q4_L)), 0)
    d128 = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, Q4_L)), 0)
    q_stage = k_bufs.index(2)
    q_stage.slice(0, 256, dim=1).store(gl.load(q_row + d256, mask=q_ok, other=0.0).to(gl.bfloat16))
    q_stage.slice(256, 128, dim=1).store(gl.load(q_row + 256 + d128, mask=q_ok, other=0.0).to(gl.bfloat16))
    q_tail.store(gl.load(q_row + 384 + d128, mask=q_ok, other=0.0).to(gl.bfloat16))
    fence_async_shared()  # q's tail (generic stores), before the wgmma reads
    _cta_barrier()
    q_a = q_stage.slice(0, 256, dim=1).load(Q_A)
    q_b = q_stage.slice(256, 128, dim=1).load(Q_A)
    _cta_barrier()  # every thread has read q before chunk 2's copies overwrite the stage
    mbarrier.arrive(q_done.index(0))

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, S4_L))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, S4_L))
    # The logits one chunk ahead: chunk c + 1's run on the tensor cores while chunk c's softmax
    # does not (and next to chunk c - 1's P V). With no chunk, the first logits read an unfilled
    # stage and are never used.
    mbarrier.wait(full.index(0), 0, pred=n > 0)
    fence_async_shared()  # the copies (generic proxy), before the wgmma reads
    s = _logits(q_a, q_b, q_tail, k_bufs.index(0))
    s = warpgroup_mma_wait(0, deps=[s])
    for c in range(n - 1):
        mbarrier.wait(full.index((c + 1) % STAGES), ((c + 1) // STAGES) & 1)
        fence_async_shared()
        s_next = _logits(q_a, q_b, q_tail, k_bufs.index((c + 1) % STAGES))
        m_i, l_i = _hand_over(s, c, valid_bufs, p_bufs, a_bufs, p_ready, p_free, qk_scale, m_i, l_i)
        s = warpgroup_mma_wait(0, deps=[s_next])
    if n > 0:
        m_i, l_i = _hand_over(s, n - 1, valid_bufs, p_bufs, a_bufs, p_ready, p_free, qk_scale, m_i, l_i)
    # Row statistics -> normalisation factor f (published for the P V warpgroups), lse, max logits.
    f = _row_stats(m_i, l_i, pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S4_L)), t64, split,
                   num_heads, lse_ptr, stride_lse_t, max_ptr, stride_max_t, part_lse_ptr, sink_ptr, split_base,
                   total_splits, HAS_SINK, WRITE_PARTIAL, WRITE_MAX)
    f_smem.store(f)
    _cta_barrier()
    mbarrier.arrive(fin.index(0))
    return (m_i,)


@gluon.jit
def _pv_wg(k_bufs, p_bufs, a_bufs, f_smem, valid_bufs, empty, full, q_done, p_ready, p_free, fin, t64, pid_h, t,
           split, num_splits, num_heads, out_ptr, stride_o_t, stride_o_h, part_o_ptr, split_base, total_splits,
           a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity,
           a_idx_ptr, a_stride_idx, a_width, a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs, a_req_ptr,
           a_start_ptr,
           b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity,
           b_idx_ptr, b_stride_idx, b_width, b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs, b_req_ptr,
           b_start_ptr,
           A_RANGE: gl.constexpr, A_LEN: gl.constexpr, HAS_B: gl.constexpr, B_RANGE: gl.constexpr,
           B_LEN: gl.constexpr, WRITE_PARTIAL: gl.constexpr, OUT_BF16: gl.constexpr, COLS: gl.constexpr,
           W: gl.constexpr):
    """P V warpgroup ``W``: V columns ``256 W ..`` of O from warpgroup 0's P and rescale
    factors, and the copies of rows ``32 W ..`` of every chunk, three chunks ahead: chunk c + 3
    goes into chunk c's stage once both P V warpgroups have multiplied chunk c (the full barrier
    counts both warpgroups' halves). The output goes out through stage ``n % 3``, which no chunk
    uses any more (chunk n - 3 was its last)."""
    a_start, a_length, a_req = _extent(t, a_width, a_len_ptr, a_req_ptr, a_start_ptr, a_num_reqs, a_max_blocks,
                                       a_block_size, A_RANGE, A_LEN)
    n_a = _n_mine(a_length, split, num_splits)
    n = n_a
    if HAS_B:
        b_start, b_length, b_req = _extent(t, b_width, b_len_ptr, b_req_ptr, b_start_ptr, b_num_reqs, b_max_blocks,
                                           b_block_size, B_RANGE, B_LEN)
        n += _n_mine(b_length, split, num_splits)
    else:
        b_start, b_length, b_req = a_start, a_length, a_req
    # Chunks 0-2; chunk 2's stage holds q until warpgroup 0 has read it. A stage's full barrier
    # completes once both warpgroups have arrived and every thread's copies have landed
    # (``cp.async.mbarrier.arrive``: the barrier tracks the copies, not this partition's loop).
    for g0 in gl.static_range(STAGES):
        x = _lookup(t, g0, n_a, split, num_splits,
                    a_idx_ptr, a_stride_idx, a_length, a_bt_ptr, a_stride_bt, a_max_blocks, a_start, a_req,
                    a_block_size, b_idx_ptr, b_stride_idx, b_length, b_bt_ptr, b_stride_bt, b_max_blocks, b_start,
                    b_req, b_block_size, W, A_RANGE, HAS_B, B_RANGE, COLS)
        if g0 == 2:
            mbarrier.wait(q_done.index(0), 0)
        if g0 < n:
            _copy_half(x, g0, n_a, k_bufs.index(g0), valid_bufs.index(g0), split, num_splits,
                       a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity, a_start,
                       b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity, b_start,
                       W, A_RANGE, HAS_B, B_RANGE, COLS)
            _copies_to(full.index(g0))
    x = _lookup(t, 3, n_a, split, num_splits,
                a_idx_ptr, a_stride_idx, a_length, a_bt_ptr, a_stride_bt, a_max_blocks, a_start, a_req,
                a_block_size, b_idx_ptr, b_stride_idx, b_length, b_bt_ptr, b_stride_bt, b_max_blocks, b_start,
                b_req, b_block_size, W, A_RANGE, HAS_B, B_RANGE, COLS)
    o = gl.zeros([BLOCK_H, HALF_V], gl.float32, O4_L)
    for c in range(n):
        st = c % STAGES
        pb = c % 2
        mbarrier.wait(p_ready.index(pb), (c // 2) & 1)
        alpha = a_bufs.index(pb).load(ROW_O)
        o = o * gl.expand_dims(alpha, 1)
        o = warpgroup_mma(p_bufs.index(pb), k_bufs.index(st).slice(W * HALF_V, HALF_V, dim=1), o)
        _cta_barrier()
        mbarrier.arrive(p_free.index(pb))
        if not COLS:
            mbarrier.arrive(empty.index(st))
        # Chunk c + 3 into this stage once the other P V warpgroup has multiplied chunk c too
        # (with COLS, this warpgroup's columns are free as soon as it has).
        g = c + STAGES
        if g < n:
            if not COLS:
                mbarrier.wait(empty.index(st), (c // STAGES) & 1)
            _copy_half(x, g, n_a, k_bufs.index(st), valid_bufs.index(st), split, num_splits,
                       a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity, a_start,
                       b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity, b_start,
                       W, A_RANGE, HAS_B, B_RANGE, COLS)
            _copies_to(full.index(st))
        x = _lookup(t, c + STAGES + 1, n_a, split, num_splits,
                    a_idx_ptr, a_stride_idx, a_length, a_bt_ptr, a_stride_bt, a_max_blocks, a_start, a_req,
                    a_block_size, b_idx_ptr, b_stride_idx, b_length, b_bt_ptr, b_stride_bt, b_max_blocks, b_start,
                    b_req, b_block_size, W, A_RANGE, HAS_B, B_RANGE, COLS)
    mbarrier.wait(fin.index(0), 0)
    f = f_smem.load(ROW_O)
    _store_half_o(o, f, k_bufs.index(n % STAGES).slice(W * HALF_V, HALF_V, dim=1), t64, pid_h, split, num_heads,
                  W * HALF_V, out_ptr, stride_o_t, stride_o_h, part_o_ptr, split_base, total_splits, WRITE_PARTIAL,
                  OUT_BF16)


@gluon.jit
def _sparse_mla_attn_sm90_qreg_kernel(
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
    A_LEN: gl.constexpr, B_LEN: gl.constexpr, WRITE_MAX: gl.constexpr = False, COL_COPIES: gl.constexpr = False,
):
    """Grid ``(num_tokens * cdiv(num_heads, 64), num_splits)``, head tiles fastest; bf16 pages
    in both sets; launched with ``NUM_WARPS`` (4) warps, the two P V warpgroups on top."""
    tiles = gl.cdiv(num_heads, BLOCK_H)
    t = gl.program_id(0) // tiles
    pid_h = gl.program_id(0) % tiles
    split = gl.program_id(1)
    t64 = t.to(gl.int64)

    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], MMA_SMEM)
    q_tail = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 128], MMA_SMEM)
    p_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_H, BLOCK_N], MMA_SMEM)
    a_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], VEC_SMEM)
    f_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], VEC_SMEM)
    valid_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N], VEC_SMEM)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    fin = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(empty.index(i), count=2)
        mbarrier.init(full.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_free.index(i), count=2)
    mbarrier.init(fin.index(0), count=1)
    mbarrier.init(q_done.index(0), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_s_wg, (q_ptr, stride_q_t, stride_q_h, num_heads, t64, pid_h, q_tail, k_bufs, p_bufs, a_bufs, f_smem, valid_bufs,
                 full, q_done, p_ready, p_free, fin, t, split, num_splits, qk_scale,
                 lse_ptr, stride_lse_t, max_ptr, stride_max_t, part_lse_ptr, sink_ptr, split_base, total_splits,
                 a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
                 b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
                 A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN, HAS_SINK, WRITE_PARTIAL, WRITE_MAX)),
        (_pv_wg, (k_bufs, p_bufs, a_bufs, f_smem, valid_bufs, empty, full, q_done, p_ready, p_free, fin, t64, pid_h, t,
                  split, num_splits, num_heads, out_ptr, stride_o_t, stride_o_h, part_o_ptr, split_base, total_splits,
                  a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity,
                  a_idx_ptr, a_stride_idx, a_width, a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs,
                  a_req_ptr, a_start_ptr,
                  b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity,
                  b_idx_ptr, b_stride_idx, b_width, b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs,
                  b_req_ptr, b_start_ptr,
                  A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN, WRITE_PARTIAL, OUT_BF16, COL_COPIES, 0)),
        (_pv_wg, (k_bufs, p_bufs, a_bufs, f_smem, valid_bufs, empty, full, q_done, p_ready, p_free, fin, t64, pid_h, t,
                  split, num_splits, num_heads, out_ptr, stride_o_t, stride_o_h, part_o_ptr, split_base, total_splits,
                  a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity,
                  a_idx_ptr, a_stride_idx, a_width, a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs,
                  a_req_ptr, a_start_ptr,
                  b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity,
                  b_idx_ptr, b_stride_idx, b_width, b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs,
                  b_req_ptr, b_start_ptr,
                  A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN, WRITE_PARTIAL, OUT_BF16, COL_COPIES, 1)),
    ], [4, 4], [PV_REGS, PV_REGS])
