"""Prefill path (``prefill=True``): range-form sets shared by blocks of consecutive tokens.

Realistic prefill metadata (SWA windows sliding by one entry, a dense compressed prefix) for
two requests, optionally merged with a per-token top-k set, in sorted and shuffled token
order; checked against the fp64 oracle with the 2x bf16-run rule.
"""

from __future__ import annotations

import pytest
import torch

from dsv4attn.ops.sparse_attn import sparse_mla_attention
from dsv4attn.testing.attention_oracle import SMALL_LAYOUT, SetSpec, assert_matches, build_set, make_sink, oracle

WINDOW = 16


def _prefill_batch(num_heads: int, with_topk: bool, shuffle: bool, device, fp8: bool = True):
    gen = torch.Generator().manual_seed(100 + num_heads * 2 + with_topk + 4 * shuffle)
    # Request 0: positions 30..41 (chunked prefill); request 1: positions 0..8 (fresh prompt).
    toks = [(0, p) for p in range(30, 42)] + [(1, p) for p in range(0, 9)]
    if shuffle:
        order = torch.randperm(len(toks), generator=gen).tolist()
        toks = [toks[i] for i in order]
    req = [r for r, _ in toks]
    pos = [p for _, p in toks]
    num_tokens = len(toks)
    swa = build_set(SetSpec("range", fp8, 16, WINDOW), num_tokens, req, SMALL_LAYOUT, gen, device,
                    lengths=[min(p + 1, WINDOW) for p in pos], starts=[max(0, p - WINDOW + 1) for p in pos])
    if with_topk:
        other = build_set(SetSpec("indices", True, 16, 20), num_tokens, req, SMALL_LAYOUT, gen, device)
    else:  # dense compressed prefix, ratio 4 here: entries 0 .. (p+1)//4 - 1
        other = build_set(SetSpec("range", True, 2, 12), num_tokens, req, SMALL_LAYOUT, gen, device,
                          lengths=[(p + 1) // 4 for p in pos], starts=[0] * num_tokens)
    q = torch.randn(num_tokens, num_heads, SMALL_LAYOUT.head_dim, generator=gen).to(torch.bfloat16)
    sink = make_sink(num_heads, "inf", gen)
    return q, [swa, other], sink


@pytest.mark.parametrize("num_heads", [1, 3, 8])
@pytest.mark.parametrize("with_topk", [False, True], ids=["range+range", "range+topk"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["sorted", "shuffled"])
def test_prefill_matches_oracle(num_heads, with_topk, shuffle, device):
    q, built, sink = _prefill_batch(num_heads, with_topk, shuffle, device)
    scale = SMALL_LAYOUT.head_dim**-0.5 * 2.0
    out, lse = sparse_mla_attention(q.to(device), [b.cset for b in built], scale, sink.to(device), impl="triton",
                                    prefill=True)
    assert_matches(out, lse, oracle(q, built, scale, sink), oracle(q, built, scale, sink, True), "prefill")
    out_d, lse_d = sparse_mla_attention(q.to(device), [b.cset for b in built], scale, sink.to(device), impl="triton")
    torch.testing.assert_close(lse, lse_d, rtol=1e-5, atol=1e-5)


def test_prefill_bf16_pages_single_set(device):
    q, built, sink = _prefill_batch(4, False, False, device, fp8=False)
    out, lse = sparse_mla_attention(q.to(device), [built[0].cset], 0.2, None, impl="triton", prefill=True)
    assert_matches(out, lse, oracle(q, built[:1], 0.2, None), oracle(q, built[:1], 0.2, None, True), "prefill-bf16")
