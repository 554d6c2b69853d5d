"""Metadata ops vs naive plain-Python oracles (loops over tokens), both kernel paths.

Random batches (hypothesis): request counts and lengths, contexts on and around every
compression boundary, zero-length requests, padded tokens (slot -1), permuted block tables,
outputs larger than needed and poisoned with a sentinel: every element that must be written is
checked, and every element outside the written region must still hold the sentinel.
The Triton path runs in the interpreter on CPU (slow), so it gets fewer examples.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4attn.ops.metadata import (
    build_c128a_topk_metadata,
    compute_c128a_range_lengths,
    compute_global_topk_indices_and_lens,
    compute_swa_indices_and_lens,
    compute_swa_ranges,
    get_compressed_slot_mapping,
)

POISON = -7
IMPLS = ["reference", "triton"]
#: (impl, hypothesis examples); the slow sweeps run thousands more batches (``-m slow``).
CASES = [
    ("reference", 300),
    ("triton", 60),
    pytest.param("reference", 3000, marks=pytest.mark.slow, id="reference-sweep"),
    pytest.param("triton", 400, marks=pytest.mark.slow, id="triton-sweep"),
]
HC = [HealthCheck.too_slow, HealthCheck.data_too_large]


# ---- naive oracle ------------------------------------------------------------------------------
def token_table(query_lens, seq_lens):
    """[(req, position)] per token, by loops."""
    out = []
    for q, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        for i in range(ql):
            out.append((q, sl - ql + i))
    return out


def engine_cp_slot(row, c, bs, world, rank, il):
    """vLLM's compressed-slot formula for entry c (dsv4-system.md 4.4), -1 off this rank or past
    the table: virtual blocks of bs * world entries, dealt in chunks of il."""
    vbs = bs * world
    blk, voff = c // vbs, c % vbs
    if (voff // il) % world != rank or blk >= len(row):
        return -1
    return row[blk] * bs + (voff // (world * il)) * il + voff % il


def slot_of(bt, req, e, bs):
    col = e // bs
    if col >= len(bt[req]):
        return -1
    return bt[req][col] * bs + e % bs


# ---- strategies --------------------------------------------------------------------------------
@st.composite
def batches(draw, max_reqs=6, max_q=20, ratio=4, max_ctx=700):
    """(query_lens, seq_lens, padded flags per token) with contexts near multiples of ``ratio``."""
    n = draw(st.integers(0, max_reqs))
    ql, sl = [], []
    for _ in range(n):
        q = draw(st.integers(0, max_q))
        near = draw(st.integers(0, max_ctx // ratio)) * ratio + draw(st.integers(-2, 2))
        prefix = draw(st.one_of(st.integers(0, max_ctx), st.just(max(0, near))))
        ql.append(q)
        sl.append(prefix + q)
    pad = draw(st.lists(st.booleans(), min_size=sum(ql), max_size=sum(ql)))
    return ql, sl, pad


def make_table(draw_seed, num_reqs, max_blocks):
    """Permuted block ids (no two requests share a block), int32 [num_reqs, max_blocks]."""
    g = torch.Generator().manual_seed(draw_seed)
    total = num_reqs * max_blocks
    return torch.randperm(total + 5, generator=g)[:total].to(torch.int32).view(num_reqs, max_blocks)


def poisoned(shape, dtype, device):
    return torch.full(shape, POISON, dtype=dtype, device=device)


# ---- get_compressed_slot_mapping ---------------------------------------------------------------
@pytest.mark.parametrize("impl,examples", CASES)
def test_compressed_slot_mapping_property(impl, examples, device):
    @settings(max_examples=examples, deadline=None, suppress_health_check=HC)
    @given(
        data=st.data(),
        ratio=st.sampled_from([4, 128, 8]),
        bs=st.sampled_from([64, 2, 3]),
        cp=st.sampled_from([(1, 0, 1), (2, 1, 1), (2, 0, 2), (3, 2, 4), (4, 1, 3)]),
    )
    def run(data, ratio, bs, cp):
        world, rank, il = cp
        ql, sl, _ = data.draw(batches(ratio=ratio, max_ctx=900 if ratio == 128 else 300))
        num_reqs = len(ql)
        max_blocks = data.draw(st.integers(1, 12))  # may be too narrow: those entries become -1
        bt = make_table(data.draw(st.integers(0, 99)), num_reqs, max_blocks)
        extra = data.draw(st.integers(0, 5))
        t = sum(ql)
        qsl = torch.tensor([0] + [sum(ql[: i + 1]) for i in range(num_reqs)], dtype=torch.int32)
        out = poisoned((t + extra,), torch.int64, device)
        res = get_compressed_slot_mapping(
            t, qsl.to(device), torch.tensor(sl, dtype=torch.int32, device=device), bt.to(device), bs, ratio,
            out=out, cp_world_size=world, cp_rank=rank, cp_kv_cache_interleave_size=il, impl=impl,
        )
        want = []
        btl = bt.tolist()
        for req, p in token_table(ql, sl):
            s = -1
            if (p + 1) % ratio == 0:
                s = engine_cp_slot(btl[req], p // ratio, bs, world, rank, il)
            want.append(s)
        assert res.shape == (t,) and (t == 0 or res.data_ptr() == out.data_ptr())
        assert out.tolist() == want + [-1] * extra

    run()


def test_compressed_slot_mapping_vllm_example(device):
    """vLLM's own test case: r=4, 64 entries/block, 40 tokens at positions 240..279 -> 10 slots."""
    qsl = torch.tensor([0, 40], dtype=torch.int32, device=device)
    sl = torch.tensor([280], dtype=torch.int32, device=device)
    bt = torch.tensor([[7, 3, 9]], dtype=torch.int32, device=device)
    for impl in IMPLS:
        out = get_compressed_slot_mapping(40, qsl, sl, bt, 64, 4, impl=impl).tolist()
        got = [(240 + i, s) for i, s in enumerate(out) if s >= 0]
        assert [p for p, _ in got] == list(range(243, 280, 4))
        assert [s for _, s in got] == [7 * 64 + 60 + i for i in range(4)] + [3 * 64 + i for i in range(6)]


@pytest.mark.parametrize("world,rank,il,bs", [(2, 0, 1, 64), (2, 1, 2, 4), (4, 3, 2, 2), (3, 1, 4, 8),
                                              (2, 1, 3, 2), (2, 0, 4, 2), (3, 2, 5, 64), (4, 1, 3, 4)])
@pytest.mark.parametrize("impl", IMPLS)
def test_compressed_slot_mapping_cp_matches_vllm_formula(world, rank, il, bs, impl, device):
    """Equal to the engine's formula for every interleave size, dividing the block size or not."""
    r, sl_v, t = 4, 1200, 1200
    qsl = torch.tensor([0, t], dtype=torch.int32, device=device)
    sl = torch.tensor([sl_v], dtype=torch.int32, device=device)
    bt = torch.randperm(400, generator=torch.Generator().manual_seed(1))[:300].to(torch.int32).view(1, 300)
    got = get_compressed_slot_mapping(t, qsl, sl, bt.to(device), bs, r, cp_world_size=world, cp_rank=rank,
                                      cp_kv_cache_interleave_size=il, impl=impl).tolist()
    btl = bt.tolist()[0]
    want = [engine_cp_slot(btl, p // r, bs, world, rank, il) if (p + 1) % r == 0 else -1 for p in range(sl_v)]
    assert got == want


# ---- build_c128a_topk_metadata ---------------------------------------------------------------
@pytest.mark.parametrize("impl,examples", CASES)
@pytest.mark.parametrize("full_width", [True, False])
def test_c128a_topk_property(impl, examples, full_width, device):
    @settings(max_examples=examples, deadline=None, suppress_health_check=HC)
    @given(data=st.data(), ratio=st.sampled_from([4, 128]))
    def run(data, ratio):
        ql, sl, pad = data.draw(batches(ratio=ratio, max_ctx=1000 if ratio == 4 else 3000))
        toks = token_table(ql, sl)
        t = len(toks)
        nd = data.draw(st.integers(0, t))
        bs = 2 if ratio == 128 else 64
        max_ct = data.draw(st.sampled_from([256, 300])) if ratio == 4 else 32
        num_reqs = len(ql)
        bt = make_table(data.draw(st.integers(0, 99)), max(num_reqs, 1), -(-max_ct // bs) + 1)
        width = max_ct + data.draw(st.integers(0, 3))
        rows = t + 2
        g, dl, pf = poisoned((rows, width), torch.int32, device), poisoned((rows,), torch.int32, device), \
            poisoned((rows, width), torch.int32, device)
        pos = torch.tensor([p for _, p in toks], dtype=torch.int64, device=device)
        t2r = torch.tensor([q for q, _ in toks], dtype=torch.int32, device=device)
        sm = torch.tensor([-1 if x else i for i, x in enumerate(pad)], dtype=torch.int64, device=device)
        rg, rdl, rpf = build_c128a_topk_metadata(pos, ratio, nd, t2r, bt.to(device), bs, sm, g, dl, pf, max_ct,
                                                 full_width=full_width, impl=impl)
        assert rg.shape == (nd, width) and rdl.shape == (nd,) and rpf.shape == (t - nd, width)
        assert nd == 0 or rg.data_ptr() == g.data_ptr()
        assert nd == t or rpf.data_ptr() == pf.data_ptr()
        btl = bt.tolist()
        gw, dw, pw = [[POISON] * width for _ in range(rows)], [POISON] * rows, [[POISON] * width for _ in range(rows)]
        for i, (req, p) in enumerate(toks):
            n = min((p + 1) // ratio, max_ct)
            end = max_ct if full_width else min(-(-n // 128) * 128, max_ct)
            for j in range(end):
                if i < nd:
                    gw[i][j] = slot_of(btl, req, j, bs) if j < n else -1
                else:
                    pw[i - nd][j] = j if j < n else -1
            if i < nd:
                dw[i] = 0 if pad[i] else n
        assert g.tolist() == gw
        assert dl.tolist() == dw
        assert pf.tolist() == pw

    run()


# ---- SWA indices / ranges --------------------------------------------------------------------
@pytest.mark.parametrize("impl,examples", CASES)
def test_swa_indices_and_ranges_property(impl, examples, device):
    @settings(max_examples=examples, deadline=None, suppress_health_check=HC)
    @given(data=st.data(), window=st.sampled_from([128, 8, 5]), bs=st.sampled_from([64, 4]))
    def run(data, window, bs):
        ql, sl, pad = data.draw(batches(ratio=bs, max_ctx=400))
        toks = token_table(ql, sl)
        t = len(toks)
        bt = make_table(data.draw(st.integers(0, 99)), max(len(ql), 1), max(sl, default=0) // bs + 1)
        pos = torch.tensor([p for _, p in toks], dtype=torch.int64, device=device)
        t2r = torch.tensor([q for q, _ in toks], dtype=torch.int32, device=device)
        sm = torch.tensor([-1 if x else 3 * i for i, x in enumerate(pad)], dtype=torch.int64, device=device)
        width, rows = window + 2, t + 2
        idx, lens = poisoned((rows, width), torch.int32, device), poisoned((rows,), torch.int32, device)
        ri, rl = compute_swa_indices_and_lens(pos, t2r, bt.to(device), bs, sm, window, idx, lens, impl=impl)
        assert ri.shape == (t, window) and rl.shape == (t,)
        st_, ln = poisoned((rows,), torch.int32, device), poisoned((rows,), torch.int32, device)
        compute_swa_ranges(pos, sm, window, st_, ln, impl=impl)
        btl = bt.tolist()
        wi, wl = [[POISON] * width for _ in range(rows)], [POISON] * rows
        ws, wn = [POISON] * rows, [POISON] * rows
        for i, (req, p) in enumerate(toks):
            start = max(0, p - window + 1)
            n = 0 if pad[i] else p + 1 - start
            wl[i], ws[i], wn[i] = n, start, n
            for j in range(window):
                wi[i][j] = slot_of(btl, req, start + j, bs) if j < n else -1
        assert idx.tolist() == wi and lens.tolist() == wl
        assert st_.tolist() == ws and ln.tolist() == wn

    run()


# ---- top-k local -> global; C128A range lengths ---------------------------------------------
@pytest.mark.parametrize("impl,examples", CASES)
def test_global_topk_property(impl, examples, device):
    @settings(max_examples=examples, deadline=None, suppress_health_check=HC)
    @given(data=st.data(), k=st.sampled_from([1, 7, 64, 130]), bs=st.sampled_from([64, 3]))
    def run(data, k, bs):
        t = data.draw(st.integers(0, 12))
        num_reqs = data.draw(st.integers(1, 4))
        max_blocks = data.draw(st.integers(1, 6))
        bt = make_table(data.draw(st.integers(0, 99)), num_reqs, max_blocks)
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
        hi = max_blocks * bs + 3  # some indices fall beyond the table: holes
        loc = torch.randint(-1, hi, (t, k), generator=g, dtype=torch.int32)
        loc[torch.rand(t, k, generator=g) < 0.3] = -1
        t2r = torch.randint(0, num_reqs, (t,), generator=g, dtype=torch.int32)
        ok = torch.rand(t, generator=g) < 0.8
        out, lens = poisoned((t + 1, k + 3), torch.int32, device), poisoned((t + 1,), torch.int32, device)
        ro, rl = compute_global_topk_indices_and_lens(loc.to(device), t2r.to(device), bt.to(device), bs,
                                                      ok.to(device), out, lens, impl=impl)
        assert ro.shape == (t, k) and rl.shape == (t,)
        btl = bt.tolist()
        wo, wl = [[POISON] * (k + 3) for _ in range(t + 1)], [POISON] * (t + 1)
        for i in range(t):
            row = loc[i].tolist()
            wo[i][:k] = [slot_of(btl, int(t2r[i]), x, bs) if x >= 0 else -1 for x in row]
            wl[i] = sum(x >= 0 for x in row) if ok[i] else 0
        assert out.tolist() == wo and lens.tolist() == wl

    run()


@pytest.mark.parametrize("impl", IMPLS)
def test_c128a_range_lengths(impl, device):
    pos = torch.tensor([0, 126, 127, 128, 255, 256, 1000, 5], dtype=torch.int64, device=device)
    sm = torch.tensor([0, 1, 2, 3, 4, -1, 6, 7], dtype=torch.int64, device=device)
    ln = poisoned((10,), torch.int32, device)
    r = compute_c128a_range_lengths(pos, sm, 128, ln, impl=impl)
    assert r.shape == (8,)
    assert ln.tolist() == [0, 0, 1, 1, 2, 0, 7, 0, POISON, POISON]


# ---- bad inputs ------------------------------------------------------------------------------
def _c128a_args():
    pos = torch.tensor([300, 10], dtype=torch.int64)
    t2r = torch.zeros(2, dtype=torch.int32)
    bt = torch.zeros(1, 8, dtype=torch.int32)
    sm = torch.zeros(2, dtype=torch.int64)
    g, dl, pf = torch.zeros(4, 128, dtype=torch.int32), torch.zeros(4, dtype=torch.int32), torch.zeros(4, 128, dtype=torch.int32)
    return [pos, 128, 1, t2r, bt, 2, sm, g, dl, pf, 128]


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: a.__setitem__(0, a[0].float()), TypeError, "positions"),
        (lambda a: a.__setitem__(3, a[3].long()), TypeError, "token_to_req_indices"),
        (lambda a: a.__setitem__(4, a[4].long()), TypeError, "block_table"),
        (lambda a: a.__setitem__(2, 3), ValueError, "num_decode_tokens"),
        (lambda a: a.__setitem__(10, 256), ValueError, "too small"),  # wider than the buffers
        (lambda a: a.__setitem__(7, torch.zeros(0, 128, dtype=torch.int32)), ValueError, "global_decode_buffer"),
        (lambda a: a.__setitem__(9, torch.zeros(4, 128, dtype=torch.int64)), TypeError, "prefill_buffer"),
        (lambda a: a.__setitem__(1, 0), ValueError, "compress_ratio"),
    ],
)
def test_c128a_bad_inputs(mutate, exc, match):
    args = _c128a_args()
    mutate(args)
    with pytest.raises(exc, match=match):
        build_c128a_topk_metadata(*args, impl="reference")


def test_slot_mapping_bad_inputs():
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    sl = torch.tensor([5], dtype=torch.int32)
    bt = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(TypeError, match="query_start_loc"):
        get_compressed_slot_mapping(2, qsl.long(), sl, bt, 64, 4)
    with pytest.raises(ValueError, match="query_start_loc"):
        get_compressed_slot_mapping(2, qsl[:1], sl, bt, 64, 4)
    with pytest.raises(TypeError, match="seq_lens"):
        get_compressed_slot_mapping(2, qsl, sl.float(), bt, 64, 4)
    with pytest.raises(ValueError, match="block_table"):
        get_compressed_slot_mapping(2, qsl, sl, bt[:0], 64, 4)
    with pytest.raises(ValueError, match="too small"):
        get_compressed_slot_mapping(2, qsl, sl, bt, 64, 4, out=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(TypeError, match="out"):
        get_compressed_slot_mapping(2, qsl, sl, bt, 64, 4, out=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="cp_rank"):
        get_compressed_slot_mapping(2, qsl, sl, bt, 64, 4, cp_world_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="block_size"):
        get_compressed_slot_mapping(2, qsl, sl, bt, 0, 4)
    with pytest.raises(ValueError, match="impl"):
        get_compressed_slot_mapping(2, qsl, sl, bt, 64, 4, impl="cuda")


def test_swa_and_topk_bad_inputs():
    pos = torch.zeros(3, dtype=torch.int64)
    t2r = torch.zeros(3, dtype=torch.int32)
    bt = torch.zeros(1, 4, dtype=torch.int32)
    sm = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="token_to_req_indices"):
        compute_swa_indices_and_lens(pos, t2r[:2], bt, 64, sm, 128)
    with pytest.raises(ValueError, match="indices_out"):
        compute_swa_indices_and_lens(pos, t2r, bt, 64, sm, 128, indices_out=torch.zeros(3, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="window_size"):
        compute_swa_indices_and_lens(pos, t2r, bt, 64, sm, 0)
    with pytest.raises(TypeError, match="slot_mapping"):
        compute_swa_ranges(pos, sm.float(), 128)
    with pytest.raises(TypeError, match="topk_local"):
        compute_global_topk_indices_and_lens(torch.zeros(3, 4), t2r, bt, 64, sm >= 0)
    with pytest.raises(TypeError, match="is_valid_token"):
        compute_global_topk_indices_and_lens(torch.zeros(3, 4, dtype=torch.int32), t2r, bt, 64, sm)
    with pytest.raises(ValueError, match="lens_out"):
        compute_global_topk_indices_and_lens(torch.zeros(3, 4, dtype=torch.int32), t2r, bt, 64, sm >= 0,
                                             lens_out=torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("impl", IMPLS)
def test_c128a_default_width_clamps_like_the_engine(impl, device):
    """Engine default max_compressed_tokens = 8192: a token needing more entries is clamped to it."""
    pos = torch.tensor([2_000_000, 300], dtype=torch.int64, device=device)  # n = 15625 (clamped), 2
    t2r = torch.tensor([0, 0], dtype=torch.int32, device=device)
    bt = torch.arange(4096, dtype=torch.int32, device=device).flip(0)[None].contiguous()
    sm = torch.zeros(2, dtype=torch.int64, device=device)
    g = torch.full((1, 8192), POISON, dtype=torch.int32, device=device)
    dl = torch.full((1,), POISON, dtype=torch.int32, device=device)
    pf = torch.full((1, 8192), POISON, dtype=torch.int32, device=device)
    gd, lens, pref = build_c128a_topk_metadata(pos, 128, 1, t2r, bt, 2, sm, g, dl, pf, impl=impl)
    assert lens.tolist() == [8192]
    e = torch.arange(8192)
    assert gd[0].cpu().tolist() == ((4095 - e // 2) * 2 + e % 2).tolist()
    assert pref[0, :3].cpu().tolist() == [0, 1, -1] and bool((pref[0, 3:] == -1).all())
