"""Values a step's layers share (serving.paged.StepTables) and the layer step's cached pieces.

The engine computes the rotary tables and the pooling positions once per step and hands them to
every layer; a layer step that computes its own must give the same bits. Oracle: the same engine
step with sharing switched off (every ``get`` computes afresh), and the einsum / ``.float()``
forms that the cached pieces replace.
"""

import pytest
import torch

from dsv4attn.config import AttentionConfig
from dsv4attn.layers import rope as rope_mod
from dsv4attn.layers.attention import DeepseekV4Attention, GroupedLinear
from dsv4attn.serving.engine import PagedAttentionEngine
from dsv4attn.serving.paged import StepTables

KINDS = ("sliding", "csa", "hca", "csa", "hca", "sliding")
RATIOS = (1, 4, 128, 4, 128, 1)


def _layers(dtype=torch.float32):
    cfg = AttentionConfig(hidden_size=32, num_heads=2, head_dim=80, rope_dim=16, q_lora_rank=16, o_groups=1,
                          o_lora_rank=8, window_size=8, index_num_heads=2, index_head_dim=32, index_topk=4,
                          layer_kinds=KINDS, compress_ratios=RATIOS)
    torch.manual_seed(0)
    layers = []
    for i in range(len(KINDS)):
        layer = DeepseekV4Attention(cfg, i)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.3)
        layers.append(layer.to(dtype).eval())
    return layers


def _run(layers, steps):
    """Outputs of every layer in every step (hidden of each step: the same random rows)."""
    eng = PagedAttentionEngine(layers, "auto", max_model_len=400, max_num_batched_tokens=160, max_num_reqs=4,
                               num_blocks=24, impl="reference")
    g = torch.Generator().manual_seed(1)
    outs = []
    for step in steps:
        plan = eng.begin_step(step)
        x = torch.randn(plan.num_tokens, 32, generator=g)
        outs.append([eng.run_layer(i, x) for i in range(len(layers))])
        eng.end_step()
    return outs


STEPS = [{"a": 37, "b": 5}, {"a": 1, "b": 1, "c": 140}, {"a": 1, "b": 1, "c": 1}, {"b": 2, "c": 1}]


def test_shared_tables_give_the_bits_of_per_layer_tables_and_compute_each_once(monkeypatch):
    """Six layers of three kinds over steps that cross compression boundaries (prefill chunks,
    decodes, a request joining): with the tables shared, each (rotary table, ratio) is computed
    once per step, and every output equals, bit for bit, the run in which every layer computes
    its own."""
    layers = _layers()
    calls = []
    real = rope_mod.rope_cos_sin

    def spy(*args, **kwargs):
        calls.append(kwargs.get("ratio", 1))
        return real(*args, **kwargs)

    monkeypatch.setattr(rope_mod, "rope_cos_sin", spy)
    shared = _run(layers, STEPS)
    keys = {(layer.rotary.rope, r) for layer in layers for r in {1, layer.ratio}}
    assert len(calls) == len(keys) * len(STEPS)
    monkeypatch.setattr(StepTables, "get", lambda self, key, make: make())
    calls.clear()
    alone = _run(layers, STEPS)
    assert len(calls) == sum(1 + (layer.ratio > 1) for layer in layers) * len(STEPS)
    for a, b in zip(shared, alone):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_refresh_recomputes_into_the_same_tensors():
    """What captured graphs rely on: ``refresh`` writes each value's new result into the tensor
    ``get`` returned first, and ``get`` keeps returning that tensor."""
    src = torch.arange(4.0)
    tables = StepTables()
    (first,) = tables.get("k", lambda: (src * 2,))
    src += 10
    assert tables.get("k", lambda: (torch.zeros(4),))[0] is first
    torch.testing.assert_close(first, torch.arange(4.0) * 2)
    tables.refresh()
    assert tables.get("k", lambda: (torch.zeros(4),))[0] is first
    torch.testing.assert_close(first, (torch.arange(4.0) + 10) * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_without_autograd_equals_einsum(dtype):
    """The inference form (a batched product written straight into ``[T, G, out_g]``) equals
    the einsum form bit for bit, and a product that needs gradients still gets them."""
    lin = GroupedLinear(24, 4 * 8, 4).to(dtype)
    x = torch.randn(5, 4, 24, dtype=dtype)
    want = torch.einsum("tgi,goi->tgo", x, lin.weight.view(4, 8, 24)).flatten(1)
    with torch.no_grad():
        got = lin(x)
    assert got.shape == (5, 32) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    y = lin(x)
    y.sum().backward()
    assert lin.weight.grad is not None


def test_sinks_fp32_cached_until_the_parameter_changes():
    """A bf16 layer's sinks convert once; an in-place update of the parameter refreshes the same
    cached tensor (graphs captured before read it); an fp32 layer hands the parameter itself."""
    layer = _layers(torch.bfloat16)[0]
    first = layer.sinks_fp32()
    assert first.dtype == torch.float32 and first.is_contiguous()
    torch.testing.assert_close(first, layer.sinks.float(), rtol=0, atol=0)
    assert layer.sinks_fp32() is first
    with torch.no_grad():
        layer.sinks.add_(1.0)
    again = layer.sinks_fp32()
    assert again is first
    torch.testing.assert_close(again, layer.sinks.float(), rtol=0, atol=0)
    fp32 = _layers()[0]
    assert fp32.sinks_fp32().data_ptr() == fp32.sinks.data_ptr()


def test_layer_step_refuses_other_tables_before_writing_a_cache():
    """``layer_step(tables=...)`` takes a StepTables or None: anything else is a TypeError naming
    the argument, raised before the step writes its caches (they keep their bytes)."""
    from dsv4attn.serving.paged import layer_step

    layers = _layers()
    eng = PagedAttentionEngine(layers, "auto", max_model_len=400, max_num_batched_tokens=160, max_num_reqs=4,
                               num_blocks=24, impl="reference")
    plan = eng.begin_step({"a": 9})
    before = [t.clone() for t in vars(eng.caches[1]).values() if isinstance(t, torch.Tensor)]
    x = torch.randn(plan.num_tokens, 32)
    st, sp = plan.state(layers[1].ratio)
    with pytest.raises(TypeError, match="tables"):
        layer_step(layers[1], x, plan.metadata, eng.builder, eng.caches[1], st, impl="reference",
                   state_positions=sp, tables={"rotary": None})
    after = [t for t in vars(eng.caches[1]).values() if isinstance(t, torch.Tensor)]
    assert len(before) == len(after) > 0 and all(torch.equal(a, b) for a, b in zip(before, after))
