"""The demo's workload loop (chunked prefill + decode, a 3-kind stack) verifies itself."""

import dataclasses

import pytest

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
demo = pytest.importorskip("dsv4attn.serving.layer_demo")


def test_small_demo_runs_and_matches_reference(device):
    size = dataclasses.replace(demo.SMALL, prompt_lens=(1, 140), decode_lens=(1, 6), token_budget=96)
    if device.type == "cuda":
        size = dataclasses.replace(size, prompt_lens=(100, 300))
    res = demo.run_demo(size, 5, device, seed=1, progress=False)
    assert res.requests == 5 and res.steps > 1 and res.tokens > 0
    assert set(res.max_err) == {"sliding", "csa", "hca"}
    assert max(res.max_err.values()) < 1e-4  # fp32: see test_layer_runner
    table = demo.format_table([res])
    assert table.count("\n") == 2 and "small" in table
