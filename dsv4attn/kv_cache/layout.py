"""The paged KV-cache page formats, all in one place: the byte layout is the spec.

Three page formats (docs/cache-format.md has the pictures):

- ``fp8_ds_mla`` (:class:`FP8DSMLALayout`): SWA and compressed KV entries;
- the indexer-key page (:class:`IndexerKLayout`): C4A lightning-indexer keys, fp8 + fp32 scale;
- the compressor-state page (:func:`state_row_width`, :func:`state_page_bytes`): fp32 rows.

Every page size is :func:`page_bytes` of ``(block_size, entry_bytes, align)``: written once.
A cache is accepted when its block stride holds the entries' information bytes
(``block_size * entry_bytes``): padded pages (the engine's allocation) and contiguous caches
(the engine's tests) alike; kernels address every byte from the block base.

``fp8_ds_mla`` (FlashMLA "MODEL1"), per block of ``block_size`` entries, offsets in bytes from the
block base, for the production instance ``nope_dim=448, rope_dim=64`` (entry = 584 B):

    [0, bs*576)                 token data; entry i at i*576:
                                  448 x float8 e4m3fn (NoPE dims 0..447, divided by its tile scale)
                                  64 x bf16           (RoPE dims 448..511, unquantised)
    [bs*576, bs*576 + bs*8)     scales; entry i at bs*576 + i*8:
                                  7 x UE8M0 byte (tile t covers NoPE dims 64t..64t+63), 1 zero byte
    [bs*584, page_bytes)        zero padding; page_bytes = round_up(bs*584, 576)

The cache tensor is a ``(num_blocks, block_size, 584)`` uint8 view with ``stride(0) = page_bytes``;
the last two dims are cosmetic (kernels address from the block base with the offsets above).

Quantisation of one tile (x first rounded to bf16): ``amax = max(max|x|, 1e-4)``,
``e = ceil(log2(amax / 448))``, byte ``e + 127`` (clamped to [0, 255]), values
``clamp(x / 2^e, -448, 448)`` rounded to e4m3fn. Dequantisation: ``fp8 * 2^(byte - 127)``.

``auto``: ``(num_blocks, block_size, head_dim)`` pages in the model dtype (bf16), contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4attn._checks import check_int

#: Largest finite float8 e4m3fn magnitude.
FP8_E4M3_MAX = 448.0
#: Lower clamp on a tile's amax before the exponent is taken (FlashMLA / vLLM quantiser).
AMAX_FLOOR = 1e-4
#: UE8M0 exponent bias.
UE8M0_BIAS = 127


#: Cache dtype strings: "auto" stores model-dtype (bf16) rows; "fp8_ds_mla" the 584-byte format.
KV_CACHE_DTYPES = ("auto", "fp8_ds_mla")
#: Aliases an engine may pass, rewritten to the canonical name (vLLM rewrites fp8* to fp8_ds_mla).
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_ds_mla", "fp8_e4m3": "fp8_ds_mla", "bfloat16": "auto", "bf16": "auto"}


def normalize_kv_cache_dtype(kv_cache_dtype: object, name: str = "kv_cache_dtype") -> str:
    """Canonical cache dtype name, ``"auto"`` or ``"fp8_ds_mla"`` (aliases ``fp8``, ``fp8_e4m3``,
    ``bf16``, ``bfloat16``); ``TypeError``/``ValueError`` naming ``name`` otherwise."""
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"{name} must be a str, got {type(kv_cache_dtype).__name__}")
    canon = KV_CACHE_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if canon not in KV_CACHE_DTYPES:
        raise ValueError(f"{name} {kv_cache_dtype!r} is not supported; use one of {KV_CACHE_DTYPES} "
                         f"(aliases {sorted(KV_CACHE_DTYPE_ALIASES)})")
    return canon


#: Bytes of one fp32 indexer-key scale.
INDEXER_SCALE_BYTES = 4
#: Default page alignment of fp8 pages: one production token-data row (576 B).
DEFAULT_PAGE_ALIGN = 576
#: Bytes of a bf16 / fp32 element.
BF16_BYTES, FP32_BYTES = 2, 4


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def page_bytes(block_size: int, entry_bytes: int, align: int = 1) -> int:
    """Bytes of one page (= block stride) holding ``block_size`` entries of ``entry_bytes``,
    padded to a multiple of ``align``: the one formula behind every page size."""
    return round_up(block_size * entry_bytes, align)


def _span(cache: torch.Tensor, info_bytes: int, page: int) -> int:
    """Bytes per block to view behind a cache: the block stride, or for a one-block cache the
    padded page when the storage holds it and the information bytes otherwise."""
    if cache.shape[0] > 1:
        return cache.stride(0)
    avail = cache.untyped_storage().nbytes() - cache.storage_offset() * cache.element_size()
    return page if avail >= page else info_bytes


@dataclass(frozen=True)
class FP8DSMLALayout:
    """Byte layout of one ``fp8_ds_mla`` page; ``FP8DSMLALayout()`` is the production (448, 64).

    Small test models use other ``(nope_dim, rope_dim)``; ``nope_dim`` must be a multiple of
    ``tile`` (64). Sizes in bytes.
    """

    nope_dim: int = 448
    rope_dim: int = 64
    tile: int = 64

    def __post_init__(self) -> None:
        for name in ("nope_dim", "rope_dim", "tile"):
            check_int(name, getattr(self, name), 0)
        if self.tile <= 0 or self.nope_dim <= 0 or self.nope_dim % self.tile:
            raise ValueError(f"nope_dim must be a positive multiple of {self.tile}, got {self.nope_dim}")
        if self.rope_dim < 0 or self.rope_dim % 2:
            raise ValueError(f"rope_dim must be even and >= 0, got {self.rope_dim}")

    @property
    def head_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    @property
    def num_tiles(self) -> int:
        return self.nope_dim // self.tile

    @property
    def data_bytes(self) -> int:
        """fp8 NoPE bytes + bf16 RoPE bytes of one entry (576 in production)."""
        return self.nope_dim + 2 * self.rope_dim

    @property
    def scale_bytes(self) -> int:
        """Scale bytes of one entry, padded to 8 (7 + 1 pad in production)."""
        return round_up(self.num_tiles, 8)

    @property
    def entry_bytes(self) -> int:
        """Information bytes per entry (584 in production)."""
        return self.data_bytes + self.scale_bytes

    @property
    def page_align(self) -> int:
        """Page alignment: one token-data row (576 B, "FlashMLA requires 576B alignment")."""
        return self.data_bytes

    def page_bytes(self, block_size: int) -> int:
        """Padded page size = block stride in bytes."""
        return page_bytes(block_size, self.entry_bytes, self.page_align)

    def scale_offset(self, block_size: int) -> int:
        """Byte offset of the scale area inside a page."""
        return block_size * self.data_bytes


PRODUCTION_LAYOUT = FP8DSMLALayout()


def layout_for_head_dim(head_dim: int, rope_dim: int) -> FP8DSMLALayout:
    return FP8DSMLALayout(nope_dim=head_dim - rope_dim, rope_dim=rope_dim)


def page_bytes_auto(block_size: int, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Page size of an ``auto`` (plain rows) cache."""
    return block_size * head_dim * torch.empty((), dtype=dtype).element_size()


def alloc_fp8_ds_mla_cache(
    num_blocks: int,
    block_size: int,
    layout: FP8DSMLALayout = PRODUCTION_LAYOUT,
    device: torch.device | str = "cpu",
    fill: int | None = 0,
) -> torch.Tensor:
    """Allocate a cache; returns the ``(num_blocks, block_size, entry_bytes)`` uint8 strided view.

    ``fill`` is the byte every page starts with (``None`` leaves memory uninitialised).
    """
    check_int("num_blocks", num_blocks, 1)
    check_int("block_size", block_size, 1)
    page = layout.page_bytes(block_size)
    flat = torch.empty(num_blocks * page, dtype=torch.uint8, device=device)
    if fill is not None:
        flat.fill_(fill)
    return fp8_ds_mla_view(flat, num_blocks, block_size, layout)


def fp8_ds_mla_view(
    flat: torch.Tensor, num_blocks: int, block_size: int, layout: FP8DSMLALayout = PRODUCTION_LAYOUT
) -> torch.Tensor:
    """The ``(num_blocks, block_size, entry_bytes)`` view of a flat uint8 buffer of pages."""
    page = layout.page_bytes(block_size)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < num_blocks * page:
        raise ValueError(
            f"flat must be a 1-D uint8 buffer of >= {num_blocks * page} bytes, got "
            f"{flat.dtype} {tuple(flat.shape)}"
        )
    return flat.as_strided((num_blocks, block_size, layout.entry_bytes), (page, layout.entry_bytes, 1))


def pages_of(cache: torch.Tensor, layout: FP8DSMLALayout = PRODUCTION_LAYOUT) -> torch.Tensor:
    """``(num_blocks, span)`` uint8 view of the pages behind a cache view (span = the block
    stride; at least ``block_size * entry_bytes``, which is all a page's information)."""
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    check_fp8_ds_mla_cache("cache", cache, layout)
    span = _span(cache, block_size * layout.entry_bytes, layout.page_bytes(block_size))
    return cache.as_strided((num_blocks, span), (max(cache.stride(0), span), 1))


def check_fp8_ds_mla_cache(name: str, cache: object, layout: FP8DSMLALayout = PRODUCTION_LAYOUT) -> None:
    """Raise unless ``cache`` is a valid fp8_ds_mla view for ``layout``."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8 (fp8_ds_mla pages), got {cache.dtype}")
    if cache.dim() != 3 or cache.shape[2] != layout.entry_bytes:
        raise ValueError(
            f"{name} must have shape (num_blocks, block_size, {layout.entry_bytes}), got {tuple(cache.shape)}"
        )
    _check_paged_bytes(name, cache, layout.entry_bytes)


def _check_paged_bytes(name: str, cache: torch.Tensor, entry_bytes: int) -> None:
    """Strides of a uint8 paged view: bytes contiguous, entries ``entry_bytes`` apart, blocks at
    least ``block_size * entry_bytes`` apart (padded or contiguous), at least one entry."""
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"{name} must hold at least one block of one entry, got shape {tuple(cache.shape)}")
    info = block_size * entry_bytes
    if num_blocks > 1 and cache.stride(0) < info:
        raise ValueError(f"{name} block stride {cache.stride(0)} is smaller than the {info} bytes of a block's "
                         f"entries (block_size {block_size} x {entry_bytes})")
    if cache.stride(2) != 1 or (block_size > 1 and cache.stride(1) != entry_bytes):
        raise ValueError(f"{name} must have entries of {entry_bytes} contiguous bytes (strides (*, {entry_bytes}, 1)),"
                         f" got strides {cache.stride()}")
    avail = cache.untyped_storage().nbytes() - cache.storage_offset()
    if (num_blocks - 1) * cache.stride(0) + info > avail:
        raise ValueError(f"{name} views {num_blocks} blocks of stride {cache.stride(0)} but its storage holds only "
                         f"{avail} bytes")


def quantize_tokens(
    x: torch.Tensor, layout: FP8DSMLALayout = PRODUCTION_LAYOUT
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise rows ``x[..., head_dim]`` -> (nope fp8 bytes ``[..., nope_dim]`` uint8,
    rope ``[..., rope_dim]`` bf16, scale bytes ``[..., num_tiles]`` uint8)."""
    xb = x.to(torch.bfloat16).float()
    nope, rope = xb[..., : layout.nope_dim], xb[..., layout.nope_dim :]
    tiles = nope.reshape(*nope.shape[:-1], layout.num_tiles, layout.tile)
    amax = tiles.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    e = torch.ceil(torch.log2(amax / FP8_E4M3_MAX))
    q = (tiles / torch.exp2(e).unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q8 = q.to(torch.float8_e4m3fn).view(torch.uint8).reshape(nope.shape)
    scale = (e + UE8M0_BIAS).clamp(0, 255).to(torch.uint8)
    return q8, rope.to(torch.bfloat16), scale


def dequantize_tokens(
    nope_bytes: torch.Tensor, rope: torch.Tensor, scale_bytes: torch.Tensor, layout: FP8DSMLALayout = PRODUCTION_LAYOUT
) -> torch.Tensor:
    """Inverse of :func:`quantize_tokens`; returns float32 ``[..., head_dim]``."""
    vals = nope_bytes.view(torch.float8_e4m3fn).float()
    vals = vals.reshape(*vals.shape[:-1], layout.num_tiles, layout.tile)
    vals = vals * torch.exp2(scale_bytes.float() - UE8M0_BIAS).unsqueeze(-1)
    return torch.cat([vals.reshape(*vals.shape[:-2], layout.nope_dim), rope.float()], dim=-1)


def encode_pages(
    x: torch.Tensor, layout: FP8DSMLALayout = PRODUCTION_LAYOUT
) -> torch.Tensor:
    """``x (num_blocks, block_size, head_dim)`` -> ``(num_blocks, page_bytes)`` uint8 pages."""
    num_blocks, block_size, _ = x.shape
    q8, rope, scale = quantize_tokens(x, layout)
    page = layout.page_bytes(block_size)
    pages = torch.zeros(num_blocks, page, dtype=torch.uint8, device=x.device)
    data = torch.cat([q8, rope.contiguous().view(torch.uint8)], dim=-1)  # [nb, bs, data_bytes]
    pages[:, : block_size * layout.data_bytes] = data.reshape(num_blocks, -1)
    sc = torch.zeros(num_blocks, block_size, layout.scale_bytes, dtype=torch.uint8, device=x.device)
    sc[..., : layout.num_tiles] = scale
    off = layout.scale_offset(block_size)
    pages[:, off : off + block_size * layout.scale_bytes] = sc.reshape(num_blocks, -1)
    return pages


def decode_pages(pages: torch.Tensor, block_size: int, layout: FP8DSMLALayout = PRODUCTION_LAYOUT) -> torch.Tensor:
    """``(num_blocks, >= page_bytes)`` uint8 pages -> float32 ``(num_blocks, block_size, head_dim)``."""
    num_blocks = pages.shape[0]
    data = pages[:, : block_size * layout.data_bytes].reshape(num_blocks, block_size, layout.data_bytes)
    nope = data[..., : layout.nope_dim].contiguous()
    rope = data[..., layout.nope_dim :].contiguous().view(torch.bfloat16)
    off = layout.scale_offset(block_size)
    sc = pages[:, off : off + block_size * layout.scale_bytes].reshape(num_blocks, block_size, layout.scale_bytes)
    return dequantize_tokens(nope, rope, sc[..., : layout.num_tiles].contiguous(), layout)


def quantize_fp8_ds_mla(x: torch.Tensor, layout: FP8DSMLALayout | None = None) -> torch.Tensor:
    """Encode ``x (num_blocks, block_size, head_dim)`` (bf16 or fp32) into a new fp8_ds_mla cache.

    Returns the ``(num_blocks, block_size, entry_bytes)`` uint8 view (block stride = padded page).
    The layout defaults to ``nope_dim = head_dim - 64, rope_dim = 64``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise TypeError(f"x must be bf16/fp16/fp32, got {x.dtype}")
    if x.dim() != 3 or 0 in x.shape:
        raise ValueError(f"x must have shape (num_blocks, block_size, head_dim), all > 0, got {tuple(x.shape)}")
    if layout is None:
        try:
            layout = layout_for_head_dim(x.shape[2], 64)
        except ValueError as e:
            raise ValueError(f"x head_dim {x.shape[2]} has no fp8_ds_mla layout with rope 64: {e}") from None
    if x.shape[2] != layout.head_dim:
        raise ValueError(f"x last dim must be head_dim={layout.head_dim}, got {x.shape[2]}")
    num_blocks, block_size, _ = x.shape
    pages = encode_pages(x, layout)
    return fp8_ds_mla_view(pages.reshape(-1), num_blocks, block_size, layout)


def dequantize_fp8_ds_mla(cache: torch.Tensor, layout: FP8DSMLALayout | None = None) -> torch.Tensor:
    """Decode a fp8_ds_mla cache view ``(num_blocks, block_size, entry_bytes)`` -> bf16
    ``(num_blocks, block_size, head_dim)``. The layout defaults to the production one when the
    last dim is 584."""
    if layout is None:
        layout = PRODUCTION_LAYOUT
    check_fp8_ds_mla_cache("cache", cache, layout)
    return decode_pages(pages_of(cache, layout), cache.shape[1], layout).to(torch.bfloat16)


# ---- the indexer-key page --------------------------------------------------------------------
@dataclass(frozen=True)
class IndexerKLayout:
    """Byte layout of one fp8 indexer-key page (same as V3.2), block of ``bs`` entries of ``dim``:
    ``[0, bs*dim)`` e4m3fn values (entry ``i`` at ``i*dim``), ``[bs*dim, bs*dim + bs*4)`` one fp32
    scale per entry (entry ``i`` at ``bs*dim + i*4``, the power-of-two value itself, little
    endian), zero padding to ``page_bytes`` (a multiple of ``align``: 8640 for (64, 128, 576)).
    ``auto`` caches hold bf16 rows ``(num_blocks, bs, dim)`` instead."""

    dim: int = 128
    align: int = DEFAULT_PAGE_ALIGN

    def __post_init__(self) -> None:
        if self.dim <= 0 or self.align <= 0:
            raise ValueError(f"IndexerKLayout needs dim > 0 and align > 0, got {self.dim}, {self.align}")

    @property
    def entry_bytes(self) -> int:
        """Information bytes per entry: ``dim`` fp8 bytes + one fp32 scale (132 in production)."""
        return self.dim + INDEXER_SCALE_BYTES

    def page_bytes(self, block_size: int) -> int:
        return page_bytes(block_size, self.entry_bytes, self.align)

    def scale_offset(self, block_size: int) -> int:
        return block_size * self.dim


def indexer_page_bytes(block_size: int, index_head_dim: int = 128, align: int = DEFAULT_PAGE_ALIGN) -> int:
    """Padded page size (= block stride) of an fp8 indexer-key cache: 8640 for (64, 128)."""
    return IndexerKLayout(index_head_dim, align).page_bytes(block_size)


def alloc_indexer_k_cache(num_blocks: int, block_size: int, index_head_dim: int = 128,
                          device: torch.device | str = "cpu", fill: int | None = 0,
                          align: int = DEFAULT_PAGE_ALIGN) -> torch.Tensor:
    """``(num_blocks, block_size, index_head_dim + 4)`` uint8 view with padded block stride."""
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size), ("index_head_dim", index_head_dim)):
        check_int(name, v, 1)
    lay = IndexerKLayout(index_head_dim, align)
    page = lay.page_bytes(block_size)
    flat = torch.empty(num_blocks * page, dtype=torch.uint8, device=device)
    if fill is not None:
        flat.fill_(fill)
    return flat.as_strided((num_blocks, block_size, lay.entry_bytes), (page, lay.entry_bytes, 1))


def check_indexer_k_cache(name: str, cache: object, dim: int) -> torch.Tensor:
    """Raise unless ``cache`` is a valid fp8 indexer-key view for keys of ``dim``; return it."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8 (fp8 indexer-key pages), got {cache.dtype}")
    eb = dim + INDEXER_SCALE_BYTES
    if cache.dim() != 3 or cache.shape[2] != eb:
        raise ValueError(f"{name} must have shape (num_blocks, block_size, {eb}), got {tuple(cache.shape)}")
    _check_paged_bytes(name, cache, eb)
    return cache


def indexer_pages_of(cache: torch.Tensor) -> torch.Tensor:
    """``(num_blocks, span)`` uint8 view of the pages behind an indexer-key cache view."""
    bs, eb = cache.shape[1], cache.shape[2]
    span = _span(cache, bs * eb, page_bytes(bs, eb, DEFAULT_PAGE_ALIGN))
    return cache.as_strided((cache.shape[0], span), (max(cache.stride(0), span), 1))


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
    check_indexer_k_cache("cache", cache, d)
    pages = indexer_pages_of(cache)
    vals = pages[:, : bs * d].reshape(nb, bs, d).contiguous().view(torch.float8_e4m3fn).float()
    scale = pages[:, bs * d : bs * d + bs * INDEXER_SCALE_BYTES].contiguous().view(torch.float32)
    return vals * scale.reshape(nb, bs, 1)


# ---- the compressor-state page -----------------------------------------------------------------
def compressor_overlap(ratio: int) -> bool:
    """Ratio-4 compressors pool overlapping windows of 2r positions; ratio 128 does not."""
    return ratio == 4


def compressor_coff(ratio: int) -> int:
    """Width multiplier of compressor state rows: 2 with overlap (r=4), 1 without (r=128)."""
    return 2 if compressor_overlap(ratio) else 1


def state_window(ratio: int) -> int:
    """Raw positions a compressor state cache must keep: 2r with overlap, r without."""
    return compressor_coff(ratio) * ratio


def state_row_width(ratio: int, dim: int) -> int:
    """fp32 elements of one compressor state row: ``[kv (coff*D) | score + ape (coff*D)]``."""
    return 2 * compressor_coff(ratio) * dim


def state_page_bytes(block_size: int, ratio: int, dim: int, align: int = DEFAULT_PAGE_ALIGN) -> int:
    """Padded page of a compressor-state cache: ``block_size`` fp32 rows of ``state_row_width``."""
    return page_bytes(block_size, state_row_width(ratio, dim) * FP32_BYTES, align)
