"""Warp-specialised Hopper (sm90) sparse MLA attention kernel in Gluon, fp8 and bf16 pages.

Same grid, arguments and outputs as :func:`dsv4attn.kernels.sparse_attn_sm90._sparse_mla_attn_sm90_kernel`
on fp8 pages of the 448 + 64 layout or bf16 pages (the launcher picks one or the other; on bf16
pages the producer copies rows with ``cp.async`` instead of dequantising). One CTA of 12 warps in
three partitions (on fp8 pages by default 16 in four: ``DUAL``, below) that share q, two K stages
[64, 512] bf16, P and the per-chunk validity vectors in shared memory and hand work over with
mbarriers (docs/design.md, "Attention kernel"):

- the **producer** (4 warps, 128 registers) gathers each 64-candidate chunk with plain 16-byte
  loads into registers, issued before it waits for a free K stage (slot lookups one chunk ahead),
  asks L2 for the next chunk's lines, dequantises (hardware e4m3 -> f32, times the tile's
  2^(byte-127), RoPE merged in registers) and writes the bf16 tile into the stage (full
  barrier). Holding the *next* chunk's loads in loop-carried registers while dequantising this
  one spilled heavily; loading both halves of a chunk before dequantising either does not. With
  ``PIPE`` (splits of many chunks) the loads run half a chunk ahead instead, carried as 32-bit
  words (:func:`_produce_set_pipe`);
- **warpgroup 0** (the default partition, 216 registers) computes all of ``S = q K^T`` for a
  chunk (one 64 x 64 x 512 wgmma: q is read from shared memory once), runs the online softmax
  alone (row maxima within the warpgroup: no exchange), keeps P in registers for its half of
  ``O += P V`` (V columns 0-255, register-operand wgmma) and hands P and the rescale factors to
  warpgroup 1 through shared memory (one buffer per K stage);
- **warpgroup 1** (160 registers) waits for them and computes the other half (columns 256-511);
- both release the K stage (the empty barrier counts two arrivals), so warpgroup 0 computes S of
  chunk c+1 while warpgroup 1 still multiplies chunk c, and the producer dequantises chunk c+1
  meanwhile. At the end warpgroup 0 publishes each row's normalisation factor; each warpgroup
  writes its half of the output.

Invalid candidates are never dereferenced (masked loads; prefetches of invalid candidates ask
for the cache's first line) and get -inf logits from the per-chunk validity vector, as in every
kernel of the library.

With ``CLUSTER`` (65-128 heads, fp8 pages; ``KernelConfig.sm90_cluster``, the default) a
token's two head tiles run as one cluster of two CTAs whose producers each dequantise half of
every chunk into both CTAs' K stages (:func:`_produce_set_cluster`; inline PTX, see the comment
above :data:`_CL_BASE`).

With ``DUAL`` (fp8 pages; ``KernelConfig.sm90_dual_producer``, the default) the CTA has 16 warps:
two producer warpgroups of 80 registers share the gathers and the dequantisation, warpgroup W
filling rows ``32 W ..`` of every chunk (:func:`_rows_start`, :func:`_produce_set_rows`), and
each consumer's half of O is two 64 x 128 accumulators (:func:`_wg0_loop_dual`,
:func:`_wg1_dual`; warpgroup 0 then has 192 registers).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait,
)

from dsv4attn.kernels.common import BF16X2_2POW120, BF16X2_NEG_ZERO, e4m3_bits_ptx
from dsv4attn.kernels.sparse_attn_gather import _candidate_entry, _candidate_place
from dsv4attn.kernels.sparse_attn_sm90 import (
    BLOCK_H, BLOCK_N, HEAD_DIM, MMA_SMEM, NOPE, VEC_SMEM, _async_load, _cta_barrier, _extent, _row_stats,
)

#: Warps of the default partition (warpgroup 0); warpgroup 1 and the producer run on top, with
#: these registers per thread (warpgroup 0 gets what is left of the register file: 216).
NUM_WARPS = 4
WG1_REGS = gl.constexpr(160)
PRODUCER_WARPS = gl.constexpr(4)
PRODUCER_REGS = gl.constexpr(128)
#: ``DUAL``: each of the two producer warpgroups' registers (warpgroup 0 then gets 192).
DUAL_PRODUCER_REGS = gl.constexpr(80)
#: Rows per producer step (half a chunk).
HALF = gl.constexpr(32)
# Producer layout [32 rows, 8 tiles, 64 bytes]: a lane holds 16 bytes of one row, 4 lanes a
# 64-byte tile, 8 rows per warp; each thread covers one row x 8 tiles (tile 7 = RoPE, loaded as
# bf16 through R_L, which gives each thread 16 RoPE values of the same row).
P_L = gl.constexpr(gl.BlockedLayout([1, 1, 16], [8, 1, 4], [4, 1, 1], [2, 1, 0]))
P_ROW = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, P_L)))
P_TILE = gl.constexpr(gl.SliceLayout(0, gl.SliceLayout(2, P_L)))
P_COL = gl.constexpr(gl.SliceLayout(0, gl.SliceLayout(1, P_L)))
R_L = gl.constexpr(gl.SliceLayout(1, P_L))
# L2 prefetch of a half-chunk: [32 rows, 8 addresses] (the row's 128-byte lines and its scale
# word), two per thread.
PF_L = gl.constexpr(gl.BlockedLayout([1, 2], [8, 4], [4, 1], [1, 0]))


@gluon.jit
def _n_mine(length, split, num_splits):
    """How many of a set's ``length`` candidates' 64-row chunks split ``split`` takes (chunks
    ``split, split + num_splits, ...``): the producer's and the consumers' one count."""
    return gl.maximum(gl.cdiv(gl.cdiv(length, BLOCK_N) - split, num_splits), 0)


@gluon.jit
def _half_rows(h, split, num_splits):
    """Candidate positions of half-chunk ``h`` of this split: chunk ``split + (h // 2) *
    num_splits``, rows ``(h % 2) * 32 ..`` (the split's chunks interleave as in every kernel)."""
    return (split + (h // 2) * num_splits) * BLOCK_N + (h % 2) * HALF + gl.arange(0, HALF, layout=P_ROW)


@gluon.jit
def _row_place(x, j, start, block_size, capacity, stride_blk, IS_RANGE: gl.constexpr):
    """Byte offsets in the cache of candidates ``j``'s 576 data bytes and 8 scale bytes (from
    their slot lookups ``x``), and their validity: the one address formula of both producers."""
    blk, off, valid = _candidate_place(x, j, start, block_size, capacity, IS_RANGE)
    return blk * stride_blk + off * 576, blk * stride_blk + block_size * 576 + off * 8, valid


@gluon.jit
def _load_half(cache_ptr, x, j, start, block_size, capacity, stride_blk, IS_RANGE: gl.constexpr):
    """Issue the loads of one half-chunk (``x``: its slot-lookup reads): fp8 bytes [32, 8, 64]
    (tile 7 masked), RoPE [32, 64] bf16, the 8 scale bytes per row as one int64, validity."""
    data, scale, valid = _row_place(x, j, start, block_size, capacity, stride_blk, IS_RANGE)
    t3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=P_TILE), 0), 2)
    c3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 64, layout=P_COL), 0), 1)
    d3 = gl.expand_dims(gl.expand_dims(data, 1), 2)
    v3 = gl.expand_dims(gl.expand_dims(valid, 1), 2)
    raw = gl.load(cache_ptr + d3 + t3 * 64 + c3, mask=v3 & (t3 < 7), other=0)
    rrow: gl.constexpr = gl.SliceLayout(1, R_L)
    rdata = gl.convert_layout(data, rrow, assert_trivial=True)
    rvalid = gl.convert_layout(valid, rrow, assert_trivial=True)
    rc = gl.arange(0, 64, layout=gl.SliceLayout(0, R_L))
    rptr = (cache_ptr + rdata + NOPE).to(gl.pointer_type(gl.bfloat16))
    rope = gl.load(gl.expand_dims(rptr, 1) + gl.expand_dims(rc, 0), mask=gl.expand_dims(rvalid, 1), other=0.0)
    sc = gl.load((cache_ptr + scale).to(gl.pointer_type(gl.int64)), mask=valid, other=0)
    return raw, rope, sc, valid


@gluon.jit
def _prefetch_half(cache_ptr, x, j, start, block_size, capacity, stride_blk, IS_RANGE: gl.constexpr):
    """Ask L2 for one half-chunk's rows (every 128-byte line of the 576 data bytes and the scale
    word) ahead of their loads: no registers are held while the lines travel. Invalid
    candidates prefetch the cache's first line instead (never an address outside the cache)."""
    xr = gl.convert_layout(x, gl.SliceLayout(1, PF_L))
    jr = gl.convert_layout(j, gl.SliceLayout(1, PF_L))
    blk, off, valid = _candidate_place(xr, jr, start, block_size, capacity, IS_RANGE)
    k = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, PF_L)), 0)
    row = gl.expand_dims(blk * stride_blk, 1)
    line = gl.where(k < 5, row + gl.expand_dims(off * 576, 1) + k * 128, row + gl.expand_dims(off * 576, 1) + 575)
    addr = gl.where(k < 6, line, row + block_size * 576 + gl.expand_dims(off * 8, 1))
    addr = gl.where(gl.expand_dims(valid, 1), addr, 0)
    gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [cache_ptr + addr],
                              dtype=gl.int32, is_pure=False, pack=1)


#: PTX taking one word of four e4m3 bytes ($2) to two bf16x2 words ($0: bytes 0, 1; $1: bytes 2,
#: 3; the first byte in the low half), each pair times its bf16x2 scale ($3, $4): the bit moves
#: of :func:`dsv4attn.kernels.common.e4m3_bits_ptx` and two bf16x2 products per pair (by 2^120,
#: then by the tile's power-of-two scale, with one rounding as in the fp32 chain: the same bf16
#: for every finite byte). The conversion unit, which the e4m3 -> f16 -> f32 -> bf16 chain keeps
#: busy, is not used. 0x7F / 0xFF (e4m3's NaN, never written by a quantiser) come out as +-480 x
#: scale instead of NaN.
_E4M3X4_BF16 = gl.constexpr(
    f"{{ .reg .b32 n, c, z, y, s, u, v; mov.b32 n, 0; mov.b32 c, {BF16X2_2POW120}; mov.b32 z, {BF16X2_NEG_ZERO}; "
    + e4m3_bits_ptx("$2", "n", "0x1404") + "fma.rn.bf16x2 y, y, c, z; fma.rn.bf16x2 u, y, $3, z; "
    + e4m3_bits_ptx("$2", "n", "0x3424") + "fma.rn.bf16x2 y, y, c, z; fma.rn.bf16x2 v, y, $4, z; "
    "mov.b32 $0, u; mov.b32 $1, v; }")


@gluon.jit
def _store_half(raw, rope, sc, valid, k_half, valid_half, DQ_BITS: gl.constexpr):
    """Dequantise a loaded half-chunk into ``k_half`` [32, 512] bf16 (shared, wgmma layout):
    value x 2^(byte-127) per (row, 64-dim tile), exact in bf16; invalid rows are zeros (their
    scale word loads as 0). Tile 7 takes the RoPE values. ``DQ_BITS``: by the integer moves of
    :data:`_E4M3X4_BF16` (four bytes per instance); else through Triton's e4m3 -> f32 casts."""
    tile = gl.arange(0, 8, layout=P_TILE)
    e = (gl.expand_dims(sc, 1) >> (gl.expand_dims(tile, 0) * 8).to(gl.int64)) & 255
    if DQ_BITS:
        scale_b = gl.broadcast(gl.expand_dims((e.to(gl.int16) << 7).to(gl.bfloat16, bitcast=True), 2), raw)[0]
        f = gl.inline_asm_elementwise(_E4M3X4_BF16, "=r,=r,r,r,r", [raw, scale_b], dtype=gl.bfloat16,
                                      is_pure=True, pack=4)
    else:
        scale = (e.to(gl.uint32) << 23).to(gl.float32, bitcast=True)
        f = (raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(scale, 2)).to(gl.bfloat16)
    t3 = gl.expand_dims(gl.expand_dims(tile, 0), 2)
    f = gl.where(t3 < 7, f, gl.expand_dims(rope, 1))
    k_half.store(gl.reshape(f, [HALF, HEAD_DIM]))
    valid_half.store(valid.to(gl.int8))


@gluon.jit
def _hand_over(full, st):
    """A producer's end of stage ``st``: its generic-proxy stores (or ``cp.async`` copies) fenced
    before the consumers' wgmma reads, every thread of the partition done, then its one arrive."""
    fence_async_shared()
    _cta_barrier()
    mbarrier.arrive(full.index(st))


@gluon.jit
def _set_start(t, split, num_splits, block_size, idx_ptr, stride_idx, width, len_ptr, bt_ptr, stride_bt, max_blocks,
               num_reqs, req_ptr, start_ptr, IS_RANGE: gl.constexpr, HAS_LEN: gl.constexpr):
    """A producer's start on one candidate set: the set's extent for token ``t``, this split's
    chunk count, and the slot lookups of its first two chunks (half-chunks 0-3)."""
    start, length, req = _extent(t, width, len_ptr, req_ptr, start_ptr, num_reqs, max_blocks, block_size, IS_RANGE,
                                 HAS_LEN)
    n_mine = _n_mine(length, split, num_splits)
    x0 = _candidate_entry(t, _half_rows(0, split, num_splits), idx_ptr, stride_idx, length, bt_ptr, stride_bt,
                          max_blocks, start, req, block_size, IS_RANGE)
    x1 = _candidate_entry(t, _half_rows(1, split, num_splits), idx_ptr, stride_idx, length, bt_ptr, stride_bt,
                          max_blocks, start, req, block_size, IS_RANGE)
    y0 = _candidate_entry(t, _half_rows(2, split, num_splits), idx_ptr, stride_idx, length, bt_ptr, stride_bt,
                          max_blocks, start, req, block_size, IS_RANGE)
    y1 = _candidate_entry(t, _half_rows(3, split, num_splits), idx_ptr, stride_idx, length, bt_ptr, stride_bt,
                          max_blocks, start, req, block_size, IS_RANGE)
    return start, length, req, n_mine, x0, x1, y0, y1


@gluon.jit
def _produce_set(it, k_bufs, valid_bufs, empty, full, t, split, num_splits,
                 cache_ptr, stride_blk, block_size, capacity,
                 idx_ptr, stride_idx, width, len_ptr, bt_ptr, stride_bt, max_blocks, num_reqs, req_ptr, start_ptr,
                 IS_RANGE: gl.constexpr, HAS_LEN: gl.constexpr, PREFETCH: gl.constexpr,
                 DQ_BITS: gl.constexpr):
    """Fill K stages with this split's chunks of one candidate set, in order; ``it`` counts the
    chunks produced so far (stage ``it % 2``, phase ``it // 2``). Per chunk: all its page loads
    are issued (slot lookups read one chunk ahead) before waiting for the stage to be free, so
    their latency runs under the consumers' work on the other stage; then both halves are
    dequantised into the stage. (Holding the next chunk's loads in registers across the
    dequantisation, one step further ahead, spills the producer's registers.)"""
    start, length, req, n_mine, x0, x1, y0, y1 = _set_start(t, split, num_splits, block_size, idx_ptr, stride_idx,
                                                            width, len_ptr, bt_ptr, stride_bt, max_blocks, num_reqs,
                                                            req_ptr, start_ptr, IS_RANGE, HAS_LEN)
    for h in range(0, 2 * n_mine, 2):
        raw0, rope0, sc0, v0 = _load_half(cache_ptr, x0, _half_rows(h, split, num_splits), start, block_size,
                                          capacity, stride_blk, IS_RANGE)
        raw1, rope1, sc1, v1 = _load_half(cache_ptr, x1, _half_rows(h + 1, split, num_splits), start, block_size,
                                          capacity, stride_blk, IS_RANGE)
        if PREFETCH:  # the next chunk's lines, while this one is loaded and dequantised
            _prefetch_half(cache_ptr, y0, _half_rows(h + 2, split, num_splits), start, block_size, capacity,
                           stride_blk, IS_RANGE)
            _prefetch_half(cache_ptr, y1, _half_rows(h + 3, split, num_splits), start, block_size, capacity,
                           stride_blk, IS_RANGE)
        x0 = y0
        x1 = y1
        y0 = _candidate_entry(t, _half_rows(h + 4, split, num_splits), idx_ptr, stride_idx, length, bt_ptr,
                              stride_bt, max_blocks, start, req, block_size, IS_RANGE)
        y1 = _candidate_entry(t, _half_rows(h + 5, split, num_splits), idx_ptr, stride_idx, length, bt_ptr,
                              stride_bt, max_blocks, start, req, block_size, IS_RANGE)
        st = it % 2
        mbarrier.wait(empty.index(st), ((it // 2) & 1) ^ 1)  # a fresh barrier passes parity 1
        k_buf = k_bufs.index(st)
        valid_buf = valid_bufs.index(st)
        _store_half(raw0, rope0, sc0, v0, k_buf.slice(0, HALF, dim=0), valid_buf.slice(0, HALF, dim=0), DQ_BITS)
        _store_half(raw1, rope1, sc1, v1, k_buf.slice(HALF, HALF, dim=0), valid_buf.slice(HALF, HALF, dim=0), DQ_BITS)
        _hand_over(full, st)
        it += 1
    return it


@gluon.jit
def _first_entries(t, j, idx_ptr, stride_idx, width, length):
    """An indices-form set's first slot reads (:func:`_candidate_entry`) issued together with the
    length read instead of after it: entries ``j < width`` (inside the index row) are read, and
    those at or past ``length`` become -1 (invalid) once it arrives. A CTA's first gathers then
    wait for two dependent reads (index, page) instead of three."""
    x = gl.load(idx_ptr + t.to(gl.int64) * stride_idx + gl.where(j < width, j, 0), mask=j < width, other=-1)
    return gl.where(j < length, x, -1)


@gluon.jit
def _rows_start(t, split, num_splits, block_size, idx_ptr, stride_idx, width, len_ptr, bt_ptr, stride_bt, max_blocks,
                num_reqs, req_ptr, start_ptr, W: gl.constexpr, IS_RANGE: gl.constexpr, HAS_LEN: gl.constexpr):
    """Producer warpgroup ``W``'s start on one candidate set (``DUAL``): the set's extent for token
    ``t`` and the slot lookups of its half of the split's first two chunks. An indices-form set's
    index reads go out with the length read instead of after it (:func:`_first_entries`)."""
    start, length, req = _extent(t, width, len_ptr, req_ptr, start_ptr, num_reqs, max_blocks, block_size, IS_RANGE,
                                 HAS_LEN)
    if IS_RANGE:
        x = _candidate_entry(t, _half_rows(W, split, num_splits), idx_ptr, stride_idx, length, bt_ptr, stride_bt,
                             max_blocks, start, req, block_size, IS_RANGE)
        y = _candidate_entry(t, _half_rows(2 + W, split, num_splits), idx_ptr, stride_idx, length, bt_ptr,
                             stride_bt, max_blocks, start, req, block_size, IS_RANGE)
    else:
        x = _first_entries(t, _half_rows(W, split, num_splits), idx_ptr, stride_idx, width, length)
        y = _first_entries(t, _half_rows(2 + W, split, num_splits), idx_ptr, stride_idx, width, length)
    return start, length, req, x, y


@gluon.jit
def _produce_set_rows(it, k_bufs, valid_bufs, empty, full, t, split, num_splits,
                      cache_ptr, stride_blk, block_size, capacity,
                      idx_ptr, stride_idx, bt_ptr, stride_bt, max_blocks, start, length, req, x, y,
                      W: gl.constexpr, IS_RANGE: gl.constexpr, PREFETCH: gl.constexpr, DQ_BITS: gl.constexpr):
    """One of the two producer warpgroups of ``DUAL``: :func:`_produce_set` for rows ``32 W ..``
    of every chunk only (half-chunk ``2 i + W``), from :func:`_rows_start`'s extent and first
    lookups. The other warpgroup fills the other half of the same stage; each arrives on the
    stage's full barrier (two arrivals). Per chunk its loads are issued and the lines of its
    next half asked of L2 before it waits for the stage, so each warpgroup's loads travel while
    the other one dequantises."""
    n_mine = _n_mine(length, split, num_splits)
    for i in range(n_mine):
        h = 2 * i + W
        raw, rope, sc, v = _load_half(cache_ptr, x, _half_rows(h, split, num_splits), start, block_size, capacity,
                                      stride_blk, IS_RANGE)
        if PREFETCH:  # this warpgroup's half of the next chunk
            _prefetch_half(cache_ptr, y, _half_rows(h + 2, split, num_splits), start, block_size, capacity,
                           stride_blk, IS_RANGE)
        x = y
        y = _candidate_entry(t, _half_rows(h + 4, split, num_splits), idx_ptr, stride_idx, length, bt_ptr,
                             stride_bt, max_blocks, start, req, block_size, IS_RANGE)
        st = it % 2
        mbarrier.wait(empty.index(st), ((it // 2) & 1) ^ 1)  # a fresh barrier passes parity 1
        _store_half(raw, rope, sc, v, k_bufs.index(st).slice(W * HALF, HALF, dim=0),
                    valid_bufs.index(st).slice(W * HALF, HALF, dim=0), DQ_BITS)
        _hand_over(full, st)
        it += 1
    return it


# The pipelined producer (``PIPE``) carries half a chunk's loads across the loop's back edge; as
# 32-bit words (a uint8 tensor carried through a loop takes one register per byte), one tensor
# per 64-dim tile, dequantised four tiles at a time (so its bf16 pairs do not all wait in
# registers for one store). [32 rows, 16 words]: a lane holds 16 bytes of one
# row's tile, 4 lanes a row, 8 rows per warp; dequantised, [32, 32] words, 32 bytes per lane.
WT_L = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0]))
WTO_L = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0]))
# The cluster's two producers (``DUAL`` with ``CLUSTER``): a lane holds 8 fp8 bytes of one row's
# tile, 8 lanes a row, 4 rows per warp; dequantised, [32, 32] words with one 16-byte chunk per
# lane, so that one store instruction of a warp writes 4 whole 128-byte rows of a K stage
# (contiguous in both CTAs: a remote store of 32 scattered 16-byte pieces costs far more).
WC_L = gl.constexpr(gl.BlockedLayout([1, 2], [4, 8], [4, 1], [1, 0]))
WCO_L = gl.constexpr(gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0]))
WC_ROW = gl.constexpr(gl.SliceLayout(1, WC_L))
#: A K stage seen as 32-bit words (same bytes, same 128-byte swizzle).
MMA_SMEM32 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
#: Triton 3.9 names it ``reinterpret``, 3.6 ``_reinterpret``.
_REINTERPRET_39 = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def _stage_words(k_bufs, st):
    """K stage ``st`` as [64, 256] int32 (bf16 pairs, the same bytes)."""
    if _REINTERPRET_39:
        return k_bufs.index(st).reinterpret(gl.int32, [BLOCK_N, 256], MMA_SMEM32)
    else:
        return k_bufs.index(st)._reinterpret(gl.int32, [BLOCK_N, 256], MMA_SMEM32)


@gluon.jit
def _load_tiles(cache_ptr, x, j, start, block_size, capacity, stride_blk, IS_RANGE: gl.constexpr):
    """:func:`_load_half` as 32-bit words: the 7 fp8 tiles [32, 16] int32 each, RoPE [32, 32]
    int32 (bf16 pairs), the scale word, validity."""
    wptr, data, scale, valid = _tile_words(cache_ptr, x, j, start, block_size, capacity, stride_blk, WT_L, IS_RANGE)
    m = gl.expand_dims(valid, 1)
    r0 = gl.load(wptr, mask=m, other=0)
    r1 = gl.load(wptr + 16, mask=m, other=0)
    r2 = gl.load(wptr + 32, mask=m, other=0)
    r3 = gl.load(wptr + 48, mask=m, other=0)
    r4 = gl.load(wptr + 64, mask=m, other=0)
    r5 = gl.load(wptr + 80, mask=m, other=0)
    r6 = gl.load(wptr + 96, mask=m, other=0)
    rope = _rope_words(cache_ptr, data, valid, WTO_L)
    sc = gl.load((cache_ptr + scale).to(gl.pointer_type(gl.int64)), mask=valid, other=0)
    return r0, r1, r2, r3, r4, r5, r6, rope, sc, valid


@gluon.jit
def _tile_words(cache_ptr, x, j, start, block_size, capacity, stride_blk, L: gl.constexpr, IS_RANGE: gl.constexpr):
    """The half-chunk's rows placed in the cache (:func:`_row_place`, one row per ``L`` row):
    [32, 16] int32 pointers to fp8 tile 0 of each row (layout ``L``; tile T is ``+ 16 T``),
    the rows' byte offsets, their scale words' offsets and validity."""
    row: gl.constexpr = gl.SliceLayout(1, L)
    data, scale, valid = _row_place(gl.convert_layout(x, row), gl.convert_layout(j, row), start, block_size,
                                    capacity, stride_blk, IS_RANGE)
    wptr = gl.expand_dims((cache_ptr + data).to(gl.pointer_type(gl.int32)), 1) + gl.expand_dims(
        gl.arange(0, 16, layout=gl.SliceLayout(0, L)), 0)
    return wptr, data, scale, valid


@gluon.jit
def _rope_words(cache_ptr, data, valid, L: gl.constexpr):
    """The rows' RoPE parts (64 bf16 after the NoPE bytes) as [32, 32] int32 in layout ``L``,
    zero for invalid rows."""
    rrow: gl.constexpr = gl.SliceLayout(1, L)
    rptr = (cache_ptr + gl.convert_layout(data, rrow) + NOPE).to(gl.pointer_type(gl.int32))
    return gl.load(gl.expand_dims(rptr, 1) + gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, L)), 0),
                   mask=gl.expand_dims(gl.convert_layout(valid, rrow), 1), other=0)


@gluon.jit
def _dequant_tile(r, sc, T: gl.constexpr, DQ_BITS: gl.constexpr, OUT_L: gl.constexpr = WTO_L):
    """Tile ``T`` [32, 16] words dequantised to [32, 32] words of bf16 pairs (``OUT_L``: WTO_L
    from WT_L, WCO_L from WC_L, each lane's words staying with it): each word's four
    e4m3 bytes times the tile's 2^(byte-127), exactly, by inline PTX: ``DQ_BITS``, integer moves
    and bf16x2 multiplies (:data:`_E4M3X4_BF16`); else e4m3 -> f16 -> f32, the product, -> bf16."""
    e = ((sc >> (8 * T)) & 255).to(gl.uint32)
    if DQ_BITS:
        w = gl.broadcast(gl.expand_dims(((e << 7) | (e << 23)).to(gl.int32, bitcast=True), 1), r)[0]
        lo, hi = gl.inline_asm_elementwise(_E4M3X4_BF16, "=r,=r,r,r,r", [r, w, w], dtype=(gl.int32, gl.int32),
                                           is_pure=True, pack=1)
        return gl.convert_layout(gl.reshape(gl.join(lo, hi), [HALF, 32]), OUT_L)
    scale = gl.expand_dims((e << 23).to(gl.float32, bitcast=True), 1)
    lo, hi = gl.inline_asm_elementwise(
        "{ .reg .b16 l, h, x0, x1, x2, x3; .reg .b32 a, b; .reg .f32 f0, f1, f2, f3; "
        "mov.b32 {l, h}, $2; cvt.rn.f16x2.e4m3x2 a, l; cvt.rn.f16x2.e4m3x2 b, h; "
        "mov.b32 {x0, x1}, a; mov.b32 {x2, x3}, b; "
        "cvt.f32.f16 f0, x0; cvt.f32.f16 f1, x1; cvt.f32.f16 f2, x2; cvt.f32.f16 f3, x3; "
        "mul.f32 f0, f0, $3; mul.f32 f1, f1, $3; mul.f32 f2, f2, $3; mul.f32 f3, f3, $3; "
        "cvt.rn.bf16x2.f32 $0, f1, f0; cvt.rn.bf16x2.f32 $1, f3, f2; }",
        "=r,=r,r,r", [r, gl.broadcast(scale, r)[0]], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    return gl.convert_layout(gl.reshape(gl.join(lo, hi), [HALF, 32]), OUT_L)


@gluon.jit
def _cat4(a, b, c, d):
    """[32, 32] x 4 -> [32, 128] (a | b | c | d), all in each thread's registers."""
    x = gl.join(gl.join(a, b), gl.join(c, d))  # [32, 32, 2 (a / b), 2 (ab / cd)]
    return gl.reshape(gl.permute(x, (0, 3, 2, 1)), [HALF, 128])


@gluon.jit
def _store_tiles(r0, r1, r2, r3, r4, r5, r6, rope, sc, valid, k32, valid_half, DQ_BITS: gl.constexpr):
    """:func:`_load_tiles`' half-chunk, dequantised, into ``k32`` [32, 256] int32 (rows of a K
    stage, bf16 pairs) in two stores of four tiles; tile 7 takes the RoPE words. (Triton fences
    each store into part of one buffer with a barrier of the partition: one store per tile,
    which keeps fewer registers live, measured 10% slower on the H200; one store for all eight
    spills.)"""
    s = gl.convert_layout(sc, gl.SliceLayout(1, WT_L))
    k32.slice(0, 128, dim=1).store(_cat4(_dequant_tile(r0, s, 0, DQ_BITS), _dequant_tile(r1, s, 1, DQ_BITS),
                                         _dequant_tile(r2, s, 2, DQ_BITS), _dequant_tile(r3, s, 3, DQ_BITS)))
    k32.slice(128, 128, dim=1).store(_cat4(_dequant_tile(r4, s, 4, DQ_BITS), _dequant_tile(r5, s, 5, DQ_BITS),
                                           _dequant_tile(r6, s, 6, DQ_BITS), rope))
    valid_half.store(valid.to(gl.int8))


@gluon.jit
def _produce_set_pipe(it, k_bufs, valid_bufs, empty, full, t, split, num_splits,
                      cache_ptr, stride_blk, block_size, capacity,
                      idx_ptr, stride_idx, width, len_ptr, bt_ptr, stride_bt, max_blocks, num_reqs, req_ptr, start_ptr,
                      IS_RANGE: gl.constexpr, HAS_LEN: gl.constexpr, PREFETCH: gl.constexpr,
                      DQ_BITS: gl.constexpr):
    """:func:`_produce_set` with the loads one half-chunk ahead of the dequantisation: half 1's
    loads go out before half 0 is dequantised, and the next chunk's half 0 before half 1 (it is
    carried across the loop's back edge as 32-bit words), so each load has half a chunk's
    dequantisation to arrive in instead of none. A chunk costs less, the set's first chunk
    more (docs/benchmarks.md, Table 36); the launcher picks it for long splits
    (``KernelConfig.sm90_pipe_min_chunks``)."""
    start, length, req, n_mine, x0, x1, y0, y1 = _set_start(t, split, num_splits, block_size, idx_ptr, stride_idx,
                                                            width, len_ptr, bt_ptr, stride_bt, max_blocks, num_reqs,
                                                            req_ptr, start_ptr, IS_RANGE, HAS_LEN)
    a0, a1, a2, a3, a4, a5, a6, rope0, sc0, v0 = _load_tiles(cache_ptr, x0, _half_rows(0, split, num_splits), start,
                                                             block_size, capacity, stride_blk, IS_RANGE)
    for h in range(0, 2 * n_mine, 2):
        b0, b1, b2, b3, b4, b5, b6, rope1, sc1, v1 = _load_tiles(cache_ptr, x1, _half_rows(h + 1, split, num_splits),
                                                                 start, block_size, capacity, stride_blk, IS_RANGE)
        if PREFETCH:  # the next chunk's lines
            _prefetch_half(cache_ptr, y0, _half_rows(h + 2, split, num_splits), start, block_size, capacity,
                           stride_blk, IS_RANGE)
            _prefetch_half(cache_ptr, y1, _half_rows(h + 3, split, num_splits), start, block_size, capacity,
                           stride_blk, IS_RANGE)
        st = it % 2
        mbarrier.wait(empty.index(st), ((it // 2) & 1) ^ 1)  # a fresh barrier passes parity 1
        k_buf = _stage_words(k_bufs, st)
        valid_buf = valid_bufs.index(st)
        _store_tiles(a0, a1, a2, a3, a4, a5, a6, rope0, sc0, v0, k_buf.slice(0, HALF, dim=0),
                     valid_buf.slice(0, HALF, dim=0), DQ_BITS)
        # The next chunk's half 0 (masked off past this split's chunks), then its slot lookups.
        a0, a1, a2, a3, a4, a5, a6, rope0, sc0, v0 = _load_tiles(cache_ptr, y0, _half_rows(h + 2, split, num_splits),
                                                                 start, block_size, capacity, stride_blk, IS_RANGE)
        x1 = y1
        y0 = _candidate_entry(t, _half_rows(h + 4, split, num_splits), idx_ptr, stride_idx, length, bt_ptr,
                              stride_bt, max_blocks, start, req, block_size, IS_RANGE)
        y1 = _candidate_entry(t, _half_rows(h + 5, split, num_splits), idx_ptr, stride_idx, length, bt_ptr,
                              stride_bt, max_blocks, start, req, block_size, IS_RANGE)
        _store_tiles(b0, b1, b2, b3, b4, b5, b6, rope1, sc1, v1, k_buf.slice(HALF, HALF, dim=0),
                     valid_buf.slice(HALF, HALF, dim=0), DQ_BITS)
        _hand_over(full, st)
        it += 1
    return it


# The merged producer (``MERGE``, both sets of one form): ``PIPE``'s loop over this split's
# half-chunks of set A and then of set B as one sequence, so that set B's slot lookups and first
# loads go out while set A's last chunk is dequantised, as any next chunk's do, instead of after
# it (each set's head used to wait for its own chain of reads). Each half-chunk's set is chosen
# by its place in the sequence; the per-set values are scalars.
@gluon.jit
def _g_set(g, n_a, split, num_splits, sa, sb):
    """Half-chunk ``g`` of the merged sequence: its candidate positions in its set and that set's
    values, in the order of ``sa`` / ``sb`` (each set's cache pointer, block stride, block size,
    capacity, index pointer, index stride, length, block-table pointer, its stride, max blocks,
    start, request; set A's ``2 n_a`` half-chunks come first)."""
    in_b = g >= 2 * n_a
    j = _half_rows(g - 2 * n_a * in_b.to(gl.int32), split, num_splits)
    return (j, gl.where(in_b, sb[0], sa[0]), gl.where(in_b, sb[1], sa[1]), gl.where(in_b, sb[2], sa[2]),
            gl.where(in_b, sb[3], sa[3]), gl.where(in_b, sb[4], sa[4]), gl.where(in_b, sb[5], sa[5]),
            gl.where(in_b, sb[6], sa[6]), gl.where(in_b, sb[7], sa[7]), gl.where(in_b, sb[8], sa[8]),
            gl.where(in_b, sb[9], sa[9]), gl.where(in_b, sb[10], sa[10]), gl.where(in_b, sb[11], sa[11]))


@gluon.jit
def _g_entry(t, g, n_a, split, num_splits, sa, sb, IS_RANGE: gl.constexpr):
    """The slot-lookup reads of half-chunk ``g`` of the merged sequence."""
    j, _c, _s, block_size, _cap, idx_ptr, stride_idx, length, bt_ptr, stride_bt, max_blocks, start, req = _g_set(
        g, n_a, split, num_splits, sa, sb)
    return _candidate_entry(t, j, idx_ptr, stride_idx, length, bt_ptr, stride_bt, max_blocks, start, req, block_size,
                            IS_RANGE)


@gluon.jit
def _g_load(x, g, n_a, split, num_splits, sa, sb, IS_RANGE: gl.constexpr):
    """:func:`_load_tiles` of half-chunk ``g`` of the merged sequence (``x``: its lookups)."""
    j, cache_ptr, stride_blk, block_size, capacity, _i, _si, _l, _b, _sb, _m, start, _r = _g_set(
        g, n_a, split, num_splits, sa, sb)
    return _load_tiles(cache_ptr, x, j, start, block_size, capacity, stride_blk, IS_RANGE)


@gluon.jit
def _g_prefetch(x, g, n_a, split, num_splits, sa, sb, IS_RANGE: gl.constexpr):
    """:func:`_prefetch_half` of half-chunk ``g`` of the merged sequence."""
    j, cache_ptr, stride_blk, block_size, capacity, _i, _si, _l, _b, _sb, _m, start, _r = _g_set(
        g, n_a, split, num_splits, sa, sb)
    _prefetch_half(cache_ptr, x, j, start, block_size, capacity, stride_blk, IS_RANGE)


@gluon.jit
def _produce_sets_merged(k_bufs, valid_bufs, empty, full, t, split, num_splits,
                         a_cache_ptr, a_stride_blk, a_block_size, a_capacity, a_idx_ptr, a_stride_idx, a_width,
                         a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
                         b_cache_ptr, b_stride_blk, b_block_size, b_capacity, b_idx_ptr, b_stride_idx, b_width,
                         b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
                         IS_RANGE: gl.constexpr, A_LEN: gl.constexpr, HAS_B: gl.constexpr, B_LEN: gl.constexpr,
                         PREFETCH: gl.constexpr, DQ_BITS: gl.constexpr):
    """:func:`_produce_set_pipe` over both sets as one sequence of half-chunks (``MERGE``)."""
    a_start, a_length, a_req = _extent(t, a_width, a_len_ptr, a_req_ptr, a_start_ptr, a_num_reqs, a_max_blocks,
                                       a_block_size, IS_RANGE, A_LEN)
    n_a = _n_mine(a_length, split, num_splits)
    if HAS_B:
        b_start, b_length, b_req = _extent(t, b_width, b_len_ptr, b_req_ptr, b_start_ptr, b_num_reqs, b_max_blocks,
                                           b_block_size, IS_RANGE, B_LEN)
        n = n_a + _n_mine(b_length, split, num_splits)
    else:
        b_start, b_length, b_req = a_start, a_length * 0, a_req
        n = n_a
    # Each set's values, in the order :func:`_g_set` picks from.
    sa = (a_cache_ptr, a_stride_blk, a_block_size, a_capacity, a_idx_ptr, a_stride_idx, a_length, a_bt_ptr,
          a_stride_bt, a_max_blocks, a_start, a_req)
    sb = (b_cache_ptr, b_stride_blk, b_block_size, b_capacity, b_idx_ptr, b_stride_idx, b_length, b_bt_ptr,
          b_stride_bt, b_max_blocks, b_start, b_req)
    x0 = _g_entry(t, 0, n_a, split, num_splits, sa, sb, IS_RANGE)
    x1 = _g_entry(t, 1, n_a, split, num_splits, sa, sb, IS_RANGE)
    y0 = _g_entry(t, 2, n_a, split, num_splits, sa, sb, IS_RANGE)
    y1 = _g_entry(t, 3, n_a, split, num_splits, sa, sb, IS_RANGE)
    a0, a1, a2, a3, a4, a5, a6, rope0, sc0, v0 = _g_load(x0, 0, n_a, split, num_splits, sa, sb, IS_RANGE)
    for h in range(0, 2 * n, 2):
        b0, b1, b2, b3, b4, b5, b6, rope1, sc1, v1 = _g_load(x1, h + 1, n_a, split, num_splits, sa, sb, IS_RANGE)
        if PREFETCH:  # the next chunk's lines
            _g_prefetch(y0, h + 2, n_a, split, num_splits, sa, sb, IS_RANGE)
            _g_prefetch(y1, h + 3, n_a, split, num_splits, sa, sb, IS_RANGE)
        it = h // 2
        st = it % 2
        mbarrier.wait(empty.index(st), ((it // 2) & 1) ^ 1)  # a fresh barrier passes parity 1
        k_buf = _stage_words(k_bufs, st)
        valid_buf = valid_bufs.index(st)
        _store_tiles(a0, a1, a2, a3, a4, a5, a6, rope0, sc0, v0, k_buf.slice(0, HALF, dim=0),
                     valid_buf.slice(0, HALF, dim=0), DQ_BITS)
        a0, a1, a2, a3, a4, a5, a6, rope0, sc0, v0 = _g_load(y0, h + 2, n_a, split, num_splits, sa, sb, IS_RANGE)
        x1 = y1
        y0 = _g_entry(t, h + 4, n_a, split, num_splits, sa, sb, IS_RANGE)
        y1 = _g_entry(t, h + 5, n_a, split, num_splits, sa, sb, IS_RANGE)
        _store_tiles(b0, b1, b2, b3, b4, b5, b6, rope1, sc1, v1, k_buf.slice(HALF, HALF, dim=0),
                     valid_buf.slice(HALF, HALF, dim=0), DQ_BITS)
        _hand_over(full, st)


# h128 decode in clusters of two CTAs (``CLUSTER``; with one producer slower than two CTAs on the
# H100, docs/benchmarks.md Table 52, with two producers 4.5-4.8% faster, Table 77): the two
# 64-head tiles of a token run in one cluster; each CTA's producers gather and dequantise half of
# every chunk (rows 32 * rank ..) and write it into their own K stage and, with ``st.async``, into
# the peer's, completing on the peer's ``rfull`` barrier; a stage is free once the consumer
# warpgroups of both CTAs released it (``xempty``: each consumer warpgroup arrives on its own
# CTA's and on the peer's). Triton 3.6's Gluon has no cluster stores, barriers or shared-memory
# addresses, so these are inline PTX: the four cluster barriers live in 32 bytes that the
# launcher appends to the dynamic shared memory (``global_smem + %dynamic_smem_size - 32``:
# rfull[0], rfull[1], xempty[0], xempty[1]), and the K stages' offset in ``global_smem``
# (``K_OFF``) is read by the launcher from the compiled kernel.
_CL_BASE = ("mov.u32 b, global_smem; mov.u32 d, %dynamic_smem_size; add.u32 b, b, d; sub.u32 b, b, 32; ")
#: One thread of the partition: predicate p from operand $1, the thread's element of
#: :func:`_cl_one` (reading %tid.x in inline PTX made ptxas spill warpgroup 0's loop, Triton 3.6).
_CL_ONE = "setp.eq.u32 p, $1, 0; "
#: Initialise the four cluster barriers (thread 0 of the CTA) and make them visible cluster-wide.
_CL_INIT = gl.constexpr(
    "{ .reg .u32 b, d; .reg .pred p; " + _CL_ONE + _CL_BASE
    + "@p mbarrier.init.shared::cta.b64 [b], 1; @p mbarrier.init.shared::cta.b64 [b+8], 1; "
    "@p mbarrier.init.shared::cta.b64 [b+16], 4; @p mbarrier.init.shared::cta.b64 [b+24], 4; "
    "fence.mbarrier_init.release.cluster; mov.u32 $0, 0; }")
#: Every thread of the cluster: arrive (relaxed: the barriers' init is released by its own fence) and wait;
#: or the two halves apart, so that a partition done with its remote operations does not wait for the
#: peer until it exits.
_CL_SYNC = gl.constexpr("barrier.cluster.arrive.relaxed.aligned; barrier.cluster.wait.aligned; mov.u32 $0, $1;")
_CL_ARRIVE = gl.constexpr("barrier.cluster.arrive.aligned; mov.u32 $0, $1;")
_CL_WAIT_ALL = gl.constexpr("barrier.cluster.wait.aligned; mov.u32 $0, $1;")
#: Wait for phase parity $2 of the cluster barrier at byte $1 of the area (every thread).
_CL_WAIT = gl.constexpr(
    "{ .reg .u32 b, d, a; .reg .pred p; " + _CL_BASE + "add.u32 a, b, $1; "
    "LAB_WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [a], $2; @!p bra LAB_WAIT; "
    "mov.u32 $0, 0; }")
#: One thread of a consumer warpgroup arrives on xempty barrier $2 of this CTA and of CTA rank $3: the
#: warpgroup is done with the stage.
_CL_RELEASE = gl.constexpr(
    "{ .reg .u32 b, d, a, r; .reg .pred p; " + _CL_ONE + _CL_BASE + "add.u32 a, b, $2; "
    "mapa.shared::cluster.u32 r, a, $3; "
    "@p mbarrier.arrive.shared::cta.b64 _, [a]; "
    "@p mbarrier.arrive.shared::cluster.b64 _, [r]; mov.u32 $0, 0; }")
#: One thread of the producer arrives on rfull barrier $2, expecting the peer's 32 KiB.
_CL_EXPECT = gl.constexpr(
    "{ .reg .u32 b, d, a; .reg .pred p; " + _CL_ONE + _CL_BASE + "add.u32 a, b, $2; "
    "@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [a], 32768; mov.u32 $0, 0; }")
#: $0: the peer's (rank $1) cluster address of global_smem minus this CTA's shared address of it.
_CL_DELTA = gl.constexpr("{ .reg .u32 g, r; mov.u32 g, global_smem; mapa.shared::cluster.u32 r, g, $1; "
                         "sub.u32 $0, r, g; }")
#: The peer's (rank $1) cluster address of its rfull barriers.
_CL_PEER_BAR = gl.constexpr("{ .reg .u32 b, d; " + _CL_BASE + "mapa.shared::cluster.u32 $0, b, $1; }")
#: This CTA's shared address of global_smem + $2.
_CL_SMEM = gl.constexpr("{ .reg .u32 g; mov.u32 g, global_smem; add.u32 $0, g, $2; }")
#: Four words ($4-$7) to shared address $8 + $12 of this CTA and, by st.async, to the same place
#: in the peer's (+ $16), completing 16 bytes on the peer's barrier $20 (pack of 4 words).
_CL_ST2 = gl.constexpr(
    "{ .reg .u32 a, r; add.u32 a, $8, $12; st.shared.v4.b32 [a], {$4, $5, $6, $7}; add.u32 r, a, $16; "
    "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [r], {$4, $5, $6, $7}, [$20]; "
    "mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; }")
_CL_ST2_C = gl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 20))


@gluon.jit
def _cl_op(asm: gl.constexpr, a, b):
    """A cluster PTX helper on scalars $1, $2 (every thread of the partition runs it)."""
    return gl.inline_asm_elementwise(asm, "=r,r,r", [a, b], dtype=gl.int32, is_pure=False, pack=1)


#: One element per thread of a 4-warp partition; element 0 is the partition's thread 0.
LANES_L = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))


@gluon.jit
def _cl_one(asm: gl.constexpr, a, b):
    """A cluster PTX helper that one thread of the 4-warp partition runs (operands $2, $3)."""
    lanes = gl.arange(0, 128, layout=LANES_L)
    gl.inline_asm_elementwise(asm, "=r,r,r,r", [lanes, a, b], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _cl_wait_free(it, st):
    """Wait until the four consumer warpgroups of both CTAs released stage ``st`` of this CTA's
    chunk ``it - 2`` (the first two chunks find their stages free)."""
    if it >= 2:
        _cl_op(_CL_WAIT, 16 + 8 * st, (it // 2 - 1) & 1)


@gluon.jit
def _cl_tile_addr(rank, K_OFF: gl.constexpr, L: gl.constexpr = WTO_L):
    """[32, 32] shared addresses (layout ``L``: WTO_L, or WCO_L for the two producers) of this
    CTA's half-chunk rows (32 * rank + r) in K stage 0, 64-dim tile 0, word w: the stage's
    128-byte swizzle (64-column blocks of 64 rows x 128 bytes, 16-byte chunk c of row R at
    c ^ (R % 8)); only the first word of each thread's 16-byte chunks is used."""
    r = gl.expand_dims(gl.arange(0, HALF, layout=gl.SliceLayout(1, L)), 1)
    w = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, L)), 0)
    base = _cl_op(_CL_SMEM, rank, rank * 0 + K_OFF)
    return base + rank * (HALF * 128) + r * 128 + (((w >> 2) ^ (r & 7)) << 4) + (w & 3) * 4


@gluon.jit
def _cl_st(words, addr, off, delta, bar, L: gl.constexpr = WTO_L):
    """Tile words [32, 32] (layout ``L``) into both CTAs' K stage: ``addr + off`` here and in the peer."""
    zero = gl.full([HALF, 32], 0, gl.int32, L)
    gl.inline_asm_elementwise(_CL_ST2, _CL_ST2_C, [words, addr, zero + off, zero + delta, zero + bar],
                              dtype=gl.int32, is_pure=False, pack=4)


@gluon.jit
def _store_tiles_cl(r0, r1, r2, r3, r4, r5, r6, rope, sc, addr, st, delta, bar, DQ_BITS: gl.constexpr):
    """:func:`_store_tiles` for the cluster: each tile's 32 rows x 128 bytes into K stage ``st``
    of this CTA and the peer's (8 KiB per tile, 64 KiB per stage)."""
    s = gl.convert_layout(sc, gl.SliceLayout(1, WT_L))
    so = st * (BLOCK_N * HEAD_DIM * 2)
    _cl_st(_dequant_tile(r0, s, 0, DQ_BITS), addr, so, delta, bar)
    _cl_st(_dequant_tile(r1, s, 1, DQ_BITS), addr, so + 8192, delta, bar)
    _cl_st(_dequant_tile(r2, s, 2, DQ_BITS), addr, so + 2 * 8192, delta, bar)
    _cl_st(_dequant_tile(r3, s, 3, DQ_BITS), addr, so + 3 * 8192, delta, bar)
    _cl_st(_dequant_tile(r4, s, 4, DQ_BITS), addr, so + 4 * 8192, delta, bar)
    _cl_st(_dequant_tile(r5, s, 5, DQ_BITS), addr, so + 5 * 8192, delta, bar)
    _cl_st(_dequant_tile(r6, s, 6, DQ_BITS), addr, so + 6 * 8192, delta, bar)
    _cl_st(rope, addr, so + 7 * 8192, delta, bar)


@gluon.jit
def _cluster_halves(t, rank, split, num_splits, idx_ptr, stride_idx, width, len_ptr, bt_ptr, stride_bt, max_blocks,
                    num_reqs, req_ptr, start_ptr, block_size, IS_RANGE: gl.constexpr, HAS_LEN: gl.constexpr):
    """A cluster producer's start: the set's extent for token ``t``, this split's chunk count, and
    the entries of this CTA's first two half-chunks (rows ``32 * rank ..`` of chunks 0 and 1)."""
    start, length, req = _extent(t, width, len_ptr, req_ptr, start_ptr, num_reqs, max_blocks, block_size, IS_RANGE,
                                 HAS_LEN)
    n_mine = _n_mine(length, split, num_splits)
    x = _candidate_entry(t, _half_rows(rank, split, num_splits), idx_ptr, stride_idx, length, bt_ptr, stride_bt,
                         max_blocks, start, req, block_size, IS_RANGE)
    y = _candidate_entry(t, _half_rows(2 + rank, split, num_splits), idx_ptr, stride_idx, length, bt_ptr,
                         stride_bt, max_blocks, start, req, block_size, IS_RANGE)
    return start, length, req, n_mine, x, y


@gluon.jit
def _produce_set_cluster(it, valid_bufs, full, rank, addr, delta, peer_bar, t, split, num_splits,
                         cache_ptr, stride_blk, block_size, capacity,
                         idx_ptr, stride_idx, width, len_ptr, bt_ptr, stride_bt, max_blocks, num_reqs, req_ptr,
                         start_ptr, IS_RANGE: gl.constexpr, HAS_LEN: gl.constexpr, PREFETCH: gl.constexpr,
                         DQ_BITS: gl.constexpr, AHEAD: gl.constexpr):
    """:func:`_produce_set` for a cluster of two: this CTA gathers rows ``32 * rank ..`` of each
    chunk (half-chunk ``2 i + rank``) and writes them into both CTAs' stage; the chunk's validity
    (all 64 rows) is looked up here for this CTA's consumers. Per chunk: the half's loads are
    issued (with ``AHEAD``, the next chunk's, this chunk's being carried in registers; slot lookups
    one chunk further; the lines after that asked of L2), then the producer waits until the four
    consumer warpgroups of both CTAs freed the stage, arms its rfull barrier for the peer's 32 KiB,
    stores, and arrives on its full barrier."""
    start, length, req, n_mine, x, y = _cluster_halves(t, rank, split, num_splits, idx_ptr, stride_idx, width, len_ptr,
                                                       bt_ptr, stride_bt, max_blocks, num_reqs, req_ptr, start_ptr,
                                                       block_size, IS_RANGE, HAS_LEN)
    xv = _candidate_entry(t, _chunk_rows(0, split, num_splits), idx_ptr, stride_idx, length, bt_ptr, stride_bt,
                          max_blocks, start, req, block_size, IS_RANGE)
    lead: gl.constexpr = 2 if AHEAD else 0  # half-chunks between a load and its store
    if AHEAD:  # the first chunk's loads; from then on each chunk's are carried from the iteration before
        a0, a1, a2, a3, a4, a5, a6, rope, sc, _v = _load_tiles(cache_ptr, x, _half_rows(rank, split, num_splits),
                                                              start, block_size, capacity, stride_blk, IS_RANGE)
        x = y
        y = _candidate_entry(t, _half_rows(4 + rank, split, num_splits), idx_ptr, stride_idx, length, bt_ptr,
                             stride_bt, max_blocks, start, req, block_size, IS_RANGE)
    for i in range(n_mine):
        b0, b1, b2, b3, b4, b5, b6, rope_b, sc_b, _v = _load_tiles(
            cache_ptr, x, _half_rows(2 * i + lead + rank, split, num_splits), start, block_size, capacity, stride_blk,
            IS_RANGE)
        if PREFETCH:  # the lines of the chunk after the one loaded
            _prefetch_half(cache_ptr, y, _half_rows(2 * i + lead + 2 + rank, split, num_splits), start, block_size,
                           capacity, stride_blk, IS_RANGE)
        x = y
        y = _candidate_entry(t, _half_rows(2 * i + lead + 4 + rank, split, num_splits), idx_ptr, stride_idx, length,
                             bt_ptr, stride_bt, max_blocks, start, req, block_size, IS_RANGE)
        if not AHEAD:
            a0, a1, a2, a3, a4, a5, a6, rope, sc = b0, b1, b2, b3, b4, b5, b6, rope_b, sc_b
        _b, _o, valid = _candidate_place(xv, _chunk_rows(i, split, num_splits), start, block_size, capacity,
                                         IS_RANGE)
        xv = _candidate_entry(t, _chunk_rows(i + 1, split, num_splits), idx_ptr, stride_idx, length, bt_ptr,
                              stride_bt, max_blocks, start, req, block_size, IS_RANGE)
        st = it % 2
        _cl_wait_free(it, st)
        _cl_one(_CL_EXPECT, 8 * st, st)
        _store_tiles_cl(a0, a1, a2, a3, a4, a5, a6, rope, sc, addr, st, delta, peer_bar + 8 * st, DQ_BITS)
        valid_bufs.index(st).store(valid.to(gl.int8))
        _hand_over(full, st)
        it += 1
        if AHEAD:
            a0, a1, a2, a3, a4, a5, a6, rope, sc = b0, b1, b2, b3, b4, b5, b6, rope_b, sc_b
    return it


@gluon.jit
def _load_cols(cache_ptr, x, j, start, block_size, capacity, stride_blk, W: gl.constexpr, IS_RANGE: gl.constexpr):
    """The page loads of one producer warpgroup of ``DUAL`` with ``CLUSTER``: warpgroup W's four
    of the half-chunk's eight 64-dim tiles (W 0: fp8 tiles 0-3; W 1: fp8 tiles 4-6 and the RoPE,
    already bf16 pairs), as 32-bit words in WC_L (8 bytes per lane) and the RoPE in WCO_L (16
    bytes per lane); the scale word and validity."""
    wptr, data, scale, valid = _tile_words(cache_ptr, x, j, start, block_size, capacity, stride_blk, WC_L, IS_RANGE)
    m = gl.expand_dims(valid, 1)
    if W == 0:
        r0 = gl.load(wptr, mask=m, other=0)
        r1 = gl.load(wptr + 16, mask=m, other=0)
        r2 = gl.load(wptr + 32, mask=m, other=0)
        r3 = gl.load(wptr + 48, mask=m, other=0)
    else:
        r0 = gl.load(wptr + 64, mask=m, other=0)
        r1 = gl.load(wptr + 80, mask=m, other=0)
        r2 = gl.load(wptr + 96, mask=m, other=0)
        r3 = _rope_words(cache_ptr, data, valid, WCO_L)
    sc = gl.load((cache_ptr + scale).to(gl.pointer_type(gl.int64)), mask=valid, other=0)
    return r0, r1, r2, r3, sc


@gluon.jit
def _store_cols_cl(r0, r1, r2, r3, sc, addr, st, delta, bar, W: gl.constexpr, DQ_BITS: gl.constexpr):
    """:func:`_load_cols`' tiles, dequantised, into both CTAs' K stage ``st`` (tiles ``4 W ..``:
    32 rows x 128 bytes each, 16 KiB per warpgroup and CTA); each store instruction of a warp
    writes 4 whole rows of a tile."""
    s = gl.convert_layout(sc, WC_ROW)
    so = st * (BLOCK_N * HEAD_DIM * 2) + W * (4 * 8192)
    _cl_st(_dequant_tile(r0, s, 4 * W, DQ_BITS, WCO_L), addr, so, delta, bar, WCO_L)
    _cl_st(_dequant_tile(r1, s, 4 * W + 1, DQ_BITS, WCO_L), addr, so + 8192, delta, bar, WCO_L)
    _cl_st(_dequant_tile(r2, s, 4 * W + 2, DQ_BITS, WCO_L), addr, so + 2 * 8192, delta, bar, WCO_L)
    if W == 0:
        _cl_st(_dequant_tile(r3, s, 3, DQ_BITS, WCO_L), addr, so + 3 * 8192, delta, bar, WCO_L)
    else:
        _cl_st(r3, addr, so + 3 * 8192, delta, bar, WCO_L)


@gluon.jit
def _produce_set_cluster_cols(it, valid_bufs, full, rank, addr, delta, peer_bar, t, split, num_splits,
                              cache_ptr, stride_blk, block_size, capacity,
                              idx_ptr, stride_idx, width, len_ptr, bt_ptr, stride_bt, max_blocks, num_reqs, req_ptr,
                              start_ptr, W: gl.constexpr, IS_RANGE: gl.constexpr, HAS_LEN: gl.constexpr,
                              PREFETCH: gl.constexpr, DQ_BITS: gl.constexpr):
    """:func:`_produce_set_cluster` split by columns between the two producer warpgroups of
    ``DUAL``: both gather this CTA's rows ``32 * rank ..`` of every chunk, warpgroup W only its
    four 64-dim tiles (:func:`_load_cols`), and write them into both CTAs' stage; so each CTA's
    loads and dequantisation per chunk are a quarter of a 64-row stage per warpgroup. Warpgroup 0
    arms the rfull barrier for the peer's 32 KiB and asks L2 for the next chunk's lines;
    warpgroup W looks up and stores the validity of rows ``32 W ..`` (this CTA's consumers need
    all 64). The full barrier counts both warpgroups."""
    start, length, req, n_mine, x, y = _cluster_halves(t, rank, split, num_splits, idx_ptr, stride_idx, width, len_ptr,
                                                       bt_ptr, stride_bt, max_blocks, num_reqs, req_ptr, start_ptr,
                                                       block_size, IS_RANGE, HAS_LEN)
    xv = _candidate_entry(t, _half_rows(W, split, num_splits), idx_ptr, stride_idx, length, bt_ptr, stride_bt,
                          max_blocks, start, req, block_size, IS_RANGE)
    for i in range(n_mine):
        r0, r1, r2, r3, sc = _load_cols(cache_ptr, x, _half_rows(2 * i + rank, split, num_splits), start,
                                        block_size, capacity, stride_blk, W, IS_RANGE)
        if PREFETCH and W == 0:  # the lines of the next chunk's rows
            _prefetch_half(cache_ptr, y, _half_rows(2 * i + 2 + rank, split, num_splits), start, block_size,
                           capacity, stride_blk, IS_RANGE)
        x = y
        y = _candidate_entry(t, _half_rows(2 * i + 4 + rank, split, num_splits), idx_ptr, stride_idx, length,
                             bt_ptr, stride_bt, max_blocks, start, req, block_size, IS_RANGE)
        _b, _o, valid = _candidate_place(xv, _half_rows(2 * i + W, split, num_splits), start, block_size, capacity,
                                         IS_RANGE)
        xv = _candidate_entry(t, _half_rows(2 * i + 2 + W, split, num_splits), idx_ptr, stride_idx, length, bt_ptr,
                              stride_bt, max_blocks, start, req, block_size, IS_RANGE)
        st = it % 2
        _cl_wait_free(it, st)
        if W == 0:
            _cl_one(_CL_EXPECT, 8 * st, st)
        _store_cols_cl(r0, r1, r2, r3, sc, addr, st, delta, peer_bar + 8 * st, W, DQ_BITS)
        valid_bufs.index(st).slice(W * HALF, HALF, dim=0).store(valid.to(gl.int8))
        _hand_over(full, st)
        it += 1
    return it


# bf16 pages: [64 rows, 512] bf16 copied with cp.async, 16 bytes per thread per row, 8 rows per
# pass of the 4 producer warps.
KB4_L = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))
KB4_ROW = gl.constexpr(gl.SliceLayout(1, KB4_L))


@gluon.jit
def _chunk_rows(i, split, num_splits):
    """Candidate positions of this split's chunk ``i`` (chunk ``split + i * num_splits``)."""
    return (split + i * num_splits) * BLOCK_N + gl.arange(0, BLOCK_N, layout=KB4_ROW)


@gluon.jit
def _produce_set_bf16(it, k_bufs, valid_bufs, empty, full, t, split, num_splits,
                      cache_ptr, stride_blk, stride_entry, block_size, capacity,
                      idx_ptr, stride_idx, width, len_ptr, bt_ptr, stride_bt, max_blocks, num_reqs, req_ptr,
                      start_ptr, IS_RANGE: gl.constexpr, HAS_LEN: gl.constexpr):
    """bf16 pages: per chunk, wait for a free K stage, copy the rows straight into it with
    ``cp.async`` (invalid candidates zero-filled, never read), wait for the copies and hand the
    stage over. Nothing to dequantise, so the producer only needs to run one chunk ahead: the
    copy of chunk c+1 lands while the consumers multiply chunk c. Slot lookups read one chunk
    ahead."""
    start, length, req = _extent(t, width, len_ptr, req_ptr, start_ptr, num_reqs, max_blocks, block_size, IS_RANGE,
                                 HAS_LEN)
    n_mine = _n_mine(length, split, num_splits)
    d = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, KB4_L)), 0)
    x = _candidate_entry(t, _chunk_rows(0, split, num_splits), idx_ptr, stride_idx, length, bt_ptr, stride_bt,
                         max_blocks, start, req, block_size, IS_RANGE)
    for i in range(n_mine):
        blk, off, valid = _candidate_place(x, _chunk_rows(i, split, num_splits), start, block_size, capacity,
                                           IS_RANGE)
        x = _candidate_entry(t, _chunk_rows(i + 1, split, num_splits), idx_ptr, stride_idx, length, bt_ptr,
                             stride_bt, max_blocks, start, req, block_size, IS_RANGE)
        st = it % 2
        mbarrier.wait(empty.index(st), ((it // 2) & 1) ^ 1)  # a fresh barrier passes parity 1
        rows = gl.expand_dims(blk * stride_blk + off * stride_entry, 1)
        _async_load(k_bufs.index(st), cache_ptr + rows + d, mask=gl.expand_dims(valid, 1))
        cp.commit_group()
        valid_bufs.index(st).store(valid.to(gl.int8))
        cp.wait_group(0)
        _hand_over(full, st)
        it += 1
    return it


@gluon.jit
def _producer(k_bufs, valid_bufs, empty, full, t, pid_h, split, num_splits,
              a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity,
              a_idx_ptr, a_stride_idx, a_width, a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs, a_req_ptr,
              a_start_ptr,
              b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity,
              b_idx_ptr, b_stride_idx, b_width, b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs, b_req_ptr,
              b_start_ptr,
              A_RANGE: gl.constexpr, A_LEN: gl.constexpr, HAS_B: gl.constexpr, B_RANGE: gl.constexpr,
              B_LEN: gl.constexpr, PREFETCH: gl.constexpr, PAGES_BF16: gl.constexpr, PIPE: gl.constexpr,
              DQ_BITS: gl.constexpr, CLUSTER: gl.constexpr, K_OFF: gl.constexpr, MERGE: gl.constexpr,
              DUAL: gl.constexpr, W: gl.constexpr):
    if CLUSTER:  # a cluster CTA: rows 32 * pid_h .. of every chunk, into both CTAs' stages
        peer = 1 - pid_h
        addr = _cl_tile_addr(pid_h, K_OFF, WCO_L if DUAL else WTO_L)
        delta = _cl_op(_CL_DELTA, peer, peer)
        peer_bar = _cl_op(_CL_PEER_BAR, peer, peer)
        _cl_op(_CL_SYNC, pid_h, pid_h)  # the peer's barriers are initialised before the first remote store
        if DUAL:  # one of two producer warpgroups: 64-dim tiles 4 W .. of those rows
            it = _produce_set_cluster_cols(t * 0, valid_bufs, full, pid_h, addr, delta, peer_bar, t, split,
                                           num_splits, a_cache_ptr, a_stride_blk, a_block_size, a_capacity,
                                           a_idx_ptr, a_stride_idx, a_width, a_len_ptr, a_bt_ptr, a_stride_bt,
                                           a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr, W, A_RANGE, A_LEN,
                                           PREFETCH, DQ_BITS)
            if HAS_B:
                _produce_set_cluster_cols(it, valid_bufs, full, pid_h, addr, delta, peer_bar, t, split, num_splits,
                                          b_cache_ptr, b_stride_blk, b_block_size, b_capacity, b_idx_ptr,
                                          b_stride_idx, b_width, b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks,
                                          b_num_reqs, b_req_ptr, b_start_ptr, W, B_RANGE, B_LEN, PREFETCH, DQ_BITS)
        else:
            it = _produce_set_cluster(t * 0, valid_bufs, full, pid_h, addr, delta, peer_bar, t, split, num_splits,
                                      a_cache_ptr, a_stride_blk, a_block_size, a_capacity, a_idx_ptr, a_stride_idx,
                                      a_width, a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs,
                                      a_req_ptr, a_start_ptr, A_RANGE, A_LEN, PREFETCH, DQ_BITS, PIPE)
            if HAS_B:
                _produce_set_cluster(it, valid_bufs, full, pid_h, addr, delta, peer_bar, t, split, num_splits,
                                     b_cache_ptr, b_stride_blk, b_block_size, b_capacity, b_idx_ptr, b_stride_idx,
                                     b_width, b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs,
                                     b_req_ptr, b_start_ptr, B_RANGE, B_LEN, PREFETCH, DQ_BITS, PIPE)
        _cl_op(_CL_ARRIVE, pid_h, pid_h)  # its last remote store is issued (release: it is done before the peer
        _cl_op(_CL_WAIT_ALL, pid_h, pid_h)  # leaves the barrier); neither CTA exits before the other is done
    elif DUAL:  # one of two producer warpgroups: rows 32 W .. of every chunk
        a_start, a_length, a_req, ax, ay = _rows_start(t, split, num_splits, a_block_size, a_idx_ptr, a_stride_idx,
                                                       a_width, a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks,
                                                       a_num_reqs, a_req_ptr, a_start_ptr, W, A_RANGE, A_LEN)
        if HAS_B:  # set B's extent and first lookups too: ready when set A's last chunk is stored
            b_start, b_length, b_req, bx, by = _rows_start(t, split, num_splits, b_block_size, b_idx_ptr,
                                                           b_stride_idx, b_width, b_len_ptr, b_bt_ptr, b_stride_bt,
                                                           b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr, W,
                                                           B_RANGE, B_LEN)
        it = _produce_set_rows(t * 0, k_bufs, valid_bufs, empty, full, t, split, num_splits,
                               a_cache_ptr, a_stride_blk, a_block_size, a_capacity, a_idx_ptr, a_stride_idx,
                               a_bt_ptr, a_stride_bt, a_max_blocks, a_start, a_length, a_req, ax, ay,
                               W, A_RANGE, PREFETCH, DQ_BITS)
        if HAS_B:
            _produce_set_rows(it, k_bufs, valid_bufs, empty, full, t, split, num_splits,
                              b_cache_ptr, b_stride_blk, b_block_size, b_capacity, b_idx_ptr, b_stride_idx,
                              b_bt_ptr, b_stride_bt, b_max_blocks, b_start, b_length, b_req, bx, by,
                              W, B_RANGE, PREFETCH, DQ_BITS)
    elif PAGES_BF16:
        it = _produce_set_bf16(t * 0, k_bufs, valid_bufs, empty, full, t, split, num_splits,
                               a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity, a_idx_ptr,
                               a_stride_idx, a_width, a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs,
                               a_req_ptr, a_start_ptr, A_RANGE, A_LEN)
        if HAS_B:
            _produce_set_bf16(it, k_bufs, valid_bufs, empty, full, t, split, num_splits,
                              b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity, b_idx_ptr,
                              b_stride_idx, b_width, b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs,
                              b_req_ptr, b_start_ptr, B_RANGE, B_LEN)
    elif PIPE and MERGE:
        _produce_sets_merged(k_bufs, valid_bufs, empty, full, t, split, num_splits,
                             a_cache_ptr, a_stride_blk, a_block_size, a_capacity, a_idx_ptr, a_stride_idx, a_width,
                             a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
                             b_cache_ptr, b_stride_blk, b_block_size, b_capacity, b_idx_ptr, b_stride_idx, b_width,
                             b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
                             A_RANGE, A_LEN, HAS_B, B_LEN, PREFETCH, DQ_BITS)
    elif PIPE:
        it = _produce_set_pipe(t * 0, k_bufs, valid_bufs, empty, full, t, split, num_splits,
                               a_cache_ptr, a_stride_blk, a_block_size, a_capacity, a_idx_ptr, a_stride_idx, a_width,
                               a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
                               A_RANGE, A_LEN, PREFETCH, DQ_BITS)
        if HAS_B:
            _produce_set_pipe(it, k_bufs, valid_bufs, empty, full, t, split, num_splits,
                              b_cache_ptr, b_stride_blk, b_block_size, b_capacity, b_idx_ptr, b_stride_idx, b_width,
                              b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
                              B_RANGE, B_LEN, PREFETCH, DQ_BITS)
    else:
        it = _produce_set(t * 0, k_bufs, valid_bufs, empty, full, t, split, num_splits,
                          a_cache_ptr, a_stride_blk, a_block_size, a_capacity, a_idx_ptr, a_stride_idx, a_width,
                          a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr, A_RANGE,
                          A_LEN, PREFETCH, DQ_BITS)
        if HAS_B:
            _produce_set(it, k_bufs, valid_bufs, empty, full, t, split, num_splits,
                         b_cache_ptr, b_stride_blk, b_block_size, b_capacity, b_idx_ptr, b_stride_idx, b_width,
                         b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr, B_RANGE,
                         B_LEN, PREFETCH, DQ_BITS)

HALF_V = gl.constexpr(256)
S4_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
O4_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
P_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O4_L, k_width=2))
Q4_L = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0]))
ROW_O = gl.constexpr(gl.SliceLayout(1, O4_L))


# A half of the output read back from shared memory: a warp covers one row's 256 bf16 (512
# contiguous bytes), 16 bytes per thread.
OST_L = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0]))
# ``DUAL``: each consumer's half of O as two [64, 128] accumulators (a 64 x 256 wgmma needs a
# register target of 158, above the 128 at which ptxas compiles a 16-warp kernel); a quarter of
# the output read back with a warp over two rows' 128 bf16.
QV = gl.constexpr(128)
O2_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]))
P_A2 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O2_L, k_width=2))
ROW_O2 = gl.constexpr(gl.SliceLayout(1, O2_L))
OST2_L = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))


@gluon.jit
def _store_half_o(o, f, stage, t64, pid_h, split, num_heads, col0, out_ptr, stride_o_t, stride_o_h, part_o_ptr,
                  split_base, total_splits, WRITE_PARTIAL: gl.constexpr, OUT_BF16: gl.constexpr,
                  WIDTH: gl.constexpr = HALF_V, O_L: gl.constexpr = O4_L, OST: gl.constexpr = OST_L):
    """Write ``o * f`` (rows = heads, 256 columns starting at ``col0``) to the output or the
    split-KV partial (``WIDTH`` columns in layout ``O_L``; ``OST`` reads them back by rows). A bf16
    output goes through ``stage`` (these columns of q's buffer, free once the last logits are
    done): stored in the accumulator's layout, read back by rows, so each warp writes 512
    contiguous bytes. Written straight from the accumulator layout (4 bytes per thread and row),
    the epilogue made a CTA's fixed cost 8.3 us instead of 5.7 us on the H200 (h64 prefill,
    docs/benchmarks.md Table 27)."""
    h = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
    d = col0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, O_L))
    h_ok = h < num_heads
    hc = gl.where(h_ok, h, 0)
    mask2 = gl.expand_dims(h_ok, 1)
    res = o * gl.expand_dims(f, 1)
    if OUT_BF16 and not WRITE_PARTIAL:
        stage.store(res.to(gl.bfloat16))
        _cta_barrier()
        hs = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, OST))
        ds = col0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, OST))
        hs_ok = hs < num_heads
        optr = (out_ptr + t64 * stride_o_t + gl.expand_dims(gl.where(hs_ok, hs, 0) * stride_o_h, 1)
                + gl.expand_dims(ds, 0))
        gl.store(optr, stage.load(OST), mask=gl.expand_dims(hs_ok, 1))
    elif WRITE_PARTIAL:
        part_row = (t64 * total_splits + split_base + split) * num_heads + hc
        gl.store(part_o_ptr + gl.expand_dims(part_row * HEAD_DIM, 1) + gl.expand_dims(d, 0), res, mask=mask2)
    else:  # fp32 output
        optr = out_ptr + t64 * stride_o_t + gl.expand_dims(hc * stride_o_h, 1) + gl.expand_dims(d, 0)
        gl.store(optr, res, mask=mask2)


@gluon.jit
def _n_total(t, split, num_splits,
             a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
             b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
             A_RANGE: gl.constexpr, A_LEN: gl.constexpr, HAS_B: gl.constexpr, B_RANGE: gl.constexpr,
             B_LEN: gl.constexpr):
    """The split's chunks over both sets, in the producer's order (each consumer partition counts
    them itself: computed before the partitions split, the set extents were shared with the
    producer and held in its registers across its loops, which made it spill)."""
    _, length, _ = _extent(t, a_width, a_len_ptr, a_req_ptr, a_start_ptr, a_num_reqs, a_max_blocks, a_block_size,
                           A_RANGE, A_LEN)
    n = _n_mine(length, split, num_splits)
    if HAS_B:
        _, length, _ = _extent(t, b_width, b_len_ptr, b_req_ptr, b_start_ptr, b_num_reqs, b_max_blocks,
                               b_block_size, B_RANGE, B_LEN)
        n += _n_mine(length, split, num_splits)
    return n


@gluon.jit
def _chunk_valid(valid_buf):
    """A chunk's validity vector [64] (int8, 0: no candidate) from shared memory, in the layout
    of the logits' columns. Read between the logits' wgmma issue and its wait, its latency runs
    under the product instead of after it."""
    return valid_buf.load(gl.SliceLayout(0, S4_L))


@gluon.jit
def _softmax_step(s, valid, qk_scale, m_i, l_i):
    """One chunk of the online softmax (base 2) on the logits ``s`` [64, 64] (S4_L): invalid
    candidates (``valid`` 0, from :func:`_chunk_valid`) get -inf; returns P (fp32), each row's
    rescale factor for what came before, and the new row max and sum (a row with nothing valid
    yet keeps max -inf and sum 0)."""
    ok = gl.expand_dims(valid != 0, 0)
    s = gl.where(ok, s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - gl.expand_dims(m_safe, 1))
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _wg0_loop(n, o, m_i, l_i, q_all, k_bufs, p_bufs, a_bufs, valid_bufs, empty, full, p_ready, p_free, qk_scale,
              peer, CLUSTER: gl.constexpr):
    """Warpgroup 0's walk over the split's ``n`` chunks (both sets, in the producer's order):
    ``S = q K^T``, the online softmax (base 2), ``O[:, :256] += P V`` issued asynchronously, and
    while it runs, P and the rescale factors handed to warpgroup 1 through P buffer ``i % 2``
    once warpgroup 1 has released it (its multiply of chunk i - 2 is done); then the stage is
    released. (Issuing chunk i + 1's logits behind ``P V`` as well measured slower on the H200.)"""
    for i in range(n):
        st = i % 2
        mbarrier.wait(full.index(st), (i // 2) & 1)
        if CLUSTER:  # the peer's half of the chunk
            _cl_op(_CL_WAIT, 8 * st, (i // 2) & 1)
        k_cur = k_bufs.index(st)
        if CLUSTER:  # q through an index ptxas cannot prove 0: keeps its wgmma descriptors in the loop
            q_cur = q_all.index(i >> 30)  # (Triton 3.6 hoisted and spilled them here)
        else:
            q_cur = q_all.index(0)
        s = warpgroup_mma(q_cur, k_cur.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S4_L),
                          use_acc=False, is_async=True)
        valid = _chunk_valid(valid_bufs.index(st))  # read while the logits are computed
        s = warpgroup_mma_wait(0, deps=[s])
        p, alpha, m_i, l_i = _softmax_step(s, valid, qk_scale, m_i, l_i)
        p16 = p.to(gl.bfloat16)
        o = o * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
        pa = gl.convert_layout(p16, P_A)
        o_acc = warpgroup_mma(pa, k_cur.slice(0, HALF_V, dim=1), o, is_async=True)
        mbarrier.wait(p_free.index(st), ((i // 2) & 1) ^ 1)  # a fresh barrier passes parity 1
        p_bufs.index(st).store(p16)
        a_bufs.index(st).store(alpha)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(p_ready.index(st))
        o, pa = warpgroup_mma_wait(0, deps=[o_acc, pa])
        _cta_barrier()
        if CLUSTER:
            _cl_one(_CL_RELEASE, 16 + 8 * st, peer)
        else:
            mbarrier.arrive(empty.index(st))
    return o, m_i, l_i


@gluon.jit
def _wg0_loop_dual(n, o0, o1, m_i, l_i, q_all, k_bufs, p_bufs, a_bufs, valid_bufs, empty, full, p_ready, p_free,
                   qk_scale, peer, CLUSTER: gl.constexpr):
    """:func:`_wg0_loop` with its half of O as two [64, 128] accumulators (``DUAL``)."""
    for i in range(n):
        st = i % 2
        mbarrier.wait(full.index(st), (i // 2) & 1)
        if CLUSTER:  # the peer's half of the chunk
            _cl_op(_CL_WAIT, 8 * st, (i // 2) & 1)
        k_cur = k_bufs.index(st)
        if CLUSTER:  # q through an index ptxas cannot prove 0 (see _wg0_loop)
            q_cur = q_all.index(i >> 30)
        else:
            q_cur = q_all.index(0)
        s = warpgroup_mma(q_cur, k_cur.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S4_L),
                          use_acc=False, is_async=True)
        valid = _chunk_valid(valid_bufs.index(st))  # read while the logits are computed
        s = warpgroup_mma_wait(0, deps=[s])
        p, alpha, m_i, l_i = _softmax_step(s, valid, qk_scale, m_i, l_i)
        p16 = p.to(gl.bfloat16)
        a2 = gl.expand_dims(gl.convert_layout(alpha, ROW_O2), 1)
        o0 = o0 * a2
        o1 = o1 * a2
        pa = gl.convert_layout(p16, P_A2)
        acc0 = warpgroup_mma(pa, k_cur.slice(0, QV, dim=1), o0, is_async=True)
        acc1 = warpgroup_mma(pa, k_cur.slice(QV, QV, dim=1), o1, is_async=True)
        mbarrier.wait(p_free.index(st), ((i // 2) & 1) ^ 1)  # a fresh barrier passes parity 1
        p_bufs.index(st).store(p16)
        a_bufs.index(st).store(alpha)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(p_ready.index(st))
        o0, o1, pa = warpgroup_mma_wait(0, deps=[acc0, acc1, pa])
        _cta_barrier()
        if CLUSTER:
            _cl_one(_CL_RELEASE, 16 + 8 * st, peer)
        else:
            mbarrier.arrive(empty.index(st))
    return o0, o1, m_i, l_i


@gluon.jit
def _wg0(q_ptr, stride_q_t, stride_q_h, num_heads, t64, pid_h, q_all, k_bufs, p_bufs, a_bufs, f_smem, valid_bufs,
         empty, full, p_ready, p_free, fin, t, split, num_splits, qk_scale,
         out_ptr, stride_o_t, stride_o_h, lse_ptr, stride_lse_t, max_ptr, stride_max_t, part_o_ptr, part_lse_ptr,
         sink_ptr, split_base, total_splits,
         a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
         b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
         A_RANGE: gl.constexpr, A_LEN: gl.constexpr, HAS_B: gl.constexpr, B_RANGE: gl.constexpr, B_LEN: gl.constexpr,
         HAS_SINK: gl.constexpr, WRITE_PARTIAL: gl.constexpr, OUT_BF16: gl.constexpr, WRITE_MAX: gl.constexpr,
         CLUSTER: gl.constexpr, DUAL: gl.constexpr):
    """Warpgroup 0: q, S, softmax, the first half of O, the row statistics and the epilogue's
    normalisation factors."""
    q_smem = q_all.index(0)
    if CLUSTER:  # first: the peer's producer waits for it before its first remote store
        _cl_op(_CL_SYNC, pid_h, pid_h)
    n = _n_total(t, split, num_splits, a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr,
                 a_start_ptr, b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
                 A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN)
    dq = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, Q4_L))
    hq = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, Q4_L))
    hq_ok = hq < num_heads
    q = gl.load(q_ptr + t64 * stride_q_t + gl.expand_dims(gl.where(hq_ok, hq, 0) * stride_q_h, 1)
                + gl.expand_dims(dq, 0), mask=gl.expand_dims(hq_ok, 1), other=0.0)
    q_smem.store(q.to(gl.bfloat16))  # all of q's loads in flight at once
    fence_async_shared()
    _cta_barrier()
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, S4_L))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, S4_L))
    if DUAL:
        o0 = gl.zeros([BLOCK_H, QV], gl.float32, O2_L)
        o1 = gl.zeros([BLOCK_H, QV], gl.float32, O2_L)
        o0, o1, m_i, l_i = _wg0_loop_dual(n, o0, o1, m_i, l_i, q_all, k_bufs, p_bufs, a_bufs, valid_bufs, empty,
                                          full, p_ready, p_free, qk_scale, 1 - pid_h, CLUSTER)
    else:
        o = gl.zeros([BLOCK_H, HALF_V], gl.float32, O4_L)
        o, m_i, l_i = _wg0_loop(n, o, m_i, l_i, q_all, k_bufs, p_bufs, a_bufs, valid_bufs, empty, full, p_ready,
                                p_free, qk_scale, 1 - pid_h, CLUSTER)
    if CLUSTER:  # its last remote arrive is issued
        _cl_op(_CL_ARRIVE, pid_h, pid_h)
    # Row statistics -> normalisation factor f (published for warpgroup 1) and lse / max logits.
    f = _row_stats(gl.convert_layout(m_i, ROW_O), gl.convert_layout(l_i, ROW_O),
                   pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_O), t64, split, num_heads, lse_ptr,
                   stride_lse_t, max_ptr, stride_max_t, part_lse_ptr, sink_ptr, split_base, total_splits, HAS_SINK,
                   WRITE_PARTIAL, WRITE_MAX)
    f_smem.store(f)
    _cta_barrier()
    mbarrier.arrive(fin.index(0))
    if DUAL:
        f2 = gl.convert_layout(f, ROW_O2)
        _store_half_o(o0, f2, q_smem.slice(0, QV, dim=1), t64, pid_h, split, num_heads, 0, out_ptr, stride_o_t,
                      stride_o_h, part_o_ptr, split_base, total_splits, WRITE_PARTIAL, OUT_BF16, QV, O2_L, OST2_L)
        _store_half_o(o1, f2, q_smem.slice(QV, QV, dim=1), t64, pid_h, split, num_heads, QV, out_ptr, stride_o_t,
                      stride_o_h, part_o_ptr, split_base, total_splits, WRITE_PARTIAL, OUT_BF16, QV, O2_L, OST2_L)
    else:
        _store_half_o(o, f, q_smem.slice(0, HALF_V, dim=1), t64, pid_h, split, num_heads, 0, out_ptr, stride_o_t,
                      stride_o_h, part_o_ptr, split_base, total_splits, WRITE_PARTIAL, OUT_BF16)
    if CLUSTER:  # neither CTA exits while the other may still reach into it
        _cl_op(_CL_WAIT_ALL, pid_h, pid_h)
    return (m_i,)


@gluon.jit
def _wg1_dual(q_smem, k_bufs, p_bufs, a_bufs, f_smem, empty, full, p_ready, p_free, fin, t64, pid_h, t, split,
              num_splits, num_heads, out_ptr, stride_o_t, stride_o_h, part_o_ptr, split_base, total_splits,
              a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
              b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
              A_RANGE: gl.constexpr, A_LEN: gl.constexpr, HAS_B: gl.constexpr, B_RANGE: gl.constexpr,
              B_LEN: gl.constexpr, WRITE_PARTIAL: gl.constexpr, OUT_BF16: gl.constexpr, CLUSTER: gl.constexpr):
    """:func:`_wg1` of ``DUAL``: its half of O (columns 256-511) as two [64, 128] accumulators."""
    n = _n_total(t, split, num_splits, a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr,
                 a_start_ptr, b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
                 A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN)
    o0 = gl.zeros([BLOCK_H, QV], gl.float32, O2_L)
    o1 = gl.zeros([BLOCK_H, QV], gl.float32, O2_L)
    if CLUSTER:
        _cl_op(_CL_SYNC, pid_h, pid_h)
    for i in range(n):
        st = i % 2
        mbarrier.wait(full.index(st), (i // 2) & 1)
        if CLUSTER:
            _cl_op(_CL_WAIT, 8 * st, (i // 2) & 1)
        mbarrier.wait(p_ready.index(st), (i // 2) & 1)
        alpha = gl.expand_dims(a_bufs.index(st).load(ROW_O2), 1)
        o0 = o0 * alpha
        o1 = o1 * alpha
        k_cur = k_bufs.index(st)
        acc0 = warpgroup_mma(p_bufs.index(st), k_cur.slice(HALF_V, QV, dim=1), o0, is_async=True)
        acc1 = warpgroup_mma(p_bufs.index(st), k_cur.slice(HALF_V + QV, QV, dim=1), o1, is_async=True)
        o0, o1 = warpgroup_mma_wait(0, deps=[acc0, acc1])
        _cta_barrier()
        mbarrier.arrive(p_free.index(st))
        if CLUSTER:
            _cl_one(_CL_RELEASE, 16 + 8 * st, 1 - pid_h)
        else:
            mbarrier.arrive(empty.index(st))
    if CLUSTER:  # its last remote arrive is issued
        _cl_op(_CL_ARRIVE, pid_h, pid_h)
    mbarrier.wait(fin.index(0), 0)
    f = f_smem.load(ROW_O2)
    _store_half_o(o0, f, q_smem.slice(HALF_V, QV, dim=1), t64, pid_h, split, num_heads, HALF_V, out_ptr,
                  stride_o_t, stride_o_h, part_o_ptr, split_base, total_splits, WRITE_PARTIAL, OUT_BF16, QV, O2_L,
                  OST2_L)
    _store_half_o(o1, f, q_smem.slice(HALF_V + QV, QV, dim=1), t64, pid_h, split, num_heads, HALF_V + QV, out_ptr,
                  stride_o_t, stride_o_h, part_o_ptr, split_base, total_splits, WRITE_PARTIAL, OUT_BF16, QV, O2_L,
                  OST2_L)
    if CLUSTER:  # neither CTA exits while the other may still reach into it
        _cl_op(_CL_WAIT_ALL, pid_h, pid_h)


@gluon.jit
def _wg1(q_smem, k_bufs, p_bufs, a_bufs, f_smem, empty, full, p_ready, p_free, fin, t64, pid_h, t, split, num_splits,
         num_heads, out_ptr, stride_o_t, stride_o_h, part_o_ptr, split_base, total_splits,
         a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
         b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
         A_RANGE: gl.constexpr, A_LEN: gl.constexpr, HAS_B: gl.constexpr, B_RANGE: gl.constexpr, B_LEN: gl.constexpr,
         WRITE_PARTIAL: gl.constexpr, OUT_BF16: gl.constexpr, CLUSTER: gl.constexpr):
    """Warpgroup 1: the second half of O from warpgroup 0's P and rescale factors; releases each
    P buffer and K stage after its multiply."""
    n = _n_total(t, split, num_splits, a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr,
                 a_start_ptr, b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
                 A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN)
    o = gl.zeros([BLOCK_H, HALF_V], gl.float32, O4_L)
    if CLUSTER:
        _cl_op(_CL_SYNC, pid_h, pid_h)
    for i in range(n):
        st = i % 2
        mbarrier.wait(full.index(st), (i // 2) & 1)
        if CLUSTER:
            _cl_op(_CL_WAIT, 8 * st, (i // 2) & 1)
        mbarrier.wait(p_ready.index(st), (i // 2) & 1)
        alpha = a_bufs.index(st).load(ROW_O)
        o = o * gl.expand_dims(alpha, 1)
        o = warpgroup_mma(p_bufs.index(st), k_bufs.index(st).slice(HALF_V, HALF_V, dim=1), o)
        _cta_barrier()
        mbarrier.arrive(p_free.index(st))
        if CLUSTER:
            _cl_one(_CL_RELEASE, 16 + 8 * st, 1 - pid_h)
        else:
            mbarrier.arrive(empty.index(st))
    if CLUSTER:  # its last remote arrive is issued
        _cl_op(_CL_ARRIVE, pid_h, pid_h)
    mbarrier.wait(fin.index(0), 0)
    f = f_smem.load(ROW_O)
    _store_half_o(o, f, q_smem.slice(HALF_V, HALF_V, dim=1), t64, pid_h, split, num_heads, HALF_V, out_ptr,
                  stride_o_t, stride_o_h, part_o_ptr, split_base, total_splits, WRITE_PARTIAL, OUT_BF16)
    if CLUSTER:  # neither CTA exits while the other may still reach into it
        _cl_op(_CL_WAIT_ALL, pid_h, pid_h)


@gluon.jit
def _sparse_mla_attn_sm90_ws_kernel(
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
    A_LEN: gl.constexpr, B_LEN: gl.constexpr, WRITE_MAX: gl.constexpr = False, PREFETCH: gl.constexpr = True,
    PAGES_BF16: gl.constexpr = False, PIPE: gl.constexpr = False, DQ_BITS: gl.constexpr = True,
    CLUSTER: gl.constexpr = False, K_OFF: gl.constexpr = 0, MERGE: gl.constexpr = False, DUAL: gl.constexpr = False,
):
    """Grid ``(num_tokens * cdiv(num_heads, 64), num_splits)``, head tiles fastest, as the
    single-partition kernel; fp8 pages of the 448 + 64 layout, or with PAGES_BF16 bf16 pages,
    in both sets; launched with ``NUM_WARPS`` (4) warps, warpgroup 1 and the producer on top.
    ``PREFETCH``: the producer's L2 prefetch (a tuning switch, on in production)."""
    tiles = gl.cdiv(num_heads, BLOCK_H)
    t = gl.program_id(0) // tiles
    pid_h = gl.program_id(0) % tiles
    split = gl.program_id(1)
    t64 = t.to(gl.int64)

    q_all = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_H, HEAD_DIM], MMA_SMEM)
    q_smem = q_all.index(0)
    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HEAD_DIM], MMA_SMEM)
    p_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_H, BLOCK_N], MMA_SMEM)
    a_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], VEC_SMEM)
    f_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], VEC_SMEM)
    valid_bufs = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N], VEC_SMEM)
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    fin = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(empty.index(i), count=2)
        mbarrier.init(full.index(i), count=2 if DUAL else 1)
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_free.index(i), count=1)
    mbarrier.init(fin.index(0), count=1)
    if CLUSTER:
        _cl_one(_CL_INIT, t, t)
    fence_async_shared()

    if DUAL:  # two producer warpgroups, each filling half of every stage; the consumers' halves of O in quarters
        gl.warp_specialize([
            (_wg0, (q_ptr, stride_q_t, stride_q_h, num_heads, t64, pid_h, q_all, k_bufs, p_bufs, a_bufs, f_smem,
                    valid_bufs, empty, full, p_ready, p_free, fin, t, split, num_splits, qk_scale,
                    out_ptr, stride_o_t, stride_o_h, lse_ptr, stride_lse_t, max_ptr, stride_max_t, part_o_ptr,
                    part_lse_ptr, sink_ptr, split_base, total_splits,
                    a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
                    b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
                    A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN, HAS_SINK, WRITE_PARTIAL, OUT_BF16, WRITE_MAX, CLUSTER, DUAL)),
            (_wg1_dual, (q_smem, k_bufs, p_bufs, a_bufs, f_smem, empty, full, p_ready, p_free, fin, t64, pid_h, t,
                         split, num_splits, num_heads, out_ptr, stride_o_t, stride_o_h, part_o_ptr, split_base,
                         total_splits, a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr,
                         a_start_ptr, b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr,
                         b_start_ptr, A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN, WRITE_PARTIAL, OUT_BF16, CLUSTER)),
            (_producer, (k_bufs, valid_bufs, empty, full, t, pid_h, split, num_splits,
                         a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity,
                         a_idx_ptr, a_stride_idx, a_width, a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs,
                         a_req_ptr, a_start_ptr,
                         b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity,
                         b_idx_ptr, b_stride_idx, b_width, b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs,
                         b_req_ptr, b_start_ptr,
                         A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN, PREFETCH, PAGES_BF16, PIPE, DQ_BITS, CLUSTER, K_OFF,
                         MERGE, DUAL, 0)),
            (_producer, (k_bufs, valid_bufs, empty, full, t, pid_h, split, num_splits,
                         a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity,
                         a_idx_ptr, a_stride_idx, a_width, a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs,
                         a_req_ptr, a_start_ptr,
                         b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity,
                         b_idx_ptr, b_stride_idx, b_width, b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs,
                         b_req_ptr, b_start_ptr,
                         A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN, PREFETCH, PAGES_BF16, PIPE, DQ_BITS, CLUSTER, K_OFF,
                         MERGE, DUAL, 1)),
        ], [4, PRODUCER_WARPS, PRODUCER_WARPS], [WG1_REGS, DUAL_PRODUCER_REGS, DUAL_PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_wg0, (q_ptr, stride_q_t, stride_q_h, num_heads, t64, pid_h, q_all, k_bufs, p_bufs, a_bufs, f_smem,
                    valid_bufs, empty, full, p_ready, p_free, fin, t, split, num_splits, qk_scale,
                    out_ptr, stride_o_t, stride_o_h, lse_ptr, stride_lse_t, max_ptr, stride_max_t, part_o_ptr,
                    part_lse_ptr, sink_ptr, split_base, total_splits,
                    a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
                    b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
                    A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN, HAS_SINK, WRITE_PARTIAL, OUT_BF16, WRITE_MAX, CLUSTER, False)),
            (_wg1, (q_smem, k_bufs, p_bufs, a_bufs, f_smem, empty, full, p_ready, p_free, fin, t64, pid_h, t, split, num_splits,
                    num_heads, out_ptr, stride_o_t, stride_o_h, part_o_ptr, split_base, total_splits,
                    a_block_size, a_width, a_len_ptr, a_max_blocks, a_num_reqs, a_req_ptr, a_start_ptr,
                    b_block_size, b_width, b_len_ptr, b_max_blocks, b_num_reqs, b_req_ptr, b_start_ptr,
                    A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN, WRITE_PARTIAL, OUT_BF16, CLUSTER)),
            (_producer, (k_bufs, valid_bufs, empty, full, t, pid_h, split, num_splits,
                         a_cache_ptr, a_stride_blk, a_stride_entry, a_block_size, a_capacity,
                         a_idx_ptr, a_stride_idx, a_width, a_len_ptr, a_bt_ptr, a_stride_bt, a_max_blocks, a_num_reqs,
                         a_req_ptr, a_start_ptr,
                         b_cache_ptr, b_stride_blk, b_stride_entry, b_block_size, b_capacity,
                         b_idx_ptr, b_stride_idx, b_width, b_len_ptr, b_bt_ptr, b_stride_bt, b_max_blocks, b_num_reqs,
                         b_req_ptr, b_start_ptr,
                         A_RANGE, A_LEN, HAS_B, B_RANGE, B_LEN, PREFETCH, PAGES_BF16, PIPE, DQ_BITS, CLUSTER, K_OFF,
                         MERGE, DUAL, 0)),
        ], [4, PRODUCER_WARPS], [WG1_REGS, PRODUCER_REGS])
