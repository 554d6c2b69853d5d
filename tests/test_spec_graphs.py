"""Speculative verify steps through the CUDA-graph path (``DecodeGraphs(query_len=q)``).

CPU: the padded static verify step (``enable_cuda_graphs(capture=False)``, exactly the code the
graphs capture) serves the uniform verify steps of ``generate(num_speculative_tokens=3)`` and
gives transformers' greedy tokens. GPU (marked ``gpu``): graphs captured at context 0 replay
bit for bit like the same static step run eagerly, through verify steps of 1..4 tokens per
request with random rollbacks while contexts cross the 4/64/128/256 boundaries and requests
join and leave; and they agree with the dynamic eager step to bf16 rounding.
"""

import random

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from test_spec_generate import NoisyOracleDrafter

from dsv4attn.serving.engine import PagedAttentionEngine
from dsv4attn.serving.model import PagedDeepseekV4, reference_generate
from dsv4attn.serving.tiny import tiny_attention_layers, tiny_hf_model


def test_static_padded_verify_steps_equal_transformers(monkeypatch):
    model = tiny_hf_model(2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 126, 129)]
    want = reference_generate(model, prompts, 10)
    pm = PagedDeepseekV4(model, max_model_len=160, max_num_reqs=4, impl="reference", num_speculative_tokens=3)
    pm.enable_cuda_graphs(buckets=(1, 2, 4), capture=False)
    assert sorted(pm.engine.spec_graphs) == [2, 3, 4]
    used = []
    for q, gr in pm.engine.spec_graphs.items():
        run = gr.run
        monkeypatch.setattr(gr, "run", lambda i, h, b, q=q, run=run: used.append((q, b)) or run(i, h, b))
    got, stats = pm.generate(prompts, 10, token_budget=64, num_speculative_tokens=3,
                             drafter=NoisyOracleDrafter(prompts, want, seed=5), return_stats=True)
    assert got == want
    assert {q for q, _ in used} >= {4} and stats.accepted > 0  # full verify steps went through the static path
    assert pm.requests == []


_layers = tiny_attention_layers


def _script(rng, steps=200, k=3):
    """Steps ({request: new tokens}, {request: tokens to roll back}, leaving): prompts of up to
    70 tokens, then uniform verify steps of 1 + m tokens (m in 0..k) with random rejections."""
    live, nxt, out = {}, 0, []
    for s in range(steps):
        step, back = {}, {}
        if len(live) < 3 or s % 40 == 20:
            live[nxt] = 0
            step[nxt] = rng.randint(1, 70)
            nxt += 1
        m = rng.randint(0, k)
        for r in live:
            if r not in step:
                step[r] = 1 + m
                back[r] = rng.randint(0, m)
        leave = [r for r, n in live.items() if n > 300 or (s % 50 == 49 and r == min(live))]
        out.append((step, back, leave))
        for r, n in step.items():
            live[r] += n - back.get(r, 0)
        for r in leave:
            del live[r]
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_ds_mla"])
def test_spec_graph_replay_equals_static_bit_for_bit(kv):
    layers = _layers(10)
    kw = {"max_model_len": 512, "max_num_reqs": 8, "max_num_batched_tokens": 256, "num_blocks": 64,
          "num_speculative_tokens": 3}
    graph = PagedAttentionEngine(layers, kv, **kw)
    graph.enable_cuda_graphs(buckets=(1, 2, 4, 8))  # captured now, every context 0
    static = PagedAttentionEngine(layers, kv, **kw)
    static.enable_cuda_graphs(buckets=(1, 2, 4, 8), capture=False)
    dynamic = PagedAttentionEngine(layers, kv, **kw)
    gen = torch.Generator(device="cuda").manual_seed(0)
    replays, worst = 0, 0.0
    for step, back, leave in _script(random.Random(0)):
        plans = [e.begin_step(step) for e in (graph, static, dynamic)]
        T = plans[0].num_tokens
        replays += plans[0].bucket is not None and plans[0].query_lens[0] > 1
        for i in range(len(layers)):
            h = torch.randn(T, layers[0].config.hidden_size, generator=gen, device="cuda", dtype=torch.bfloat16)
            a, b, c = (e.run_layer(i, h) for e in (graph, static, dynamic))
            assert torch.equal(a, b), f"replay differs from eager at step {step}, layer {i}"
            worst = max(worst, ((a.float() - c.float()).abs().max() / c.float().abs().max().clamp(min=1e-6)).item())
        for e in (graph, static, dynamic):
            e.end_step()
            for r, n in back.items():
                if n:
                    e.rollback(r, n)
                e.commit(r)
            for r in leave:
                e.free(r)
    assert replays > 100
    assert worst < 0.05  # static vs dynamic form: bf16 rounding of differently ordered reductions


@pytest.mark.gpu
def test_speculative_generate_with_graphs_equals_the_same_steps_eager_bf16():
    """Graphs need the bf16 (Triton) attention path, so the GPU check is bf16: speculative
    generation with verify steps replayed from CUDA graphs gives exactly the tokens of the same
    padded static steps run eagerly (capture=False), for k = 1..4. Token equality with
    transformers in fp32 is the CPU test above (test_spec_generate.py covers k = 1..4 too)."""
    model = tiny_hf_model(4, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 126, 1, 129, 60, 250)]
    want = reference_generate(model, prompts, 24)  # the drafter's source: a mix of accepts and rejects
    for k in (1, 2, 3, 4):
        outs = []
        for capture in (True, False):
            pm = PagedDeepseekV4(model, max_model_len=320, max_num_reqs=4, num_speculative_tokens=k)
            pm.enable_cuda_graphs(capture=capture)
            got, stats = pm.generate(prompts, 24, num_speculative_tokens=k, return_stats=True,
                                     drafter=NoisyOracleDrafter(prompts, want, seed=k))
            assert stats.accepted > 0
            outs.append(got)
        assert outs[0] == outs[1], k


@pytest.mark.gpu
def test_cuda_graphs_refuse_fp32_layers():
    model = tiny_hf_model(4, device="cuda")
    with pytest.raises(ValueError, match="CUDA graphs need bf16 layers"):
        PagedDeepseekV4(model, max_model_len=320, max_num_reqs=4).enable_cuda_graphs()
