"""Offline sm90 compile report of the attention kernels: registers, spills, shared memory.

No GPU needed: compiles with Triton's bundled ptxas for ``GPUTarget("cuda", 90, 32)`` and prints
one line per kernel config (production layout 448 + 64, fp8 pages: indices-form C4A + range-form
SWA for decode, two range sets for prefill). Pointer and int arguments are declared 16-byte
divisible where the real launch would specialise them so (page strides are multiples of 16).

    python -m scripts.sm90_report                 # default grid (from the repository root)
    python -m scripts.sm90_report --quick         # only the default configs
"""

from __future__ import annotations

import argparse
import inspect
import re
import subprocess
import tempfile
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dsv4attn.kernels.sparse_attn import _sparse_mla_attn_kernel, _sparse_mla_combine_kernel
from dsv4attn.kernels.sparse_attn_prefill import _sparse_mla_prefill_kernel
from dsv4attn.kv_cache.layout import PRODUCTION_LAYOUT as LAY
from dsv4attn.ops.sparse_attn_launch import geometry

TARGET = GPUTarget("cuda", 90, 32)
#: Integer arguments that are multiples of 16 in real launches (strides of q/out/pages).
DIV16 = re.compile(r"(stride_q|stride_o|stride_blk|stride_lse|stride_max|stride_idx|stride_bt)")
FLOATS = {"qk_scale"}


def compile_report(fn, constexprs: dict, num_warps: int, num_stages: int, q_dtype: str = "bf16") -> dict:
    """Compile ``fn`` for sm90 with ``constexprs``; return n_regs, n_spills, shared bytes."""
    names = list(inspect.signature(fn.fn).parameters)
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in constexprs:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            ty = {"q_ptr": q_dtype, "out_ptr": q_dtype, "lse_ptr": "fp32", "max_ptr": "fp32", "part_o_ptr": "fp32",
                  "part_lse_ptr": "fp32", "sink_ptr": "fp32"}.get(n)
            if ty is None:
                ty = "u8" if "cache" in n else "i32"
            sig[n] = "*" + ty
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in FLOATS:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if DIV16.search(n):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    t0 = time.time()
    k = triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))
    regs, spills = ptxas_usage(k.asm["ptx"], k.metadata.name)
    return dict(regs=regs, spills=spills, smem=k.metadata.shared, secs=time.time() - t0)


def ptxas_usage(ptx: str, name: str) -> tuple[int, int]:
    """Registers and spill bytes (stores) that the installed Triton's bundled ptxas reports for
    sm_90a: Triton 3.9's CUDA 13 ``ptxas-blackwell`` (it emits PTX 9.x), or ``ptxas`` where the
    bundle has no other (Triton 3.6, the GPU machine's)."""
    bundle = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptxas = bundle / "ptxas-blackwell" if (bundle / "ptxas-blackwell").exists() else bundle / "ptxas"
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "k.ptx"
        f.write_text(ptx)
        res = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(f), "-o", str(Path(d) / "k.cubin")],
                             capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(res.stderr[-2000:])
    text = res.stderr + res.stdout
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else -1


def geo() -> dict:
    return dict(geometry(LAY.head_dim, LAY.nope_dim), DATA_BYTES=LAY.data_bytes, SCALE_BYTES=LAY.scale_bytes,
                CPU_INTERP=False)


def decode_constexprs(block_h: int, block_n: int, partial: bool, out_bf16: bool = True, lazy: bool = False,
                      v_mask: int = 15, prefetch: bool = False) -> dict:
    return dict(geo(), OUT_BF16=out_bf16, A_FP8=True, A_RANGE=False, HAS_B=True, B_FP8=True, B_RANGE=True,
                HAS_SINK=True, WRITE_MAX=False, WRITE_PARTIAL=partial, BLOCK_H=block_h, BLOCK_N=block_n, LAZY=lazy,
                V_MASK=v_mask, PREFETCH=prefetch, A_LEN=True, B_LEN=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", action="store_true", help="only the default config and the decode variants")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, target sm90; production layout {LAY.nope_dim}+{LAY.rope_dim}")
    if args.variants:
        grid = [(64, 32, 8, 1)]
    elif args.quick:  # the defaults of kernel_config (64-head tiles: 64-wide chunks)
        grid = [(64, 64, 8, 1), (64, 32, 8, 1), (16, 32, 4, 1), (32, 32, 8, 1)]
    else:
        grid = [(bh, bn, w, st) for bh in (64, 32, 16) for bn in (16, 32, 64) for w in (4, 8) for st in (1, 2)]
    print("decode kernel (C4A indices + SWA range, sink, final write):")
    for bh, bn, w, st in grid:
        r = compile_report(_sparse_mla_attn_kernel, decode_constexprs(bh, bn, False), w, st)
        print(f"  BLOCK_H={bh:3d} BLOCK_N={bn:3d} warps={w} stages={st}: regs {r['regs']:3d} spills {r['spills']:5d} "
              f"smem {r['smem'] / 1024:6.1f} KiB  ({r['secs']:.0f}s)", flush=True)
    print("decode kernel variants (prefetch, d_v split: V_MASK 1 = dims 0-255, 14 = the rest):")
    for bh, bn, w, vm, pf in ((64, 32, 8, 15, True), (64, 32, 8, 1, False), (64, 32, 8, 14, False),
                              (64, 32, 8, 1, True), (64, 32, 8, 14, True), (64, 64, 8, 1, True),
                              (64, 32, 4, 1, True), (64, 32, 4, 14, True)):
        r = compile_report(_sparse_mla_attn_kernel, decode_constexprs(bh, bn, False, v_mask=vm, prefetch=pf), w, 1)
        print(f"  BLOCK_H={bh} BLOCK_N={bn} warps={w} V_MASK={vm:2d} prefetch={pf:d}: regs {r['regs']} "
              f"spills {r['spills']} smem {r['smem'] / 1024:.1f} KiB", flush=True)
    if args.variants:
        return
    print("decode kernel, split-KV partial write, fp32 q/out:")
    r = compile_report(_sparse_mla_attn_kernel, decode_constexprs(64, 32, True), 8, 1)
    print(f"  partial  BLOCK_H=64 BLOCK_N=32 warps=8: regs {r['regs']} spills {r['spills']} smem {r['smem']}")
    r = compile_report(_sparse_mla_attn_kernel, decode_constexprs(64, 32, False, False), 8, 1, q_dtype="fp32")
    print(f"  fp32 q   BLOCK_H=64 BLOCK_N=32 warps=8: regs {r['regs']} spills {r['spills']} smem {r['smem']}")
    for bh, bn, w in ((64, 32, 8), (16, 32, 4)):
        r = compile_report(_sparse_mla_attn_kernel, decode_constexprs(bh, bn, False, lazy=True), w, 1)
        print(f"  lazy rescale BLOCK_H={bh} BLOCK_N={bn} warps={w}: regs {r['regs']} spills {r['spills']} "
              f"smem {r['smem']}")
    print("prefill kernel (two range sets, 64 rows):")
    for bm, bh, bn, w in ((8, 8, 32, 8), (8, 8, 32, 4), (64, 1, 32, 8), (2, 32, 32, 8), (8, 8, 64, 8)):
        c = dict(geo(), OUT_BF16=True, A_FP8=True, HAS_B=True, B_FP8=True, HAS_SINK=True, WRITE_PARTIAL=False,
                 BLOCK_M=bm, BLOCK_H=bh, BLOCK_N=bn)
        r = compile_report(_sparse_mla_prefill_kernel, c, w, 1)
        print(f"  BLOCK_M={bm} BLOCK_H={bh} BLOCK_N={bn} warps={w}: regs {r['regs']} spills {r['spills']} "
              f"smem {r['smem'] / 1024:.1f} KiB", flush=True)
    c = dict(HEAD_DIM=512, D_PAD=512, HAS_SINK=True, OUT_BF16=True, S_PAD=16, CPU_INTERP=False)
    r = compile_report(_sparse_mla_combine_kernel, c, 4, 1)
    print(f"combine S_PAD=16 warps=4: regs {r['regs']} spills {r['spills']} smem {r['smem']}")


if __name__ == "__main__":
    main()
