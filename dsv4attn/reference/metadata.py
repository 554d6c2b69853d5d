"""Plain-PyTorch references of the per-step metadata ops: the executable spec.

Each ``foo_ref`` has the signature of the public op ``dsv4attn.ops.metadata.foo`` (without
``impl``), receives already-validated and already-allocated outputs, writes them, and returns
the same slices the op returns. Vectorised torch code, no host sync beyond what torch needs.

Conventions shared by every op (see ``dsv4attn/ops/metadata.py`` for the full docstrings):
- ``block_size`` counts ENTRIES physically stored per block (SWA 64, C4A compressed 64,
  C128A compressed 2); slots come from :func:`dsv4attn.kv_cache.slots.entry_slots` (one formula,
  one meaning of holes: an entry whose block column lies beyond ``block_table.shape[1]`` or whose
  block id is negative becomes -1 instead of an out-of-bounds read; the builders reject such
  batches up front).
"""

from __future__ import annotations

import torch

from dsv4attn.kv_cache.slots import C128A_TOPK_ALIGNMENT, block_slots, entry_slots

__all__ = [
    "C128A_TOPK_ALIGNMENT",
    "build_c128a_topk_metadata_ref",
    "compute_c128a_range_lengths_ref",
    "compute_global_topk_indices_and_lens_ref",
    "compute_swa_indices_and_lens_ref",
    "compute_swa_ranges_ref",
    "get_compressed_slot_mapping_ref",
]


def get_compressed_slot_mapping_ref(
    num_tokens: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    compress_ratio: int,
    out: torch.Tensor,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_kv_cache_interleave_size: int = 1,
) -> torch.Tensor:
    """Reference of ``get_compressed_slot_mapping``; ``out`` is required here (the op allocates)."""
    out.fill_(-1)
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out[:num_tokens]
    dev = out.device
    t = torch.arange(num_tokens, device=dev, dtype=torch.int64)
    qsl = query_start_loc.long()
    total = qsl[num_reqs]
    # req = the last request whose start is <= t (zero-length requests are skipped over).
    req = torch.searchsorted(qsl[1:].contiguous(), t, right=True).clamp(max=num_reqs - 1)
    start = qsl[req]
    qlen = qsl[req + 1] - start
    p = seq_lens.long()[req] - qlen + (t - start)
    valid = (t < total) & (p >= 0) & (torch.remainder(p + 1, compress_ratio) == 0)
    # The engine's formula: entry c = p // r; entries are dealt to CP ranks within each virtual
    # block of block_size * world entries, in chunks of the interleave size I.
    c = torch.div(p.clamp(min=0), compress_ratio, rounding_mode="floor")
    il, ws = cp_kv_cache_interleave_size, cp_world_size
    vbs = block_size * ws
    voff = torch.remainder(c, vbs)
    valid &= torch.remainder(torch.div(voff, il, rounding_mode="floor"), ws) == cp_rank
    off = torch.div(voff, ws * il, rounding_mode="floor") * il + torch.remainder(voff, il)
    col = torch.div(c, vbs, rounding_mode="floor")
    out[:num_tokens] = block_slots(block_table, req, col, off, block_size, valid)
    return out[:num_tokens]


def build_c128a_topk_metadata_ref(
    positions: torch.Tensor,
    compress_ratio: int,
    num_decode_tokens: int,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    slot_mapping: torch.Tensor,
    global_decode_buffer: torch.Tensor,
    decode_lens_buffer: torch.Tensor,
    prefill_buffer: torch.Tensor,
    max_compressed_tokens: int,
    full_width: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of ``build_c128a_topk_metadata`` (writes rows token by token group, vectorised)."""
    num_tokens = positions.shape[0]
    nd = num_decode_tokens
    n = ((positions.long() + 1) // compress_ratio).clamp(0, max_compressed_tokens)  # [T]
    if full_width:
        ends = torch.full_like(n, max_compressed_tokens)
    else:
        align = C128A_TOPK_ALIGNMENT
        ends = ((n + align - 1) // align * align).clamp(max=max_compressed_tokens)
    cols = torch.arange(max_compressed_tokens, device=positions.device, dtype=torch.int64)
    if nd > 0:
        nn, ee = n[:nd, None], ends[:nd, None]
        req = token_to_req_indices[:nd, None].long().expand(nd, max_compressed_tokens)
        entry = cols[None, :].expand(nd, max_compressed_tokens)
        slots = entry_slots(block_table, req, entry, block_size, entry < nn).to(torch.int32)
        rows = global_decode_buffer[:nd, :max_compressed_tokens]
        keep = entry >= ee  # columns this form does not write
        rows.copy_(torch.where(keep, rows, slots))
        lens = torch.where(slot_mapping[:nd] >= 0, n[:nd], torch.zeros_like(n[:nd]))
        decode_lens_buffer[:nd] = lens.to(torch.int32)
    npf = num_tokens - nd
    if npf > 0:
        nn, ee = n[nd:, None], ends[nd:, None]
        entry = cols[None, :].expand(npf, max_compressed_tokens)
        local = torch.where(entry < nn, entry, torch.full_like(entry, -1)).to(torch.int32)
        rows = prefill_buffer[:npf, :max_compressed_tokens]
        rows.copy_(torch.where(entry >= ee, rows, local))
    return global_decode_buffer[:nd], decode_lens_buffer[:nd], prefill_buffer[:npf]


def compute_swa_indices_and_lens_ref(
    positions: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    slot_mapping: torch.Tensor,
    window_size: int,
    indices_out: torch.Tensor,
    lens_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``compute_swa_indices_and_lens``."""
    num_tokens = positions.shape[0]
    p = positions.long()[:, None]
    start = (p - window_size + 1).clamp(min=0)
    length = torch.where(slot_mapping[:, None] >= 0, p + 1 - start, torch.zeros_like(p)).clamp(min=0)
    j = torch.arange(window_size, device=positions.device, dtype=torch.int64)[None, :]
    req = token_to_req_indices.long()[:, None].expand(num_tokens, window_size)
    entry = (start + j).expand(num_tokens, window_size)
    slots = entry_slots(block_table, req, entry, block_size, j < length)
    indices_out[:num_tokens, :window_size] = slots.to(torch.int32)
    lens_out[:num_tokens] = length[:, 0].to(torch.int32)
    return indices_out[:num_tokens, :window_size], lens_out[:num_tokens]


def compute_global_topk_indices_and_lens_ref(
    topk_local: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid_token: torch.Tensor,
    out: torch.Tensor,
    lens_out: torch.Tensor,
    entry_limit: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``compute_global_topk_indices_and_lens``."""
    num_tokens, k = topk_local.shape
    local = topk_local.long()
    req = token_to_req_indices.long()[:, None].expand(num_tokens, k)
    ok = local >= 0
    if entry_limit is not None:
        ok = ok & (local < entry_limit[:num_tokens, None].long())
    out[:num_tokens, :k] = entry_slots(block_table, req, local, block_size, ok).to(torch.int32)
    count = ok.sum(dim=1)
    lens_out[:num_tokens] = torch.where(is_valid_token, count, torch.zeros_like(count)).to(torch.int32)
    return out[:num_tokens, :k], lens_out[:num_tokens]


def compute_swa_ranges_ref(
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    window_size: int,
    starts_out: torch.Tensor,
    lengths_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``compute_swa_ranges``."""
    num_tokens = positions.shape[0]
    p = positions.long()
    start = (p - window_size + 1).clamp(min=0)
    length = torch.where(slot_mapping >= 0, p + 1 - start, torch.zeros_like(p)).clamp(min=0)
    starts_out[:num_tokens] = start.to(torch.int32)
    lengths_out[:num_tokens] = length.to(torch.int32)
    return starts_out[:num_tokens], lengths_out[:num_tokens]


def compute_c128a_range_lengths_ref(
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    compress_ratio: int,
    lengths_out: torch.Tensor,
) -> torch.Tensor:
    """Reference of ``compute_c128a_range_lengths``."""
    num_tokens = positions.shape[0]
    n = ((positions.long() + 1) // compress_ratio).clamp(min=0)
    n = torch.where(slot_mapping >= 0, n, torch.zeros_like(n))
    lengths_out[:num_tokens] = n.to(torch.int32)
    return lengths_out[:num_tokens]
