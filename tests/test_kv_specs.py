"""Cache specs and accounting: the production table of dsv4-system.md 3.2, layer ownership,
groups of V4-Flash, small-config scaling and the 1M-token footprint."""

from __future__ import annotations

import pytest
import torch

from dsv4attn.kv_cache.accounting import (
    DENSE_BF16_BYTES,
    dense_mla_bytes,
    footprint_table,
    request_footprint,
)
from dsv4attn.kv_cache.specs import (
    CacheConfig,
    cache_groups,
    compressor_coff,
    layer_cache_specs,
    state_row_width,
    state_window,
    v4_flash_config,
)


def by_name(specs):
    return {s.name: s for s in specs}


def test_production_table():
    cfg = CacheConfig(compress_ratios=(0, 4, 128))
    assert [s.name for s in layer_cache_specs(cfg, 0)] == ["swa_kv"]
    c4 = by_name(layer_cache_specs(cfg, 1))
    assert set(c4) == {"swa_kv", "compressed_kv", "indexer_k", "compressor_state", "indexer_compressor_state"}
    c128 = by_name(layer_cache_specs(cfg, 2))
    assert set(c128) == {"swa_kv", "compressed_kv", "compressor_state"}
    # (tokens per block-table column, stored entries per block, bytes/entry, padded page)
    rows = {
        ("swa_kv", 1): (64, 64, 584, 37440),
        ("compressed_kv", 1): (256, 64, 584, 37440),
        ("indexer_k", 1): (256, 64, 132, 8640),
        ("compressor_state", 1): (4, 4, 8192, 32832),
        ("indexer_compressor_state", 1): (4, 4, 2048, 8640),
        ("compressed_kv", 2): (256, 2, 584, 1728),
        ("compressor_state", 2): (8, 8, 4096, 32832),
    }
    for (name, layer), want in rows.items():
        s = by_name(layer_cache_specs(cfg, layer))[name]
        assert (s.tokens_per_block, s.block_size, s.entry_bytes, s.page_bytes) == want, name
    assert c4["compressor_state"].row_shape == (2048,) and c128["compressor_state"].row_shape == (1024,)
    assert (state_window(4), state_window(128), compressor_coff(4), compressor_coff(128)) == (8, 128, 2, 1)


def test_auto_dtype_and_small_dims():
    cfg = CacheConfig(compress_ratios=(4,), head_dim=128, rope_dim=64, index_head_dim=32, kv_cache_dtype="auto")
    s = by_name(layer_cache_specs(cfg, 0))
    assert s["swa_kv"].row_shape == (128,) and s["swa_kv"].page_bytes == 64 * 256
    assert s["indexer_k"].entry_bytes == 64 and s["indexer_k"].dtype == "bfloat16"
    assert s["compressor_state"].row_shape == (state_row_width(4, 128),) == (512,)
    fp8 = by_name(layer_cache_specs(CacheConfig(compress_ratios=(4,), head_dim=128, index_head_dim=32), 0))
    # (64 nope + 64 rope) layout: 64 + 128 data bytes + 8 scale bytes, pages aligned to 192.
    assert fp8["swa_kv"].entry_bytes == 200 and fp8["swa_kv"].page_bytes % 192 == 0
    assert fp8["indexer_k"].entry_bytes == 36


def test_v4_flash_groups():
    cfg = v4_flash_config()
    assert cfg.num_layers == 43
    assert sum(r == 4 for r in cfg.compress_ratios) == 21 and sum(r == 128 for r in cfg.compress_ratios) == 20
    groups = {g.name: g for g in cache_groups(cfg)}
    assert len(groups["swa"].caches) == 43
    assert len(groups["full_mla"].caches) == 21 * 2 + 20
    assert len(groups["c4_state"].caches) == 42 and len(groups["c128_state"].caches) == 20
    assert (groups["swa"].window, groups["c4_state"].window, groups["c128_state"].window) == (128, 8, 128)
    assert groups["full_mla"].kind == "full" and groups["full_mla"].tokens_per_block == 256


def test_from_hf_config():
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV4Config(num_hidden_layers=4, compress_ratios=[0, 4, 128, 4])
    cfg = CacheConfig.from_hf(hf)
    assert cfg.compress_ratios == (1, 4, 128, 4)
    assert (cfg.head_dim, cfg.rope_dim, cfg.index_head_dim, cfg.sliding_window) == (512, 64, 128, 128)
    assert CacheConfig.from_hf({"compress_ratios": [0, 4]}).compress_ratios == (0, 4)


def test_bad_config():
    with pytest.raises(ValueError, match="compress_ratios"):
        CacheConfig(compress_ratios=(2,))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="nope_dim"):
        CacheConfig(head_dim=100)


def test_v4_flash_footprint_at_1m():
    cfg = v4_flash_config()
    n = 1 << 20
    fp = request_footprint(cfg, n)
    caches = fp.by_cache()
    # 21 C4A layers x 4096 blocks x 37,440 B + 20 C128A layers x 4096 x 1,728 B.
    assert caches["compressed_kv"] == 4096 * (21 * 37440 + 20 * 1728)
    assert caches["indexer_k"] == 4096 * 21 * 8640
    # SWA: the next token sees 128 positions -> 2 blocks of 64 (window end is block aligned).
    assert caches["swa_kv"] == 43 * 2 * 37440
    assert fp.total_bytes < dense_mla_bytes(43, n) / 6
    assert dense_mla_bytes(43, n, DENSE_BF16_BYTES) == 43 * n * 1024
    assert "dense MLA bf16" in footprint_table(cfg)


def test_allocate_matches_writer_views():
    """Every spec allocates the view its writer expects (padded block stride included)."""
    from dsv4attn.kv_cache.layout import check_fp8_ds_mla_cache, layout_for_head_dim
    from dsv4attn.ops.cache_ops import insert_indexer_k, insert_kv, write_compressor_state

    for dtype in ("fp8_ds_mla", "auto"):
        cfg = CacheConfig(compress_ratios=(4, 128), kv_cache_dtype=dtype)
        for layer in range(2):
            for spec in layer_cache_specs(cfg, layer):
                t = spec.allocate(3, fill=0)
                assert t.shape == (3, spec.block_size, *spec.row_shape)
                assert t.stride(0) * t.element_size() == spec.page_bytes
                slots = torch.tensor([0, 3 * spec.block_size - 1])
                if spec.name in ("swa_kv", "compressed_kv"):
                    if dtype == "fp8_ds_mla":
                        check_fp8_ds_mla_cache("t", t, layout_for_head_dim(512, 64))
                    insert_kv(torch.ones(2, 512), slots, t, dtype)
                elif spec.name == "indexer_k":
                    insert_indexer_k(torch.ones(2, 128), slots, t, dtype)
                else:
                    w = spec.row_shape[0] // 2
                    write_compressor_state(torch.ones(2, w), torch.ones(2, w), torch.zeros(spec.compress_ratio, w),
                                           slots, slots, t)
