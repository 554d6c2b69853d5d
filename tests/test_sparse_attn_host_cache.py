"""The host-path caches of the sparse attention (issue 9) never change a result or a refusal.

Per-shape decisions (fp8 layout, geometry, kernel config, launch constexprs) are cached in LRUs
of pure functions. These tests make a call, then change one thing the caches are keyed by (head
count, token count, q dtype, layout, device index, split knobs) and check the next call against
the fp64 oracle or the uncached function; and that bad input after a good call is still refused
with nothing written.
"""

from __future__ import annotations

import pytest
import torch

from dsv4attn.flashmla_compat import flash_mla_with_kvcache, get_mla_metadata
from dsv4attn.ops import sparse_attn as sa
from dsv4attn.ops import sparse_attn_launch as sl
from dsv4attn.ops.candidate_set import CandidateSet, layout_for
from dsv4attn.testing.attention_oracle import (
    PROD_LAYOUT,
    SMALL_LAYOUT,
    SetSpec,
    assert_matches,
    build_set,
    make_sink,
    oracle,
)


def _case(device, num_tokens, num_heads, layout, gen, form="indices"):
    built = [build_set(SetSpec(form, True, 16, 24), num_tokens, [0] * num_tokens, layout, gen, device)]
    q = torch.randn(num_tokens, num_heads, layout.head_dim, generator=gen).to(torch.bfloat16)
    return built, q, make_sink(num_heads, "finite", gen)


def _check(device, built, q, sink, impl="triton", what="", **kw):
    out, lse = sa.sparse_mla_attention(q.to(device), [b.cset for b in built], 0.125,
                                       None if sink is None else sink.to(device), impl=impl, **kw)
    qf = q.float() if q.dtype == torch.float32 else q
    assert_matches(out.float() if out.dtype == torch.float32 else out, lse,
                   oracle(qf, built, 0.125, sink), oracle(qf, built, 0.125, sink, True), what)
    return out


def test_changed_heads_tokens_dtype_layout_after_cached_call(device):
    """Same call site, one keyed property changed per call: every result matches the oracle."""
    gen = torch.Generator().manual_seed(5)
    built, q, sink = _case(device, 3, 4, SMALL_LAYOUT, gen)
    _check(device, built, q, sink, what="first")
    _check(device, built, q, sink, what="again (cached)")
    b2, q2, s2 = _case(device, 3, 16, SMALL_LAYOUT, gen)  # head count -> other tile
    _check(device, b2, q2, s2, what="16 heads")
    b3, q3, s3 = _case(device, 5, 4, SMALL_LAYOUT, gen, form="range")  # tokens and set form
    _check(device, b3, q3, s3, what="range form, 5 tokens")
    out = _check(device, built, q.float(), sink, what="fp32 q")  # dtype -> OUT_BF16 constexpr
    assert out.dtype == torch.float32
    b4, q4, s4 = _case(device, 2, 4, PROD_LAYOUT, gen)  # layout -> geometry
    _check(device, b4, q4, s4, what="production layout")
    _check(device, built, q, sink, what="split 2", num_splits=2)  # split knob -> config key
    _check(device, built, q, None, what="no sink")  # HAS_SINK constexpr


def test_cached_config_equals_uncached_and_keys_the_device(monkeypatch):
    """The config LRU returns exactly kernel_config's answer, per device index (SM counts
    differ between devices; a cached answer of one device must not serve another)."""
    monkeypatch.setattr(sl, "sm_count", lambda dev: {0: 132, 1: 16}[dev.index])
    monkeypatch.setattr(sl, "sm90_kernel_available", lambda dev: dev.index == 0)  # no real device 1 needed
    sl._cached_config.cache_clear()
    try:
        for args in [(64, 64, 512, 640), (64, 128, 512, 640), (4096, 64, 512, 640), (1, 8, 80, 33)]:
            for dev in (torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")):
                for splits, det in [(None, False), (None, True), (3, False)]:
                    want = sl.kernel_config(*args, dev, splits, det)
                    assert sl._cached_config(*args, dev, splits, det) == want
                    assert sl._cached_config(*args, dev, splits, det) == want  # served from the cache
        # h64 B64 splits on the 132-SM device, not on the 16-SM one: the device is in the key.
        assert sl._cached_config(64, 64, 512, 640, torch.device("cuda", 0), None, False).num_splits == 2
        assert sl._cached_config(64, 64, 512, 640, torch.device("cuda", 1), None, False).num_splits == 1
    finally:
        sl._cached_config.cache_clear()


def test_bad_input_after_good_call_is_refused_before_any_write(device):
    gen = torch.Generator().manual_seed(6)
    built, q, sink = _case(device, 3, 4, SMALL_LAYOUT, gen)
    sets = [b.cset for b in built]
    qd, sd = q.to(device), sink.to(device)
    sa.sparse_mla_attention(qd, sets, 0.125, sd, impl="triton")
    out = torch.full_like(qd, 7.0)
    bad = [
        (TypeError, "q must have dtype", dict(q=qd.half())),
        (ValueError, "attn_sink must have shape", dict(attn_sink=sd[:3])),
        (ValueError, "layout head_dim", dict(sets=[CandidateSet(cache=sets[0].cache, lengths=sets[0].lengths,
                                                                indices=sets[0].indices, layout=PROD_LAYOUT)])),
        (TypeError, "sets\\[0\\].lengths must have dtype", dict(sets=[CandidateSet(
            cache=sets[0].cache, lengths=sets[0].lengths.long(), indices=sets[0].indices, layout=SMALL_LAYOUT)])),
        (TypeError, "softmax_scale must be a finite", dict(softmax_scale=float("nan"))),
        (ValueError, "want_max needs num_splits", dict(want_max=True, num_splits=2)),
        (TypeError, "sets\\[0\\].layout must be an FP8DSMLALayout", dict(sets=[CandidateSet(
            cache=sets[0].cache, lengths=sets[0].lengths, indices=sets[0].indices, layout={"nope_dim": 64})])),
    ]
    for exc, match, change in bad:
        args = dict(q=qd, sets=sets, softmax_scale=0.125, attn_sink=sd, out=out, impl="triton") | change
        with pytest.raises(exc, match=match):
            sa.sparse_mla_forward(**args)
        assert (out == 7.0).all(), f"{match}: out was written before the refusal"


def test_layout_errors_are_not_cached():
    """A refused layout raises on every call (exceptions never enter the LRU), and a good one
    asked for under another name is still right."""
    for _ in range(2):
        with pytest.raises(ValueError, match="sets\\[1\\].layout head_dim"):
            layout_for(PROD_LAYOUT, 80, PROD_LAYOUT.entry_bytes, "sets[1]")
    assert layout_for(None, 512, PROD_LAYOUT.entry_bytes, "x") == PROD_LAYOUT
    assert layout_for(None, SMALL_LAYOUT.head_dim, SMALL_LAYOUT.entry_bytes, "y") == SMALL_LAYOUT


def test_with_kvcache_other_shape_through_a_new_metadata_object(device):
    """FlashMLA entry: a second shape (heads, batch) after a cached first call is right, and
    reusing the first metadata object for it is still refused."""
    gen = torch.Generator().manual_seed(8)
    meta1, _ = get_mla_metadata()
    for num_heads, batch, meta in [(3, 2, meta1), (16, 3, get_mla_metadata()[0])]:
        a = build_set(SetSpec("indices", True, 64, 24), batch, [0] * batch, PROD_LAYOUT, gen, device)
        q = torch.randn(batch, 1, num_heads, 512, generator=gen).to(torch.bfloat16)
        args = (a.cset.cache.unsqueeze(-2), None, None, 512)
        kw = dict(softmax_scale=0.1, is_fp8_kvcache=True, indices=a.cset.indices.view(batch, 1, -1),
                  topk_length=a.cset.lengths, impl="triton")  # entries past the length are NaN-poisoned
        out, lse = flash_mla_with_kvcache(q.to(device), *args, meta, **kw)
        qf = q.view(batch, num_heads, 512)
        assert_matches(out.view(batch, num_heads, 512), lse.view(batch, num_heads), oracle(qf, [a], 0.1, None),
                       oracle(qf, [a], 0.1, None, True), f"h{num_heads}")
        if meta is not meta1:
            with pytest.raises(ValueError, match="tile_scheduler_metadata"):
                flash_mla_with_kvcache(q.to(device), *args, meta1, **kw)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_indices_form_without_lengths_means_whole_rows(impl, device):
    """``lengths=None`` (what the FlashMLA entries pass without ``topk_length``, so no vector
    is allocated per call) equals lengths of the full width: holes, slots past the capacity and
    a second set with lengths all still behave; the range form still needs lengths."""
    gen = torch.Generator().manual_seed(10)
    num_tokens, num_heads = 3, 4
    a = build_set(SetSpec("indices", True, 16, 20), num_tokens, [0] * num_tokens, SMALL_LAYOUT, gen, device,
                  lengths=[20] * num_tokens)
    idx = a.cset.indices.clone()
    idx[1, 3] = a.cset.capacity + 5  # beyond the cache: invalid, never read
    a.slots[1] = [x for x in a.slots[1] if x != int(a.cset.indices[1, 3])]
    whole = CandidateSet(cache=a.cset.cache, lengths=None, indices=idx, layout=SMALL_LAYOUT)
    b = build_set(SetSpec("indices", False, 8, 9), num_tokens, [0] * num_tokens, SMALL_LAYOUT, gen, device)
    q = torch.randn(num_tokens, num_heads, SMALL_LAYOUT.head_dim, generator=gen).to(torch.bfloat16)
    for sets, built in (([whole], [a]), ([whole, b.cset], [a, b]), ([b.cset, whole], [b, a])):
        out, lse = sa.sparse_mla_attention(q.to(device), sets, 0.125, impl=impl)
        assert_matches(out, lse, oracle(q, built, 0.125, None), oracle(q, built, 0.125, None, True),
                       f"{len(sets)} sets")
    rng = build_set(SetSpec("range", True, 16, 9), num_tokens, [0] * num_tokens, SMALL_LAYOUT, gen, device)
    with pytest.raises(TypeError, match="sets\\[0\\].lengths must be a torch.Tensor"):
        sa.sparse_mla_attention(q.to(device), [CandidateSet(
            cache=rng.cset.cache, lengths=None, block_table=rng.cset.block_table, token_to_req=rng.cset.token_to_req,
            starts=rng.cset.starts, layout=SMALL_LAYOUT)], 0.125, impl=impl)
