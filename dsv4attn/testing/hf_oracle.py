"""Bridge to the Hugging Face reference (``transformers`` DeepseekV4Attention): the test oracle.

Used by the parity tests and the demo. ``transformers`` is imported lazily (it is a test/demo
dependency only). Nothing here is used on the serving path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def small_hf_config(**overrides: Any) -> Any:
    """A small ``DeepseekV4Config`` with one layer of each kind (sliding, CSA r=4, HCA r=16).

    Defaults: hidden 64, 4 heads, head_dim 80 (= 64 NoPE + 16 RoPE), window 8, 8 indexer heads
    of dim 32, top-k 4, YaRN on the compress table; ``overrides`` replace any field
    (``compress_rates`` and ``compress_ratios`` included). Eager attention is selected.
    """
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    kwargs: dict[str, Any] = dict(
        vocab_size=128, hidden_size=64, num_attention_heads=4, head_dim=80, qk_rope_head_dim=16,
        q_lora_rank=32, o_groups=2, o_lora_rank=24, sliding_window=8, index_n_heads=8,
        index_head_dim=32, index_topk=4, num_hidden_layers=3, compress_ratios=[0, 4, 128],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=1024, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    )
    kwargs.update(overrides)
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    config = DeepseekV4Config(**kwargs)
    config._attn_implementation = "eager"
    return config


def hf_reference_layer(
    hf_config: Any, layer_idx: int, *, seed: int = 0, dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.nn.Module:
    """The reference ``DeepseekV4Attention`` with deterministic random weights of unit-scale activations.

    Linear weights ~ N(0, 1/in_features); norm weights 1 + 0.1 N(0,1); position biases 0.5 N(0,1);
    sinks N(0,1).
    """
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention as HFAttention

    module = HFAttention(hf_config, layer_idx)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("position_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return module.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def hf_forward(module: torch.nn.Module, hidden: torch.Tensor, chunk_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Run the reference layer on ONE sequence ``hidden [T, hidden_size]`` -> ``[T, hidden_size]``.

    ``chunk_sizes=None``: one cache-free call over the whole sequence. Otherwise the sequence is
    fed in chunks of the given sizes (summing to T) through a ``DynamicCache``, as ``generate``
    would, with the model's sliding-window causal mask and per-rope-type position embeddings.
    """
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    config: Any = module.config
    rotary = DeepseekV4RotaryEmbedding(config).to(hidden.device)
    T = hidden.shape[0]
    sizes = [T] if chunk_sizes is None else list(chunk_sizes)
    if sum(sizes) != T or any(s <= 0 for s in sizes):
        raise ValueError(f"chunk_sizes must be positive and sum to {T}, got {sizes}")
    cache = None if chunk_sizes is None else DynamicCache(config=config)
    outs, start = [], 0
    for n in sizes:
        x = hidden[start:start + n][None]
        pos = torch.arange(start, start + n, device=hidden.device)[None]
        mask = create_sliding_window_causal_mask(
            config=config, inputs_embeds=x, attention_mask=None, past_key_values=cache, position_ids=pos,
            layer_idx=int(getattr(module, "layer_idx")),
        )
        emb = {
            "main": rotary(x, position_ids=pos, layer_type="main"),
            "compress": rotary(x, position_ids=pos, layer_type="compress"),
        }
        out, _ = module(x, position_embeddings=emb, position_ids=pos, attention_mask=mask, past_key_values=cache)
        outs.append(out[0])
        start += n
    return torch.cat(outs, dim=0)
