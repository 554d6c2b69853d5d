"""One step of one DeepSeek-V4 attention layer over paged caches, for a whole batch at once.

Called by :class:`dsv4attn.serving.engine.PagedAttentionEngine` for every layer of a step (the
step's metadata is built once by the engine and shared by all layers). No host sync and no
shape that depends on a context length: CUDA graphs capture it as is (``serving.graphs``).

The batch is flat: ``T`` tokens of ``R`` requests (decodes first), described by the step's
``BatchMetadata`` / ``StepMetadata`` (``dsv4attn.metadata``). Order within the step (all cache
writes happen before attention reads, as in the serving engine):

1. q / kv projections; kv inserted into the SWA cache at the step's SWA slot mapping;
2. compressors (main, and the indexer's for CSA): every token saves its state row into the state
   cache; every token completing a block (``(p+1) % r == 0``, i.e. compressed slot >= 0) pools
   its window's rows (read back through the state block table, so windows opened in earlier
   steps close correctly), normalises, rotates at ``k*r`` and writes the compressed entry;
3. CSA: indexer queries score the request's indexer keys (read from the cache), deterministic
   top-k, local -> global slots (``StepMetadataBuilder.global_topk``);
4. sparse attention with the sink over the SWA range and the compressed set;
5. inverse RoPE + grouped output projection.

Each op runs once for the whole batch. Cache writers, compressor pooling, the indexer top-k and
the attention op come from ``dsv4attn.ops``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from collections.abc import Callable, Hashable, Mapping, Sequence

from dsv4attn.kv_cache.layout import (
    FP8DSMLALayout,
    alloc_fp8_ds_mla_cache,
    alloc_indexer_k_cache,
    layout_for_head_dim,
)
from dsv4attn.kv_cache.specs import CacheSpec
from dsv4attn.kv_cache.slots import entry_slots
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.layers.compressor import Compressor
from dsv4attn.metadata import StepMetadata, StepMetadataBuilder
from dsv4attn.ops.cache_ops import insert_indexer_k, insert_kv, write_compressor_state
from dsv4attn.ops.candidate_set import CandidateSet
from dsv4attn.ops.sparse_attn import sparse_mla_attention


@dataclass
class LayerCaches:
    """The paged caches of one layer (views handed to the ops).

    swa / compressed: ``auto`` rows ``(num_blocks, bs, head_dim)`` in the model dtype, or
    fp8_ds_mla uint8 views; indexer_k: rows ``(num_blocks, 64, D_I)`` or the fp8 indexer layout;
    states: fp32 ``(num_blocks, state_bs, 2*coff*D)``. Block sizes count stored entries.
    """

    kv_cache_dtype: str
    layout: FP8DSMLALayout | None  # None for kv_cache_dtype 'auto'
    swa: torch.Tensor
    compressed: torch.Tensor | None = None
    indexer_k: torch.Tensor | None = None
    state: torch.Tensor | None = None
    indexer_state: torch.Tensor | None = None


#: LayerCaches field -> the name of its cache spec (``kv_cache.specs.layer_cache_specs``), whose
#: ``group`` says which allocation group's block ids index it: the one field <-> spec table
#: (allocation below, prefix export / import in the engine).
CACHE_FIELD_SPECS = {"swa": "swa_kv", "compressed": "compressed_kv", "indexer_k": "indexer_k",
                     "state": "compressor_state", "indexer_state": "indexer_compressor_state"}


def alloc_layer_caches(layer: DeepseekV4Attention, specs: Mapping[str, CacheSpec], kv_cache_dtype: str,
                       blocks: Callable[[str], int], device: torch.device, dtype: torch.dtype) -> LayerCaches:
    """A layer's caches, one per spec of ``layer_cache_specs`` (by name), each with
    ``blocks(spec.group)`` blocks: fp8_ds_mla or ``dtype`` kv pages, fp8 or ``dtype`` indexer
    keys, fp32 compressor states. The one allocation of the engine and of the DCP runner (which
    gives every group the same count)."""
    cfg = layer.config
    fp8 = kv_cache_dtype == "fp8_ds_mla"
    layout = layout_for_head_dim(cfg.head_dim, cfg.rope_dim) if fp8 else None

    def kv_cache(name: str) -> torch.Tensor:
        s = specs[name]
        if layout is not None:
            return alloc_fp8_ds_mla_cache(blocks(s.group), s.block_size, layout, device=device)
        return torch.zeros(blocks(s.group), s.block_size, cfg.head_dim, dtype=dtype, device=device)

    def state(name: str) -> torch.Tensor:
        s = specs[name]
        return torch.zeros(blocks(s.group), s.block_size, *s.row_shape, dtype=torch.float32, device=device)

    caches = LayerCaches(kv_cache_dtype, layout, swa=kv_cache(CACHE_FIELD_SPECS["swa"]))
    if layer.ratio > 1:
        caches.compressed = kv_cache(CACHE_FIELD_SPECS["compressed"])
        caches.state = state(CACHE_FIELD_SPECS["state"])
    if layer.ratio == 4:
        s = specs[CACHE_FIELD_SPECS["indexer_k"]]
        n = blocks(s.group)
        caches.indexer_k = (alloc_indexer_k_cache(n, s.block_size, cfg.index_head_dim, device=device) if fp8 else
                            torch.zeros(n, s.block_size, cfg.index_head_dim, dtype=dtype, device=device))
        caches.indexer_state = state(CACHE_FIELD_SPECS["indexer_state"])
    return caches


def state_window_base(start: int, ratio: int, tokens_per_block: int) -> int:
    """First raw position of a request's *windowed* state table for a step whose first new
    token is at ``start``: at or below every state row the step's tokens write or pool (a
    window reaches at most ``2r`` rows back: ``(start // r) * r - r``), floored to a multiple of
    ``lcm(r, tokens_per_block)`` so shifted positions keep ``p % r`` and whole columns, and >= 0.
    The step hands the writers and the pooling ``positions - base`` with the table's columns
    from ``base / tokens_per_block`` on, so the table's width follows the window, not the
    context."""
    m = math.lcm(ratio, tokens_per_block)
    return max(0, (start // ratio) * ratio - ratio) // m * m


def state_window(starts: Sequence[int], query_lens: Sequence[int], ratio: int, tokens_per_block: int
                 ) -> tuple[list[int], torch.Tensor]:
    """Per request ``i`` (first new token at ``starts[i]``, ``query_lens[i]`` new tokens): the first
    column of its windowed state table, ``state_window_base // tokens_per_block``, and per token
    (requests' tokens in order) the shift int64 ``[sum(query_lens)]`` to subtract from the raw
    positions for the state ops."""
    bases = [state_window_base(s, ratio, tokens_per_block) for s in starts]
    shift = torch.tensor(bases, dtype=torch.int64).repeat_interleave(torch.tensor(list(query_lens), dtype=torch.int64))
    return [b // tokens_per_block for b in bases], shift


def state_slots(positions: torch.Tensor, req: torch.Tensor, block_table: torch.Tensor, block_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of raw positions in a state cache: positions/req ``[...]`` -> (slot int64, valid bool).

    Invalid (negative position, column beyond the table or a freed/-1 block): slot 0, valid False.
    """
    slot = entry_slots(block_table, req, positions, block_size)  # the one slot formula (-1 = hole)
    ok = slot >= 0
    return torch.where(ok, slot, torch.zeros_like(slot)), ok


def completing_positions(positions: torch.Tensor, entry_slots: torch.Tensor) -> torch.Tensor:
    """int64 positions of the tokens that complete an entry this step (compressed slot >= 0),
    -1 for the others: what the pooling reads (shared by both compressors of a CSA layer)."""
    pos = positions.long()
    slots = entry_slots[: pos.shape[0]]
    return torch.where(slots >= 0, pos, torch.full_like(pos, -1))


def run_compressor(
    comp: Compressor, hidden: torch.Tensor, positions: torch.Tensor, token_to_req: torch.Tensor,
    state_cache: torch.Tensor, state_table: torch.Tensor, entry_slots: torch.Tensor,
    pool_positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], impl: str,
    proj: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Save every token's state row, then build the entries completed in this step.

    Returns (entries ``[T, D]`` in hidden's dtype, their compressed slots int64 ``[T]``): one row
    per token; rows of tokens that complete no block have slot -1 (the caller's insert skips
    them), so no host sync picks the boundary tokens. ``positions``: what the state writer sees
    (raw, or shifted for a windowed state table); ``pool_positions``: the same with -1 where
    ``entry_slots < 0`` (:func:`completing_positions`); ``rope``: cos/sin at each entry's first
    raw position (``rotary(raw positions, ratio=r)``). Both are per layer, shared by the two
    compressors of a CSA layer. ``proj``: ``(kv_proj(hidden), gate_proj(hidden))`` when the
    caller has them (``DeepseekV4Attention.project_inputs``). The state rows go to entry ``p``
    of the token's request in ``state_table`` (slots computed in the writer; holes and freed
    blocks skip).
    """
    t2r = token_to_req.to(torch.int32)
    kv, gate = proj if proj is not None else (comp.kv_proj(hidden), comp.gate_proj(hidden))
    write_compressor_state(kv, gate, comp.position_bias, positions, None,
                           state_cache, block_table=state_table, token_to_req=t2r, validate_slots=False, impl=impl)
    pooled = comp.pool_paged(state_cache, state_table, t2r, pool_positions, impl=impl)
    cos, sin = rope
    return comp.finish(pooled, cos, sin, hidden.dtype, impl=impl), entry_slots[: positions.shape[0]]


class StepTables:
    """Per-step tensors that every layer with the same inputs would otherwise compute again: the
    rotary cos / sin at the step's positions (per rotary table and ratio) and the pooling
    positions (per compress ratio). A V4 model has dozens of layers per table, so a step computes
    each once (2-3 launches per compressing layer's step saved).

    ``get(key, make)`` computes ``make()`` (a tuple of tensors) on first use and returns it after.
    The eager engine keeps one per step. CUDA graphs keep one per bucket: the captured layer steps
    read its tensors, so each step's ``prepare`` calls :meth:`refresh`, which runs every ``make``
    again (they read the bucket's static inputs) and copies the results into the same tensors,
    outside the layers' graphs."""

    def __init__(self) -> None:
        self._memo: dict[Hashable, tuple[Callable[[], tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]] = {}

    def get(self, key: Hashable, make: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = (make, make())
        return hit[1]

    def refresh(self) -> None:
        for make, outs in self._memo.values():
            for out, new in zip(outs, make()):
                out.copy_(new)


def _rotary(layer: DeepseekV4Attention, pos: torch.Tensor, ratio: int, impl: str,
            tables: StepTables) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer.rotary(pos, ratio)``, shared through ``tables`` by the layers of one rotary table."""
    rot = layer.rotary
    cos, sin = tables.get(("rotary", rot.rope, rot.rope_dim, ratio), lambda: rot(pos, ratio=ratio, impl=impl))
    return cos, sin


def indexer_topk(
    layer: DeepseekV4Attention, qr: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    eligible: torch.Tensor, token_to_req: torch.Tensor, caches: LayerCaches, mla_table: torch.Tensor,
    w: torch.Tensor, impl: str = "auto",
) -> torch.Tensor:
    """Request-local top-k int32 ``[T, topk]`` (-1 padded) of every token over the entries
    ``0 .. eligible - 1`` of its request's indexer-K cache (``eligible = (p + 1) // r``: the
    step's C4A ``lengths``); ``w``: ``weights_proj(hidden)``."""
    idx = layer.indexer
    # callers pass CSA layers only, whose caches the engine allocates with an indexer-K cache
    assert idx is not None and caches.indexer_k is not None
    q, w = idx.queries(qr, hidden, cos, sin, impl=impl, w=w)
    return idx.topk_paged(q, w, caches.indexer_k, mla_table, token_to_req, eligible, impl=impl)


def layer_step(
    layer: DeepseekV4Attention, hidden: torch.Tensor, step: StepMetadata, builder: StepMetadataBuilder,
    caches: LayerCaches, state_table: torch.Tensor | None, impl: str = "auto", deterministic: bool = False,
    state_positions: torch.Tensor | None = None, tables: StepTables | None = None,
) -> torch.Tensor:
    """hidden ``[T, hidden_size]`` of the step's tokens (batch order) -> output ``[T, hidden_size]``.

    ``state_table`` with ``state_positions`` (int64 ``[T]``): a windowed state table (row r from
    column ``base_r / tokens_per_block`` on) and the tokens' positions minus their request's
    ``base_r`` (:func:`state_window_base`); without ``state_positions`` the table is the
    request's whole table and the positions are the raw ones. ``tables``: the step's
    :class:`StepTables`, shared by its layers (None: this layer computes its own)."""
    batch = step.batch
    pos, t2r = batch.positions, step.token_to_req
    if tables is None:
        tables = StepTables()
    elif not isinstance(tables, StepTables):  # before any cache is written
        raise TypeError(f"tables must be a StepTables or None, got {type(tables).__name__}")
    cos, sin = _rotary(layer, pos, 1, impl, tables)
    proj = layer.project_inputs(hidden)  # one GEMM once the engine fused the input projections
    q, qr = layer.project_q(hidden, cos, sin, impl=impl, qa=proj[0])
    kv = layer.project_kv(hidden, cos, sin, impl=impl, kv=proj[1])
    kcd = caches.kv_cache_dtype
    # Every slot of a step comes from block tables the metadata builder already checked against
    # num_blocks (state rows: the writer's slot formula yields -1 outside the table): the writers' own
    # per-call range check (a host sync each) would repeat that work on the hot path.
    insert_kv(kv, batch.slot_mapping, caches.swa, kcd, layout=caches.layout, validate_slots=False, impl=impl)
    sw = step.swa
    sets = [CandidateSet(caches.swa, sw.lengths, block_table=sw.block_table, token_to_req=t2r,
                         starts=sw.starts, layout=caches.layout if kcd == "fp8_ds_mla" else None)]
    if layer.compressor is not None:
        # the engine allocates compressed + state caches and a state table for every compressing layer
        assert caches.compressed is not None and caches.state is not None and state_table is not None
        cm = step.compressed[layer.ratio]
        erope = _rotary(layer, pos, layer.ratio, impl, tables)  # at each entry's first raw position
        spos = pos if state_positions is None else state_positions[: pos.shape[0]]
        ppos = tables.get(("pool", layer.ratio), lambda: (completing_positions(spos, cm.slot_mapping),))[0]
        entries, slots = run_compressor(layer.compressor, hidden, spos, t2r, caches.state, state_table,
                                        cm.slot_mapping, ppos, erope, impl, proj=(proj[2], proj[3]))
        insert_kv(entries.contiguous(), slots, caches.compressed, kcd, layout=caches.layout, validate_slots=False,
                  impl=impl)
        lay = caches.layout if kcd == "fp8_ds_mla" else None
        if layer.kind == "csa":
            idx = layer.indexer  # CSA layers own an indexer; the engine allocates its state and K caches
            assert idx is not None and caches.indexer_state is not None and caches.indexer_k is not None
            ientries, islots = run_compressor(idx, hidden, spos, t2r, caches.indexer_state, state_table,
                                              cm.slot_mapping, ppos, erope, impl, proj=(proj[4], proj[5]))
            insert_indexer_k(ientries.contiguous(), islots, caches.indexer_k, kcd, validate_slots=False, impl=impl)
            # the eligible counts are the step's C4A lengths, (p + 1) // 4 per token (0 for padding)
            assert cm.lengths is not None  # the builder fills them for ratio 4
            local = indexer_topk(layer, qr, hidden, cos, sin, cm.lengths, t2r, caches, cm.block_table, proj[6], impl)
            glob, lens = builder.global_topk(step, local.contiguous(), impl=impl)
            sets.append(CandidateSet(caches.compressed, lens, indices=glob, layout=lay))
        else:
            sets.append(CandidateSet(caches.compressed, cm.lengths, block_table=cm.block_table, token_to_req=t2r,
                                     starts=cm.starts, layout=lay))
    scale = layer.config.softmax_scale
    # The Triton kernel multiplies on bf16 tensor cores whatever q's dtype; an fp32 layer asks
    # for fp32 attention, which the reference computes.
    attn_impl = impl if q.dtype == torch.bfloat16 else "reference"
    attn, _ = sparse_mla_attention(q.contiguous(), sets, scale, layer.sinks_fp32(),
                                   deterministic=deterministic, impl=attn_impl)
    return layer.project_out(attn, cos, sin, impl=impl)
