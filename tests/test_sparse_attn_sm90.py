"""The Gluon sm90 attention kernel (Hopper only) against the fp64 oracle and the portable kernel.

Same tolerance rule as tests/test_sparse_attn.py (error vs fp64 <= 2x the bf16 run's error, inf
positions of lse equal, no NaN from the NaN-poisoned unused pages). The cases cover what the
dispatcher sends to it: production fp8 layout, 33..128 heads (64-head tiles, masked rows), both
set forms with holes and lengths, split-KV partials, sinks of every kind, fp32 q/out.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from dsv4attn.kv_cache.layout import (
    alloc_fp8_ds_mla_cache, dequantize_fp8_ds_mla, fp8_ds_mla_view, pages_of,
)
from dsv4attn.ops.candidate_set import CandidateSet
from dsv4attn.ops.sparse_attn_launch import KernelConfig, kernel_config, launch, sm90_kernel_available, uses_sm90
from dsv4attn.testing.attention_oracle import PROD_LAYOUT, SMALL_LAYOUT, SetSpec, assert_matches, build_set, make_sink, oracle

ON_HOPPER = torch.cuda.is_available() and sm90_kernel_available(torch.device("cuda"))
_skip_off_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU with Triton's Gluon sm90 API")


def needs_hopper(fn):
    return pytest.mark.gpu(_skip_off_hopper(fn))


# Every launch here goes through the launch cache as on a GPU, on CPU too: the dispatch tests'
# stand-in kernels (no Python function, nothing returned) first met the cache on the H200.
pytestmark = pytest.mark.usefixtures("launches_through_cache")

# (id, num_heads, num_tokens, set specs, num_splits, sink kind, num_reqs)
CASES = [
    ("h64-idx+idx", 64, 6, [SetSpec("indices", True, 64, 512), SetSpec("indices", True, 64, 128)], 1, "finite", 3),
    ("h128-idx+range", 128, 4, [SetSpec("indices", True, 64, 300), SetSpec("range", True, 64, 129)], 1, "inf", 2),
    ("h40-range-split3", 40, 3, [SetSpec("range", True, 16, 700)], 3, "none", 3),
    ("h96-idx-split2", 96, 5, [SetSpec("indices", True, 32, 200, hole_frac=0.4)], 2, "finite", 2),
    ("h64-idx+range-split4", 64, 2, [SetSpec("indices", True, 64, 1000), SetSpec("range", True, 64, 65)], 4,
     "finite", 1),
    # bf16 pages (the prefill kv of engines that keep bf16 caches): K stages filled by cp.async.
    ("bf16-h64-idx+idx", 64, 5, [SetSpec("indices", False, 64, 700), SetSpec("indices", False, 16, 100)], 1,
     "finite", 2),
    ("bf16-h128-range-split2", 128, 3, [SetSpec("range", False, 32, 300, hole_frac=0.3)], 2, "inf", 3),
    # Chunks of both sets in one split's walk, odd chunk counts per split, partial output.
    ("bf16-h64-idx+range-split3", 64, 4, [SetSpec("indices", False, 64, 900, hole_frac=0.2),
                                          SetSpec("range", False, 64, 200)], 3, "finite", 2),
]


def _inputs(case, device, q_dtype=torch.bfloat16):
    _, num_heads, num_tokens, specs, num_splits, sink_kind, num_reqs = case
    gen = torch.Generator().manual_seed(zlib.crc32(case[0].encode()))
    token_to_req = [t * num_reqs // num_tokens for t in range(num_tokens)]
    built = [build_set(s, num_tokens, token_to_req, PROD_LAYOUT, gen, device) for s in specs]
    q = torch.randn(num_tokens, num_heads, PROD_LAYOUT.head_dim, generator=gen).to(torch.bfloat16).to(q_dtype)
    sink = make_sink(num_heads, sink_kind, gen)
    return q, built, sink, num_splits


def _run(q, built, sink, num_splits, sm90: bool, device, max_logits: bool = False, ws: bool = True):
    """``sm90``: a Gluon kernel (``ws``: the warp-specialised one, on fp8 and on bf16 pages;
    else the single-partition one) or the portable one."""
    num_tokens, num_heads, d = q.shape
    cfg = kernel_config(num_tokens, num_heads, d, 1024, device, num_splits)
    assert cfg.sm90 is True and cfg.sm90_ws is True
    assert cfg.sm90_ws_bf16 is True
    cfg = KernelConfig(cfg.block_h, cfg.block_n, cfg.num_splits, cfg.num_warps, cfg.num_stages, sm90=sm90,
                       sm90_ws=ws, sm90_ws_bf16=ws)
    sets = [b.cset for b in built]
    assert uses_sm90(cfg, sets, PROD_LAYOUT) is sm90
    qd = q.to(device)
    out = torch.empty_like(qd)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=device)
    mx = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=device) if max_logits else None
    launch(qd, sets, 0.09, None if sink is None else sink.to(device), out, lse, mx, num_splits, config=cfg)
    return (out, lse, mx) if max_logits else (out, lse)


@needs_hopper
@pytest.mark.parametrize("variant", ["ws", "single"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sm90_matches_fp64_oracle_and_portable_kernel(case, variant):
    """Both Gluon kernels (warp-specialised or single-partition) on fp8 and on bf16 pages."""
    device = torch.device("cuda")
    q, built, sink, num_splits = _inputs(case, device)
    out, lse = _run(q, built, sink, num_splits, True, device, ws=variant == "ws")
    ref = oracle(q, built, 0.09, sink)
    assert_matches(out, lse, ref, oracle(q, built, 0.09, sink, low_precision=True), case[0])
    p_out, p_lse = _run(q, built, sink, num_splits, False, device)
    # Same math, different MMA order: within the bf16 rounding of the output.
    torch.testing.assert_close(out.float(), p_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, p_lse, atol=1e-4, rtol=1e-5)


def _assert_variants_bit_identical(case, variants: dict, max_logits: bool = False, after_launch=None) -> None:
    """Launch ``case`` once per named change of its KernelConfig (``{name: fields}``), into
    NaN-filled outputs: out, lse (and max logits) of every variant equal the first one's bit for
    bit, and the last one's match the fp64 oracle. ``after_launch(name)`` runs after each launch."""
    device = torch.device("cuda")
    q, built, sink, num_splits = _inputs(case, device)
    num_tokens, num_heads, d = q.shape
    base = kernel_config(num_tokens, num_heads, d, 1024, device, num_splits)
    sets = [b.cset for b in built]
    qd = q.to(device)
    sk = None if sink is None else sink.to(device)
    res = []
    for name, fields in variants.items():
        out = torch.full_like(qd, float("nan"))
        lse = torch.full((num_tokens, num_heads), float("nan"), dtype=torch.float32, device=device)
        mx = torch.full_like(lse, float("nan")) if max_logits else None
        launch(qd, sets, 0.09, sk, out, lse, mx, num_splits, config=dataclasses.replace(base, **fields))
        if after_launch is not None:
            after_launch(name)
        res.append((name, out, lse, mx))
    first = res[0]
    for name, out, lse, mx in res[1:]:
        assert torch.equal(out, first[1]) and torch.equal(lse, first[2]), f"{name} against {first[0]}"
        assert not max_logits or torch.equal(mx, first[3]), f"{name} against {first[0]}: max logits"
    ref = oracle(q, built, 0.09, sink)
    assert_matches(res[-1][1], res[-1][2], ref, oracle(q, built, 0.09, sink, low_precision=True), case[0])


# Cases with two 64-head tiles on fp8 pages: what the two-CTA cluster variant serves.
CLUSTER_CASES = [c for c in CASES if 64 < c[1] <= 128 and c[3][0].fp8] + [
    ("h128-idx+range-split3", 128, 5, [SetSpec("indices", True, 64, 900, hole_frac=0.3),
                                       SetSpec("range", True, 64, 129)], 3, "finite", 2),
    ("h72-idx+idx", 72, 3, [SetSpec("indices", True, 16, 200), SetSpec("indices", True, 64, 64, hole_frac=1.0)], 1,
     "none", 3),
    ("h128-range-split2", 128, 4, [SetSpec("range", True, 32, 333, hole_frac=0.5)], 2, "inf", 4),
]


@needs_hopper
@pytest.mark.parametrize("min_chunks", [10**9, 0], ids=["plain-producer", "loads-ahead-producer"])
@pytest.mark.parametrize("case", CLUSTER_CASES, ids=[c[0] for c in CLUSTER_CASES])
def test_sm90_cluster_is_bit_identical_to_two_ctas(case, min_chunks):
    """The two-CTA cluster variant (each CTA gathers and dequantises half of every chunk into
    both CTAs' K stages) computes exactly what two independent CTAs compute: the same bf16 K
    tiles, the same MMAs in the same order. So out and lse are bit-identical, and both match the
    fp64 oracle (holes, a set of holes only, empty rows, splits, sinks, NaN-poisoned pages)."""
    from dsv4attn.ops import sparse_attn_launch as sl

    ready = [len(sl._cluster_ready)]

    def compiled(name: str) -> None:  # a cluster launch used a cluster kernel; the others compiled none
        assert not sl._cluster_failures
        if name.startswith("cluster"):
            assert len(sl._cluster_ready) >= max(ready[0], 1)
        else:
            assert len(sl._cluster_ready) == ready[0]
        ready[0] = len(sl._cluster_ready)

    one = dict(sm90_pipe_min_chunks=min_chunks, sm90_dual_producer=False)
    variants = {"two CTAs": dict(one, sm90_cluster=False), "cluster": dict(one, sm90_cluster=True)}
    if min_chunks:  # two producer warpgroups (never with the loads ahead), as two CTAs and as the cluster
        variants.update({"two CTAs, dual": dict(one, sm90_dual_producer=True, sm90_cluster=False),
                         "cluster, dual": dict(one, sm90_dual_producer=True, sm90_cluster=True)})
    _assert_variants_bit_identical(case, variants, after_launch=compiled)


# fp8 cases whose sets share one form: what the merged producer serves (the others walk their
# sets one after another whatever the switch says).
MERGE_CASES = [c for c in CASES if c[3][0].fp8 and len({s.form for s in c[3]}) == 1] + [
    ("h128-idx+idx-split2", 128, 5, [SetSpec("indices", True, 64, 700, hole_frac=0.3),
                                     SetSpec("indices", True, 16, 130)], 2, "finite", 2),
    ("h64-range+range-split3", 64, 4, [SetSpec("range", True, 32, 500), SetSpec("range", True, 64, 70)], 3,
     "inf", 3),
    ("h64-idx-holes+idx", 64, 3, [SetSpec("indices", True, 64, 64, hole_frac=1.0),
                                  SetSpec("indices", True, 64, 190, hole_frac=0.2)], 1, "none", 3),
]


@needs_hopper
@pytest.mark.parametrize("case", MERGE_CASES, ids=[c[0] for c in MERGE_CASES])
def test_sm90_merged_producer_is_bit_identical(case):
    """The producer that walks both sets as one sequence of half-chunks (``sm90_merge_sets``,
    loads ahead) fills the same stages with the same bf16 rows in the same order as the one that
    walks them one after the other: out and lse are bit-identical, and match the fp64 oracle
    (sets shorter than a chunk, a set of holes only, empty rows, splits, NaN-poisoned pages)."""
    one = dict(sm90_pipe_min_chunks=0, sm90_dual_producer=False)
    _assert_variants_bit_identical(case, {"per set": dict(one, sm90_merge_sets=False),
                                          "merged": dict(one, sm90_merge_sets=True)})


# Every fp8 case above: what the two producer warpgroups serve (masked head rows, holes, a set of
# holes only, empty rows, both set forms, splits, sinks of every kind).
DUAL_CASES = list({c[0]: c for c in CASES + CLUSTER_CASES + MERGE_CASES if c[3][0].fp8}.values())


@needs_hopper
@pytest.mark.parametrize("case", DUAL_CASES, ids=[c[0] for c in DUAL_CASES])
def test_sm90_dual_producer_is_bit_identical(case):
    """Two producer warpgroups, each dequantising half of every chunk into the same stage, and
    each consumer's half of O as two 64 x 128 accumulators (``sm90_dual_producer``): the same bf16
    K tiles and the same products per output element as the default kernel, with its plain and
    its loads-ahead producer. So out and lse are bit-identical, and match the fp64 oracle."""
    one = dict(sm90_dual_producer=False)
    _assert_variants_bit_identical(case, {"plain": dict(one, sm90_pipe_min_chunks=10**9),
                                          "ahead": dict(one, sm90_pipe_min_chunks=0),
                                          "dual": dict(sm90_dual_producer=True)})


# Every bf16 case above and more: what the q-in-registers kernel serves (masked head rows, holes,
# a set of holes only, fewer chunks than K stages, both set forms, odd chunk counts per split).
QREG_CASES = [c for c in CASES if not c[3][0].fp8] + [
    ("bf16-h128-idx+range-split5", 128, 4, [SetSpec("indices", False, 64, 1000, hole_frac=0.2),
                                            SetSpec("range", False, 64, 257)], 5, "finite", 2),
    ("bf16-h40-holes+idx", 40, 3, [SetSpec("indices", False, 64, 64, hole_frac=1.0),
                                   SetSpec("indices", False, 16, 190, hole_frac=0.2)], 1, "none", 3),
    ("bf16-h64-range-1chunk", 64, 3, [SetSpec("range", False, 64, 40)], 1, "inf", 2),
    ("bf16-h64-idx-2chunks", 64, 2, [SetSpec("indices", False, 32, 128, hole_frac=0.0)], 1, "finite", 1),
]


@needs_hopper
@pytest.mark.parametrize("max_logits", [False, True], ids=["lse", "max-logits"])
@pytest.mark.parametrize("case", QREG_CASES, ids=[c[0] for c in QREG_CASES])
def test_sm90_qreg_is_bit_identical(case, max_logits):
    """The q-in-registers kernel on bf16 pages (``sm90_bf16_qreg``: q held in warpgroup 0's
    registers, three K stages, both halves of ``P V`` on two other warpgroups) computes the same
    products in the same order as the warp-specialised kernel: the logits over the 512 dims in
    one accumulation, P rounded to bf16 once, each output column's ``P V`` from the same P. So
    out, lse and max logits are bit-identical, and match the fp64 oracle. The same for its copies
    by columns (``sm90_qreg_col_copies``): the same rows land in the same stages."""
    if max_logits and case[4] > 1:
        pytest.skip("max logits are produced without split-KV only")
    _assert_variants_bit_identical(case, {"warp-specialised": dict(sm90_bf16_qreg=False),
                                          "q in registers": dict(sm90_bf16_qreg=True),
                                          "q in registers, copies by columns": dict(sm90_bf16_qreg=True,
                                                                                    sm90_qreg_col_copies=True)},
                                   max_logits)


@needs_hopper
def test_sm90_fp32_q_and_out():
    device = torch.device("cuda")
    q, built, sink, num_splits = _inputs(CASES[0], device, torch.float32)
    out, lse = _run(q, built, sink, num_splits, True, device)
    assert out.dtype == torch.float32
    assert_matches(out, lse, oracle(q, built, 0.09, sink), oracle(q, built, 0.09, sink, low_precision=True), "fp32")


@needs_hopper
@pytest.mark.parametrize("case", [c for c in CASES if c[4] == 1], ids=[c[0] for c in CASES if c[4] == 1])
def test_sm90_max_logits(case):
    """Max logits (FlashMLA's prefill output; only without split-KV): each row's largest scaled
    logit over its valid candidates, -inf for a row without any, against fp64 over the same
    bf16 q and dequantised rows; out and lse unchanged by asking for them."""
    device = torch.device("cuda")
    q, built, sink, _ = _inputs(case, device)
    out, lse, mx = _run(q, built, sink, 1, True, device, max_logits=True)  # fp8 cases: the ws kernel
    want_o, want_l = _run(q, built, sink, 1, True, device)
    assert torch.equal(out, want_o) and torch.equal(lse, want_l)
    ref = torch.full(mx.shape, float("-inf"), dtype=torch.float64)
    tol = torch.zeros(mx.shape, dtype=torch.float64)
    q64 = q.double()
    for t in range(q.shape[0]):
        rows = [b.kdec[torch.tensor(b.slots[t], dtype=torch.long)] for b in built if b.slots[t]]
        if rows:
            k = torch.cat(rows).double()
            ref[t] = ((q64[t] @ k.T) * 0.09).max(dim=-1).values
            # bf16 x bf16 products are exact in fp32; the fp32 sums over 512 dims in another
            # order than fp64's: 2^-16 of the sum of |products| bounds that.
            tol[t] = 2.0**-16 * ((q64[t].abs() @ k.abs().T) * 0.09).max(dim=-1).values
    got = mx.cpu().double()
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert ((got[fin] - ref[fin]).abs() <= tol[fin]).all()


def test_dispatch_rules():
    """Only the production fp8 layout or bf16 pages, no variant configs (runs everywhere)."""
    cfg = KernelConfig(64, 64, 1, 8, 1, sm90=True)
    gen = torch.Generator().manual_seed(0)
    prod = build_set(SetSpec("indices", True, 64, 64), 1, [0], PROD_LAYOUT, gen, "cpu").cset
    small = build_set(SetSpec("indices", True, 16, 16), 1, [0], SMALL_LAYOUT, gen, "cpu").cset
    bf16 = build_set(SetSpec("indices", False, 64, 64), 1, [0], PROD_LAYOUT, gen, "cpu").cset
    assert uses_sm90(cfg, [prod, prod], PROD_LAYOUT)
    assert not uses_sm90(cfg, [prod, bf16], PROD_LAYOUT)  # a bf16 set
    assert not uses_sm90(cfg, [small], SMALL_LAYOUT)
    assert not uses_sm90(KernelConfig(64, 64, 1, 8, 1), [prod], PROD_LAYOUT)
    assert not uses_sm90(KernelConfig(64, 64, 1, 8, 1, v_split=2, sm90=True), [prod], PROD_LAYOUT)
    assert uses_sm90(cfg, [bf16], None)
    # Rows not 16-byte aligned (a view one byte into the cache) cannot take 16-byte cp.async.
    shifted = dataclasses.replace(prod, cache=torch.empty(prod.cache.numel() + 1, dtype=torch.uint8)[1:].view(
        prod.cache.shape))
    assert not uses_sm90(cfg, [shifted], PROD_LAYOUT)
    if not torch.cuda.is_available():
        assert kernel_config(4, 64, 512, 640, torch.device("cpu")).sm90 is False


def test_build_failure_falls_back_to_the_portable_kernel(monkeypatch, device):
    """If the sm90 kernel cannot be built here (another Triton release), the launch warns once
    and this and every later call run the portable kernel: same outputs, nothing raised."""
    from dsv4attn.ops import sparse_attn_launch as sl

    calls = []

    class _Broken:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                calls.append(grid)
                raise RuntimeError("PassManager::run failed")
            return run

    gen = torch.Generator().manual_seed(3)
    built = [build_set(SetSpec("indices", True, 16, 40), 2, [0, 0], SMALL_LAYOUT, gen, device)]
    q = torch.randn(2, 4, SMALL_LAYOUT.head_dim, generator=gen).to(torch.bfloat16).to(device)
    cfg = KernelConfig(16, 16, 1, 4, 1, sm90=True)
    want_o, want_l = torch.empty_like(q), torch.empty(2, 4, device=device)
    launch(q, [built[0].cset], 0.1, None, want_o, want_l, None, 1, config=dataclasses.replace(cfg, sm90=False))
    monkeypatch.setattr(sl, "_sm90_kernel", lambda ws, qreg=False: (_Broken(), 8))
    monkeypatch.setattr(sl, "uses_sm90", lambda *a: True)
    monkeypatch.setattr(sl, "_sm90_failures", [])
    for i in range(2):
        out, lse = torch.empty_like(q), torch.empty(2, 4, device=device)
        if i == 0:
            with pytest.warns(RuntimeWarning, match="portable Triton kernel"):
                launch(q, [built[0].cset], 0.1, None, out, lse, None, 1, config=cfg)
        else:
            launch(q, [built[0].cset], 0.1, None, out, lse, None, 1, config=cfg)
        assert torch.equal(out, want_o) and torch.equal(lse, want_l)
    assert len(calls) == 1  # tried once, then never again in this process


def test_argument_errors_are_not_swallowed(monkeypatch, device):
    """Only build / launch failures fall back; anything else from the sm90 call propagates."""
    from dsv4attn.ops import sparse_attn_launch as sl

    class _Bad:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                raise TypeError("bad argument")
            return run

    gen = torch.Generator().manual_seed(4)
    built = [build_set(SetSpec("indices", True, 16, 20), 1, [0], SMALL_LAYOUT, gen, device)]
    q = torch.randn(1, 4, SMALL_LAYOUT.head_dim, generator=gen).to(torch.bfloat16).to(device)
    monkeypatch.setattr(sl, "_sm90_kernel", lambda ws, qreg=False: (_Bad(), 8))
    monkeypatch.setattr(sl, "uses_sm90", lambda *a: True)
    monkeypatch.setattr(sl, "_sm90_failures", [])
    with pytest.raises(TypeError, match="bad argument"):
        launch(q, [built[0].cset], 0.1, None, torch.empty_like(q), torch.empty(1, 4, device=device), None, 1,
               config=KernelConfig(16, 16, 1, 4, 1, sm90=True))
    assert sl._sm90_failures == []


@pytest.mark.parametrize("variant", ["ws", "single", "qreg"])
def test_sm90_launch_is_the_only_launch_when_it_succeeds(monkeypatch, device, variant):
    """Dispatch: when uses_sm90 holds, the sm90 kernel picked by ``sm90_ws`` (fp8 pages) or
    ``sm90_bf16_qreg`` (bf16 pages) gets the portable kernel's arguments plus its own
    constexprs, and nothing else runs (no portable launch after it)."""
    from dsv4attn.kernels.sparse_attn_sm90 import _sparse_mla_attn_sm90_kernel as single
    from dsv4attn.kernels.sparse_attn_sm90_qreg import _sparse_mla_attn_sm90_qreg_kernel as qreg
    from dsv4attn.kernels.sparse_attn_sm90_ws import _sparse_mla_attn_sm90_ws_kernel as warp_specialised
    from dsv4attn.ops import sparse_attn_launch as sl

    seen = []

    class _Ok:
        def __init__(self, real):
            self.real = real

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.append((grid, len(args), kwargs, self.real))
            return run

    gen = torch.Generator().manual_seed(5)
    fp8 = variant != "qreg"
    built = [build_set(SetSpec("indices", fp8, 16, 20), 3, [0, 0, 0], SMALL_LAYOUT, gen, device)]
    q = torch.randn(3, 40, SMALL_LAYOUT.head_dim, generator=gen).to(torch.bfloat16).to(device)
    kernels = {"ws": warp_specialised, "single": single, "qreg": qreg}
    monkeypatch.setattr(sl, "_sm90_kernel",
                        lambda w, qr=False: (_Ok(kernels["qreg" if qr else "ws" if w else "single"]), 8))
    monkeypatch.setattr(sl, "uses_sm90", lambda *a: True)
    monkeypatch.setattr(sl, "_sm90_failures", [])
    out = torch.full_like(q, 7.0)
    launch(q, [built[0].cset], 0.1, None, out, torch.empty(3, 40, device=device), None, 1,
           config=KernelConfig(64, 64, 1, 8, 1, sm90=True, sm90_ws=variant != "single",
                               sm90_bf16_qreg=variant == "qreg"))
    assert len(seen) == 1 and (out == 7.0).all()  # the (fake) sm90 kernel ran alone
    grid, nargs, kw, real = seen[0]
    assert real is kernels[variant]
    # The positional arguments are exactly the real kernel's runtime parameters, the keywords its
    # constexprs (plus the launch options; CLUSTER and K_OFF only in cluster launches).
    constexprs = [n for n in real.arg_names if n.isupper() and n not in ("CLUSTER", "K_OFF")]
    assert grid == (3, 1) and nargs == len([n for n in real.arg_names if not n.isupper()])
    assert set(kw) == set(constexprs) | {"num_warps", "num_stages"}
    if fp8:
        assert kw["PAGES_BF16"] is False  # fp8 pages, for either kernel


@pytest.mark.parametrize("heads, fp8, cluster, want", [
    (128, True, True, True), (65, True, True, True), (128, True, False, False), (64, True, True, False),
    (129, True, True, False), (128, False, True, False),
])
def test_sm90_cluster_dispatch(monkeypatch, device, heads, fp8, cluster, want):
    """Dispatch: the two-CTA cluster launch is tried only for fp8 pages, two 64-head tiles and
    ``KernelConfig.sm90_cluster``, with one cluster per (token, split); when it declines (it
    could not be built), the same kernel runs as two CTAs per token."""
    from dsv4attn.ops import sparse_attn_launch as sl

    seen, tried = [], []

    class _Ok:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((grid, kwargs))

    def fake_cluster(kernel, warps, grid, args, consts):
        tried.append((grid, consts))
        return len(tried) == 1  # the first launch takes the cluster, the second declines

    gen = torch.Generator().manual_seed(7)
    built = [build_set(SetSpec("indices", fp8, 16, 20), 2, [0, 0], SMALL_LAYOUT, gen, device)]
    q = torch.randn(2, heads, SMALL_LAYOUT.head_dim, generator=gen).to(torch.bfloat16).to(device)
    monkeypatch.setattr(sl, "_sm90_kernel", lambda w, qreg=False: (_Ok(), 4))
    monkeypatch.setattr(sl, "uses_sm90", lambda *a: True)
    monkeypatch.setattr(sl, "_sm90_failures", [])
    monkeypatch.setattr(sl, "_cluster_failures", [])
    monkeypatch.setattr(sl, "_launch_cluster", fake_cluster)
    cfg = KernelConfig(64, 64, 2, 8, 1, sm90=True, sm90_cluster=cluster, sm90_dual_producer=False)
    for _ in range(2):
        launch(q, [built[0].cset], 0.1, None, torch.empty_like(q), torch.empty(2, heads, device=device), None, 2,
               config=cfg)
    tiles = -(-heads // 64)
    if want:
        assert [g for g, _ in tried] == [(2, 2), (2, 2)]
        assert [g for g, _ in seen] == [(2 * tiles, 2)]  # the declined launch
        # The cluster gets the constexprs of the launch it replaces (CLUSTER and K_OFF are its own).
        assert tried[0][1] == {k: v for k, v in seen[0][1].items() if k not in ("num_warps", "num_stages")}
    else:
        assert tried == [] and [g for g, _ in seen] == [(2 * tiles, 2)] * 2


@pytest.mark.parametrize("fails", ["build", "launch"])
def test_cluster_failure_falls_back_to_two_ctas(monkeypatch, device, fails):
    """If the cluster variant cannot be built here (Triton internals it relies on moved) or the
    driver refuses its launch, the launch warns once and runs the same kernel as two CTAs per
    token, now and later."""
    from dsv4attn.ops import sparse_attn_launch as sl

    seen, builds = [], []

    class _Ok:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(grid)

    class _Refused:
        def __getitem__(self, grid):
            def run(*args):
                raise RuntimeError("cluster launch refused")
            return run

    def broken(*a, **k):
        builds.append(1)
        if fails == "build":
            raise RuntimeError("allocation pass failed")
        return _Refused()

    gen = torch.Generator().manual_seed(8)
    built = [build_set(SetSpec("indices", True, 16, 20), 2, [0, 0], SMALL_LAYOUT, gen, device)]
    q = torch.randn(2, 128, SMALL_LAYOUT.head_dim, generator=gen).to(torch.bfloat16).to(device)
    monkeypatch.setattr(sl, "_sm90_kernel", lambda w, qreg=False: (_Ok(), 4))
    monkeypatch.setattr(sl, "uses_sm90", lambda *a: True)
    monkeypatch.setattr(sl, "_sm90_failures", [])
    monkeypatch.setattr(sl, "_cluster_failures", [])
    monkeypatch.setattr(sl, "_cluster_kernel", broken)
    monkeypatch.setattr(sl, "_bound_values", lambda kernel, args, consts: list(args))
    cfg = KernelConfig(64, 64, 1, 8, 1, sm90=True, sm90_cluster=True, sm90_dual_producer=False)
    with pytest.warns(RuntimeWarning, match="two CTAs per token"):
        launch(q, [built[0].cset], 0.1, None, torch.empty_like(q), torch.empty(2, 128, device=device), None, 1,
               config=cfg)
    launch(q, [built[0].cset], 0.1, None, torch.empty_like(q), torch.empty(2, 128, device=device), None, 1,
           config=cfg)
    assert builds == [1] and seen == [(4, 1), (4, 1)]  # tried once; both launches ran as 2 tiles x 2 tokens
    assert len(sl._cluster_failures) == 1
    assert ("allocation pass failed" if fails == "build" else "launch refused") in sl._cluster_failures[0]


def test_cluster_launch_values_follow_the_kernel_signature():
    """The cluster launch hands Triton's launcher every parameter in signature order: the
    runtime arguments, then each constexpr from the call or its default."""
    from dsv4attn.kernels.sparse_attn_sm90_ws import _sparse_mla_attn_sm90_ws_kernel as k
    from dsv4attn.ops.sparse_attn_launch import _bound_values

    names = list(k.arg_names)
    first = names.index("A_RANGE")
    args = tuple(range(first))
    vals = _bound_values(k, args, {n: f"set-{n}" for n in names[first:] if n not in ("K_OFF", "PIPE")})
    assert len(vals) == len(names) and tuple(vals[:first]) == args
    assert all(n.isupper() for n in names[first:])
    assert vals[names.index("K_OFF")] == 0 and vals[names.index("PIPE")] is False  # defaults
    assert vals[names.index("CLUSTER")] == "set-CLUSTER"


@pytest.mark.parametrize("form, width, splits, min_chunks, ahead", [
    ("indices", 20, 1, 8, False), ("indices", 20, 1, 1, True), ("indices", 20, 1, 0, True),
    ("indices", 20, 2, 1, False), ("indices", 20, 2, 0, True), ("indices", 130, 1, 3, True),
    ("range", 20, 1, 1, False), ("range", 20, 1, 0, True),
])
def test_sm90_producer_loads_ahead_only_for_long_splits(monkeypatch, device, form, width, splits, min_chunks, ahead):
    """Dispatch: the fp8 producer's loads go half a chunk ahead (``PIPE``) only where a split
    has at least ``KernelConfig.sm90_pipe_min_chunks`` chunks, counted from the indices-form
    widths (20 wide: one chunk of 64, shared by the splits; 130: three); a range-form set
    counts none."""
    from dsv4attn.ops import sparse_attn_launch as sl

    seen = []

    class _Ok:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(kwargs)

    gen = torch.Generator().manual_seed(6)
    built = [build_set(SetSpec(form, True, 16, width), 2, [0, 0], SMALL_LAYOUT, gen, device)]
    q = torch.randn(2, 64, SMALL_LAYOUT.head_dim, generator=gen).to(torch.bfloat16).to(device)
    monkeypatch.setattr(sl, "_sm90_kernel", lambda w, qreg=False: (_Ok(), 4))
    monkeypatch.setattr(sl, "uses_sm90", lambda *a: True)
    monkeypatch.setattr(sl, "_sm90_failures", [])
    launch(q, [built[0].cset], 0.1, None, torch.empty_like(q), torch.empty(2, 64, device=device), None, splits,
           config=KernelConfig(64, 64, splits, 8, 1, sm90=True, sm90_pipe_min_chunks=min_chunks,
                               sm90_dual_producer=False))
    assert [kw["PIPE"] for kw in seen] == [ahead]


@pytest.mark.parametrize("forms, min_chunks, switch, merged", [
    (("indices", "indices"), 0, True, True), (("range", "range"), 0, True, True), (("indices",), 0, True, True),
    (("indices", "range"), 0, True, False), (("indices", "indices"), 10**9, True, False),
    (("indices", "indices"), 0, False, False),
])
def test_sm90_merged_producer_dispatch(monkeypatch, device, forms, min_chunks, switch, merged):
    """Dispatch: the producer walks the sets as one sequence (``MERGE``) only with its loads
    ahead (``PIPE``), the switch on, and every set of one form."""
    from dsv4attn.ops import sparse_attn_launch as sl

    seen = []

    class _Ok:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(kwargs)

    gen = torch.Generator().manual_seed(9)
    sets = [build_set(SetSpec(f, True, 16, 20), 2, [0, 0], SMALL_LAYOUT, gen, device).cset for f in forms]
    q = torch.randn(2, 64, SMALL_LAYOUT.head_dim, generator=gen).to(torch.bfloat16).to(device)
    monkeypatch.setattr(sl, "_sm90_kernel", lambda w, qreg=False: (_Ok(), 4))
    monkeypatch.setattr(sl, "uses_sm90", lambda *a: True)
    monkeypatch.setattr(sl, "_sm90_failures", [])
    launch(q, sets, 0.1, None, torch.empty_like(q), torch.empty(2, 64, device=device), None, 1,
           config=KernelConfig(64, 64, 1, 8, 1, sm90=True, sm90_pipe_min_chunks=min_chunks,
                               sm90_merge_sets=switch, sm90_dual_producer=False))
    assert [(kw["PIPE"], kw["MERGE"]) for kw in seen] == [(min_chunks == 0, merged)]


@pytest.mark.parametrize("fp8, switch, cluster, want", [
    (True, True, False, (True, False)), (True, False, False, (False, True)), (False, True, False, (False, False)),
    (True, True, True, (True, False)), (True, False, True, (False, True)),
])
def test_sm90_dual_producer_dispatch(monkeypatch, device, fp8, switch, cluster, want):
    """Dispatch: two producer warpgroups (``DUAL``) on fp8 pages when the switch is on, never with
    the loads carried ahead (``PIPE``), never on bf16 pages; with ``sm90_cluster`` too, the two-CTA
    cluster launch runs them (its producers split each CTA's rows by columns)."""
    from dsv4attn.ops import sparse_attn_launch as sl

    seen = []

    class _Ok:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(kwargs)

    def cluster_launch(kernel, warps, grid, args, consts):
        seen.append(dict(consts, cluster=True))
        return True

    gen = torch.Generator().manual_seed(11)
    sets = [build_set(SetSpec("indices", fp8, 16, 20), 2, [0, 0], SMALL_LAYOUT, gen, device).cset]
    q = torch.randn(2, 128, SMALL_LAYOUT.head_dim, generator=gen).to(torch.bfloat16).to(device)
    monkeypatch.setattr(sl, "_sm90_kernel", lambda w, qreg=False: (_Ok(), 4))
    monkeypatch.setattr(sl, "uses_sm90", lambda *a: True)
    monkeypatch.setattr(sl, "_sm90_failures", [])
    monkeypatch.setattr(sl, "_cluster_failures", [])
    monkeypatch.setattr(sl, "_launch_cluster", cluster_launch)
    launch(q, sets, 0.1, None, torch.empty_like(q), torch.empty(2, 128, device=device), None, 1,
           config=KernelConfig(64, 64, 1, 8, 1, sm90=True, sm90_pipe_min_chunks=0, sm90_dual_producer=switch,
                               sm90_cluster=cluster))
    assert [(kw["DUAL"], kw["PIPE"], kw.get("cluster", False)) for kw in seen] == [want + (cluster,)]


@pytest.mark.parametrize("fp8, ws, switch, want", [
    (False, True, True, True), (False, True, False, False), (False, False, True, False), (True, True, True, False),
])
def test_sm90_qreg_dispatch(monkeypatch, device, fp8, ws, switch, want):
    """Dispatch: the q-in-registers kernel runs on bf16 pages when ``sm90_bf16_qreg`` is on and
    the warp-specialised kernel would run there; never on fp8 pages. It copies by columns
    exactly when ``sm90_qreg_col_copies`` says so."""
    from dsv4attn.ops import sparse_attn_launch as sl

    asked = []
    consts = []

    class _Ok:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: consts.append(kwargs)

    def pick(w, qreg=False):
        asked.append(qreg)
        return _Ok(), 4

    gen = torch.Generator().manual_seed(13)
    sets = [build_set(SetSpec("indices", fp8, 16, 20), 2, [0, 0], SMALL_LAYOUT, gen, device).cset]
    q = torch.randn(2, 64, SMALL_LAYOUT.head_dim, generator=gen).to(torch.bfloat16).to(device)
    monkeypatch.setattr(sl, "_sm90_kernel", pick)
    monkeypatch.setattr(sl, "uses_sm90", lambda *a: True)
    monkeypatch.setattr(sl, "_sm90_failures", [])
    for cols in (False, True):
        launch(q, sets, 0.1, None, torch.empty_like(q), torch.empty(2, 64, device=device), None, 1,
               config=KernelConfig(64, 64, 1, 8, 1, sm90=True, sm90_ws=ws, sm90_ws_bf16=ws, sm90_bf16_qreg=switch,
                                   sm90_qreg_col_copies=cols))
    assert asked == [want, want]
    assert [kw.get("COL_COPIES") for kw in consts] == ([False, True] if want else [None, None])


@needs_hopper
@pytest.mark.parametrize("dq_bits", [True, False], ids=["bit-moves", "fp32-chain"])
@pytest.mark.parametrize("min_chunks, dual", [(10**9, False), (0, False), (10**9, True)],
                         ids=["plain-producer", "loads-ahead-producer", "dual-producer"])
def test_sm90_dequantisation_is_exact_for_every_byte(min_chunks, dual, dq_bits):
    """The warp-specialised kernel's fp8 -> bf16 step, isolated, in both fp8 producers (the
    plain one and the one whose loads run ahead; one candidate per token alone would pick the
    plain one) and both decodes: integer moves and bf16x2 multiplies (the default), or the
    e4m3 -> f32 chain (Triton's casts in the plain producer, inline PTX in the other). q = 0 and one candidate per token make
    every head's output the candidate's dequantised row (P = 1, O = 1 x V in fp32,
    1 / l = 1), so it must equal the reference decoder's bf16 row. The rows hold every finite
    e4m3 byte (0x7F / 0xFF, e4m3's NaN, excluded) under every scale byte 1..246 (2^-126 ..
    2^119; larger bytes overflow 448 x 2^(b-127) to inf, and 0 x inf logits would make q = 0
    meaningless; byte 0 reads as scale 0 in the kernels, as in FlashMLA, where the reference
    decoder says 2^-127: no quantiser writes it, their bytes are >= 105 since amax >= 1e-4).
    Equal as values (the fp32 accumulator turns -0 into +0), except that a bf16 subnormal may
    come out as zero (the tensor cores and the fp32 epilogue flush them; that is the MMA's
    arithmetic, not the dequantisation)."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(11)
    num_blocks, block = 4, 64
    rows = num_blocks * block
    lay = PROD_LAYOUT
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    nope = finite[torch.randint(0, len(finite), (rows, lay.nope_dim), generator=gen)]
    scales = (torch.randperm(rows * lay.num_tiles, generator=gen) % 246 + 1).to(torch.uint8).reshape(rows, lay.num_tiles)
    rope = torch.randn(rows, lay.rope_dim, generator=gen).to(torch.bfloat16)
    cache = alloc_fp8_ds_mla_cache(num_blocks, block, lay, device="cpu", fill=0)
    pages = pages_of(cache, lay)
    data = pages[:, : block * lay.data_bytes].view(num_blocks, block, lay.data_bytes)
    data[..., : lay.nope_dim] = nope.view(num_blocks, block, -1)
    data[..., lay.nope_dim:] = rope.view(torch.uint8).view(num_blocks, block, -1)
    off = lay.scale_offset(block)
    sc = pages[:, off : off + block * lay.scale_bytes].view(num_blocks, block, lay.scale_bytes)
    sc[..., : lay.num_tiles] = scales.view(num_blocks, block, -1)
    want = dequantize_fp8_ds_mla(cache, lay).reshape(rows, lay.head_dim)
    assert torch.isfinite(want).all() and (want == 0).any() and (want.abs() < 2.0**-126).any()
    cache_d = fp8_ds_mla_view(pages.reshape(-1).to(device), num_blocks, block, lay)  # same page stride
    order = torch.randperm(rows, generator=gen)
    cset = CandidateSet(cache=cache_d, lengths=torch.ones(rows, dtype=torch.int32, device=device),
                        indices=order.to(torch.int32)[:, None].contiguous().to(device))
    q = torch.zeros(rows, 64, lay.head_dim, dtype=torch.bfloat16, device=device)
    base = kernel_config(rows, 64, lay.head_dim, 1, device, 1)
    cfg = dataclasses.replace(base, sm90=True, sm90_ws=True, sm90_pipe_min_chunks=min_chunks,
                              sm90_dequant_bits=dq_bits, sm90_dual_producer=dual)
    assert uses_sm90(cfg, [cset], lay)
    out = torch.empty_like(q)
    lse = torch.empty(rows, 64, dtype=torch.float32, device=device)
    launch(q, [cset], 0.09, None, out, lse, None, 1, config=cfg)
    got = out.cpu().float()
    exp = want[order][:, None, :].expand_as(got).float()
    sub = (exp != 0) & (exp.abs() < 2.0**-126)
    bad = ((got != exp) & ~(sub & (got == 0))).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} values differ, first at {bad[0].tolist()}"
    assert (got[~sub] == exp[~sub]).all() and (exp.abs() >= 2.0**100).any()
