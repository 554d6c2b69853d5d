"""Plain-PyTorch cache writers (the executable spec of dsv4attn/ops/cache_ops.py) and the
indexer-key page format helpers.

Each ``*_ref`` has the op's signature minus ``impl``/``validate_slots`` and assumes validated
input. Slots ``< 0`` (and, defensively, ``>= num_blocks * block_size``) are skipped.

Indexer key page (``fp8_ds_mla`` mode), block of ``bs`` entries of ``D`` dims, offsets in bytes:
``[0, bs*D)`` fp8 e4m3fn values (entry ``i`` at ``i*D``), ``[bs*D, bs*D + bs*4)`` one fp32 scale
per entry (entry ``i`` at ``bs*D + i*4``, the power-of-two value itself, little endian), then
zero padding to ``page_bytes`` (a multiple of 576 in production). ``auto`` mode: bf16 rows.
"""

from __future__ import annotations

import torch

from dsv4attn.kv_cache.layout import (
    AMAX_FLOOR,
    FP8_E4M3_MAX,
    FP8DSMLALayout,
    layout_for_head_dim,
    pages_of,
    quantize_tokens,
    round_up,
)
from dsv4attn.kv_cache.specs import INDEXER_SCALE_BYTES

#: Default page alignment of indexer-key pages (one production token-data row).
INDEXER_PAGE_ALIGN = 576


def indexer_page_bytes(block_size: int, index_head_dim: int = 128, align: int = INDEXER_PAGE_ALIGN) -> int:
    """Padded page size (= block stride) of an fp8 indexer-key cache: 8640 for (64, 128)."""
    return round_up(block_size * (index_head_dim + INDEXER_SCALE_BYTES), align)


def alloc_indexer_k_cache(num_blocks: int, block_size: int, index_head_dim: int = 128,
                          device: torch.device | str = "cpu", fill: int | None = 0,
                          align: int = INDEXER_PAGE_ALIGN) -> torch.Tensor:
    """``(num_blocks, block_size, index_head_dim + 4)`` uint8 view with padded block stride."""
    page = indexer_page_bytes(block_size, index_head_dim, align)
    flat = torch.empty(num_blocks * page, dtype=torch.uint8, device=device)
    if fill is not None:
        flat.fill_(fill)
    return flat.as_strided((num_blocks, block_size, index_head_dim + INDEXER_SCALE_BYTES),
                           (page, index_head_dim + INDEXER_SCALE_BYTES, 1))


def indexer_pages_of(cache: torch.Tensor) -> torch.Tensor:
    """``(num_blocks, block_stride)`` uint8 view of the pages behind an indexer-key cache view."""
    return cache.as_strided((cache.shape[0], cache.stride(0)), (cache.stride(0), 1))


def quantize_indexer_k(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k [..., D]`` -> (fp8 e4m3fn bytes ``[..., D]`` uint8, fp32 scales ``[...]``).

    One block of ``D`` per entry: x rounded to bf16, ``amax = max(max|x|, 1e-4)``,
    ``scale = 2^ceil(log2(amax / 448))``, values ``clamp(x / scale, -448, 448)`` to e4m3fn.
    """
    x = k.to(torch.bfloat16).float()
    amax = x.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_E4M3_MAX)))
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn).view(torch.uint8), scale


def dequantize_indexer_k(cache: torch.Tensor) -> torch.Tensor:
    """fp8 indexer-key cache view ``(num_blocks, bs, D + 4)`` -> fp32 ``(num_blocks, bs, D)``."""
    nb, bs, d = cache.shape[0], cache.shape[1], cache.shape[2] - INDEXER_SCALE_BYTES
    pages = indexer_pages_of(cache)
    vals = pages[:, : bs * d].reshape(nb, bs, d).contiguous().view(torch.float8_e4m3fn).float()
    scale = pages[:, bs * d : bs * d + bs * INDEXER_SCALE_BYTES].contiguous().view(torch.float32)
    return vals * scale.reshape(nb, bs, 1)


def _split_slots(slot_mapping: torch.Tensor, num_blocks: int, block_size: int):
    slots = slot_mapping.long()
    valid = (slots >= 0) & (slots < num_blocks * block_size)
    rows = valid.nonzero().squeeze(1)
    s = slots[rows]
    return rows, s // block_size, s % block_size


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
    bias = ape[torch.remainder(positions[rows].long(), r)]
    state_cache[blk, off] = torch.cat([kv[rows], score[rows] + bias], dim=-1).to(state_cache.dtype)
