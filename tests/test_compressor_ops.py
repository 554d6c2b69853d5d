"""Compressor pooling op: Triton (interpreter on CPU) and reference vs a plain-Python fp64 oracle
over paged state caches; plus the state update (``write_compressor_state``) -> pooling chain
against the whole-sequence path of the layer's Compressor.

Tolerance: 2e-6 of the output scale. Both sides are fp32 softmax-weighted sums of <= 128 rows
(exp and sums err a few ulp relative to the fp64 oracle); a wrong row, column half or position
bias is O(1). Pages and rows the windows must not read are NaN-poisoned.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from dsv4attn.layers.compressor import Compressor
from dsv4attn.ops.cache_ops import write_compressor_state
from dsv4attn.ops.compressor import compressor_pool

IMPLS = ["reference", "triton"]


def make_case(N, D, bs, ratio, overlap, seed, max_pos=60, freed=1):
    """Random state cache with permuted tables; rows outside every window stay NaN."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    coff = 2 if overlap else 1
    R = rng.randint(1, 3)
    cols = -(-(max_pos + ratio) // bs) + 1
    nb = R * cols + 2
    block_table = torch.randperm(nb, generator=g)[: R * cols].to(torch.int32).view(R, cols).clone()
    state = torch.full((nb, bs, 2 * coff * D), float("nan"))
    token_to_req = torch.randint(0, R, (N,), generator=g, dtype=torch.int32)
    positions = torch.randint(0, max_pos, (N,), generator=g)
    positions = (positions // ratio) * ratio + ratio - 1  # boundary tokens
    positions[torch.rand(N, generator=g) < 0.2] = -1  # rows to skip
    positions[0] = ratio - 1  # entry 0: with overlap its previous block is at negative positions
    # write the rows of every window, then free (-1) some blocks wholly before every window, as
    # the sliding-window manager does
    need = torch.zeros(R, cols * bs, dtype=torch.bool)
    for n in range(N):
        p = int(positions[n])
        if p >= 0:
            lo = max(0, (p // ratio) * ratio - (coff - 1) * ratio)
            need[int(token_to_req[n]), lo:(p // ratio + 1) * ratio] = True
    for r in range(R):
        for pos in need[r].nonzero().squeeze(1).tolist():
            b = int(block_table[r, pos // bs])
            state[b, pos % bs] = torch.randn(2 * coff * D, generator=g) * 2
        unused = [c for c in range(cols) if not need[r, c * bs:(c + 1) * bs].any()]
        for c in rng.sample(unused, min(freed, len(unused))):
            block_table[r, c] = -1
    return dict(state_cache=state, block_table=block_table, token_to_req=token_to_req, positions=positions,
                ratio=ratio, overlap=overlap)


def oracle(case):
    """Plain Python, fp64."""
    st, bt = case["state_cache"].double(), case["block_table"].tolist()
    r, overlap = case["ratio"], case["overlap"]
    coff = 2 if overlap else 1
    nb, bs, width = st.shape
    D = width // (2 * coff)
    out = []
    for n, p in enumerate(case["positions"].tolist()):
        if p < 0:
            out.append([0.0] * D)
            continue
        req = int(case["token_to_req"][n])
        if not 0 <= req < len(bt):
            out.append([0.0] * D)
            continue
        k = p // r
        rows = []
        for j in range(coff * r):
            pos = k * r - (coff - 1) * r + j
            if pos < 0 or pos // bs >= len(bt[req]) or not 0 <= bt[req][pos // bs] < nb:
                continue
            half = D if (overlap and j >= r) else 0
            row = st[bt[req][pos // bs], pos % bs].tolist()
            rows.append((row[half:half + D], row[coff * D + half:coff * D + half + D]))
        res = []
        for d in range(D):
            if not rows:
                res.append(0.0)
                continue
            m = max(s[d] for _, s in rows)
            ws = [math.exp(s[d] - m) for _, s in rows]
            res.append(sum(w * kv[d] for w, (kv, _) in zip(ws, rows)) / sum(ws))
        out.append(res)
    return torch.tensor(out, dtype=torch.float64).reshape(len(out), D)


def _kernel_device(impl):
    """The Triton path runs where kernels run: the GPU when there is one (the interpreter only
    serves CPU tensors on machines without CUDA); cases are built on the CPU."""
    return torch.device("cuda" if impl == "triton" and torch.cuda.is_available() else "cpu")


def run(case, impl, **kw):
    dev = _kernel_device(impl)
    args = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    return compressor_pool(**args, impl=impl, **kw).cpu()


CASES = [  # (N, D, bs, ratio, overlap)
    (7, 24, 4, 4, True),
    (5, 72, 3, 4, True),  # D > the kernel's 64-channel block, awkward block size
    (6, 40, 8, 8, False),
    (4, 16, 8, 128, False),  # HCA window: 128 rows
    (3, 8, 5, 3, True),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", CASES)
def test_pool_matches_oracle(shape, impl):
    N, D, bs, r, ov = shape
    case = make_case(N, D, bs, r, ov, seed=N * 31 + D, max_pos=300 if r == 128 else 40)
    got = run(case, impl)
    want = oracle(case)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * want.abs().max().item())
    assert (got[case["positions"] < 0] == 0).all()


def test_triton_equals_reference():
    case = make_case(9, 48, 4, 4, True, seed=3, max_pos=64)
    torch.testing.assert_close(run(case, "triton"), run(case, "reference"), rtol=0, atol=1e-6)


def test_window_without_valid_rows_is_zero():
    """A window whose blocks are all freed (-1) or beyond the table pools to 0, never NaN."""
    case = make_case(4, 16, 4, 4, True, seed=5, max_pos=20, freed=0)
    case["block_table"][:] = -1
    for impl in IMPLS:
        assert (run(case, impl) == 0).all()
        got = run(case, impl, validate_indices=False)
        assert (got == 0).all()


def test_unchecked_values_are_masked_not_read():
    case = make_case(6, 16, 4, 4, True, seed=8, max_pos=30)
    case["block_table"][0, -1] = 10_000  # sentinel id in a column no window uses
    case["block_table"][:, 0] = -1  # freed under live windows: those rows weigh 0
    case["token_to_req"][1] = 50  # not a table row: a zero row
    want = oracle(case)
    for impl in IMPLS:
        got = run(case, impl, validate_indices=False)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * want.abs().max().item())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False)])
def test_state_update_then_pool_equals_dense_compressor(ratio, overlap, impl):
    """State rows saved through write_compressor_state into a permuted paged cache, pooled by the
    op at every boundary, equal the Compressor's whole-sequence pooling of the same rows."""
    torch.manual_seed(0)
    dev = _kernel_device(impl)
    comp = Compressor(32, 24, ratio, overlap=overlap, eps=1e-6).to(dev)
    with torch.no_grad():
        comp.position_bias.normal_()
        T, bs = 5 * ratio + 3, 4
        hidden = torch.randn(T, 32, device=dev)
        pos = torch.arange(T, device=dev)
        cols = -(-T // bs)
        nb = cols + 3
        table = torch.randperm(nb, device=dev)[:cols].to(torch.int32)[None]
        state = torch.full((nb, bs, comp.state_width), float("nan"), device=dev)
        slots = table[0, pos // bs].long() * bs + pos % bs
        write_compressor_state(comp.kv_proj(hidden), comp.gate_proj(hidden), comp.position_bias.contiguous(),
                               pos, slots, state, impl=impl)
        bpos = torch.where((pos + 1) % ratio == 0, pos, -1)
        got = comp.pool_paged(state, table, torch.zeros(T, dtype=torch.int32, device=dev), bpos, impl=impl)
        rows = comp.state_rows(hidden, pos)
        n = T // ratio
        wpos = comp.window_positions(torch.arange(n, device=dev))
        want = comp.pool(rows[wpos.clamp(min=0)], wpos >= 0)
    keep = bpos >= 0
    assert (got[~keep] == 0).all()
    torch.testing.assert_close(got[keep], want, rtol=0, atol=2e-6 * want.abs().max().item())


def _good():
    return make_case(4, 16, 4, 4, True, seed=4, max_pos=20)


@pytest.mark.parametrize("mutate,err,match", [
    (lambda c: c.update(state_cache=c["state_cache"].double()), TypeError, "state_cache"),
    (lambda c: c.update(state_cache=c["state_cache"][:, :, :-1]), ValueError, "state_cache"),
    (lambda c: c.update(state_cache=c["state_cache"][:, :, ::2]), ValueError, "state_cache"),
    (lambda c: c.update(positions=c["positions"].float()), TypeError, "positions"),
    (lambda c: c.update(token_to_req=c["token_to_req"].long()), TypeError, "token_to_req"),
    (lambda c: c.update(token_to_req=c["token_to_req"][:1]), ValueError, "token_to_req"),
    (lambda c: c.update(token_to_req=c["token_to_req"] + 9), ValueError, "token_to_req values"),
    (lambda c: c.update(block_table=c["block_table"].long()), TypeError, "block_table"),
    (lambda c: c["block_table"].__setitem__((0, 0), 999), ValueError, "block_table ids"),
    (lambda c: c.update(positions=c["positions"] * 0 + 10_000), ValueError, "positions has"),
    (lambda c: c.update(ratio=0), ValueError, "ratio"),
    (lambda c: c.update(ratio=4.0), ValueError, "ratio"),
    (lambda c: c.update(overlap=1), TypeError, "overlap"),
])
def test_bad_input(mutate, err, match):
    c = _good()
    mutate(c)
    with pytest.raises(err, match=match):
        run(c, "reference")


def test_empty():
    c = _good()
    for impl in IMPLS:
        dev = _kernel_device(impl)
        out = compressor_pool(c["state_cache"].to(dev), c["block_table"].to(dev), c["token_to_req"][:0].to(dev),
                              c["positions"][:0].to(dev), 4, True, impl=impl)
        assert out.shape == (0, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("ratio,overlap,D", [(4, True, 512), (4, True, 128), (128, False, 512)])
def test_production_shape_gpu(ratio, overlap, D):
    dev = torch.device("cuda")
    case = make_case(256, D, 4 if ratio == 4 else 8, ratio, overlap, seed=1, max_pos=2048)
    case = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    got, want = run(case, "triton"), run(case, "reference")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * want.abs().max().item())
