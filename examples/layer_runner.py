"""One DeepSeek-V4 attention layer serving several requests over paged caches.

    python examples/layer_runner.py
"""

import torch

import dsv4attn
from dsv4attn.serving.tiny import tiny_hf_config

hf_config = tiny_hf_config(compress_ratios=(0, 4, 128))
config = dsv4attn.AttentionConfig.from_hf(hf_config)
layer = dsv4attn.DeepseekV4Attention(config, layer_idx=1)  # the CSA layer (weights: load a state dict)
runner = dsv4attn.AttentionRunner(layer, kv_cache_dtype="auto", num_blocks=16, max_model_len=1024)
a, b = torch.randn(40, config.hidden_size), torch.randn(3, config.hidden_size)
out = runner.step({"a": a[:32], "b": b})  # a prefill chunk and a 3-token prompt in one step
out = runner.step({"a": a[32:], "b": torch.randn(1, config.hidden_size)})  # next chunk + a decode
full = layer(a)  # the cache-free whole-sequence spec
assert torch.allclose(out["a"], full[32:], atol=1e-4 * full.abs().max().item())
runner.free("a")
runner.free("b")
print("layer", layer.kind, "outputs", tuple(out["a"].shape), "match the whole-sequence forward")
