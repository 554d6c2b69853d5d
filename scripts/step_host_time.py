"""Host time of one decode step's bookkeeping (issue "Serve a whole model"), on any machine.

    PYTHONPATH=. python -m scripts.step_host_time BATCH CTX [--graphs] [--profile]

The small bench_model layers (one of each kind) on CPU, BATCH requests at CTX tokens; times
``begin_step`` + ``abort_step`` of a one-token-per-request step (block tables, positions and
slots, metadata build; median of five rounds of ten). With ``--graphs`` the engine prepares
the step in its CUDA-graph bucket buffers (``capture=False``: the same host work);
``--profile`` prints a cProfile of ten steps.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from benchmarks.bench_model import flash_config, make_layers, put_contexts
from dsv4attn.serving.engine import PagedAttentionEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("batch", type=int)
    ap.add_argument("ctx", type=int)
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    cfg = flash_config(("sliding", "csa", "hca"), True)
    layers = make_layers(cfg, torch.device("cpu"), torch.float32)
    b, ctx = a.batch, a.ctx
    eng = PagedAttentionEngine(layers, "fp8_ds_mla", num_blocks=b * (-(-(ctx + 64) // 256)) + 4,
                               device=torch.device("cpu"), max_num_batched_tokens=max(b, 256),
                               max_model_len=ctx + 64, max_num_reqs=b)
    put_contexts(eng, b, ctx)
    if a.graphs:
        eng.enable_cuda_graphs(buckets=(b,), capture=False)
    step = {r: 1 for r in range(b)}

    def ten() -> None:
        for _ in range(10):
            eng.begin_step(step)
            eng.abort_step()

    ten()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        ten()
        times.append((time.perf_counter() - t) * 100)
    print(f"B={b} ctx={ctx}{' graphs' if a.graphs else ''}: begin+abort {statistics.median(times):.2f} ms per step")
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        ten()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumtime").print_stats(25)


if __name__ == "__main__":
    main()
