"""The DeepSeek-V4 attention layer (all three kinds) and its pieces: compressor, indexer, RoPE,
norms; and (until it moves to ``dsv4attn.serving``) the runner.

- :class:`DeepseekV4Attention`: checkpoint-compatible module; ``forward`` is the cache-free
  whole-sequence spec.
- :class:`AttentionRunner`: serves many requests over paged caches, one batched step at a time.
- :func:`layer_step`: one batched step of a layer over given caches and step metadata.
"""

from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.layers.indexer import select_topk, topk_boundary_ties
from dsv4attn.layers.paged import LayerCaches, layer_step
from dsv4attn.layers.runner import AttentionRunner

__all__ = [
    "AttentionRunner",
    "DeepseekV4Attention",
    "LayerCaches",
    "layer_step",
    "select_topk",
    "topk_boundary_ties",
]
