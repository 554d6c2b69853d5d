"""Prefill time against top-k on the GPU: where a CTA's fixed cost ends and its per-chunk cost starts.

FlashMLA's ``flash_mla_sparse_fwd`` inputs (4096 query tokens, one set of top-k rows out of 16384
bf16 rows, sink), top-k 128 ... 2048 (FlashMLA takes multiples of 128), through
``dsv4attn.flash_mla_sparse_fwd`` and, when ``flash_mla`` imports (``--flashmla-path``), through
FlashMLA's; CUDA-graph replay. A CTA of either library takes one (token, 64-head tile) and walks
its top-k in 64-row chunks, one CTA per SM at a time, so time ~ waves * (fixed + chunks *
per_chunk); the least-squares line over the sweep gives both terms per CTA, in us.

    python3 -m scripts.prefill_sweep [--flashmla-path DIR] [--heads 64,128] [--label NAME]
        [--kernel-config FIELD=VALUE,...]

``--kernel-config`` changes KernelConfig fields in every dispatch of this process (as
``benchmarks.bench_vs_flashmla --kernel-config``), so that two runs fit a switch's two settings.
"""

from __future__ import annotations

import argparse
import math

import torch

import dsv4attn
from benchmarks.bench_vs_flashmla import D, SCALE, load_flashmla, override_kernel_config
from benchmarks.common import graph_us, line_fit

TOPKS = (128, 256, 512, 1024, 2048)  # FlashMLA takes multiples of 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flashmla-path")
    ap.add_argument("--heads", default="64,128")
    ap.add_argument("--label", default="dsv4attn")
    ap.add_argument("--no-flashmla", action="store_true")
    ap.add_argument("--kernel-config", default="", help="KernelConfig fields for every dispatch: a=1,b=True")
    args = ap.parse_args()
    if args.kernel_config:
        override_kernel_config(args.kernel_config)
    fm = None if args.no_flashmla else load_flashmla(args.flashmla_path)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    s_q, s_kv = 4096, 16384
    for h in (int(x) for x in args.heads.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(0)
        kv = torch.randn(s_kv, 1, D, device="cuda", generator=gen).to(torch.bfloat16)
        q = (torch.randn(s_q, h, D, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        sink = torch.randn(h, device="cuda", generator=gen)
        perm = torch.rand(s_q, s_kv, device="cuda", generator=gen).argsort(dim=1).to(torch.int32)
        waves = math.ceil(s_q * (h // 64) / sms)
        rows: dict[str, list[float]] = {args.label: []}
        if fm is not None:
            rows["FlashMLA"] = []
        for topk in TOPKS:
            idx = perm[:, :topk].contiguous()[:, None, :]
            line = [f"h{h} top-k {topk:5d}"]
            o_ref = None
            for name in rows:
                lib = dsv4attn if name == args.label else fm

                def fn(lib=lib, idx=idx):
                    return lib.flash_mla_sparse_fwd(q, kv, idx, SCALE, D, attn_sink=sink)

                try:
                    o, _, lse = fn()
                    us = graph_us(fn, calls=10)
                except Exception as e:  # noqa: BLE001 - report and go on
                    line.append(f"{name} failed {type(e).__name__}: {str(e)[:80]}")
                    rows[name].append(float("nan"))
                    continue
                rows[name].append(us)
                agree = ""
                if o_ref is None:
                    o_ref = (o.float(), lse)
                else:
                    agree = (f" (|d out| {(o.float() - o_ref[0]).abs().max().item():.1e}"
                             f" |d lse| {(lse - o_ref[1]).abs().max().item():.1e})")
                line.append(f"{name} {us:8.1f} us{agree}")
            print("  ".join(line), flush=True)
        for name, us in rows.items():
            pts = [(t / 64, u) for t, u in zip(TOPKS, us) if u == u]
            if len(pts) < 2:
                continue
            a, b = line_fit([p[0] for p in pts], [p[1] / waves for p in pts])
            print(f"h{h} {name}: per CTA fixed {a:.2f} us, per 64-row chunk {b:.3f} us over {waves} waves",
                  flush=True)


if __name__ == "__main__":
    main()
