"""One DCP step: the rank's per-step metadata (built once, shared by every layer of a model) and
one layer's step over the rank's shard of the caches.

:func:`build_dcp_metadata` is the DCP counterpart of ``StepMetadataBuilder.build`` (range form):
from the step's request lengths and this rank's block tables it gives the SWA slot mapping
(``get_compressed_slot_mapping`` with ratio 1 and the CP arguments: raw position ``p`` is SWA
entry ``p``), the SWA window as a LOCAL range per token, and per compressed ratio the CP slot
mapping and the local length of the C128A prefix. :func:`dcp_layer_step` is the counterpart of
``layer_step`` (see :mod:`dsv4attn.distributed.dcp` for the dataflow and collectives).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

from dsv4attn._checks import check_tensor
from dsv4attn.distributed.interleave import global_to_local, local_to_global, merge_scale, num_local, owner
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.layers.indexer import select_topk
from dsv4attn.ops import metadata as meta_ops
from dsv4attn.ops.cache_ops import insert_indexer_k, insert_kv
from dsv4attn.ops.candidate_set import CandidateSet
from dsv4attn.ops.sparse_attn import sparse_mla_attention
from dsv4attn.reference.indexer import gather_indexer_keys
from dsv4attn.serving.paged import LayerCaches, completing_positions, run_compressor, state_slots

#: Bound on the indexer's per-chunk temporaries (as in ``layer_step``): 64 MiB of fp32.
_INDEXER_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class DCPCompressedMetadata:
    """One compressed ratio on this rank: ``block_table`` int32 ``[R, cols]`` of LOCAL entries
    (``block_size`` per block), ``slot_mapping`` int64 ``[T]`` (the CP slot of the entry a token
    completes, -1 if none or another rank's), ``lengths`` int32 ``[T]`` (this rank's entries among
    ``0 .. (p+1)//r - 1``), ``state_block_table`` int32 ``[R, cols]`` (replicated state cache)."""

    block_table: torch.Tensor
    block_size: int
    slot_mapping: torch.Tensor
    lengths: torch.Tensor
    state_block_table: torch.Tensor


@dataclass(frozen=True)
class DCPStepMetadata:
    """One step on one DCP rank (R requests, T tokens, decodes first). positions int64 ``[T]``,
    token_to_req int32 ``[T]`` (replicated); swa_block_table int32 ``[R, cols]`` of LOCAL
    entries, swa_slot_mapping int64 ``[T]`` (-1: another rank's position), swa_starts /
    swa_lengths int32 ``[T]`` (the window as a local range); ``compressed``: ratio -> metadata."""

    rank: int
    world_size: int
    interleave: int
    positions: torch.Tensor
    token_to_req: torch.Tensor
    max_seq_len: int
    swa_block_table: torch.Tensor
    swa_slot_mapping: torch.Tensor
    swa_starts: torch.Tensor
    swa_lengths: torch.Tensor
    compressed: Mapping[int, DCPCompressedMetadata]


def build_dcp_metadata(
    query_lens: Sequence[int], seq_lens: Sequence[int], swa_block_table: torch.Tensor, swa_block_size: int,
    window_size: int, compressed: Mapping[int, tuple[torch.Tensor, int, torch.Tensor]], rank: int,
    world_size: int, interleave: int, device: torch.device | str, impl: str = "auto",
) -> DCPStepMetadata:
    """This rank's metadata of one step.

    query_lens / seq_lens: per request (decodes first), ``1 <= query_len <= seq_len``;
    swa_block_table int32 ``[>=R, cols]`` (this rank's, local entries, ``swa_block_size`` per
    block); ``compressed``: ratio -> (block table of local compressed entries, entries per block,
    state block table). Tables must be on ``device``.
    """
    ql, sl = [int(x) for x in query_lens], [int(x) for x in seq_lens]
    if len(ql) != len(sl) or not ql:
        raise ValueError(f"query_lens and seq_lens must be non-empty and of equal length, got {len(ql)}, {len(sl)}")
    if any(not 1 <= q <= s for q, s in zip(ql, sl)):
        raise ValueError(f"every request needs 1 <= query_len <= seq_len, got {list(zip(ql, sl))}")
    dev = torch.device(device)
    R, T = len(ql), sum(ql)
    for name, t in [("swa_block_table", swa_block_table)] + [
            (f"compressed[{r}] tables", x) for r, (bt, _, st) in compressed.items() for x in (bt, st)]:
        check_tensor(name, t, dtype=torch.int32, ndim=2, device=dev)
        if t.shape[0] < R:
            raise ValueError(f"{name} must have >= {R} rows, got shape {tuple(t.shape)}")
    nl = lambda n: num_local(n, rank, world_size, interleave)  # noqa: E731
    cp: dict[str, Any] = dict(cp_world_size=world_size, cp_rank=rank, cp_kv_cache_interleave_size=interleave)
    pos = torch.cat([torch.arange(s - q, s) for q, s in zip(ql, sl)]).to(dev)
    t2r = torch.repeat_interleave(torch.arange(R, dtype=torch.int32), torch.tensor(ql)).to(dev)
    qsl = torch.tensor([0] + ql).cumsum(0).to(torch.int32).to(dev)
    seq = torch.tensor(sl, dtype=torch.int32, device=dev)
    swa_sm = meta_ops.get_compressed_slot_mapping(T, qsl, seq, swa_block_table, swa_block_size, 1, impl=impl, **cp)
    lo = nl((pos - window_size + 1).clamp(min=0))
    comp = {}
    for r, (bt, bs, state_bt) in compressed.items():
        csm = meta_ops.get_compressed_slot_mapping(T, qsl, seq, bt, bs, r, impl=impl, **cp)
        lengths = nl(torch.div(pos + 1, r, rounding_mode="floor")).to(torch.int32)
        comp[r] = DCPCompressedMetadata(bt, bs, csm, lengths, state_bt)
    return DCPStepMetadata(rank, world_size, interleave, pos, t2r, max(sl), swa_block_table, swa_sm,
                           lo.to(torch.int32), (nl(pos + 1) - lo).to(torch.int32), MappingProxyType(comp))


def dcp_layer_step(layer: DeepseekV4Attention, hidden: torch.Tensor, meta: DCPStepMetadata, caches: LayerCaches,
                   group: Any, impl: str = "auto") -> torch.Tensor:
    """hidden ``[T, hidden_size]`` (batch order, the same on every rank) -> output ``[T, hidden_size]``,
    identical on every rank of ``group`` (all-reduced). ``caches``: this rank's shard."""
    pos, t2r, c = meta.positions, meta.token_to_req, caches
    T, dev = hidden.shape[0], hidden.device
    cos, sin = layer.rotary(pos)
    q, qr = layer.project_q(hidden, cos, sin)
    kv = layer.project_kv(hidden, cos, sin)
    kcd = c.kv_cache_dtype
    lay = c.layout if kcd == "fp8_ds_mla" else None
    insert_kv(kv, meta.swa_slot_mapping, c.swa, kcd, layout=c.layout, validate_slots=False, impl=impl)
    sets = [CandidateSet(c.swa, meta.swa_lengths, block_table=meta.swa_block_table, token_to_req=t2r,
                         starts=meta.swa_starts, layout=lay)]
    if layer.compressor is not None:
        assert c.compressed is not None and c.state is not None  # a compressed layer's caches
        cm = meta.compressed[layer.ratio]
        erope = layer.rotary(pos, ratio=layer.ratio)  # at each entry's first raw position
        ppos = completing_positions(pos, cm.slot_mapping)
        entries, slots = run_compressor(layer.compressor, hidden, pos, t2r, c.state, cm.state_block_table,
                                        cm.slot_mapping, ppos, erope, impl)
        insert_kv(entries.contiguous(), slots, c.compressed, kcd, layout=c.layout, validate_slots=False, impl=impl)
        if layer.kind == "csa":
            assert layer.indexer is not None and c.indexer_state is not None and c.indexer_k is not None  # CSA
            ient, islots = run_compressor(layer.indexer, hidden, pos, t2r, c.indexer_state, cm.state_block_table,
                                          cm.slot_mapping, ppos, erope, impl)
            insert_indexer_k(ient.contiguous(), islots, c.indexer_k, kcd, validate_slots=False, impl=impl)
            top = dcp_indexer_topk(layer, qr, hidden, cos, sin, pos, t2r, c, cm.block_table,
                                   meta.max_seq_len // layer.ratio, group, meta.rank, meta.world_size, meta.interleave)
            mine = (top >= 0) & (owner(top.clamp(min=0), meta.world_size, meta.interleave) == meta.rank)
            local = global_to_local(top.clamp(min=0), meta.world_size, meta.interleave)
            idx = _entry_slots(local, t2r.long()[:, None].expand_as(local), cm.block_table, cm.block_size, mine)
            idx = idx.to(torch.int32).contiguous()
            lens = torch.full((T,), idx.shape[1], dtype=torch.int32, device=dev)  # holes anywhere: -1 marks them
            sets.append(CandidateSet(c.compressed, lens, indices=idx, layout=lay))
        else:
            sets.append(CandidateSet(c.compressed, cm.lengths, block_table=cm.block_table, token_to_req=t2r,
                                     starts=torch.zeros(T, dtype=torch.int32, device=dev), layout=lay))
    attn_impl = impl if q.dtype == torch.bfloat16 else "reference"  # as layer_step: fp32 asks for fp32
    attn, lse = sparse_mla_attention(q.contiguous(), sets, layer.config.softmax_scale, None, impl=attn_impl)
    scale = merge_scale(lse, layer.sinks, group)
    partial = (attn.float() * scale[..., None]).to(attn.dtype)
    out = layer.project_out(partial, cos, sin).contiguous()  # a TP shard all-reduces over its TP group here
    dist.all_reduce(out, group=group)
    return out


def dcp_indexer_topk(
    layer: DeepseekV4Attention, qr: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    positions: torch.Tensor, token_to_req: torch.Tensor, caches: LayerCaches, mla_table: torch.Tensor,
    max_eligible: int, group: Any, rank: int, world_size: int, interleave: int,
) -> torch.Tensor:
    """Global top-k entry ids int64 ``[T, K]`` (``K = min(topk, max_eligible)``, -1 padded),
    identical on every rank and equal to one process's ``select_topk`` over all entries.

    Each rank scores the indexer keys it owns (local entries ``< num_local((p+1)//r)``), keeps its
    own top-k, and the ranks all-gather ``(score, global entry)`` pairs; the global top-k of a
    total order (score descending, entry ascending) lies within the union of the per-rank top-k.
    """
    idx = layer.indexer
    assert idx is not None and caches.indexer_k is not None  # a CSA layer (dcp_layer_step calls this for those)
    T, dev = positions.shape[0], positions.device
    K = min(idx.topk, max_eligible)
    if K == 0:
        return torch.full((T, 0), -1, dtype=torch.int64, device=dev)
    eligible = torch.div(positions.long() + 1, idx.ratio, rounding_mode="floor")
    elig_local = num_local(eligible, rank, world_size, interleave)
    n_local = num_local(max_eligible, rank, world_size, interleave)
    vals = torch.full((T, K), float("-inf"), dtype=torch.float32, device=dev)
    gids = torch.full((T, K), -1, dtype=torch.int64, device=dev)
    if n_local > 0:
        q, w = idx.queries(qr, hidden, cos, sin)
        bs = caches.indexer_k.shape[1]
        e = torch.arange(n_local, device=dev)
        per_chunk = max(1, _INDEXER_CHUNK_ELEMENTS // (n_local * max(idx.dim, idx.num_heads)))
        for t0 in range(0, T, per_chunk):
            rows = slice(t0, min(T, t0 + per_chunk))
            req = token_to_req[rows].long()[:, None].expand(-1, n_local)
            slot = _entry_slots(e[None, :].expand_as(req), req, mla_table, bs, e[None, :] < elig_local[rows, None])
            ok = slot >= 0
            keys = gather_indexer_keys(caches.indexer_k, torch.where(ok, slot, torch.zeros_like(slot)))
            keys = torch.where(ok[..., None], keys, torch.zeros((), device=dev))
            scores = idx.scores(q[rows], w[rows], keys)  # [n, n_local]
            sel = select_topk(scores, elig_local[rows], idx.topk).long()  # [n, <= K]
            has, k_loc = sel >= 0, sel.shape[1]
            vals[rows, :k_loc] = torch.where(has, scores.gather(1, sel.clamp(min=0)), float("-inf"))
            gids[rows, :k_loc] = torch.where(has, local_to_global(sel.clamp(min=0), rank, world_size, interleave), -1)
    all_vals = [torch.empty_like(vals) for _ in range(world_size)]
    all_gids = [torch.empty_like(gids) for _ in range(world_size)]
    dist.all_gather(all_vals, vals.contiguous(), group=group)
    dist.all_gather(all_gids, gids.contiguous(), group=group)
    vals, gids = torch.cat(all_vals, dim=1), torch.cat(all_gids, dim=1)  # [T, world * K]
    by_id = torch.sort(torch.where(gids >= 0, gids, torch.iinfo(torch.int64).max), dim=1, stable=True).indices
    vals, gids = vals.gather(1, by_id), gids.gather(1, by_id)
    best = torch.sort(vals, dim=1, descending=True, stable=True).indices[:, :K]
    top = gids.gather(1, best)
    keep = torch.arange(K, device=dev)[None, :] < eligible[:, None]
    return torch.where(keep, top, torch.full_like(top, -1))


def _entry_slots(entries: torch.Tensor, req: torch.Tensor, table: torch.Tensor, block_size: int,
                 valid: torch.Tensor) -> torch.Tensor:
    """int64 slots of rank-local ``entries [...]`` of requests ``req [...]`` through ``table``; -1
    where not ``valid``, past the table's columns (an empty table included) or at a -1 block."""
    if table.shape[0] == 0 or table.shape[1] == 0:
        return torch.full(entries.shape, -1, dtype=torch.int64, device=entries.device)
    slot, ok = state_slots(entries, req, table, block_size)
    return torch.where(ok & valid, slot, torch.full_like(slot, -1))
