"""``PagedAttentionEngine.warmup()``: after it, serving launches no kernel specialisation it did
not, so nothing compiles while serving.

CPU: every Triton launch goes through the interpreter, where
:func:`dsv4attn.testing.triton_specs.recording` computes the specialisation a GPU would compile
(constexprs, argument types, 16-divisibility, integers equal to 1). The warm-up's set must
contain every specialisation a random serving run launches afterwards: requests joining and
leaving, prompt chunks of random lengths, decodes, contexts through window and compression
boundaries. GPU (marked): the same run compiles no kernel after the warm-up (Triton's own caches).
"""

import random

import pytest
import torch

from dsv4attn.serving.engine import PagedAttentionEngine
from dsv4attn.serving.tiny import tiny_attention_layers
from dsv4attn.testing.triton_specs import recording
from test_serving_engine import _layers as _small_layers

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


def _serve(e: PagedAttentionEngine, steps: int, seed: int) -> None:
    """A random serving run: joins with prompt chunks, decodes, leaves."""
    rng = random.Random(seed)
    live: dict = {}
    nxt = 0
    hs = e.layers[0].config.hidden_size
    for _ in range(steps):
        for r in [r for r, n in live.items() if n > e.max_model_len - 40 or rng.random() < 0.05]:
            e.free(r)
            del live[r]
        feed, budget = {}, e.max_num_batched_tokens
        for r in live:
            n = 1 if rng.random() < 0.8 else rng.randint(2, 30)
            n = min(n, budget, e.max_model_len - live[r])
            if n > 0:
                feed[r] = n
                budget -= n
        while len(live) + len(feed) - len([r for r in feed if r in live]) < e.max_num_reqs and budget > 0 \
                and rng.random() < 0.4:
            n = min(rng.randint(1, 70), budget)
            feed[("s", nxt)] = n
            live[("s", nxt)] = 0
            budget -= n
            nxt += 1
        if not feed:
            continue
        plan = e.begin_step(feed)
        for i in range(len(e.layers)):
            e.run_layer(i, torch.randn(plan.num_tokens, hs, dtype=e.dtype, device=e.device))
        e.end_step()
        for r, n in feed.items():
            live[r] += n


def _check_no_new_specialisations(layers, kv, max_num_reqs, budget, steps):
    e = PagedAttentionEngine(layers, kv, max_model_len=300, max_num_batched_tokens=budget, max_num_reqs=max_num_reqs,
                             impl="triton")
    with recording() as warmed:
        assert e.warmup() > 0
    assert e.requests == [] and all(p.num_free == p.num_blocks for p in e.manager.pools.values())
    with recording() as served:
        _serve(e, steps, seed=1)
    assert served
    new = {k: v for k, v in served.items() if k not in warmed}
    assert not new, [(v["name"], v["constexprs"], v["divisible"], v["ones"]) for v in new.values()]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's launch hook is the CPU check")
def test_serving_after_warmup_launches_only_warmed_specialisations():
    """Up to 4 requests (1 and other batch classes), fp32 layers (every Triton kernel but the
    attention, which fp32 layers run in PyTorch), fp8 pages; ~2 minutes in the interpreter."""
    _check_no_new_specialisations(_small_layers(), "fp8_ds_mla", 4, 48, 15)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's launch hook is the CPU check")
@pytest.mark.parametrize("kv", ["auto", "fp8_ds_mla"])
def test_serving_after_warmup_launches_only_warmed_specialisations_wide(kv):
    """Up to 17 requests (batch classes on both sides of 16), bf16 layers (the Triton attention
    kernel too); ~30 minutes in the interpreter (-m slow)."""
    _check_no_new_specialisations(tiny_attention_layers(3, device="cpu"), kv, 17, 96, 30)


def test_step_tables_keep_widths_in_one_specialisation_class():
    """Eager steps hand the kernels block tables whose widths (and row strides) are multiples of
    16 whatever the contexts, and the slot-mapping search depth moves only at 16 / 256 / 4096
    requests: the integers Triton specialises on stay in one class while serving."""
    from dsv4attn.ops.metadata import search_iters

    assert [search_iters(n) for n in (0, 1, 15, 16, 255, 256, 4095, 4096)] == [4, 4, 4, 8, 8, 12, 12, 16]
    e = PagedAttentionEngine(_small_layers(), "auto", max_model_len=1200, max_num_batched_tokens=320,
                             max_num_reqs=4, impl="reference")
    for n in (5, 300, 300, 300, 1):
        plan = e.begin_step({"a": n, **({"b": 1} if e.requests else {})})
        tables = list(plan.metadata.batch.block_tables.values()) + list(plan.state_tables.values())
        for t in tables:
            assert t.shape[1] % 16 == 0 and t.stride(0) % 16 == 0, t.shape
        e.abort_step() if n == 1 else e.end_step()
        if n == 5:
            e.begin_step({"b": 3})
            e.end_step()


def test_warmup_refuses_a_busy_engine_and_bad_arguments():
    layers = tiny_attention_layers(3, device="cpu", dtype=torch.float32)
    e = PagedAttentionEngine(layers, "auto", max_model_len=300, max_num_batched_tokens=64, max_num_reqs=4,
                             impl="reference")
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        e.warmup(0)
    e.begin_step({"a": 3})
    with pytest.raises(RuntimeError, match="inside a step"):
        e.warmup()
    e.abort_step()
    e.begin_step({"a": 3})
    e.end_step()
    with pytest.raises(RuntimeError, match="idle"):
        e.warmup()
    e.free("a")
    assert e.warmup() > 0 and e.requests == []


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_ds_mla"])
def test_nothing_compiles_while_serving_after_warmup_gpu(kv):
    import dsv4attn.kernels as kernels_pkg
    import importlib
    import pkgutil

    def compiled() -> int:
        n = 0
        for m in pkgutil.iter_modules(kernels_pkg.__path__):
            mod = importlib.import_module(f"dsv4attn.kernels.{m.name}")
            for obj in vars(mod).values():
                while not hasattr(obj, "device_caches") and hasattr(obj, "fn"):  # autotuner / heuristics wrappers
                    obj = obj.fn
                for cache in getattr(obj, "device_caches", {}).values():
                    n += len(cache[0])  # the per-device dict of compiled binaries
        return n

    layers = tiny_attention_layers(3)
    e = PagedAttentionEngine(layers, kv, max_model_len=400, max_num_batched_tokens=96, max_num_reqs=18)
    e.warmup()
    torch.cuda.synchronize()
    before = compiled()
    assert before > 0
    _serve(e, 60, seed=2)
    torch.cuda.synchronize()
    assert compiled() == before
