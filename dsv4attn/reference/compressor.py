"""Plain-PyTorch compressor pooling (the executable spec of
:func:`dsv4attn.ops.compressor.compressor_pool`).

A compressor with ratio ``r`` and entry width ``D`` keeps one fp32 state row per raw position,
``[kv (coff*D) | score (coff*D)]`` (``coff = 2`` with overlapping windows, CSA; ``1`` otherwise,
HCA; the score already includes the position bias). Entry ``k`` pools the ``L = coff * r`` rows
at positions ``k*r - (coff-1)*r .. k*r + r - 1`` ("window order"):

- with overlap, the first ``r`` rows (previous block) use columns ``[0, D)`` of kv and score, the
  last ``r`` rows (current block) use ``[D, 2D)``; without overlap every row uses ``[0, D)``;
- a row is valid iff its position is >= 0 and its state slot exists (block-table column in
  range, block id in ``[0, num_blocks)``); invalid rows get weight 0 and are never read;
- per channel ``d``: ``out[d] = sum_rows softmax_rows(score[:, d]) * kv[:, d]``; a channel with
  no valid row gives 0.
"""

from __future__ import annotations

import torch

from dsv4attn.kv_cache.slots import entry_slots


def pool_window_rows(rows: torch.Tensor, valid: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """rows fp32 ``[N, L, 2*coff*D]`` (window order), valid bool ``[N, L]`` -> pooled fp32 ``[N, D]``."""
    coff = 2 if overlap else 1
    D = rows.shape[2] // (2 * coff)
    half = coff * D  # kv columns, then score columns
    r = ratio
    if overlap:
        kv = torch.cat([rows[:, :r, 0:D], rows[:, r:, D:2 * D]], dim=1)
        score = torch.cat([rows[:, :r, half:half + D], rows[:, r:, half + D:half + 2 * D]], dim=1)
    else:
        kv, score = rows[:, :, :D], rows[:, :, half:half + D]
    score = score.float().masked_fill(~valid[:, :, None], float("-inf"))
    kv = kv.float().masked_fill(~valid[:, :, None], 0.0)
    weights = torch.softmax(score, dim=1).nan_to_num(nan=0.0)  # all rows invalid -> 0
    return (kv * weights).sum(dim=1)


def window_positions(entry_index: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """entry indices ``[N]`` -> raw positions of their window rows int64 ``[N, L]`` (may be < 0)."""
    coff = 2 if overlap else 1
    offs = torch.arange(coff * ratio, device=entry_index.device) - (coff - 1) * ratio
    return entry_index.long()[:, None] * ratio + offs


def state_row_slots(positions: torch.Tensor, req: torch.Tensor, block_table: torch.Tensor, block_size: int,
                    num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of raw positions in a state cache: positions/req ``[...]`` -> (slot int64, valid bool).

    Invalid (negative position, column beyond the table, block id outside ``[0, num_blocks)``):
    slot 0, valid False.
    """
    slot = entry_slots(block_table, req, positions, block_size)  # the one slot formula (-1 = hole)
    ok = (slot >= 0) & (slot < num_blocks * block_size)  # also: a block id past the cache
    return torch.where(ok, slot, torch.zeros_like(slot)), ok


def compressor_pool_ref(
    state_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    overlap: bool,
) -> torch.Tensor:
    """Reference of :func:`dsv4attn.ops.compressor.compressor_pool` (validated input assumed).

    state_cache fp32 ``(num_blocks, bs, 2*coff*D)``, block_table int32 ``[R, max_blocks]``,
    token_to_req int32 ``[N]``, positions int ``[N]`` -> fp32 ``[N, D]``: row n pools entry
    ``positions[n] // ratio`` of request ``token_to_req[n]``; rows with ``positions[n] < 0`` (or a
    request that is not a table row) are 0.
    """
    N = positions.shape[0]
    nb, bs, width = state_cache.shape
    coff = 2 if overlap else 1
    out = torch.zeros((N, width // (2 * coff)), dtype=torch.float32, device=state_cache.device)
    req_ok = (token_to_req >= 0) & (token_to_req < block_table.shape[0])
    use = ((positions >= 0) & req_ok).nonzero().squeeze(1)
    if use.numel() == 0:
        return out
    entry = torch.div(positions[use].long(), ratio, rounding_mode="floor")
    pos = window_positions(entry, ratio, overlap)  # [n, L]
    req = token_to_req[use].long()[:, None].expand_as(pos)
    slot, ok = state_row_slots(pos, req, block_table, bs, nb)
    rows = state_cache[torch.div(slot, bs, rounding_mode="floor"), slot % bs]  # [n, L, width]
    out[use] = pool_window_rows(rows, ok, ratio, overlap)
    return out
