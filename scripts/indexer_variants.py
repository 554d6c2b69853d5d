"""Time variants of the lightning indexer's top-k kernel on the GPU (graph replays, one line each).

Shapes of ``benchmarks/bench_indexer.py`` (64 heads x 128 dims, top-512, fp8 pages of 64
entries, one query token per request, n = ctx / 4 entries); the variants are the launch
overrides of ``dsv4attn.ops.indexer._indexer_topk_triton`` (fp8 keys as words or bytes, warps,
keys per dot). Each variant's output is checked against the default's (same keys, same rule:
identical indices, scores within the dots' summation-order rounding; near-ties that another
summation order rounds apart show as a share of differing indices).

    python3 -m scripts.indexer_variants [WORD...]    # repository root, CUDA; WORD picks variants by label
    python3 -m scripts.indexer_variants --splits 1,2,4 [WORD...]   # each variant at each split count

With ``--splits`` every picked variant runs at each given number of programs per token instead
of the op's own choice (``_num_splits``), to see where the choice should fall.
"""

from __future__ import annotations

import sys

import torch

from benchmarks.bench_indexer import TOPK, decode_case
from benchmarks.common import graph_us
from dsv4attn.ops.indexer import _indexer_topk_triton, _num_splits

CASES = ((64, 4096), (256, 4096), (64, 65536), (256, 65536))
VARIANTS = [
    ("words, 4 warps, few=128, PTX decode (default)", {}),
    ("words, fp32 decode (asm=False)", dict(asm=False)),
    ("words, 8 warps, fp32 decode", dict(num_warps=8, asm=False)),
    ("bytes, 4 warps", dict(words=False)),
    ("words, 8 warps", dict(num_warps=8)),
    ("bytes, 8 warps", dict(words=False, num_warps=8)),
    ("words, 4 warps, 64 keys", dict(block_n=64)),
    ("words, every chunk sorted whole (few=0)", dict(few=0)),
    ("words, sort only the keys above the threshold when <= 32", dict(few=32)),
    ("words, ... <= 64", dict(few=64)),
    ("words, ... <= 128", dict(few=128)),
    ("words, ... <= 256", dict(few=256)),
]


def main() -> None:
    """argv: words that select variants by label (the default always runs first, as the base)."""
    picks = sys.argv[1:]
    split_counts: list[int | None] = [None]
    if picks[:1] == ["--splits"]:
        split_counts = [int(x) for x in picks[1].split(",")]
        picks = picks[2:]
    variants = [(f"{label}, {s} splits" if s else label, kw, s) for i, (label, kw) in enumerate(VARIANTS)
                if i == 0 or not picks or any(p in label for p in picks) for s in split_counts]
    device = torch.device("cuda")
    torch.manual_seed(0)
    print("| variant | " + " | ".join(f"B{b} {c // 1024}K" for b, c in CASES) + " |")
    print("|---|" + "---|" * len(CASES))
    inputs = [decode_case(B, ctx, device) for B, ctx in CASES]
    base = [None] * len(CASES)
    for label, kw, splits in variants:
        cells = []
        for c, args in enumerate(inputs):
            def call(args=args, kw=kw, splits=splits):
                return _indexer_topk_triton(*args, TOPK, True, splits or _num_splits(args[0].shape[0], device), **kw)

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
    _report_registers()


def _report_registers() -> None:
    """Registers and spills per thread of every compiled specialisation (occupancy: at 4 warps and
    255 registers, two programs share an SM)."""
    from dsv4attn.kernels.indexer import _indexer_topk_kernel

    for cache in getattr(_indexer_topk_kernel, "device_caches", {}).values():
        for kernel in cache[0].values():
            c = getattr(kernel, "constants", {}) or {}
            keys = {k: v for k, v in c.items() if isinstance(k, str) and k in ("WORDS", "FEW", "SPLIT", "BLOCK_N")}
            print(f"regs {getattr(kernel, 'n_regs', '?')} spills {getattr(kernel, 'n_spills', '?')} "
                  f"warps {kernel.metadata.num_warps} {keys}")


if __name__ == "__main__":
    main()
