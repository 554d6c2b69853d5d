"""Regression tests of the attention op's input hardening (issue 11) and batch invariance.

Strided per-token vectors, token_to_req outside the block table, unbounded range lengths,
NaN entries that are candidates of one token of a shared prefill tile only, and the
deterministic mode. Each case compares the Triton path (interpreter on CPU) with the
reference and/or with the same inputs in a plainly valid form.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4attn.ops.candidate_set import MAX_ENTRIES, CandidateSet
from dsv4attn.ops.sparse_attn import sparse_mla_attention
from dsv4attn.testing.attention_oracle import SMALL_LAYOUT, SetSpec, build_set

D = SMALL_LAYOUT.head_dim
I32 = torch.int32


def _strided(x: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (every second element of a larger buffer)."""
    buf = torch.full((x.shape[0], 2), 12345, dtype=x.dtype, device=x.device)
    buf[:, 0] = x
    return buf[:, 0]


def _close(a, b):
    torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_strided_per_token_vectors_read_as_their_values(impl, device):
    gen = torch.Generator().manual_seed(3)
    a = build_set(SetSpec("range", True, 16, 40), 4, [0, 0, 1, 1], SMALL_LAYOUT, gen, device).cset
    b = build_set(SetSpec("indices", True, 16, 30), 4, [0, 0, 1, 1], SMALL_LAYOUT, gen, device).cset
    q = torch.randn(4, 3, D, generator=gen).bfloat16().to(device)
    sink = torch.randn(3, generator=gen).to(device)
    ref = sparse_mla_attention(q, [a, b], 0.1, sink, impl=impl)
    a2 = dataclasses.replace(a, lengths=_strided(a.lengths), starts=_strided(a.starts),
                             token_to_req=_strided(a.token_to_req))
    b2 = dataclasses.replace(b, lengths=_strided(b.lengths))
    sink2 = torch.stack([sink, sink + 100], 1)[:, 0]
    assert not a2.lengths.is_contiguous() and not sink2.is_contiguous()
    got = sparse_mla_attention(q, [a2, b2], 0.1, sink2, impl=impl)
    _close(got[0], ref[0])
    _close(got[1], ref[1])


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_token_to_req_outside_the_table_means_no_candidates(impl, device):
    gen = torch.Generator().manual_seed(4)
    a = build_set(SetSpec("range", True, 16, 40), 4, [0, 0, 1, 1], SMALL_LAYOUT, gen, device).cset
    b = build_set(SetSpec("indices", True, 16, 30), 4, [0, 0, 1, 1], SMALL_LAYOUT, gen, device).cset
    q = torch.randn(4, 3, D, generator=gen).bfloat16().to(device)
    bad_req = torch.tensor([0, -1, 1, 2], dtype=I32, device=device)  # 2 rows in the table
    got = sparse_mla_attention(q, [dataclasses.replace(a, token_to_req=bad_req), b], 0.1, impl=impl)
    empty = dataclasses.replace(a, lengths=torch.where(bad_req[:, None] == torch.tensor([-1, 2], device=device),
                                                       0, a.lengths[:, None]).amin(1).to(I32))
    want = sparse_mla_attention(q, [empty, b], 0.1, impl=impl)
    _close(got[0], want[0])
    _close(got[1], want[1])


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_range_lengths_are_bounded_by_the_block_table(impl, device):
    """Lengths near the int32 limit, and starts far past the table, cost the table's work and
    give the result of the clipped ranges (no overflow to an empty result, no unbounded loop)."""
    gen = torch.Generator().manual_seed(5)
    a = build_set(SetSpec("range", True, 16, 40), 3, [0, 0, 1], SMALL_LAYOUT, gen, device).cset
    span = a.block_table.shape[1] * a.block_size
    q = torch.randn(3, 2, D, generator=gen).bfloat16().to(device)
    starts = torch.tensor([0, 5, 2**31 - 10], dtype=I32, device=device)
    huge = dataclasses.replace(a, starts=starts, lengths=torch.full((3,), 2**31 - 1, dtype=I32, device=device))
    clipped = dataclasses.replace(a, starts=starts, lengths=torch.tensor([span, span - 5, 0], dtype=I32,
                                                                         device=device))
    got = sparse_mla_attention(q, [huge], 0.1, impl=impl)
    want = sparse_mla_attention(q, [clipped], 0.1, impl=impl)
    _close(got[0], want[0])
    _close(got[1], want[1])
    assert torch.isinf(got[1][2]).all() and torch.isfinite(got[1][:2]).all()


def test_block_table_span_beyond_int32_is_refused(device):
    cache = torch.zeros(1, 1, D, dtype=torch.bfloat16, device=device).expand(1, 1 << 21, D)
    s = CandidateSet(cache=cache, lengths=torch.ones(1, dtype=I32, device=device),
                     block_table=torch.zeros(1, (MAX_ENTRIES >> 21) + 1, dtype=I32, device=device),
                     token_to_req=torch.zeros(1, dtype=I32, device=device),
                     starts=torch.zeros(1, dtype=I32, device=device))
    with pytest.raises(ValueError, match="block_table spans"):
        sparse_mla_attention(torch.zeros(1, 1, D, dtype=torch.bfloat16, device=device), [s], 0.1)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_prefill_tile_keeps_a_nan_entry_to_the_tokens_it_belongs_to(fp8, device):
    """8 tokens of one request in one shared prefill tile, sliding windows of 4 entries: entry 0
    holds NaN. It is a candidate of token 0 only; every other token's output must equal the
    reference (no 0 * NaN through the shared tile); token 0's out and lse are NaN, as in the
    reference."""
    gen = torch.Generator().manual_seed(6)
    built = build_set(SetSpec("range", fp8, 16, 4), 8, [0] * 8, SMALL_LAYOUT, gen, device,
                      lengths=[4] * 8, starts=list(range(8)))
    s = built.cset
    blk0 = int(s.block_table[0, 0])
    if fp8:
        from dsv4attn.kv_cache.layout import pages_of

        pages = pages_of(s.cache, SMALL_LAYOUT)
        rope_at = SMALL_LAYOUT.nope_dim  # first RoPE bf16 of entry 0
        pages[blk0, rope_at : rope_at + 2] = torch.tensor([0xC0, 0x7F], dtype=torch.uint8)  # bf16 NaN
    else:
        s.cache[blk0, 0, 5] = float("nan")
    q = torch.randn(8, 4, D, generator=gen).bfloat16().to(device)
    got_o, got_l = sparse_mla_attention(q, [s], 0.1, impl="triton", prefill=True)
    ref_o, ref_l = sparse_mla_attention(q, [s], 0.1, impl="reference")
    assert torch.isnan(ref_o[0]).all() and torch.isnan(got_o[0]).all() and torch.isnan(got_l[0]).all()
    assert torch.isfinite(got_o[1:]).all()
    torch.testing.assert_close(got_o[1:].float(), ref_o[1:].float(), rtol=0, atol=2e-2)
    torch.testing.assert_close(got_l[1:], ref_l[1:], rtol=0, atol=1e-3)


def test_deterministic_mode_is_batch_invariant(device):
    """A token's output bits do not depend on the other tokens of the call (different batch
    sizes would pick different split-KV factors by default)."""
    gen = torch.Generator().manual_seed(7)
    n = 6
    sets = [build_set(SetSpec("indices", True, 16, 150), n, [0] * n, SMALL_LAYOUT, gen, device).cset,
            build_set(SetSpec("range", True, 16, 40), n, list(range(n)), SMALL_LAYOUT, gen, device).cset]
    q = torch.randn(n, 20, D, generator=gen).bfloat16().to(device)

    def rows(idx):
        sub = []
        for s in sets:
            kw = {k: getattr(s, k)[idx] for k in ("lengths", "indices", "token_to_req", "starts")
                  if getattr(s, k) is not None}
            sub.append(dataclasses.replace(s, **kw))
        return sparse_mla_attention(q[idx], sub, 0.1, deterministic=True, prefill=True, impl="triton")

    full_o, full_l = rows(torch.arange(n))
    for idx in (torch.tensor([2]), torch.tensor([4, 2, 0])):
        o, lse = rows(idx)
        assert torch.equal(o.cpu(), full_o[idx].cpu()) and torch.equal(lse.cpu(), full_l[idx].cpu())
    with pytest.raises(TypeError, match="deterministic"):
        sparse_mla_attention(q, sets, 0.1, deterministic=1)
