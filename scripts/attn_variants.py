"""Time decode-kernel variants of the sparse attention on the GPU (one line per variant).

Cases as in ``benchmarks/bench_vs_flashmla.py`` (fp8_ds_mla pages written by dsv4attn, 512
disjoint top-k + 128 SWA candidates per token, both indices form, sink); the variants are
:class:`dsv4attn.ops.sparse_attn_launch.KernelConfig` values launched through ``launch``. Also prints
the host time of one eager FlashMLA-compatible call (launch overhead, no device sync).

    python3 -m scripts.attn_variants [--skips] [--quick] [--decode-sweep] [--h128]
    python3 -m scripts.attn_variants --prefill [--bf16] [--no-single] [--rows-per-block N] [--max-logits] [--rounds N]

(from the repository root; graph replays)
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

import dsv4attn
from benchmarks.bench_vs_flashmla import BLOCK, D, SCALE, disjoint_slots, fp8_cache
from benchmarks.common import graph_us, interleaved_graph_us, line_fit
from dsv4attn.kv_cache.layout import quantize_fp8_ds_mla
from dsv4attn.ops.candidate_set import CandidateSet
from dsv4attn.ops.sparse_attn_launch import kernel_config, launch

#: (label, overrides of the default KernelConfig). The sm90 "skip" variants time the Gluon
#: kernel with parts left out (1 dequant, 2 MMAs, 4 page gathers; results then differ): what
#: each part costs when the others run.
#: (heads, batch) of the decode cases timed.
CASES = ((64, 64), (64, 256), (64, 1024), (128, 64), (128, 256), (128, 1024))
#: With ``--skips``, only these cases.
SKIP_CASES = ((64, 256),)
VARIANTS = [
    ("default", {}),
    ("ws, h128 as two CTAs", dict(sm90_cluster=False)),
    ("ws, one producer", dict(sm90_dual_producer=False, sm90_cluster=False)),
    ("ws, one producer, merged", dict(sm90_dual_producer=False, sm90_merge_sets=True, sm90_cluster=False)),
    ("ws, one producer, not ahead", dict(sm90_dual_producer=False, sm90_pipe_min_chunks=10**9, sm90_cluster=False)),
    ("ws, h128 cluster, one producer", dict(sm90_dual_producer=False, sm90_cluster=True)),
    ("ws, h128 cluster, one producer, not ahead",
     dict(sm90_dual_producer=False, sm90_cluster=True, sm90_pipe_min_chunks=10**9)),
    ("ws, fp32-chain dequant", dict(sm90_dequant_bits=False)),
    ("sm90 single-partition", dict(sm90_ws=False)),
    ("ws without L2 prefetch", dict(sm90_l2_prefetch=False)),
    ("portable 64/64/w8", dict(sm90=False)),
]
#: With ``--skips``: the single-partition sm90 kernel with parts left out (profiling only).
SKIP_VARIANTS = [
    ("sm90 no dequant", dict(sm90_skip=1, sm90_ws=False)),
    ("sm90 no mma", dict(sm90_skip=2, sm90_ws=False)),
    ("sm90 no gather", dict(sm90_skip=4, sm90_ws=False)),
    ("sm90 gather only", dict(sm90_skip=3, sm90_ws=False)),
    ("sm90 mma only", dict(sm90_skip=5, sm90_ws=False)),
    ("sm90 dequant only", dict(sm90_skip=6, sm90_ws=False)),
    ("sm90 loop only", dict(sm90_skip=7, sm90_ws=False)),
]


def sets_for(b: int, gen) -> list[CandidateSet]:
    out = []
    for k in (512, 128):
        cache = fp8_cache(b * k, "cuda", gen)
        idx = disjoint_slots(b, k, cache.shape[0] * BLOCK, "cuda", gen)[:, 0, :].contiguous()
        out.append(CandidateSet(cache=cache, lengths=torch.full((b,), k, dtype=torch.int32, device="cuda"),
                                indices=idx))
    return out


def prefill_inputs(s_q: int, h: int, topk: int, gen: torch.Generator, s_kv: int = 16384, rows_per_block: int = BLOCK):
    """The prefill rows' inputs: bf16 pages of ``s_kv`` rows (``rows_per_block`` rows a page;
    FlashMLA's prefill layout, as the bench passes it, has 1), q [s_q, h, D]
    bf16, one indices-form set of ``topk`` distinct rows per token (int32 [s_q, topk]), the
    lengths and a sink [h]."""
    kv = torch.randn(s_kv // rows_per_block, rows_per_block, D, device="cuda", generator=gen).to(torch.bfloat16)
    idx = torch.rand(s_q, s_kv, device="cuda", generator=gen).argsort(dim=1)[:, :topk].to(torch.int32)
    q = (torch.randn(s_q, h, D, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    sink = torch.randn(h, device="cuda", generator=gen)
    lengths = torch.full((s_q,), topk, dtype=torch.int32, device="cuda")
    return kv, idx, q, sink, lengths


def prefill_variants() -> None:
    """Prefill rows of benchmarks/bench_vs_flashmla.py (4096 query tokens, one indices-form set of
    top-k rows out of 16384, sink) on bf16 pages (FlashMLA's ``flash_mla_sparse_fwd`` input) and
    the same rows as fp8 pages: the warp-specialised kernel against the single-partition one and
    the q-in-registers one. ``--rows-per-block N``: pages of N rows (default 64; the bench's
    bf16 rows have 1); ``--max-logits``: the kernels also write max logits, as
    ``flash_mla_sparse_fwd`` asks; ``--rounds N`` (5): the variants' graphs are timed in turn N
    times, and each line gives the median, the range over the rounds and the range of the
    per-round ratio to the first variant."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    s_q = 4096
    rpb = int(sys.argv[sys.argv.index("--rows-per-block") + 1]) if "--rows-per-block" in sys.argv else BLOCK
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 5
    for h in (64, 128):
        for topk in (512, 2048):
            kv, idx, q, sink, lengths = prefill_inputs(s_q, h, topk, gen, rows_per_block=rpb)
            pages = {"bf16": kv} if "--bf16" in sys.argv else {"bf16": kv, "fp8": quantize_fp8_ds_mla(kv)}
            for kind, cache in pages.items():
                sets = [CandidateSet(cache=cache, lengths=lengths, indices=idx)]
                base = kernel_config(s_q, h, D, topk, q.device)
                out = torch.empty_like(q)
                lse = torch.empty(s_q, h, device="cuda")
                mx = torch.empty(s_q, h, device="cuda") if "--max-logits" in sys.argv else None
                ref = None
                fns: dict = {}
                diffs: dict = {}
                for label, over in (("single-partition", dict(sm90_ws=False, sm90_ws_bf16=False)),
                                    ("warp-specialised", dict(sm90_ws=True, sm90_ws_bf16=True)),
                                    ("q in registers", dict(sm90_ws=True, sm90_ws_bf16=True, sm90_bf16_qreg=True)),
                                    ("qreg, col copies", dict(sm90_ws=True, sm90_ws_bf16=True, sm90_bf16_qreg=True,
                                                              sm90_qreg_col_copies=True)),
                                    ("ws fp32-chain dq", dict(sm90_ws=True, sm90_dequant_bits=False))):
                    if (label == "ws fp32-chain dq") if kind == "bf16" else label.startswith("q"):  # qreg: bf16 only
                        continue
                    if label == "single-partition" and "--no-single" in sys.argv:  # |d| then vs the ws kernel
                        continue
                    cfg = dataclasses.replace(base, **over)
                    try:
                        launch(q, sets, SCALE, sink, out, lse, mx, None, cfg)
                        if ref is None:
                            ref = (out.float().clone(), lse.clone())
                        diffs[label] = ((out.float() - ref[0]).abs().max().item(), (lse - ref[1]).abs().max().item())
                        fns[label] = lambda cfg=cfg: launch(q, sets, SCALE, sink, out, lse, mx, None, cfg)
                    except Exception as e:  # noqa: BLE001 - report and go on
                        print(f"prefill h{h} top-k {topk} {kind} {label}: failed {type(e).__name__}: {str(e)[:160]}",
                              flush=True)
                # The variants' graphs timed in turn (rounds in alternating order): see
                # benchmarks.common.interleaved_graph_us.
                times = interleaved_graph_us(fns, rounds=rounds)
                first = next(iter(times), None)
                for label, ts in times.items():
                    us = sorted(ts)[len(ts) // 2]
                    rel = [a / b for a, b in zip(ts, times[first])]
                    d_o, d_l = diffs[label]
                    print(f"prefill h{h} top-k {topk} {kind:4s} {label:18s}: {us:9.1f} us (rounds {min(ts):.0f}-"
                          f"{max(ts):.0f}, / first {min(rel):.3f}-{max(rel):.3f})   |d out| {d_o:.1e} "
                          f"|d lse| {d_l:.1e} (vs the first kernel)", flush=True)


def decode_sweep() -> None:
    """Decode at a full GPU (B=1024) with 64 SWA + k compressed candidates per token, k = 64 ..
    1984 (2 .. 32 chunks): graph time against chunks, fitted per CTA as fixed + chunks x per chunk
    (time / waves, waves = CTAs / SMs), for h64 and h128."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    b = 1024
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    h128_only = "--h128" in sys.argv
    for h in (128,) if h128_only else (64, 128):
        q = (torch.randn(b, h, D, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        sink = torch.randn(h, device="cuda", generator=gen)
        out = torch.empty_like(q)
        lse = torch.empty(b, h, device="cuda")
        one = dict(sm90_dual_producer=False, sm90_cluster=False)
        labels = [("default", {}), ("one producer", one)]
        if not h128_only:
            labels += [("one producer, not ahead", dict(one, sm90_pipe_min_chunks=10**9)),
                       ("one producer, ahead", dict(one, sm90_pipe_min_chunks=0))]
        if h == 128:
            labels += [("two CTAs", dict(sm90_cluster=False)),
                       ("one-producer cluster", dict(sm90_dual_producer=False, sm90_cluster=True))]
        res: dict = {lab: [] for lab, _ in labels}
        for k in ((448, 960, 1984) if h128_only else (64, 192, 448, 960, 1984)):
            sets = []
            for n in (k, 64):
                cache = fp8_cache(b * n, "cuda", gen)
                idx = disjoint_slots(b, n, cache.shape[0] * BLOCK, "cuda", gen)[:, 0, :].contiguous()
                sets.append(CandidateSet(cache=cache, lengths=torch.full((b,), n, dtype=torch.int32, device="cuda"),
                                         indices=idx))
            base = dataclasses.replace(kernel_config(b, h, D, k + 64, q.device), num_splits=1)
            for lab, over in labels:
                cfg = dataclasses.replace(base, **over)
                us = graph_us(lambda: launch(q, sets, SCALE, sink, out, lse, None, None, cfg), warmup_ms=5, rep_ms=30)
                chunks = k // 64 + 1
                res[lab].append((chunks, us))
                print(f"decode sweep h{h} B{b} chunks {chunks:2d} {lab:24s}: {us:8.1f} us", flush=True)
        waves = b * (h // 64) / sms
        for lab, pts in res.items():
            icpt, slope = line_fit([float(c) for c, _ in pts], [u / waves for _, u in pts])
            print(f"fit h{h} {lab}: fixed {icpt:.2f} us / CTA, {slope:.3f} us / chunk ({waves:.2f} waves)", flush=True)


def main() -> None:
    if "--prefill" in sys.argv:
        prefill_variants()
        return
    if "--decode-sweep" in sys.argv:
        decode_sweep()
        return

    if "--skips" in sys.argv:
        variants = [v for v in VARIANTS if v[0] in ("default", "sm90 single-partition")] + SKIP_VARIANTS
    else:
        variants = VARIANTS
    if "--quick" in sys.argv:  # the warp-specialised kernel's producers only
        variants = VARIANTS[:3]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for h, b in (SKIP_CASES if "--skips" in sys.argv else CASES):
        if "--h128" in sys.argv and h != 128:
            continue
        q = (torch.randn(b, h, D, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        sets = sets_for(b, gen)
        sink = torch.randn(h, device="cuda", generator=gen)
        out = torch.empty_like(q)
        lse = torch.empty(b, h, device="cuda")
        ref_o, ref_l = dsv4attn.sparse_mla_attention(q, sets, SCALE, sink)
        base = kernel_config(b, h, D, 640, q.device)
        print(f"decode h{h} B{b} (default {base})", flush=True)
        for label, over in variants:
            for splits in sorted({base.num_splits, 1}):
                cfg = dataclasses.replace(base, num_splits=splits, **over)
                try:
                    launch(q, sets, SCALE, sink, out, lse, None, None, cfg)
                    d_o = (out.float() - ref_o.float()).abs().max().item()
                    d_l = (lse - ref_l).abs().max().item()
                    us = graph_us(lambda: launch(q, sets, SCALE, sink, out, lse, None, None, cfg), warmup_ms=5, rep_ms=30)
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"  {label:24s} splits {splits}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                print(f"  {label:24s} splits {splits}: {us:8.1f} us   |d out| {d_o:.1e} |d lse| {d_l:.1e}",
                      flush=True)
    # Host cost of one eager compat call (what eager timing adds when the GPU is idle-waiting).
    b, h = 64, 64
    q = (torch.randn(b, 1, h, D, device="cuda", generator=gen)).to(torch.bfloat16)
    sets = sets_for(b, gen)
    meta, _ = dsv4attn.get_mla_metadata()

    def call():
        return dsv4attn.flash_mla_with_kvcache(
            q, sets[0].cache.unsqueeze(-2), None, None, D, meta, softmax_scale=SCALE, is_fp8_kvcache=True,
            indices=sets[0].indices[:, None], extra_k_cache=sets[1].cache.unsqueeze(-2),
            extra_indices_in_kvcache=sets[1].indices[:, None], attn_sink=torch.zeros(h, device="cuda"))

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        call()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"host time per eager compat call (h64 B64): {(t1 - t0) / 50 * 1e6:.1f} us", flush=True)
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        call()
    pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(18)


if __name__ == "__main__":
    main()
