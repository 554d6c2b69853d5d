"""Configuration sweep of the paged runner against transformers (fp32): windows 1..200, top-k
1..16, 2..4 heads, several seeds. One quick case runs by default; the rest is marked slow.
Tolerance and tie handling as in test_layer_runner."""

import random

import pytest
import torch

from dsv4attn.config import AttentionConfig
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.serving.runner import AttentionRunner

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
hf_oracle = pytest.importorskip("dsv4attn.testing.hf_oracle")

from test_layer_runner import _close, _interleave  # noqa: E402

CONFIGS = [
    dict(sliding_window=1, index_topk=1),
    dict(sliding_window=200, index_topk=2),
    dict(sliding_window=3, index_topk=16, num_attention_heads=2, o_groups=1),
    dict(sliding_window=16, index_topk=8, index_n_heads=16),
]


def _check(overrides, layer_idx, seed, device):
    hf = hf_oracle.small_hf_config(
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}, **overrides)
    ref = hf_oracle.hf_reference_layer(hf, layer_idx, seed=seed)
    ours = DeepseekV4Attention(AttentionConfig.from_hf(hf), layer_idx)
    ours.load_state_dict(ref.state_dict(), strict=True)
    g = torch.Generator().manual_seed(seed)
    lens = [270, 13, 150] if layer_idx == 2 else [70, 13, 41, 1]
    seqs = {f"s{i}": torch.randn(n, 64, generator=g) for i, n in enumerate(lens)}
    runner = AttentionRunner(ours.to(device), num_blocks=128, device=device, max_model_len=1024,
                             impl="auto" if device.type == "cuda" else "reference")
    got = _interleave(runner, seqs, random.Random(seed), 128 if layer_idx == 2 else 4)
    for k, x in seqs.items():
        _close(got[k], hf_oracle.hf_forward(ref, x), skip=ours.topk_ambiguous(x.to(device)))


def test_window_one_topk_one(device):
    _check(CONFIGS[0], 1, 0, device)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("layer_idx", range(3))
@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_config_sweep(config, layer_idx, seed, device):
    _check(CONFIGS[config], layer_idx, seed, device)
