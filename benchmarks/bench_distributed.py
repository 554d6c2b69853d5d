"""Decode step time and cache memory per GPU of one attention layer: TP 1 vs 2, DCP 1 vs 2.

Production layer of bench_layer (V4-Flash attention: 64 heads x 512, o_groups 8, window 128,
indexer 64 x 128 top-k 512), bf16 weights, fp8_ds_mla pages, for each layer kind: B requests at
context L each, one decode token per request per step. The context is reserved, not run
(``DCPAttentionRunner.reserve`` / the block manager: blocks allocated, pages zero), so 1M-token
contexts cost no prefill; every kernel still reads every page it would read. One row = one
``runner.step`` (metadata, cache writes, compressors, indexer, attention, projections and the
collectives), median over ``--reps`` steps, the slowest rank. Memory per GPU: the bytes of the
SWA / compressed / indexer-key pages the requests hold on one rank, and
``torch.cuda.max_memory_allocated`` (weights, caches sized for the run, temporaries).

    python -m benchmarks.bench_distributed                          # TP 1 = DCP 1 (one GPU)
    torchrun --nproc-per-node 2 -m benchmarks.bench_distributed --tp 2
    torchrun --nproc-per-node 2 -m benchmarks.bench_distributed --dcp 2
    python -m benchmarks.bench_distributed --smoke                  # tiny sizes, CPU
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.bench_layer import make_layer, production_config
from benchmarks.common import base_parser
from dsv4attn.distributed.launch import add_parallel_args, init_parallel, make_runner, parallel_config_from_args
from dsv4attn.distributed.selfcheck import held_bytes, reserve_context

MIB = 1 << 20
#: Tokens per reserve step: the sliding groups briefly hold a chunk of blocks (c4 state: chunk / 4),
#: each step walks the request's table on the host (1M tokens: 64 steps).
RESERVE_CHUNK = 16384


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _max_over_ranks(x: float, device: torch.device) -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def main() -> None:
    p = base_parser(__doc__)
    add_parallel_args(p)
    p.add_argument("--contexts", default="65536,1048576", help="comma-separated context lengths")
    p.add_argument("--batch", default="1,8", help="comma-separated request counts")
    p.add_argument("--kinds", default="sliding,csa,hca")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    ctx = init_parallel(parallel_config_from_args(args), device="cpu" if args.smoke else None)
    dev = ctx.device
    cfg = production_config(args.smoke)
    contexts = [300, 1000] if args.smoke else [int(x) for x in args.contexts.split(",")]
    batches = [1, 2] if args.smoke else [int(x) for x in args.batch.split(",")]
    impl = "reference" if dev.type == "cpu" else "auto"
    rows = []
    for layer_idx, kind in enumerate(cfg.layer_kinds):
        if kind not in args.kinds.split(","):
            continue
        layer = make_layer(cfg, layer_idx, dev)
        for B in batches:
            for L in contexts:
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                max_len = L + args.reps + 8
                # compressed columns + sliding windows per request, plus one request's reserve transient
                # (c4 state: chunk / 4 blocks, SWA: chunk / 64)
                transient = RESERVE_CHUNK // 4 + RESERVE_CHUNK // 64 + 128
                blocks = B * (-(-L // 256) // ctx.config.dcp + 128) + transient
                runner = make_runner(layer, ctx, kv_cache_dtype="fp8_ds_mla", num_blocks=blocks, device=dev,
                                     max_num_batched_tokens=max(64, B), max_model_len=max_len, max_num_reqs=B,
                                     impl=impl)
                for r in range(B):
                    reserve_context(runner, f"r{r}", L, RESERVE_CHUNK)
                x = {f"r{r}": torch.randn(1, cfg.hidden_size, device=dev, dtype=torch.bfloat16) for r in range(B)}
                runner.step(x)  # warm-up (compiles)
                ts = []
                for _ in range(args.reps):
                    _sync()
                    if dist.is_initialized():
                        dist.barrier()
                    t0 = time.perf_counter()
                    runner.step(x)
                    _sync()
                    ts.append(time.perf_counter() - t0)
                us = _max_over_ranks(statistics.median(ts) * 1e6, dev)
                held = sum(sum(held_bytes(runner, f"r{r}").values()) for r in range(B))
                held = _max_over_ranks(held, dev)
                peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
                peak = _max_over_ranks(peak, dev)
                rows.append((kind, B, L, us, held / MIB, peak / MIB))
                del runner
    if ctx.rank == 0:
        gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        print(f"\n## Decode step, one layer, tp={ctx.config.tp} dcp={ctx.config.dcp} "
              f"(interleave {ctx.config.dcp_interleave}) [{gpu}]")
        print("| kind | B | context | step us (median, slowest rank) | KV pages held / GPU MiB "
              "| peak allocated / GPU MiB |")
        print("|---|---|---|---|---|---|")
        for kind, B, L, us, held, peak in rows:
            print(f"| {kind} | {B} | {L} | {us:.0f} | {held:.1f} | {peak:.0f} |")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
