"""One step of one DeepSeek-V4 attention layer over paged caches, for a whole batch at once.

Called by :class:`dsv4attn.serving.engine.PagedAttentionEngine` for every layer of a step (the
step's metadata is built once by the engine and shared by all layers).

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

Each op runs once for the whole batch. Cache writers and the attention op come from
``dsv4attn.ops``; the pooling gather and the indexer scoring are plain PyTorch here (no kernel
of their own yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4attn.kv_cache.layout import FP8DSMLALayout
from dsv4attn.kv_cache.specs import INDEXER_SCALE_BYTES
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.layers.compressor import Compressor
from dsv4attn.layers.indexer import select_topk
from dsv4attn.metadata import StepMetadata, StepMetadataBuilder
from dsv4attn.ops.cache_ops import insert_indexer_k, insert_kv, write_compressor_state
from dsv4attn.ops.candidate_set import CandidateSet
from dsv4attn.ops.sparse_attn import sparse_mla_attention

#: Elements of the indexer's per-chunk temporaries ([tokens, entries, max(D_I, H_I)] fp32): the
#: query tokens scored together are chosen so this bound holds (64 MiB of fp32).
_INDEXER_CHUNK_ELEMENTS = 1 << 24


@dataclass
class LayerCaches:
    """The paged caches of one layer (views handed to the ops).

    swa / compressed: ``auto`` rows ``(num_blocks, bs, head_dim)`` in the model dtype, or
    fp8_ds_mla uint8 views; indexer_k: rows ``(num_blocks, 64, D_I)`` or the fp8 indexer layout;
    states: fp32 ``(num_blocks, state_bs, 2*coff*D)``. Block sizes count stored entries.
    """

    kv_cache_dtype: str
    layout: FP8DSMLALayout
    swa: torch.Tensor
    compressed: torch.Tensor | None = None
    indexer_k: torch.Tensor | None = None
    state: torch.Tensor | None = None
    indexer_state: torch.Tensor | None = None


def state_slots(positions: torch.Tensor, req: torch.Tensor, block_table: torch.Tensor, block_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of raw positions in a state cache: positions/req ``[...]`` -> (slot int64, valid bool).

    Invalid (negative position, column beyond the table or a freed/-1 block): slot 0, valid False.
    """
    pos = positions.long()
    col = torch.div(pos.clamp(min=0), block_size, rounding_mode="floor")
    ok = (pos >= 0) & (col < block_table.shape[1])
    blk = block_table[req.long(), col.clamp(max=max(block_table.shape[1] - 1, 0))].long()
    ok = ok & (blk >= 0)
    slot = blk * block_size + torch.remainder(pos.clamp(min=0), block_size)
    return torch.where(ok, slot, torch.zeros_like(slot)), ok


def run_compressor(
    comp: Compressor, hidden: torch.Tensor, positions: torch.Tensor, token_to_req: torch.Tensor,
    state_cache: torch.Tensor, state_table: torch.Tensor, entry_slots: torch.Tensor,
    rotary: torch.nn.Module, impl: str, static: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Save every token's state row, then build the entries completed in this step.

    Returns (entries ``[B, D]`` in hidden's dtype, their compressed slots int64 ``[B]``) for the
    B boundary tokens (``entry_slots >= 0``); the caller writes them to its cache. ``static``:
    B = every token (no host sync, shapes fixed by T: the CUDA-graph path); the rows of tokens
    that close no entry are garbage with slot -1, which the writers skip.
    """
    bs = state_cache.shape[1]
    slots, ok = state_slots(positions, token_to_req, state_table, bs)
    write_compressor_state(comp.kv_proj(hidden).float(), comp.gate_proj(hidden).float(),
                           comp.position_bias.float().contiguous(), positions,
                           torch.where(ok, slots, torch.full_like(slots, -1)), state_cache,
                           validate_slots=False, impl=impl)
    if static:
        bpos, req, out_slots = positions.long(), token_to_req.long(), entry_slots
    else:
        boundary = (entry_slots >= 0).nonzero().squeeze(1)
        if boundary.numel() == 0:
            return hidden.new_zeros((0, comp.dim)), entry_slots[:0]
        bpos, req, out_slots = positions[boundary].long(), token_to_req[boundary].long(), entry_slots[boundary]
    first = torch.div(bpos, comp.ratio, rounding_mode="floor") * comp.ratio
    window = comp.window_positions(first // comp.ratio)  # [B, L]
    wslots, wvalid = state_slots(window, req[:, None].expand_as(window), state_table, bs)
    rows = state_cache.reshape(-1, state_cache.shape[2])[wslots]  # [B, L, width] fp32
    cos, sin = rotary(first)
    entries = comp.finish(comp.pool(rows, wvalid), cos, sin, hidden.dtype)
    return entries, out_slots


def gather_indexer_keys(cache: torch.Tensor, slots: torch.Tensor, fp8: bool) -> torch.Tensor:
    """Indexer keys at global ``slots [...]`` (all valid) -> fp32 ``[..., D_I]``."""
    bs = cache.shape[1]
    blk, off = torch.div(slots, bs, rounding_mode="floor"), torch.remainder(slots, bs)
    if not fp8:
        return cache[blk, off].float()
    d = cache.shape[2] - INDEXER_SCALE_BYTES
    base = cache.as_strided((cache.shape[0] * cache.stride(0),), (1,), cache.storage_offset())
    blk_base = blk * cache.stride(0)
    data = base[(blk_base + off * d)[..., None] + torch.arange(d, device=slots.device)]
    scale = base[(blk_base + bs * d + off * INDEXER_SCALE_BYTES)[..., None]
                 + torch.arange(INDEXER_SCALE_BYTES, device=slots.device)]
    return data.view(torch.float8_e4m3fn).float() * scale.contiguous().view(torch.float32)


def indexer_topk(
    layer: DeepseekV4Attention, qr: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    positions: torch.Tensor, token_to_req: torch.Tensor, caches: LayerCaches, mla_table: torch.Tensor,
    max_entries: int | None = None,
) -> torch.Tensor:
    """Request-local top-k int32 ``[T, min(topk, N)]`` (-1 padded) of every token; N = the most
    eligible entries ``(p+1)//r`` of any token in the step (one host sync), or ``max_entries``
    when given (no sync; the CUDA-graph path passes the capacity ``max_model_len // r``)."""
    idx = layer.indexer
    eligible = torch.div(positions.long() + 1, idx.ratio, rounding_mode="floor")
    T = positions.shape[0]
    n_max = max_entries if max_entries is not None else (int(eligible.max()) if T else 0)
    width = min(idx.topk, n_max)
    out = torch.full((T, width), -1, dtype=torch.int32, device=positions.device)
    if width == 0:
        return out
    q, w = idx.queries(qr, hidden, cos, sin)
    bs = caches.indexer_k.shape[1]
    e = torch.arange(n_max, device=positions.device)
    fp8 = caches.kv_cache_dtype == "fp8_ds_mla"
    per_chunk = max(1, _INDEXER_CHUNK_ELEMENTS // (n_max * max(idx.dim, idx.num_heads)))
    for t0 in range(0, T, per_chunk):
        rows = slice(t0, min(T, t0 + per_chunk))
        req = token_to_req[rows].long()[:, None].expand(-1, n_max)
        valid = e[None, :] < eligible[rows, None]
        slot, ok = state_slots(e[None, :].expand_as(req), req, mla_table, bs)
        ok = ok & valid
        keys = gather_indexer_keys(caches.indexer_k, torch.where(ok, slot, torch.zeros_like(slot)), fp8)
        keys = torch.where(ok[..., None], keys, torch.zeros((), device=keys.device))
        scores = idx.scores(q[rows], w[rows], keys)
        out[rows] = select_topk(scores, eligible[rows], idx.topk)
    return out


def layer_step(
    layer: DeepseekV4Attention, hidden: torch.Tensor, step: StepMetadata, builder: StepMetadataBuilder,
    caches: LayerCaches, state_table: torch.Tensor | None, impl: str = "auto",
    max_model_len: int | None = None,
) -> torch.Tensor:
    """hidden ``[T, hidden_size]`` of the step's tokens (batch order) -> output ``[T, hidden_size]``.

    ``max_model_len`` given: the static form (no host sync, every shape a function of T and
    the capacities only, so a CUDA graph captured at any context replays at any other): the
    compressors pool a window for every token and the indexer scores ``max_model_len // 4``
    entry columns. The two forms agree up to fp32 reduction order.
    """
    batch = step.batch
    pos, t2r = batch.positions, step.token_to_req
    cos, sin = layer.rotary(pos)
    q, qr = layer.project_q(hidden, cos, sin)
    kv = layer.project_kv(hidden, cos, sin)
    kcd = caches.kv_cache_dtype
    # Every slot of a step comes from block tables the metadata builder already checked against
    # num_blocks (or from state_slots, which yields -1 outside the table): the writers' own
    # per-call range check (a host sync each) would repeat that work on the hot path.
    insert_kv(kv, batch.slot_mapping, caches.swa, kcd, layout=caches.layout, validate_slots=False, impl=impl)
    sw = step.swa
    sets = [CandidateSet(caches.swa, sw.lengths, block_table=sw.block_table, token_to_req=t2r,
                         starts=sw.starts, layout=caches.layout if kcd == "fp8_ds_mla" else None)]
    if layer.compressor is not None:
        cm = step.compressed[layer.ratio]
        static = max_model_len is not None
        entries, slots = run_compressor(layer.compressor, hidden, pos, t2r, caches.state, state_table,
                                        cm.slot_mapping, layer.rotary, impl, static)
        insert_kv(entries.contiguous(), slots, caches.compressed, kcd, layout=caches.layout, validate_slots=False,
                  impl=impl)
        lay = caches.layout if kcd == "fp8_ds_mla" else None
        if layer.kind == "csa":
            ientries, islots = run_compressor(layer.indexer, hidden, pos, t2r, caches.indexer_state, state_table,
                                              cm.slot_mapping, layer.rotary, impl, static)
            insert_indexer_k(ientries.contiguous(), islots, caches.indexer_k, kcd, validate_slots=False, impl=impl)
            local = indexer_topk(layer, qr, hidden, cos, sin, pos, t2r, caches, cm.block_table,
                                 max_model_len // layer.ratio if static else None)
            glob, lens = builder.global_topk(step, local.contiguous(), impl=impl)
            sets.append(CandidateSet(caches.compressed, lens, indices=glob, layout=lay))
        else:
            sets.append(CandidateSet(caches.compressed, cm.lengths, block_table=cm.block_table, token_to_req=t2r,
                                     starts=cm.starts, layout=lay))
    scale = layer.config.softmax_scale
    # The Triton kernel multiplies on bf16 tensor cores whatever q's dtype; an fp32 layer asks
    # for fp32 attention, which the reference computes.
    attn_impl = impl if q.dtype == torch.bfloat16 else "reference"
    attn, _ = sparse_mla_attention(q.contiguous(), sets, scale, layer.sinks.float().contiguous(), impl=attn_impl)
    return layer.project_out(attn, cos, sin)
