"""Low-precision runs of the paged layer (bf16 compute, bf16 or fp8_ds_mla pages) and the Triton path.

Bounds come from the reference's own low-precision error: ``e_ref`` = |HF in bf16 - HF in fp32|
on the same inputs and weights. Our error ``e`` = |ours - HF fp32|.

- bf16 pages: the flash-attention rule, ``e <= 2 * e_ref`` (mean; and max for the sliding and
  HCA kinds).
- fp8_ds_mla pages: e4m3 keeps 3 mantissa bits where bf16 keeps 7 (a 16x coarser step) on the
  448/64-wide NoPE part of every K = V entry, with power-of-two tile scales; errors average over
  the softmax, so we allow 8x the reference's bf16 error (observed ~4x).
- CSA: the indexer's top-k is discrete; rounding flips near-tied selections for a few tokens in
  the reference's bf16 run and in ours alike, at different tokens, so only the mean is bounded.
"""

import copy
import random

import pytest
import torch

from dsv4attn.config import AttentionConfig
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.serving.runner import AttentionRunner
from dsv4attn.testing import assert_within_reference_error

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from dsv4attn.testing import hf_oracle  # noqa: E402 (after the transformers check)

KINDS = [(0, "sliding"), (1, "csa"), (2, "hca")]


def _setup(layer_idx, seed):
    hf = hf_oracle.small_hf_config(
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    ref = hf_oracle.hf_reference_layer(hf, layer_idx, seed=seed)
    ours = DeepseekV4Attention(AttentionConfig.from_hf(hf), layer_idx)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def _run(layer, seqs, kv_cache_dtype, device, impl, dtype, seed=0):
    """Two-at-a-time interleaved chunked run of every sequence; returns id -> fp32 CPU outputs."""
    runner = AttentionRunner(layer.to(device=device, dtype=dtype), kv_cache_dtype=kv_cache_dtype, num_blocks=96,
                             device=device, max_model_len=1024, impl=impl)
    rng = random.Random(seed)
    pos = {k: 0 for k in seqs}
    outs = {k: [] for k in seqs}
    live = list(seqs)
    while live:
        batch = live[:2]
        chunks = {}
        for k in batch:
            n = min(rng.choice([1, 1, 3, 5, 17]), seqs[k].shape[0] - pos[k])
            chunks[k] = seqs[k][pos[k]:pos[k] + n].to(device=device, dtype=dtype)
            pos[k] += n
        for k, o in runner.step(chunks).items():
            outs[k].append(o.float().cpu())
            if pos[k] == seqs[k].shape[0]:
                live.remove(k)
                runner.free(k)
    return {k: torch.cat(v) for k, v in outs.items()}


@pytest.mark.parametrize("kv_cache_dtype,factor", [("auto", 2.0), ("fp8_ds_mla", 8.0)])
@pytest.mark.parametrize("layer_idx,kind", KINDS)
def test_bf16_error_within_reference_bound(layer_idx, kind, kv_cache_dtype, factor, device):
    ref, ours = _setup(layer_idx, seed=20 + layer_idx)
    g = torch.Generator().manual_seed(30 + layer_idx)
    lens = [270, 140] if kind == "hca" else [90, 45]
    seqs = {f"r{i}": torch.randn(n, 64, generator=g) for i, n in enumerate(lens)}
    ref_bf16 = copy.deepcopy(ref).to(torch.bfloat16)
    impl = "auto" if device.type == "cuda" else "reference"
    got = _run(ours, seqs, kv_cache_dtype, device, impl, torch.bfloat16)
    gots, lows, golds = [], [], []
    for k, x in seqs.items():
        golds.append(hf_oracle.hf_forward(ref, x))
        lows.append(hf_oracle.hf_forward(ref_bf16, x.bfloat16()).float())
        gots.append(got[k])
    assert_within_reference_error(torch.cat(gots), torch.cat(lows), torch.cat(golds), factor,
                                  check_max=kind != "csa")


@pytest.mark.parametrize("layer_idx,kind,kv_cache_dtype,T", [
    (0, "sliding", "auto", 20), (1, "csa", "fp8_ds_mla", 30), (2, "hca", "auto", 132),
])
def test_triton_path_matches_reference_ops(layer_idx, kind, kv_cache_dtype, T, device):
    """The Triton ops (interpreter on CPU, compiled on GPU) give the reference ops' results:
    both end in bf16 outputs, so they may differ by one bf16 rounding of the output (2^-8 rel)."""
    _, ours = _setup(layer_idx, seed=40)
    g = torch.Generator().manual_seed(41)
    seqs = {"a": torch.randn(T, 64, generator=g), "b": torch.randn(T // 2, 64, generator=g)}
    a = _run(copy.deepcopy(ours), seqs, kv_cache_dtype, device, "triton", torch.bfloat16, seed=1)
    b = _run(copy.deepcopy(ours), seqs, kv_cache_dtype, device, "reference", torch.bfloat16, seed=1)
    for k in seqs:
        torch.testing.assert_close(a[k], b[k], rtol=2 ** -7, atol=2 ** -7 * b[k].abs().max().item())


@pytest.mark.parametrize("layer_idx,kind", KINDS)
def test_fp32_compute_over_fp8_pages(layer_idx, kind, device):
    """fp32 compute over fp8_ds_mla pages: the only error is the cache quantisation, bounded as above."""
    ref, ours = _setup(layer_idx, seed=50)
    g = torch.Generator().manual_seed(51)
    seqs = {"a": torch.randn(260 if kind == "hca" else 64, 64, generator=g)}
    impl = "auto" if device.type == "cuda" else "reference"
    got = _run(ours, seqs, "fp8_ds_mla", device, impl, torch.float32)["a"]
    gold = hf_oracle.hf_forward(ref, seqs["a"])
    e_ref = (hf_oracle.hf_forward(copy.deepcopy(ref).to(torch.bfloat16), seqs["a"].bfloat16()).float() - gold).abs()
    assert (got - gold).abs().mean() <= 8 * e_ref.mean()


@pytest.mark.parametrize("layer_idx,kind", KINDS)
def test_fused_input_projections(layer_idx, kind, device):
    """``fuse_input_projections`` (the engine does it on GPU): the state dict is unchanged and
    still loads, the layer step gives the unfused results (one GEMM's columns = the separate
    GEMMs, up to their summation order: fp32 tolerance), and a module copy falls back to
    separate projections."""
    _, ours = _setup(layer_idx, seed=60)
    ours = ours.to(device)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    g = torch.Generator().manual_seed(61)
    seqs = {"a": torch.randn(40, 64, generator=g), "b": torch.randn(17, 64, generator=g)}
    want = _run(copy.deepcopy(ours), seqs, "auto", device, "reference", torch.float32, seed=1)
    fused = copy.deepcopy(ours)
    fused.fuse_input_projections()
    lins = fused.input_linears()
    w = fused._fused_weight(lins)
    assert w is not None and len(lins) == {"sliding": 2, "csa": 7, "hca": 4}[kind]
    fused.fuse_input_projections()  # idempotent: the same tensor (graphs of other engines read it)
    assert fused._fused_weight(lins) is w
    sd = fused.state_dict()
    assert sd.keys() == before.keys() and all(torch.equal(sd[k], before[k]) for k in sd)
    fused.load_state_dict(before)  # loads into the shared storage, sharing kept
    assert fused._fused_weight(lins) is not None
    x = torch.randn(5, 64, generator=g).to(device)
    for got, lin in zip(fused.project_inputs(x), lins):
        torch.testing.assert_close(got, lin(x), rtol=1e-5, atol=1e-5)
    got = _run(fused, seqs, "auto", device, "reference", torch.float32, seed=1)
    for k in seqs:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4 * want[k].abs().max().item())
    assert copy.deepcopy(fused)._fused_weight(copy.deepcopy(fused).input_linears()) is None
