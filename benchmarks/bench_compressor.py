"""Benchmark: compressor pooling (gated softmax over a window of paged fp32 state rows).

Cases: N = 256 (a decode step in which every token closes a block) and 4096 (a 16K-token
prefill of ratio 4) pooled entries for the C4A main compressor (D 512, r 4, overlapping 8-row
windows, state bs 4), the C4A indexer compressor (D 128) and, for HCA, N = 256 and 1024 entries
(D 512, r 128: 128-row windows, state bs 8). Each request's state rows sit on shuffled blocks.
Bytes = the rows' used halves (L x 2 x D x 4: kv + score) + the pooled output; no FLOPs counted.

    python -m benchmarks.bench_compressor            # H200: < 60 s
    python -m benchmarks.bench_compressor --smoke    # tiny sizes, CPU ok (reference path)
"""

from __future__ import annotations

import torch

from benchmarks.common import Ceilings, Row, base_parser, median_us, print_table
from dsv4attn.device import supported_paths
from dsv4attn.ops.compressor import compressor_pool


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    configs = [("c4a main", 512, 4, True, 4), ("c4a indexer", 128, 4, True, 4), ("hca", 512, 128, False, 8)]
    impls = [p for p in ("triton", "reference") if p in supported_paths(device)] if cuda else ["reference"]
    ceil = Ceilings() if (args.no_ceilings or not cuda) else Ceilings.measure()
    torch.manual_seed(0)
    rows: list[Row] = []
    for name, D, r, overlap, bs in configs:
        coff = 2 if overlap else 1
        counts = ([256, 1024] if r == 128 else [256, 4096]) if cuda else [8]
        for N in counts:
            per_req = (coff * r) // bs + 1  # blocks covering one window
            nb = N * per_req
            state = torch.randn(nb, bs, 2 * coff * D, device=device)  # up to 570 MB: made on the device
            table = torch.randperm(nb, device=device).to(torch.int32).view(N, per_req)
            pos = torch.full((N,), coff * r - 1, device=device)  # entry coff-1: a whole window of valid rows
            t2r = torch.arange(N, dtype=torch.int32, device=device)
            nbytes = N * (coff * r * 2 * D * 4 + D * 4 + 16)
            for impl in impls:
                us = median_us(lambda: compressor_pool(state, table, t2r, pos, r, overlap, validate_indices=False,
                                                       impl=impl))
                rows.append(Row(f"compressor_pool {name} N={N}", us, bytes=nbytes, extra={"impl": impl}))
    print_table("compressor pooling: window rows read (bytes) per pooled entry", rows, ceil)


if __name__ == "__main__":
    main()
