"""Prefix caching: a request started from a prefix hold gives the bits of a cold run.

Oracles: (1) a control engine that computes the whole prompt itself, with the same step
composition after the prefix, so its outputs must be *bit-identical* (the started request reads
the very bytes the control wrote: same inputs, same kernels, same batch); (2) transformers'
greedy generate (token for token) for ``generate`` with the cache on; (3) block accounting: every
pool is full again once requests are freed and holds released. Holds must survive the request
that made them moving past the window and being freed, and sharing must not change either
request's later outputs.
"""

import pytest
import torch

from dsv4attn.kv_cache.allocator import NULL_BLOCK, BlockPool, KVCacheManager, PrefixHold
from dsv4attn.kv_cache.allocator import PoolExhaustedError as PoolExhaustedErrorT
from dsv4attn.kv_cache.specs import CacheConfig, cache_groups
from dsv4attn.serving.engine import PagedAttentionEngine
from test_serving_engine import _layers

G = 256  # the prefix granule with the default block sizes (full_mla columns of 256 raw tokens)


@pytest.fixture(scope="module")
def layers():
    return _layers()


def _engine(layers, kv="auto", **kw):
    kw = dict(max_model_len=700, max_num_batched_tokens=300, max_num_reqs=4, impl="reference") | kw
    return PagedAttentionEngine(layers, kv, **kw)


def _step(e, feed, end=True):
    """One step of ``{request: hidden rows}``; returns every layer's output per request."""
    plan = e.begin_step({r: len(v) for r, v in feed.items()})
    h = torch.cat([feed[r] for r in plan.order])
    outs = [e.run_layer(i, h) for i in range(len(e.layers))]
    if end:
        e.end_step()
    return {r: [o[a:a + n] for o in outs] for r, (a, n) in plan.offsets().items()}


def _pools_full(e):
    return all(p.num_free == p.num_blocks for p in e.manager.pools.values())


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kv", ["auto", "fp8_ds_mla"])
def test_started_request_equals_a_cold_run_bit_for_bit(layers, kv):
    torch.manual_seed(1)
    x, y, z = torch.randn(700, 32), torch.randn(700, 32), torch.randn(700, 32)
    # control: x's prompt in two steps split at the prefix end, then decodes
    c = _engine(layers, kv)
    _step(c, {"x": x[:G]})
    want = [_step(c, {"x": x[G:300]})["x"]] + [_step(c, {"x": x[t:t + 1]})["x"] for t in range(300, 312)]
    # a control for "a" alone, to check that sharing does not change the request that made the hold
    ca = _engine(layers, kv)
    _step(ca, {"a": x[:G]})
    want_a = [_step(ca, {"a": y[t:t + 100]})["a"] for t in range(G, 556, 100)]

    e = _engine(layers, kv, max_cached_prefixes=2)
    _step(e, {"a": x[:G]})
    hold = e.save_prefix("a", G)
    assert hold.num_tokens == G and e.prefix_holds == [hold]
    # "a" moves on past the window (its own window blocks at the prefix end are released by it,
    # the hold keeps them) while another request fills the freed blocks
    got_a = []
    for t in range(G, 556, 100):
        got_a.append(_step(e, {"a": y[t:t + 100]})["a"])
        _step(e, {"z": z[t - G:t - G + 100]})
    assert all(_same(g, w) for g, w in zip(got_a, want_a))
    e.free("a")
    e.free("z")
    e.add_request("b", hold)
    assert e.seq_len("b") == G
    got = [_step(e, {"b": x[G:300]})["b"]] + [_step(e, {"b": x[t:t + 1]})["b"] for t in range(300, 312)]
    assert all(_same(g, w) for g, w in zip(got, want))
    e.free("b")
    assert not _pools_full(e)  # the hold still keeps its blocks
    assert e.release_prefix(hold) == hold.num_blocks
    assert _pools_full(e) and e.prefix_holds == []


def _started_vs_cold_decodes(make_engine, x, y, maker_decodes: int, end: int) -> None:
    """A request "b" started from a hold of "a"'s first G tokens (after "a" decoded
    ``maker_decodes`` more tokens and left) against "b" computing its prefix itself: a chunk to
    270, then decodes to ``end`` through the engine's CUDA-graph decode step (bucket 1); every
    layer's output bit for bit."""
    runs = []
    for cached in (False, True):
        e = make_engine()
        if cached:
            _step(e, {"a": x[:G]})
            hold = e.save_prefix("a", G)
            for t in range(G, G + maker_decodes):
                _step(e, {"a": y[t:t + 1]})
            e.free("a")
            e.add_request("b", hold)
            e.release_prefix(hold)  # "b" keeps what it shares
        else:
            _step(e, {"b": x[:G]})
        outs = [_step(e, {"b": x[G:270]})["b"]]
        for t in range(270, end):
            plan = e.begin_step({"b": 1})
            assert plan.bucket == 1  # the graph decode step
            outs.append([e.run_layer(i, x[t:t + 1]) for i in range(len(e.layers))])
            e.end_step()
        runs.append(outs)
        e.free("b")
        assert _pools_full(e)
    assert all(_same(g, w) for g, w in zip(runs[1], runs[0]))


def test_started_request_through_the_static_decode_step(layers):
    """Decodes of a request started from a hold go through the CUDA-graph decode step (run
    eagerly here: capture=False, the same static tables and kernels) and equal a cold run's."""
    torch.manual_seed(6)

    def make():
        e = _engine(layers, max_cached_prefixes=1, num_blocks=16)
        e.enable_cuda_graphs(buckets=(1, 2), capture=False)
        return e

    _started_vs_cold_decodes(make, torch.randn(700, 32), torch.randn(700, 32), 20, 290)


def test_two_requests_share_a_hold_while_both_run(layers):
    torch.manual_seed(2)
    x, u, v = torch.randn(700, 32), torch.randn(100, 32), torch.randn(100, 32)
    c = _engine(layers)
    _step(c, {"x": x[:G]})
    want_u = _step(c, {"x": u[:40]})["x"]
    c2 = _engine(layers)
    _step(c2, {"x": x[:G]})
    want_v = _step(c2, {"x": v[:70]})["x"]
    e = _engine(layers, max_cached_prefixes=1)
    _step(e, {"a": x[:G]})
    hold = e.save_prefix("a", G)
    e.free("a")
    e.add_request("u", hold)
    e.add_request("v", hold)
    got = _step(e, {"u": u[:40]})  # separate steps: the same step composition as the controls
    got |= _step(e, {"v": v[:70]})
    assert _same(got["u"], want_u) and _same(got["v"], want_v)
    full = e.manager.block_ids("u", "full_mla")[0]
    assert full == e.manager.block_ids("v", "full_mla")[0] == hold.block_ids("full_mla")[0]
    assert e.manager.pools["full_mla"].refs(full) == 3  # the hold and both requests
    for r in ("u", "v"):
        e.free(r)
    e.release_prefix(hold)
    assert _pools_full(e)


def test_hold_saved_inside_a_step_at_a_boundary_it_passed(layers):
    """A hold taken inside a step (after every layer ran) at a boundary inside the step's chunk
    serves a request that continues from there; the control computed the prefix in a chunk of
    another length, so values may differ by summation order only."""
    torch.manual_seed(3)
    x = torch.randn(700, 32)
    c = _engine(layers)
    _step(c, {"x": x[:G]})
    want = _step(c, {"x": x[G:290]})["x"]
    e = _engine(layers, max_cached_prefixes=1)
    _step(e, {"a": x[:280]}, end=False)
    hold = e.save_prefix("a", G)
    e.end_step()
    e.free("a")
    e.add_request("b", hold)
    got = _step(e, {"b": x[G:290]})["b"]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def _snapshot(e):
    return (e.requests, [e.seq_len(r) for r in e.requests], {g: p.num_free for g, p in e.manager.pools.items()},
            list(e.prefix_holds), e.in_step)


def test_bad_prefix_calls_change_nothing(layers):
    torch.manual_seed(4)
    x = torch.randn(700, 32)
    e = _engine(layers, max_cached_prefixes=1)
    other = _engine(layers, max_cached_prefixes=1)
    _step(other, {"o": x[:G]})
    foreign = other.save_prefix("o", G)
    _step(e, {"a": x[:G]})
    before = _snapshot(e)
    for call, err, match in [
        (lambda: e.save_prefix("a", 100), ValueError, "multiple of the prefix granule 256"),
        (lambda: e.save_prefix("a", 512), ValueError, "only tokens in the caches"),
        (lambda: e.save_prefix("a", 0), ValueError, "positive"),
        (lambda: e.save_prefix("a", True), ValueError, "positive"),
        (lambda: e.save_prefix("nope", G), KeyError, "unknown request"),
        (lambda: e.add_request("b", foreign), ValueError, "not a live prefix hold of this engine"),
        (lambda: e.add_request("b", "hold"), TypeError, "PrefixHold"),
        (lambda: e.release_prefix(foreign), ValueError, "not a live prefix hold"),
    ]:
        with pytest.raises(err, match=match):
            call()
        assert _snapshot(e) == before
    hold = e.save_prefix("a", G)
    before = _snapshot(e)
    for call, err, match in [
        (lambda: e.save_prefix("a", G), ValueError, "max_cached_prefixes=1"),
        (lambda: e.add_request("a", hold), ValueError, "already exists"),
        (lambda: e.add_request(None, hold), ValueError, "None"),
    ]:
        with pytest.raises(err, match=match):
            call()
        assert _snapshot(e) == before
    e.begin_step({"a": 2})
    before = _snapshot(e)
    for call, err in [(lambda: e.save_prefix("a", G), RuntimeError), (lambda: e.add_request("b", hold), RuntimeError)]:
        with pytest.raises(err):
            call()
        assert _snapshot(e) == before
    e.abort_step()
    e.release_prefix(hold)
    with pytest.raises(ValueError, match="not a live prefix hold"):
        e.add_request("b", hold)
    with pytest.raises(ValueError, match="not a live prefix hold"):
        e.release_prefix(hold)
    # too far behind: "a" moved on and released what position 256 reads in its window groups
    _step(e, {"a": x[G:300]})
    with pytest.raises(ValueError, match="too far behind"):
        e.save_prefix("a", G)
    e.free("a")
    assert _pools_full(e)


def test_holds_accept_their_tokens_under_speculative_decoding(layers):
    """Inside a step a hold may not reach the step's last k tokens (unverified drafts); between
    steps holding accepts the held tokens: no rollback below them afterwards."""
    torch.manual_seed(5)
    x = torch.randn(700, 32)
    e = _engine(layers, num_speculative_tokens=2, max_cached_prefixes=2)
    _step(e, {"a": x[:G]}, end=False)
    with pytest.raises(ValueError, match="rollback could take back"):
        e.save_prefix("a", G)
    e.end_step()
    assert e.rollback_limit("a") == 2
    hold = e.save_prefix("a", G)
    assert e.rollback_limit("a") == 0
    _step(e, {"a": x[G:G + 3]})
    e.rollback("a", 2)  # tokens past the hold can still be taken back
    with pytest.raises(ValueError):
        e.rollback("a", 2)
    _step(e, {"a": x[G + 1:2 * G + 2]}, end=False)
    hold2 = e.save_prefix("a", 2 * G)  # in step: 512 <= 514 - 2
    e.abort_step()  # ... and gone with the aborted step
    assert hold2.released and e.prefix_holds == [hold]
    e.free("a")
    e.add_request("b", hold)
    assert e.rollback_limit("b") == 0
    e.free("b")
    e.release_prefix(hold)
    assert _pools_full(e)


def test_block_pool_reference_counts():
    p = BlockPool(4)
    a, b = p.take(2)
    p.share([a])
    assert p.refs(a) == 2 and p.refs(b) == 1 and p.num_free == 2
    p.give_back([a, b])
    assert p.refs(a) == 1 and p.refs(b) == 0 and p.num_free == 3
    for ids, match in [([b], "not handed out"), ([a, a], "given twice"), ([9], "not a block id")]:
        with pytest.raises(ValueError, match=match):
            p.give_back(ids)
        with pytest.raises(ValueError, match=match):
            p.share(ids)
        assert p.refs(a) == 1 and p.num_free == 3
    p.give_back([a])
    assert p.num_free == 4


def test_manager_hold_columns_and_window_sizing():
    """A hold keeps every full column below its end and exactly the window columns a token at its
    end reads (``cdiv(W - 1, bs)``, what the sizing adds per hold); the started request's next
    columns are new blocks."""
    cfg = CacheConfig(compress_ratios=(1, 4, 128), head_dim=80, rope_dim=16, index_head_dim=32, sliding_window=128)
    groups = cache_groups(cfg)
    m = KVCacheManager(groups, {g.name: 300 for g in groups})
    m.add_request("a", 2 * G)
    m.advance("a", 2 * G)
    hold = m.hold_prefix("a", 2 * G)
    assert isinstance(hold, PrefixHold)
    for g in groups:
        kept = [b for b in hold.block_ids(g.name) if b != NULL_BLOCK]
        want = 2 * G // g.tokens_per_block if g.kind == "full" else -(-(g.window - 1) // g.tokens_per_block)
        assert len(kept) == want, g.name
        assert kept == m.block_ids("a", g.name)[2 * G // g.tokens_per_block - want:2 * G // g.tokens_per_block]
    m.free("a")
    m.add_request("b", 2 * G + 5, prefix=hold)
    assert m.num_computed("b") == 2 * G
    for g in groups:
        table = m.block_ids("b", g.name)
        col = 2 * G // g.tokens_per_block
        assert table[:col] == hold.block_ids(g.name)
        assert not set(table[col:]) & set(hold.block_ids(g.name))


# ---- generate with the prefix cache, against transformers ------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from dsv4attn.serving.cli import random_prompts
    from dsv4attn.serving.model import reference_generate
    from dsv4attn.serving.tiny import tiny_hf_model

    model = tiny_hf_model(0)
    shared = random_prompts(1, 256, 7, [530])[0]
    tails = random_prompts(4, 256, 8, [9, 30, 3, 1])
    other = random_prompts(1, 256, 9, [300])[0]
    prompts = [shared[:300] + tails[0],  # holds at 256 (prompt) ...
               shared[:270] + tails[1],  # ... hit at 256
               shared + tails[2],  # hit at 256, then holds at 512
               shared[:520] + tails[3],  # hit at 512
               other,  # no hit
               shared[:250]]  # no hit (shorter than a granule); its decode passes 256
    return model, prompts, reference_generate(model, prompts, 8), reference_generate


def test_generate_with_prefix_cache_equals_transformers(tiny):
    from dsv4attn.serving.model import PagedDeepseekV4

    model, prompts, want, reference_generate = tiny
    pm = PagedDeepseekV4(model, max_model_len=600, max_num_batched_tokens=256, max_num_reqs=1, num_blocks=16,
                         impl="reference", max_cached_prefixes=8)
    assert pm.generate(prompts, 8) == want
    st = pm.prefix_cache.stats
    assert (st.hits, st.hit_tokens, st.refused) == (3, 256 + 256 + 512, 0)
    assert len(pm.prefix_cache) == st.saved - st.evicted > 0
    # a second call: every prompt longer than a granule starts from a hold, the outputs stay
    assert pm.generate(prompts, 8) == want
    assert pm.prefix_cache.stats.hits == 3 + 5
    # a follow-up turn: the short prompt plus its answer passed 256 while decoding
    turn = prompts[5] + want[5] + [17, 18]
    assert pm.generate([turn], 4) == reference_generate(model, [turn], 4)
    assert pm.prefix_cache.stats.hits == 3 + 5 + 1
    pm.prefix_cache.clear()
    assert all(p.num_free == p.num_blocks for p in pm.engine.manager.pools.values())


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_generate_with_prefix_cache_equals_transformers(tiny, k):
    from dsv4attn.serving.model import PagedDeepseekV4

    model, prompts, want, _ = tiny
    pm = PagedDeepseekV4(model, max_model_len=600, max_num_batched_tokens=256, max_num_reqs=1, num_blocks=16,
                         impl="reference", max_cached_prefixes=8, num_speculative_tokens=k)
    outs, spec = pm.generate(prompts, 8, num_speculative_tokens=k, return_stats=True)
    assert outs == want
    st = pm.prefix_cache.stats
    assert (st.hits, st.hit_tokens, st.refused) == (3, 256 + 256 + 512, 0)
    assert pm.generate(prompts, 8, num_speculative_tokens=k) == want
    assert pm.prefix_cache.stats.hits == 3 + 5 and pm.prefix_cache.stats.refused == 0


def test_generate_gives_holds_back_when_the_context_pool_is_short(tiny):
    """Two context blocks per request and room for two requests: holds of finished requests
    must be given back (least recently used first) for new requests to join; outputs unchanged."""
    from dsv4attn.serving.model import PagedDeepseekV4

    model, prompts, want, _ = tiny
    pm = PagedDeepseekV4(model, max_model_len=600, max_num_batched_tokens=256, max_num_reqs=2, num_blocks=5,
                         impl="reference", max_cached_prefixes=4)
    assert pm.generate(prompts, 8) == want
    st = pm.prefix_cache.stats
    assert st.evicted > 0 and st.hits > 0
    pm.prefix_cache.clear()
    assert all(p.num_free == p.num_blocks for p in pm.engine.manager.pools.values())


def test_window_pools_sized_for_the_holds_never_run_short(layers):
    """Window-bounded pools are sized for max_num_reqs requests plus max_cached_prefixes holds:
    with every hold taken (from requests that then move on) and every slot busy with full steps,
    no window-bounded pool runs short."""
    torch.manual_seed(7)
    x = torch.randn(700, 32)
    e = _engine(layers, max_num_reqs=2, max_cached_prefixes=3, num_blocks=32, max_num_batched_tokens=512,
                max_model_len=1000)
    _step(e, {"a": x[:G], "c": x[:G]}, end=False)
    holds = [e.save_prefix("a", G), e.save_prefix("c", G)]
    e.end_step()
    _step(e, {"a": x[G:2 * G]}, end=False)
    holds.append(e.save_prefix("a", 2 * G))
    e.end_step()
    for n in (100, 156, 60):  # both slots busy, past the windows of every hold
        _step(e, {"a": x[:n], "c": x[:256 - n]})
    sliding = [g.name for g in e.manager.groups if g.kind == "sliding"]
    assert min(e.manager.pools[g].num_free for g in sliding) >= 0
    for r in ("a", "c"):
        e.free(r)
    e.add_request("d", holds[2])
    _step(e, {"d": x[:100]})
    e.free("d")
    for h in holds:
        e.release_prefix(h)
    assert _pools_full(e)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_ds_mla"])
def test_started_request_replays_captured_graphs_like_a_cold_run(kv):
    """On the GPU (bf16, Triton kernels, decode steps replayed from CUDA graphs captured before
    any request existed): a request started from a hold gives the bits of a cold run."""
    from dsv4attn.serving.tiny import tiny_attention_layers

    layers = tiny_attention_layers(11)
    hs = layers[0].config.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, y = (torch.randn(700, hs, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def make():
        e = PagedAttentionEngine(layers, kv, max_model_len=700, max_num_reqs=4, max_num_batched_tokens=300,
                                 num_blocks=16, max_cached_prefixes=1)
        e.enable_cuda_graphs(buckets=(1, 2))  # captured before any request exists
        return e

    # "a" decodes 150 tokens (replays) before leaving; "b" decodes through SWA-block,
    # compression and 128 boundaries
    _started_vs_cold_decodes(make, x, y, 150, 400)


def test_distributed_wrappers_refuse_prefix_caching(layers):
    from dsv4attn.distributed.engine import DCPPagedAttentionEngine
    from dsv4attn.distributed.model import ParallelPagedDeepseekV4

    with pytest.raises(ValueError, match="max_cached_prefixes"):
        DCPPagedAttentionEngine(layers, max_cached_prefixes=4)
    with pytest.raises(ValueError, match="max_cached_prefixes"):
        ParallelPagedDeepseekV4(torch.nn.Linear(2, 2), object(), max_cached_prefixes=4)
    with pytest.raises(ValueError, match="max_cached_prefixes"):
        _engine(layers, max_cached_prefixes=-1)


# ---- export / import: KV transfer between engines, offload -------------------------------------------

@pytest.mark.parametrize("kv", ["auto", "fp8_ds_mla"])
def test_exported_prefix_serves_another_engine_like_a_cold_run(layers, kv, tmp_path):
    """A prefill engine exports a prefix; a second engine (other block ids in use, the blob
    through torch.save/torch.load) imports it and a request started there gives the bits of a
    cold run on that engine."""
    torch.manual_seed(8)
    x, w = torch.randn(700, 32), torch.randn(700, 32)
    c = _engine(layers, kv, max_num_batched_tokens=512)
    _step(c, {"x": x[:2 * G]})
    want = [_step(c, {"x": x[2 * G:2 * G + 40]})["x"]] + [_step(c, {"x": x[t:t + 1]})["x"] for t in range(552, 560)]

    src = _engine(layers, kv, max_cached_prefixes=1, max_num_batched_tokens=512)
    _step(src, {"a": x[:2 * G]})
    blob = src.export_prefix(src.save_prefix("a", 2 * G))
    assert blob.num_tokens == 2 * G and blob.nbytes > 0
    torch.save(blob, tmp_path / "prefix.pt")
    blob = torch.load(tmp_path / "prefix.pt", weights_only=False)

    dst = _engine(layers, kv, max_cached_prefixes=1, max_num_batched_tokens=512)
    _step(dst, {"other": w[:300]})  # blocks in use: the imported prefix lands on other ids
    hold = dst.import_prefix(blob)
    assert hold.block_ids("full_mla") != src.prefix_holds[0].block_ids("full_mla")
    dst.add_request("b", hold)
    got = [_step(dst, {"b": x[2 * G:2 * G + 40]})["b"]] + [_step(dst, {"b": x[t:t + 1]})["b"] for t in range(552, 560)]
    assert all(_same(g, v) for g, v in zip(got, want))
    for r in ("b", "other"):
        dst.free(r)
    dst.release_prefix(hold)
    assert _pools_full(dst)


def test_import_refuses_what_it_cannot_read_and_changes_nothing(layers):
    torch.manual_seed(9)
    x = torch.randn(700, 32)
    src = _engine(layers, max_cached_prefixes=1)
    _step(src, {"a": x[:G]})
    blob = src.export_prefix(src.save_prefix("a", G))
    fp8 = _engine(layers, "fp8_ds_mla", max_cached_prefixes=1)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        fp8.import_prefix(blob)
    two = _engine(layers[:2], max_cached_prefixes=1)
    with pytest.raises(ValueError, match="another geometry"):
        two.import_prefix(blob)
    dst = _engine(layers, max_cached_prefixes=1, num_blocks=1)
    before = _snapshot(dst)
    import dataclasses

    bad_pages = dataclasses.replace(blob, pages=blob.pages[:2])
    for arg, err in [(blob.pages, TypeError), (bad_pages, ValueError)]:
        with pytest.raises(err):
            dst.import_prefix(arg)
        assert _snapshot(dst) == before
    _step(dst, {"z": x[:10]})  # the one full_mla block is taken: the import is short
    before = _snapshot(dst)
    from dsv4attn.kv_cache.allocator import PoolExhaustedError

    with pytest.raises(PoolExhaustedError):
        dst.import_prefix(blob)
    assert _snapshot(dst) == before
    dst.free("z")
    short = _engine(layers, max_cached_prefixes=1, max_model_len=G)
    with pytest.raises(ValueError, match="no room"):
        short.add_request("b", short.import_prefix(blob))
    h = dst.import_prefix(blob)
    with pytest.raises(ValueError, match="max_cached_prefixes=1"):
        dst.import_prefix(blob)
    with pytest.raises(ValueError, match="not a live prefix hold"):
        src.export_prefix(h)


# ---- random programs over the allocator: reference counts and immutability of held blocks --------------

POOL = 160


def _alloc_state(m):
    import copy

    return (copy.deepcopy(m._tables), dict(m._num_tokens), dict(m._num_computed), dict(m._floor),
            sorted(m.pool._free), dict(m.pool._refs), len(m._holds))


def _random_op(rng, m, holds, gone, gran):
    """One call on ``m``, valid most of the time (requests exist, holds at granule boundaries)."""
    live = m.requests
    op = rng.choices(["add", "fork", "grow", "advance", "hold", "release", "free", "rollback", "commit",
                      "truncate"], weights=[3, 3, 4, 5, 4, 2, 1, 2, 2, 1])[0]
    rid = rng.choice(live) if live and op not in ("add", "fork") and rng.random() < 0.9 else f"r{rng.randrange(4)}"
    n = rng.randrange(40)
    if op == "add":
        return lambda: m.add_request(rid, n)
    if op == "fork":
        pool = gone if gone and rng.random() < 0.15 else holds
        return lambda: m.add_request(rid, n, prefix=rng.choice(pool) if pool else None)
    if op == "grow":
        return lambda: m.grow(rid, m.num_tokens(rid) + rng.randrange(12))
    if op == "advance":
        return lambda: m.advance(rid, min(m.num_tokens(rid), m.num_computed(rid) + rng.randrange(16)))
    if op == "hold":
        back = rng.choice([0, 0, 0, 1, 2])
        odd = rng.random() < 0.1
        return lambda: holds.append(m.hold_prefix(rid, (m.num_computed(rid) // gran - back) * gran + 3 * odd))
    if op == "release":
        def release():
            if holds:
                gone.append(holds.pop(rng.randrange(len(holds))))
                m.release_prefix(gone[-1])
        return release
    if op == "free":
        return lambda: m.free(rid)
    if op == "rollback":
        return lambda: m.rollback(rid, max(0, m.num_computed(rid) - rng.randrange(5)))
    if op == "commit":
        return lambda: m.commit(rid)
    return lambda: m.truncate(rid, max(m.num_computed(rid), m.num_tokens(rid) - rng.randrange(5)))


@pytest.mark.parametrize("k", [0, 1, 3])
def test_random_hold_programs_keep_reference_counts(k):
    """Random interleavings of requests, holds, forks, growth, rollback and frees (300 programs
    of 60 calls): every block's reference count equals its owners (request tables and live
    holds), free and owned blocks partition the pool, a refused call changes nothing, and no
    request can write (or roll back into) a block a live hold keeps."""
    import random

    from dsv4attn.kv_cache.specs import GroupSpec

    groups = [GroupSpec("full", "full", tokens_per_block=8), GroupSpec("swa", "sliding", tokens_per_block=4, window=8),
              GroupSpec("state", "sliding", tokens_per_block=2, window=3)]
    made = 0
    for seed in range(300):
        rng = random.Random(seed)
        m = KVCacheManager(groups, POOL, rollback_tokens=k)
        gran = m.prefix_granule
        holds: list = []
        gone: list = []  # released holds: forking from one is refused
        for _ in range(60):
            call = _random_op(rng, m, holds, gone, gran)
            before = _alloc_state(m)
            n_holds = len(holds)
            try:
                call()
            except (KeyError, ValueError, PoolExhaustedErrorT):
                assert _alloc_state(m) == before
            made += len(holds) > n_holds
            owners: dict[int, int] = {}
            tables = [m.block_ids(r, g.name) for r in m.requests for g in groups]
            tables += [h.block_ids(g.name) for h in holds for g in groups]
            for t in tables:
                for b in t:
                    if b != NULL_BLOCK:
                        owners[b] = owners.get(b, 0) + 1
            assert owners == m.pool._refs
            assert sorted(list(owners) + m.pool._free) == list(range(POOL))
            held = {b for h in holds for g in groups for b in h.block_ids(g.name) if b != NULL_BLOCK}
            for r in m.requests:
                for g in groups:
                    for c, b in enumerate(m.block_ids(r, g.name)):
                        if b in held:  # never written again, not even after a rollback
                            assert (c + 1) * g.tokens_per_block <= m.rollback_floor(r), (seed, r, g.name, c)
        for r in m.requests:
            m.free(r)
        for h in holds:
            m.release_prefix(h)
        assert m.pool.num_free == POOL and not m.pool._refs
    assert made > 50  # the programs do take holds


def test_sizing_and_table_arguments_refuse_bad_values():
    from dsv4attn.kv_cache.accounting import plan_num_blocks

    cfg = CacheConfig(compress_ratios=(1, 4, 128), head_dim=80, rope_dim=16, index_head_dim=32, sliding_window=128)
    kw = dict(max_num_reqs=2, max_num_batched_tokens=64, max_model_len=512)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="prefix_holds"):
            plan_num_blocks(cfg, prefix_holds=bad, **kw)
    assert plan_num_blocks(cfg, prefix_holds=3, **kw)["swa"] > plan_num_blocks(cfg, **kw)["swa"]
    m = KVCacheManager(cache_groups(cfg), 256)
    m.add_request("a", 300)
    for bad in (0, -16, True):
        with pytest.raises(ValueError, match="align"):
            m.block_table(["a"], "swa", align=bad)
    assert m.block_table(["a"], "swa", align=16).shape == (1, 16)
