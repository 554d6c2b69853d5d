"""A whole DeepSeek-V4 model over several processes: TP heads and DCP caches in the paged engine.

:class:`ParallelPagedDeepseekV4` is :class:`dsv4attn.serving.model.PagedDeepseekV4` with its
attention engine built for this rank's place (:class:`~dsv4attn.distributed.launch.ParallelContext`):

- TP (``tp > 1``): every attention layer is replaced by its head shard
  (:func:`~dsv4attn.distributed.tp.shard_attention` over the TP group) after the weights are
  loaded; the shards' output all-reduce makes each layer's output whole on every rank;
- DCP (``dcp > 1``): the engine is a :class:`~dsv4attn.distributed.engine.DCPPagedAttentionEngine`
  over the DCP group (metadata once per step, ``dcp_layer_step`` per layer);
- everything but attention (embeddings, hyper-connections, MoE, head) is replicated: every rank
  holds the whole transformers model and computes it on the same rows.

SPMD: every rank calls the same methods with the same arguments (``generate`` with the same
prompts). Outputs are identical on every rank (every layer ends in an all-reduce); ``step``
checks that every rank's greedy token agrees (one all-gather of ``R`` token ids per step) and
raises on every rank otherwise, so the ranks never feed different tokens.

    ctx = init_parallel(ParallelConfig(tp=2))          # under torchrun
    pm = paged_model(hf_model.to(ctx.device), ctx, max_model_len=4096)
    outs = pm.generate(prompts, 16)                     # same on every rank
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dsv4attn.distributed.engine import DCPPagedAttentionEngine
from dsv4attn.distributed.launch import ParallelContext
from dsv4attn.distributed.tp import shard_attention
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.serving.engine import PagedAttentionEngine
from dsv4attn.serving.model import PagedDeepseekV4


class ParallelPagedDeepseekV4(PagedDeepseekV4):
    """:class:`PagedDeepseekV4` for this rank of a TP x DCP world (module doc). ``ctx`` from
    :func:`~dsv4attn.distributed.launch.init_parallel`; the model must be on ``ctx.device``;
    other arguments as the base class (``num_blocks`` / ``memory_bytes`` per rank)."""

    def __init__(self, hf_model: nn.Module, ctx: ParallelContext, **kwargs: Any) -> None:
        if kwargs.get("max_cached_prefixes"):
            raise ValueError("max_cached_prefixes: prefix caching is not supported with --tp/--dcp yet")
        if not isinstance(ctx, ParallelContext):
            raise TypeError(f"ctx must be a ParallelContext (init_parallel), got {type(ctx).__name__}")
        if kwargs.get("num_speculative_tokens"):
            raise ValueError("speculative decoding is not supported with --tp/--dcp yet")
        self.parallel = ctx
        super().__init__(hf_model, **kwargs)
        self.layers = self.engine.layers  # the shards under TP

    def _make_engine(self, layers: list[DeepseekV4Attention], *args: Any, **kwargs: Any) -> PagedAttentionEngine:
        ctx = self.parallel
        ctx.config.check_layer(layers[0].num_heads)
        if ctx.config.tp > 1:
            layers = [shard_attention(layer, ctx.tp_group) for layer in layers]
        if ctx.config.dcp > 1:
            kv = args[0] if args else kwargs.pop("kv_cache_dtype", "auto")
            return DCPPagedAttentionEngine(layers, ctx.dcp_group, interleave=ctx.config.dcp_interleave,
                                           kv_cache_dtype=kv, **kwargs)
        return PagedAttentionEngine(layers, *args, **kwargs)

    def enable_cuda_graphs(self, buckets: Sequence[int] | None = None, capture: bool = True) -> None:
        raise NotImplementedError("CUDA graphs are not supported with --tp/--dcp yet")

    def step(self, tokens: Mapping[Hashable, Sequence[int]]) -> dict[Hashable, torch.Tensor]:
        """As the base class; then every rank's greedy token of every request must agree."""
        out = super().step(tokens)
        if self.parallel.world_size > 1 and out:
            check_greedy_agreement(torch.stack([v.argmax() for v in out.values()]), list(out))
        return out


def check_greedy_agreement(ids: torch.Tensor, requests: Sequence[Hashable], group: Any = None) -> None:
    """All-gather int64 ``ids [R]`` (this rank's greedy tokens) over ``group`` (default: the
    world) and raise ``RuntimeError`` on every rank if any rank differs."""
    ids = ids.to(torch.int64).contiguous()
    parts = [torch.empty_like(ids) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, ids, group=group)
    every = torch.stack(parts).cpu()  # [world, R]
    bad = (every != every[0]).any(dim=0).nonzero().flatten().tolist()
    if bad:
        i = bad[0]
        raise RuntimeError(f"ranks disagree on the greedy token of request {requests[i]!r}: "
                           f"{every[:, i].tolist()} (rank order)")


def paged_model(hf_model: nn.Module, ctx: ParallelContext, **kwargs: Any) -> PagedDeepseekV4:
    """This rank's model server: :class:`ParallelPagedDeepseekV4` when ``ctx`` spans several
    processes, else a plain :class:`PagedDeepseekV4` (keyword arguments of that class)."""
    if ctx.world_size > 1:
        return ParallelPagedDeepseekV4(hf_model, ctx, **kwargs)
    return PagedDeepseekV4(hf_model, **kwargs)
