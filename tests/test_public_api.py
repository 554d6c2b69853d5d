"""The package root exports what engines and other projects' tests import, with those signatures."""

import inspect

import dsv4attn


def test_all_names_resolve():
    for name in dsv4attn.__all__:
        assert getattr(dsv4attn, name) is not None, name


def test_engine_compatible_signatures():
    params = list(inspect.signature(dsv4attn.get_compressed_slot_mapping).parameters)
    assert params[:10] == ["num_tokens", "query_start_loc", "seq_lens", "block_table", "block_size",
                           "compress_ratio", "out", "cp_world_size", "cp_rank", "cp_kv_cache_interleave_size"]
    params = list(inspect.signature(dsv4attn.build_c128a_topk_metadata).parameters)
    assert params[:11] == ["positions", "compress_ratio", "num_decode_tokens", "token_to_req_indices",
                           "block_table", "block_size", "slot_mapping", "global_decode_buffer",
                           "decode_lens_buffer", "prefill_buffer", "max_compressed_tokens"]
    params = list(inspect.signature(dsv4attn.flash_mla_with_kvcache).parameters)
    assert params[:16] == ["q", "k_cache", "block_table", "cache_seqlens", "head_dim_v",
                           "tile_scheduler_metadata", "num_splits", "softmax_scale", "causal",
                           "is_fp8_kvcache", "indices", "attn_sink", "extra_k_cache",
                           "extra_indices_in_kvcache", "topk_length", "extra_topk_length"]
    params = list(inspect.signature(dsv4attn.flash_mla_sparse_fwd).parameters)
    assert params[:7] == ["q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length"]
