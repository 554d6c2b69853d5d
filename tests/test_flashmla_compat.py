"""FlashMLA-compatible entry points: shapes, conventions (lse layout, natural log, max_logits,
invalid indices >= s_kv) and values against the fp64 oracle."""

from __future__ import annotations

import pytest
import torch

from dsv4attn.flashmla_compat import (
    FlashMLASchedMeta,
    flash_mla_sparse_fwd,
    flash_mla_with_kvcache,
    get_mla_metadata,
)
from dsv4attn.testing.attention_oracle import PROD_LAYOUT, SMALL_LAYOUT, SetSpec, assert_matches, build_set, oracle


def test_get_mla_metadata_is_a_placeholder():
    meta, second = get_mla_metadata(torch.zeros(3), 64, num_heads_k=1)
    assert isinstance(meta, FlashMLASchedMeta) and second is None and not meta.have_initialized


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_with_kvcache_two_caches_mtp(impl, device):
    """b=2 requests x s_q=2 (MTP) tokens, SWA cache + extra compressed cache, per-batch lengths."""
    gen = torch.Generator().manual_seed(21)
    batch, s_q, num_heads = 2, 2, 3
    num_tokens = batch * s_q
    lens_a, lens_b = [33, 5], [40, 0]
    a = build_set(SetSpec("indices", True, 64, 40), num_tokens, [0] * num_tokens, PROD_LAYOUT, gen, device,
                  lengths=[n for n in lens_a for _ in range(s_q)])
    b = build_set(SetSpec("indices", True, 2, 48), num_tokens, [0] * num_tokens, PROD_LAYOUT, gen, device,
                  lengths=[n for n in lens_b for _ in range(s_q)])
    q = torch.randn(batch, s_q, num_heads, 512, generator=gen).to(torch.bfloat16)
    sink = torch.tensor([0.5, float("-inf"), 3.0])
    meta, _ = get_mla_metadata()
    i32 = dict(dtype=torch.int32, device=device)
    out, lse = flash_mla_with_kvcache(
        q.to(device), a.cset.cache.unsqueeze(-2), None, None, 512, meta, softmax_scale=0.1, is_fp8_kvcache=True,
        indices=a.cset.indices.view(batch, s_q, -1), attn_sink=sink.to(device),
        extra_k_cache=b.cset.cache.unsqueeze(-2), extra_indices_in_kvcache=b.cset.indices.view(batch, s_q, -1),
        topk_length=torch.tensor(lens_a, **i32), extra_topk_length=torch.tensor(lens_b, **i32), impl=impl)
    assert out.shape == (batch, s_q, num_heads, 512) and lse.shape == (batch, num_heads, s_q)
    qf = q.view(num_tokens, num_heads, 512)
    ref_o, ref_l = oracle(qf, [a, b], 0.1, sink)
    base_o, base_l = oracle(qf, [a, b], 0.1, sink, low_precision=True)
    assert_matches(out.reshape(num_tokens, num_heads, 512), lse.transpose(1, 2).reshape(num_tokens, num_heads),
                   (ref_o, ref_l), (base_o, base_l), "with_kvcache")
    # The metadata object is bound to these shapes now.
    with pytest.raises(ValueError, match="tile_scheduler_metadata"):
        flash_mla_with_kvcache(q[:1].to(device), a.cset.cache.unsqueeze(-2), None, None, 512, meta,
                               is_fp8_kvcache=True, indices=a.cset.indices.view(batch, s_q, -1)[:1], impl=impl)


def test_with_kvcache_rejects_dense_and_bad_args(device):
    gen = torch.Generator().manual_seed(2)
    a = build_set(SetSpec("indices", True, 16, 8), 2, [0, 0], SMALL_LAYOUT, gen, device)
    q = torch.zeros(2, 1, 4, SMALL_LAYOUT.head_dim, dtype=torch.bfloat16, device=device)
    cache = a.cset.cache.unsqueeze(-2)
    meta, _ = get_mla_metadata()
    with pytest.raises(ValueError, match="sparse mode"):
        flash_mla_with_kvcache(q, cache, None, None, 80, meta)
    with pytest.raises(ValueError, match="causal"):
        flash_mla_with_kvcache(q, cache, None, None, 80, meta, causal=True, is_fp8_kvcache=True,
                               indices=a.cset.indices.view(2, 1, -1))
    with pytest.raises(TypeError, match="is_fp8_kvcache"):
        flash_mla_with_kvcache(q, cache, None, None, 80, meta, indices=a.cset.indices.view(2, 1, -1))
    with pytest.raises(ValueError, match="topk_length"):
        flash_mla_with_kvcache(q, cache, None, None, 80, meta, is_fp8_kvcache=True,
                               indices=a.cset.indices.view(2, 1, -1),
                               topk_length=torch.zeros(3, dtype=torch.int32, device=device))


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("d_v", [80, 64])
def test_sparse_fwd_flat_kv(impl, d_v, device):
    """Flat bf16 kv with NaN rows nobody may read; -1, >= s_kv and past-length indices."""
    gen = torch.Generator().manual_seed(33)
    s_q, num_heads, d, s_kv, topk = 5, 4, SMALL_LAYOUT.head_dim, 50, 70
    kv = torch.randn(s_kv, 1, d, generator=gen).to(torch.bfloat16)
    kv[40:] = float("nan")  # rows >= 40 are never valid candidates
    idx = torch.randint(0, 40, (s_q, 1, topk), generator=gen, dtype=torch.int32)
    idx[:, :, ::7] = -1
    idx[:, :, 3::11] = s_kv + 3  # >= s_kv: invalid
    lens = torch.tensor([topk, 10, 0, 1, 64], dtype=torch.int32)
    for t in range(s_q):
        idx[t, 0, lens[t]:] = 45  # past the length: points at NaN rows
    idx[3, 0, 0] = -1  # token 3: its single candidate is a hole -> empty row
    q = torch.randn(s_q, num_heads, d, generator=gen).to(torch.bfloat16)
    sink = torch.tensor([float("inf"), 0.0, -1.0, float("-inf")])
    out, max_logits, lse = flash_mla_sparse_fwd(q.to(device), kv.to(device), idx.to(device), 0.2, d_v=d_v,
                                                attn_sink=sink.to(device), topk_length=lens.to(device), impl=impl)
    assert out.shape == (s_q, num_heads, d_v) and max_logits.shape == lse.shape == (s_q, num_heads)

    class _Built:  # oracle input: decoded rows + valid slots per token
        kdec = kv[:, 0].double()
        slots = [[int(s) for s in idx[t, 0, : lens[t]] if 0 <= s < s_kv] for t in range(s_q)]

    ref_o, ref_l = oracle(q, [_Built], 0.2, sink)
    base_o, base_l = oracle(q, [_Built], 0.2, sink, low_precision=True)
    assert_matches(out, lse, (ref_o[..., :d_v], ref_l), (base_o[..., :d_v], base_l), "sparse_fwd")
    assert torch.isinf(lse[2]).all() and torch.isinf(lse[3]).all() and (lse[2] > 0).all()
    for t in range(s_q):
        if not _Built.slots[t]:
            assert torch.isneginf(max_logits[t]).all()
            continue
        k = kv[_Built.slots[t], 0].double()
        want = (q[t].double() @ k.T * 0.2).amax(-1)
        torch.testing.assert_close(max_logits[t].cpu().double(), want, rtol=1e-5, atol=1e-5)


def test_sparse_fwd_rejects_bad_args(device):
    q = torch.zeros(2, 4, 80, dtype=torch.bfloat16, device=device)
    kv = torch.zeros(10, 1, 80, dtype=torch.bfloat16, device=device)
    idx = torch.zeros(2, 1, 8, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="kv"):
        flash_mla_sparse_fwd(q, kv[:, :, :64], idx, 0.1)
    with pytest.raises(ValueError, match="indices"):
        flash_mla_sparse_fwd(q, kv, idx[:1], 0.1)
    with pytest.raises(TypeError, match="indices"):
        flash_mla_sparse_fwd(q, kv, idx.long(), 0.1)
    with pytest.raises(ValueError, match="d_v"):
        flash_mla_sparse_fwd(q, kv, idx, 0.1, d_v=512)
    with pytest.raises(ValueError, match="indexer_topk"):
        flash_mla_sparse_fwd(q, kv, idx, 0.1, d_v=80, indexer_topk=512)


def _contiguous_copy(cache: torch.Tensor) -> torch.Tensor:
    """The same entries in a contiguous (num_blocks, block_size, 584) buffer (block stride
    block_size * 584, no page padding), as engines' tests allocate caches."""
    nb, bs, eb = cache.shape
    flat = torch.zeros(nb * bs * eb, dtype=torch.uint8, device=cache.device)
    for b in range(nb):
        flat[b * bs * eb : (b + 1) * bs * eb] = cache.as_strided((bs * eb,), (1,), cache.storage_offset()
                                                                  + b * cache.stride(0))
    return flat.view(nb, bs, eb)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_with_kvcache_fp8_dtype_contiguous_cache_and_out(impl, device):
    """FlashMLA's float8_e4m3fn view of the bytes, a contiguous cache (block stride 584 * bs)
    and a preallocated out give exactly the uint8 padded-page result; the metadata object
    carries FlashMLA's fields and is not bound by a call that fails validation."""
    gen = torch.Generator().manual_seed(8)
    batch, h = 3, 4
    a = build_set(SetSpec("indices", True, 16, 50), batch, [0] * batch, PROD_LAYOUT, gen, device)
    q = torch.randn(batch, 1, h, 512, generator=gen).to(torch.bfloat16).to(device)
    idx = a.cset.indices.view(batch, 1, -1)
    meta, _ = get_mla_metadata()
    lens = a.cset.lengths  # past the length: poisoned entries
    want_o, want_l = flash_mla_with_kvcache(q, a.cset.cache.unsqueeze(-2), None, None, 512, meta, is_fp8_kvcache=True,
                                            indices=idx, topk_length=lens, impl=impl)
    assert torch.isfinite(want_o).all()
    assert meta.tile_scheduler_metadata is None and meta.num_splits.dtype == torch.int32
    contiguous = _contiguous_copy(a.cset.cache)
    assert contiguous.stride(0) == 16 * 584 < a.cset.cache.stride(0)
    out = torch.full((batch, 1, h, 512), float("nan"), dtype=torch.bfloat16, device=device)
    meta2, _ = get_mla_metadata()
    with pytest.raises(ValueError, match="out"):  # bad out: refused, meta2 stays unbound
        flash_mla_with_kvcache(q, contiguous.unsqueeze(-2), None, None, 512, meta2, is_fp8_kvcache=True,
                               indices=idx, topk_length=lens, out=out[:, :, :2], impl=impl)
    assert not meta2.have_initialized and meta2.config is None
    got_o, got_l = flash_mla_with_kvcache(q, contiguous.unsqueeze(-2).view(torch.float8_e4m3fn), None, None, 512,
                                          meta2, is_fp8_kvcache=True, indices=idx, topk_length=lens, out=out,
                                          impl=impl)
    assert got_o.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, want_o, rtol=0, atol=0)
    torch.testing.assert_close(got_l, want_l, rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_sparse_fwd_writes_out_in_place(impl, device):
    gen = torch.Generator().manual_seed(9)
    s_q, h, d = 3, 4, SMALL_LAYOUT.head_dim
    kv = torch.randn(30, 1, d, generator=gen).to(torch.bfloat16).to(device)
    idx = torch.randint(0, 30, (s_q, 1, 12), generator=gen, dtype=torch.int32).to(device)
    q = torch.randn(s_q, h, d, generator=gen).to(torch.bfloat16).to(device)
    want = flash_mla_sparse_fwd(q, kv, idx, 0.2, d_v=d, impl=impl)
    for d_v in (d, 64):  # in place, and through a copy when only the first d_v dims are asked
        out = torch.zeros(s_q, h, d_v, dtype=torch.bfloat16, device=device)
        got = flash_mla_sparse_fwd(q, kv, idx, 0.2, d_v=d_v, out=out, impl=impl)
        assert got[0].data_ptr() == out.data_ptr()
        torch.testing.assert_close(out, want[0][..., :d_v], rtol=0, atol=0)
        torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_no_topk_length_means_whole_rows(impl, device):
    """Without ``topk_length`` every index row counts whole (no per-call lengths vector):
    same result as passing the full width, for both entry points."""
    gen = torch.Generator().manual_seed(41)
    s_q, num_heads, d, s_kv, topk = 4, 3, SMALL_LAYOUT.head_dim, 30, 19
    kv = torch.randn(s_kv, 1, d, generator=gen).to(torch.bfloat16).to(device)
    idx = torch.randint(-1, s_kv + 4, (s_q, 1, topk), generator=gen, dtype=torch.int32).to(device)
    q = torch.randn(s_q, num_heads, d, generator=gen).to(torch.bfloat16).to(device)
    full = torch.full((s_q,), topk, dtype=torch.int32, device=device)
    got = flash_mla_sparse_fwd(q, kv, idx, 0.2, d_v=d, impl=impl)
    want = flash_mla_sparse_fwd(q, kv, idx, 0.2, d_v=d, topk_length=full, impl=impl)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    a = build_set(SetSpec("indices", True, 16, 24), s_q, [0] * s_q, SMALL_LAYOUT, gen, device, lengths=[24] * s_q)
    q4 = torch.randn(s_q, 1, num_heads, d, generator=gen).to(torch.bfloat16)
    out, lse = flash_mla_with_kvcache(q4.to(device), a.cset.cache.unsqueeze(-2), None, None, d, get_mla_metadata()[0],
                                      softmax_scale=0.1, is_fp8_kvcache=True, indices=a.cset.indices.view(s_q, 1, -1),
                                      impl=impl)
    qf = q4.view(s_q, num_heads, d)
    assert_matches(out.view(s_q, num_heads, d), lse.view(s_q, num_heads), oracle(qf, [a], 0.1, None),
                   oracle(qf, [a], 0.1, None, True), "with_kvcache, no topk_length")
