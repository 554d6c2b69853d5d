"""Small random DeepSeek-V4 models built with transformers (tests, ``--tiny``, examples).

``tiny_hf_model(seed, ...)`` returns a transformers ``DeepseekV4ForCausalLM`` with every module
of the real architecture (hyper-connections, hash and learned MoE routing, sinks, CSA indexer,
compressors) at toy sizes, with weights drawn so activations stay unit-scale and greedy
decoding does not collapse to one repeated token (transformers' own init, std 0.02 everywhere
and zero sinks/biases, gives a nearly constant model). Eager attention is selected (the only
transformers path with sinks), so the model is directly usable as the oracle.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch

#: Layer schedule of the default tiny model: 0 = sliding, 4 = CSA, 128 = HCA.
TINY_RATIOS = (0, 4, 128, 4, 128, 0)


def tiny_hf_config(num_layers: int | None = None, compress_ratios: tuple[int, ...] = TINY_RATIOS, **overrides: Any):
    """A small ``DeepseekV4Config``: hidden 64, 4 heads x 80 (64 NoPE + 16 RoPE), window 8,
    indexer 8 heads x 32 top-k 4, 4 routed experts (2 per token), vocab 256."""
    import logging

    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    ratios = list(compress_ratios) if num_layers is None else [compress_ratios[i % len(compress_ratios)]
                                                                for i in range(num_layers)]
    kwargs: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, num_attention_heads=4, head_dim=80, qk_rope_head_dim=16,
        q_lora_rank=32, o_groups=2, o_lora_rank=24, sliding_window=8, index_n_heads=8, index_head_dim=32,
        index_topk=4, num_hidden_layers=len(ratios), compress_ratios=ratios,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        max_position_embeddings=4096, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        intermediate_size=64, attn_implementation="eager",
    )
    kwargs.update(overrides)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return DeepseekV4Config(**kwargs)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Redraw every parameter deterministically: matrices ~ N(0, 1/fan_in), norm weights
    1 + 0.1 N, position biases 0.5 N, sinks N(0, 1), embeddings N(0, 1), hyper-connection
    scales/bases 0.5 N, hash-routing tables uniform over the experts."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if p.dim() >= 2 and "embed_tokens" in name:
            v = torch.randn(p.shape, generator=gen)
        elif p.dim() >= 2:
            v = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            v = 1 + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith("position_bias") or name.endswith("sinks"):
            v = torch.randn(p.shape, generator=gen) * (0.5 if name.endswith("position_bias") else 1.0)
        else:  # hc base / scale, router biases
            v = 0.5 * torch.randn(p.shape, generator=gen)
        p.copy_(v.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            num_experts: int = cast(Any, model).config.n_routed_experts  # a transformers model's config
            rows = [torch.randperm(num_experts, generator=gen)[: b.shape[1]] for _ in range(b.shape[0])]
            b.copy_(torch.stack(rows).to(b.dtype))
    return model


def tiny_hf_model(seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                  **config_overrides: Any):
    """A random tiny ``DeepseekV4ForCausalLM`` (see :func:`tiny_hf_config`), eval mode, eager attention."""
    from transformers import DeepseekV4ForCausalLM

    config = tiny_hf_config(**config_overrides)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config)
    randomize_(model, seed)
    model.generation_config.eos_token_id = None  # random weights: generate exactly max_new_tokens
    # transformers declares PreTrainedModel.to with functools.wraps(nn.Module.to): mypy sees the unbound signature
    return model.to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]


def tiny_attention_layers(seed: int, ratios: tuple[int, ...] = (0, 4, 128), dtype: torch.dtype = torch.bfloat16,
                          device: torch.device | str = "cuda") -> list:
    """One randomized ``DeepseekV4Attention`` per entry of ``ratios`` (tiny config, top-k 8) on
    ``device`` in ``dtype``: the layers the engine and graph tests drive without a whole model."""
    from dsv4attn.config import AttentionConfig
    from dsv4attn.layers.attention import DeepseekV4Attention

    cfg = AttentionConfig.from_hf(tiny_hf_config(compress_ratios=ratios, index_topk=8))
    layers = []
    for i in range(len(ratios)):
        layer = DeepseekV4Attention(cfg, i)
        randomize_(layer, seed + i)
        layers.append(layer.to(device=device, dtype=dtype).eval())
    return layers

