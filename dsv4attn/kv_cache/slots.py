"""The candidate-set contract's addressing, written once: entry -> block table -> slot.

Every paged cache stores ``block_size`` ENTRIES per block (SWA 64, C4A compressed 64 = 256 // 4,
C128A compressed 2 = 256 // 128, state caches 4 / 8). Entry ``e`` of a request's stream lives at

    slot = block_table[req, e // block_size] * block_size + e % block_size

and a slot is split back into ``(block, offset) = (slot // block_size, slot % block_size)``.

Holes have one meaning everywhere (metadata ops, references, kernels through
:func:`dsv4attn.kernels.common.entry_slot`): a candidate is a hole, slot ``-1``, when the caller
marks it invalid, when its entry is negative, when its block column is at or past the table's
width, or when the block id read from the table is negative (``NULL_BLOCK = -1``, a released
sliding-window block). A hole is never dereferenced.

C128A top-k rows are padded with -1 to a multiple of :data:`C128A_TOPK_ALIGNMENT` (FlashMLA
needs top-k widths that are a multiple of its B_TOPK, 64 or 128; vLLM ``_C128A_TOPK_ALIGNMENT``).
"""

from __future__ import annotations

import torch

#: The hole / skip value of slots, block ids and indices.
NULL_SLOT = -1
#: C128A top-k widths are multiples of this (see the module doc).
C128A_TOPK_ALIGNMENT = 128
#: The engine's default ``max_compressed_tokens`` of ``build_c128a_topk_metadata``.
DEFAULT_MAX_COMPRESSED_TOKENS = 8192


def round_up(x: int, m: int) -> int:
    """Smallest multiple of ``m`` that is ``>= x`` (``m >= 1``)."""
    return (x + m - 1) // m * m


def cdiv(x: int, m: int) -> int:
    return -(-x // m)


def c128a_max_compressed(max_model_len: int, compress_ratio: int = 128) -> int:
    """Row width of C128A top-k rows: ``round_up(cdiv(max_model_len, r), 128)``."""
    return round_up(cdiv(max_model_len, compress_ratio), C128A_TOPK_ALIGNMENT)


def block_slots(
    block_table: torch.Tensor, req: torch.Tensor, col: torch.Tensor, off: torch.Tensor, block_size: int,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """``block_table[req, col] * block_size + off`` as int64, -1 for holes (see the module doc).

    ``req``, ``col``, ``off`` (and ``valid``, bool) broadcast to one shape; invalid lanes never
    index the table (they read row 0, column 0, or nothing when the table is empty).
    """
    col = col.long()
    ok = (col >= 0) & (col < block_table.shape[1])
    if valid is not None:
        ok = ok & valid
    if block_table.shape[0] == 0 or block_table.shape[1] == 0:
        return torch.full(torch.broadcast_shapes(req.shape, col.shape, off.shape), NULL_SLOT,
                          dtype=torch.int64, device=block_table.device)
    zero = torch.zeros((), dtype=torch.int64, device=block_table.device)
    req_i = torch.where(ok, req.long(), zero)
    col_i = torch.where(ok, col, zero)
    blk = block_table[req_i, col_i].long()
    ok = ok & (blk >= 0)
    slot = blk * block_size + off.long()
    return torch.where(ok, slot, torch.full_like(slot, NULL_SLOT))


def entry_slots(
    block_table: torch.Tensor, req: torch.Tensor, entry: torch.Tensor, block_size: int,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """int64 global slots of entries ``entry`` of requests ``req`` (broadcast); -1 for holes,
    including negative entries."""
    entry = entry.long()
    ok = entry >= 0 if valid is None else valid & (entry >= 0)
    col = torch.div(entry, block_size, rounding_mode="floor")
    return block_slots(block_table, req, col, torch.remainder(entry, block_size), block_size, ok)


def split_slots(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block, offset)`` int64 of global slots (valid slots only; holes give negative blocks)."""
    s = slots.long()
    return torch.div(s, block_size, rounding_mode="floor"), torch.remainder(s, block_size)
