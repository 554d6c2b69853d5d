"""PagedDeepseekV4 against transformers' own greedy generate, token for token (fp32, CPU/GPU).

Oracle: ``DeepseekV4ForCausalLM.generate(ids, do_sample=False)`` with eager attention, one
prompt at a time (``reference_generate``). The wrapped model runs everything but attention
through transformers' modules and attention through the paged engine; in fp32 the two differ
only by summation order (~1e-6 relative, see test_layer_runner), far below the logit gaps of a
random model, so the greedy tokens must be identical. Prompt lengths sit on and next to the
compression boundaries (multiples of 4 and 128), the window (8) and the SWA block (64).
"""

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from dsv4attn.kv_cache.allocator import PoolExhaustedError  # noqa: E402
from dsv4attn.serving.model import PagedDeepseekV4, reference_generate  # noqa: E402
from dsv4attn.serving.cli import random_prompts
from dsv4attn.serving.tiny import tiny_hf_model  # noqa: E402

LENGTHS = (1, 3, 4, 5, 9, 64, 127, 128, 129, 131)
NEW = 8


def _prompts(lengths, seed=1, vocab=256):
    return random_prompts(len(lengths), vocab, seed, lengths)


@pytest.fixture(scope="module")
def tiny():
    model = tiny_hf_model(0)
    prompts = _prompts(LENGTHS)
    return model, prompts, reference_generate(model, prompts, NEW)


def _impl(device):
    return "auto" if device.type == "cuda" else "reference"


@pytest.mark.parametrize("budget,chunk,max_reqs", [(512, None, 16), (64, 5, 16), (40, 1, 3), (130, 64, 2)])
def test_greedy_equals_transformers(tiny, device, budget, chunk, max_reqs):
    model, prompts, want = tiny
    if chunk == 1:  # one prompt token per step: the short prompts and one past 128 suffice (CI time)
        keep = [i for i, n in enumerate(LENGTHS) if n < 10 or n == 129]
        prompts, want = [prompts[i] for i in keep], [want[i] for i in keep]
    pm = PagedDeepseekV4(model.to(device), max_model_len=256, max_num_batched_tokens=512, max_num_reqs=max_reqs,
                         impl=_impl(device))
    got = pm.generate(prompts, NEW, token_budget=budget, chunk_size=chunk)
    model.to("cpu")
    assert got == want
    assert pm.requests == [] and pm.engine.num_free_blocks() == pm.engine.num_blocks["full_mla"]


def test_model_left_usable_as_oracle(tiny):
    model, prompts, want = tiny
    PagedDeepseekV4(model, max_model_len=256).generate(prompts[:2], 2)
    assert reference_generate(model, prompts[:1], NEW) == want[:1]  # self_attn modules restored


def test_metadata_built_once_per_step_for_all_layers(tiny, monkeypatch):
    model, prompts, _ = tiny
    pm = PagedDeepseekV4(model, max_model_len=256)
    builds, runs = [], []
    build, run = pm.engine.builder.build, pm.engine.run_layer
    monkeypatch.setattr(pm.engine.builder, "build", lambda *a, **k: builds.append(1) or build(*a, **k))
    monkeypatch.setattr(pm.engine, "run_layer", lambda i, h: runs.append(i) or run(i, h))
    pm.step({"a": prompts[6], "b": prompts[2]})
    pm.step({"a": [7], "b": [9]})
    n = len(pm.layers)
    assert len(pm.layers) == 6 and builds == [1, 1] and runs == list(range(n)) * 2


def test_step_api_matches_generate(tiny):
    """Driving the per-step API by hand (teacher-forced decode) gives generate's tokens."""
    model, prompts, want = tiny
    pm = PagedDeepseekV4(model, max_model_len=256)
    logits = pm.step({"x": prompts[8][:100], "y": prompts[7]})
    toks = [int(logits["y"].argmax())]
    logits = pm.step({"x": prompts[8][100:]})
    for t in want[7][:-1]:
        logits = pm.step({"y": [t]})
        toks.append(int(logits["y"].argmax()))
    assert toks == want[7]
    assert int(logits["y"].argmax()) == want[7][-1]
    pm.free("x")
    pm.free("y")


def _state(pm):
    e = pm.engine
    return (e.requests, [e.seq_len(r) for r in e.requests], {g: p.num_free for g, p in e.manager.pools.items()})


def test_bad_steps_change_nothing(tiny, monkeypatch):
    model, prompts, _ = tiny
    pm = PagedDeepseekV4(model, max_model_len=160, num_blocks=2, max_num_batched_tokens=256, max_num_reqs=3)
    pm.step({"a": prompts[6]})
    before = _state(pm)
    for bad, err in [({None: [1]}, ValueError), ({"b": [256]}, ValueError), ({"b": [-1]}, ValueError),
                     ({"b": []}, ValueError), ({"b": "abc"}, TypeError), ({"a": [1] * 40}, ValueError),
                     ({"b": [1] * 300}, ValueError), (["a"], TypeError)]:
        with pytest.raises(err):
            pm.step(bad)
        assert _state(pm) == before
    pm.step({"b": prompts[7]})  # the second (last) compressed block
    before = _state(pm)
    with pytest.raises(PoolExhaustedError, match="num_blocks"):
        pm.step({"a": [1], "c": prompts[0]})  # c would need a third block
    assert _state(pm) == before
    with pytest.raises(ValueError, match="max_num_reqs"):
        pm.step({"c": [1], "d": [2]})
    assert _state(pm) == before

    def boom(i, h):
        raise RuntimeError("layer failed")

    monkeypatch.setattr(pm.engine, "run_layer", boom)
    with pytest.raises(RuntimeError, match="layer failed"):
        pm.step({"a": [3], "b": [4]})
    assert _state(pm) == before and not pm.engine.in_step


def test_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="compress ratios"):
        PagedDeepseekV4(tiny_hf_model(0, compress_ratios=(0, 128), compress_rates={
            "compressed_sparse_attention": 4, "heavily_compressed_attention": 16}), max_model_len=64)
    with pytest.raises(TypeError, match="DeepseekV4ForCausalLM"):
        PagedDeepseekV4(torch.nn.Linear(2, 2))
    model = tiny_hf_model(0, compress_ratios=(0, 4))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        PagedDeepseekV4(model, kv_cache_dtype="int8", max_model_len=64)
    with pytest.raises(ValueError, match="impl"):
        PagedDeepseekV4(model, impl="cuda", max_model_len=64)
    pm = PagedDeepseekV4(model, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        pm.generate([[1] * 60], 10)
    with pytest.raises(ValueError, match="prompts"):
        pm.generate([[]], 2)
    assert pm.generate([[1, 2]], 0) == [[]]


@pytest.mark.parametrize("kv,factor", [("auto", 2.0), ("fp8_ds_mla", 4.0)])
def test_low_precision_within_the_references_own_error(kv, factor):
    """bf16 model: teacher-forced on transformers' bf16 greedy sequences, our logits stay within
    ``factor`` x transformers' own bf16 error of the float32 logits (the CLI's bound, justified
    in dsv4attn.serving.cli.LOWP_FACTOR). Free-running sequences may part at a near-tie, so
    they are not compared."""
    from dsv4attn.serving.cli import LOWP_FACTOR, teacher_forced_errors

    assert LOWP_FACTOR[kv] == factor
    model = tiny_hf_model(0, dtype=torch.bfloat16)
    prompts = _prompts((5, 128, 131), seed=7)
    refs = reference_generate(model, prompts, 6)
    pm = PagedDeepseekV4(model, kv_cache_dtype=kv, max_model_len=160)
    ours, ref = teacher_forced_errors(pm, model, prompts, refs)
    assert 0 < ours <= factor * ref, (ours, ref)
    assert pm.requests == []


@pytest.mark.parametrize("k", [0, 2])
def test_generate_refuses_while_an_earlier_generates_requests_live(tiny, k):
    """Both batchers (plain and speculative) refuse to start over live ("generate", i) requests
    of an interrupted earlier generate(), before touching the engine; max_new_tokens=0 still
    just returns empty lists."""
    model, prompts, _ = tiny
    pm = PagedDeepseekV4(model, max_model_len=256, num_speculative_tokens=k)
    pm.step({("generate", 0): prompts[1]})  # what an interrupted generate() leaves behind
    before = _state(pm)
    with pytest.raises(RuntimeError, match="earlier generate"):
        pm.generate(prompts[:2], 3, num_speculative_tokens=k)
    assert _state(pm) == before
    assert pm.generate(prompts[:2], 0, num_speculative_tokens=k) == [[], []]
    pm.free(("generate", 0))
