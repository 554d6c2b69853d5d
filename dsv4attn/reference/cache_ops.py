"""Plain-PyTorch cache writers: the executable spec of dsv4attn/ops/cache_ops.py.

Each ``*_ref`` has the op's signature minus ``impl``/``validate_slots`` and assumes validated
input. Slots ``< 0`` (and, defensively, ``>= num_blocks * block_size``) are skipped.

The page formats (fp8_ds_mla, indexer-key, compressor-state) live in
:mod:`dsv4attn.kv_cache.layout`.
"""

from __future__ import annotations

import torch

from dsv4attn.kv_cache.layout import (
    INDEXER_SCALE_BYTES,
    FP8DSMLALayout,
    alloc_indexer_k_cache,
    dequantize_indexer_k,
    indexer_page_bytes,
    indexer_pages_of,
    layout_for_head_dim,
    pages_of,
    quantize_indexer_k,
    quantize_tokens,
)
from dsv4attn.kv_cache.slots import split_slots

#: Page-format helpers re-exported from their home, :mod:`dsv4attn.kv_cache.layout`.
__all__ = [
    "alloc_indexer_k_cache",
    "dequantize_indexer_k",
    "indexer_page_bytes",
    "indexer_pages_of",
    "insert_indexer_k_ref",
    "insert_kv_ref",
    "quantize_indexer_k",
    "write_compressor_state_ref",
]


def _split_slots(slot_mapping: torch.Tensor, num_blocks: int, block_size: int):
    slots = slot_mapping.long()
    valid = (slots >= 0) & (slots < num_blocks * block_size)
    rows = valid.nonzero().squeeze(1)
    blk, off = split_slots(slots[rows], block_size)
    return rows, blk, off


def insert_kv_ref(
    kv: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache: torch.Tensor,
    kv_cache_dtype: str = "fp8_ds_mla",
    layout: FP8DSMLALayout | None = None,
) -> None:
    """Reference of :func:`dsv4attn.ops.cache_ops.insert_kv` (same semantics, in place)."""
    nb, bs = cache.shape[0], cache.shape[1]
    rows, blk, off = _split_slots(slot_mapping, nb, bs)
    if rows.numel() == 0:
        return
    if kv_cache_dtype == "auto":
        cache[blk, off] = kv[rows].to(cache.dtype)
        return
    layout = layout or layout_for_head_dim(kv.shape[1], 64)
    q8, rope, scale = quantize_tokens(kv[rows], layout)
    pages = pages_of(cache, layout)
    data = torch.cat([q8, rope.contiguous().view(torch.uint8)], dim=-1)  # [n, data_bytes]
    cols = off[:, None] * layout.data_bytes + torch.arange(layout.data_bytes, device=cache.device)
    pages[blk[:, None], cols] = data
    sc = torch.zeros(rows.numel(), layout.scale_bytes, dtype=torch.uint8, device=cache.device)
    sc[:, : layout.num_tiles] = scale
    cols = (layout.scale_offset(bs) + off[:, None] * layout.scale_bytes
            + torch.arange(layout.scale_bytes, device=cache.device))
    pages[blk[:, None], cols] = sc


def insert_indexer_k_ref(
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache: torch.Tensor,
    kv_cache_dtype: str = "fp8_ds_mla",
) -> None:
    """Reference of :func:`dsv4attn.ops.cache_ops.insert_indexer_k` (in place)."""
    nb, bs = cache.shape[0], cache.shape[1]
    rows, blk, off = _split_slots(slot_mapping, nb, bs)
    if rows.numel() == 0:
        return
    if kv_cache_dtype == "auto":
        cache[blk, off] = k[rows].to(cache.dtype)
        return
    d = k.shape[1]
    q8, scale = quantize_indexer_k(k[rows])
    pages = indexer_pages_of(cache)
    ar = torch.arange(d, device=cache.device)
    pages[blk[:, None], off[:, None] * d + ar] = q8
    ar4 = torch.arange(INDEXER_SCALE_BYTES, device=cache.device)
    pages[blk[:, None], bs * d + off[:, None] * INDEXER_SCALE_BYTES + ar4] = scale.view(torch.uint8).reshape(-1, 4)


def write_compressor_state_ref(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    state_cache: torch.Tensor,
) -> None:
    """Reference of :func:`dsv4attn.ops.cache_ops.write_compressor_state` (in place)."""
    nb, bs = state_cache.shape[0], state_cache.shape[1]
    rows, blk, off = _split_slots(slot_mapping, nb, bs)
    if rows.numel() == 0:
        return
    r = ape.shape[0]
    bias = ape[torch.remainder(positions[rows].long(), r)].float()
    state_cache[blk, off] = torch.cat([kv[rows].float(), score[rows].float() + bias], dim=-1).to(state_cache.dtype)
