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
