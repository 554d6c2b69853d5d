"""Hopper (sm90) sparse MLA attention kernel in Gluon, for the DeepSeek-V4 geometry on fp8 pages.

Same contract and arguments as :func:`dsv4attn.kernels.sparse_attn._sparse_mla_attn_kernel`
(one program per query token x 64-head tile x split; candidates of up to two sets; sink; final
or split-KV partial outputs), restricted to what DeepSeek-V4 serves: head dim 512 = 448 fp8
NoPE dims (seven 64-dim tiles with UE8M0 scales) + 64 bf16 RoPE dims, 64 heads per program,
8 warps. The launcher (:mod:`dsv4attn.ops.sparse_attn_launch`) picks it only
where it applies and keeps the portable Triton kernel for everything else.

Why it is faster than the portable kernel (docs/design.md, "Attention kernel"): the portable
kernel keeps q, a dequantised tile and a [64, 512] fp32 accumulator in registers (255 registers
and spills, gathers not overlapped). Here

- q [64, 512] bf16 and the dequantised candidate tile K [64, 512] bf16 live in shared memory in
  the wgmma layout; the two warpgroups split every MMA along N: logits ``S = q K^T`` as two
  64x32 halves, ``O += P K`` as two 64x256 halves (each warpgroup owns 128 accumulator
  registers per thread, nothing spills, K is read once per chunk for both products);
- the 576 data bytes of each candidate row are gathered with ``cp.async`` into a two-stage
  raw buffer one chunk ahead, so the gather of chunk c+1 runs under the dequantisation and
  MMAs of chunk c;
- dequantisation runs on all 256 threads, 16 bytes per thread per row, one scale per
  (row, 64-dim tile) from the UE8M0 byte (hardware e4m3 -> f32 conversion, exact).

Masking follows the portable kernel: invalid candidates (past the token's length, -1 or out
of range slots, holes in the block table) are never dereferenced (cp.async zero-fills them)
and get -inf logits, so NaN in other pages never reaches a token.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from dsv4attn.kernels.sparse_attn_gather import _candidate_entry, _candidate_place, _clip_range

#: The cp.async copy builtin: ``async_load`` in newer Gluon releases, where the Triton 3.6 name
#: ``async_copy_global_to_shared`` (same leading arguments) raises.
_async_load = cp.async_load if hasattr(cp, "async_load") else cp.async_copy_global_to_shared
#: CTA-wide barrier: ``thread_barrier`` in Triton 3.6, ``barrier`` in newer releases.
_cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier

#: ln(2): the online softmax runs in base 2 (the host folds log2(e) into qk_scale).
LN2 = gl.constexpr(0.6931471805599453)
#: Fixed geometry of this kernel.
BLOCK_H = gl.constexpr(64)
BLOCK_N = gl.constexpr(64)
HEAD_DIM = gl.constexpr(512)
NOPE = gl.constexpr(448)
NUM_WARPS = 8

# Register layouts (8 warps). S [64 heads, 64 candidates] and O [64, 512]: the two warpgroups
# split N. Gather (cp.async issue): RAW_L [64 rows, 8 tiles, 64 bytes] with four 16-byte vectors
# of one row per thread, ROPE_L / SCALE_L with the same row of each thread (two rows per thread,
# so the slot arithmetic stays small next to the accumulator).
S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]))
O_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]))
RAW_L = gl.constexpr(gl.BlockedLayout([1, 4, 16], [4, 2, 4], [8, 1, 1], [2, 1, 0]))
SCALE_L = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0]))
ROPE_L = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0]))
Q_L = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0]))
ROW_L = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, RAW_L)))
# bf16 pages: [64 rows, 512] rows gathered 16 bytes per thread, four rows per thread.
KB_L = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0]))
KB_ROW_L = gl.constexpr(gl.SliceLayout(1, KB_L))
# Shared layouts: wgmma operands (128-byte swizzle), raw rows unswizzled (one 512 B row per warp).
MMA_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
RAW_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
FLAT_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
VEC_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[0]))


@gluon.jit
def _issue_chunk(raw_buf, rope_buf, scale_buf, valid_buf, cache_ptr, x, c, start, block_size, capacity, stride_blk,
                 IS_RANGE: gl.constexpr, SKIP: gl.constexpr):
    """Start the cp.async gather of chunk ``c`` into one stage: per candidate its 448 fp8 bytes
    (as tiles 0-6 of [64, 8, 64]), its 64 bf16 RoPE values and its 8 scale bytes. Invalid
    candidates are zero-filled, never read; their validity goes to ``valid_buf`` (int8). ``x``:
    the chunk's slot-lookup reads (:func:`_entries`), issued one chunk earlier."""
    j = c * BLOCK_N + gl.arange(0, BLOCK_N, layout=ROW_L)
    blk, off, valid = _candidate_place(x, j, start, block_size, capacity, IS_RANGE)
    if (SKIP & 4) != 0:
        valid = valid & (j < 0)
    data = blk * stride_blk + off * 576
    tile = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, RAW_L)))
    col = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, RAW_L)))
    d3 = gl.expand_dims(gl.expand_dims(data, 1), 2)
    t3 = gl.expand_dims(gl.expand_dims(tile, 0), 2)
    c3 = gl.expand_dims(gl.expand_dims(col, 0), 1)
    v3 = gl.expand_dims(gl.expand_dims(valid, 1), 2)
    _async_load(raw_buf, cache_ptr + d3 + t3 * 64 + c3, mask=v3 & (t3 < 7))
    rrow: gl.constexpr = gl.SliceLayout(1, ROPE_L)
    rdata = gl.convert_layout(data, rrow, assert_trivial=True)
    rvalid = gl.convert_layout(valid, rrow, assert_trivial=True)
    rc = gl.arange(0, 64, layout=gl.SliceLayout(0, ROPE_L))
    rptr = (cache_ptr + rdata + NOPE).to(gl.pointer_type(gl.bfloat16))
    _async_load(rope_buf, gl.expand_dims(rptr, 1) + gl.expand_dims(rc, 0),
                                   mask=gl.expand_dims(rvalid, 1))
    srow: gl.constexpr = gl.SliceLayout(1, SCALE_L)
    sdata = gl.convert_layout(blk * stride_blk + block_size * 576 + off * 8, srow, assert_trivial=True)
    svalid = gl.convert_layout(valid, srow, assert_trivial=True)
    sb = gl.arange(0, 8, layout=gl.SliceLayout(0, SCALE_L))
    _async_load(scale_buf, cache_ptr + gl.expand_dims(sdata, 1) + gl.expand_dims(sb, 0),
                                   mask=gl.expand_dims(svalid, 1))
    cp.commit_group()
    valid_buf.store(valid.to(gl.int8))


@gluon.jit
def _entries(t, c, idx_ptr, stride_idx, length, bt_ptr, stride_bt, max_blocks, start, req, block_size,
             IS_RANGE: gl.constexpr, LAYOUT: gl.constexpr = ROW_L):
    """Issue the slot-lookup reads of chunk ``c`` (in the issuing layout; consumed by
    :func:`_issue_chunk` / :func:`_issue_chunk_bf16` one step later)."""
    j = c * BLOCK_N + gl.arange(0, BLOCK_N, layout=LAYOUT)
    return _candidate_entry(t, j, idx_ptr, stride_idx, length, bt_ptr, stride_bt, max_blocks, start, req, block_size,
                            IS_RANGE)


@gluon.jit
def _extent(t, width, len_ptr, req_ptr, start_ptr, num_reqs, max_blocks, block_size, IS_RANGE: gl.constexpr,
            HAS_LEN: gl.constexpr):
    """(start, length, req) of token t's candidates in one set, as the portable kernel: the
    length capped by the index width, a range clipped to its block-table row."""
    if HAS_LEN:
        length = gl.minimum(gl.load(len_ptr + t), width)
    else:
        length = t * 0 + width
    req = 0
    start = 0
    if IS_RANGE:
        req = gl.load(req_ptr + t)
        start, length = _clip_range(gl.load(start_ptr + t), length, req, num_reqs, max_blocks * block_size)
    return start, length, req


@gluon.jit
def _dequant_chunk(raw_buf, rope_buf, scale_buf, k_smem):
    """Raw stage -> bf16 K [64, 512] in shared memory with one store (Triton's barrier pass
    fences every store into part of one buffer, so row or column slices would each cost a CTA
    barrier; the caller synchronises around it). Scale of (row, tile) = 2^(byte - 127); tile 7
    is the RoPE, whose raw bytes and scale byte are padding."""
    L64: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, 1, 4], [8, 1, 1], [2, 1, 0])
    raw = raw_buf.load(L64)
    e = scale_buf.load(gl.SliceLayout(2, L64)).to(gl.uint32)
    scale = (e << 23).to(gl.float32, bitcast=True)
    f = (raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(scale, 2)).to(gl.bfloat16)
    rope = gl.expand_dims(rope_buf.load(gl.SliceLayout(1, L64)), 1)
    tile = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L64))), 0), 2)
    f = gl.where(tile < 7, f, rope)
    k_smem.store(gl.reshape(f, [BLOCK_N, HEAD_DIM]))


@gluon.jit
def _set_pass(t, split, num_splits, q_smem, k_smem, p_smem, mx_smem, raw_bufs, rope_bufs, scale_bufs, valid_bufs, o, m_i, l_i,
              start, length, req, x, cache_ptr, stride_blk, block_size, capacity,
              idx_ptr, stride_idx, bt_ptr, stride_bt, max_blocks,
              qk_scale, IS_RANGE: gl.constexpr, FIRST_ISSUED: gl.constexpr, SKIP: gl.constexpr):
    """Attend chunks ``split, split + num_splits, ...`` of one set (online softmax, base 2);
    ``(start, length, req)`` from :func:`_extent` and ``x`` the first chunk's slot reads, both
    issued at the kernel's start; with FIRST_ISSUED that chunk's gathers are in flight too.

    Pipeline per chunk c: the slot-lookup reads of chunk c + 2 steps and the page gathers
    (cp.async) of chunk c + 1 step are in flight while chunk c is dequantised and multiplied.
    ``SKIP`` (profiling only, 0 in production): 1 skips dequantisation, 2 the MMAs, 4 the
    page gathers."""
    n_chunks = gl.cdiv(length, BLOCK_N)
    if not FIRST_ISSUED:
        _issue_chunk(raw_bufs.index(0), rope_bufs.index(0), scale_bufs.index(0), valid_bufs.index(0), cache_ptr, x,
                     split, start, block_size, capacity, stride_blk, IS_RANGE, SKIP)
    x = _entries(t, split + num_splits, idx_ptr, stride_idx, length, bt_ptr, stride_bt, max_blocks, start, req,
                 block_size, IS_RANGE)
    it = 0
    for c in range(split, n_chunks, num_splits):
        st = it % 2
        _issue_chunk(raw_bufs.index(1 - st), rope_bufs.index(1 - st), scale_bufs.index(1 - st),
                     valid_bufs.index(1 - st), cache_ptr, x, c + num_splits, start, block_size, capacity, stride_blk,
                     IS_RANGE, SKIP)
        x = _entries(t, c + 2 * num_splits, idx_ptr, stride_idx, length, bt_ptr, stride_bt, max_blocks, start, req,
                     block_size, IS_RANGE)
        cp.wait_group(1)
        _cta_barrier()
        if (SKIP & 1) == 0:
            _dequant_chunk(raw_bufs.index(st), rope_bufs.index(st), scale_bufs.index(st), k_smem)
        fence_async_shared()
        _cta_barrier()
        if (SKIP & 2) == 0:
            s = warpgroup_mma(q_smem, k_smem.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L),
                              use_acc=False)
        else:
            s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L)
        o, m_i, l_i = _softmax_pv(s, valid_bufs.index(st), o, m_i, l_i, p_smem, mx_smem, k_smem, qk_scale, SKIP)
        it += 1
    cp.wait_group(0)
    _cta_barrier()
    return o, m_i, l_i


@gluon.jit
def _softmax_pv(s, valid_buf, o, m_i, l_i, p_smem, mx_smem, v_smem, qk_scale, SKIP: gl.constexpr):
    """One online-softmax step (base 2) on the logits ``s`` [64, 64] of a chunk (invalid
    candidates -inf) and ``O += P V`` with V the chunk's K tile in ``v_smem``. ``l_i`` is kept
    per element ([64, 64], summed once in the epilogue) and the row maxima of the two
    warpgroups' column halves meet in ``mx_smem`` [64, 2]: one CTA barrier for the softmax."""
    ok = gl.expand_dims(valid_buf.load(gl.SliceLayout(0, S_L)) != 0, 0)
    s = gl.where(ok, s * qk_scale, float("-inf"))
    half = gl.max(gl.reshape(s, [BLOCK_H, 2, BLOCK_N // 2]), axis=2)  # [64, 2]: within each warpgroup
    mx_smem.store(half)
    _cta_barrier()
    m_new = gl.maximum(m_i, gl.max(mx_smem.load(S_L), axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - gl.expand_dims(m_safe, 1))
    l_i = l_i * gl.expand_dims(alpha, 1) + p
    p_smem.store(p.to(gl.bfloat16))
    fence_async_shared()
    _cta_barrier()
    o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
    if (SKIP & 2) == 0:
        o = warpgroup_mma(p_smem, v_smem, o)
    return o, m_new, l_i


@gluon.jit
def _issue_chunk_bf16(k_buf, valid_buf, cache_ptr, x, c, start, block_size, capacity, stride_blk, stride_entry,
                      IS_RANGE: gl.constexpr):
    """bf16 pages: start the cp.async gather of chunk ``c``'s rows (512 bf16 each) straight
    into a K stage (wgmma layout); invalid candidates are zero-filled, never read."""
    j = c * BLOCK_N + gl.arange(0, BLOCK_N, layout=KB_ROW_L)
    blk, off, valid = _candidate_place(x, j, start, block_size, capacity, IS_RANGE)
    data = blk * stride_blk + off * stride_entry
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, KB_L))
    _async_load(k_buf, cache_ptr + gl.expand_dims(data, 1) + gl.expand_dims(d, 0),
                                   mask=gl.expand_dims(valid, 1))
    cp.commit_group()
    valid_buf.store(valid.to(gl.int8))


@gluon.jit
def _set_pass_bf16(t, split, num_splits, q_smem, k_bufs, p_smem, mx_smem, valid_bufs, o, m_i, l_i,
                   start, length, req, x, cache_ptr, stride_blk, stride_entry, block_size, capacity,
                   idx_ptr, stride_idx, bt_ptr, stride_bt, max_blocks,
                   qk_scale, IS_RANGE: gl.constexpr, FIRST_ISSUED: gl.constexpr):
    """:func:`_set_pass` for bf16 pages: no dequantisation; the rows of chunk c + 1 step land
    in the other K stage while chunk c is multiplied."""
    n_chunks = gl.cdiv(length, BLOCK_N)
    if not FIRST_ISSUED:
        _issue_chunk_bf16(k_bufs.index(0), valid_bufs.index(0), cache_ptr, x, split, start, block_size, capacity,
                          stride_blk, stride_entry, IS_RANGE)
    x = _entries(t, split + num_splits, idx_ptr, stride_idx, length, bt_ptr, stride_bt, max_blocks, start, req,
                 block_size, IS_RANGE, KB_ROW_L)
    it = 0
    for c in range(split, n_chunks, num_splits):
        st = it % 2
        cp.wait_group(0)
        fence_async_shared()
        _cta_barrier()
        # K stage 1 - st was last read by the previous chunk's P V (finished: synchronous wgmma).
        _issue_chunk_bf16(k_bufs.index(1 - st), valid_bufs.index(1 - st), cache_ptr, x, c + num_splits, start,
                          block_size, capacity, stride_blk, stride_entry, IS_RANGE)
        x = _entries(t, c + 2 * num_splits, idx_ptr, stride_idx, length, bt_ptr, stride_bt, max_blocks, start, req,
                     block_size, IS_RANGE, KB_ROW_L)
        k_cur = k_bufs.index(st)
        s = warpgroup_mma(q_smem, k_cur.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L), use_acc=False)
        o, m_i, l_i = _softmax_pv(s, valid_bufs.index(st), o, m_i, l_i, p_smem, mx_smem, k_cur, qk_scale, 0)
        it += 1
    cp.wait_group(0)
    _cta_barrier()
    return o, m_i, l_i


@gluon.jit
def _sparse_mla_attn_sm90_kernel(
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
    A_LEN: gl.constexpr, B_LEN: gl.constexpr, PAGES_BF16: gl.constexpr = False, WRITE_MAX: gl.constexpr = False,
    SKIP: gl.constexpr = 0,
):
    """Grid ``(num_tokens * cdiv(num_heads, 64), num_splits)``, head tiles fastest (as the
    portable kernel). Both sets are fp8 pages of the 448 + 64 layout, or with PAGES_BF16 both
    bf16 pages (512 contiguous bf16 per entry; strides in elements). WRITE_MAX (only without
    split-KV) also writes each row's max scaled logit, as the portable kernel does."""
    tiles = gl.cdiv(num_heads, BLOCK_H)
    t = gl.program_id(0) // tiles
    pid_h = gl.program_id(0) % tiles
    split = gl.program_id(1)
    t64 = t.to(gl.int64)

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, HEAD_DIM], MMA_SMEM)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], MMA_SMEM)
    valid_bufs = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N], VEC_SMEM)
    mx_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H, 2], FLAT_SMEM)
    if PAGES_BF16:
        k_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HEAD_DIM], MMA_SMEM)
    else:
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, HEAD_DIM], MMA_SMEM)
        raw_bufs = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, 8, 64], RAW_SMEM)
        rope_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, 64], FLAT_SMEM)
        scale_bufs = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, 8], FLAT_SMEM)

    # The slot reads of both sets' first chunks and set A's first gathers go out before q is
    # loaded: their dependent global reads (length -> index -> block table -> page) overlap q's
    # load and, for set B, set A's whole pass.
    XL: gl.constexpr = KB_ROW_L if PAGES_BF16 else ROW_L
    a_start, a_len, a_req = _extent(t, a_width, a_len_ptr, a_req_ptr, a_start_ptr, a_num_reqs, a_max_blocks,
                                    a_block_size, A_RANGE, A_LEN)
    xa = _entries(t, split, a_idx_ptr, a_stride_idx, a_len, a_bt_ptr, a_stride_bt, a_max_blocks, a_start, a_req,
                  a_block_size, A_RANGE, XL)
    if HAS_B:
        b_start, b_len, b_req = _extent(t, b_width, b_len_ptr, b_req_ptr, b_start_ptr, b_num_reqs, b_max_blocks,
                                        b_block_size, B_RANGE, B_LEN)
        xb = _entries(t, split, b_idx_ptr, b_stride_idx, b_len, b_bt_ptr, b_stride_bt, b_max_blocks, b_start, b_req,
                      b_block_size, B_RANGE, XL)
    if PAGES_BF16:
        _issue_chunk_bf16(k_bufs.index(0), valid_bufs.index(0), a_cache_ptr, xa, split, a_start, a_block_size,
                          a_capacity, a_stride_blk, a_stride_entry, A_RANGE)
    else:
        _issue_chunk(raw_bufs.index(0), rope_bufs.index(0), scale_bufs.index(0), valid_bufs.index(0), a_cache_ptr, xa,
                     split, a_start, a_block_size, a_capacity, a_stride_blk, A_RANGE, SKIP)

    dq = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, Q_L))
    for r in gl.static_range(0, BLOCK_H, 16):
        hq = pid_h * BLOCK_H + r + gl.arange(0, 16, layout=gl.SliceLayout(1, Q_L))
        hq_ok = hq < num_heads
        q = gl.load(q_ptr + t64 * stride_q_t + gl.expand_dims(gl.where(hq_ok, hq, 0) * stride_q_h, 1)
                    + gl.expand_dims(dq, 0), mask=gl.expand_dims(hq_ok, 1), other=0.0)
        q_smem.slice(r, 16, dim=0).store(q.to(gl.bfloat16))

    o = gl.zeros([BLOCK_H, HEAD_DIM], gl.float32, O_L)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L)
    # q_smem is published by the barriers inside the first chunk (fence + barrier before wgmma).
    if PAGES_BF16:
        o, m_i, l_i = _set_pass_bf16(
            t, split, num_splits, q_smem, k_bufs, p_smem, mx_smem, valid_bufs, o, m_i, l_i,
            a_start, a_len, a_req, xa, a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity,
            a_idx_ptr, a_stride_idx, a_bt_ptr, a_stride_bt, a_max_blocks, qk_scale, A_RANGE, True)
        if HAS_B:
            o, m_i, l_i = _set_pass_bf16(
                t, split, num_splits, q_smem, k_bufs, p_smem, mx_smem, valid_bufs, o, m_i, l_i,
                b_start, b_len, b_req, xb, b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity,
                b_idx_ptr, b_stride_idx, b_bt_ptr, b_stride_bt, b_max_blocks, qk_scale, B_RANGE, False)
    else:
        o, m_i, l_i = _set_pass(
            t, split, num_splits, q_smem, k_smem, p_smem, mx_smem, raw_bufs, rope_bufs, scale_bufs, valid_bufs, o, m_i,
            l_i, a_start, a_len, a_req, xa, a_cache_ptr, a_stride_blk, a_block_size, a_capacity,
            a_idx_ptr, a_stride_idx, a_bt_ptr, a_stride_bt, a_max_blocks, qk_scale, A_RANGE, True, SKIP)
        if HAS_B:
            o, m_i, l_i = _set_pass(
                t, split, num_splits, q_smem, k_smem, p_smem, mx_smem, raw_bufs, rope_bufs, scale_bufs, valid_bufs, o,
                m_i, l_i, b_start, b_len, b_req, xb, b_cache_ptr, b_stride_blk, b_block_size, b_capacity,
                b_idx_ptr, b_stride_idx, b_bt_ptr, b_stride_bt, b_max_blocks, qk_scale, B_RANGE, False, SKIP)

    _epilogue(o, m_i, l_i, t64, pid_h, split, num_heads, out_ptr, stride_o_t, stride_o_h, lse_ptr, stride_lse_t,
              max_ptr, stride_max_t, part_o_ptr, part_lse_ptr, sink_ptr, split_base, total_splits,
              HAS_SINK, WRITE_PARTIAL, OUT_BF16, WRITE_MAX)


@gluon.jit
def _row_stats(m_i, l_i, h, t64, split, num_heads, lse_ptr, stride_lse_t, max_ptr, stride_max_t, part_lse_ptr,
               sink_ptr, split_base, total_splits, HAS_SINK: gl.constexpr, WRITE_PARTIAL: gl.constexpr,
               WRITE_MAX: gl.constexpr):
    """The end of a split's softmax for heads ``h`` (running max ``m_i`` and sum ``l_i``, base
    2): writes the lse (natural log; +inf for a row with no valid candidate) and the max logits,
    or the split-KV partial's base-2 lse (-inf when empty), and returns each row's output factor
    (``1 / l``, with the sink's share taken out; 0 for an empty row)."""
    h_ok = h < num_heads
    hc = gl.where(h_ok, h, 0)
    is_empty = l_i == 0.0
    l_safe = gl.where(is_empty, 1.0, l_i)
    lse2 = gl.where(is_empty, float("-inf"), m_i + gl.log2(l_safe))
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
            gl.store(max_ptr + t64 * stride_max_t + hc, m_i * LN2, mask=h_ok)
    return f


@gluon.jit
def _epilogue(o, m_i, l_i, t64, pid_h, split, num_heads, out_ptr, stride_o_t, stride_o_h, lse_ptr, stride_lse_t,
              max_ptr, stride_max_t, part_o_ptr, part_lse_ptr, sink_ptr, split_base, total_splits,
              HAS_SINK: gl.constexpr, WRITE_PARTIAL: gl.constexpr, OUT_BF16: gl.constexpr, WRITE_MAX: gl.constexpr):
    """Write a program's result from the unnormalised ``o`` [64, 512], the row max ``m_i``
    (base 2) and the per-element row sums ``l_i`` [64, 64]: the split-KV partial (normalised O,
    base-2 lse) or the final output with the sink, lse (+inf for empty rows) and max logits."""
    # In O's layout (rows = heads).
    h = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
    f = _row_stats(gl.convert_layout(m_i, gl.SliceLayout(1, O_L)),
                   gl.convert_layout(gl.sum(l_i, axis=1), gl.SliceLayout(1, O_L)), h, t64, split, num_heads,
                   lse_ptr, stride_lse_t, max_ptr, stride_max_t, part_lse_ptr, sink_ptr, split_base, total_splits,
                   HAS_SINK, WRITE_PARTIAL, WRITE_MAX)
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_L))
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
