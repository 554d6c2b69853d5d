"""Engine rollback: random accept/reject sequences leave exactly the caches of the accepted tokens.

Three engines over the same layers (sliding, CSA r=4, HCA r=128; window 8) run the same
requests:

- ``spec``: every verify step feeds ``[token, d_1 .. d_m]`` per request, the first ``a`` drafts
  true continuations, the rest garbage; then ``rollback(m - a)`` and ``commit``;
- ``twin``: the same steps with *different* garbage (same shapes, so every kernel sees the same
  batch layout);
- ``ref``: only the accepted tokens, in steps of their own.

After any sequence the bytes each request can still read (the SWA rows of the window, every
compressed entry and indexer key, the compressor state rows of the open windows) must be
bit-identical between ``spec`` and ``twin`` (a rejected token leaves no trace, whatever it was),
and equal to ``ref``'s up to fp32 rounding (``ref``'s steps have other shapes, so its matmuls
round differently: on CPU a linear layer's row changes in the last bit with the batch size,
which is why exact equality is asserted against the same-shape twin); the block bookkeeping
must equal ``ref``'s exactly; and a later step must give the same outputs. Prefix lengths sit
next to the 4- and 128-boundaries so rollbacks cross compression windows and SWA blocks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from dsv4attn.kv_cache.specs import (
    GROUP_C4_STATE,
    GROUP_C128_STATE,
    GROUP_FULL_MLA,
    GROUP_SWA,
)
from dsv4attn.serving.engine import PagedAttentionEngine
from dsv4attn.serving.model import PagedDeepseekV4
from dsv4attn.serving.tiny import tiny_hf_model

VOCAB = 48
K_MAX = 4


@pytest.fixture(scope="module")
def layers():
    pm = PagedDeepseekV4(tiny_hf_model(3, compress_ratios=(0, 4, 128)), max_model_len=64)
    torch.manual_seed(0)
    return pm.layers, torch.randn(VOCAB, pm.config.hidden_size)


def _engine(layers, kv, device, k=K_MAX):
    return PagedAttentionEngine([layer.to(device) for layer in layers], kv, device=device, max_model_len=512,
                                max_num_batched_tokens=256, max_num_reqs=4, impl="reference" if device.type == "cpu"
                                else "auto", num_speculative_tokens=k)


def _entry_bytes(cache: torch.Tensor, blk: int, off: int, fp8_layout=None, indexer: bool = False) -> torch.Tensor:
    """The bytes of one stored entry: a plain row, or (fp8 pages) its data bytes + scale bytes."""
    if fp8_layout is None and not indexer:
        return cache[blk, off].contiguous().view(torch.uint8)
    bs = cache.shape[1]
    base = cache.as_strided((cache.shape[0] * cache.stride(0),), (1,), cache.storage_offset())
    b0 = blk * cache.stride(0)
    if indexer:  # [bs * d data][bs * 4 fp32 scales]
        d = cache.shape[2] - 4
        return torch.cat([base[b0 + off * d:b0 + (off + 1) * d], base[b0 + bs * d + off * 4:b0 + bs * d + off * 4 + 4]])
    lay = fp8_layout
    data = base[b0 + off * lay.data_bytes:b0 + (off + 1) * lay.data_bytes]
    s0 = b0 + lay.scale_offset(bs) + off * lay.scale_bytes
    return torch.cat([data, base[s0:s0 + lay.scale_bytes]])


def readable(eng: PagedAttentionEngine, rid) -> dict:
    """What request ``rid`` can still read, by logical position: name -> [n, bytes] uint8."""
    n, m, W = eng.seq_len(rid), eng.manager, eng.layers[0].config.window_size
    out = {}

    def rows(name, cache, group, positions, per_block, **kw):
        table = m.block_ids(rid, group)
        got = []
        for e in positions:
            blk = table[e // per_block]
            assert blk >= 0, f"{name}: position {e} is readable but its block was given back"
            got.append(_entry_bytes(cache, blk, e % per_block, **kw))
        out[name] = torch.stack(got) if got else torch.zeros(0, dtype=torch.uint8)

    for i, (layer, c) in enumerate(zip(eng.layers, eng.caches)):
        fp8 = c.layout if c.kv_cache_dtype == "fp8_ds_mla" else None
        rows(f"{i}.swa", c.swa, GROUP_SWA, range(max(0, n - W + 1), n), c.swa.shape[1], fp8_layout=fp8)
        r = layer.ratio
        if r == 1:
            continue
        rows(f"{i}.compressed", c.compressed, GROUP_FULL_MLA, range(n // r), c.compressed.shape[1], fp8_layout=fp8)
        coff = 2 if r == 4 else 1
        open_rows = range(max(0, (n // r - (coff - 1)) * r), n)  # rows the next entries still pool
        group = GROUP_C4_STATE if r == 4 else GROUP_C128_STATE
        rows(f"{i}.state", c.state, group, open_rows, c.state.shape[1])
        if r == 4:
            rows(f"{i}.indexer_k", c.indexer_k, GROUP_FULL_MLA, range(n // 4), c.indexer_k.shape[1],
                 indexer=fp8 is not None)
            rows(f"{i}.indexer_state", c.indexer_state, group, open_rows, c.indexer_state.shape[1])
    return out


def bookkeeping(eng: PagedAttentionEngine) -> dict:
    m = eng.manager
    return {"free": {g: p.num_free for g, p in m.pools.items()},
            "held": {r: {g.name: m.num_held(r, g.name) for g in m.groups} for r in m.requests},
            "len": {r: eng.seq_len(r) for r in m.requests}}


def run_step(eng: PagedAttentionEngine, emb: torch.Tensor, feed: dict, rollback: dict | None = None) -> list:
    """One step: feed {rid: token ids}; roll back {rid: n}; commit. Returns every layer's output."""
    plan = eng.begin_step({rid: len(t) for rid, t in feed.items()})
    ids = torch.tensor([t for rid in plan.order for t in feed[rid]])
    hidden = emb[ids].to(device=eng.device, dtype=eng.dtype)
    outs = [eng.run_layer(i, hidden) for i in range(len(eng.layers))]
    eng.end_step()
    for rid in feed:
        if rollback and rollback.get(rid):
            eng.rollback(rid, rollback[rid])
        eng.commit(rid)
    return outs


@st.composite
def programs(draw):
    k = draw(st.integers(1, K_MAX))
    prefix = {"a": draw(st.sampled_from([3, 6, 7, 122, 125, 126, 127])), "b": draw(st.sampled_from([1, 5, 60, 129]))}
    steps = [{rid: (m, draw(st.integers(0, m))) for rid in ("a", "b") for m in [draw(st.integers(0, k))]}
             for _ in range(draw(st.integers(1, 5)))]
    return k, prefix, steps, draw(st.integers(0, 2**16))


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    """Equal up to ``rel`` of the larger of 1 and b's max (fp32: ~1e-7 observed)."""
    if a.shape != b.shape or not a.numel():
        return a.shape == b.shape
    return bool((a - b).abs().max() <= rel * max(1.0, float(b.abs().max())))


def check_program(layers, kv, device, program):
    _, prefix, steps, seed = program
    base_layers, emb = layers
    g = torch.Generator().manual_seed(seed)
    spec, twin, ref = (_engine(base_layers, kv, device) for _ in range(3))
    seqs = {rid: torch.randint(0, VOCAB, (n + 6 * K_MAX,), generator=g).tolist() for rid, n in prefix.items()}
    pos = dict(prefix)
    first = {rid: seqs[rid][:n] for rid, n in prefix.items()}
    for eng in (spec, twin, ref):
        run_step(eng, emb, first)
    for step in steps:
        feed_s, feed_t, feed_r, back = {}, {}, {}, {}
        for rid, (m, a) in step.items():
            p = pos[rid]
            true = seqs[rid][p:p + 1 + a]
            junk = [torch.randint(0, VOCAB, (m - a,), generator=g).tolist() for _ in range(2)]
            feed_s[rid], feed_t[rid], feed_r[rid] = true + junk[0], true + junk[1], true
            back[rid] = m - a
            pos[rid] = p + 1 + a
        run_step(spec, emb, feed_s, back)
        run_step(twin, emb, feed_t, back)
        run_step(ref, emb, feed_r)
        assert bookkeeping(spec) == bookkeeping(ref) == bookkeeping(twin)
        for rid in ("a", "b"):
            s, t, r = readable(spec, rid), readable(twin, rid), readable(ref, rid)
            for name in s:
                assert torch.equal(s[name], t[name]), f"{rid} {name}: a rejected token left a trace"
                if kv == "auto":
                    assert _close(s[name].view(torch.float32), r[name].view(torch.float32)), f"{rid} {name}"
    probe = {rid: seqs[rid][pos[rid]:pos[rid] + 3] for rid in ("a", "b")}
    outs = [run_step(e, emb, probe) for e in (spec, twin, ref)]
    for o_s, o_t, o_r in zip(*outs):
        assert torch.equal(o_s, o_t)
        # fp8: ref's entries may round to the neighbouring e4m3 value (2^-4 relative) here and there
        assert _close(o_s, o_r, 1e-5 if kv == "auto" else 5e-2)


@pytest.mark.parametrize("kv", ["auto", "fp8_ds_mla"])
def test_random_accept_reject_sequences(layers, kv):
    @settings(max_examples=4, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(program=programs())
    def run(program):
        check_program(layers, kv, torch.device("cpu"), program)

    run()


def test_rollback_across_windows_fixed_case(layers):
    """Deterministic: request at 126 verifies 4 drafts (positions 126..130, crossing the 128
    entry and the SWA block boundary) and keeps only the first token; then a second crossing."""
    check_program(layers, "auto", torch.device("cpu"),
                  (4, {"a": 126, "b": 127}, [{"a": (4, 0), "b": (4, 1)}, {"a": (4, 2), "b": (3, 3)}], 7))


def test_engine_rollback_validation(layers):
    base_layers, emb = layers
    eng = _engine(base_layers, "auto", torch.device("cpu"), k=2)
    run_step(eng, emb, {"a": list(range(10))})
    plan = eng.begin_step({"a": 3})
    assert plan.metadata.batch.num_decodes == 1 and plan.metadata.batch.decode_threshold == 3
    with pytest.raises(RuntimeError, match="inside a step"):
        eng.rollback("a", 1)
    eng.abort_step()
    run_step(eng, emb, {"a": [1, 2, 3]}, {"a": 0})
    assert eng.rollback_limit("a") == 0  # committed
    eng.begin_step({"a": 3})
    eng.run_layer(0, emb[[4, 5, 6]])
    eng.run_layer(1, emb[[4, 5, 6]])
    eng.run_layer(2, emb[[4, 5, 6]])
    eng.end_step()
    assert eng.rollback_limit("a") == 2  # k = 2 tokens of headroom
    before = bookkeeping(eng)
    for bad, err in [(3, ValueError), (-1, ValueError), (True, TypeError), (1.0, TypeError)]:
        with pytest.raises(err):
            eng.rollback("a", bad)
        assert bookkeeping(eng) == before
    with pytest.raises(KeyError):
        eng.rollback("zz", 1)
    eng.rollback("a", 2)
    assert eng.seq_len("a") == 14 and eng.rollback_limit("a") == 0
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        _engine(base_layers, "auto", torch.device("cpu"), k=8)
    plain = _engine(base_layers, "auto", torch.device("cpu"), k=0)
    run_step(plain, emb, {"a": [1, 2]})
    with pytest.raises(ValueError, match="at most num_speculative_tokens=0"):
        plain.rollback("a", 1)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_ds_mla"])
def test_random_accept_reject_sequences_gpu(layers, kv):
    @settings(max_examples=10, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(program=programs())
    def run(program):
        check_program(layers, kv, torch.device("cuda"), program)

    run()
