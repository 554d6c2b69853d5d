"""Launch the default decode attention kernel a few times on one case, for Nsight Compute.

    ncu -k regex:sparse_mla_attn --launch-skip 2 -c 1 --section WarpStateStats \\
        python3 -m scripts.attn_profile --heads 64 --batch 256

Same inputs as ``scripts/attn_variants.py``: decode, 512 + 128 fp8 candidates per token, sink;
with ``--prefill TOPK``, its prefill rows instead (``--batch`` query tokens, bf16 pages of 16384
rows, one indices-form set of TOPK rows per token, sink). With ``--flashmla PATH`` FlashMLA runs
on the same cache bytes instead, for the same sections of its kernel: its decode
``flash_mla_with_kvcache`` (``ncu -k regex:splitkv_mla_fp8_sparse`` ...), or with ``--prefill``
its ``flash_mla_sparse_fwd`` (``ncu -k regex:sparse_attn_fwd_kernel`` ...): both libraries
profiled on one machine.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from benchmarks.bench_vs_flashmla import SCALE, D
from dsv4attn.ops.sparse_attn_launch import kernel_config, kernel_config_changes, launch
from dsv4attn.ops.candidate_set import CandidateSet
from scripts.attn_variants import prefill_inputs, sets_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--skip", type=int, default=0, help="sm90 kernel parts to skip (KernelConfig.sm90_skip)")
    ap.add_argument("--config", default="", help="KernelConfig fields to change, e.g. sm90_cluster=False")
    ap.add_argument("--prefill", type=int, default=0, metavar="TOPK", help="the prefill rows' inputs (bf16 pages)")
    ap.add_argument("--flashmla", default="", metavar="PATH",
                    help="run FlashMLA's decode, or with --prefill its prefill (built package at PATH)")
    a = ap.parse_args()
    over = kernel_config_changes(a.config)  # checked before anything runs
    gen = torch.Generator(device="cuda").manual_seed(0)
    if a.prefill:
        kv, idx, q, sink, lengths = prefill_inputs(a.batch, a.heads, a.prefill, gen)
        sets = [CandidateSet(cache=kv, lengths=lengths, indices=idx)]
    else:
        q = (torch.randn(a.batch, a.heads, D, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        sets = sets_for(a.batch, gen)
        sink = torch.randn(a.heads, device="cuda", generator=gen)
    if a.flashmla and a.prefill:
        run_flashmla_prefill(a.flashmla, q, sets[0], sink, a.launches)
        return
    if a.flashmla:
        run_flashmla(a.flashmla, q, sets, sink, a.launches)
        return
    out = torch.empty_like(q)
    lse = torch.empty(a.batch, a.heads, device="cuda")
    width = a.prefill or 640
    cfg = dataclasses.replace(kernel_config(a.batch, a.heads, D, width, q.device), sm90_skip=a.skip, **over)
    for _ in range(a.launches):
        launch(q, sets, SCALE, sink, out, lse, None, None, cfg)
    torch.cuda.synchronize()
    print(cfg)


def run_flashmla(path: str, q: torch.Tensor, sets: list[CandidateSet], sink: torch.Tensor, launches: int) -> None:
    """FlashMLA's decode on the same inputs: set 0 as its top-k indices, set 1 as its extra cache
    (the bench's call, one query token per request)."""
    from benchmarks.bench_vs_flashmla import flashmla_decode, load_flashmla

    fm = load_flashmla(path)
    if fm is None:
        raise SystemExit(f"no FlashMLA at {path}")
    meta, _ = fm.get_mla_metadata()
    main, extra = sets
    if main.indices is None or extra.indices is None:
        raise SystemExit("FlashMLA's decode takes indices-form sets")
    for _ in range(launches):
        flashmla_decode(fm, meta, q[:, None], main.cache, extra.cache, main.indices[:, None], extra.indices[:, None],
                        sink)
    torch.cuda.synchronize()
    print(f"FlashMLA from {path}: {launches} decode calls")


def run_flashmla_prefill(path: str, q: torch.Tensor, cset: CandidateSet, sink: torch.Tensor, launches: int) -> None:
    """FlashMLA's prefill on the same rows: the pages as its [rows, 1, D] kv, the set's indices as
    its top-k (the bench's call)."""
    from benchmarks.bench_vs_flashmla import load_flashmla

    fm = load_flashmla(path)
    if fm is None:
        raise SystemExit(f"no FlashMLA at {path}")
    kv = cset.cache.reshape(-1, 1, D)
    for _ in range(launches):
        fm.flash_mla_sparse_fwd(q, kv, cset.indices[:, None, :], SCALE, D, attn_sink=sink)
    torch.cuda.synchronize()
    print(f"FlashMLA from {path}: {launches} prefill calls")


if __name__ == "__main__":
    main()
