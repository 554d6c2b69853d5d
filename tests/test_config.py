"""AttentionConfig: from_hf against the HF config and rotary tables, validation errors."""

import dataclasses

import pytest
import torch

from dsv4attn.config import AttentionConfig, RopeConfig

hf_oracle = pytest.importorskip("dsv4attn.testing.hf_oracle")
pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


def test_from_hf_schedule_dims_and_rope():
    hf = hf_oracle.small_hf_config()
    cfg = AttentionConfig.from_hf(hf)
    assert cfg.layer_kinds == ("sliding", "csa", "hca")
    assert cfg.compress_ratios == (1, 4, 16)
    assert (cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.rope_dim, cfg.nope_dim) == (64, 4, 80, 16, 64)
    assert (cfg.window_size, cfg.index_num_heads, cfg.index_head_dim, cfg.index_topk) == (8, 8, 32, 4)
    assert (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank) == (32, 2, 24)
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.rope(0) == cfg.main_rope and cfg.main_rope.rope_type == "default"
    assert cfg.rope(1) == cfg.rope(2) == cfg.compress_rope
    assert cfg.compress_rope.rope_type == "yarn" and cfg.compress_rope.attention_factor == 1.0
    assert cfg.main_rope.theta == hf.rope_theta and cfg.compress_rope.theta == hf.compress_rope_theta


def test_rope_tables_equal_reference():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    hf = hf_oracle.small_hf_config()
    cfg = AttentionConfig.from_hf(hf)
    ref = DeepseekV4RotaryEmbedding(hf)
    for label, rope in (("main", cfg.main_rope), ("compress", cfg.compress_rope)):
        torch.testing.assert_close(rope.inv_freq(cfg.rope_dim), getattr(ref, f"{label}_inv_freq"), rtol=0, atol=0)
        assert rope.attention_factor == getattr(ref, f"{label}_attention_scaling")


def test_from_hf_production_defaults():
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    hf = DeepseekV4Config(num_hidden_layers=4, compress_ratios=[0, 4, 128, 4],
                          rope_parameters={"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536})
    cfg = AttentionConfig.from_hf(hf)
    assert cfg.compress_ratios == (1, 4, 128, 4)
    assert (cfg.head_dim, cfg.rope_dim, cfg.window_size, cfg.index_topk) == (512, 64, 128, 512)
    assert cfg.softmax_scale == 512 ** -0.5


def _base(**kw):
    args = dict(hidden_size=64, num_heads=4, head_dim=80, rope_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=24,
                window_size=8, index_num_heads=8, index_head_dim=32, index_topk=4,
                layer_kinds=("sliding", "csa", "hca"), compress_ratios=(1, 4, 128))
    args.update(kw)
    return AttentionConfig(**args)


@pytest.mark.parametrize("kw", [
    dict(layer_kinds=("sliding", "csa", "bogus")),
    dict(compress_ratios=(0, 4, 128)),
    dict(compress_ratios=(1, 1, 128)),
    dict(compress_ratios=(1, 4)),
    dict(rope_dim=80),
    dict(rope_dim=15),
    dict(o_groups=3),
    dict(index_head_dim=16),
    dict(hidden_size=0),
    dict(rms_norm_eps=0.0),
])
def test_validation(kw):
    with pytest.raises(ValueError):
        _base(**kw)


def test_frozen_and_layer_index():
    cfg = _base()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.head_dim = 64
    with pytest.raises(ValueError):
        cfg.layer_kind(3)
    with pytest.raises(ValueError):
        RopeConfig(theta=1e4, rope_type="dynamic")


# ---- every configuration transformers accepts: loads and matches, or is refused by name ----------
PAGED_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
#: What transformers runs that a stricter config used to refuse: heads not divisible by o_groups
#: (only heads * head_dim must be), NoPE dims that are not multiples of 64, small RoPE dims.
ODD_CONFIGS = [
    dict(num_attention_heads=6, o_groups=4),
    dict(num_attention_heads=3, o_groups=2),
    dict(head_dim=72, qk_rope_head_dim=16),
    dict(head_dim=80, qk_rope_head_dim=8),
]


@pytest.mark.parametrize("overrides", ODD_CONFIGS)
def test_odd_configs_match_transformers_dense_and_paged(overrides):
    """fp32 parity (dsv4attn.testing.tolerance): dense path to 1e-5 of the output scale, paged
    runner over "auto" pages (two steps: a prefill chunk, then decodes) to 1e-4."""
    from dsv4attn.layers.attention import DeepseekV4Attention
    from dsv4attn.serving.runner import AttentionRunner
    from dsv4attn.testing import assert_close_rel

    hf = hf_oracle.small_hf_config(compress_rates=PAGED_RATES, **overrides)
    g = torch.Generator().manual_seed(5)
    for layer_idx in range(3):
        ref = hf_oracle.hf_reference_layer(hf, layer_idx, seed=layer_idx)
        ours = DeepseekV4Attention(AttentionConfig.from_hf(hf), layer_idx)
        ours.load_state_dict(ref.state_dict(), strict=True)
        x = torch.randn(260 if layer_idx == 2 else 36, hf.hidden_size, generator=g)
        want = hf_oracle.hf_forward(ref, x)
        assert_close_rel(ours(x), want, 1e-5, skip=ours.topk_ambiguous(x))
        runner = AttentionRunner(ours, kv_cache_dtype="auto", num_blocks=64, max_model_len=1024, impl="reference")
        n = x.shape[0]
        got = torch.cat([runner.step({"a": x[:n - 3]})["a"]] + [runner.step({"a": x[i:i + 1]})["a"] for i in range(n - 3, n)])
        assert_close_rel(got, want, 1e-4, skip=ours.topk_ambiguous(x))


def test_limits_of_the_paged_path_are_named_up_front():
    """fp8 pages quantise NoPE in 64-wide tiles; paged caches serve ratios 4 and 128 (the dense
    layer serves any ratio transformers accepts)."""
    from dsv4attn.kv_cache.specs import CacheConfig
    from dsv4attn.layers.attention import DeepseekV4Attention
    from dsv4attn.serving.runner import AttentionRunner

    hf = hf_oracle.small_hf_config(head_dim=72, qk_rope_head_dim=16, compress_rates=PAGED_RATES)
    layer = DeepseekV4Attention(AttentionConfig.from_hf(hf), 0)
    with pytest.raises(ValueError, match="multiple of 64"):
        AttentionRunner(layer, kv_cache_dtype="fp8_ds_mla", num_blocks=8)
    with pytest.raises(ValueError, match="multiple of 64"):
        CacheConfig(compress_ratios=(4,), head_dim=72, rope_dim=16, kv_cache_dtype="fp8_ds_mla")
    hca16 = DeepseekV4Attention(AttentionConfig.from_hf(hf_oracle.small_hf_config()), 2)
    with pytest.raises(ValueError, match="compress ratios"):
        AttentionRunner(hca16, num_blocks=8)


#: The attention fields of the published DeepSeek-V4-Flash config.json (compress_ratios has one
#: entry per layer plus the MTP layer's, 0).
FLASH_JSON = dict(
    hidden_size=4096, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8,
    o_lora_rank=1024, sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512,
    num_hidden_layers=43, num_nextn_predict_layers=1, rms_norm_eps=1e-6, max_position_embeddings=1048576,
    rope_theta=10000, compress_rope_theta=160000,
    rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                  "type": "yarn"},
    compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0],
)


def test_from_hf_takes_a_config_json_dict():
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    from dsv4attn.kv_cache.specs import CacheConfig

    a = AttentionConfig.from_hf(FLASH_JSON)
    assert a == AttentionConfig.from_hf(DeepseekV4Config(**FLASH_JSON))
    assert a.num_layers == 43 and a.compress_rope.rope_type == "yarn" and a.compress_rope.factor == 16
    assert CacheConfig.from_hf(FLASH_JSON).compress_ratios == tuple(FLASH_JSON["compress_ratios"])
    with pytest.raises(ValueError, match="o_groups"):
        AttentionConfig.from_hf({k: v for k, v in FLASH_JSON.items() if k != "o_groups"})


def test_v4_flash_config_is_the_published_schedule():
    from dsv4attn.kv_cache.specs import v4_flash_config

    assert v4_flash_config().compress_ratios == tuple(FLASH_JSON["compress_ratios"][:43])
    assert v4_flash_config(include_mtp=True).compress_ratios == tuple(FLASH_JSON["compress_ratios"])
    assert v4_flash_config("fp8").kv_cache_dtype == "fp8_ds_mla"
