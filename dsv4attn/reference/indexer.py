"""Plain-PyTorch lightning indexer over the paged indexer-K cache (the executable spec of
:func:`dsv4attn.ops.indexer.indexer_topk`) and the deterministic top-k rule.

Score of entry ``e`` for query token ``t`` (``H`` heads, head dim ``D``)::

    s[t, e] = sum_h weights[t, h] * ReLU(q[t, h] . K[e])

``weights`` carries every scale factor (the layer folds ``H^-0.5 * D^-0.5`` in). ``K[e]`` is the
key stored at entry ``e`` of the token's request: fp8 pages hold ``D`` e4m3fn bytes and one fp32
power-of-two scale per entry (``K = fp8 * scale``), "auto" pages hold bf16/fp32 rows.

Entry ``e`` is a candidate of token ``t`` iff ``token_to_req[t]`` is a block-table row,
``e < lengths[t]``, its block-table column
``e // block_size`` exists, and the block id there is in ``[0, num_blocks)`` (a -1 hole is not a
candidate; nothing is read from it). Top-k keeps the ``min(topk, #candidates)`` best candidates,
best first; equal scores go to the LOWER entry index (``-0.0`` equals ``+0.0``); the remaining
columns are ``-1`` (score ``-inf``). Non-finite scores rank unspecified.
"""

from __future__ import annotations

import torch

from dsv4attn.kv_cache.slots import entry_slots
from dsv4attn.kv_cache.specs import INDEXER_SCALE_BYTES

#: Elements of the reference's per-chunk temporaries ([tokens, entries, max(D, H)] fp32): the
#: query tokens scored together are chosen so this bound holds (64 MiB of fp32).
_CHUNK_ELEMENTS = 1 << 24


def select_topk(scores: torch.Tensor, num_eligible: torch.Tensor, topk: int) -> torch.Tensor:
    """scores fp32 ``[T, N]``, num_eligible int ``[T]`` -> int32 ``[T, min(topk, N)]`` entry indices.

    Row t keeps the ``min(topk, num_eligible[t])`` best of entries ``0 .. num_eligible[t]-1``,
    best first, ties -> lower index first; remaining columns are -1. ``N`` may be 0.
    """
    T, N = scores.shape
    eligible = torch.arange(N, device=scores.device)[None, :] < num_eligible[:, None]
    return select_topk_masked(scores, eligible, min(topk, N))[0]


def select_topk_masked(scores: torch.Tensor, candidate: torch.Tensor, topk: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """scores fp32 ``[T, N]``, candidate bool ``[T, N]`` -> (int32 ``[T, topk]`` entry indices,
    fp32 ``[T, topk]`` their scores): the ``min(topk, #candidates)`` best candidates of each row,
    best first, ties -> lower index; the rest ``-1`` / ``-inf``. Needs finite candidate scores."""
    T, N = scores.shape
    idx = torch.full((T, topk), -1, dtype=torch.int32, device=scores.device)
    val = torch.full((T, topk), float("-inf"), dtype=torch.float32, device=scores.device)
    width = min(topk, N)
    if width == 0 or T == 0:
        return idx, val
    masked = (scores.float() + 0.0).masked_fill(~candidate, float("-inf"))  # + 0.0: -0.0 -> +0.0
    # a stable descending sort keeps equal scores (and -0.0 == +0.0) in ascending index order
    top = torch.sort(masked, dim=-1, descending=True, stable=True)
    keep = torch.arange(width, device=scores.device)[None, :] < candidate.sum(dim=1, keepdim=True)
    idx[:, :width] = torch.where(keep, top.indices[:, :width], -1).to(torch.int32)
    val[:, :width] = torch.where(keep, top.values[:, :width], float("-inf"))
    return idx, val


def topk_boundary_ties(scores: torch.Tensor, num_eligible: torch.Tensor, topk: int) -> torch.Tensor:
    """bool ``[T]``: True where the top-k selection of a row is ambiguous, i.e. more than ``topk``
    entries are eligible and the ``topk``-th and ``topk+1``-th best eligible scores are equal
    (typically exact ReLU zeros). Any tie-break is then valid; the reference's is arbitrary."""
    T, N = scores.shape
    if topk >= N:
        return torch.zeros(T, dtype=torch.bool, device=scores.device)
    eligible = torch.arange(N, device=scores.device)[None, :] < num_eligible[:, None]
    best = scores.masked_fill(~eligible, float("-inf")).sort(dim=-1, descending=True).values
    return (num_eligible > topk) & (best[:, topk - 1] == best[:, topk])


def gather_indexer_keys(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Indexer keys at global ``slots [...]`` (all valid) -> fp32 ``[..., D]``.

    cache: uint8 fp8 pages ``(num_blocks, bs, D + 4)`` (any block stride) or bf16/fp32 rows
    ``(num_blocks, bs, D)``.
    """
    bs = cache.shape[1]
    slots = slots.long()
    blk, off = torch.div(slots, bs, rounding_mode="floor"), torch.remainder(slots, bs)
    if cache.dtype != torch.uint8:
        return cache[blk, off].float()
    d = cache.shape[2] - INDEXER_SCALE_BYTES
    base = cache.as_strided((cache.shape[0] * cache.stride(0),), (1,), cache.storage_offset())
    blk_base = blk * cache.stride(0)
    data = base[(blk_base + off * d)[..., None] + torch.arange(d, device=slots.device)]
    scale = base[(blk_base + bs * d + off * INDEXER_SCALE_BYTES)[..., None]
                 + torch.arange(INDEXER_SCALE_BYTES, device=slots.device)]
    return data.view(torch.float8_e4m3fn).float() * scale.contiguous().view(torch.float32)


def indexer_candidates(block_table: torch.Tensor, token_to_req: torch.Tensor, lengths: torch.Tensor,
                       num_blocks: int, block_size: int, num_entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries ``0 .. num_entries-1`` of each token -> (global slot int64 ``[T, N]`` (0 where not a
    candidate), candidate bool ``[T, N]``) by the rule in the module docstring."""
    e = torch.arange(num_entries, device=lengths.device)
    req = token_to_req.long()
    row_ok = (req >= 0) & (req < block_table.shape[0])
    live = (e[None, :] < lengths.long()[:, None]) & row_ok[:, None]
    slot = entry_slots(block_table, torch.where(row_ok, req, 0)[:, None], e[None, :], block_size, live)
    ok = (slot >= 0) & (slot < num_blocks * block_size)  # the one slot formula, plus ids past the cache
    return torch.where(ok, slot, torch.zeros_like(slot)), ok


def indexer_topk_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    lengths: torch.Tensor,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`dsv4attn.ops.indexer.indexer_topk` (validated input assumed).

    q ``[T, H, D]``, weights ``[T, H]``, k_cache (see :func:`gather_indexer_keys`), block_table
    int32 ``[R, max_blocks]``, token_to_req / lengths int32 ``[T]`` -> (int32 ``[T, topk]``
    request-local entry indices, fp32 ``[T, topk]`` scores), fp32 math, scored in token chunks.
    """
    T = q.shape[0]
    dev = q.device
    idx = torch.full((T, topk), -1, dtype=torch.int32, device=dev)
    val = torch.full((T, topk), float("-inf"), dtype=torch.float32, device=dev)
    nb, bs = k_cache.shape[0], k_cache.shape[1]
    req_ok = (token_to_req >= 0) & (token_to_req < block_table.shape[0])
    n = torch.where(req_ok, lengths.long().clamp(0, block_table.shape[1] * bs), 0)
    token_to_req = torch.where(req_ok, token_to_req, 0)
    n_max = int(n.max()) if T else 0
    if n_max == 0 or topk == 0:
        return idx, val
    per_chunk = max(1, _CHUNK_ELEMENTS // (n_max * max(q.shape[1], q.shape[2])))
    for t0 in range(0, T, per_chunk):
        rows = slice(t0, min(T, t0 + per_chunk))
        slot, ok = indexer_candidates(block_table, token_to_req[rows], n[rows], nb, bs, n_max)
        keys = torch.where(ok[..., None], gather_indexer_keys(k_cache, slot), 0.0)  # [t, N, D]
        logits = torch.einsum("thd,tnd->thn", q[rows].float(), keys)
        scores = (torch.relu(logits) * weights[rows].float()[:, :, None]).sum(dim=1)
        idx[rows], val[rows] = select_topk_masked(scores, ok, topk)
    return idx, val
