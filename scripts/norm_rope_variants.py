"""Time the fused norm + RoPE kernel on a decode step's shapes (V4-Flash, B tokens), one line per
rows-per-program setting (graph replays, us; CUDA).

    python3 -m scripts.norm_rope_variants [B]        # repository root, CUDA; default B = 256

Each setting of ``dsv4attn.ops.norm_rope._HEAD_ROWS`` (rows per program where a token has 8 or
more head rows; the other calls take one row per program whatever the setting) runs the seven
calls of a CSA layer's step: q_a norm, q norm + RoPE, kv norm + RoPE, both compressors' entries,
the indexer's queries and the output's inverse RoPE. Outputs are checked equal to the first
setting's ("differs" where a tile shape changes a row's summation order).
"""

from __future__ import annotations

import sys

import torch

import dsv4attn.ops.norm_rope as nr
from benchmarks.common import graph_us


def cases(B: int, dev: torch.device):
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32).to(dtype)

    cos, sin = r(B, 32, dtype=torch.float32), r(B, 32, dtype=torch.float32)
    attn = r(B, 64, 512)
    return [
        ("q_a norm [B, 1024]", lambda x=r(B, 1024), w=r(1024): nr.norm_rope(x, eps=1e-6, weight=w)),
        ("q norm+rope [B, 64, 512]", lambda x=r(B, 64, 512): nr.norm_rope(x, cos, sin, eps=1e-6)),
        ("kv norm+rope [B, 512]", lambda x=r(B, 512), w=r(512): nr.norm_rope(x, cos, sin, eps=1e-6, weight=w)),
        ("entries fp32 [B, 512]", lambda x=r(B, 512, dtype=torch.float32), w=r(512):
            nr.norm_rope(x, cos, sin, eps=1e-6, weight=w, dtype=torch.bfloat16)),
        ("idx entries fp32 [B, 128]", lambda x=r(B, 128, dtype=torch.float32), w=r(128):
            nr.norm_rope(x, cos, sin, eps=1e-6, weight=w, dtype=torch.bfloat16)),
        ("idx q rope [B, 64, 128]", lambda x=r(B, 64, 128): nr.norm_rope(x, cos, sin)),
        ("inverse rope in place [B, 64, 512]", lambda: nr.norm_rope(attn, cos, sin, inverse=True, out=attn)),
    ]


def main() -> None:
    B = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    dev = torch.device("cuda")
    settings = (1, 2, 4, 8, 16)
    calls = cases(B, dev)
    print(f"| call (B={B}) | " + " | ".join(f"{s} rows" for s in settings) + " |")
    print("|---|" + "---|" * len(settings))
    totals = [0.0] * len(settings)
    for label, fn in calls:
        cells, base = [], None
        for k, s in enumerate(settings):
            nr._HEAD_ROWS = s
            out = fn().clone() if "in place" not in label else None
            if base is None:
                base = out
            elif out is not None and not torch.equal(out, base):
                cells.append("differs")
                continue
            us = graph_us(fn, calls=20)
            totals[k] += us
            cells.append(f"{us:.2f}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("| total | " + " | ".join(f"{t:.1f}" for t in totals) + " |")


if __name__ == "__main__":
    main()
