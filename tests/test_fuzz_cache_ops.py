"""Fuzz: the cache writers against generated bad inputs (tests/fuzz_common.py), both kernel paths.

Refusals name the argument and leave the cache bit-identical; strided slot mappings, positions
and row-strided inputs write exactly what contiguous ones write; NaN/Inf rows change their own
slot only; slots outside the cache are refused (validated) or skipped (unvalidated), never
written elsewhere.
"""

from __future__ import annotations

import pytest
import torch
from fuzz_common import Mutation, _bits, check_mutation, tensor_mutations
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4attn.kv_cache.layout import FP8DSMLALayout, alloc_fp8_ds_mla_cache, alloc_indexer_k_cache
from dsv4attn.ops.cache_ops import insert_indexer_k, insert_kv, write_compressor_state

#: Kernel paths these CPU-tensor suites exercise: the Triton path runs here only in the interpreter
#: (machines without CUDA); the boundary checks under test are the same code for both paths.
IMPLS = ["reference"] if torch.cuda.is_available() else ["reference", "triton"]

I32, I64, F32 = torch.int32, torch.int64, torch.float32
FLOATS = [torch.bfloat16, torch.float16, F32]
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
LAY = FP8DSMLALayout(64, 16)  # small fp8_ds_mla entries: 64 fp8 NoPE + 16 bf16 RoPE
NB, BS = 3, 4
POISON = 0xA5


def _row_strided(t):
    """Same values, rows twice as far apart (last dim still contiguous)."""
    return torch.cat([t, t], dim=1)[:, : t.shape[1]]


COMMON = [
    Mutation("kv_cache_dtype", "unknown", lambda v: "fp4", "refuse"),
    Mutation("kv_cache_dtype", "not a str", lambda v: 8, "refuse"),
    Mutation("impl", "unknown", lambda v: "cuda", "refuse"),
]


def _slot_muts(capacity):
    return tensor_mutations("slot_mapping", [I32, I64], bounds=(-1, capacity - 1))


def _src_muts(arg):
    return (tensor_mutations(arg, FLOATS, exact_len=False, strided_same=False)
            + [Mutation(arg, "last dim strided", lambda t: torch.stack([t, t], -1)[..., 0], "refuse"),
               Mutation(arg, "rows strided", _row_strided, "same"),
               Mutation(arg, "no columns", lambda t: t[:, :0], "refuse")])


def _cache_muts(arg, entry_bytes):
    return (tensor_mutations(arg, [torch.uint8], exact_len=False, strided_same=False, output=True)
            + [Mutation(arg, "entries not contiguous", lambda c: c.as_strided(c.shape, (c.stride(0), entry_bytes + 1, 1)),
                        "refuse"),
               Mutation(arg, "blocks overlap", lambda c: c.as_strided(c.shape, (entry_bytes, entry_bytes, 1)), "refuse"),
               Mutation(arg, "no blocks", lambda c: c[:0], "refuse")])


INSERT_KV_MUTS = (_src_muts("kv") + _slot_muts(NB * BS) + _cache_muts("cache", LAY.entry_bytes) + COMMON
                  + [Mutation("layout", "wrong type", lambda v: "448/64", "refuse"),
                     Mutation("layout", "other head_dim", lambda v: FP8DSMLALayout(128, 16), "refuse")])


def _run(fn, make, mut):
    kwargs, state = make()
    baseline = None
    if mut.expect == "same":
        fn(**kwargs)
        baseline = [_bits(s) for s in state]
        kwargs, state = make()
    check_mutation(fn, kwargs, state, mut, baseline)


def _slots(seed, n, capacity):
    g = torch.Generator().manual_seed(seed)
    s = torch.randperm(capacity, generator=g)[:n]
    s[torch.rand(n, generator=g) < 0.2] = -1
    return s


@pytest.mark.parametrize("mut", INSERT_KV_MUTS, ids=repr)
@settings(max_examples=4, **SETTINGS)
@given(n=st.integers(1, 6), seed=st.integers(0, 99),
       impl=st.sampled_from(IMPLS))
def test_fuzz_insert_kv(n, seed, mut, impl):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(n, LAY.head_dim, generator=g)
    slots = _slots(seed, n, NB * BS)

    def make():
        cache = alloc_fp8_ds_mla_cache(NB, BS, LAY, fill=POISON)
        return dict(kv=kv.clone(), slot_mapping=slots.clone(), cache=cache, kv_cache_dtype="fp8_ds_mla", layout=LAY,
                    impl=impl), [cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0)]

    _run(insert_kv, make, mut)


INDEXER_MUTS = _src_muts("k") + _slot_muts(NB * BS) + _cache_muts("cache", 36) + COMMON


@pytest.mark.parametrize("mut", INDEXER_MUTS, ids=repr)
@settings(max_examples=4, **SETTINGS)
@given(n=st.integers(1, 6), seed=st.integers(0, 99),
       impl=st.sampled_from(IMPLS))
def test_fuzz_insert_indexer_k(n, seed, mut, impl):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, 32, generator=g)
    slots = _slots(seed, n, NB * BS)

    def make():
        cache = alloc_indexer_k_cache(NB, BS, 32, fill=POISON)
        return dict(k=k.clone(), slot_mapping=slots.clone(), cache=cache, kv_cache_dtype="fp8_ds_mla", impl=impl), [
            cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0)]

    _run(insert_indexer_k, make, mut)


STATE_MUTS = (
    _src_muts("kv")
    + tensor_mutations("score", FLOATS, strided_same=False) + [Mutation("score", "rows strided", _row_strided, "same")]
    + tensor_mutations("ape", FLOATS, exact_len=False, strided_same=False)
    + [Mutation("ape", "no rows", lambda t: t[:0], "refuse"), Mutation("ape", "rows strided", _row_strided, "same")]
    + tensor_mutations("positions", [I32, I64]) + _slot_muts(NB * BS)
    + tensor_mutations("state_cache", [F32], exact_len=False, strided_same=False, output=True)
    + [Mutation("state_cache", "no blocks", lambda c: c[:0], "refuse"), Mutation("impl", "unknown", lambda v: "x", "refuse")]
)


@pytest.mark.parametrize("mut", STATE_MUTS, ids=repr)
@settings(max_examples=4, **SETTINGS)
@given(n=st.integers(1, 6), seed=st.integers(0, 99),
       impl=st.sampled_from(IMPLS))
def test_fuzz_write_compressor_state(n, seed, mut, impl):
    g = torch.Generator().manual_seed(seed)
    kv, score = torch.randn(n, 16, generator=g), torch.randn(n, 16, generator=g)
    ape = torch.randn(4, 16, generator=g)
    pos = torch.randint(-5, 1000, (n,), generator=g)
    slots = _slots(seed, n, NB * BS)

    def make():
        cache = torch.full((NB, BS, 32), 7.0)
        return dict(kv=kv.clone(), score=score.clone(), ape=ape.clone(), positions=pos.clone(), slot_mapping=slots.clone(),
                    state_cache=cache, impl=impl), [cache]

    _run(write_compressor_state, make, mut)


@settings(max_examples=40, **SETTINGS)
@given(n=st.integers(2, 6), seed=st.integers(0, 99), bad=st.sampled_from([float("nan"), float("inf"), -float("inf")]),
       impl=st.sampled_from(IMPLS), dtype=st.sampled_from(["fp8_ds_mla", "auto"]))
def test_non_finite_rows_change_their_own_slot_only(n, seed, bad, impl, dtype):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(n, LAY.head_dim, generator=g)
    slots = _slots(seed, n, NB * BS)
    slots[0] = 5
    out = []
    for rows in (kv, kv.clone().index_fill_(0, torch.tensor([0]), bad)):
        if dtype == "fp8_ds_mla":
            cache = alloc_fp8_ds_mla_cache(NB, BS, LAY, fill=POISON)
            insert_kv(rows, slots, cache, dtype, layout=LAY, impl=impl)
            out.append(cache.as_strided((NB, BS, LAY.entry_bytes), cache.stride()).clone())
        else:
            cache = torch.zeros(NB, BS, LAY.head_dim)
            insert_kv(rows, slots, cache, dtype, impl=impl)
            out.append(cache.clone())
    # Compare every entry but slot 5 (token 0's) bit for bit; fp8 scale bytes of slot 5 live in its
    # own 8-byte scale row, data in its own 576... here 96-byte data row: both covered by entry 5.
    a, b = (o.reshape(NB * BS, -1) for o in out)
    if dtype == "fp8_ds_mla":
        pa = out[0].as_strided((NB, out[0].stride(0)), (out[0].stride(0), 1))
        pb = out[1].as_strided((NB, out[1].stride(0)), (out[1].stride(0), 1))
        mask = torch.ones_like(pa, dtype=torch.bool)
        blk, off = divmod(5, BS)
        mask[blk, off * LAY.data_bytes:(off + 1) * LAY.data_bytes] = False
        so = LAY.scale_offset(BS) + off * LAY.scale_bytes
        mask[blk, so:so + LAY.scale_bytes] = False
        assert torch.equal(pa[mask], pb[mask])
    else:
        keep = torch.ones(NB * BS, dtype=torch.bool)
        keep[5] = False
        assert torch.equal(a[keep], b[keep])


def test_unvalidated_slots_outside_the_cache_write_nothing():
    """validate_slots=False (CUDA-graph capture): slots past the cache or below -1 are skipped."""
    for impl in IMPLS:
        cache = alloc_fp8_ds_mla_cache(NB, BS, LAY, fill=POISON)
        flat = cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0)
        before = flat.clone()
        insert_kv(torch.randn(3, LAY.head_dim), torch.tensor([NB * BS, 2**31 - 1, -5]), cache, layout=LAY,
                  validate_slots=False, impl=impl)
        assert torch.equal(flat, before)
