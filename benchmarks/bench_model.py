"""Benchmark of a V4-Flash-shaped model served over the paged backend (issue "Serve a whole model").

Model: V4-Flash attention (hidden 4096, 64 heads x 512 = 448 + 64, q_lora 1024, o_groups 8 x
1024, window 128, indexer 64 x 128 top-k 512, compress ratios 4 / 128), random bf16 weights,
fp8_ds_mla caches, ``--layers`` layers of each kind (sliding, CSA, HCA).

Tables:
1. Decode step per layer, B in {64, 256} x context in {4K, 64K}: eager (the dynamic layer step)
   and CUDA-graph replay (the static step captured per bucket), against the layer's floor. The
   contexts are put in place by the block manager (cache contents random-free zeros: timing
   only), so no prefill of 16M tokens is needed. Also the per-step host work (block tables +
   metadata, once per step for all layers).
2. Prefill of one 8K-token request, per layer.
3. ``generate`` throughput (new tokens/s) of a whole transformers DeepseekV4ForCausalLM with
   these attention dims (small MoE and vocabulary) at B=256, eager and with decode graphs.

Floor per layer and step: flops = 2 * tokens * (projection weights) + 4 * tokens * h * 512 * N
(+ indexer scoring 2 * tokens * ctx/4 * 64 * 128 on CSA); bytes = weights + tokens * N * 584
(+ indexer keys tokens * ctx/4 * 132 on CSA); N = attended entries per token.

    python -m benchmarks.bench_model            # H200
    python -m benchmarks.bench_model --small    # toy sizes on CPU (checks the script runs)
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import Row, base_parser, median_us, print_table, serving_setup
from dsv4attn.config import AttentionConfig
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.serving.engine import PagedAttentionEngine
from dsv4attn.serving.paged import layer_step

ENTRY_BYTES, INDEXER_BYTES = 584, 132
KIND_RATIO = {"sliding": 1, "csa": 4, "hca": 128}


def flash_config(kinds: tuple[str, ...], small: bool) -> AttentionConfig:
    ratios = tuple(KIND_RATIO[k] for k in kinds)
    if small:
        return AttentionConfig(hidden_size=64, num_heads=4, head_dim=80, rope_dim=16, q_lora_rank=32, o_groups=2,
                               o_lora_rank=16, window_size=128, index_num_heads=4, index_head_dim=32, index_topk=16,
                               layer_kinds=kinds, compress_ratios=ratios)
    return AttentionConfig(hidden_size=4096, num_heads=64, head_dim=512, rope_dim=64, q_lora_rank=1024, o_groups=8,
                           o_lora_rank=1024, window_size=128, index_num_heads=64, index_head_dim=128, index_topk=512,
                           layer_kinds=kinds, compress_ratios=ratios)


def make_layers(cfg: AttentionConfig, dev: torch.device, dtype: torch.dtype) -> list[DeepseekV4Attention]:
    layers = []
    for i in range(cfg.num_layers):
        layer = DeepseekV4Attention(cfg, i)
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else
                        torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        layers.append(layer.to(device=dev, dtype=dtype).eval())
    return layers


def floor_row(cfg: AttentionConfig, layer: DeepseekV4Attention, case: str, us: float, tokens: int, ctx: int,
              extra: dict) -> Row:
    weights = sum(p.numel() for n, p in layer.named_parameters() if n.endswith("proj.weight"))
    wbytes = 2 * sum(p.numel() for p in layer.parameters())
    n = min(ctx, cfg.window_size)
    flops = 2 * tokens * weights
    nbytes = wbytes
    if layer.kind == "csa":
        n += min(ctx // 4, cfg.index_topk)
        flops += 2 * tokens * (ctx // 4) * cfg.index_num_heads * cfg.index_head_dim
        nbytes += tokens * (ctx // 4) * INDEXER_BYTES
    elif layer.kind == "hca":
        n += ctx // 128
    flops += 4 * tokens * cfg.num_heads * cfg.head_dim * n
    nbytes += tokens * n * ENTRY_BYTES
    return Row(case, us, flops=flops, bytes=nbytes, extra=extra)


def put_contexts(eng: PagedAttentionEngine, batch: int, ctx: int) -> None:
    """Requests 0..batch-1 at ``ctx`` computed tokens (blocks only; timing does not need content)."""
    step = eng.max_num_batched_tokens  # what the window-bounded pools are sized for
    for r in range(batch):
        eng.manager.add_request(r, 0)
        for end in [*range(step, ctx, step), ctx]:  # sliding groups release as they go
            eng.manager.grow(r, end)
            eng.manager.advance(r, end)


def decode_engine(layers, dev, batch: int, ctx: int, room: int = 64, step_tokens: int = 256,
                  **kwargs) -> PagedAttentionEngine:
    """An fp8_ds_mla engine over ``layers`` with requests 0..batch-1 at ``ctx`` computed tokens
    and blocks for ``room`` more tokens each (steps of up to ``max(batch, step_tokens)`` tokens;
    ``kwargs`` go to the engine)."""
    eng = PagedAttentionEngine(layers, "fp8_ds_mla", num_blocks=batch * (-(-(ctx + room) // 256)) + 4, device=dev,
                               max_num_batched_tokens=max(batch, step_tokens), max_model_len=ctx + room,
                               max_num_reqs=batch, **kwargs)
    put_contexts(eng, batch, ctx)
    return eng


def decode_rows(cfg, layers, dev, batch, ctx, graphs: bool) -> list[Row]:
    eng = decode_engine(layers, dev, batch, ctx)
    step = {r: 1 for r in range(batch)}
    hs = cfg.hidden_size
    x = torch.randn(batch, hs, device=dev, dtype=layers[0].sinks.dtype)
    host_us = median_us(lambda: (eng.begin_step(step), eng.abort_step()))
    plan = eng.begin_step(step)
    states = [plan.state(layer.ratio) for layer in layers]
    eager = [median_us(lambda i=i: layer_step(layers[i], x, plan.metadata, eng.builder, eng.caches[i], states[i][0],
                                              impl=eng.impl, state_positions=states[i][1]))
             for i in range(len(layers))]
    eng.abort_step()
    replay = [float("nan")] * len(layers)
    if graphs:
        eng.enable_cuda_graphs(buckets=(batch,), capture=dev.type == "cuda")
        plan = eng.begin_step(step)
        g = eng.graphs
        g.inputs[batch].copy_(x)
        if dev.type == "cuda":
            replay = [median_us(g.graphs[(i, batch)].replay) for i in range(len(layers))]
        else:
            replay = [median_us(lambda i=i: g._eager(i, batch, g.inputs[batch])) for i in range(len(layers))]
        eng.abort_step()
    rows = []
    for i, layer in enumerate(layers):
        for mode, us in (("eager", eager[i]), ("graph" if dev.type == "cuda" else "static", replay[i])):
            if us != us:  # nan: not measured
                continue
            rows.append(floor_row(cfg, layer, f"L{i} {layer.kind} decode B={batch} ctx={ctx} {mode}", us, batch, ctx,
                                  {"host us/step": f"{host_us:.0f}", "tok/s": f"{batch / (us * 1e-6):.0f}"}))
    eng.graphs = None
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def prefill_rows(cfg, layers, dev, c: int) -> list[Row]:
    eng = PagedAttentionEngine(layers, "fp8_ds_mla", num_blocks=-(-c // 256) + 4, device=dev,
                               max_num_batched_tokens=c, max_model_len=c, max_num_reqs=1)
    x = torch.randn(c, cfg.hidden_size, device=dev, dtype=layers[0].sinks.dtype)
    plan = eng.begin_step({0: c})
    rows = []
    for i, layer in enumerate(layers):
        st, sp = plan.state(layer.ratio)
        us = median_us(lambda i=i, layer=layer, st=st, sp=sp: layer_step(layer, x, plan.metadata, eng.builder,
                                                                         eng.caches[i], st, impl=eng.impl,
                                                                         state_positions=sp))
        rows.append(floor_row(cfg, layer, f"L{i} {layer.kind} prefill {c}", us, c, c // 2,
                              {"tok/s": f"{c / (us * 1e-6):.0f}"}))
    eng.abort_step()
    return rows


def generate_rows(args, dev, dtype) -> list[Row]:
    from dsv4attn.serving.model import PagedDeepseekV4
    from dsv4attn.serving.tiny import tiny_hf_model

    kinds = [0, 0] + [4, 128] * args.layers
    dims = {} if args.small else dict(
        hidden_size=4096, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8,
        o_lora_rank=1024, sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512,
        vocab_size=4096, moe_intermediate_size=256, intermediate_size=512, n_routed_experts=8,
        max_position_embeddings=65536)
    model = tiny_hf_model(0, dtype=dtype, device=dev, compress_ratios=tuple(kinds), **dims)
    B, P, N = (8, 40, 4) if args.small else (256, 512, 64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (P,), generator=g).tolist() for _ in range(B)]
    rows = []
    for graphs in (False, True):
        pm = PagedDeepseekV4(model, kv_cache_dtype="fp8_ds_mla", max_model_len=P + N, max_num_reqs=B,
                             max_num_batched_tokens=max(B, 8192 if not args.small else 256))
        if graphs:
            pm.enable_cuda_graphs(buckets=(B,), capture=dev.type == "cuda")
        # Warm-up with the timed batch itself: Triton compiles a kernel per specialisation
        # (constexprs, and ints that are 1 or multiples of 16), so a small warm-up batch leaves
        # the timed run compiling the shapes of the full batch's prefill chunks and decodes.
        pm.generate(prompts, 2)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        pm.generate(prompts, N)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        rows.append(Row(f"generate B={B} prompt {P} + {N} new, {len(kinds)} layers, "
                        f"{'graphs' if graphs else 'eager'}", dt * 1e6,
                        extra={"new tok/s": f"{B * N / dt:.0f}", "tok/s": f"{B * (P + N) / dt:.0f}"}))
        del pm
    return rows


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="toy dims and sizes (CPU ok)")
    p.add_argument("--layers", type=int, default=1, help="layers of each kind (default 1)")
    p.add_argument("--skip", default="", help="comma list of decode,prefill,generate to skip")
    args = p.parse_args()
    dev, dtype, ceil = serving_setup(args)
    kinds = ("sliding", "csa", "hca") * args.layers
    cfg = flash_config(kinds, args.small)
    layers = make_layers(cfg, dev, dtype)
    skip = set(filter(None, args.skip.split(",")))
    cases = [(4, 300), (8, 1000)] if args.small else [(64, 4096), (256, 4096), (64, 65536), (256, 65536)]
    if "decode" not in skip:
        rows = []
        for batch, ctx in cases:
            rows += decode_rows(cfg, layers, dev, batch, ctx, graphs=True)
        print_table("V4-Flash-shaped decode step per layer (fp8_ds_mla, bf16): eager vs CUDA-graph replay", rows,
                    ceil)
    if "prefill" not in skip:
        print_table("prefill of one request, per layer", prefill_rows(cfg, layers, dev, 256 if args.small else 8192),
                    ceil)
    if "generate" not in skip:
        print_table("generate throughput (whole transformers model, attention on dsv4attn)",
                    generate_rows(args, dev, dtype), ceil)


if __name__ == "__main__":
    main()
