"""Host time of one decode step's bookkeeping (issue "Serve a whole model"), on any machine.

    PYTHONPATH=. python -m scripts.step_host_time BATCH CTX [--graphs] [--profile]

The small bench_model layers (one of each kind) on CPU, BATCH requests at CTX tokens; times
the host side of consecutive decode steps, ``begin_step`` + ``end_step`` with one token per
request (allocation, block tables, positions and slots, metadata build, the sliding groups'
releases; the layers are not run), as the mean over 40 steps from CTX on (so every fourth
step adds a column to the 4-token state group, as in serving). With ``--graphs`` the engine
prepares the steps in its CUDA-graph bucket buffers (``capture=False``: the same host work);
``--profile`` prints a cProfile of 40 more steps.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from benchmarks.bench_model import decode_engine, flash_config, make_layers


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
    eng = decode_engine(layers, torch.device("cpu"), b, ctx, room=256)
    if a.graphs:
        eng.enable_cuda_graphs(buckets=(b,), capture=False)
    step = {r: 1 for r in range(b)}

    def steps(n: int) -> None:
        for _ in range(n):
            eng.begin_step(step)
            eng.end_step()

    steps(4)
    t = time.perf_counter()
    steps(40)
    per = (time.perf_counter() - t) / 40 * 1e3
    print(f"B={b} ctx={ctx}{' graphs' if a.graphs else ''}: begin+end {per:.2f} ms per step")
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        steps(40)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumtime").print_stats(25)


if __name__ == "__main__":
    main()
