"""GPU check of the attention kernels across kernel configs (run on the H200; CPU works too, slowly).

For the production layout (448 + 64, fp8 pages, NaN-poisoned unused pages), head counts
1/3/8/64/128, candidate sets in indices form, range form and both, split-KV 1 and 2, it runs the
Triton path with several explicit kernel configs (BLOCK_H, BLOCK_N, num_warps, num_stages),
the default config, the prefill path and the reference, and prints per run the max out error
against the fp64 oracle next to the bound of the test suite (2 x the bf16 run's error + one
bf16 ulp), the max lse error, and OK/BAD. A summary lists the configs with any BAD run.

    python -m scripts.gpu_attn_debug            # all configs (from the repository root)
    python -m scripts.gpu_attn_debug --quick    # default + the old failing config
    python -m scripts.gpu_attn_debug --heads 3 64 --combos idx+range   # a subset

Each config compiles once per (set forms, split) variant: the full run compiles ~100 kernels.
"""

from __future__ import annotations

import argparse
import math
import os
import zlib

import torch

if not torch.cuda.is_available():  # CPU: Triton's interpreter (as tests/conftest.py does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsv4attn.ops.sparse_attn import sparse_mla_attention  # noqa: E402
from dsv4attn.ops.sparse_attn_launch import KernelConfig, kernel_config, launch  # noqa: E402
from dsv4attn.testing.attention_oracle import PROD_LAYOUT, SetSpec, build_set, make_sink, oracle  # noqa: E402

#: (BLOCK_H, BLOCK_N, num_warps, num_stages); the first is the config that failed on Triton 3.6.
CONFIGS = [(16, 16, 8, 2), (16, 16, 4, 1), (16, 32, 4, 1), (16, 32, 8, 1), (16, 64, 4, 1), (32, 32, 4, 1),
           (32, 32, 8, 1), (32, 64, 8, 1), (64, 16, 8, 1), (64, 32, 8, 1), (64, 32, 8, 2), (64, 64, 8, 1),
           (64, 32, 4, 1)]
COMBOS = {
    "idx": [SetSpec("indices", True, 64, 130)],
    "range": [SetSpec("range", True, 64, 128)],
    "idx+range": [SetSpec("indices", True, 64, 130), SetSpec("range", True, 64, 128)],
}


def errors(out, lse, ref, base) -> tuple[float, float, float, bool]:
    """(max out error, its bound, max lse error, ok) with the test suite's rule."""
    ref_o, ref_l = ref
    base_o, base_l = base
    out = out.detach().cpu().double()
    lse = lse.detach().cpu().double()
    amax = ref_o.abs().max().item()
    ulp = 2.0 ** (math.floor(math.log2(amax)) - 7) if amax > 0 else 0.0
    err = (out - ref_o).abs().max().item() if not torch.isnan(out).any() else float("nan")
    bound = 2 * (base_o - ref_o).abs().max().item() + ulp
    fin = torch.isfinite(ref_l)
    lerr = (lse[fin] - ref_l[fin]).abs().max().item() if fin.any() else 0.0
    lbound = 2 * (base_l[fin] - ref_l[fin]).abs().max().item() + 1e-5 * (ref_l[fin].abs().max().item() + 1) \
        if fin.any() else 0.0
    same_inf = torch.equal(torch.isinf(lse), torch.isinf(ref_l))
    ok = err <= bound and lerr <= lbound and same_inf
    return err, bound, lerr, ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", type=int, default=3)
    ap.add_argument("--heads", type=int, nargs="*", default=[1, 3, 8, 64, 128])
    ap.add_argument("--combos", nargs="*", default=list(COMBOS), choices=list(COMBOS))
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    configs = CONFIGS[:1] if args.quick else CONFIGS
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}")
    bad: dict[str, int] = {}
    runs = 0
    num_tokens = args.tokens
    for num_heads in args.heads:
        for combo in args.combos:
            specs = COMBOS[combo]
            name = f"h{num_heads}-{combo}"
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            req = [t * 2 // num_tokens for t in range(num_tokens)]
            built = [build_set(s, num_tokens, req, PROD_LAYOUT, gen, device) for s in specs]
            sets = [b.cset for b in built]
            q = torch.randn(num_tokens, num_heads, PROD_LAYOUT.head_dim, generator=gen).to(torch.bfloat16)
            sink = make_sink(num_heads, "finite", gen)
            scale = PROD_LAYOUT.head_dim**-0.5 * 2.0
            ref, base = oracle(q, built, scale, sink), oracle(q, built, scale, sink, low_precision=True)
            qd, sd = q.to(device), sink.to(device)
            n = sum(s.width for s in specs)
            default = kernel_config(num_tokens, num_heads, PROD_LAYOUT.head_dim, n, device, 1)
            runs_here = [("reference", None, False), ("prefill", None, True)]
            for splits in (1, 2):
                for bh, bn, w, st in configs:
                    runs_here.append((f"bh{bh} n{bn} w{w} s{st}", KernelConfig(bh, bn, splits, w, st), False))
                d = default
                for lazy in (False, True):
                    runs_here.append((f"default bh{d.block_h} n{d.block_n} w{d.num_warps} s{d.num_stages}"
                                      + (" lazy" if lazy else ""),
                                      KernelConfig(d.block_h, d.block_n, splits, d.num_warps, d.num_stages, lazy),
                                      False))
            for label, cfg, prefill in runs_here:
                try:
                    if label == "reference":
                        out, lse = sparse_mla_attention(qd, sets, scale, sd, impl="reference")
                    elif prefill:
                        out, lse = sparse_mla_attention(qd, sets, scale, sd, impl="triton", prefill=True)
                    else:
                        out = torch.empty_like(qd)
                        lse = torch.empty(num_tokens, num_heads, device=device)
                        launch(qd, sets, scale, sd, out, lse, None, None, cfg)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    err, bound, lerr, ok = errors(out, lse, ref, base)
                    msg = f"out err {err:9.3g} (bound {bound:8.3g})  lse err {lerr:9.3g}  {'OK' if ok else 'BAD'}"
                except Exception as e:  # noqa: BLE001 - a failing config is a result too
                    ok, msg = False, f"FAILED {type(e).__name__}: {str(e)[:120]}"
                key = label if cfg is None else f"{label} k{cfg.num_splits}"
                runs += 1
                if not ok:
                    bad[key] = bad.get(key, 0) + 1
                print(f"{name:14s} {key:34s} {msg}", flush=True)
    print(f"\n{runs} runs; configs with BAD runs: " + (", ".join(f"{k} ({v})" for k, v in sorted(bad.items()))
                                                      if bad else "none"))


if __name__ == "__main__":
    main()
