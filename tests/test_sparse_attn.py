"""sparse_mla_attention (Triton kernel and PyTorch reference) against an fp64 oracle.

Tolerance (flash-attention rule): the kernel's max error vs the fp64 oracle is at most 2x the
error of the same computation run with bf16 weights/outputs (see helpers.assert_matches),
inf/NaN positions of lse match, and no NaN reaches the output although unused pages are
NaN-poisoned. Interpreter shapes are small; a few production-layout (448 + 64) cases run too.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4attn.ops.candidate_set import CandidateSet
from dsv4attn.ops.sparse_attn import sparse_mla_attention
from dsv4attn.ops.sparse_attn_launch import KernelConfig, kernel_config, kernel_config_changes, launch, pick_splits
from dsv4attn.testing.attention_oracle import (
    PROD_LAYOUT,
    SMALL_LAYOUT,
    SetSpec,
    assert_matches,
    build_set,
    make_sink,
    oracle,
)

# (id, num_heads, num_tokens, layout, set specs, num_splits, sink kind, num_reqs)
CASES = [
    ("h1-idx-fp8", 1, 4, SMALL_LAYOUT, [SetSpec("indices", True, 16, 70)], 1, "none", 1),
    ("h3-range-bf16+idx-fp8", 3, 5, SMALL_LAYOUT,
     [SetSpec("range", False, 16, 33), SetSpec("indices", True, 8, 20)], 1, "finite", 2),
    ("h8-range-fp8+idx-fp8-split3", 8, 4, SMALL_LAYOUT,
     [SetSpec("range", True, 16, 100), SetSpec("indices", True, 16, 65)], 3, "inf", 3),
    ("h8-idx-bf16+range-bf16", 8, 3, SMALL_LAYOUT,
     [SetSpec("indices", False, 4, 17), SetSpec("range", False, 2, 9)], 1, "inf", 2),
    ("h64-idx-fp8+range-fp8-split2", 64, 2, SMALL_LAYOUT,
     [SetSpec("indices", True, 16, 64), SetSpec("range", True, 64, 129)], 2, "finite", 1),
    ("h128-range-fp8", 128, 1, SMALL_LAYOUT, [SetSpec("range", True, 2, 40)], 1, "inf", 1),
    ("prod-h3-idx-fp8+range-fp8", 3, 2, PROD_LAYOUT,
     [SetSpec("indices", True, 64, 40), SetSpec("range", True, 64, 33)], 1, "finite", 1),
    ("prod-h64-idx-fp8-split2", 64, 1, PROD_LAYOUT, [SetSpec("indices", True, 64, 66)], 2, "inf", 1),
]


def _run_case(case, device, impl, prefill=False):
    _, num_heads, num_tokens, layout, specs, num_splits, sink_kind, num_reqs = case
    num_reqs = min(num_reqs, num_tokens)
    gen = torch.Generator().manual_seed(zlib.crc32(case[0].encode()))
    token_to_req = [t * num_reqs // num_tokens for t in range(num_tokens)]
    built = [build_set(s, num_tokens, token_to_req, layout, gen, device) for s in specs]
    d = layout.head_dim
    q = torch.randn(num_tokens, num_heads, d, generator=gen).to(torch.bfloat16)
    scale = d**-0.5 * 2.0  # sharper than 1/sqrt(d) so the softmax is far from uniform
    sink = make_sink(num_heads, sink_kind, gen)
    kw = dict(num_splits=num_splits, prefill=prefill) if impl == "triton" else {}
    out, lse = sparse_mla_attention(q.to(device), [b.cset for b in built], scale,
                                    None if sink is None else sink.to(device), impl=impl, **kw)
    assert out.shape == (num_tokens, num_heads, d) and out.dtype == torch.bfloat16
    assert lse.shape == (num_tokens, num_heads) and lse.dtype == torch.float32
    ref = oracle(q, built, scale, sink)
    base = oracle(q, built, scale, sink, low_precision=True)
    assert_matches(out, lse, ref, base, case[0])


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_fp64_oracle(case, impl, device):
    _run_case(case, device, impl)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_empty_rows_and_lengths_zero(impl, device):
    """Tokens with length 0, with only -1 holes, and one with a single candidate."""
    gen = torch.Generator().manual_seed(7)
    num_tokens, num_heads = 4, 3
    a = build_set(SetSpec("indices", True, 16, 20, hole_frac=0.0), num_tokens, [0] * num_tokens, SMALL_LAYOUT, gen,
                  device, lengths=[0, 20, 1, 0])
    idx = a.cset.indices.clone()
    idx[1] = -1  # token 1: 20 candidates, all holes
    a.slots[1] = []
    a = type(a)(CandidateSet(cache=a.cset.cache, lengths=a.cset.lengths, indices=idx, layout=SMALL_LAYOUT),
                a.kdec, a.slots)
    b = build_set(SetSpec("range", True, 16, 5), num_tokens, [0] * num_tokens, SMALL_LAYOUT, gen, device,
                  lengths=[0, 0, 0, 2])
    q = torch.randn(num_tokens, num_heads, SMALL_LAYOUT.head_dim, generator=gen).to(torch.bfloat16)
    sink = torch.tensor([0.3, float("inf"), float("-inf")])
    out, lse = sparse_mla_attention(q.to(device), [a.cset, b.cset], 0.1, sink.to(device), impl=impl)
    assert torch.isinf(lse[0]).all() and (lse[0] > 0).all() and (out[0] == 0).all()
    assert torch.isinf(lse[1]).all() and (out[1] == 0).all()
    assert torch.isfinite(lse[2:]).all()
    assert (out[2:, 1] == 0).all()  # sink +inf zeroes the output, lse stays finite
    assert_matches(out, lse, oracle(q, [a, b], 0.1, sink), oracle(q, [a, b], 0.1, sink, True), "empty")


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_lengths_beyond_width_mean_whole_row(impl, device):
    """lengths > width never reads past the index row (the next row or beyond the tensor)."""
    gen = torch.Generator().manual_seed(9)
    a = build_set(SetSpec("indices", True, 16, 20, hole_frac=0.0), 3, [0] * 3, SMALL_LAYOUT, gen, device,
                  lengths=[20, 5, 20])
    long = CandidateSet(cache=a.cset.cache, lengths=torch.tensor([25, 5, 1000], dtype=torch.int32, device=device),
                        indices=a.cset.indices, layout=SMALL_LAYOUT)
    q = torch.randn(3, 2, SMALL_LAYOUT.head_dim, generator=gen).to(torch.bfloat16)
    out, lse = sparse_mla_attention(q.to(device), [long], 0.1, impl=impl)
    assert_matches(out, lse, oracle(q, [a], 0.1, None), oracle(q, [a], 0.1, None, True), "long lengths")


def test_no_tokens(device):
    gen = torch.Generator().manual_seed(1)
    a = build_set(SetSpec("indices", True, 16, 4), 0, [], SMALL_LAYOUT, gen, device, lengths=[])
    q = torch.empty(0, 2, SMALL_LAYOUT.head_dim, dtype=torch.bfloat16, device=device)
    for impl in ("triton", "reference"):
        out, lse = sparse_mla_attention(q, [a.cset], 0.1, impl=impl)
        assert out.shape == (0, 2, SMALL_LAYOUT.head_dim) and lse.shape == (0, 2)


def test_preallocated_out_is_written_in_place(device):
    """A poisoned strided ``out`` (a head-padded buffer) gets every element written, nothing else."""
    gen = torch.Generator().manual_seed(3)
    a = build_set(SetSpec("range", True, 16, 24), 3, [0, 0, 1], SMALL_LAYOUT, gen, device)
    q = torch.randn(3, 5, SMALL_LAYOUT.head_dim, generator=gen).to(torch.bfloat16)
    buf = torch.full((3, 8, SMALL_LAYOUT.head_dim), float("nan"), dtype=torch.bfloat16, device=device)
    out_view = buf[:, 2:7]
    out, lse = sparse_mla_attention(q.to(device), [a.cset], 0.2, out=out_view, impl="triton")
    assert out.data_ptr() == out_view.data_ptr()
    assert not torch.isnan(buf[:, 2:7]).any()
    assert torch.isnan(buf[:, :2]).all() and torch.isnan(buf[:, 7:]).all()
    assert_matches(out, lse, oracle(q, [a], 0.2, None), oracle(q, [a], 0.2, None, True), "out=")


def test_split_kv_matches_single_pass(device):
    """Split-KV + combine and the single pass agree closely (same arithmetic, other order)."""
    gen = torch.Generator().manual_seed(5)
    a = build_set(SetSpec("indices", True, 16, 150), 2, [0, 0], SMALL_LAYOUT, gen, device)
    q = torch.randn(2, 4, SMALL_LAYOUT.head_dim, generator=gen).to(torch.bfloat16).to(device)
    sink = torch.tensor([0.0, 1.0, float("inf"), float("-inf")], device=device)
    o1, l1 = sparse_mla_attention(q, [a.cset], 0.15, sink, impl="triton", num_splits=1)
    o4, l4 = sparse_mla_attention(q, [a.cset], 0.15, sink, impl="triton", num_splits=4)
    torch.testing.assert_close(l1, l4, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o1.float(), o4.float(), rtol=2**-7, atol=1e-3)


def test_forced_split_count_is_capped_at_16(device):
    """A forced ``num_splits`` above 16 runs 16 splits (the combine merges at most 16 partials
    per row): same result as 16, no error; non-positive or non-int counts are still refused."""
    gen = torch.Generator().manual_seed(6)
    a = build_set(SetSpec("indices", True, 16, 300), 1, [0], SMALL_LAYOUT, gen, device)
    q = torch.randn(1, 4, SMALL_LAYOUT.head_dim, generator=gen).to(torch.bfloat16).to(device)
    assert kernel_config(1, 4, SMALL_LAYOUT.head_dim, 300, q.device, 40).num_splits == 16
    o16, l16 = sparse_mla_attention(q, [a.cset], 0.15, impl="triton", num_splits=16)
    o40, l40 = sparse_mla_attention(q, [a.cset], 0.15, impl="triton", num_splits=40)
    assert torch.equal(o16, o40) and torch.equal(l16, l40)
    assert_matches(o40, l40, oracle(q, [a], 0.15, None), oracle(q, [a], 0.15, None, True), "40 splits")
    for bad in (0, -2, 2.0):
        with pytest.raises(ValueError, match="num_splits"):
            sparse_mla_attention(q, [a.cset], 0.15, impl="triton", num_splits=bad)


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("layout", [SMALL_LAYOUT, PROD_LAYOUT], ids=["small", "prod"])
def test_fp32_query_gives_fp32_output(impl, layout, device):
    """fp32 q -> fp32 out. Reference: computed in fp32 throughout (q never rounded to bf16):
    within fp32 rounding of the fp64 oracle on the fp32 q (rtol 1e-4: sums of <= 200 products).
    Triton: bf16 tensor-core products, fp32 output: within the 2x rule of the oracle on the
    bf16-rounded q, and no bf16 rounding of the output (it differs from its own bf16 cast)."""
    gen = torch.Generator().manual_seed(31)
    specs = [SetSpec("indices", True, 64, 70), SetSpec("range", True, 64, 40)]
    built = [build_set(sp, 3, [0, 0, 1], layout, gen, device) for sp in specs]
    q = torch.randn(3, 5, layout.head_dim, generator=gen)
    sink = make_sink(5, "finite", gen)
    scale = layout.head_dim**-0.5
    out, lse = sparse_mla_attention(q.to(device), [b.cset for b in built], scale, sink.to(device), impl=impl)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    if impl == "reference":
        ref_o, ref_l = oracle(q, built, scale, sink)
        # atol: an fp32 sum of <= 200 products of O(1) terms carries ~200 * 2^-24 * 3 ~ 4e-5 of
        # rounding in the worst order (cuBLAS on the H200 showed 1.5e-5 at one near-zero output).
        torch.testing.assert_close(out.cpu().double(), ref_o, rtol=1e-4, atol=5e-5)
        torch.testing.assert_close(lse.cpu().double(), ref_l, rtol=1e-5, atol=1e-5)
    else:
        qb = q.bfloat16()
        assert_matches(out, lse, oracle(qb, built, scale, sink), oracle(qb, built, scale, sink, True), "fp32 q")
        assert not torch.equal(out.cpu(), out.cpu().bfloat16().float())
        for kw in (dict(num_splits=2), dict(prefill=True)):  # the combine and prefill kernels' fp32 writes
            o2, l2 = sparse_mla_attention(q.to(device), [b.cset for b in built], scale, sink.to(device), impl=impl,
                                          **kw)
            assert o2.dtype == torch.float32
            assert_matches(o2, l2, oracle(qb, built, scale, sink), oracle(qb, built, scale, sink, True), f"fp32 {kw}")


@pytest.mark.parametrize("num_heads", [3, 20])
def test_lazy_rescale_matches_oracle(num_heads, device):
    """Lazy online-softmax rescaling: sharp logits (scale 0.6: maxima jump by more and by less
    than 2^8 between chunks), empty rows, -1 holes, splits 1 and 3, +-inf sinks."""
    gen = torch.Generator().manual_seed(41 + num_heads)
    specs = [SetSpec("indices", True, 16, 90), SetSpec("range", False, 16, 50)]
    built = [build_set(sp, 4, [0, 0, 1, 1], SMALL_LAYOUT, gen, device, lengths=lens)
             for sp, lens in zip(specs, ([90, 0, 37, 5], [50, 0, 0, 33]))]
    q = torch.randn(4, num_heads, SMALL_LAYOUT.head_dim, generator=gen).to(torch.bfloat16)
    sink = make_sink(num_heads, "inf", gen)
    ref, base = oracle(q, built, 0.6, sink), oracle(q, built, 0.6, sink, True)
    for splits in (1, 3):
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=device)
        launch(q.to(device), [b.cset for b in built], 0.6, sink.to(device), out, lse, None, None,
                KernelConfig(16 if num_heads <= 16 else 32, 16, splits, 4, 1, True))
        assert_matches(out, lse, ref, base, f"lazy splits {splits}")


def test_kernel_config_changes_are_checked_before_use():
    """``"field=value,..."`` (the benchmarks' --kernel-config, DSV4ATTN_TEST_KERNEL_CONFIG) gives
    the fields with their literal values; a name that is no field, among them the switches removed
    after measurement, is refused naming it, and so are a value of the wrong type (a bool field
    given 1, an int field given True), a value that is no literal and an item without ``=``."""
    assert kernel_config_changes("") == {}
    assert kernel_config_changes(" sm90_cluster=False, num_splits=2 ,") == {"sm90_cluster": False, "num_splits": 2}
    for removed in ("sm90_q_ahead", "sm90_wg1_lag", "sm90_bf16_halves", "sm90_pingpong"):
        with pytest.raises(ValueError, match=f"no field '{removed}'"):
            kernel_config_changes(f"sm90_cluster=False,{removed}=True")
        with pytest.raises(TypeError, match=removed):
            KernelConfig(64, 64, 1, 4, 1, **{removed: True})
    with pytest.raises(TypeError, match="sm90_cluster takes bool"):
        kernel_config_changes("sm90_cluster=1")
    with pytest.raises(TypeError, match="num_splits takes int"):
        kernel_config_changes("num_splits=True")
    with pytest.raises(ValueError, match="'Fals' is not a Python literal"):
        kernel_config_changes("sm90_cluster=Fals")
    with pytest.raises(ValueError, match="expected field=value"):
        kernel_config_changes("sm90_cluster")


def test_pick_splits_fills_waves():
    """Split-KV model on 132 SMs with 10 chunks per program (decode: 640 candidates): a
    half-full grid splits in 2, a full one stays whole, a lone program takes one chunk per
    split; never more splits than chunks or the cap."""
    assert pick_splits(64, 132, 10) == 2
    assert pick_splits(128, 132, 10) == 1 and pick_splits(256, 132, 10) == 1
    assert pick_splits(1, 132, 10) == 10 and 10 < pick_splits(1, 132, 40) <= 16 and pick_splits(1, 132, 6, 2) == 2
    assert all(1 <= pick_splits(n, 132, c, 5) <= min(5, c) for n in range(1, 600, 7) for c in (1, 2, 10, 40))


def _valid_args(device):
    gen = torch.Generator().manual_seed(11)
    a = build_set(SetSpec("indices", True, 16, 8), 2, [0, 0], SMALL_LAYOUT, gen, device)
    q = torch.randn(2, 4, SMALL_LAYOUT.head_dim, generator=gen).to(torch.bfloat16).to(device)
    return q, a.cset


def test_bad_inputs_raise_naming_the_argument(device):
    q, s = _valid_args(device)
    with pytest.raises(TypeError, match="q"):
        sparse_mla_attention(q.half(), [s], 0.1)
    with pytest.raises(TypeError, match="out"):
        sparse_mla_attention(q.float(), [s], 0.1, out=torch.empty(q.shape, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="heads"):
        sparse_mla_attention(torch.zeros(2, 129, q.shape[2], dtype=torch.bfloat16, device=device), [s], 0.1)
    with pytest.raises(ValueError, match="sets"):
        sparse_mla_attention(q, [s, s, s], 0.1)
    with pytest.raises(ValueError, match="sets"):
        sparse_mla_attention(q, [], 0.1)
    with pytest.raises(TypeError, match="sets\\[0\\]"):
        sparse_mla_attention(q, ["x"], 0.1)
    with pytest.raises(TypeError, match="lengths"):
        sparse_mla_attention(q, [CandidateSet(s.cache, s.lengths.long(), indices=s.indices)], 0.1)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_attention(q, [CandidateSet(s.cache, s.lengths, indices=s.indices[:1])], 0.1)
    with pytest.raises(ValueError, match="range form needs"):
        sparse_mla_attention(q, [CandidateSet(s.cache, s.lengths)], 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        sparse_mla_attention(q[..., :64].contiguous(), [s], 0.1)
    with pytest.raises(ValueError, match="attn_sink"):
        sparse_mla_attention(q, [s], 0.1, attn_sink=torch.zeros(3, device=device))
    with pytest.raises(TypeError, match="softmax_scale"):
        sparse_mla_attention(q, [s], float("nan"))
    with pytest.raises(ValueError, match="out"):
        sparse_mla_attention(q, [s], 0.1, out=torch.empty(2, 3, q.shape[2], dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="impl"):
        sparse_mla_attention(q, [s], 0.1, impl="cuda")


@pytest.mark.slow
@pytest.mark.parametrize("num_heads", [1, 3, 8, 64, 128])
@pytest.mark.parametrize("layout", [SMALL_LAYOUT, PROD_LAYOUT], ids=["small", "prod"])
def test_sweep_slow(num_heads, layout, device):
    for splits, prefill in ((1, False), (3, False), (1, True)):
        case = (f"sweep-h{num_heads}-{layout.nope_dim}-s{splits}", num_heads, 3, layout,
                [SetSpec("indices", True, 64, 130), SetSpec("range", True, 64, 128)], splits, "inf", 2)
        _run_case(case, device, "triton", prefill=prefill)


#: Kernel configs (BLOCK_H, BLOCK_N, num_warps, num_stages, lazy_rescale) that must all be correct: the
#: defaults and the alternatives that benchmarks/bench_sparse_attn.py --sweep times. The first
#: one (16-head tile at 8 warps, 16-wide chunks) miscompiled on Triton 3.6 with the previous kernel.
CONFIGS = [(16, 16, 8, 2, False), (16, 32, 4, 1, False), (16, 32, 8, 1, False), (32, 32, 8, 1, False),
           (64, 16, 8, 1, False), (64, 32, 8, 1, False), (64, 32, 8, 2, False), (64, 64, 8, 1, False),
           (64, 32, 4, 1, False), (16, 32, 4, 1, True), (64, 32, 8, 1, True)]


@pytest.mark.slow
@pytest.mark.parametrize("num_heads", [3, 64])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["bh%d-n%d-w%d-s%d-lazy%d" % c for c in CONFIGS])
def test_kernel_configs_prod_layout(cfg, num_heads, device):
    """Every kernel config gives correct results at the production layout (splits 1 and 2)."""
    gen = torch.Generator().manual_seed(77 + num_heads)
    specs = [SetSpec("indices", True, 64, 70), SetSpec("range", True, 64, 40)]
    built = [build_set(sp, 2, [0, 1], PROD_LAYOUT, gen, device) for sp in specs]
    q = torch.randn(2, num_heads, PROD_LAYOUT.head_dim, generator=gen).to(torch.bfloat16)
    sink = make_sink(num_heads, "inf", gen)
    scale = PROD_LAYOUT.head_dim**-0.5 * 2.0
    ref, base = oracle(q, built, scale, sink), oracle(q, built, scale, sink, True)
    for splits in (1, 2):
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=device)
        launch(q.to(device), [b.cset for b in built], scale, sink.to(device), out, lse, None, None,
                KernelConfig(cfg[0], cfg[1], splits, cfg[2], cfg[3], cfg[4]))
        assert_matches(out, lse, ref, base, f"config {cfg} splits {splits}")


@settings(max_examples=12, deadline=None)
@given(
    num_heads=st.integers(1, 20),
    num_tokens=st.integers(1, 4),
    forms=st.lists(st.tuples(st.sampled_from(["indices", "range"]), st.booleans(), st.sampled_from([2, 16, 64]),
                             st.integers(0, 80)), min_size=1, max_size=2),
    num_splits=st.integers(1, 3),
    sink_kind=st.sampled_from(["none", "finite", "inf"]),
    seed=st.integers(0, 1 << 20),
    prefill=st.booleans(),
)
def test_random_sets_match_oracle(num_heads, num_tokens, forms, num_splits, sink_kind, seed, prefill):
    """Random mixes of forms, page dtypes, block sizes, widths, splits and the prefill path."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    specs = [SetSpec(f, fp8, bs, w) for f, fp8, bs, w in forms]
    case = (f"random-{seed}", num_heads, num_tokens, SMALL_LAYOUT, specs, num_splits, sink_kind, 2)
    _run_case(case, device, "triton", prefill=prefill)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_fp32_pages_equal_bf16_pages_holding_the_same_values(impl, device):
    """"auto" pages in fp32 (an fp32 model's cache) holding bf16-representable values give
    exactly the result of the bf16 pages: both paths read them as the same numbers."""
    gen = torch.Generator().manual_seed(41)
    specs = [SetSpec("range", False, 16, 30), SetSpec("indices", False, 16, 20)]
    built = [build_set(sp, 4, [0, 0, 1, 1], SMALL_LAYOUT, gen, device) for sp in specs]
    q = torch.randn(4, 3, SMALL_LAYOUT.head_dim, generator=gen).bfloat16().to(device)
    sets_bf16 = [b.cset for b in built]
    sets_fp32 = [dataclasses.replace(s, cache=s.cache.float()) for s in sets_bf16]
    scale = SMALL_LAYOUT.head_dim**-0.5
    o16, l16 = sparse_mla_attention(q, sets_bf16, scale, impl=impl)
    o32, l32 = sparse_mla_attention(q, sets_fp32, scale, impl=impl)
    torch.testing.assert_close(o32, o16, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(l32, l16, rtol=0, atol=0, equal_nan=True)


#: Decode-kernel variants beyond the tile sizes: (prefetch, v_split, lazy_rescale).
VARIANTS = [(True, 1, False), (False, 2, False), (True, 2, False), (True, 2, True)]


@pytest.mark.parametrize("layout", [SMALL_LAYOUT, pytest.param(PROD_LAYOUT, marks=pytest.mark.slow)],
                         ids=["small", "prod"])
@pytest.mark.parametrize("variant", VARIANTS, ids=["pf%d-v%d-lazy%d" % v for v in VARIANTS])
def test_prefetch_and_v_split_match_oracle(variant, layout, device):
    """The software-pipelined gather and the d_v split across two launches: fp8 and bf16
    pages, both forms, NaN-poisoned pages, holes, empty rows, lengths shorter than one chunk
    and spanning several (the prefetch runs past the end), splits 1 and 3, +-inf sinks."""
    prefetch, v_split, lazy = variant
    gen = torch.Generator().manual_seed(5 + v_split + 2 * prefetch + layout.nope_dim)
    num_heads = 64 if layout is PROD_LAYOUT else 5
    specs = [SetSpec("indices", True, 16, 70), SetSpec("range", layout is SMALL_LAYOUT, 16, 40)]
    built = [build_set(sp, 4, [0, 0, 1, 1], layout, gen, device, lengths=lens)
             for sp, lens in zip(specs, ([70, 0, 9, 33], [40, 0, 0, 17]))]
    q = torch.randn(4, num_heads, layout.head_dim, generator=gen).to(torch.bfloat16)
    sink = make_sink(num_heads, "inf", gen)
    scale = layout.head_dim**-0.5 * 2.0
    ref, base = oracle(q, built, scale, sink), oracle(q, built, scale, sink, True)
    for splits in (1, 3):
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=device)
        cfg = KernelConfig(64 if num_heads > 32 else 16, 16, splits, 8 if num_heads > 32 else 4, 1, lazy,
                           v_split=v_split, prefetch=prefetch)
        launch(q.to(device), [b.cset for b in built], scale, sink.to(device), out, lse, None, None, cfg)
        assert_matches(out, lse, ref, base, f"variant {variant} splits {splits}")
