"""Fuzz: the step boundary (BatchMetadata, MetadataConfig, StepMetadataBuilder) against generated
bad inputs: refused with the argument named before any builder buffer changes."""

from __future__ import annotations

import pytest
import torch
from fuzz_common import Mutation, _bits, check_mutation, int_mutations
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4attn.metadata import BatchMetadata, MetadataConfig, StepMetadataBuilder

I32, I64 = torch.int32, torch.int64
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
NUM_BLOCKS = 64


def _tables(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return {"swa": torch.randint(0, NUM_BLOCKS, (rows, 16), generator=g, dtype=I32),
            "full_mla": torch.randint(0, NUM_BLOCKS, (rows, 4), generator=g, dtype=I32)}


def _from_requests(query_lens, seq_lens, block_tables, **kw):
    return BatchMetadata.from_requests(query_lens, seq_lens, block_tables, **kw)


REQ_MUTS = (
    [Mutation("query_lens", "negative", lambda v: [-1] + v[1:], "refuse"),
     Mutation("query_lens", "str", lambda v: "12", "refuse"),
     Mutation("query_lens", "float entry", lambda v: [1.0] + v[1:], "refuse", "query_lens[0]"),
     Mutation("query_lens", "int64 tensor", lambda v: torch.tensor(v), "refuse"),
     Mutation("seq_lens", "shorter than the query", lambda v: [0] * len(v), "refuse"),
     Mutation("seq_lens", "past int32", lambda v: [2**31] * len(v), "refuse"),
     Mutation("seq_lens", "one more request", lambda v: v + [3], "refuse", "query_start_loc"),
     Mutation("block_tables", "not a mapping", lambda v: list(v.values()), "refuse"),
     Mutation("block_tables", "no swa table", lambda v: {"full_mla": v["full_mla"]}, "refuse"),
     Mutation("block_tables", "unknown group", lambda v: dict(v, c4=v["swa"]), "refuse"),
     Mutation("block_tables", "int64 table", lambda v: dict(v, swa=v["swa"].long()), "refuse"),
     Mutation("block_tables", "too few rows", lambda v: dict(v, swa=v["swa"][:0]), "refuse"),
     Mutation("block_tables", "table on meta", lambda v: dict(v, full_mla=v["full_mla"].to("meta")), "refuse"),
     Mutation("block_tables", "too few columns to derive slots", lambda v: dict(v, swa=v["swa"][:, :1]), "refuse"),
     Mutation("slot_mapping", "wrong dtype", lambda v: torch.zeros(1, dtype=I32), "refuse"),
     Mutation("positions", "inconsistent", lambda v: torch.full((1,), 10**6, dtype=I64), "refuse"),
     Mutation("device", "bogus", lambda v: "gpu7", "refuse"),
     Mutation("device", "not a device", lambda v: 3, "refuse")]
    + int_mutations("num_speculative_tokens", [-1]) + int_mutations("swa_block_size", [0, -64])
)


@pytest.mark.parametrize("mut", REQ_MUTS, ids=repr)
@settings(max_examples=4, **SETTINGS)
@given(n=st.integers(1, 4), seed=st.integers(0, 99))
def test_fuzz_batch_from_requests(n, seed, mut):
    ql = [1] * n
    sl = [71 + 7 * i for i in range(n)]
    kw = dict(query_lens=ql, seq_lens=sl, block_tables=_tables(n, seed), slot_mapping=None, positions=None,
              num_speculative_tokens=0, swa_block_size=64, device=None)
    if mut.arg in ("slot_mapping", "positions") and n != 1:
        return
    check_mutation(_from_requests, kw, [], mut)


CONFIG_MUTS = (
    [m for name in ("max_num_batched_tokens", "max_num_reqs", "max_model_len", "window_size", "swa_block_size",
                    "mla_block_size", "index_topk") for m in int_mutations(name, [0, -1])]
    + int_mutations("max_model_len", [2**31]) + int_mutations("max_num_batched_tokens", [2**31])
    + [Mutation("num_blocks", "missing group", lambda v: {"swa": 8}, "refuse", "full_mla"),
       Mutation("num_blocks", "zero", lambda v: 0, "refuse"),
       Mutation("num_blocks", "str", lambda v: "8", "refuse"),
       Mutation("num_blocks", "slots past int32", lambda v: 2**30, "refuse"),
       Mutation("form", "unknown", lambda v: "dense", "refuse"),
       Mutation("compress_ratios", "ratio 16", lambda v: (4, 16), "refuse"),
       Mutation("compress_ratios", "repeated", lambda v: (4, 4), "refuse")]
)


@pytest.mark.parametrize("mut", CONFIG_MUTS, ids=repr)
def test_fuzz_metadata_config(mut):
    kw = dict(max_num_batched_tokens=64, max_num_reqs=8, max_model_len=1024, num_blocks=NUM_BLOCKS, window_size=128,
              compress_ratios=(4, 128), swa_block_size=64, mla_block_size=256, index_topk=512, form="full")
    check_mutation(MetadataConfig, kw, [], mut)


def _builder():
    return StepMetadataBuilder(MetadataConfig(max_num_batched_tokens=16, max_num_reqs=4, max_model_len=1024,
                                              num_blocks=NUM_BLOCKS, form="full", index_topk=8), "cpu")


def _batch(seed, tables=None, slot_mapping=None):
    t = _tables(2, seed) if tables is None else tables
    return BatchMetadata.from_requests([1, 3], [300, 3], t, slot_mapping)


BUILD_MUTS = [
    Mutation("batch", "not a batch", lambda b: {"swa": 1}, "refuse"),
    Mutation("batch", "block id past num_blocks", lambda b: _batch(0, dict(_tables(2, 0), full_mla=torch.full(
        (2, 4), NUM_BLOCKS, dtype=I32))), "refuse", "block_tables"),
    Mutation("batch", "slot past the SWA cache", lambda b: _batch(0, slot_mapping=torch.full(
        (4,), NUM_BLOCKS * 64, dtype=I64)), "refuse", "slot_mapping"),
    Mutation("batch", "missing full_mla table", lambda b: BatchMetadata.from_requests(
        [1, 3], [300, 3], {"swa": _tables(2, 0)["swa"]}), "refuse", "full_mla"),
    Mutation("batch", "context past max_model_len", lambda b: BatchMetadata.from_requests(
        [1], [2000], {"swa": torch.zeros(1, 40, dtype=I32), "full_mla": torch.zeros(1, 8, dtype=I32)}), "refuse",
        "max_model_len"),
    Mutation("impl", "unknown", lambda v: "fast", "refuse"),
]


@pytest.mark.parametrize("mut", BUILD_MUTS, ids=repr)
def test_fuzz_builder_build(mut):
    builder = _builder()
    builder.build(_batch(1))
    state = list(builder.buffers().values())
    check_mutation(builder.build, dict(batch=_batch(2), impl="reference"), state, mut)


@pytest.mark.parametrize("mut", [
    Mutation("topk_local", "int64", lambda t: t.long(), "refuse"),
    Mutation("topk_local", "more rows than tokens", lambda t: torch.zeros(9, 2, dtype=I32), "refuse"),
    Mutation("topk_local", "wider than index_topk", lambda t: torch.zeros(4, 9, dtype=I32), "refuse"),
    Mutation("topk_local", "list", lambda t: t.tolist(), "refuse"),
    Mutation("step", "not a step", lambda s: object(), "refuse"),
], ids=repr)
def test_fuzz_builder_global_topk(mut):
    builder = _builder()
    step = builder.build(_batch(3))
    state = [builder.c4_global_topk, builder.c4_topk_lens]
    check_mutation(builder.global_topk, dict(step=step, topk_local=torch.zeros(4, 2, dtype=I32)), state, mut)


def test_strided_slot_mapping_equals_contiguous():
    a = _builder().build(_batch(4, slot_mapping=torch.arange(4, dtype=I64)))
    sm = torch.stack([torch.arange(4, dtype=I64)] * 2, -1)[:, 0]
    assert not sm.is_contiguous()
    b = _builder().build(_batch(4, slot_mapping=sm))
    assert _bits(a.swa.decode_indices) == _bits(b.swa.decode_indices)
    assert _bits(a.compressed[4].slot_mapping) == _bits(b.compressed[4].slot_mapping)
