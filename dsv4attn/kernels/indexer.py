"""Triton lightning indexer: score a token's own indexer keys and keep its top-k, in one pass.

One program per query token (or per token and split, below). It streams the token's candidate
entries ``0 .. lengths[t]-1`` (read through its request's block-table row) in chunks of ``K_P2``
(= top-k rounded up to a power of two, >= 16) and keeps a running best-``K_P2`` list in
registers, so the work is ``O(lengths[t])`` per token and the only temporary is an int64
``[T, num_splits, K_P2]`` scratch: no
``[T, max_entries]`` score matrix, no host-known maximum length, nothing sized by
``max_model_len`` (graph-capturable as is).

Scoring a chunk: ``BLOCK_N`` keys at a time are gathered (fp8 bytes decoded with integer bit
operations and multiplied by the entry's fp32 scale after the dot, or bf16/fp32 rows), one
``tl.dot`` of the keys ``[BLOCK_N, D_P2]`` by ``q^T [D_P2, H_P2]`` gives every head's logits,
then ``sum_h w[h] * ReLU(logit)``. fp8 keys are loaded as 32-bit words (``WORDS``, where the
head dim is a multiple of 4 and ``D_P2 >= 64``): word ``v`` holds dims ``4v .. 4v+3``, and the
dot runs as four dots of ``D_P2 / 4`` dims, byte ``j`` of every word against q^T's rows
``4v + j``, so no byte moves between lanes (13-15% faster on the H200 than bytes, which Triton
repacks; docs/benchmarks.md, Table 41); on CUDA sm_80+ (``ASM``) the words are decoded to bf16
pairs by inline PTX, 5 instructions per pair (Table 44). Keys are the dot's rows: the decoded keys are its register
operand and each key's sum over heads stays within the threads that hold its row (with q as
the rows, the keys went through shared memory and the head sum crossed warps: 1.3-1.5x slower
on the H200). The program walks its steps of ``BLOCK_N`` entries in one flat
loop and issues step ``i + 1``'s block-table and page loads before scoring step ``i`` (one
program holds ~255 registers per thread, so few programs share an SM to hide those loads'
latency: 11-25% faster on the H200, docs/benchmarks.md).

Selection (why this design): each score becomes one int64 *key* that orders exactly like the
rule "higher score first, equal scores -> lower index": the score's fp32 bits mapped to an
order-preserving signed int (``b >= 0 ? b : b ^ 0x7FFFFFFF``; ``-0.0`` canonicalised to
``+0.0`` first) in the high 32 bits, ``0xFFFFFFFF - index`` in the low 32 bits; non-candidates
get ``INT64_MIN``. Keys are unique, so plain integer max/sort is the deterministic top-k and
no tie handling remains. A chunk's keys are written to the scratch row (the dot produces them
``BLOCK_N`` at a time; a ``K_P2``-wide dot would not fit in registers), read back as one
``[K_P2]`` tensor, sorted ascending and merged with the descending best list by the bitonic
half-cleaner ``max(best[i], chunk[i])`` (which yields exactly the top ``K_P2`` of the union as
one bitonic sequence), then put in descending order by a bitonic merge (``log2 K_P2`` stages
instead of a second sort's ``~log2^2 K_P2 / 2``). The first chunk is just sorted; later chunks
whose best key does not beat the current ``K_P2``-th are skipped, and chunks where at most ``FEW``
keys do sort only those (:func:`_merge_chunk_few`; Table 43). Compared with a radix select over a ``[T, n]``
score workspace this needs no workspace sized by the context and one pass over the keys; the
price is a bitonic sort and a bitonic merge of ``K_P2`` int64 per chunk (``~K log^2 K``
compares, small next to the chunk's ``K * H * D`` MACs).

Few tokens with long rows (small-batch decode) would leave most SMs idle, so a row can be
split over ``num_splits`` programs (interleaved chunks); each leaves its best list in its
scratch row and counts itself in on the token's arrival counter, and the last to arrive merges
the lists with the same half-cleaner and writes the top-k (no second launch; it resets the
counter, so the buffer stays zero between launches). Keys are unique, so the result does not
depend on the split count.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4attn.kernels.common import BF16X2_2POW120, BF16X2_NEG_ZERO, block_id, e4m3_bits_ptx

#: Sentinel key of a non-candidate (below every real key).
INT64_MIN = tl.constexpr(-9223372036854775808)


@triton.jit
def _decode_e4m3(x):
    """e4m3fn bytes (any int dtype, 0..255) -> fp32 values exactly (subnormals included)."""
    x = x.to(tl.uint32)
    f = (((x & 0x80) << 24) | ((x & 0x7F) << 20)).to(tl.float32, bitcast=True)
    return f * 1.329227995784916e36  # 2^120: the e4m3 exponent bias 7 -> fp32 bias 127


@triton.jit
def _score_keys(s, e, valid):
    """fp32 scores ``s`` and entry indices ``e`` (``[n]``) -> int64 sort keys (see module doc)."""
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 -> +0.0
    b = s.to(tl.int32, bitcast=True)
    o = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
    key = (o.to(tl.int64) << 32) | (4294967295 - e.to(tl.int64))
    return tl.where(valid, key, INT64_MIN)


@triton.jit
def _merge_desc(x, K: tl.constexpr, LOG_K: tl.constexpr):
    """A bitonic sequence ``x [K]`` (``K = 2^LOG_K``) -> the same keys sorted descending: the
    ``LOG_K`` compare-exchange stages of a bitonic merge (a full sort takes ``LOG_K (LOG_K + 1) / 2``).
    Stage ``i`` pairs positions ``K >> (i + 1)`` apart within blocks of twice that and puts the
    larger key first."""
    for i in tl.static_range(LOG_K):
        x = _merge_stage(x, K, K >> (i + 1))
    return x


@triton.jit
def _merge_stage(x, K: tl.constexpr, S: tl.constexpr):
    """One stage of :func:`_merge_desc`: keys ``S`` apart within blocks of ``2 S``, larger first."""
    y = tl.reshape(x, [K // (2 * S), 2, S])
    first = tl.arange(0, 2)[None, :, None] == 0
    a = tl.sum(tl.where(first, y, 0), axis=1)
    b = tl.sum(tl.where(first, 0, y), axis=1)
    y = tl.where(first, tl.maximum(a, b)[:, None, :], tl.minimum(a, b)[:, None, :])
    return tl.reshape(y, [K])


@triton.jit
def _merge_chunk(best, cand, K: tl.constexpr, LOG_K: tl.constexpr):
    """Merge a chunk's keys ``cand [K]`` (any order) into the descending best list ``best [K]``:
    ``cand`` sorted ascending makes ``max(best, cand)`` bitonic, holding the K largest of both."""
    return _merge_desc(tl.maximum(best, tl.sort(cand)), K, LOG_K)


@triton.jit
def _merge_chunk_few(best, cand, K: tl.constexpr, LOG_K: tl.constexpr, FEW: tl.constexpr):
    """Merge a chunk's keys ``cand [K]`` into the descending best list ``best [K]``, sorting only
    the keys above ``best``'s last when at most ``FEW`` are (then slot s takes the chunk's
    (s+1)-th such key, at the number of positions whose running count of them is <= s: a
    histogram of the counts, summed up); more take the whole-chunk sort, none leave ``best`` as
    it is."""
    above = cand > tl.min(best, axis=0)
    cnt = tl.sum(above.to(tl.int32), axis=0)
    if cnt > FEW:
        best = _merge_chunk(best, cand, K, LOG_K)
    elif cnt > 0:
        run = tl.cumsum(above.to(tl.int32), axis=0)  # [K], nondecreasing
        s = tl.arange(0, FEW)
        # positions with a running count <= s, for each s: a histogram of the counts, summed up
        at = tl.cumsum(tl.histogram(run, FEW, mask=run < FEW), axis=0)  # [FEW]: K past the last
        few = tl.gather(cand, tl.minimum(at, K - 1), 0)
        few = tl.sort(tl.where(s < cnt, few, INT64_MIN))  # ascending
        j = tl.arange(0, K)
        asc = tl.gather(few, tl.maximum(j - (K - FEW), 0), 0)  # [K]: the few last, ascending
        asc = tl.where(j >= K - FEW, asc, INT64_MIN)
        best = _merge_desc(tl.maximum(best, asc), K, LOG_K)
    return best


@triton.jit
def _step_entries(i, split, num_splits, n, req, bt_ptr, stride_bt, max_blocks, num_blocks, block_size,
                  stride_cache_block, BLOCK_N: tl.constexpr, K_P2: tl.constexpr):
    """A split's step ``i`` (entries ``BLOCK_N`` at a time, chunk ``split + (i // (K_P2 / BLOCK_N))
    * num_splits``) -> ``(entries, valid, page byte offsets, offsets in the page)``; entries past
    ``n`` or in holes are invalid, with page and offset 0 (masked by the loads, never read)."""
    SUBS: tl.constexpr = K_P2 // BLOCK_N
    e = (split + (i // SUBS) * num_splits) * K_P2 + (i % SUBS) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = e < n
    blk = block_id(bt_ptr, req, e // block_size, valid, stride_bt, 1, max_blocks)
    valid = (blk >= 0) & (blk < num_blocks)
    page = tl.where(valid, blk, 0).to(tl.int64) * stride_cache_block
    off = tl.where(valid, e % block_size, 0).to(tl.int64)
    return e, valid, page, off


@triton.jit
def _gather_keys(i, split, num_splits, n, req, bt_ptr, stride_bt, max_blocks, num_blocks, block_size,
                 cache_ptr, stride_cache_block, stride_cache_entry,
                 HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, BLOCK_N: tl.constexpr, K_P2: tl.constexpr,
                 IS_FP8: tl.constexpr):
    """Issue the loads of a split's step ``i`` (:func:`_step_entries`): ``(keys, scales, valid,
    entries)``. fp8 keys stay raw bytes (decoded where they are scored), scales are the entries'
    fp32 words (1.0 for bf16/fp32 rows)."""
    e, valid, page, off = _step_entries(i, split, num_splits, n, req, bt_ptr, stride_bt, max_blocks, num_blocks,
                                        block_size, stride_cache_block, BLOCK_N, K_P2)
    dd = tl.arange(0, D_P2)
    kmask = valid[:, None] & (dd < HEAD_DIM)[None, :]
    if IS_FP8:
        x = tl.load(cache_ptr + page[:, None] + off[:, None] * HEAD_DIM + dd[None, :], mask=kmask, other=0)
        sptr = (cache_ptr + page + block_size * HEAD_DIM + off * 4).to(tl.pointer_type(tl.float32))
        scale = tl.load(sptr, mask=valid, other=0.0)
    else:
        x = tl.load(cache_ptr + page[:, None] + off[:, None] * stride_cache_entry + dd[None, :],
                    mask=kmask, other=0.0)
        scale = tl.full([BLOCK_N], 1.0, tl.float32)
    return x, scale, valid, e


@triton.jit
def _gather_words(i, split, num_splits, n, req, bt_ptr, stride_bt, max_blocks, num_blocks, block_size,
                  cache_ptr, stride_cache_block,
                  HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, BLOCK_N: tl.constexpr, K_P2: tl.constexpr):
    """:func:`_gather_keys` for fp8 pages, the keys loaded as 32-bit words ``[BLOCK_N, D_P2 / 4]``
    (word ``v`` of a key holds its dims ``4v .. 4v+3``; the page's bytes are 4-byte aligned, which
    the op checks). Scored by :func:`_score_words`, whose decode then needs no byte moved between
    lanes (loaded as bytes, Triton repacks them: 512 PRMT instructions against 64 per program)."""
    e, valid, page, off = _step_entries(i, split, num_splits, n, req, bt_ptr, stride_bt, max_blocks, num_blocks,
                                        block_size, stride_cache_block, BLOCK_N, K_P2)
    vv = tl.arange(0, D_P2 // 4)
    kmask = valid[:, None] & (vv < HEAD_DIM // 4)[None, :]
    wptr = (cache_ptr + page[:, None] + off[:, None] * HEAD_DIM).to(tl.pointer_type(tl.int32))
    x = tl.load(wptr + vv[None, :], mask=kmask, other=0)
    sptr = (cache_ptr + page + block_size * HEAD_DIM + off * 4).to(tl.pointer_type(tl.float32))
    scale = tl.load(sptr, mask=valid, other=0.0)
    return x, scale, valid, e


@triton.jit
def _gather_step(i, split, num_splits, n, req, bt_ptr, stride_bt, max_blocks, num_blocks, block_size,
                 cache_ptr, stride_cache_block, stride_cache_entry,
                 HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, BLOCK_N: tl.constexpr, K_P2: tl.constexpr,
                 IS_FP8: tl.constexpr, WORDS: tl.constexpr):
    """Step ``i``'s loads in the kernel's form: :func:`_gather_words` (WORDS) or :func:`_gather_keys`."""
    if WORDS:
        x, scale, valid, e = _gather_words(i, split, num_splits, n, req, bt_ptr, stride_bt, max_blocks, num_blocks,
                                           block_size, cache_ptr, stride_cache_block, HEAD_DIM, D_P2, BLOCK_N, K_P2)
    else:
        x, scale, valid, e = _gather_keys(i, split, num_splits, n, req, bt_ptr, stride_bt, max_blocks, num_blocks,
                                          block_size, cache_ptr, stride_cache_block, stride_cache_entry,
                                          HEAD_DIM, D_P2, BLOCK_N, K_P2, IS_FP8)
    return x, scale, valid, e


@triton.jit
def _load_qt(q_ptr, t64, stride_q_t, stride_q_h, num_heads, HEAD_DIM: tl.constexpr, H_P2: tl.constexpr,
             D_P2: tl.constexpr, DOT_BF16: tl.constexpr, STEP: tl.constexpr, FIRST: tl.constexpr):
    """q^T rows ``FIRST, FIRST + STEP, ...`` (``[D_P2 / STEP, H_P2]``) in the dot's input dtype."""
    hh = tl.arange(0, H_P2)
    dd = tl.arange(0, D_P2 // STEP) * STEP + FIRST
    q = tl.load(q_ptr + t64 * stride_q_t + hh[None, :] * stride_q_h + dd[:, None],
                mask=(hh < num_heads)[None, :] & (dd < HEAD_DIM)[:, None], other=0.0)
    if DOT_BF16:
        q = q.to(tl.bfloat16)
    else:
        q = q.to(tl.float32)
    return q


def _e4m3_pair_asm(sel: str) -> tl.constexpr:
    """PTX taking byte j of two words (prmt selector ``sel``) to the pair's e4m3 values as bf16x2
    (first word in the low half), exactly: :func:`dsv4attn.kernels.common.e4m3_bits_ptx`, then
    the fma by 2^120. 5 instructions per pair where the fp32 decode, its multiply and the pack to
    bf16 take about 9."""
    return tl.constexpr(
        "{ .reg .b32 y, s, c, z; " + e4m3_bits_ptx("$1", "$2", sel) + f"mov.b32 c, {BF16X2_2POW120}; "
        f"mov.b32 z, {BF16X2_NEG_ZERO}; fma.rn.bf16x2 $0, y, c, z; }}")


#: prmt selectors: byte j of the first word to byte 1, of the second to byte 3 (bytes 0 and 2 are
#: masked off after)
_E4M3_B0 = _e4m3_pair_asm("0x4000")
_E4M3_B1 = _e4m3_pair_asm("0x5111")
_E4M3_B2 = _e4m3_pair_asm("0x6222")
_E4M3_B3 = _e4m3_pair_asm("0x7333")


@triton.jit
def _e4m3_bf16(x, j: tl.constexpr):
    """Byte ``j`` of every int32 word of ``x`` -> its e4m3 value as bf16, exactly (the PTX of
    :func:`_e4m3_pair_asm`, two elements per instance: CUDA sm_80+ only)."""
    if j == 0:
        k = tl.inline_asm_elementwise(_E4M3_B0, "=r,r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=2)
    elif j == 1:
        k = tl.inline_asm_elementwise(_E4M3_B1, "=r,r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=2)
    elif j == 2:
        k = tl.inline_asm_elementwise(_E4M3_B2, "=r,r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        k = tl.inline_asm_elementwise(_E4M3_B3, "=r,r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=2)
    return k


@triton.jit
def _dot_byte(x, j: tl.constexpr, qt, acc, DOT_BF16: tl.constexpr, ASM: tl.constexpr):
    """``acc + keys' dims 4v + j (byte j of every word of x) . qt`` (qt: those dims of q^T).
    ``ASM``: decode straight to bf16 pairs by inline PTX (:func:`_e4m3_bf16`)."""
    if ASM:
        acc = tl.dot(_e4m3_bf16(x, j), qt, acc)
    else:
        k = _decode_e4m3(((x >> (8 * j)) & 0xFF).to(tl.uint8))
        if DOT_BF16:
            acc = tl.dot(k.to(tl.bfloat16), qt, acc)
        else:
            acc = tl.dot(k, qt, acc, input_precision="ieee")
    return acc


@triton.jit
def _score_words(q0, q1, q2, q3, w, x, scale, DOT_BF16: tl.constexpr, ASM: tl.constexpr):
    """:func:`_score` of fp8 keys held as words: the dot over dims runs as four dots, one per byte
    of a word (dims ``4v + j`` against q^T's rows ``4v + j``), so no byte is moved between lanes."""
    acc = tl.zeros([x.shape[0], q0.shape[1]], tl.float32)
    acc = _dot_byte(x, 0, q0, acc, DOT_BF16, ASM)
    acc = _dot_byte(x, 1, q1, acc, DOT_BF16, ASM)
    acc = _dot_byte(x, 2, q2, acc, DOT_BF16, ASM)
    acc = _dot_byte(x, 3, q3, acc, DOT_BF16, ASM)
    return _weigh(acc, scale, w, True)


@triton.jit
def _weigh(logits, scale, w, IS_FP8: tl.constexpr):
    """Logits ``[BLOCK_N, H_P2]`` -> ``sum_h w[h] * ReLU(logit * scale)`` per key (fp8 keys: the
    entry's scale, a power of two > 0: exact, and it commutes with ReLU)."""
    if IS_FP8:
        logits = logits * scale[:, None]
    return tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1)


@triton.jit
def _score(qt, w, x, scale, IS_FP8: tl.constexpr, DOT_BF16: tl.constexpr):
    """``sum_h w[h] * ReLU(q[h] . k)`` of gathered keys ``x [BLOCK_N, D_P2]`` -> fp32 ``[BLOCK_N]``
    (``qt``: q transposed, ``[D_P2, H_P2]``). Keys are the dot's rows: the decoded keys feed it
    from registers and the sum over heads stays within each row's threads."""
    k = _decode_e4m3(x) if IS_FP8 else x
    if DOT_BF16:
        logits = tl.dot(k.to(tl.bfloat16), qt)  # [BLOCK_N, H_P2]: exact bf16 products, fp32 sums
    else:
        logits = tl.dot(k.to(tl.float32), qt, input_precision="ieee")
    return _weigh(logits, scale, w, IS_FP8)


@triton.jit
def _store_topk(best, idx_ptr, val_ptr, t64, stride_idx_t, stride_val_t, topk, K_P2: tl.constexpr):
    """Descending keys ``best [K_P2]`` -> the first ``topk`` entry indices (-1) and scores (-inf)."""
    j = tl.arange(0, K_P2)
    ok = best != INT64_MIN
    index = tl.where(ok, (4294967295 - (best & 4294967295)).to(tl.int32), -1)
    o = (best >> 32).to(tl.int32)
    bits = tl.where(o >= 0, o, o ^ 0x7FFFFFFF)
    val = tl.where(ok, bits.to(tl.float32, bitcast=True), float("-inf"))
    tl.store(idx_ptr + t64 * stride_idx_t + j, index, mask=j < topk)
    tl.store(val_ptr + t64 * stride_val_t + j, val, mask=j < topk)


@triton.jit
def _merge_splits(base, num_splits, K_P2: tl.constexpr, LOG_K: tl.constexpr):
    """The ``num_splits`` ascending best lists at ``base`` (int64 ``[num_splits, K_P2]``) -> their
    top ``K_P2``, descending. Read from L2 (``.cg``): other SMs wrote them."""
    j = tl.arange(0, K_P2)
    best = tl.load(base + (K_P2 - 1) - j, cache_modifier=".cg")  # split 0, descending
    for s in range(1, num_splits):
        cand = tl.load(base + s * K_P2 + j, cache_modifier=".cg")  # ascending
        if tl.max(cand, axis=0) > tl.min(best, axis=0):
            best = _merge_desc(tl.maximum(best, cand), K_P2, LOG_K)
    return best


@triton.jit
def _indexer_topk_kernel(
    q_ptr, w_ptr, cache_ptr, bt_ptr, t2r_ptr, len_ptr, scratch_ptr, count_ptr, idx_ptr, val_ptr,
    stride_q_t, stride_q_h, stride_w_t, stride_cache_block, stride_cache_entry, stride_bt,
    stride_idx_t, stride_val_t,
    num_heads, num_reqs, block_size, max_blocks, num_blocks, topk, num_splits,
    HEAD_DIM: tl.constexpr, H_P2: tl.constexpr, D_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    K_P2: tl.constexpr, IS_FP8: tl.constexpr, DOT_BF16: tl.constexpr, SPLIT: tl.constexpr, LOG_K: tl.constexpr,
    WORDS: tl.constexpr, FEW: tl.constexpr, ASM: tl.constexpr,
):
    """Grid ``(T, num_splits)``. q ``[T, H, D]`` (last dim contiguous), w fp32 ``[T, H]``, scratch
    int64 ``[T, num_splits, K_P2]``, count int32 ``[>= T]`` all zero. Split s takes chunks ``s,
    s + num_splits, ...`` of the token's entries. It writes ``idx [T, topk]`` int32 and
    ``val [T, topk]`` fp32; with SPLIT each split leaves its best list in its scratch row,
    ascending, and the last of the token's splits to arrive merges them (``count`` back to 0)."""
    t = tl.program_id(0)
    split = tl.program_id(1)
    t64 = t.to(tl.int64)
    req = tl.load(t2r_ptr + t).to(tl.int64)
    req_ok = (req >= 0) & (req < num_reqs)
    n = tl.where(req_ok, tl.minimum(tl.load(len_ptr + t), max_blocks * block_size), 0)
    req = tl.where(req_ok, req, 0)
    hh = tl.arange(0, H_P2)
    hm = hh < num_heads
    w = tl.load(w_ptr + t64 * stride_w_t + hh, mask=hm, other=0.0)
    if WORDS:
        q0 = _load_qt(q_ptr, t64, stride_q_t, stride_q_h, num_heads, HEAD_DIM, H_P2, D_P2, DOT_BF16, 4, 0)
        q1 = _load_qt(q_ptr, t64, stride_q_t, stride_q_h, num_heads, HEAD_DIM, H_P2, D_P2, DOT_BF16, 4, 1)
        q2 = _load_qt(q_ptr, t64, stride_q_t, stride_q_h, num_heads, HEAD_DIM, H_P2, D_P2, DOT_BF16, 4, 2)
        q3 = _load_qt(q_ptr, t64, stride_q_t, stride_q_h, num_heads, HEAD_DIM, H_P2, D_P2, DOT_BF16, 4, 3)
    else:
        q = _load_qt(q_ptr, t64, stride_q_t, stride_q_h, num_heads, HEAD_DIM, H_P2, D_P2, DOT_BF16, 1, 0)
    scratch = scratch_ptr + (t64 * num_splits + split) * K_P2
    SUBS: tl.constexpr = K_P2 // BLOCK_N
    n_sub = tl.cdiv(tl.maximum(tl.cdiv(n, K_P2) - split, 0), num_splits) * SUBS  # this split's steps
    best = tl.full([K_P2], INT64_MIN, tl.int64)  # sorted descending
    x, scale, valid, e = _gather_step(0, split, num_splits, n, req, bt_ptr, stride_bt, max_blocks, num_blocks,
                                      block_size, cache_ptr, stride_cache_block, stride_cache_entry,
                                      HEAD_DIM, D_P2, BLOCK_N, K_P2, IS_FP8, WORDS)
    for i in range(0, n_sub):
        # the next step's loads are issued first: they travel while this step is scored
        xn, scale_n, valid_n, e_n = _gather_step(i + 1, split, num_splits, n, req, bt_ptr, stride_bt, max_blocks,
                                                 num_blocks, block_size, cache_ptr, stride_cache_block,
                                                 stride_cache_entry, HEAD_DIM, D_P2, BLOCK_N, K_P2, IS_FP8, WORDS)
        if WORDS:
            s = _score_words(q0, q1, q2, q3, w, x, scale, DOT_BF16, ASM)
        else:
            s = _score(q, w, x, scale, IS_FP8, DOT_BF16)
        tl.store(scratch + (i % SUBS) * BLOCK_N + tl.arange(0, BLOCK_N), _score_keys(s, e, valid))
        if i % SUBS == SUBS - 1:  # a whole chunk of K_P2 keys is in the scratch row
            tl.debug_barrier()
            cand = tl.load(scratch + tl.arange(0, K_P2))
            tl.debug_barrier()  # every lane has read the chunk before the next one is written
            if i == SUBS - 1:
                best = tl.sort(cand, descending=True)
            elif FEW > 0:
                best = _merge_chunk_few(best, cand, K_P2, LOG_K, FEW)
            elif tl.max(cand, axis=0) > tl.min(best, axis=0):
                best = _merge_chunk(best, cand, K_P2, LOG_K)
        x, scale, valid, e = xn, scale_n, valid_n, e_n
    if SPLIT:
        tl.store(scratch + (K_P2 - 1) - tl.arange(0, K_P2), best)  # ascending
        tl.debug_barrier()  # every lane's stores are issued before the arrival (release, GPU scope)
        arrived = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
        if arrived == num_splits - 1:  # the token's other splits have all left their lists
            tl.debug_barrier()
            tl.store(count_ptr + t, 0)  # the next launch finds the counter at zero
            best = _merge_splits(scratch_ptr + t64 * num_splits * K_P2, num_splits, K_P2, LOG_K)
            _store_topk(best, idx_ptr, val_ptr, t64, stride_idx_t, stride_val_t, topk, K_P2)
    else:
        _store_topk(best, idx_ptr, val_ptr, t64, stride_idx_t, stride_val_t, topk, K_P2)
