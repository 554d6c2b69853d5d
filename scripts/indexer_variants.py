"""Time variants of the lightning indexer's top-k kernel on the GPU (graph replays, one line each).

Shapes of ``benchmarks/bench_indexer.py`` (64 heads x 128 dims, top-512, fp8 pages of 64
entries, one query token per request, n = ctx / 4 entries); the variants are the launch
overrides of ``dsv4attn.ops.indexer._indexer_topk_triton`` (fp8 keys as words or bytes, warps,
keys per dot). Each variant's output is checked against the default's (same keys, same rule:
identical indices, scores within the dots' summation-order rounding; near-ties that another
summation order rounds apart show as a share of differing indices).

    python3 -m scripts.indexer_variants     # repository root, CUDA
"""

from __future__ import annotations

import torch

from benchmarks.bench_indexer import TOPK, decode_case
from benchmarks.common import graph_us
from dsv4attn.ops.indexer import _indexer_topk_triton, _num_splits

CASES = ((64, 4096), (256, 4096), (64, 65536), (256, 65536))
VARIANTS = [
    ("words, 4 warps (default)", {}),
    ("bytes, 4 warps", dict(words=False)),
    ("words, 8 warps", dict(num_warps=8)),
    ("bytes, 8 warps", dict(words=False, num_warps=8)),
    ("words, 4 warps, 64 keys", dict(block_n=64)),
]


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    print("| variant | " + " | ".join(f"B{b} {c // 1024}K" for b, c in CASES) + " |")
    print("|---|" + "---|" * len(CASES))
    inputs = [decode_case(B, ctx, device) for B, ctx in CASES]
    base = [None] * len(CASES)
    for label, kw in VARIANTS:
        cells = []
        for c, args in enumerate(inputs):
            def call(args=args, kw=kw):
                return _indexer_topk_triton(*args, TOPK, True, _num_splits(args[0].shape[0], device), **kw)

            try:
                idx, val = call()
                torch.cuda.synchronize()
                if base[c] is None:
                    base[c] = (idx, val)
                same = torch.equal(idx, base[c][0]) and torch.allclose(val, base[c][1], rtol=1e-5, atol=1e-5)
                diff = (idx != base[c][0]).float().mean().item()
                cells.append(f"{graph_us(call):.1f}" + ("" if same else f" (idx differ {diff:.2%})"))
            except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the sweep goes on
                cells.append(f"failed: {type(exc).__name__}: {str(exc)[:80]}")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
