"""dsv4attn against FlashMLA, side by side in one process on the same inputs (issue 9's table).

Decode rows: B requests of one query token, h heads; 512 compressed candidates (indices form,
disjoint per token, block size 64) + 128 SWA candidates in a second cache (FlashMLA's
``extra_k_cache``), attention sink. Both caches are written once by
``dsv4attn.kv_cache.layout.quantize_fp8_ds_mla`` and handed to FlashMLA as ``torch.float8_e4m3fn`` views of
the same bytes; dsv4attn runs through its FlashMLA-compatible ``flash_mla_with_kvcache`` with
the same arguments. Prefill rows: 4096 query tokens over a bf16 kv of 16384 rows, top-k 512 or
2048 random rows per token, sink, through both libraries' ``flash_mla_sparse_fwd``; an extra
dsv4attn row per case reads the same kv as fp8_ds_mla pages directly (no bf16 staging).

Times are medians of ``triton.testing.do_bench`` (eager launches, as an engine without CUDA
graphs sees them; do_bench clears L2 before each call, which hides host time up to that clear's
length) and, with ``--graphs``, of CUDA-graph replays of 10 calls. ``--back-to-back`` adds the
wall time per call of 100 eager calls in a row (the throughput of an eager loop: host or device,
whichever is slower). The graph times
of a case's kernels are taken in turn, ``--rounds`` times (5; the order reversed every other
round; each turn runs 100 ms before it is timed for 100 ms), and each is the median of its
rounds: an H100 lowers its clock to hold its power limit under these loads, so each version
should run at the clock its own draw allows while the card's slow drift falls on every version
alike. The table gives the lowest and highest per-round ratio too. Agreement: bf16 out within
2e-3 abs and lse within 1e-3 of FlashMLA, checked on every row before timing.

    python -m benchmarks.bench_vs_flashmla --flashmla-path /tmp/flashmla_build
    python -m benchmarks.bench_vs_flashmla --smoke      # CPU: tiny sizes, dsv4attn only
    python -m benchmarks.bench_vs_flashmla --flashmla-path ... --graphs --decode-sweep   # fixed / per chunk

Without ``flash_mla`` importable it prints dsv4attn's times and says FlashMLA was not found.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch

import dsv4attn
from benchmarks.common import Ceilings, back_to_back_us, interleaved_graph_us, line_fit, median_us
from dsv4attn.kv_cache.layout import PRODUCTION_LAYOUT as LAYOUT
from dsv4attn.kv_cache.layout import quantize_fp8_ds_mla
from dsv4attn.ops.candidate_set import CandidateSet

D = LAYOUT.head_dim  # 512
SCALE = D**-0.5
BLOCK = 64
OUT_TOL = 2e-3
LSE_TOL = 1e-3


@dataclass
class Result:
    case: str
    flashmla_us: float | None
    dsv4attn_us: float
    floor_us: float
    max_out_diff: float | None = None
    max_lse_diff: float | None = None
    flashmla_graph_us: float | None = None
    dsv4attn_graph_us: float | None = None
    #: the lowest and highest ratio of one round's graph times (dsv4attn / FlashMLA)
    graph_ratio_lo: float | None = None
    graph_ratio_hi: float | None = None
    #: eager throughput: us per call of back-to-back calls (``--back-to-back``)
    flashmla_b2b_us: float | None = None
    dsv4attn_b2b_us: float | None = None

    @property
    def ratio(self) -> float | None:
        return self.dsv4attn_us / self.flashmla_us if self.flashmla_us else None


def graph_times(fns: dict, results: dict[str, "Result"], rounds: int, ours: str = "ours",
                theirs: str = "theirs") -> None:
    """The graph times of ``fns`` (name -> callable: dsv4attn's kernels and, where FlashMLA is
    there, ``theirs``), interleaved over ``rounds`` rounds, into ``results`` (name -> the row
    whose dsv4attn time it is; FlashMLA's time goes into every row)."""
    times = interleaved_graph_us(fns, calls=10, rounds=rounds)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731 - rounds is odd
    for name, row in results.items():
        row.dsv4attn_graph_us = med(times[name])
        if theirs in times:
            row.flashmla_graph_us = med(times[theirs])
            if name == ours:
                ratios = [a / b for a, b in zip(times[name], times[theirs])]
                row.graph_ratio_lo, row.graph_ratio_hi = min(ratios), max(ratios)


def back_to_back(row: Result, ours, theirs=None) -> None:
    """Fill ``row``'s back-to-back times (median us per call) of ``ours`` and ``theirs``."""
    row.dsv4attn_b2b_us = back_to_back_us(ours)[0]
    if theirs is not None:
        row.flashmla_b2b_us = back_to_back_us(theirs)[0]


def load_flashmla(path: str | None):
    if path:
        sys.path.insert(0, path)
    try:
        import flash_mla  # noqa: F401

        return flash_mla
    except Exception as e:  # noqa: BLE001 - report why, then run dsv4attn alone
        print(f"FlashMLA not found ({type(e).__name__}: {e}); printing dsv4attn's times only", flush=True)
        return None


def fp8_cache(num_entries: int, device, gen) -> torch.Tensor:
    """``(blocks, BLOCK, 584)`` uint8 fp8_ds_mla view written by dsv4attn from random bf16 rows."""
    blocks = -(-num_entries // BLOCK)
    x = torch.randn(blocks, BLOCK, D, device=device, generator=gen).to(torch.bfloat16)
    return quantize_fp8_ds_mla(x)


def disjoint_slots(num_tokens: int, k: int, capacity: int, device, gen) -> torch.Tensor:
    return torch.randperm(capacity, device=device, generator=gen)[: num_tokens * k].to(torch.int32).view(
        num_tokens, 1, k)


def compare(name: str, ref, got, lse_ref, lse_got) -> tuple[float, float]:
    d_out = (ref.float() - got.float()).abs().max().item()
    fin = torch.isfinite(lse_ref)
    d_lse = (lse_ref[fin] - lse_got[fin]).abs().max().item() if fin.any() else 0.0
    same_inf = torch.equal(torch.isfinite(lse_ref), torch.isfinite(lse_got))
    ok = d_out <= OUT_TOL and d_lse <= LSE_TOL and same_inf
    print(f"  {name}: max|d out| {d_out:.2e}  max|d lse| {d_lse:.2e}  {'agree' if ok else 'DISAGREE'}", flush=True)
    if not ok:
        raise SystemExit(f"{name}: dsv4attn and FlashMLA disagree beyond out {OUT_TOL} / lse {LSE_TOL}")
    return d_out, d_lse


@dataclass
class DecodeInputs:
    """One decode batch: ``topk`` candidates per token in ``main`` and ``swa`` in ``extra``
    (fp8_ds_mla caches written by dsv4attn; FlashMLA's ``[b, 1, k]`` index form), q ``[b, 1, h,
    D]``, a sink, and the same candidates as dsv4attn's indices-form ``sets``."""

    main: torch.Tensor
    extra: torch.Tensor
    idx: torch.Tensor
    eidx: torch.Tensor
    q: torch.Tensor
    sink: torch.Tensor
    sets: list[CandidateSet]


def decode_inputs(b: int, h: int, topk: int, swa: int, device, gen) -> DecodeInputs:
    main = fp8_cache(b * topk, device, gen)
    extra = fp8_cache(b * swa, device, gen)
    idx = disjoint_slots(b, topk, main.shape[0] * BLOCK, device, gen)
    eidx = disjoint_slots(b, swa, extra.shape[0] * BLOCK, device, gen)
    q = (torch.randn(b, 1, h, D, device=device, generator=gen) * 0.5).to(torch.bfloat16)
    sink = torch.randn(h, device=device, generator=gen)
    i32 = dict(dtype=torch.int32, device=device)
    sets = [CandidateSet(cache=c, lengths=torch.full((b,), i.shape[-1], **i32), indices=i[:, 0, :].contiguous())
            for c, i in ((main, idx), (extra, eidx))]
    return DecodeInputs(main, extra, idx, eidx, q, sink, sets)


def flashmla_decode(fm, meta, q, main, extra, idx, eidx, sink):
    """FlashMLA's sparse fp8 decode on this library's cache bytes (``main`` / ``extra``: [blocks,
    block, entry] uint8 pages, seen as fp8; ``q`` [B, 1, H, D]; ``idx`` / ``eidx`` [B, 1, k]): the
    call the side by side times, and ``scripts/attn_profile.py --flashmla`` profiles."""
    f8 = torch.float8_e4m3fn
    return fm.flash_mla_with_kvcache(q, main.unsqueeze(-2).view(f8), None, None, D, meta, softmax_scale=SCALE,
                                     is_fp8_kvcache=True, indices=idx, attn_sink=sink,
                                     extra_k_cache=extra.unsqueeze(-2).view(f8), extra_indices_in_kvcache=eidx)


def decode_case(fm, b: int, h: int, topk: int, swa: int, ceil: Ceilings, device, rounds: int,
                gen, b2b: bool = False, det_row: bool = True) -> list[Result]:
    """One decode row and (``det_row``) its deterministic-mode row; ``rounds``: of graph timing
    (0: none); ``b2b``: back-to-back times too."""
    name = f"decode h{h} B{b}"
    x = decode_inputs(b, h, topk, swa, device, gen)
    main, extra, idx, eidx, q, sink, sets = x.main, x.extra, x.idx, x.eidx, x.q, x.sink, x.sets
    ours_meta, _ = dsv4attn.get_mla_metadata()
    args = dict(softmax_scale=SCALE, is_fp8_kvcache=True, indices=idx, attn_sink=sink,
                extra_indices_in_kvcache=eidx)

    def ours():
        return dsv4attn.flash_mla_with_kvcache(q, main.unsqueeze(-2), None, None, D, ours_meta,
                                               extra_k_cache=extra.unsqueeze(-2), **args)

    n = topk + swa
    bytes_ = b * (n * LAYOUT.entry_bytes + n * 4 + 2 * h * D * 2 + h * 4)
    floor = max(bytes_ / ceil.copy_bytes_per_s, 2.0 * h * n * 2 * D * b / ceil.mma_flops) * 1e6
    o_ours, l_ours = ours()
    res = Result(name, None, median_us(ours), floor)
    rows, fns = dict(ours=res), dict(ours=ours)  # the rows this case returns, and what each one times
    if det_row:  # the batch-invariant mode through the op (same bytes, both sets in indices form)
        q3 = q[:, 0]

        def ours_det():
            return dsv4attn.sparse_mla_attention(q3, sets, SCALE, sink, deterministic=True)

        rows["det"] = Result(name + " (dsv4attn deterministic)", None, median_us(ours_det), floor)
        fns["det"] = ours_det
    if fm is not None:
        fm_meta, _ = fm.get_mla_metadata()

        def theirs():
            return flashmla_decode(fm, fm_meta, q, main, extra, idx, eidx, sink)

        o_fm, l_fm = theirs()
        res.max_out_diff, res.max_lse_diff = compare(name, o_fm, o_ours, l_fm, l_ours)
        if det_row:
            o_det, l_det = ours_det()
            compare(name + " deterministic", o_fm[:, 0], o_det, l_fm[..., 0], l_det)
        t_fm = median_us(theirs)
        for row in rows.values():
            row.flashmla_us = t_fm
        fns["theirs"] = theirs
    if b2b:
        back_to_back(res, ours, fns.get("theirs"))
    if rounds:
        graph_times(fns, rows, rounds)
    return list(rows.values())


def prefill_case(fm, h: int, topk: int, s_q: int, s_kv: int, ceil: Ceilings, device, rounds: int,
                 gen, b2b: bool = False) -> list[Result]:
    """One prefill row and its fp8-pages row; ``rounds``: of graph timing (0: none); ``b2b``:
    back-to-back times too."""
    name = f"prefill h{h} top-k {topk}"
    kv = (torch.randn(s_kv, 1, D, device=device, generator=gen)).to(torch.bfloat16)
    idx = torch.rand(s_q, s_kv, device=device, generator=gen).argsort(dim=1)[:, :topk].to(torch.int32)[:, None, :]
    q = (torch.randn(s_q, h, D, device=device, generator=gen) * 0.5).to(torch.bfloat16)
    sink = torch.randn(h, device=device, generator=gen)
    flops = 2.0 * h * topk * 2 * D * s_q
    bytes_ = s_kv * D * 2 + s_q * (topk * 4 + 2 * h * D * 2 + h * 8)
    floor = max(bytes_ / ceil.copy_bytes_per_s, flops / ceil.mma_flops) * 1e6

    def ours():
        return dsv4attn.flash_mla_sparse_fwd(q, kv, idx, SCALE, D, attn_sink=sink)

    o_ours, _, l_ours = ours()
    res = Result(name, None, median_us(ours), floor)
    fns = dict(ours=ours)
    # The same rows as fp8_ds_mla pages, read directly by dsv4attn (no bf16 staging copy).
    cache = quantize_fp8_ds_mla(kv.view(-1, BLOCK, D))
    cset = CandidateSet(cache=cache, lengths=torch.full((s_q,), topk, dtype=torch.int32, device=device),
                        indices=idx[:, 0, :].contiguous())

    def ours_fp8():
        return dsv4attn.sparse_mla_attention(q, [cset], SCALE, sink)

    fp8 = Result(name + " (dsv4attn fp8 pages)", None, median_us(ours_fp8), floor)
    if fm is not None:
        def theirs():
            return fm.flash_mla_sparse_fwd(q, kv, idx, SCALE, D, attn_sink=sink)

        o_fm, _, l_fm = theirs()
        res.max_out_diff, res.max_lse_diff = compare(name, o_fm, o_ours, l_fm, l_ours)
        res.flashmla_us = median_us(theirs)
        fp8.flashmla_us = res.flashmla_us
        fns["theirs"] = theirs
    if b2b:
        back_to_back(res, ours, fns.get("theirs"))
    if rounds:
        graph_times(fns, dict(ours=res), rounds)
    return [res, fp8]


def decode_sweep(fm, ceil: Ceilings, device, rounds: int, gen, smoke: bool) -> list[dict]:
    """Decode at a full GPU (B=1024) with k compressed + 128 SWA candidates per token, k = 128 ..
    1920 (4 .. 32 chunks of 64; multiples of 128, as the side by side's 512 + 128), both libraries
    timed as in the side by side (no deterministic row); each library's time fitted as ``fixed +
    chunks x per chunk`` (whole-batch us), so the two can be compared part by part without
    assuming how either schedules its CTAs (FlashMLA's decode is persistent)."""
    b, swa, ks, heads = (4, 16, (64, 128), (2,)) if smoke else (1024, 128, (128, 384, 896, 1920), (64, 128))
    out = []
    for h in heads:
        pts: dict[str, list[tuple[int, float]]] = {"dsv4attn": [], "FlashMLA": []}
        for k in ks:
            res = decode_case(fm, b, h, k, swa, ceil, device, rounds, gen, det_row=False)[0]
            chunks = -(-k // 64) + -(-swa // 64)
            ours, theirs = res.dsv4attn_graph_us or res.dsv4attn_us, res.flashmla_graph_us or res.flashmla_us
            pts["dsv4attn"].append((chunks, ours))
            if theirs is not None:
                pts["FlashMLA"].append((chunks, theirs))
            print(f"decode sweep h{h} B{b} chunks {chunks:2d}: dsv4attn {ours:9.1f} us"
                  + ("" if theirs is None else f"  FlashMLA {theirs:9.1f} us  ratio {ours / theirs:.2f}x"), flush=True)
        for lib, xy in pts.items():
            if len(xy) >= 2:
                fixed, per_chunk = line_fit([float(c) for c, _ in xy], [t for _, t in xy])
                print(f"fit h{h} B{b} {lib}: fixed {fixed:.1f} us + {per_chunk:.2f} us per chunk (whole batch)",
                      flush=True)
                out.append(dict(heads=h, batch=b, library=lib, points=xy, fixed_us=fixed, per_chunk_us=per_chunk))
    return out


def print_results(results: list[Result], ceil: Ceilings, have_fm: bool) -> None:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\n## dsv4attn vs FlashMLA [{gpu}; copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, "
          f"bf16 mma {ceil.mma_flops / 1e12:.0f} TFLOP/s]" + ("" if have_fm else " -- FlashMLA not found"))
    graphs = any(r.dsv4attn_graph_us for r in results)
    head = ["case", "FlashMLA us", "dsv4attn us", "dsv4attn / FlashMLA", "floor us", "FlashMLA % floor",
            "dsv4attn % floor"]
    if graphs:
        head += ["FlashMLA graph us", "dsv4attn graph us", "graph ratio", "rounds' ratios"]
    b2b = any(r.dsv4attn_b2b_us for r in results)
    if b2b:
        head += ["FlashMLA back-to-back us", "dsv4attn back-to-back us", "back-to-back ratio"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    f = lambda x, p=1: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    for r in results:
        cells = [r.case, f(r.flashmla_us), f(r.dsv4attn_us), "-" if r.ratio is None else f"{r.ratio:.2f}x",
                 f(r.floor_us), "-" if not r.flashmla_us else f"{100 * r.floor_us / r.flashmla_us:.0f}%",
                 f"{100 * r.floor_us / r.dsv4attn_us:.0f}%"]
        if graphs:
            gr = (r.dsv4attn_graph_us / r.flashmla_graph_us) if r.flashmla_graph_us and r.dsv4attn_graph_us else None
            cells += [f(r.flashmla_graph_us), f(r.dsv4attn_graph_us), "-" if gr is None else f"{gr:.2f}x",
                      "-" if r.graph_ratio_lo is None else f"{r.graph_ratio_lo:.2f}-{r.graph_ratio_hi:.2f}"]
        if b2b:
            br = (r.dsv4attn_b2b_us / r.flashmla_b2b_us) if r.flashmla_b2b_us and r.dsv4attn_b2b_us else None
            cells += [f(r.flashmla_b2b_us), f(r.dsv4attn_b2b_us), "-" if br is None else f"{br:.2f}x"]
        print("| " + " | ".join(cells) + " |")


def override_kernel_config(spec: str) -> None:
    """Change the KernelConfig fields ``spec`` ("field=value,...") in every config that the
    attention dispatch picks, for this process."""
    import dataclasses

    from dsv4attn.ops import sparse_attn_launch

    try:
        over = sparse_attn_launch.kernel_config_changes(spec)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--kernel-config: {e}") from None
    pick = sparse_attn_launch.kernel_config
    sparse_attn_launch.kernel_config = lambda *a, **k: dataclasses.replace(pick(*a, **k), **over)
    print(f"KernelConfig overridden: {over}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flashmla-path", default=None, help="folder holding the built flash_mla package")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (reference path), dsv4attn only")
    p.add_argument("--graphs", action="store_true", help="also time CUDA-graph replays")
    p.add_argument("--back-to-back", action="store_true",
                   help="also time back-to-back eager calls (throughput: host or device, whichever is slower)")
    p.add_argument("--only", default="", help="comma-separated substrings: run only matching cases")
    p.add_argument("--rounds", type=int, default=5, help="rounds of interleaved graph timing (odd)")
    p.add_argument("--json", default=None, help="write the rows to this file")
    p.add_argument("--decode-sweep", action="store_true",
                   help="decode at B=1024 over 4-32 chunks per token, each library fitted as fixed + per chunk")
    p.add_argument("--kernel-config", default="", help='KernelConfig fields "field=value,..." changed in every '
                   "config dispatch picks (a candidate default, timed before it becomes one)")
    args = p.parse_args()
    if args.rounds < 1 or args.rounds % 2 == 0:
        raise SystemExit("--rounds must be an odd number >= 1")
    if args.kernel_config:
        override_kernel_config(args.kernel_config)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    fm = load_flashmla(args.flashmla_path) if cuda else None
    ceil = Ceilings.measure() if cuda else Ceilings()
    gen = torch.Generator(device=device).manual_seed(0)
    rounds = args.rounds if args.graphs and cuda else 0
    only = [s for s in args.only.split(",") if s]
    want = lambda name: not only or any(s in name for s in only)  # noqa: E731
    results: list[Result] = []
    if args.decode_sweep:
        fits = decode_sweep(fm, ceil, device, rounds, gen, args.smoke)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(fits, fh, indent=1)
        return
    if args.smoke:
        dec, pre = [(4, 2)], [(4, 16, 8, 128)]
        topk, swa = 64, 16
    else:
        dec = [(h, b) for h in (64, 128) for b in (64, 256, 1024)]
        pre = [(h, k, 4096, 16384) for h in (64, 128) for k in (512, 2048)]
        topk, swa = 512, 128
    for h, b in dec:
        if want(f"decode h{h} B{b}"):
            results += decode_case(fm, b, h, topk, swa, ceil, device, rounds, gen, args.back_to_back)
            print(f"  {results[-2]}\n  {results[-1]}", flush=True)
    for h, k, s_q, s_kv in pre:
        if want(f"prefill h{h} top-k {k}"):
            results += prefill_case(fm, h, k, s_q, s_kv, ceil, device, rounds, gen, args.back_to_back)
            print(f"  {results[-2]}\n  {results[-1]}", flush=True)
    print_results(results, ceil, fm is not None)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([dict(asdict(r), ratio=r.ratio) for r in results], fh, indent=1)


if __name__ == "__main__":
    main()
