"""Cache specs: which paged caches each DeepSeek-V4 layer kind owns, and their page geometry.

A layer with compress ratio ``r`` owns (docs/cache-format.md, dsv4-system.md section 3):

=========  ===========================================================================
SWA-only   ``swa_kv``
C4A (r=4)  ``swa_kv``, ``compressed_kv``, ``indexer_k``, ``compressor_state``,
           ``indexer_compressor_state``
C128A      ``swa_kv``, ``compressed_kv``, ``compressor_state``
=========  ===========================================================================

Every cache belongs to one allocation *group* (one block table per request per group):

- ``full_mla``  (full, 256 raw tokens per block-table column): compressed KV of C4A and C128A
  and the C4A indexer keys; stored entries per block = 256 // r (64 for r=4, 2 for r=128).
- ``swa``       (sliding, window 128 raw positions, 64 per block): every layer's SWA KV.
- ``c4_state``  (sliding, window 2r = 8, 4 per block): C4A main + indexer compressor states.
- ``c128_state`` (sliding, window r = 128, 8 per block): C128A main compressor state.

Sizes are functions of :class:`CacheConfig`, so small test models get consistent specs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from dsv4attn._checks import INT32_MAX, check_int
from dsv4attn.kv_cache.layout import (
    BF16_BYTES,
    FP32_BYTES,
    INDEXER_SCALE_BYTES,
    FP8DSMLALayout,
    IndexerKLayout,
    normalize_kv_cache_dtype,
    compressor_coff,
    compressor_overlap,
    page_bytes,
    state_page_bytes,
    state_row_width,
    state_window,
)

KVCacheDtype = Literal["fp8_ds_mla", "auto"]
#: Compress ratios DeepSeek-V4 accepts per layer (0 in a HF config means 1 = SWA-only).
SUPPORTED_RATIOS = (1, 4, 128)
__all__ = [
    "GROUPS", "GROUP_C128_STATE", "GROUP_C4_STATE", "GROUP_FULL_MLA", "GROUP_SWA", "INDEXER_SCALE_BYTES",
    "CacheConfig", "CacheSpec", "GroupSpec", "cache_groups", "compressor_coff",
    "compressor_overlap", "indexer_entry_bytes", "layer_cache_specs", "state_row_width", "state_window",
    "v4_flash_config", "V4_FLASH_COMPRESS_RATIOS",
]

#: The cache groups, one name each, used by the specs, the allocator, the metadata and the
#: runner alike (vLLM's KV-cache groups of DeepSeek-V4, dsv4-system.md 3.3).
GROUP_FULL_MLA = "full_mla"
GROUP_SWA = "swa"
GROUP_C4_STATE = "c4_state"
GROUP_C128_STATE = "c128_state"
GROUPS = (GROUP_FULL_MLA, GROUP_SWA, GROUP_C4_STATE, GROUP_C128_STATE)


@dataclass(frozen=True)
class CacheConfig:
    """The model/cache fields that fix every cache's geometry (production defaults = V4).

    ``compress_ratios``: one entry per layer, 0 or 1 = SWA-only, 4 = C4A, 128 = C128A.
    ``block_size``: raw tokens per block-table column of the full-MLA group (256 in vLLM).
    ``swa_block_size`` / ``c4_state_block_size`` / ``c128_state_block_size``: raw positions
    per block of the sliding groups (64 / 4 / 8, chosen in vLLM so pages are ~37 KB).
    ``kv_cache_dtype``: ``"fp8_ds_mla"`` (uint8 pages) or ``"auto"`` (bf16 rows).
    """

    compress_ratios: tuple[int, ...] = ()
    head_dim: int = 512
    rope_dim: int = 64
    index_head_dim: int = 128
    sliding_window: int = 128
    block_size: int = 256
    swa_block_size: int = 64
    c4_state_block_size: int = 4
    c128_state_block_size: int = 8
    kv_cache_dtype: str = "fp8_ds_mla"

    def __post_init__(self) -> None:
        if isinstance(self.compress_ratios, (str, bytes)) or not hasattr(self.compress_ratios, "__iter__"):
            raise TypeError(f"compress_ratios must be a sequence of ints, got {type(self.compress_ratios).__name__}")
        object.__setattr__(self, "compress_ratios", tuple(self.compress_ratios))
        for i, r in enumerate(self.compress_ratios):
            check_int(f"compress_ratios[{i}]", r)
        for name in ("head_dim", "rope_dim", "index_head_dim", "sliding_window", "block_size", "swa_block_size",
                     "c4_state_block_size", "c128_state_block_size"):
            check_int(name, getattr(self, name), 0 if name == "rope_dim" else 1, INT32_MAX)
        bad = [r for r in self.compress_ratios if r not in (0, *SUPPORTED_RATIOS)]
        if bad:
            raise ValueError(f"compress_ratios entries must be 0, 1, 4 or 128, got {bad}")
        object.__setattr__(self, "kv_cache_dtype", normalize_kv_cache_dtype(self.kv_cache_dtype))
        if self.kv_cache_dtype == "fp8_ds_mla":
            # fp8 pages quantise NoPE in 64-wide tiles: the limit of the page format, named here.
            FP8DSMLALayout(self.head_dim - self.rope_dim, self.rope_dim)
        elif not 0 <= self.rope_dim < self.head_dim or self.rope_dim % 2:
            raise ValueError(f"rope_dim must be even and in [0, head_dim={self.head_dim}), got {self.rope_dim}")
        for r in (4, 128):
            if r in self.compress_ratios and self.block_size % r:
                raise ValueError(f"block_size {self.block_size} must be a multiple of compress ratio {r}")

    @classmethod
    def from_hf(cls, hf_config: object, kv_cache_dtype: KVCacheDtype = "fp8_ds_mla") -> "CacheConfig":
        """Build from a HF ``DeepseekV4Config`` (or any object/dict with the same field names).

        Reads ``compress_ratios`` (or ``layer_types`` mapped through ``compress_rates``),
        ``head_dim``, ``qk_rope_head_dim``, ``index_head_dim``, ``sliding_window``.
        """
        get: Any = hf_config.get if isinstance(hf_config, dict) else (lambda k, d=None: getattr(hf_config, k, d))
        ratios = get("compress_ratios")
        if ratios is None:
            rates = {"sliding_attention": 1, "compressed_sparse_attention": 4,
                     "heavily_compressed_attention": 128, **(get("compress_rates") or {})}
            ratios = [rates[t] for t in get("layer_types")]
        return cls(
            compress_ratios=tuple(ratios),
            head_dim=get("head_dim", 512),
            rope_dim=get("qk_rope_head_dim", 64),
            index_head_dim=get("index_head_dim", 128),
            sliding_window=get("sliding_window", 128),
            kv_cache_dtype=kv_cache_dtype,
        )

    @property
    def num_layers(self) -> int:
        return len(self.compress_ratios)

    @property
    def layout(self) -> FP8DSMLALayout:
        return FP8DSMLALayout(self.head_dim - self.rope_dim, self.rope_dim)

    @property
    def page_align(self) -> int:
        """Alignment of fp8 pages: one token-data row, ``nope + 2 * rope`` bytes (576 in production)."""
        return self.head_dim + self.rope_dim

    def ratio(self, layer: int) -> int:
        """Effective compress ratio of ``layer`` (0 in the HF config means 1)."""
        return max(1, self.compress_ratios[layer])


@dataclass(frozen=True)
class CacheSpec:
    """One paged cache of one layer.

    ``tokens_per_block``: raw positions covered by one block-table column of its group.
    ``block_size``: entries physically stored per block (= tokens_per_block // compress_ratio
    for compressed streams). ``entry_bytes``: information bytes per entry. ``page_bytes``: block
    stride in bytes (entries + scales + padding). ``row_shape``/``dtype`` describe the tensor
    view handed to kernels: ``(num_blocks, block_size, *row_shape)``.
    """

    name: str
    layer: int
    group: str
    format: str
    compress_ratio: int
    tokens_per_block: int
    block_size: int
    entry_bytes: int
    page_bytes: int
    row_shape: tuple[int, ...]
    dtype: str

    def bytes_for_blocks(self, num_blocks: int) -> int:
        return num_blocks * self.page_bytes

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu", fill: int | float | None = 0) -> torch.Tensor:
        """A cache tensor for ``num_blocks`` blocks: ``(num_blocks, block_size, *row_shape)`` of
        ``dtype`` with block stride ``page_bytes`` (padding included). ``fill``: initial byte
        (uint8 caches) or value (row caches); ``None`` leaves memory uninitialised."""
        dtype = getattr(torch, self.dtype)
        item = torch.empty((), dtype=dtype).element_size()
        assert self.page_bytes % item == 0
        stride = self.page_bytes // item
        flat = torch.empty(num_blocks * stride, dtype=dtype, device=device)
        if fill is not None:
            flat.fill_(fill)
        row = self.row_shape[0]
        return flat.as_strided((num_blocks, self.block_size, row), (stride, row, 1))


@dataclass(frozen=True)
class GroupSpec:
    """An allocation group: caches that share one block table per request.

    ``kind``: ``"full"`` (grows with the sequence) or ``"sliding"`` (keeps only the blocks of
    the last ``window`` raw positions a future token can still read). ``tokens_per_block``: raw
    positions per block-table column.
    """

    name: str
    kind: Literal["full", "sliding"]
    tokens_per_block: int
    window: int | None = None
    caches: tuple[CacheSpec, ...] = field(default=(), compare=False)

    @property
    def page_bytes_per_block(self) -> int:
        """Bytes one block id costs across every cache (layer) of the group."""
        return sum(c.page_bytes for c in self.caches)


def indexer_entry_bytes(index_head_dim: int, kv_cache_dtype: str) -> int:
    """fp8: ``index_head_dim`` fp8 bytes + one fp32 scale (132 B); auto: bf16 row (256 B)."""
    if kv_cache_dtype == "fp8_ds_mla":
        return IndexerKLayout(index_head_dim).entry_bytes
    return index_head_dim * BF16_BYTES


def _kv_spec(cfg: CacheConfig, name: str, layer: int, group: str, ratio: int, tpb: int) -> CacheSpec:
    bs = tpb // ratio
    if cfg.kv_cache_dtype == "fp8_ds_mla":
        lay = cfg.layout
        return CacheSpec(name, layer, group, "fp8_ds_mla", ratio, tpb, bs, lay.entry_bytes,
                         lay.page_bytes(bs), (lay.entry_bytes,), "uint8")
    row = cfg.head_dim * BF16_BYTES
    return CacheSpec(name, layer, group, "bf16", ratio, tpb, bs, row, page_bytes(bs, row), (cfg.head_dim,), "bfloat16")


def _indexer_spec(cfg: CacheConfig, layer: int) -> CacheSpec:
    tpb, ratio = cfg.block_size, 4
    bs = tpb // ratio
    eb = indexer_entry_bytes(cfg.index_head_dim, cfg.kv_cache_dtype)
    if cfg.kv_cache_dtype == "fp8_ds_mla":
        return CacheSpec("indexer_k", layer, GROUP_FULL_MLA, "indexer_fp8", ratio, tpb, bs, eb,
                         IndexerKLayout(cfg.index_head_dim, cfg.page_align).page_bytes(bs), (eb,), "uint8")
    return CacheSpec("indexer_k", layer, GROUP_FULL_MLA, "bf16", ratio, tpb, bs, eb, page_bytes(bs, eb),
                     (cfg.index_head_dim,), "bfloat16")


def _state_spec(cfg: CacheConfig, name: str, layer: int, ratio: int, dim: int) -> CacheSpec:
    group, bs = ((GROUP_C4_STATE, cfg.c4_state_block_size) if ratio == 4
                 else (GROUP_C128_STATE, cfg.c128_state_block_size))
    width = state_row_width(ratio, dim)
    page = state_page_bytes(bs, ratio, dim, cfg.page_align)
    return CacheSpec(name, layer, group, "state_fp32", ratio, bs, bs, width * FP32_BYTES, page, (width,), "float32")


def layer_cache_specs(cfg: CacheConfig, layer: int) -> list[CacheSpec]:
    """The caches layer ``layer`` owns, in a fixed order (see the module docstring)."""
    if not 0 <= layer < cfg.num_layers:
        raise ValueError(f"layer must be in [0, {cfg.num_layers}), got {layer}")
    r = cfg.ratio(layer)
    specs = [_kv_spec(cfg, "swa_kv", layer, GROUP_SWA, 1, cfg.swa_block_size)]
    if r == 1:
        return specs
    specs.append(_kv_spec(cfg, "compressed_kv", layer, GROUP_FULL_MLA, r, cfg.block_size))
    if r == 4:
        specs.append(_indexer_spec(cfg, layer))
    specs.append(_state_spec(cfg, "compressor_state", layer, r, cfg.head_dim))
    if r == 4:
        specs.append(_state_spec(cfg, "indexer_compressor_state", layer, r, cfg.index_head_dim))
    return specs


def cache_groups(cfg: CacheConfig) -> list[GroupSpec]:
    """The allocation groups of a model, each with all its layers' caches; empty groups omitted.

    Order: ``full_mla``, ``swa``, ``c4_state``, ``c128_state``.
    """
    by_group: dict[str, list[CacheSpec]] = {}
    for layer in range(cfg.num_layers):
        for spec in layer_cache_specs(cfg, layer):
            by_group.setdefault(spec.group, []).append(spec)
    defs: list[tuple[str, Literal["full", "sliding"], int, int | None]] = [
        (GROUP_FULL_MLA, "full", cfg.block_size, None),
        (GROUP_SWA, "sliding", cfg.swa_block_size, cfg.sliding_window),
        (GROUP_C4_STATE, "sliding", cfg.c4_state_block_size, state_window(4)),
        (GROUP_C128_STATE, "sliding", cfg.c128_state_block_size, state_window(128)),
    ]
    return [GroupSpec(n, k, tpb, w, tuple(by_group[n])) for n, k, tpb, w in defs if n in by_group]


#: DeepSeek-V4-Flash ``compress_ratios`` as published in its config.json: 43 layers (0, 0, then
#: 4 on even and 128 on odd indices: 21 C4A + 20 C128A) plus the MTP layer's entry (0, SWA-only).
V4_FLASH_COMPRESS_RATIOS = (0, 0) + (4, 128) * 20 + (4, 0)


def v4_flash_config(kv_cache_dtype: str = "fp8_ds_mla", include_mtp: bool = False) -> CacheConfig:
    """DeepSeek-V4-Flash cache config: the published layer schedule (:data:`V4_FLASH_COMPRESS_RATIOS`),
    the 43 main layers, or 44 with ``include_mtp`` (the MTP layer's SWA-only attention)."""
    ratios = V4_FLASH_COMPRESS_RATIOS if include_mtp else V4_FLASH_COMPRESS_RATIOS[:43]
    return CacheConfig(compress_ratios=ratios, kv_cache_dtype=normalize_kv_cache_dtype(kv_cache_dtype))
