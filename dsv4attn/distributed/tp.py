"""Tensor parallelism over the query heads of one DeepSeek-V4 attention layer.

Rank ``r`` of ``world`` owns the contiguous heads ``[r * H/w, (r + 1) * H/w)`` (any ``w`` that
divides ``H``; no padding of the head count). What each rank holds:

- sharded: the rows of ``q_b_proj`` that produce its heads, their ``sinks``, and the part of
  the grouped output projection that reads them: for every output group ``g`` its heads touch,
  the ``o_a_proj`` block of group ``g`` restricted to the columns of those heads, and the
  ``o_b_proj`` columns of group ``g``;
- replicated (every rank computes them, as the engines do for the single shared K = V head):
  ``q_a_proj``/``q_a_norm`` (the indexer reads ``qr``), ``kv_proj``/``kv_norm``, the compressor and
  the indexer, and therefore every KV cache.

The output projection is linear (``o_b(o_a(x))``, no norm in between), so each rank's projection
of its own heads is a partial sum of the full output: one all-reduce (sum) after ``o_b_proj``
gives the single-process result. When ``w`` divides ``o_groups`` each rank owns whole groups;
otherwise a group split between ranks contributes a partial ``o_a`` sum from each of them, which
the same all-reduce completes.

:class:`TPAttention` is a :class:`DeepseekV4Attention`, so every path that runs a layer (the
dense ``forward``, ``layer_step``, ``AttentionRunner``) runs the shard unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.ops.norm_rope import norm_rope
from dsv4attn.serving.runner import AttentionRunner


def tp_head_range(num_heads: int, world_size: int, rank: int) -> tuple[int, int]:
    """Heads ``[h0, h1)`` owned by ``rank``; ``ValueError`` unless ``world_size`` divides ``num_heads``."""
    for name, v in (("num_heads", num_heads), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if num_heads % world_size:
        raise ValueError(f"tensor parallelism needs a world size that divides num_heads={num_heads}, "
                         f"got world_size={world_size}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
    per = num_heads // world_size
    return rank * per, (rank + 1) * per


def output_segments(num_heads: int, o_groups: int, h0: int, h1: int) -> list[tuple[int, int, int]]:
    """The output groups heads ``[h0, h1)`` touch: ``(group, first_head, end_head)`` per group,
    heads clipped to the group (global head ids)."""
    per_group = num_heads // o_groups
    return [(g, max(h0, g * per_group), min(h1, (g + 1) * per_group))
            for g in range(h0 // per_group, (h1 - 1) // per_group + 1)]


class ShardedGroupedLinear(nn.Module):
    """The rank's part of the grouped ``o_a_proj``: x ``[T, heads * D]`` (the rank's heads, flat)
    -> ``[T, num_segments * o_lora_rank]``, segment s = ``x[:, cols_s] @ weight_s^T``.

    Segments of equal width (always when the world size divides ``o_groups`` or ``o_groups``
    divides it) run as one batched product; unequal ones one product each.
    """

    def __init__(self, blocks: list[torch.Tensor]) -> None:
        super().__init__()
        widths = [b.shape[1] for b in blocks]
        self.widths = widths
        self.uniform = len(set(widths)) == 1
        if self.uniform:
            self.weight = nn.Parameter(torch.stack(blocks))  # [S, L, width]
        else:
            self.blocks = nn.ParameterList(nn.Parameter(b) for b in blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uniform:
            S, _, width = self.weight.shape
            return torch.einsum("tsi,soi->tso", x.reshape(x.shape[0], S, width), self.weight).flatten(1)
        outs, c = [], 0
        for w, b in zip(self.widths, self.blocks):
            outs.append(x[:, c:c + w] @ b.t())
            c += w
        return torch.cat(outs, dim=1)


class TPAttention(DeepseekV4Attention):
    """One rank's shard of a :class:`DeepseekV4Attention` (see the module doc).

    Built by :func:`shard_attention`. ``num_heads`` is the rank's head count; ``config`` stays
    the full layer's (cache geometry, softmax scale and the indexer do not change). With a
    ``group``, :meth:`project_out` all-reduces the output over it; with ``group=None`` it returns
    this rank's partial sum (the sum over ranks is the layer's output).
    """

    def __init__(self, layer: DeepseekV4Attention, rank: int, world_size: int, group: Any = None) -> None:
        if not isinstance(layer, DeepseekV4Attention):
            raise TypeError(f"layer must be a DeepseekV4Attention, got {type(layer).__name__}")
        if isinstance(layer, TPAttention):
            raise TypeError("layer is already a tensor-parallel shard; shard the full layer")
        cfg = layer.config
        h0, h1 = tp_head_range(cfg.num_heads, world_size, rank)
        nn.Module.__init__(self)
        D, L = cfg.head_dim, cfg.o_lora_rank
        self.config, self.layer_idx, self.kind, self.ratio = cfg, layer.layer_idx, layer.kind, layer.ratio
        self.num_heads, self.head_dim = h1 - h0, D
        self.tp_rank, self.tp_world_size, self.tp_group = rank, world_size, group
        self.head_range = (h0, h1)
        # replicated (shared with the full layer: same objects)
        self.q_a_proj, self.q_a_norm = layer.q_a_proj, layer.q_a_norm
        self.kv_proj, self.kv_norm = layer.kv_proj, layer.kv_norm
        self.rotary, self.compressor = layer.rotary, layer.compressor
        # sharded (copies: the full layer's large weights can be dropped)
        with torch.no_grad():
            w = layer.q_b_proj.weight
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.num_heads * D, bias=False,
                                      device=w.device, dtype=w.dtype)
            self.q_b_proj.weight.copy_(w[h0 * D:h1 * D])
            self.sinks = nn.Parameter(layer.sinks.detach()[h0:h1].clone())
            per_group = cfg.num_heads // cfg.o_groups
            wa = layer.o_a_proj.weight.view(cfg.o_groups, L, per_group * D)
            segs = output_segments(cfg.num_heads, cfg.o_groups, h0, h1)
            self.segments = segs
            # the rank's segments of the grouped projection (same call contract as GroupedLinear)
            self.o_a_proj = ShardedGroupedLinear(  # type: ignore[assignment]
                [wa[g, :, (a - g * per_group) * D:(b - g * per_group) * D].clone() for g, a, b in segs])
            wb = layer.o_b_proj.weight  # [hidden, G * L]
            self.o_b_proj = nn.Linear(len(segs) * L, cfg.hidden_size, bias=False, device=wb.device, dtype=wb.dtype)
            self.o_b_proj.weight.copy_(torch.cat([wb[:, g * L:(g + 1) * L] for g, _, _ in segs], dim=1))

    def project_out(
        self, attn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: str = "reference"
    ) -> torch.Tensor:
        """attn ``[T, heads, D]`` (this rank's heads) -> ``[T, hidden]``: inverse RoPE (in place, as
        the base class), the rank's grouped ``o_a``/``o_b`` part, then the all-reduce over
        ``tp_group`` (if any)."""
        attn = norm_rope(attn, cos, sin, inverse=True, out=attn, impl=impl)
        out = self.o_b_proj(self.o_a_proj(attn.reshape(attn.shape[0], -1))).contiguous()
        if self.tp_group is not None and self.tp_world_size > 1:
            dist.all_reduce(out, group=self.tp_group)
        return out


def _group_rank_size(group: Any) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group given but torch.distributed is not initialized (call init_process_group "
                         "or dsv4attn.distributed.launch.init_parallel first)")
    return dist.get_rank(group), dist.get_world_size(group)


def shard_attention(layer: DeepseekV4Attention, group: Any = None, *, rank: int | None = None,
                    world_size: int | None = None) -> TPAttention:
    """The shard of ``layer`` for this process's rank in ``group``.

    ``group``: a ``torch.distributed`` process group (``dist.group.WORLD`` for all ranks); rank
    and size come from it and the output is all-reduced over it. Without a group, give
    ``rank`` and ``world_size``: the shard then returns its partial output (no communication),
    which is how a single process checks the split. The layer must be on this rank's device.
    """
    if group is not None:
        g_rank, g_size = _group_rank_size(group)
        if (rank is not None and rank != g_rank) or (world_size is not None and world_size != g_size):
            raise ValueError(f"rank/world_size ({rank}, {world_size}) contradict the group's ({g_rank}, {g_size})")
        rank, world_size = g_rank, g_size
    elif rank is None or world_size is None:
        raise ValueError("give a process group, or rank and world_size for a communication-free shard")
    return TPAttention(layer, rank, world_size, group)


class TPAttentionRunner(AttentionRunner):
    """:class:`AttentionRunner` over this rank's head shard of ``layer`` (outputs all-reduced).

    Every rank of ``group`` must call :meth:`step` with the same chunks in the same order (SPMD);
    every rank returns the full output. Caches are replicated (one K = V head). Keyword arguments
    are those of :class:`AttentionRunner`.
    """

    def __init__(self, layer: DeepseekV4Attention, group: Any = None, **kwargs: Any) -> None:
        if group is None:
            group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if group is None:
            raise ValueError("TPAttentionRunner needs an initialized torch.distributed process group")
        super().__init__(shard_attention(layer, group), **kwargs)
