"""Benchmark of one whole DeepSeek-V4 attention layer step through AttentionRunner.

Production layer (V4-Flash attention: hidden 4096, 64 heads x 512 (448 + 64), q_lora 1024,
o_groups 8 x 1024, window 128, indexer 64 x 128 top-k 512), bf16 weights, fp8_ds_mla pages, for
each layer kind: a decode step of B requests at context L (every request one token), and a
prefill chunk of C tokens of one new request. One row = one ``runner.step`` (metadata build,
cache writes, compressors, indexer, attention, projections, host bookkeeping included).

Floor: flops = 2 * tokens * (linear weights) + 4 * tokens * h * 512 * N (N = attended entries
per token); bytes = the layer's weights (read once per step) + tokens * N * 584 (KV, no reuse).

    python -m benchmarks.bench_layer                  # H200: full table
    python -m benchmarks.bench_layer --smoke          # tiny sizes, runs on CPU
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import Ceilings, Row, base_parser, print_table
from dsv4attn.config import AttentionConfig
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.serving.runner import AttentionRunner

ENTRY_BYTES = 584


def production_config(smoke: bool) -> AttentionConfig:
    if smoke:
        return AttentionConfig(hidden_size=64, num_heads=4, head_dim=80, rope_dim=16, q_lora_rank=32, o_groups=2,
                               o_lora_rank=16, window_size=8, index_num_heads=8, index_head_dim=32, index_topk=8,
                               layer_kinds=("sliding", "csa", "hca"), compress_ratios=(1, 4, 128))
    return AttentionConfig(hidden_size=4096, num_heads=64, head_dim=512, rope_dim=64, q_lora_rank=1024, o_groups=8,
                           o_lora_rank=1024, window_size=128, index_num_heads=64, index_head_dim=128,
                           index_topk=512, layer_kinds=("sliding", "csa", "hca"), compress_ratios=(1, 4, 128))


def make_layer(cfg: AttentionConfig, layer_idx: int, device: torch.device) -> DeepseekV4Attention:
    layer = DeepseekV4Attention(cfg, layer_idx)
    g = torch.Generator().manual_seed(layer_idx)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return layer.to(device=device, dtype=torch.bfloat16)


def timed_us(fn, reps: int) -> float:
    """Median wall time of ``fn()`` over ``reps`` calls (device synchronised), microseconds."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e6


def attended(cfg: AttentionConfig, kind: str, ctx: int) -> int:
    n = min(ctx, cfg.window_size)
    if kind == "csa":
        n += min(ctx // 4, cfg.index_topk)
    elif kind == "hca":
        n += ctx // 128
    return n


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ceil = Ceilings() if args.no_ceilings or dev.type != "cuda" else Ceilings.measure()
    cfg = production_config(args.smoke)
    decode_cases = [(4, 300)] if args.smoke else [(64, 4096), (256, 4096), (32, 16384)]
    prefill_cases = [40] if args.smoke else [2048, 8192]
    rows = []
    for layer_idx, kind in enumerate(cfg.layer_kinds):
        layer = make_layer(cfg, layer_idx, dev)
        weights = sum(p.numel() for n, p in layer.named_parameters() if n.endswith("proj.weight"))
        wbytes = 2 * sum(p.numel() for p in layer.parameters())
        hs = cfg.hidden_size
        for batch, ctx in decode_cases:
            max_len = ctx + 64 + 4 * args.reps
            runner = AttentionRunner(layer, "fp8_ds_mla", num_blocks=None if kind == "sliding" else
                                     batch * (-(-max_len // 256)) + 4, device=dev,
                                     max_num_batched_tokens=max(8192, batch), max_model_len=max_len,
                                     max_num_reqs=batch)
            chunk = 8192 // batch if ctx * batch > 8192 else ctx
            for s in range(0, ctx, max(chunk, 1)):
                n = min(chunk, ctx - s)
                runner.step({r: torch.randn(n, hs, device=dev, dtype=torch.bfloat16) for r in range(batch)})
            x = {r: torch.randn(1, hs, device=dev, dtype=torch.bfloat16) for r in range(batch)}
            us = timed_us(lambda: runner.step(x), args.reps)
            n = attended(cfg, kind, ctx)
            rows.append(Row(f"{kind} decode B={batch} ctx={ctx}", us,
                            flops=2 * batch * weights + 4 * batch * cfg.num_heads * cfg.head_dim * n,
                            bytes=wbytes + batch * n * ENTRY_BYTES,
                            extra={"tok/s": f"{batch / (us * 1e-6):.0f}"}))
            runner = None  # free the caches before the next case
        for c in prefill_cases:
            runner = AttentionRunner(layer, "fp8_ds_mla", num_blocks=None if kind == "sliding" else -(-c // 256) + 4,
                                     device=dev,
                                     max_num_batched_tokens=c, max_model_len=c)
            x = torch.randn(c, hs, device=dev, dtype=torch.bfloat16)
            ids = iter(range(10**9))

            def prefill():
                rid = next(ids)
                runner.step({rid: x})
                runner.free(rid)

            us = timed_us(prefill, args.reps)
            n = attended(cfg, kind, c // 2)
            rows.append(Row(f"{kind} prefill {c}", us,
                            flops=2 * c * weights + 4 * c * cfg.num_heads * cfg.head_dim * n,
                            bytes=wbytes + c * ENTRY_BYTES,
                            extra={"tok/s": f"{c / (us * 1e-6):.0f}"}))
            runner = None  # free the caches before the next case
    print_table("DeepSeek-V4 attention layer step (AttentionRunner, fp8_ds_mla, bf16)", rows, ceil)


if __name__ == "__main__":
    main()
