"""Benchmark of the speculative-decoding verify step (decode with drafts) against plain decode.

V4-Flash-shaped layers (``benchmarks.bench_model.flash_config``: hidden 4096, 64 heads x 512,
window 128, indexer 64 x 128 top-k 512), bf16 weights, fp8_ds_mla caches, one layer of each
kind. B requests at context ``ctx`` each feed ``1 + k`` tokens (the last accepted token and k
drafts; k = 0 is plain decode), k in 0..3, B in {64, 256}:

1. per layer: the layer step (eager: it is sync-free and shape-static, the same step a CUDA
   graph captures; on CUDA also its graph replayed, from ``enable_cuda_graphs``: one
   ``DecodeGraphs`` per query length 1 + k) with its roofline floor; ``x plain`` = time / time
   at k = 0 of the same B (a verify step of 1 + k tokens is worth it when ``x plain`` stays
   below the expected tokens per step, 1 + accepted drafts);
2. whole engine step: ``begin_step`` (block tables + metadata, once for all layers) + every
   layer + ``end_step`` + ``rollback`` of all drafts + ``commit`` (the bookkeeping a verify
   step adds), and the rollback + commit alone.

    python -m benchmarks.bench_spec            # H200
    python -m benchmarks.bench_spec --small    # toy sizes on CPU (checks the script runs)
"""

from __future__ import annotations

import time

import torch

from benchmarks.bench_model import decode_engine, flash_config, floor_row, make_layers
from benchmarks.common import Row, base_parser, median_us, print_table, serving_setup
from dsv4attn.serving.paged import layer_step

K_MAX = 3


def spec_rows(cfg, layers, dev, batch: int, ctx: int, ks: tuple[int, ...]) -> tuple[list[Row], list[Row]]:
    # every timed engine step keeps one token per request (k drafts rolled back): room for 1024
    eng = decode_engine(layers, dev, batch, ctx, room=1024, step_tokens=max(batch * (1 + K_MAX), 256),
                        num_speculative_tokens=K_MAX)
    for r in range(batch):
        eng.commit(r)
    layer_rows, step_rows, base = [], [], {}
    for k in ks:
        step = {r: 1 + k for r in range(batch)}
        T = batch * (1 + k)
        x = torch.randn(T, cfg.hidden_size, device=dev, dtype=layers[0].sinks.dtype)
        plan = eng.begin_step(step)
        assert plan.metadata.batch.num_decodes == batch  # every request on the decode path
        for i, layer in enumerate(layers):
            st, sp = plan.state(layer.ratio)
            for mode in ("eager",):
                us = median_us(lambda layer=layer, x=x, meta=plan.metadata, c=eng.caches[i], st=st, sp=sp:
                               layer_step(layer, x, meta, eng.builder, c, st, impl=eng.impl, state_positions=sp))
                key = (i, mode)
                base.setdefault(key, us) if k == 0 else None
                layer_rows.append(floor_row(cfg, layer, f"L{i} {layer.kind} B={batch} k={k} {mode}", us, T, ctx, {
                    "tokens": T, "us/token": f"{us / T:.2f}",
                    "x plain": f"{us / base[key]:.2f}" if key in base else "-"}))
        eng.abort_step()

        def full_step(step=step, x=x, k=k):
            eng.begin_step(step)
            for i in range(len(layers)):
                eng.run_layer(i, x)
            eng.end_step()
            for r in range(batch):
                if k:
                    eng.rollback(r, k)
                eng.commit(r)

        us = median_us(full_step, warmup_ms=10, rep_ms=50)
        base.setdefault("step", us) if k == 0 else None

        undo_us = []  # rollback + commit alone (host bookkeeping): grow + advance again first
        for _ in range(5):
            for r in range(batch):
                n = eng.seq_len(r) + k
                eng.manager.grow(r, n)
                eng.manager.advance(r, n)
            t0 = time.perf_counter()
            for r in range(batch):
                if k:
                    eng.rollback(r, k)
                eng.commit(r)
            undo_us.append((time.perf_counter() - t0) * 1e6)
        step_rows.append(Row(f"engine step B={batch} k={k} ({len(layers)} layers)", us, extra={
            "tokens": T, "x plain": f"{us / base['step']:.2f}",
            "rollback+commit us (host)": f"{sorted(undo_us)[2]:.0f}"}))
    if dev.type == "cuda":  # the same verify steps replayed from CUDA graphs (DecodeGraphs(query_len=1+k))
        eng.enable_cuda_graphs(buckets=(batch,))
        for k in ks:
            step = {r: 1 + k for r in range(batch)}
            T = batch * (1 + k)
            plan = eng.begin_step(step)
            g = eng._graphs_for(plan.query_lens)
            assert plan.bucket == batch and g.query_len == 1 + k
            g.inputs[batch].copy_(torch.randn(T, cfg.hidden_size, device=dev, dtype=layers[0].sinks.dtype))
            for i, layer in enumerate(layers):
                us = median_us(g.graphs[(i, batch)].replay)
                key = (i, "graph")
                base.setdefault(key, us) if k == 0 else None
                layer_rows.append(floor_row(cfg, layer, f"L{i} {layer.kind} B={batch} k={k} graph", us, T, ctx, {
                    "tokens": T, "us/token": f"{us / T:.2f}",
                    "x plain": f"{us / base[key]:.2f}" if key in base else "-"}))
            eng.abort_step()
    return layer_rows, step_rows


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="toy dims and sizes (CPU ok)")
    p.add_argument("--ctx", type=int, default=None, help="context per request (default 4096; --small 300)")
    args = p.parse_args()
    dev, dtype, ceil = serving_setup(args)
    cfg = flash_config(("sliding", "csa", "hca"), args.small)
    layers = make_layers(cfg, dev, dtype)
    ctx = args.ctx or (300 if args.small else 4096)
    batches = (4,) if args.small else (64, 256)
    ks = (0, 1, 2) if args.small else tuple(range(K_MAX + 1))
    layer_rows, step_rows = [], []
    for b in batches:
        lr, sr = spec_rows(cfg, layers, dev, b, ctx, ks)
        layer_rows += lr
        step_rows += sr
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print_table(f"verify step (1 + k tokens per request) vs plain decode, per layer, ctx={ctx} (fp8_ds_mla)",
                layer_rows, ceil)
    print_table("whole engine step with rollback of every draft", step_rows, ceil)


if __name__ == "__main__":
    main()
