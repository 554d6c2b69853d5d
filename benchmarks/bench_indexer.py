"""Benchmark: lightning-indexer top-k (scoring + deterministic top-k) over fp8 indexer-K pages.

Cases: decode steps of B = 64 and 256 requests (one query token each) at 4K and 64K context
(n = 1024 and 16384 indexer entries per token), V4 shape: 64 indexer heads of 128 dims,
top-k 512, bs 64 pages of 8,640 bytes, each request on its own shuffled blocks (the cache is far
larger than L2). Bytes = every token's keys + scales (n x 132) + q (bf16) + weights + outputs;
FLOPs = 2 x H x D x n per token (the QK products; ReLU/sum/top-k are not counted). The reference
runs only where its [T, n, D] temporaries stay small. On CUDA the Triton rows' time is the CUDA
graph replay (the small cases' eager calls are bound by the host's launch cost; their eager
median is the "eager us" column).

    python -m benchmarks.bench_indexer            # H200: < 60 s
    python -m benchmarks.bench_indexer --smoke    # tiny sizes, CPU ok (reference path)
"""

from __future__ import annotations

import torch

from benchmarks.common import Ceilings, Row, base_parser, graph_us, median_us, print_table
from dsv4attn.device import supported_paths
from dsv4attn.ops.indexer import indexer_topk
from dsv4attn.reference.cache_ops import alloc_indexer_k_cache, indexer_pages_of

H, D, TOPK, BS = 64, 128, 512, 64


def _cache(num_blocks: int, device: torch.device) -> torch.Tensor:
    """fp8 pages of random finite keys (never the NaN code 0x7F/0xFF) and equal scales, made on
    the device (the largest case holds 566 MB of pages)."""
    cache = alloc_indexer_k_cache(num_blocks, BS, D, device=device)
    pages = indexer_pages_of(cache)
    vals = torch.randint(0, 0x7F, (num_blocks, BS * D), dtype=torch.uint8, device=device)
    vals |= torch.randint(0, 2, vals.shape, dtype=torch.uint8, device=device) << 7
    pages[:, :BS * D] = vals
    pages[:, BS * D:BS * D + BS * 4].view(torch.float32).fill_(1.0 / 64)
    return cache


def decode_case(B: int, ctx: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """One decode step of ``B`` requests at context ``ctx``: ``(q, weights, k_cache, block_table,
    token_to_req, lengths)`` for :func:`indexer_topk`, every request on its own shuffled blocks."""
    n = ctx // 4
    per_req = n // BS
    cache = _cache(B * per_req, device)
    table = torch.randperm(B * per_req, device=device).to(torch.int32).view(B, per_req)
    q = torch.randn(B, H, D, device=device).to(torch.bfloat16)
    w = torch.randn(B, H, device=device) * (H * D) ** -0.5
    t2r = torch.arange(B, dtype=torch.int32, device=device)
    lengths = torch.full((B,), n, dtype=torch.int32, device=device)
    return q, w, cache, table, t2r, lengths


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    cases = [(64, 4096), (256, 4096), (64, 65536), (256, 65536)] if cuda else [(2, 512), (4, 1024)]
    impls = [p for p in ("triton", "reference") if p in supported_paths(device)] if cuda else ["reference"]
    ceil = Ceilings() if (args.no_ceilings or not cuda) else Ceilings.measure()
    torch.manual_seed(0)
    rows: list[Row] = []
    for B, ctx in cases:
        n = ctx // 4
        q, w, cache, table, t2r, lengths = decode_case(B, ctx, device)
        nbytes = B * (n * (D + 4) + H * D * 2 + H * 4 + TOPK * 8 + 8)
        for impl in impls:
            if impl == "reference" and B * n > (1 << 18):
                continue
            def call(impl=impl):
                return indexer_topk(q, w, cache, table, t2r, lengths, TOPK, validate_indices=False, impl=impl)

            us = median_us(call)
            extra = {"impl": impl, "eager us": "-"}
            if cuda and impl == "triton":  # the floor column then reads the graph replay
                extra["eager us"] = f"{us:.2f}"
                us = graph_us(call)
            rows.append(Row(f"indexer_topk decode B={B} ctx={ctx}", us, flops=2 * B * H * D * n, bytes=nbytes,
                            extra=extra))
    print_table("lightning indexer: score + top-512 over fp8 pages (bf16 q)", rows, ceil)


if __name__ == "__main__":
    main()
