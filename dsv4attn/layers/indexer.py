"""Lightning indexer of CSA layers: its own compressor, ReLU scoring and a deterministic top-k.

Score of compressed entry ``k`` for query token ``t`` (``H_I`` heads, head dim ``D_I``):
``s[t, k] = sum_h (w[t, h] * H_I^-0.5) * ReLU(q[t, h] . K[k]) * D_I^-0.5`` with
``q = RoPE_p(q_b_proj(qr))`` (no norm), ``w = weights_proj(hidden)`` and ``K`` the indexer
compressor's entries. Only entries ``k < (p + 1) // r`` are eligible (causal limit).
Top-k keeps the ``min(index_topk, eligible)`` highest scores; equal scores are broken towards
the LOWER entry index (deterministic, unlike the reference's ``torch.topk``); unused columns
are -1.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4attn.layers.compressor import Compressor
from dsv4attn.layers.rope import apply_rope


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
        self, qr: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """qr ``[T, q_lora_rank]``, hidden ``[T, hidden]`` -> (q fp32 ``[T, H_I, D_I]``, weights fp32 ``[T, H_I]``).

        The weights already include ``H_I^-0.5``; ``D_I^-0.5`` is applied in :meth:`scores`.
        """
        T = qr.shape[0]
        q = apply_rope(self.q_b_proj(qr).view(T, self.num_heads, self.dim), cos, sin).float()
        w = self.scorer.weights_proj(hidden).float() * self.num_heads ** -0.5
        return q, w

    def scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q ``[T, H, D_I]``, weights ``[T, H]``, keys ``[T, N, D_I]`` (per token) -> fp32 ``[T, N]``."""
        logits = torch.einsum("thd,tnd->thn", q, keys.float())
        logits = torch.relu(logits) * self.dim ** -0.5
        return (logits * weights[:, :, None]).sum(dim=1)


def select_topk(scores: torch.Tensor, num_eligible: torch.Tensor, topk: int) -> torch.Tensor:
    """scores fp32 ``[T, N]``, num_eligible int ``[T]`` -> int32 ``[T, min(topk, N)]`` entry indices.

    Row t keeps the ``min(topk, num_eligible[t])`` best of entries ``0 .. num_eligible[t]-1``,
    best first, ties -> lower index first; remaining columns are -1. ``N`` may be 0.
    """
    T, N = scores.shape
    width = min(topk, N)
    if width == 0:
        return torch.full((T, 0), -1, dtype=torch.int32, device=scores.device)
    eligible = torch.arange(N, device=scores.device)[None, :] < num_eligible[:, None]
    masked = scores.masked_fill(~eligible, float("-inf"))
    # stable descending sort keeps equal scores in ascending index order
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :width]
    keep = torch.arange(width, device=scores.device)[None, :] < num_eligible[:, None]
    return torch.where(keep, order, torch.full_like(order, -1)).to(torch.int32)


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
