"""Split-KV factor sweep of the decode attention kernel on the GPU (retuning ``pick_splits``).

    python3 -m scripts.split_sweep [--heads 64,128] [--batches 1,4,...] [--splits 1,2,...]

Decode rows as in benchmarks/bench_vs_flashmla.py (512 compressed + 128 SWA candidates per
token, fp8_ds_mla pages, sink), timed as CUDA-graph replays for each forced split factor, next
to the factor ``kernel_config`` picks. Prints one markdown table (us; best per row marked *).
"""

from __future__ import annotations

import argparse

import torch

import dsv4attn
from benchmarks.bench_vs_flashmla import D, SCALE, decode_inputs
from benchmarks.common import graph_us
from dsv4attn.ops.sparse_attn_launch import kernel_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="64,128")
    ap.add_argument("--batches", default="1,4,8,16,32,48,64,96,128")
    ap.add_argument("--splits", default="1,2,3,4,5,6,8,10")
    a = ap.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    splits = [int(s) for s in a.splits.split(",")]
    print("| heads | B | picked | " + " | ".join(f"s={s}" for s in splits) + " |")
    print("|---|---|---|" + "---|" * len(splits))
    for h in (int(x) for x in a.heads.split(",")):
        for b in (int(x) for x in a.batches.split(",")):
            x = decode_inputs(b, h, 512, 128, device, gen)
            q, sets, sink = x.q[:, 0], x.sets, x.sink
            picked = kernel_config(b, h, D, 640, device).num_splits
            times = [graph_us(lambda s=s: dsv4attn.sparse_mla_attention(q, sets, SCALE, sink, num_splits=s), calls=10)
                     for s in splits]
            best = min(times)
            cells = [f"{t:.1f}{'*' if t == best else ''}" for t in times]
            print(f"| {h} | {b} | {picked} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
