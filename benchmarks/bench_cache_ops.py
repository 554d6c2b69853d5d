"""Benchmark: cache writers (insert bandwidth vs the device copy ceiling).

Cases: ``insert_kv`` of T = 4096 and 65536 tokens (bf16 input rows of 512) into a large cache
(4096 blocks x 64 = 262,144 slots, 153 MB fp8_ds_mla / 268 MB bf16, larger than L2) at random
distinct slots, for ``fp8_ds_mla`` and ``auto`` (bf16 rows); plus the indexer-key writer (fp8,
128 dims) and the C4A main compressor-state writer (rows of 2 x 1024 fp32) at the same T.
Bytes = input read + slot mapping read + entry bytes written (page padding is never touched).
Validation of slots is off (as under CUDA-graph capture). Triton and reference paths on GPU.

    python -m benchmarks.bench_cache_ops            # H200: < 60 s
    python -m benchmarks.bench_cache_ops --smoke    # tiny sizes, CPU ok (reference path)
"""

from __future__ import annotations

import torch

from benchmarks.common import Ceilings, Row, base_parser, median_us, print_table
from dsv4attn.device import supported_paths
from dsv4attn.kv_cache.layout import alloc_fp8_ds_mla_cache
from dsv4attn.ops.cache_ops import insert_indexer_k, insert_kv, write_compressor_state
from dsv4attn.reference.cache_ops import alloc_indexer_k_cache


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        num_blocks, token_counts = 16, [64, 512]
    else:
        num_blocks, token_counts = 4096, [4096, 65536]
    bs = 64
    impls = [p for p in ("triton", "reference") if p in supported_paths(device)] if cuda else ["reference"]
    ceil = Ceilings() if (args.no_ceilings or not cuda) else Ceilings.measure()

    fp8 = alloc_fp8_ds_mla_cache(num_blocks, bs, device=device)
    rows_cache = torch.zeros(num_blocks, bs, 512, dtype=torch.bfloat16, device=device)
    idx_cache = alloc_indexer_k_cache(num_blocks, bs, 128, device=device)
    state = torch.zeros(num_blocks * 16, 4, 2048, device=device)  # C4A main state pages, 4 rows
    g = torch.Generator(device="cpu").manual_seed(0)
    rows: list[Row] = []
    for t in token_counts:
        slots = torch.randperm(num_blocks * bs, generator=g)[:t].to(device=device, dtype=torch.int64)
        kv = torch.randn(t, 512, generator=g).to(device=device, dtype=torch.bfloat16)
        k = torch.randn(t, 128, generator=g).to(device=device, dtype=torch.bfloat16)
        skv = torch.randn(t, 1024, generator=g).to(device)
        sscore = torch.randn(t, 1024, generator=g).to(device)
        ape = torch.randn(4, 1024, generator=g).to(device)
        pos = torch.arange(t, device=device)
        cases = [
            ("insert_kv fp8_ds_mla", t * (1024 + 8 + 584),
             lambda impl: insert_kv(kv, slots, fp8, validate_slots=False, impl=impl)),
            ("insert_kv bf16", t * (1024 + 8 + 1024),
             lambda impl: insert_kv(kv, slots, rows_cache, "auto", validate_slots=False, impl=impl)),
            ("insert_indexer_k fp8", t * (256 + 8 + 132),
             lambda impl: insert_indexer_k(k, slots, idx_cache, validate_slots=False, impl=impl)),
            ("write_compressor_state c4 main", t * (4096 * 2 + 8 + 8 + 8192),
             lambda impl: write_compressor_state(skv, sscore, ape, pos, slots, state,
                                                 validate_slots=False, impl=impl)),
        ]
        for name, nbytes, fn in cases:
            for impl in impls:
                us = median_us(lambda: fn(impl))
                rows.append(Row(f"{name} T={t}", us, bytes=nbytes, extra={"impl": impl}))
    if cuda:
        n = 1 << 28
        a = torch.empty(n, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        rows.append(Row("copy 256 MiB (ceiling check)", median_us(lambda: b.copy_(a)), bytes=2 * n,
                        extra={"impl": "torch"}))
    print_table("cache writers: insert bandwidth (bytes read + written)", rows, ceil)


if __name__ == "__main__":
    main()
