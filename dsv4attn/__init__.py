"""dsv4attn: the DeepSeek-V4 sparse attention backend (FLASHMLA_SPARSE_DSV4) in Python + Triton.

Public API only. Every op takes ``impl="auto" | "triton" | "reference"`` as its last keyword:
"auto" runs the Triton kernel on capable CUDA devices and the PyTorch reference elsewhere.
"""

from dsv4attn.backend import BACKEND_NAME, DeepseekV4SparseBackend, normalize_kv_cache_dtype
from dsv4attn.config import AttentionConfig, RopeConfig
from dsv4attn.flashmla_compat import flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_metadata
from dsv4attn.kv_cache.accounting import dense_mla_bytes, footprint_table, request_footprint
from dsv4attn.kv_cache.allocator import NULL_BLOCK, BlockPool, KVCacheManager, PoolExhaustedError
from dsv4attn.kv_cache.layout import (
    FP8DSMLALayout,
    alloc_fp8_ds_mla_cache,
    dequantize_fp8_ds_mla,
    quantize_fp8_ds_mla,
)
from dsv4attn.kv_cache.specs import CacheConfig, CacheSpec, GroupSpec, cache_groups, layer_cache_specs, v4_flash_config
from dsv4attn.layers import DeepseekV4Attention
from dsv4attn.metadata.batch import BatchMetadata, split_decodes_and_prefills
from dsv4attn.metadata.builders import (
    CompressedMetadata,
    MetadataConfig,
    StepMetadata,
    StepMetadataBuilder,
    SWAMetadata,
    metadata_bytes_written,
)
from dsv4attn.ops.cache_ops import insert_indexer_k, insert_kv, write_compressor_state
from dsv4attn.ops.candidate_set import CandidateSet
from dsv4attn.ops.metadata import (
    build_c128a_topk_metadata,
    compute_c128a_range_lengths,
    compute_global_topk_indices_and_lens,
    compute_swa_indices_and_lens,
    compute_swa_ranges,
    get_compressed_slot_mapping,
)
from dsv4attn.ops.sparse_attn import sparse_mla_attention
from dsv4attn.serving import AttentionRunner, LayerCaches, layer_step
from dsv4attn.reference.cache_ops import alloc_indexer_k_cache, dequantize_indexer_k

__all__ = [
    "BACKEND_NAME",
    "AttentionConfig",
    "AttentionRunner",
    "BatchMetadata",
    "BlockPool",
    "CacheConfig",
    "CacheSpec",
    "CandidateSet",
    "CompressedMetadata",
    "DeepseekV4Attention",
    "DeepseekV4SparseBackend",
    "FP8DSMLALayout",
    "GroupSpec",
    "KVCacheManager",
    "LayerCaches",
    "MetadataConfig",
    "NULL_BLOCK",
    "PoolExhaustedError",
    "RopeConfig",
    "SWAMetadata",
    "StepMetadata",
    "StepMetadataBuilder",
    "alloc_fp8_ds_mla_cache",
    "alloc_indexer_k_cache",
    "build_c128a_topk_metadata",
    "cache_groups",
    "compute_c128a_range_lengths",
    "compute_global_topk_indices_and_lens",
    "compute_swa_indices_and_lens",
    "compute_swa_ranges",
    "dense_mla_bytes",
    "dequantize_fp8_ds_mla",
    "dequantize_indexer_k",
    "flash_mla_sparse_fwd",
    "flash_mla_with_kvcache",
    "footprint_table",
    "get_compressed_slot_mapping",
    "get_mla_metadata",
    "insert_indexer_k",
    "insert_kv",
    "layer_cache_specs",
    "layer_step",
    "metadata_bytes_written",
    "normalize_kv_cache_dtype",
    "quantize_fp8_ds_mla",
    "request_footprint",
    "sparse_mla_attention",
    "split_decodes_and_prefills",
    "v4_flash_config",
    "write_compressor_state",
]
