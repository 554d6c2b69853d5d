"""The package root exports a small API (what engines and other projects' tests import, with
those signatures); everything else is reachable from its subpackage."""

import importlib
import inspect
import logging

import dsv4attn

ROOT = {
    "get_compressed_slot_mapping", "build_c128a_topk_metadata", "get_mla_metadata", "flash_mla_with_kvcache",
    "flash_mla_sparse_fwd", "DeepseekV4SparseBackend", "DeepseekV4MetadataBuilder", "BACKEND_NAME",
    "AttentionConfig", "RopeConfig", "CacheConfig", "DeepseekV4Attention", "AttentionRunner", "PagedDeepseekV4",
    "sparse_mla_attention", "CandidateSet", "__version__",
}

#: Where the rest lives (one home each).
SUBPACKAGES = {
    "dsv4attn.kv_cache.layout": ["FP8DSMLALayout", "IndexerKLayout", "alloc_fp8_ds_mla_cache", "alloc_indexer_k_cache",
                                 "quantize_fp8_ds_mla", "dequantize_fp8_ds_mla", "dequantize_indexer_k",
                                 "normalize_kv_cache_dtype", "state_page_bytes"],
    "dsv4attn.kv_cache.slots": ["entry_slots", "block_slots", "C128A_TOPK_ALIGNMENT"],
    "dsv4attn.kv_cache.specs": ["CacheSpec", "GroupSpec", "cache_groups", "layer_cache_specs", "v4_flash_config",
                                "GROUPS"],
    "dsv4attn.metadata": ["BatchMetadata", "MetadataConfig", "StepMetadata", "StepMetadataBuilder",
                          "split_decodes_and_prefills"],
    "dsv4attn.ops.cache_ops": ["insert_kv", "insert_indexer_k", "write_compressor_state"],
    "dsv4attn.ops.metadata": ["compute_swa_indices_and_lens", "compute_global_topk_indices_and_lens",
                              "compute_swa_ranges", "compute_c128a_range_lengths"],
    "dsv4attn.testing": ["assert_close_rel", "assert_within_reference_error"],
}


def test_root_is_the_small_api():
    assert set(dsv4attn.__all__) == ROOT
    for name in dsv4attn.__all__:
        if name == "PagedDeepseekV4" and not _has_serving_wrapper():
            continue  # the model wrapper arrives with dsv4attn.serving
        assert getattr(dsv4attn, name) is not None, name
    assert isinstance(dsv4attn.__version__, str) and dsv4attn.__version__.count(".") == 2


def _has_serving_wrapper():
    try:
        return hasattr(importlib.import_module("dsv4attn.serving"), "PagedDeepseekV4")
    except ImportError:
        return False


def test_the_rest_lives_in_subpackages():
    for module, names in SUBPACKAGES.items():
        mod = importlib.import_module(module)
        for name in names:
            assert getattr(mod, name) is not None, f"{module}.{name}"


def test_subpackages_say_what_they_hold():
    for module in ("dsv4attn", "dsv4attn.kv_cache", "dsv4attn.metadata", "dsv4attn.ops", "dsv4attn.reference",
                   "dsv4attn.kernels", "dsv4attn.layers", "dsv4attn.testing"):
        doc = importlib.import_module(module).__doc__ or ""
        assert len(doc.split()) >= 20, module


def test_library_logs_to_its_logger():
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("dsv4attn").handlers)


def test_engine_compatible_signatures():
    params = list(inspect.signature(dsv4attn.get_compressed_slot_mapping).parameters)
    assert params[:10] == ["num_tokens", "query_start_loc", "seq_lens", "block_table", "block_size",
                           "compress_ratio", "out", "cp_world_size", "cp_rank", "cp_kv_cache_interleave_size"]
    sig = inspect.signature(dsv4attn.build_c128a_topk_metadata)
    assert list(sig.parameters)[:11] == ["positions", "compress_ratio", "num_decode_tokens", "token_to_req_indices",
                                         "block_table", "block_size", "slot_mapping", "global_decode_buffer",
                                         "decode_lens_buffer", "prefill_buffer", "max_compressed_tokens"]
    assert sig.parameters["max_compressed_tokens"].default == 8192  # the engine's default
    params = list(inspect.signature(dsv4attn.flash_mla_with_kvcache).parameters)
    assert params[:16] == ["q", "k_cache", "block_table", "cache_seqlens", "head_dim_v",
                           "tile_scheduler_metadata", "num_splits", "softmax_scale", "causal",
                           "is_fp8_kvcache", "indices", "attn_sink", "extra_k_cache",
                           "extra_indices_in_kvcache", "topk_length", "extra_topk_length"]
    params = list(inspect.signature(dsv4attn.flash_mla_sparse_fwd).parameters)
    assert params[:7] == ["q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length"]
