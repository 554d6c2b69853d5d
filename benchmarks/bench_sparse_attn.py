"""Benchmark of sparse MLA attention (fp8_ds_mla pages) for the cases of docs/performance.md.

Cases: decode B = 64/256/1024 x h = 64/128 at 512 (C4A top-k, indices form) + 128 (SWA, range
form) candidates; C128A at 64K (512 entries) and 1M (8192 entries) contexts (range form) + SWA;
prefill 4096 tokens of one request with 512 + 128. Floor = max(bytes / copy, flops / mma) with
bytes per token N*584 + N*4 + Q + O + LSE (decode: nothing shared between tokens; prefill: the
unique KV bytes, i.e. perfect reuse) and flops 2*h*N*(512+512).

    python -m benchmarks.bench_sparse_attn            # H200: full table (< 2 minutes)
    python -m benchmarks.bench_sparse_attn --sweep    # + kernel-config sweep, decode h64/h128 B256
    python -m benchmarks.bench_sparse_attn --smoke    # tiny, runs on CPU (reference path)
"""

from __future__ import annotations

import torch

from benchmarks.common import Ceilings, Row, base_parser, floor_us, median_us, print_table
from dsv4attn.kv_cache.layout import PRODUCTION_LAYOUT as LAYOUT
from dsv4attn.kv_cache.layout import fp8_ds_mla_view
from dsv4attn.ops.candidate_set import CandidateSet
from dsv4attn.ops.sparse_attn import sparse_mla_attention
from dsv4attn.ops.sparse_attn_launch import KernelConfig, kernel_config, launch

D = LAYOUT.head_dim  # 512
SCALE = D**-0.5
SWA_WINDOW = 128
C4A_BLOCK = 64  # compressed entries per block (256 // 4)
SWA_BLOCK = 64
C128A_BLOCK = 2  # 256 // 128


def random_cache(num_entries: int, block_size: int, device) -> torch.Tensor:
    """A valid fp8_ds_mla cache of >= num_entries entries (random e4m3 without NaN codes,
    scale bytes 2^-7, random bf16 RoPE), built directly in page bytes."""
    num_blocks = -(-num_entries // block_size)
    page = LAYOUT.page_bytes(block_size)
    pages = torch.randint(0, 256, (num_blocks, page), dtype=torch.uint8, device=device)
    pages[(pages & 0x7F) == 0x7F] = 0
    data = pages[:, : block_size * LAYOUT.data_bytes].view(num_blocks, block_size, LAYOUT.data_bytes)
    rope = torch.randn(num_blocks, block_size, LAYOUT.rope_dim, device=device).to(torch.bfloat16)
    data[..., LAYOUT.nope_dim :] = rope.view(torch.uint8)
    off = LAYOUT.scale_offset(block_size)
    pages[:, off : off + block_size * LAYOUT.scale_bytes] = 120
    return fp8_ds_mla_view(pages.reshape(-1), num_blocks, block_size, LAYOUT)


def per_request_range(num_tokens: int, entries: int, block_size: int, device, starts=None, lengths=None):
    """Range-form set: every token its own request holding ``entries`` entries (permuted blocks)."""
    nbr = -(-entries // block_size)
    cache = random_cache(num_tokens * nbr * block_size, block_size, device)
    bt = torch.randperm(num_tokens * nbr, device=device).to(torch.int32).view(num_tokens, nbr)
    i32 = dict(dtype=torch.int32, device=device)
    return CandidateSet(cache=cache, lengths=torch.full((num_tokens,), entries, **i32) if lengths is None else lengths,
                        block_table=bt, token_to_req=torch.arange(num_tokens, **i32),
                        starts=torch.zeros(num_tokens, **i32) if starts is None else starts)


def disjoint_indices(num_tokens: int, topk: int, device) -> CandidateSet:
    """Indices-form set: token t's top-k are disjoint from every other token's (perf.md)."""
    cache = random_cache(num_tokens * topk, C4A_BLOCK, device)
    idx = torch.randperm(num_tokens * topk, device=device).to(torch.int32).view(num_tokens, topk)
    return CandidateSet(cache=cache, lengths=torch.full((num_tokens,), topk, dtype=torch.int32, device=device),
                        indices=idx)


def decode_bytes(num_tokens: int, num_heads: int, n: int, unique_kv_entries: int | None = None) -> float:
    kv = (unique_kv_entries if unique_kv_entries is not None else num_tokens * n) * LAYOUT.entry_bytes
    return kv + num_tokens * (n * 4 + 2 * num_heads * D * 2 + num_heads * 4)


def flops(num_tokens: int, num_heads: int, n: int) -> float:
    return 2.0 * num_heads * n * (D + D) * num_tokens


def run_case(name, q, sets, n, rows, unique=None, impl="auto", sink=True, prefill=False):
    num_tokens, num_heads, _ = q.shape
    attn_sink = torch.zeros(num_heads, device=q.device) if sink else None
    us = median_us(lambda: sparse_mla_attention(q, sets, SCALE, attn_sink, impl=impl, prefill=prefill))
    rows.append(Row(name, us, flops(num_tokens, num_heads, n), decode_bytes(num_tokens, num_heads, n, unique),
                    {"impl": impl}))


def prefill_sets(num_tokens: int, context: int, topk: int, device):
    """One request, query positions context-num_tokens .. context-1: SWA range (window 128) +
    C4A top-k (indices form, random among the (p+1)//4 complete compressed entries)."""
    i32 = dict(dtype=torch.int32, device=device)
    pos = torch.arange(context - num_tokens, context, device=device)
    swa_cols = -(-context // SWA_BLOCK)
    swa_cache = random_cache(swa_cols * SWA_BLOCK, SWA_BLOCK, device)
    swa = CandidateSet(cache=swa_cache, lengths=torch.clamp(pos + 1, max=SWA_WINDOW).to(**i32),
                       block_table=torch.randperm(swa_cols, device=device).to(torch.int32)[None],
                       token_to_req=torch.zeros(num_tokens, **i32),
                       starts=torch.clamp(pos - SWA_WINDOW + 1, min=0).to(**i32))
    n_comp = context // 4
    c4a_cache = random_cache(n_comp, C4A_BLOCK, device)
    local = torch.rand(num_tokens, n_comp, device=device).argsort(dim=1)[:, :topk]
    local = torch.minimum(local, ((pos + 1) // 4 - 1)[:, None].clamp(min=0))
    perm = torch.randperm(-(-n_comp // C4A_BLOCK), device=device)
    idx = (perm[local // C4A_BLOCK] * C4A_BLOCK + local % C4A_BLOCK).to(torch.int32)
    c4a = CandidateSet(cache=c4a_cache, lengths=torch.full((num_tokens,), topk, **i32), indices=idx)
    unique = n_comp + swa_cols * SWA_BLOCK
    return [c4a, swa], unique


#: Kernel configs timed by ``--sweep``: (BLOCK_H, BLOCK_N, num_warps, num_stages).
SWEEP_CONFIGS = [(bh, bn, w, st) for bh in (64, 32) for bn in (16, 32, 64) for w in (4, 8) for st in (1, 2)]


def sweep(q, sets, ceil: Ceilings, configs=None) -> list[Row]:
    """Time the decode kernel ``configs`` (default SWEEP_CONFIGS; split-KV factor of the default
    config), then the default config at several split-KV factors;
    prints one line per config as it goes (us and % of floor) and returns the rows."""
    num_tokens, num_heads, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(num_tokens, num_heads, device=q.device)
    sink = torch.zeros(num_heads, device=q.device)
    n = sum(s.lengths.max().item() for s in sets)
    base = kernel_config(num_tokens, num_heads, D, n, q.device)
    rows = []
    print(f"sweep decode h{num_heads} B{num_tokens} (default {base}):", flush=True)
    for bh, bn, w, st in SWEEP_CONFIGS if configs is None else configs:
        splits = base.num_splits  # 1 at B = 256 (the grid fills the GPU)
        cfg = KernelConfig(bh, bn, splits, w, st)
        try:
            us = median_us(lambda: launch(q, sets, SCALE, sink, out, lse, None, None, cfg), warmup_ms=5, rep_ms=20)
        except Exception as e:  # noqa: BLE001 - report configs that fail to compile or launch
            print(f"  {cfg}: failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        row = Row(f"sweep h{num_heads} B{num_tokens} bh{bh} n{bn} w{w} s{st} k{splits}", us,
                  flops(num_tokens, num_heads, n), decode_bytes(num_tokens, num_heads, n))
        print(f"  BLOCK_H={bh} BLOCK_N={bn} warps={w} stages={st} splits={splits}: {us:8.1f} us "
              f"{100 * floor_us(row, ceil) / us:5.1f}% of floor", flush=True)
        rows.append(row)
    variants = [(k, False) for k in (1, 2, 3, 4, 6)] + [(base.num_splits, True)]
    for splits, lazy in variants:  # split-KV also evens out the last wave (B * tiles / SMs programs)
        cfg = KernelConfig(base.block_h, base.block_n, splits, base.num_warps, base.num_stages, lazy)
        us = median_us(lambda: launch(q, sets, SCALE, sink, out, lse, None, None, cfg), warmup_ms=5, rep_ms=20)
        row = Row(f"sweep h{num_heads} B{num_tokens} default k{splits}" + (" lazy" if lazy else ""), us,
                  flops(num_tokens, num_heads, n), decode_bytes(num_tokens, num_heads, n))
        print(f"  default with splits={splits}{' lazy_rescale' if lazy else ''}: {us:8.1f} us "
              f"{100 * floor_us(row, ceil) / us:5.1f}% of floor", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true", help="also sweep kernel configs for decode h64/h128 B256")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    ceil = Ceilings.measure() if cuda and not args.no_ceilings else Ceilings()
    torch.manual_seed(0)
    rows: list[Row] = []
    batches = (64, 256, 1024) if not args.smoke else (2,)
    heads = (64, 128) if not args.smoke else (4,)
    topk, ctx_1m, ctx_64k = (512, 8192, 512) if not args.smoke else (64, 96, 32)
    for h in heads:
        for b in batches:
            q = torch.randn(b, h, D, device=device).to(torch.bfloat16)
            sets = [disjoint_indices(b, topk, device), per_request_range(b, SWA_WINDOW, SWA_BLOCK, device)]
            run_case(f"decode C4A {topk}+{SWA_WINDOW} h{h} B{b}", q, sets, topk + SWA_WINDOW, rows)
            if args.sweep and b == 256:
                rows += sweep(q, sets, ceil)
            elif args.sweep and b == 64:
                rows += sweep(q, sets, ceil, configs=[])  # split-KV factors only
            if h == heads[0] and b == batches[0]:
                run_case(f"decode C4A {topk}+{SWA_WINDOW} h{h} B{b}", q, sets, topk + SWA_WINDOW, rows,
                         impl="reference")
            del sets
    for h in heads:
        for b in batches[:2]:
            for label, n in (("64K", ctx_64k), ("1M", ctx_1m)):
                q = torch.randn(b, h, D, device=device).to(torch.bfloat16)
                sets = [per_request_range(b, n, C128A_BLOCK, device), per_request_range(b, SWA_WINDOW, SWA_BLOCK, device)]
                run_case(f"decode C128A@{label} {n}+{SWA_WINDOW} h{h} B{b}", q, sets, n + SWA_WINDOW, rows)
                del sets
    num_tokens, context = (4096, 65536) if not args.smoke else (8, 256)
    # h=8: a TP-sharded rank; there the SWA range is gathered once per block of 8 tokens.
    for h in (*heads, 8):
        q = torch.randn(num_tokens, h, D, device=device).to(torch.bfloat16)
        sets, unique = prefill_sets(num_tokens, context, topk, device)
        run_case(f"prefill {num_tokens} tok C4A {topk}+{SWA_WINDOW} h{h} @{context}", q, sets, topk + SWA_WINDOW,
                 rows, unique=unique, prefill=True)
        del sets
    print_table("sparse MLA attention (fp8_ds_mla, sink)", rows, ceil)


if __name__ == "__main__":
    main()
