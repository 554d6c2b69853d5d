"""Public compressor pooling op: validate -> allocate -> dispatch (Triton kernel or reference).

:func:`compressor_pool` builds compressed entries from the state rows saved in the paged state
cache (the rows themselves are written by :func:`dsv4attn.ops.cache_ops.write_compressor_state`).
RMSNorm, RoPE and the quantised insert of the pooled entries stay with the caller. Semantics:
:mod:`dsv4attn.reference.compressor`; kernel: :mod:`dsv4attn.kernels.compressor`.
"""

from __future__ import annotations

import torch
import triton

from dsv4attn._checks import check_tensor, same_device
from dsv4attn.device import resolve_impl
from dsv4attn.kernels.compressor import _compressor_pool_kernel
from dsv4attn.reference.compressor import compressor_pool_ref

_POS_DTYPES = (torch.int32, torch.int64)
#: Channels per program: [L_P2, 64] fp32 kv + score tiles (L = 8 or 128 rows).
_BLOCK_D = 64


def compressor_pool(
    state_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    overlap: bool,
    *,
    validate_indices: bool = True,
    impl: str = "auto",
) -> torch.Tensor:
    """Pool compressed entries from a paged compressor-state cache.

    state_cache: fp32 ``(num_blocks, block_size, 2*coff*D)`` (rows ``[kv | score]``, contiguous
    rows, any block stride); ``coff = 2`` if ``overlap`` (CSA) else 1. block_table: int32
    ``[R, max_blocks]`` of the state group (entry ``pos`` at ``block_table[req, pos // bs]``; -1 =
    freed). token_to_req: int32 ``[N]``. positions: int32/int64 ``[N]``: row n pools entry
    ``positions[n] // ratio`` (give the position of the token completing it, ``k*r + r - 1``);
    ``-1`` (any negative) -> a zero row (so is a row whose request is not a table row, when
    unchecked). ratio: >= 1 (4 for CSA, 128 for HCA).

    Returns fp32 ``[N, D]``: per channel, the softmax over the window's valid rows of the score
    times kv (window rows and column halves: :mod:`dsv4attn.reference.compressor`); 0 where no
    row is valid. ``validate_indices=False`` skips the value checks (a host sync); bad values are
    then masked in the kernel, never dereferenced.
    """
    check_tensor("state_cache", state_cache, dtype=torch.float32, ndim=3)
    check_tensor("positions", positions, dtype=_POS_DTYPES, ndim=1)
    N = positions.shape[0]
    device = same_device(state_cache=state_cache, positions=positions)
    check_tensor("token_to_req", token_to_req, dtype=torch.int32, shape=(N,), device=device)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=device)
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"ratio must be a positive int, got {ratio!r}")
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {type(overlap).__name__}")
    coff = 2 if overlap else 1
    nb, bs, width = state_cache.shape
    if nb < 1 or bs < 1 or width < 2 * coff or width % (2 * coff) or state_cache.stride(2) != 1:
        raise ValueError(f"state_cache must be (num_blocks >= 1, block_size >= 1, 2*{coff}*D) with contiguous "
                         f"rows, got shape {tuple(state_cache.shape)} strides {state_cache.stride()}")
    R, cols = block_table.shape
    if cols > 0 and block_table.stride(1) != 1:
        raise ValueError(f"block_table rows must be contiguous, got strides {block_table.stride()}")
    if N and R == 0:
        raise ValueError("block_table has no rows but positions is not empty")
    if validate_indices and N:
        lo, hi = (int(v) for v in torch.aminmax(token_to_req))
        if lo < 0 or hi >= R:
            raise ValueError(f"token_to_req values must be in [0, {R}), got [{lo}, {hi}]")
        if block_table.numel():
            lo, hi = (int(v) for v in torch.aminmax(block_table))
            if lo < -1 or hi >= nb:
                raise ValueError(f"block_table ids must be in [-1, {nb}), got [{lo}, {hi}]")
        hi = int(positions.max())
        if hi >= 0 and (hi // ratio + 1) * ratio > cols * bs:
            raise ValueError(f"positions has {hi}: its window ends past the block table "
                             f"({cols} columns x block_size {bs})")
    path = resolve_impl(impl, device)
    if path == "reference":
        return compressor_pool_ref(state_cache, block_table, token_to_req, positions, ratio, overlap)
    dim = width // (2 * coff)
    out = torch.empty((N, dim), dtype=torch.float32, device=device)
    if N == 0:
        return out
    block_d = min(_BLOCK_D, triton.next_power_of_2(dim))
    _compressor_pool_kernel[(N, triton.cdiv(dim, block_d))](
        state_cache, block_table, token_to_req, positions, out,
        state_cache.stride(0), state_cache.stride(1), block_table.stride(0), out.stride(0),
        R, bs, cols, nb, ratio, dim,
        COFF=coff, L_P2=triton.next_power_of_2(coff * ratio), BLOCK_D=block_d,
    )
    return out
