"""dsv4attn: the DeepSeek-V4 sparse attention backend (FLASHMLA_SPARSE_DSV4) in Python + Triton.

The package root holds the small API most users need; everything else lives in subpackages:

=========================  =====================================================================
``dsv4attn``               engine-compatible functions, the backend, the configs, the layer, the
                           runner / model wrapper, the sparse-attention op
``dsv4attn.kv_cache``      page formats (``layout``), the slot formula (``slots``), cache specs
                           and groups (``specs``), block allocator, memory accounting
``dsv4attn.metadata``      per-step batch description and builders (``BatchMetadata``,
                           ``StepMetadataBuilder``, ``MetadataConfig``)
``dsv4attn.ops``           public ops: validate -> allocate -> dispatch (cache writers, metadata,
                           sparse attention)
``dsv4attn.reference``     plain-PyTorch executable spec of every op
``dsv4attn.kernels``       Triton kernels (@triton.jit only) and shared Triton helpers
``dsv4attn.layers``        the DeepSeek-V4 attention layer and its pieces (compressor, indexer,
                           RoPE, norms)
``dsv4attn.serving``       runner, paged step, model wrapper (when installed from this tree)
``dsv4attn.testing``       test oracles (transformers) and tolerance rules
=========================  =====================================================================

Every op takes ``impl="auto" | "triton" | "reference"`` as its last keyword: "auto" runs the
Triton kernel on capable CUDA devices and the PyTorch reference elsewhere. Library code logs to
the ``dsv4attn`` logger and never prints.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from dsv4attn.backend import BACKEND_NAME, DeepseekV4MetadataBuilder, DeepseekV4SparseBackend
from dsv4attn.config import AttentionConfig, RopeConfig
from dsv4attn.flashmla_compat import flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_metadata
from dsv4attn.kv_cache.specs import CacheConfig
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.ops.candidate_set import CandidateSet
from dsv4attn.ops.metadata import build_c128a_topk_metadata, get_compressed_slot_mapping
from dsv4attn.ops.sparse_attn import sparse_mla_attention

__version__ = "0.2.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

#: Serving names resolved on first use from ``dsv4attn.serving`` (or, in trees that predate it,
#: ``dsv4attn.layers``), so the root does not import the serving stack eagerly.
_SERVING = ("AttentionRunner", "PagedDeepseekV4")


def __getattr__(name: str) -> Any:
    if name in _SERVING:
        for module in ("dsv4attn.serving", "dsv4attn.layers"):
            try:
                value = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                continue
            globals()[name] = value
            return value
        raise AttributeError(f"dsv4attn.{name} is not available in this build")
    raise AttributeError(f"module 'dsv4attn' has no attribute {name!r}")


__all__ = [
    "BACKEND_NAME",
    "AttentionConfig",
    "AttentionRunner",
    "CacheConfig",
    "CandidateSet",
    "DeepseekV4Attention",
    "DeepseekV4MetadataBuilder",
    "DeepseekV4SparseBackend",
    "PagedDeepseekV4",
    "RopeConfig",
    "__version__",
    "build_c128a_topk_metadata",
    "flash_mla_sparse_fwd",
    "flash_mla_with_kvcache",
    "get_compressed_slot_mapping",
    "get_mla_metadata",
    "sparse_mla_attention",
]
