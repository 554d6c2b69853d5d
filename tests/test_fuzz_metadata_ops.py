"""Fuzz: every public metadata op against generated bad inputs (tests/fuzz_common.py).

Hypothesis draws a valid call (request counts and lengths, tables, buffers poisoned with a
sentinel) and one mutation of one argument: wrong types, dtypes, ranks, devices, lengths, index
values outside the tables or past the int32 limit, sizes of zero, negative or near 2^31, and
strided views. Refusals must name the argument and leave every output untouched; strided views
of valid inputs must give exactly the contiguous result (both kernel paths).
"""

from __future__ import annotations

import pytest
import torch
from fuzz_common import INT32_MAX, Mutation, _bits, check_mutation, int_mutations, tensor_mutations
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4attn.ops import metadata as M

#: Kernel paths these CPU-tensor suites exercise: the Triton path runs here only in the interpreter
#: (machines without CUDA); the boundary checks under test are the same code for both paths.
IMPLS = ["reference"] if torch.cuda.is_available() else ["reference", "triton"]

I32, I64 = torch.int32, torch.int64
POISON = -7
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
IMPL_MUT = [Mutation("impl", "unknown", lambda v: "cuda", "refuse"), Mutation("impl", "None", lambda v: None, "refuse")]


@st.composite
def batch(draw, max_reqs=4, max_q=6, max_ctx=600):
    """(query_lens, seq_lens) with at least one token."""
    n = draw(st.integers(1, max_reqs))
    ql = [draw(st.integers(0, max_q)) for _ in range(n)]
    ql[0] = max(ql[0], 1)
    sl = [q + draw(st.integers(0, max_ctx)) for q in ql]
    return ql, sl


def _table(seed, rows, cols, hi=500):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, hi, (rows, cols), generator=g, dtype=I32)


def _tokens(ql, sl):
    pos, req = [], []
    for r, (q, s) in enumerate(zip(ql, sl)):
        pos += list(range(s - q, s))
        req += [r] * q
    return torch.tensor(pos, dtype=I64), torch.tensor(req, dtype=I32)


def _run(fn, make, mutation):
    """Baseline on one fresh call, the mutated call on another identical one."""
    kwargs, state = make()
    baseline = None
    if mutation.expect == "same":
        fn(**kwargs)
        baseline = [_bits(s) for s in state]
        kwargs, state = make()
    check_mutation(fn, kwargs, state, mutation, baseline)


# ---- get_compressed_slot_mapping --------------------------------------------------------------------
SLOT_MAPPING_MUTS = (
    int_mutations("num_tokens", [-1, 2**31]) + int_mutations("block_size", [0, -1, 2**31])
    + int_mutations("compress_ratio", [0, -4, 2**31]) + int_mutations("cp_world_size", [0, -1])
    + int_mutations("cp_rank", [-1, 2]) + int_mutations("cp_kv_cache_interleave_size", [0, -2])
    + tensor_mutations("query_start_loc", [I32], bounds=(0, None))
    + [Mutation("query_start_loc", "decreasing", lambda t: t.flip(0), "refuse")]
    + tensor_mutations("seq_lens", [I32], exact_len=False, bounds=(0, INT32_MAX - 1))
    + tensor_mutations("block_table", [I32], exact_len=False)
    + [Mutation("block_table", "fewer rows than requests", lambda t: t[:-1], "refuse")]
    + tensor_mutations("out", [I64], exact_len=False, output=True)
    + [Mutation("out", "too small", lambda t: t[:0], "refuse")]
    + IMPL_MUT
)


@pytest.mark.parametrize("mut", SLOT_MAPPING_MUTS, ids=repr)
@settings(max_examples=4, **SETTINGS)
@given(b=batch(), cols=st.integers(1, 6), extra=st.integers(0, 3), seed=st.integers(0, 99),
       impl=st.sampled_from(IMPLS))
def test_fuzz_get_compressed_slot_mapping(b, cols, extra, seed, mut, impl):
    ql, sl = b
    t = sum(ql)

    def make():
        qsl = torch.tensor([0] + [sum(ql[: i + 1]) for i in range(len(ql))], dtype=I32)
        out = torch.full((t + extra + 1,), POISON, dtype=I64)
        kw = dict(num_tokens=t, query_start_loc=qsl, seq_lens=torch.tensor(sl, dtype=I32),
                  block_table=_table(seed, len(ql), cols), block_size=2, compress_ratio=4, out=out, cp_world_size=2,
                  cp_rank=1, cp_kv_cache_interleave_size=1, impl=impl)
        return kw, [out]

    if mut.arg == "block_table" and mut.label == "fewer rows than requests" and len(ql) < 1:
        return
    _run(M.get_compressed_slot_mapping, make, mut)


# ---- build_c128a_topk_metadata ---------------------------------------------------------------------
C128A_MUTS = (
    int_mutations("compress_ratio", [0, -128]) + int_mutations("block_size", [0, -2, 2**31])
    + int_mutations("max_compressed_tokens", [-1, 2**31]) + int_mutations("num_decode_tokens", [-1, 10**6])
    + tensor_mutations("positions", [I32, I64], exact_len=False, bounds=(None, INT32_MAX - 1))
    + tensor_mutations("token_to_req_indices", [I32], exact_len=False, bounds=(0, None))
    + [Mutation("token_to_req_indices", "past the table rows", lambda t: t.clone().fill_(50), "refuse")]
    + tensor_mutations("slot_mapping", [I32, I64], exact_len=False)
    + tensor_mutations("block_table", [I32], exact_len=False)
    + [Mutation("block_table", "block id past int32 slots", lambda t: t.clone().fill_(2**30), "refuse")]
    + tensor_mutations("global_decode_buffer", [I32], exact_len=False, output=True)
    + [Mutation("global_decode_buffer", "narrower than max_compressed_tokens", lambda t: t[:, :64], "refuse")]
    + tensor_mutations("decode_lens_buffer", [I32], exact_len=False, output=True)
    + tensor_mutations("prefill_buffer", [I32], exact_len=False, output=True)
    + IMPL_MUT
)


@pytest.mark.parametrize("mut", C128A_MUTS, ids=repr)
@settings(max_examples=4, **SETTINGS)
@given(b=batch(max_ctx=900), seed=st.integers(0, 99),
       impl=st.sampled_from(IMPLS))
def test_fuzz_build_c128a_topk_metadata(b, seed, mut, impl):
    ql, sl = b
    pos, req = _tokens(ql, sl)
    t, nd = pos.shape[0], 1

    def make():
        g = torch.full((t + 1, 128), POISON, dtype=I32)
        dl = torch.full((t + 1,), POISON, dtype=I32)
        pf = torch.full((t + 1, 128), POISON, dtype=I32)
        kw = dict(positions=pos.clone(), compress_ratio=128, num_decode_tokens=nd, token_to_req_indices=req.clone(),
                  block_table=_table(seed, len(ql), 8), block_size=2, slot_mapping=torch.zeros(t, dtype=I64),
                  global_decode_buffer=g, decode_lens_buffer=dl, prefill_buffer=pf, max_compressed_tokens=128,
                  impl=impl)
        return kw, [g, dl, pf]

    _run(M.build_c128a_topk_metadata, make, mut)


# ---- compute_swa_indices_and_lens ------------------------------------------------------------------
SWA_MUTS = (
    int_mutations("block_size", [0, -64, 2**31]) + int_mutations("window_size", [0, -1, 2**20])
    + tensor_mutations("positions", [I32, I64], exact_len=False, bounds=(None, INT32_MAX - 1))
    + tensor_mutations("token_to_req_indices", [I32], bounds=(0, None))
    + [Mutation("token_to_req_indices", "past the table rows", lambda t: t.clone().fill_(50), "refuse")]
    + tensor_mutations("slot_mapping", [I32, I64])
    + tensor_mutations("block_table", [I32], exact_len=False)
    + tensor_mutations("indices_out", [I32], exact_len=False, output=True)
    + tensor_mutations("lens_out", [I32], exact_len=False, output=True)
    + [Mutation("indices_out", "narrower than the window", lambda t: t[:, :4], "refuse")]
    + IMPL_MUT
)


@pytest.mark.parametrize("mut", SWA_MUTS, ids=repr)
@settings(max_examples=4, **SETTINGS)
@given(b=batch(), seed=st.integers(0, 99), impl=st.sampled_from(IMPLS))
def test_fuzz_compute_swa_indices_and_lens(b, seed, mut, impl):
    ql, sl = b
    pos, req = _tokens(ql, sl)
    t = pos.shape[0]

    def make():
        idx = torch.full((t + 1, 16), POISON, dtype=I32)
        lens = torch.full((t + 1,), POISON, dtype=I32)
        kw = dict(positions=pos.clone(), token_to_req_indices=req.clone(), block_table=_table(seed, len(ql), 12),
                  block_size=64, slot_mapping=torch.zeros(t, dtype=I64), window_size=16, indices_out=idx,
                  lens_out=lens, impl=impl)
        return kw, [idx, lens]

    _run(M.compute_swa_indices_and_lens, make, mut)


# ---- compute_global_topk_indices_and_lens ----------------------------------------------------------
TOPK_MUTS = (
    int_mutations("block_size", [0, -64, 2**31])
    + tensor_mutations("topk_local", [I32], exact_len=False)
    + tensor_mutations("token_to_req", [I32], bounds=(0, None))
    + [Mutation("token_to_req", "past the table rows", lambda t: t.clone().fill_(50), "refuse")]
    + tensor_mutations("is_valid_token", [torch.bool])
    + tensor_mutations("block_table", [I32], exact_len=False)
    + tensor_mutations("entry_limit", [I32], exact_len=False, optional=True)
    + tensor_mutations("out", [I32], exact_len=False, output=True)
    + tensor_mutations("lens_out", [I32], exact_len=False, output=True)
    + IMPL_MUT
)


@pytest.mark.parametrize("mut", TOPK_MUTS, ids=repr)
@settings(max_examples=4, **SETTINGS)
@given(b=batch(), k=st.integers(1, 8), seed=st.integers(0, 99),
       impl=st.sampled_from(IMPLS))
def test_fuzz_compute_global_topk_indices_and_lens(b, k, seed, mut, impl):
    ql, sl = b
    pos, req = _tokens(ql, sl)
    t = pos.shape[0]
    g = torch.Generator().manual_seed(seed)
    loc = torch.randint(-3, 200, (t, k), generator=g, dtype=I32)  # holes, entries past the limit, any values

    def make():
        out = torch.full((t + 1, k + 1), POISON, dtype=I32)
        lens = torch.full((t + 1,), POISON, dtype=I32)
        kw = dict(topk_local=loc.clone(), token_to_req=req.clone(), block_table=_table(seed, len(ql), 4),
                  block_size=64, is_valid_token=torch.ones(t, dtype=torch.bool), out=out, lens_out=lens,
                  entry_limit=((pos + 1) // 4).to(I32), impl=impl)
        return kw, [out, lens]

    _run(M.compute_global_topk_indices_and_lens, make, mut)


# ---- range forms ---------------------------------------------------------------------------------
RANGE_MUTS = (
    tensor_mutations("positions", [I32, I64], exact_len=False, bounds=(None, INT32_MAX - 1))
    + tensor_mutations("slot_mapping", [I32, I64])
    + tensor_mutations("lengths_out", [I32], exact_len=False, output=True)
    + IMPL_MUT
)


@pytest.mark.parametrize("mut", RANGE_MUTS + tensor_mutations("starts_out", [I32], exact_len=False, output=True)
                           + int_mutations("window_size", [0, -1]) + int_mutations("compress_ratio", [0, -1]), ids=repr)
@settings(max_examples=4, **SETTINGS)
@given(b=batch(), which=st.sampled_from(["swa", "c128a"]),
       impl=st.sampled_from(IMPLS))
def test_fuzz_range_ops(b, which, mut, impl):
    ql, sl = b
    pos, _ = _tokens(ql, sl)
    t = pos.shape[0]
    if mut.arg in ("starts_out", "window_size"):
        which = "swa"
    elif mut.arg == "compress_ratio":
        which = "c128a"

    def make():
        ln = torch.full((t + 1,), POISON, dtype=I32)
        kw = dict(positions=pos.clone(), slot_mapping=torch.zeros(t, dtype=I64), lengths_out=ln, impl=impl)
        if which == "swa":
            st_ = torch.full((t + 1,), POISON, dtype=I32)
            return dict(kw, window_size=8, starts_out=st_), [st_, ln]
        return dict(kw, compress_ratio=128), [ln]

    fn = M.compute_swa_ranges if which == "swa" else M.compute_c128a_range_lengths
    _run(fn, make, mut)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_and_one_token_calls_are_valid(impl):
    """Edge sizes that must work: zero tokens (nothing written), one token."""
    for t in (0, 1):
        pos = torch.full((t,), 130, dtype=I64)
        req = torch.zeros(t, dtype=I32)
        bt = torch.arange(8, dtype=I32)[None]
        idx = torch.full((2, 8), POISON, dtype=I32)
        lens = torch.full((2,), POISON, dtype=I32)
        M.compute_swa_indices_and_lens(pos, req, bt, 64, torch.zeros(t, dtype=I64), 8, idx, lens, impl=impl)
        assert lens.tolist() == ([8] if t else []) + [POISON] * (2 - t)
        out = torch.full((2,), POISON, dtype=I64)
        qsl = torch.tensor([0, t], dtype=I32)
        M.get_compressed_slot_mapping(t, qsl, torch.tensor([131], dtype=I32), bt, 2, 128, out=out, impl=impl)
        assert out.tolist() == [-1, -1]
