"""Where a graph-replayed decode step of one layer spends its time (issue "Serve a whole model").

    python3 -m scripts.step_profile [--batch 64] [--ctx 4096] [--top 12]

Builds the V4-Flash-shaped layers of benchmarks/bench_model.py (one of each kind), puts
``--batch`` requests at ``--ctx`` tokens, captures the engine's decode graphs and replays each
layer's graph under the CUDA profiler; prints per layer the kernels by total time per replay
(on CPU, ``--small``: the static step run eagerly, CPU op times, to check the script).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_model import decode_engine, flash_config, make_layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--small", action="store_true", help="toy dims on CPU")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.small else "cpu")
    cuda = dev.type == "cuda"
    cfg = flash_config(("sliding", "csa", "hca"), not cuda)
    layers = make_layers(cfg, dev, torch.bfloat16 if cuda else torch.float32)
    b, ctx = (a.batch, a.ctx) if cuda else (4, 300)
    eng = decode_engine(layers, dev, b, ctx)
    eng.enable_cuda_graphs(buckets=(b,), capture=cuda)
    eng.begin_step({r: 1 for r in range(b)})
    g = eng.graphs
    g.inputs[b].copy_(torch.randn(b, cfg.hidden_size, device=dev, dtype=g.inputs[b].dtype))
    acts = [torch.profiler.ProfilerActivity.CUDA] if cuda else [torch.profiler.ProfilerActivity.CPU]
    reps = 10
    for i, layer in enumerate(layers):
        run = g.graphs[(i, b)].replay if cuda else (lambda i=i: g._eager(i, b, g.inputs[b]))
        for _ in range(3):
            run()
        if cuda:
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(reps):
                run()
            if cuda:
                torch.cuda.synchronize()
        rows = []
        for e in prof.key_averages():
            t = e.device_time_total if cuda else e.self_cpu_time_total
            if e.count and t > 0 and (not cuda or e.device_type == torch.autograd.DeviceType.CUDA):
                rows.append((t / reps, e.count // reps, e.key))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        print(f"\nL{i} {layer.kind} B={b} ctx={ctx}: {total:.1f} us of kernels per replay, {sum(r[1] for r in rows)} "
              f"launches")
        for t, n, k in rows[: a.top]:
            print(f"  {t:8.1f} us  x{n:<3d} {k[:90]}")
    eng.abort_step()


if __name__ == "__main__":
    main()
