"""Public cache writers: validate -> dispatch (Triton kernel or PyTorch reference) -> launch.

- :func:`insert_kv`: SWA KV rows and compressed KV entries into an ``fp8_ds_mla`` or ``auto``
  (plain rows) cache, by slot mapping.
- :func:`insert_indexer_k`: lightning-indexer keys (fp8 + fp32 scale per entry, or bf16 rows).
- :func:`write_compressor_state`: compressor state rows ``[kv | score + ape[p % r]]`` (fp32).

Slot semantics everywhere: ``slot = block_id * block_size + offset``; ``-1`` (any negative in
the kernels) writes nothing. ``validate_slots=True`` (default) checks ``-1 <= slot <
num_blocks * block_size`` on the host before launching (one device sync); pass ``False`` under
CUDA-graph capture and in a layer step whose slots the metadata builder proved once per step;
out-of-range slots are then skipped by the kernels instead. Types, dtypes, shapes, strides and
devices are checked on every call (host only); strided slot mappings and positions are made
contiguous before a kernel reads them. Nothing is written before every check passed.
Only the bytes of the addressed entries change: page padding is never written. Two tokens of
one call with the same valid slot leave that slot holding one of them (unspecified which).
"""

from __future__ import annotations

import torch
import triton

from dsv4attn._checks import check_tensor, same_device
from dsv4attn.device import resolve_impl
from dsv4attn.kernels.cache_ops import (
    _insert_indexer_k_fp8_kernel,
    _insert_kv_fp8_kernel,
    _insert_rows_kernel,
    _write_compressor_state_kernel,
)
from dsv4attn.kv_cache.layout import (
    FP8DSMLALayout,
    check_fp8_ds_mla_cache,
    check_indexer_k_cache,
    layout_for_head_dim,
    normalize_kv_cache_dtype,
)
from dsv4attn.kv_cache.slots import entry_slots
from dsv4attn.reference.cache_ops import (
    insert_indexer_k_ref,
    insert_kv_ref,
    write_compressor_state_ref,
)

_FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)
_ROW_CACHE_DTYPES = (torch.bfloat16, torch.float32)
_SLOT_DTYPES = (torch.int32, torch.int64)


def _p2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _check_slots(slot_mapping: torch.Tensor, num_tokens: int, capacity: int, validate: bool) -> torch.Tensor:
    """The slot mapping as the kernels read it (contiguous); with ``validate``, every slot in
    ``[-1, capacity)`` (one host sync)."""
    check_tensor("slot_mapping", slot_mapping, dtype=_SLOT_DTYPES, shape=(num_tokens,))
    slot_mapping = slot_mapping.contiguous()
    if validate and num_tokens:
        lo, hi = (int(v) for v in torch.aminmax(slot_mapping))
        if lo < -1:
            raise ValueError(f"slot_mapping has {lo}; slots must be >= 0 or -1 (skip)")
        if hi >= capacity:
            raise ValueError(f"slot_mapping has slot {hi} >= cache capacity {capacity} (num_blocks * block_size)")
    return slot_mapping


def _check_row_cache(name: str, cache: object, dim: int) -> torch.Tensor:
    cache = check_tensor(name, cache, dtype=_ROW_CACHE_DTYPES, ndim=3)
    if cache.shape[0] < 1 or cache.shape[1] < 1:
        raise ValueError(f"{name} must hold at least one block of one entry, got shape {tuple(cache.shape)}")
    if cache.shape[2] != dim or cache.stride(2) != 1:
        raise ValueError(f"{name} must be (num_blocks, block_size, {dim}) with a contiguous last dim, "
                         f"got shape {tuple(cache.shape)} strides {cache.stride()}")
    return cache


def _launch_rows(src: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor) -> None:
    round_bf16 = cache.dtype == torch.bfloat16 and src.dtype != torch.bfloat16
    dim = src.shape[1]
    _insert_rows_kernel[(src.shape[0],)](
        src, slot_mapping, cache,
        src.stride(0), cache.stride(0), cache.stride(1), cache.shape[1], cache.shape[0] * cache.shape[1], dim,
        BLOCK_D=min(_p2(dim), 1024), ROUND_TO_BF16=round_bf16,
    )


def insert_kv(
    kv: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache: torch.Tensor,
    kv_cache_dtype: str = "fp8_ds_mla",
    *,
    layout: FP8DSMLALayout | None = None,
    validate_slots: bool = True,
    impl: str = "auto",
) -> None:
    """Write KV rows into a paged cache, in place.

    kv: ``[num_tokens, head_dim]`` bf16/fp16/fp32. slot_mapping: ``[num_tokens]`` int32/int64,
    -1 = skip. cache: ``fp8_ds_mla`` -> ``(num_blocks, block_size, entry_bytes)`` uint8 view with
    padded block stride (kv rounded to bf16, NoPE quantised per 64-wide tile, RoPE stored bf16,
    7 scale bytes + zero pad byte; byte-identical to :func:`dsv4attn.kv_cache.layout.
    quantize_tokens`); ``auto`` -> ``(num_blocks, block_size, head_dim)`` bf16/fp32 rows
    (RNE conversion). ``layout`` defaults to ``nope = head_dim - 64, rope = 64``. Writes compressed
    entries too: a compressed cache is just a cache with its own block size and slot mapping.
    Non-finite inputs give unspecified bytes in their own slot only.
    """
    kv_cache_dtype = normalize_kv_cache_dtype(kv_cache_dtype)
    check_tensor("kv", kv, dtype=_FLOAT_INPUTS, ndim=2)
    check_tensor("slot_mapping", slot_mapping, dtype=_SLOT_DTYPES, ndim=1)
    check_tensor("cache", cache)
    device = same_device(kv=kv, slot_mapping=slot_mapping, cache=cache)
    num_tokens, head_dim = kv.shape
    if head_dim == 0:
        raise ValueError(f"kv must have at least one column, got shape {tuple(kv.shape)}")
    if kv.stride(1) != 1:
        raise ValueError(f"kv must be contiguous in its last dim, got strides {kv.stride()}")
    if layout is not None and not isinstance(layout, FP8DSMLALayout):
        raise TypeError(f"layout must be an FP8DSMLALayout or None, got {type(layout).__name__}")
    if kv_cache_dtype == "fp8_ds_mla":
        if layout is None:
            layout = layout_for_head_dim(head_dim, 64)
            if isinstance(cache, torch.Tensor) and cache.dim() == 3 and cache.shape[2] != layout.entry_bytes:
                raise ValueError(
                    f"kv head_dim {head_dim} gives {layout.entry_bytes}-byte fp8_ds_mla entries (rope 64) but "
                    f"cache has {cache.shape[2]}; pass layout= for other NoPE/RoPE splits"
                )
        if layout.head_dim != head_dim:
            raise ValueError(f"kv head_dim {head_dim} does not match layout head_dim {layout.head_dim}")
        check_fp8_ds_mla_cache("cache", cache, layout)
    elif kv_cache_dtype == "auto":
        _check_row_cache("cache", cache, head_dim)
    else:
        raise ValueError(f"kv_cache_dtype must be 'fp8_ds_mla' or 'auto', got {kv_cache_dtype!r}")
    slot_mapping = _check_slots(slot_mapping, num_tokens, cache.shape[0] * cache.shape[1], validate_slots)
    path = resolve_impl(impl, device)
    if num_tokens == 0:
        return
    if path == "reference":
        insert_kv_ref(kv, slot_mapping, cache, kv_cache_dtype, layout)
        return
    if kv_cache_dtype == "auto":
        _launch_rows(kv, slot_mapping, cache)
        return
    assert layout is not None  # resolved above for fp8_ds_mla
    _insert_kv_fp8_kernel[(num_tokens,)](
        kv, slot_mapping, cache,
        kv.stride(0), cache.stride(0), cache.shape[1], cache.shape[0] * cache.shape[1],
        NOPE_DIM=layout.nope_dim, ROPE_DIM=layout.rope_dim, TILE=layout.tile,
        NUM_TILES=layout.num_tiles, NUM_TILES_P2=_p2(layout.num_tiles),
        SCALE_BYTES=layout.scale_bytes, SCALE_P2=_p2(layout.scale_bytes),
        ROPE_P2=_p2(layout.rope_dim), INPUT_IS_BF16=kv.dtype == torch.bfloat16,
    )


def insert_indexer_k(
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache: torch.Tensor,
    kv_cache_dtype: str = "fp8_ds_mla",
    *,
    validate_slots: bool = True,
    impl: str = "auto",
) -> None:
    """Write lightning-indexer keys into their paged cache, in place.

    k: ``[num_tokens, D]`` bf16/fp16/fp32 (D = index_head_dim, 128 in production).
    slot_mapping: ``[num_tokens]`` int32/int64, -1 = skip. cache: fp8 mode (``"fp8_ds_mla"``) ->
    ``(num_blocks, block_size, D + 4)`` uint8 view whose block stride is the page size
    (:func:`dsv4attn.kv_cache.layout.alloc_indexer_k_cache`): the entry's D e4m3fn bytes at
    ``off*D`` and its fp32 scale ``2^ceil(log2(max(amax, 1e-4) / 448))`` (amax of the
    bf16-rounded key) at ``block_size*D + off*4``; ``"auto"`` -> ``(num_blocks, block_size, D)``
    bf16/fp32 rows.
    """
    kv_cache_dtype = normalize_kv_cache_dtype(kv_cache_dtype)
    check_tensor("k", k, dtype=_FLOAT_INPUTS, ndim=2)
    check_tensor("slot_mapping", slot_mapping, dtype=_SLOT_DTYPES, ndim=1)
    check_tensor("cache", cache)
    device = same_device(k=k, slot_mapping=slot_mapping, cache=cache)
    num_tokens, dim = k.shape
    if dim == 0:
        raise ValueError(f"k must have at least one column, got shape {tuple(k.shape)}")
    if k.stride(1) != 1:
        raise ValueError(f"k must be contiguous in its last dim, got strides {k.stride()}")
    if kv_cache_dtype == "fp8_ds_mla":
        check_indexer_k_cache("cache", cache, dim)
    elif kv_cache_dtype == "auto":
        _check_row_cache("cache", cache, dim)
    else:
        raise ValueError(f"kv_cache_dtype must be 'fp8_ds_mla' or 'auto', got {kv_cache_dtype!r}")
    slot_mapping = _check_slots(slot_mapping, num_tokens, cache.shape[0] * cache.shape[1], validate_slots)
    path = resolve_impl(impl, device)
    if num_tokens == 0:
        return
    if path == "reference":
        insert_indexer_k_ref(k, slot_mapping, cache, kv_cache_dtype)
    elif kv_cache_dtype == "auto":
        _launch_rows(k, slot_mapping, cache)
    else:
        _insert_indexer_k_fp8_kernel[(num_tokens,)](
            k, slot_mapping, cache,
            k.stride(0), cache.stride(0), cache.shape[1], cache.shape[0] * cache.shape[1],
            DIM=dim, BLOCK_D=_p2(dim), INPUT_IS_BF16=k.dtype == torch.bfloat16,
        )


def write_compressor_state(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor | None,
    state_cache: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    token_to_req: torch.Tensor | None = None,
    validate_slots: bool = True,
    impl: str = "auto",
) -> None:
    """Save compressor state rows, in place: ``state[slot] = [kv[t] | score[t] + ape[p % r]]``.

    kv, score: ``[num_tokens, W]`` (bf16/fp16/fp32, widened to fp32) with ``W = coff * D`` (coff 2
    for ratio 4, 1 for 128; D 512 main / 128 indexer). ape: ``[r, W]`` (any float dtype; its first
    dim is the compress ratio r). positions: ``[num_tokens]`` int32/int64 raw positions (``p % r``
    taken as a non-negative remainder). state_cache: ``(num_blocks, block_size, 2W)`` fp32, rows
    contiguous, any block stride.

    The slots: ``slot_mapping`` ``[num_tokens]`` int32/int64 state-group slots (-1 = skip), or
    ``slot_mapping=None`` with ``block_table`` int32 ``[R, max_blocks]`` and ``token_to_req``
    int32 ``[num_tokens]``: token t goes to entry ``positions[t]`` of its request (the slot
    formula of ``kv_cache.slots``; a negative position, a column past the table, a freed -1 block
    or a request outside ``[0, R)`` skips the token), computed in the kernel.
    """
    check_tensor("kv", kv, dtype=_FLOAT_INPUTS, ndim=2)
    num_tokens, width = kv.shape
    if width == 0:
        raise ValueError(f"kv must have at least one column, got shape {tuple(kv.shape)}")
    check_tensor("score", score, dtype=_FLOAT_INPUTS, shape=(num_tokens, width))
    check_tensor("ape", ape, dtype=_FLOAT_INPUTS, shape=(None, width))
    check_tensor("positions", positions, dtype=_SLOT_DTYPES, shape=(num_tokens,))
    check_tensor("state_cache", state_cache, dtype=torch.float32, ndim=3)
    from_table = slot_mapping is None
    if from_table:
        if block_table is None or token_to_req is None:
            raise ValueError("slot_mapping=None needs block_table and token_to_req")
        check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
        check_tensor("token_to_req", token_to_req, dtype=torch.int32, shape=(num_tokens,))
        if block_table.shape[1] > 0 and block_table.stride(1) != 1:
            raise ValueError(f"block_table rows must be contiguous, got strides {block_table.stride()}")
    else:
        if block_table is not None or token_to_req is not None:
            raise ValueError("give either slot_mapping or block_table + token_to_req, not both")
        check_tensor("slot_mapping", slot_mapping, dtype=_SLOT_DTYPES, ndim=1)
    device = same_device(kv=kv, score=score, ape=ape, positions=positions, slot_mapping=slot_mapping,
                         state_cache=state_cache, block_table=block_table, token_to_req=token_to_req)
    if ape.shape[0] < 1:
        raise ValueError(f"ape must have at least one row (the compress ratio), got {tuple(ape.shape)}")
    if state_cache.shape[2] != 2 * width or state_cache.stride(2) != 1:
        raise ValueError(f"state_cache must be (num_blocks, block_size, {2 * width}) with contiguous rows, "
                         f"got {tuple(state_cache.shape)} strides {state_cache.stride()}")
    for name, t in (("kv", kv), ("score", score), ("ape", ape)):
        if t.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    if state_cache.shape[0] < 1 or state_cache.shape[1] < 1:
        raise ValueError(f"state_cache must hold at least one block of one row, got shape {tuple(state_cache.shape)}")
    positions = positions.contiguous()
    nb, bs = state_cache.shape[0], state_cache.shape[1]
    if from_table:
        assert block_table is not None and token_to_req is not None
        token_to_req = token_to_req.contiguous()
        if validate_slots and num_tokens and block_table.numel():
            lo, hi = (int(v) for v in torch.aminmax(block_table))
            if lo < -1 or hi >= nb:
                raise ValueError(f"block_table ids must be in [-1, {nb}), got [{lo}, {hi}]")
    else:
        assert slot_mapping is not None
        slot_mapping = _check_slots(slot_mapping, num_tokens, nb * bs, validate_slots)
    path = resolve_impl(impl, device)
    if num_tokens == 0:
        return
    if path == "reference":
        if from_table:
            assert block_table is not None and token_to_req is not None
            R = block_table.shape[0]
            ok = (token_to_req >= 0) & (token_to_req < R)
            req = torch.where(ok, token_to_req, torch.zeros_like(token_to_req)).long()
            slot_mapping = entry_slots(block_table, req, positions, bs, valid=ok)
        assert slot_mapping is not None
        write_compressor_state_ref(kv, score, ape, positions, slot_mapping, state_cache)
        return
    bt = block_table if block_table is not None else positions
    _write_compressor_state_kernel[(num_tokens,)](
        kv, score, ape, positions, slot_mapping if slot_mapping is not None else positions, state_cache, bt,
        token_to_req if token_to_req is not None else positions,
        kv.stride(0), score.stride(0), ape.stride(0), state_cache.stride(0), state_cache.stride(1),
        bs, nb * bs, ape.shape[0], width,
        bt.stride(0) if block_table is not None else 0, block_table.shape[0] if block_table is not None else 0,
        block_table.shape[1] if block_table is not None else 0,
        BLOCK_W=min(_p2(width), 1024), SLOTS_FROM_TABLE=from_table,
    )
