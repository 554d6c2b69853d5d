"""The DeepSeek-V4 attention layer (all three kinds) and its pieces: compressor, indexer, RoPE,
norms.

- :class:`DeepseekV4Attention`: checkpoint-compatible module; ``forward`` is the cache-free
  whole-sequence spec.

Serving it over paged caches (runner, per-step layer function, model wrapper) lives in
:mod:`dsv4attn.serving`.
"""

from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.layers.indexer import select_topk, topk_boundary_ties

__all__ = [
    "DeepseekV4Attention",
    "select_topk",
    "topk_boundary_ties",
]
