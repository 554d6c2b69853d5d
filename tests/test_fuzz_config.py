"""Fuzz: configs, the backend and the page allocators against generated bad values (NaN/Inf,
zero/negative/huge sizes, wrong types): refused with the field named, never a ZeroDivisionError,
IndexError or RuntimeError."""

from __future__ import annotations

import math

import pytest
import torch
from fuzz_common import Mutation, check_mutation, int_mutations
from hypothesis import HealthCheck

from dsv4attn.backend import DeepseekV4SparseBackend as B
from dsv4attn.config import AttentionConfig, RopeConfig
from dsv4attn.kv_cache.layout import (
    alloc_fp8_ds_mla_cache,
    alloc_indexer_k_cache,
    dequantize_fp8_ds_mla,
    dequantize_indexer_k,
    quantize_fp8_ds_mla,
)
from dsv4attn.kv_cache.specs import CacheConfig

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
NONFINITE = [math.nan, math.inf, -math.inf]


def _floats(arg, positive=False):
    bad = NONFINITE + ([0.0, -1.0] if positive else [])
    return ([Mutation(arg, f"= {b}", lambda v, b=b: b, "refuse") for b in bad]
            + [Mutation(arg, "str", lambda v: "1.0", "refuse"), Mutation(arg, "None", lambda v: None, "refuse")])


ATTN_KW = dict(hidden_size=64, num_heads=4, head_dim=80, rope_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=24,
               window_size=8, index_num_heads=8, index_head_dim=32, index_topk=4, layer_kinds=("sliding", "csa", "hca"),
               compress_ratios=(1, 4, 128), main_rope=RopeConfig(1e4), compress_rope=RopeConfig(1.6e5),
               rms_norm_eps=1e-6, max_position_embeddings=1 << 20)
ATTN_MUTS = (
    [m for name in ("hidden_size", "num_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "window_size",
                    "index_num_heads", "index_head_dim", "index_topk", "max_position_embeddings")
     for m in int_mutations(name, [0, -1])]
    + int_mutations("rope_dim", [-2, 15, 80]) + _floats("rms_norm_eps", positive=True)
    + [Mutation("o_groups", "does not divide heads * head_dim", lambda v: 7, "refuse"),
       Mutation("layer_kinds", "unknown kind", lambda v: ("sliding", "csa", "dense"), "refuse", "layer_kinds[2]"),
       Mutation("layer_kinds", "a str", lambda v: "sliding", "refuse"),
       Mutation("compress_ratios", "str entry", lambda v: (1, "4", 128), "refuse", "compress_ratios[1]"),
       Mutation("compress_ratios", "kind mismatch", lambda v: (4, 4, 128), "refuse", "layer 0"),
       Mutation("compress_ratios", "length mismatch", lambda v: (1, 4), "refuse"),
       Mutation("main_rope", "not a RopeConfig", lambda v: 1e4, "refuse")]
)


@pytest.mark.parametrize("mut", ATTN_MUTS, ids=repr)
def test_fuzz_attention_config(mut):
    check_mutation(AttentionConfig, dict(ATTN_KW), [], mut)


ROPE_MUTS = (_floats("theta", positive=True) + _floats("factor") + _floats("beta_fast") + _floats("beta_slow")
             + _floats("attention_factor")
             + [Mutation("rope_type", "unknown", lambda v: "dynamic", "refuse"),
                Mutation("original_max_position_embeddings", "missing for yarn", lambda v: None, "refuse"),
                Mutation("factor", "zero for yarn", lambda v: 0.0, "refuse", "factor")])


@pytest.mark.parametrize("mut", ROPE_MUTS, ids=repr)
def test_fuzz_rope_config(mut):
    kw = dict(theta=1.6e5, rope_type="yarn", factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0,
              beta_slow=1.0, attention_factor=1.0)
    check_mutation(RopeConfig, kw, [], mut)


CACHE_MUTS = (
    [m for name in ("head_dim", "index_head_dim", "sliding_window", "block_size", "swa_block_size",
                    "c4_state_block_size", "c128_state_block_size") for m in int_mutations(name, [0, -1, 2**31])]
    + [Mutation("compress_ratios", "ratio 16", lambda v: (0, 16), "refuse"),
       Mutation("compress_ratios", "str", lambda v: "0,4", "refuse"),
       Mutation("compress_ratios", "float entry", lambda v: (0, 4.0), "refuse", "compress_ratios[1]"),
       Mutation("kv_cache_dtype", "unknown", lambda v: "fp4", "refuse"),
       Mutation("head_dim", "NoPE not a multiple of 64 on fp8 pages", lambda v: 72, "refuse", "multiple of 64"),
       Mutation("block_size", "not a multiple of 128", lambda v: 192, "refuse", "block_size")]
)


@pytest.mark.parametrize("mut", CACHE_MUTS, ids=repr)
def test_fuzz_cache_config(mut):
    kw = dict(compress_ratios=(0, 4, 128), head_dim=512, rope_dim=64, index_head_dim=128, sliding_window=128,
              block_size=256, swa_block_size=64, c4_state_block_size=4, c128_state_block_size=8,
              kv_cache_dtype="fp8_ds_mla")
    check_mutation(CacheConfig, kw, [], mut)


@pytest.mark.parametrize("args,name", [
    ((0, 64, 1, 512), "num_blocks"), ((4, 0, 1, 512), "block_size"), ((4, 64, 1, -512), "head_size"),
    ((4, 64, 2, 512), "num_kv_heads"), ((4.0, 64, 1, 512), "num_blocks"), ((True, 64, 1, 512), "num_blocks"),
])
def test_fuzz_backend_cache_shape(args, name):
    with pytest.raises((TypeError, ValueError), match=name):
        B.get_kv_cache_shape(*args, "fp8_ds_mla")
    with pytest.raises((TypeError, ValueError), match="cache_dtype_str"):
        B.get_kv_cache_shape(4, 64, 1, 512, "fp4")


@pytest.mark.parametrize("args,name", [((0,), "block_size"), ((-2,), "block_size"), ((64, 0), "head_size"),
                                       ((64, 512, 3), "cache_dtype_str"), ((2**31,), "block_size")])
def test_fuzz_backend_page_size(args, name):
    with pytest.raises((TypeError, ValueError), match=name):
        B.page_size_bytes(*args)


@pytest.mark.parametrize("fn,args,name", [
    (alloc_fp8_ds_mla_cache, (0, 4), "num_blocks"), (alloc_fp8_ds_mla_cache, (2, -1), "block_size"),
    (alloc_fp8_ds_mla_cache, (2.0, 4), "num_blocks"), (alloc_indexer_k_cache, (2, 0), "block_size"),
    (alloc_indexer_k_cache, (2, 4, 0), "index_head_dim"),
    (quantize_fp8_ds_mla, (torch.zeros(0, 4, 512),), "x"), (quantize_fp8_ds_mla, (torch.zeros(2, 4, 512).int(),), "x"),
    (quantize_fp8_ds_mla, (torch.zeros(2, 4, 500),), "head_dim"),
    (dequantize_fp8_ds_mla, (torch.zeros(0, 4, 584, dtype=torch.uint8),), "cache"),
    (dequantize_fp8_ds_mla, (torch.zeros(2, 4, 584, dtype=torch.int8),), "cache"),
    (dequantize_fp8_ds_mla, (torch.zeros(2, 4, 583, dtype=torch.uint8),), "cache"),
    (dequantize_indexer_k, (torch.zeros(2, 4, 132),), "cache"),
    (dequantize_indexer_k, (torch.zeros(9000, dtype=torch.uint8).as_strided((2, 4, 132), (100, 132, 1)),), "cache"),
])
def test_fuzz_page_helpers(fn, args, name):
    with pytest.raises((TypeError, ValueError), match=name):
        fn(*args)


def test_one_block_contiguous_caches_dequantise():
    """A one-block contiguous cache passes validation and works in the dequantisers."""
    x = torch.randn(1, 4, 512)
    padded = quantize_fp8_ds_mla(x)
    flat = torch.zeros(1, 4, 584, dtype=torch.uint8)
    flat.view(-1).copy_(padded.as_strided((4 * 584,), (1,)))
    assert torch.equal(dequantize_fp8_ds_mla(flat), dequantize_fp8_ds_mla(padded))
    k = torch.zeros(1, 4, 132, dtype=torch.uint8)
    assert dequantize_indexer_k(k).shape == (1, 4, 128)
