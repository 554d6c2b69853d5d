"""KV compressors of DeepSeek-V4 (gated softmax pooling with a learned position bias).

A compressor turns every ``r`` raw tokens into one compressed entry of width ``D``. Each raw
token at position ``p`` contributes one fp32 *state row* ``[kv (coff*D) | score (coff*D)]`` with
``score = gate + position_bias[p % r]`` (``coff = 2`` with overlapping windows (CSA, r = 4),
``1`` otherwise (HCA)). Entry ``k`` is emitted when the token ``p = k*r + r - 1`` is processed;
it pools the ``L = coff * r`` rows at positions ``k*r - (coff-1)*r .. k*r + r - 1``:

- with overlap, rows of the previous block (the first ``r``) use the first half of the kv/score
  columns ``[0, D)``, rows of the current block use ``[D, 2D)``; rows at negative positions
  (entry 0's previous block) get weight 0;
- per channel ``d``: ``c[d] = sum_rows softmax_rows(score[:, d]) * kv[:, d]``;
- then RMSNorm (``kv_norm`` weight) and RoPE at position ``k*r`` on the last ``rope_dim`` dims.

The pooling math lives in :mod:`dsv4attn.reference.compressor` (whole-sequence path) and in the
op :func:`dsv4attn.ops.compressor.compressor_pool` (paged state cache, :meth:`Compressor.pool_paged`).

Parameter names match the checkpoint: ``kv_proj``, ``gate_proj``, ``position_bias``, ``kv_norm``.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4attn.layers.norm import RMSNorm
from dsv4attn.ops.compressor import compressor_pool
from dsv4attn.ops.norm_rope import norm_rope
from dsv4attn.reference.compressor import pool_window_rows, window_positions


class Compressor(nn.Module):
    """One compressor: ``hidden -> state rows -> pooled, normed, rotated entries``.

    Args: hidden_size, dim (entry width D), ratio r (>= 2), overlap (CSA windows), eps.
    """

    def __init__(self, hidden_size: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim = dim
        self.ratio = ratio
        self.overlap = overlap
        self.coff = 2 if overlap else 1
        width = self.coff * dim
        self.kv_proj = nn.Linear(hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width))
        self.kv_norm = RMSNorm(dim, eps)

    @property
    def window_rows(self) -> int:
        """Rows pooled per entry: ``coff * ratio``."""
        return self.coff * self.ratio

    @property
    def state_width(self) -> int:
        """fp32 values per state row: ``2 * coff * dim``."""
        return 2 * self.coff * self.dim

    def state_rows(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hidden ``[T, hidden_size]``, positions ``[T]`` -> fp32 rows ``[T, 2*coff*D]``.

        ``[kv | gate + position_bias[p % r]]`` (the bias is fused in at save time).
        """
        kv = self.kv_proj(hidden).float()
        bias = self.position_bias.float()[(positions % self.ratio).long()]
        score = self.gate_proj(hidden).float() + bias
        return torch.cat([kv, score], dim=-1)

    def window_positions(self, entry_index: torch.Tensor) -> torch.Tensor:
        """entry indices ``[N]`` -> raw positions of its window rows ``[N, L]`` (may be < 0)."""
        return window_positions(entry_index, self.ratio, self.overlap)

    def pool(self, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """rows fp32 ``[N, L, 2*coff*D]`` (window order), valid ``[N, L]`` -> pooled fp32 ``[N, D]``.

        Invalid rows get weight 0; every window has at least its last ``r`` rows valid.
        """
        return pool_window_rows(rows, valid, self.ratio, self.overlap)

    def pool_paged(
        self, state_cache: torch.Tensor, block_table: torch.Tensor, token_to_req: torch.Tensor,
        positions: torch.Tensor, impl: str = "auto",
    ) -> torch.Tensor:
        """Pool entries from the paged state cache: row n pools entry ``positions[n] // r`` of request
        ``token_to_req[n]`` (``positions[n] < 0`` -> zero row) -> fp32 ``[N, D]``.

        The caller's metadata bounds every index, so the op's value checks (a host sync) are skipped.
        """
        return compressor_pool(state_cache, block_table, token_to_req.to(torch.int32), positions, self.ratio,
                               self.overlap, validate_indices=False, impl=impl)

    def finish(
        self, pooled: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, impl: str = "reference"
    ) -> torch.Tensor:
        """pooled fp32 ``[N, D]`` -> ``RoPE(kv_norm(pooled.to(dtype)))`` in ``dtype`` ``[N, D]``.

        cos/sin fp32 ``[N, rope_dim // 2]`` at the entries' first raw positions ``k*r``; ``impl``
        picks the fused norm + RoPE kernel or its reference.
        """
        return norm_rope(pooled, cos, sin, eps=self.kv_norm.eps, weight=self.kv_norm.weight, dtype=dtype, impl=impl)

    def compress_dense(
        self, rows: torch.Tensor, rotary: nn.Module, dtype: torch.dtype
    ) -> torch.Tensor:
        """All complete entries of one sequence from position 0: rows ``[T, W]`` -> ``[T // r, D]``."""
        n = rows.shape[0] // self.ratio
        if n == 0:
            return rows.new_zeros((0, self.dim), dtype=dtype)
        entries = torch.arange(n, device=rows.device)
        pos = self.window_positions(entries)  # [n, L]
        valid = pos >= 0
        gathered = rows[pos.clamp(min=0)]  # [n, L, W]
        cos, sin = rotary(entries * self.ratio)
        return self.finish(self.pool(gathered, valid), cos, sin, dtype)
