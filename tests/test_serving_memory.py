"""Memory by need: every cache group allocates by its own geometry, and the sizing helpers agree
with what an engine actually allocates and serves.

The V4-Flash check builds the whole 43-layer attention stack on the ``meta`` device (shapes and
byte counts, no memory), serves one 1M-token request and compares the bytes of every cache
tensor with ``request_footprint`` (the accounting). They differ only by the window-bounded
groups' room for in-flight tokens (a 256-token step: ~2%), hence the 5% bound.
"""

import pytest
import torch

from dsv4attn.config import AttentionConfig
from dsv4attn.kv_cache.accounting import (
    max_requests,
    memory_for_requests,
    plan_num_blocks,
    pool_bytes_by_group,
    request_footprint,
)
from dsv4attn.kv_cache.allocator import PoolExhaustedError
from dsv4attn.kv_cache.specs import CacheConfig, v4_flash_config
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.serving.engine import PagedAttentionEngine

KIND = {0: "sliding", 1: "sliding", 4: "csa", 128: "hca"}


def _flash_layers(ratios, device="meta"):
    cfg = AttentionConfig(hidden_size=4096, num_heads=64, head_dim=512, rope_dim=64, q_lora_rank=1024, o_groups=8,
                          o_lora_rank=1024, window_size=128, index_num_heads=64, index_head_dim=128, index_topk=512,
                          layer_kinds=tuple(KIND[r] for r in ratios), compress_ratios=tuple(max(1, r) for r in ratios))
    with torch.device(device):
        return [DeepseekV4Attention(cfg, i).to(torch.bfloat16) for i in range(len(ratios))]


def test_v4_flash_one_million_tokens_allocates_what_the_accounting_says():
    cfg = v4_flash_config("fp8_ds_mla")
    n = 1 << 20
    eng = PagedAttentionEngine(_flash_layers(cfg.compress_ratios), "fp8_ds_mla", device="meta", max_num_reqs=1,
                               max_model_len=n, max_num_batched_tokens=256)
    want = request_footprint(cfg, n).total_bytes
    got = eng.cache_bytes()
    assert abs(got - want) <= 0.05 * want, (got / 2**30, want / 2**30)
    assert eng.num_blocks["full_mla"] == n // 256
    # the whole request fits, prefilled in 256-token steps (block arithmetic only: meta caches)
    m = eng.manager
    m.add_request("r", 0)
    for end in range(256, n + 1, 256):
        m.grow("r", end)
        m.advance("r", end)
    assert m.pools["full_mla"].num_free == 0 and m.num_held("r", "full_mla") == n // 256
    # the old layout (every cache the full block count) would have allocated several times more
    shared = sum(s.page_bytes for g in eng.manager.groups for s in g.caches) * eng.num_blocks["full_mla"]
    assert shared > 3 * want


def test_sizing_helpers_agree_with_the_plan():
    cfg = v4_flash_config("fp8_ds_mla")
    gib = 1 << 30
    for L, T in ((4096, 1), (65536, 256), (1 << 20, 8192)):
        for n in (1, 3, 64):
            need = memory_for_requests(cfg, n, L, T)
            plan = plan_num_blocks(cfg, max_num_reqs=n, max_num_batched_tokens=T, max_model_len=L, memory_bytes=need)
            assert plan["full_mla"] == n * (-(-L // 256))
            assert sum(pool_bytes_by_group(cfg, plan).values()) <= need
        fit = max_requests(cfg, 80 * gib, L, T)
        assert memory_for_requests(cfg, fit, L, T) <= 80 * gib < memory_for_requests(cfg, fit + 1, L, T)
    assert max_requests(cfg, 1000, 4096) == 0
    # one request's share is the accounting's footprint plus in-flight room
    one = memory_for_requests(cfg, 1, 1 << 20, 256)
    assert request_footprint(cfg, 1 << 20).total_bytes <= one <= 1.05 * request_footprint(cfg, 1 << 20).total_bytes
    with pytest.raises(ValueError, match="memory_bytes"):
        plan_num_blocks(cfg, max_num_reqs=256, max_num_batched_tokens=8192, max_model_len=4096, memory_bytes=10**6)
    with pytest.raises(ValueError):
        memory_for_requests(cfg, 0, 10)


def test_engine_serves_exactly_the_requests_it_was_sized_for():
    """memory_bytes = memory_for_requests(N, L): N requests reach L tokens; one token more
    (a new block) is refused with an error that says what to set, and nothing changed."""
    ratios = (0, 4, 128, 4)
    cfg = AttentionConfig(hidden_size=32, num_heads=2, head_dim=128, rope_dim=64, q_lora_rank=16, o_groups=1,
                          o_lora_rank=8, window_size=128, index_num_heads=2, index_head_dim=128, index_topk=8,
                          layer_kinds=tuple(KIND[r] for r in ratios), compress_ratios=tuple(max(1, r) for r in ratios))
    layers = [DeepseekV4Attention(cfg, i) for i in range(len(ratios))]
    cache_cfg = CacheConfig(compress_ratios=ratios, head_dim=128, rope_dim=64, index_head_dim=128,
                            kv_cache_dtype="fp8_ds_mla")
    N, L, T = 3, 768, 64
    eng = PagedAttentionEngine(layers, "fp8_ds_mla", memory_bytes=memory_for_requests(cache_cfg, N, L, T),
                               max_num_reqs=N, max_num_batched_tokens=T, max_model_len=L + T)
    assert eng.num_blocks["full_mla"] == N * 3
    done = {r: 0 for r in range(N)}
    while any(v < L for v in done.values()):
        step = {}
        budget = T
        for r, v in done.items():
            n = min(L - v, budget, 29)
            if n > 0:
                step[r], budget = n, budget - n
        eng.begin_step(step)
        eng.end_step()
        for r, n in step.items():
            done[r] += n
    before = {g: p.num_free for g, p in eng.manager.pools.items()}
    with pytest.raises(PoolExhaustedError, match="num_blocks.*memory_bytes"):
        eng.begin_step({0: 1})
    assert {g: p.num_free for g, p in eng.manager.pools.items()} == before and eng.seq_len(0) == L
