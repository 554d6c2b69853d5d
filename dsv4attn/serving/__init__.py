"""Serving DeepSeek-V4 over the paged backend.

- :class:`PagedAttentionEngine` (``engine``): the per-step API for a stack of attention layers
  (begin a step for {request: new tokens}, run layer i, end the step, free a request); metadata
  built once per step and shared by every layer.
- :class:`AttentionRunner` (``runner``): one layer, ``step({request: hidden rows})``.
- :func:`layer_step` / :class:`LayerCaches` (``paged``): one layer's batched step over its caches.
- :class:`PagedDeepseekV4` (``model``): a transformers ``DeepseekV4ForCausalLM`` with every
  attention module on the engine; greedy ``generate`` with continuous batching.
- Speculative decoding: :class:`Drafter` / :class:`NgramDrafter` (``drafter``), the
  draft-and-verify batcher :class:`SpeculativeBatcher` and its :class:`SpecStats` (``spec``);
  ``generate(..., num_speculative_tokens=k)`` uses them; ``engine.rollback`` / ``commit``.
- Prefix caching: :class:`PrefixCache` / :class:`PrefixCacheStats` (``prefix_cache``) over the
  engine's ``save_prefix`` / ``add_request(request, prefix)`` / ``release_prefix``;
  :class:`PrefixBlob` with ``export_prefix`` / ``import_prefix`` moves a prefix between engines;
  ``PagedDeepseekV4(..., max_cached_prefixes=N)`` turns it on for ``generate``.
- ``cli`` / ``layer_demo`` / ``metadata_demo``: the jobs behind ``python -m dsv4attn`` (``generate``,
  ``layer-demo``, ``metadata-demo``); ``scheduler``, ``graphs``, ``tiny``: see their docstrings.
"""

from dsv4attn.serving.drafter import Drafter, NgramDrafter
from dsv4attn.serving.engine import PagedAttentionEngine, StepPlan
from dsv4attn.serving.model import PagedDeepseekV4, reference_generate
from dsv4attn.serving.paged import LayerCaches, layer_step
from dsv4attn.serving.prefix_cache import PrefixBlob, PrefixCache, PrefixCacheStats
from dsv4attn.serving.runner import AttentionRunner
from dsv4attn.serving.spec import SpecStats, SpeculativeBatcher

__all__ = [
    "AttentionRunner",
    "Drafter",
    "LayerCaches",
    "NgramDrafter",
    "PagedAttentionEngine",
    "PagedDeepseekV4",
    "PrefixBlob",
    "PrefixCache",
    "PrefixCacheStats",
    "SpecStats",
    "SpeculativeBatcher",
    "StepPlan",
    "layer_step",
    "reference_generate",
]
