"""Plain-PyTorch sparse MLA attention with attention sink: the executable spec.

``sparse_mla_attention_ref`` has the signature of :func:`dsv4attn.ops.sparse_attn.
sparse_mla_attention` (without ``impl``). It gathers every candidate of every set, decodes it
to fp32 (fp8_ds_mla via :mod:`dsv4attn.kv_cache.layout`), and computes one softmax over all
valid candidates in fp32, a few query tokens at a time so memory stays bounded. Runs on any
device. Invalid candidates are zeroed before any arithmetic, so NaN in unused pages never
reaches the output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv4attn.kv_cache.layout import FP8DSMLALayout, dequantize_tokens
from dsv4attn.kv_cache.slots import entry_slots
from dsv4attn.ops.candidate_set import CandidateSet, resolve_layout

#: Query tokens processed per step (bounds the gathered [tokens, candidates, head_dim] fp32 tensor).
_TOKENS_PER_STEP = 128


def candidate_slots(s: CandidateSet, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Global slots ``[n, width]`` int64 (0 where invalid) and validity ``[n, width]`` bool of
    tokens ``rows`` of set ``s``."""
    if s.lengths is None:  # indices form, whole rows
        assert s.indices is not None  # lengths=None only in the indices form (check_candidate_set)
        idx = s.indices[rows].long()
        valid = (idx >= 0) & (idx < s.capacity)
        return torch.where(valid, idx, torch.zeros_like(idx)), valid
    lengths = s.lengths[rows].long()
    n = lengths.shape[0]
    if s.indices is not None:
        idx = s.indices[rows].long()
        j = torch.arange(idx.shape[1], device=idx.device)
        valid = (j[None, :] < lengths[:, None]) & (idx >= 0)
        slot = idx
    else:
        # Entries outside the block table ([0, max_blocks * block_size)) and tokens whose
        # token_to_req is no block-table row have no candidates: clip each range to the table
        # (bounded work, whatever the lengths) and empty the others.
        assert s.block_table is not None and s.token_to_req is not None and s.starts is not None  # range form
        max_blocks, num_reqs = s.block_table.shape[1], s.block_table.shape[0]
        req = s.token_to_req[rows].long()
        lo = s.starts[rows].long().clamp(min=0)
        hi = torch.minimum(s.starts[rows].long() + lengths, torch.full_like(lo, max_blocks * s.block_size))
        lengths = torch.where((req >= 0) & (req < num_reqs), (hi - lo).clamp(min=0), torch.zeros_like(lo))
        width = int(lengths.max().item()) if n else 0
        j = torch.arange(width, device=lengths.device)
        e = lo[:, None] + j[None, :]
        valid = j[None, :] < lengths[:, None]
        slot = entry_slots(s.block_table, torch.where(valid, req[:, None], 0), e, s.block_size, valid)
        valid = slot >= 0  # the one slot formula: holes (freed blocks, columns past the table) are -1
    valid = valid & (slot < s.capacity)
    return torch.where(valid, slot, torch.zeros_like(slot)), valid


def gather_entries(s: CandidateSet, slot: torch.Tensor, layout: FP8DSMLALayout | None) -> torch.Tensor:
    """Decode the cache entries at ``slot [...]`` (all in range) -> fp32 ``[..., head_dim]``."""
    cache = s.cache
    bs = s.block_size
    blk, off = torch.div(slot, bs, rounding_mode="floor"), torch.remainder(slot, bs)
    if layout is None:  # bf16 pages
        return cache[blk, off].float()
    # Byte addresses from the block base (the view's middle/last dims are cosmetic).
    span = (cache.shape[0] - 1) * cache.stride(0) + bs * layout.entry_bytes  # last block: its bytes only
    base = cache.as_strided((span,), (1,), cache.storage_offset())
    blk_base = blk * cache.stride(0)
    data_off = blk_base + off * layout.data_bytes
    d = torch.arange(layout.data_bytes, device=slot.device)
    data = base[data_off[..., None] + d]  # [..., data_bytes] uint8
    sc_off = blk_base + layout.scale_offset(bs) + off * layout.scale_bytes
    st = torch.arange(layout.num_tiles, device=slot.device)
    scale = base[sc_off[..., None] + st]  # [..., num_tiles] uint8
    nope = data[..., : layout.nope_dim].contiguous()
    rope = data[..., layout.nope_dim :].contiguous().view(torch.bfloat16)
    return dequantize_tokens(nope, rope, scale, layout)


def sparse_mla_attention_ref(
    q: torch.Tensor,
    sets: Sequence[CandidateSet],
    softmax_scale: float,
    attn_sink: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``sparse_mla_attention``: q ``[T, H, D]`` bf16 or fp32 -> (out ``[T, H, D]``
    of q's dtype, lse ``[T, H]`` fp32); computed in fp32 (an fp32 q is never rounded to bf16).
    Inputs are assumed validated (the op validates)."""
    return sparse_mla_forward_ref(q, sets, softmax_scale, attn_sink, out, want_max=False)[:2]


def sparse_mla_forward_ref(
    q: torch.Tensor,
    sets: Sequence[CandidateSet],
    softmax_scale: float,
    attn_sink: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    want_max: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """As :func:`sparse_mla_attention_ref`, plus the max logit ``[T, H]`` fp32 (-inf for empty
    rows) when ``want_max``."""
    num_tokens, num_heads, head_dim = q.shape
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    lse_out = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    max_out = torch.empty_like(lse_out) if want_max else None
    layouts = [resolve_layout(s, head_dim, f"sets[{i}]") for i, s in enumerate(sets)]
    for t0 in range(0, num_tokens, _TOKENS_PER_STEP):
        rows = slice(t0, min(t0 + _TOKENS_PER_STEP, num_tokens))
        ks, valids = [], []
        for s, lay in zip(sets, layouts):
            slot, valid = candidate_slots(s, rows)
            k = gather_entries(s, slot, lay)  # [n, w, D]
            ks.append(torch.where(valid[..., None], k, torch.zeros((), device=k.device)))
            valids.append(valid)
        k = torch.cat(ks, dim=1)  # [n, W, D] fp32
        valid = torch.cat(valids, dim=1)  # [n, W]
        o, lse, mx = _attend(q[rows].float(), k, valid, softmax_scale, attn_sink)
        out[rows] = o.to(out.dtype)
        lse_out[rows] = lse
        if max_out is not None:
            max_out[rows] = mx
    return out, lse_out, max_out


def _attend(
    q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor, scale: float, sink: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[n, H, D]``, k ``[n, W, D]`` (zero where invalid), valid ``[n, W]`` -> out, lse, max."""
    s = torch.einsum("nhd,nwd->nhw", q, k.to(q.dtype)) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    mx = s.amax(dim=-1) if s.shape[-1] else torch.full(s.shape[:-1], float("-inf"), device=s.device)
    lse = torch.logsumexp(s, dim=-1)  # [n, H]; -inf for empty rows
    empty = torch.isneginf(lse)
    p = torch.exp(s - torch.where(empty, torch.zeros_like(lse), lse)[..., None])
    o = torch.einsum("nhw,nwd->nhd", p, k.to(q.dtype))
    if sink is not None:
        o = o / (1.0 + torch.exp(sink.to(q.dtype)[None, :] - lse))[..., None]
    o = torch.where(empty[..., None], torch.zeros_like(o), o)
    lse = torch.where(empty, torch.full_like(lse, float("inf")), lse)
    return o, lse.float(), mx.float()
