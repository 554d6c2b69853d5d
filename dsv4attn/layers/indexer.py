"""Lightning indexer of CSA layers: its own compressor, ReLU scoring and a deterministic top-k.

Score of compressed entry ``k`` for query token ``t`` (``H_I`` heads, head dim ``D_I``):
``s[t, k] = sum_h (w[t, h] * H_I^-0.5) * ReLU(q[t, h] . K[k]) * D_I^-0.5`` with
``q = RoPE_p(q_b_proj(qr))`` (no norm), ``w = weights_proj(hidden)`` and ``K`` the indexer
compressor's entries. Only entries ``k < (p + 1) // r`` are eligible (causal limit).
Top-k keeps the ``min(index_topk, eligible)`` highest scores; equal scores are broken towards
the LOWER entry index (deterministic, unlike the reference's ``torch.topk``); unused columns
are -1. The whole-sequence path scores with :meth:`Indexer.scores` + :func:`select_topk`; the
paged path (:meth:`Indexer.topk_paged`) runs the op :func:`dsv4attn.ops.indexer.indexer_topk`
over the indexer-K cache.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4attn.layers.compressor import Compressor
from dsv4attn.ops.indexer import indexer_topk
from dsv4attn.ops.norm_rope import norm_rope
from dsv4attn.reference.indexer import select_topk, topk_boundary_ties

__all__ = ["Indexer", "IndexerScorer", "select_topk", "topk_boundary_ties"]


class IndexerScorer(nn.Module):
    """Holds the per-head weight projection ``weights_proj [H_I, hidden]`` (checkpoint name)."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)


class Indexer(Compressor):
    """Indexer = overlapping compressor at ``index_head_dim`` + query projection + scorer."""

    def __init__(
        self, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int, ratio: int, topk: int, eps: float
    ) -> None:
        super().__init__(hidden_size, head_dim, ratio, overlap=True, eps=eps)
        self.num_heads = num_heads
        self.topk = topk
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.scorer = IndexerScorer(hidden_size, num_heads)

    def queries(
        self, qr: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: str = "reference",
        w: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """qr ``[T, q_lora_rank]``, hidden ``[T, hidden]`` -> (q ``[T, H_I, D_I]`` in the model dtype,
        weights fp32 ``[T, H_I]``).

        The weights already include ``H_I^-0.5``; ``D_I^-0.5`` is applied in :meth:`scores`.
        ``impl`` picks the fused RoPE kernel (``ops.norm_rope``) or its reference; ``w``:
        ``weights_proj(hidden)`` when the caller has it.
        """
        T = qr.shape[0]
        q = norm_rope(self.q_b_proj(qr).view(T, self.num_heads, self.dim), cos, sin, impl=impl)
        w = (self.scorer.weights_proj(hidden) if w is None else w).float() * self.num_heads ** -0.5
        return q, w

    def scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q ``[T, H, D_I]``, weights ``[T, H]``, keys ``[T, N, D_I]`` (per token) -> fp32 ``[T, N]``."""
        logits = torch.einsum("thd,tnd->thn", q.float(), keys.float())
        logits = torch.relu(logits) * self.dim ** -0.5
        return (logits * weights[:, :, None]).sum(dim=1)

    def topk_paged(
        self, q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
        token_to_req: torch.Tensor, num_eligible: torch.Tensor, impl: str = "auto",
    ) -> torch.Tensor:
        """Top-k over the paged indexer-K cache: q ``[T, H_I, D_I]``, weights ``[T, H_I]`` (from
        :meth:`queries`), k_cache (fp8 pages or rows), block_table int32 ``[R, max_blocks]``,
        token_to_req / num_eligible int ``[T]`` -> request-local int32 ``[T, topk]`` (-1 padded).

        ``D_I^-0.5`` is folded into the weights; q goes back to the model dtype (exact: it was
        computed there), so a bf16 model scores on the bf16 tensor cores. The caller's metadata
        already bounds every index, so the op's value checks (a host sync) are skipped.
        """
        w = (weights * self.dim ** -0.5).contiguous()
        model_dtype = self.q_b_proj.weight.dtype
        q = q.to(model_dtype) if model_dtype in (torch.bfloat16, torch.float32) else q.float()
        idx, _ = indexer_topk(q.contiguous(), w, k_cache, block_table, token_to_req.to(torch.int32),
                              num_eligible.to(torch.int32), self.topk, validate_indices=False, impl=impl)
        return idx
