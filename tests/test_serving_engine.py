"""PagedAttentionEngine's public boundary: every bad call raises TypeError/ValueError/RuntimeError
(or PoolExhaustedError) naming the problem before any state changes, and a run that interleaves
refused steps with valid ones gives the surviving requests exactly the outputs of a control
engine that only saw the valid steps."""

import random

import pytest
import torch

from dsv4attn.config import AttentionConfig
from dsv4attn.kv_cache.allocator import PoolExhaustedError
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.serving.engine import PagedAttentionEngine
from dsv4attn.serving.paged import state_window_base

RATIOS = (1, 4, 128)


def _layers(seed=0):
    cfg = AttentionConfig(hidden_size=32, num_heads=2, head_dim=80, rope_dim=16, q_lora_rank=16, o_groups=1,
                          o_lora_rank=8, window_size=8, index_num_heads=2, index_head_dim=32, index_topk=4,
                          layer_kinds=("sliding", "csa", "hca"), compress_ratios=RATIOS)
    torch.manual_seed(seed)
    layers = []
    for i in range(3):
        layer = DeepseekV4Attention(cfg, i)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.3)
        layers.append(layer.eval())
    return layers


def _engine(layers, **kw):
    kw = dict(max_model_len=300, max_num_batched_tokens=64, max_num_reqs=4, num_blocks=6, impl="reference") | kw
    return PagedAttentionEngine(layers, "auto", **kw)


def _state(e):
    return (e.requests, [e.seq_len(r) for r in e.requests], {g: p.num_free for g, p in e.manager.pools.items()})


def test_construction_refuses_bad_arguments():
    layers = _layers()
    for kw, err in [(dict(kv_cache_dtype="int4"), ValueError), (dict(impl="gpu"), ValueError),
                    (dict(max_model_len=0), ValueError), (dict(max_num_reqs=True), ValueError),
                    (dict(num_blocks=-3), ValueError), (dict(num_blocks=4, memory_bytes=10**6), ValueError)]:
        with pytest.raises(err):
            PagedAttentionEngine(layers, **({"kv_cache_dtype": "auto"} | kw))
    with pytest.raises(TypeError, match="layers\\[1\\]"):
        PagedAttentionEngine([layers[0], torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="at least one"):
        PagedAttentionEngine([])
    with pytest.raises(ValueError, match="one dtype"):
        PagedAttentionEngine([layers[0], _layers()[1].to(torch.bfloat16)])


def test_bad_calls_change_nothing():
    layers = _layers()
    e = _engine(layers)
    e.begin_step({"a": 20})
    for i in range(3):
        e.run_layer(i, torch.randn(20, 32))
    e.end_step()
    before = _state(e)
    bad_steps = [({None: 1}, ValueError), ({"b": 0}, ValueError), ({"b": -2}, ValueError), ({"b": 1.5}, TypeError),
                 ({"b": True}, TypeError), ({"b": 65}, ValueError), ({"a": 281}, ValueError), ([("a", 1)], TypeError),
                 ({}, ValueError), ({f"n{i}": 1 for i in range(4)}, ValueError)]
    for step, err in bad_steps:
        with pytest.raises(err):
            e.begin_step(step)
        assert _state(e) == before and not e.in_step
    for call in (lambda: e.run_layer(0, torch.randn(1, 32)), e.end_step, e.abort_step):
        with pytest.raises(RuntimeError):
            call()
    plan = e.begin_step({"a": 1, "b": 3})
    with pytest.raises(RuntimeError, match="already open"):
        e.begin_step({"c": 1})
    with pytest.raises(RuntimeError, match="inside a step"):
        e.free("a")
    for i, h, err in [(3, torch.randn(4, 32), ValueError), (-1, torch.randn(4, 32), ValueError),
                      (0, torch.randn(4, 31), ValueError), (0, torch.randn(3, 32), ValueError),
                      (0, torch.randn(4, 32).double(), ValueError), (0, [[0.0] * 32] * 4, TypeError)]:
        with pytest.raises(err):
            e.run_layer(i, h)
    e.run_layer(0, torch.randn(plan.num_tokens, 32))
    with pytest.raises(RuntimeError, match="already ran"):
        e.run_layer(0, torch.randn(plan.num_tokens, 32))
    e.abort_step()
    assert _state(e) == before
    with pytest.raises(KeyError):
        e.free("zz")


def test_pool_exhaustion_message_names_group_and_setting():
    e = _engine(_layers(), num_blocks=1)
    e.begin_step({"a": 30})
    e.end_step()
    with pytest.raises(PoolExhaustedError) as info:
        e.begin_step({"b": 2})
    msg = str(info.value)
    assert "'full_mla'" in msg and "num_blocks" in msg and "memory_bytes" in msg and "no request was changed" in msg


def test_refused_steps_leave_survivors_equal_to_a_control():
    layers = _layers(1)
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    test, control = _engine(layers), _engine(layers)
    lens = {}
    outs_t, outs_c = [], []
    for s in range(40):
        step = {}
        for r in list(lens)[:3]:
            step[r] = 1 if lens[r] >= 12 else rng.randint(1, 12)
        if len(lens) < 3:
            lens[f"r{s}"] = 0
            step[f"r{s}"] = rng.randint(1, 20)
        hidden = [torch.randn(sum(step.values()), 32, generator=gen) for _ in layers]
        # a refused step first (bad id / too many tokens / bad count): must change nothing
        bad = dict(step)
        key = rng.choice([None, "huge", "neg"])
        bad[key] = {None: 1, "huge": 200, "neg": -1}[key]
        with pytest.raises((ValueError, TypeError)):
            test.begin_step(bad)
        for e, outs in ((test, outs_t), (control, outs_c)):
            plan = e.begin_step(step)
            rows = [torch.cat([h[sum(step[q] for q in list(step)[:list(step).index(r)]):][:step[r]]
                               for r in plan.order]) for h in hidden]
            outs.append([e.run_layer(i, rows[i]) for i in range(len(layers))])
            e.end_step()
        for r, n in step.items():
            lens[r] += n
        for r in [r for r, n in lens.items() if n > 40]:
            for e in (test, control):
                e.free(r)
            del lens[r]
    for a, b in zip(outs_t, outs_c):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert _state(test) == _state(control)


def test_deterministic_mode_reaches_the_attention_op(monkeypatch):
    """deterministic=True on the runner / engine is what every layer step hands the attention op
    (its batch-invariant mode: no split-KV chosen from the batch); the default hands False; a
    non-bool is refused up front."""
    import dsv4attn.serving.paged as paged
    from dsv4attn.serving.runner import AttentionRunner
    from dsv4attn.testing import hf_oracle

    seen: list[bool] = []
    real = paged.sparse_mla_attention

    def spy(*args, **kwargs):
        seen.append(kwargs["deterministic"])
        return real(*args, **kwargs)

    monkeypatch.setattr(paged, "sparse_mla_attention", spy)
    hf = hf_oracle.small_hf_config(compress_rates={"compressed_sparse_attention": 4,
                                                   "heavily_compressed_attention": 128})
    layer = DeepseekV4Attention(AttentionConfig.from_hf(hf), 2)
    layer.load_state_dict(hf_oracle.hf_reference_layer(hf, 2, seed=1).state_dict())
    x = torch.randn(5, hf.hidden_size, generator=torch.Generator().manual_seed(0))
    outs = {}
    for det in (True, False):
        r = AttentionRunner(layer, num_blocks=16, max_model_len=64, max_num_batched_tokens=32, max_num_reqs=2,
                            deterministic=det)
        outs[det] = r.step({"a": x})["a"]
        assert seen[-1] is det
    torch.testing.assert_close(outs[True], outs[False], rtol=0, atol=0)  # CPU: one reference path either way
    with pytest.raises(TypeError, match="deterministic"):
        AttentionRunner(layer, num_blocks=16, max_model_len=64, deterministic=1)


def test_graph_tables_equal_a_full_rewrite_across_joins_leaves_and_buckets():
    """The static decode step rewrites only the table columns its rows reach now or reached
    before: after every step of a run where requests join, grow past block boundaries and leave
    and the bucket changes, each group's static table (host image and the tensor the graphs
    read) equals the table written from scratch, NULL_BLOCK past every row's end (state groups:
    the windowed table, with the state positions shifted by the same base)."""
    layers = _layers()
    e = _engine(layers, max_num_reqs=8, num_blocks=64, max_model_len=300)
    e.enable_cuda_graphs(buckets=(1, 2, 4, 8), capture=False)
    g = e.graphs
    rng = random.Random(5)
    live: dict[int, int] = {}
    nxt = 0
    for _ in range(60):
        if live and rng.random() < 0.15:  # a request leaves
            rid = rng.choice(list(live))
            e.free(rid)
            del live[rid]
        if len(live) < 8 and (not live or rng.random() < 0.3):  # a request joins with a prefill
            n = rng.randint(1, 40)
            e.begin_step({nxt: n})
            e.end_step()
            live[nxt] = n
            nxt += 1
        step = {r: 1 for r in live if live[r] < 290}
        if not step:
            continue
        plan = e.begin_step(step)
        assert plan.bucket is not None
        for name, t in g.tables.items():
            W = t.shape[1]
            want = torch.full((plan.bucket, W), -1, dtype=torch.int32)
            firsts = None
            if name in ("c4_state", "c128_state"):  # windowed: from each request's state_window_base on
                r = 4 if name == "c4_state" else 128
                tpb = e.manager._group(name).tokens_per_block
                firsts = [state_window_base(s, r, tpb) // tpb for s in plan.starts]
                sp = g.state_positions(plan.bucket, r)[:len(plan.order)].cpu()
                assert torch.equal(sp, plan.positions()[:len(plan.order)] - torch.tensor(firsts) * tpb)
            want[:len(plan.order)] = e.manager.block_table(list(plan.order), name, width=W, first_cols=firsts)
            if name == "swa":
                want[len(plan.order):, 0] = 0  # pad rows: one valid id at column 0
            assert torch.equal(t[:plan.bucket].cpu(), want), name
            assert torch.equal(g._host[name][:plan.bucket], want), name
        e.end_step()
        for r in step:
            live[r] += 1
