"""Triton compressor pooling: the gated softmax over one window of state rows per entry.

Grid ``(N, cdiv(D, BLOCK_D))``: one program per (pooled row, block of ``BLOCK_D`` channels).
It computes the window's ``L = coff * r`` row positions (8 for CSA, 128 for HCA), looks each up
in the request's state block-table row, and loads the ``[L_P2, BLOCK_D]`` kv and score tiles of
the valid rows in one go (rows of the previous block read columns ``[0, D)``, of the current
block ``[D, 2D)`` when windows overlap); invalid rows load kv 0 / score -inf through clamped
addresses, so NaN in unused pages never enters. Then a column softmax over the rows and the
weighted sum, fp32 throughout; a channel without any valid row gives 0. Semantics:
:mod:`dsv4attn.reference.compressor`. Byte offsets are int64.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4attn.kernels.common import block_id


@triton.jit
def _compressor_pool_kernel(
    state_ptr, bt_ptr, t2r_ptr, pos_ptr, out_ptr,
    stride_state_block, stride_state_entry, stride_bt, stride_out_n,
    num_reqs, block_size, max_blocks, num_blocks, ratio, dim,
    COFF: tl.constexpr, L_P2: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """state fp32 ``(num_blocks, bs, 2*COFF*dim)``; writes ``out [N, dim]`` fp32."""
    n = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < dim
    out = out_ptr + n.to(tl.int64) * stride_out_n + d
    p = tl.load(pos_ptr + n).to(tl.int64)
    req = tl.load(t2r_ptr + n).to(tl.int64)
    if (p < 0) | (req < 0) | (req >= num_reqs):
        tl.store(out, tl.zeros([BLOCK_D], tl.float32), mask=dm)
        return
    w_row = tl.arange(0, L_P2)
    rowpos = (p // ratio) * ratio - (COFF - 1) * ratio + w_row
    valid = (w_row < COFF * ratio) & (rowpos >= 0)
    blk = block_id(bt_ptr, req, rowpos // block_size, valid, stride_bt, 1, max_blocks)
    valid = (blk >= 0) & (blk < num_blocks)
    row = (tl.where(valid, blk, 0).to(tl.int64) * stride_state_block
           + tl.where(valid, rowpos % block_size, 0) * stride_state_entry)
    if COFF == 2:
        row = row + tl.where(w_row >= ratio, dim, 0)  # current block: second half of the columns
    m2 = valid[:, None] & dm[None, :]
    addr = state_ptr + row[:, None] + d[None, :]
    kv = tl.load(addr, mask=m2, other=0.0)
    score = tl.load(addr + COFF * dim, mask=m2, other=float("-inf"))
    mx = tl.max(score, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    e = tl.exp(score - mx[None, :])  # invalid rows: exp(-inf) = 0
    den = tl.sum(e, axis=0)
    num = tl.sum(e * kv, axis=0)
    tl.store(out, tl.where(den > 0.0, num / tl.where(den > 0.0, den, 1.0), 0.0), mask=dm)
