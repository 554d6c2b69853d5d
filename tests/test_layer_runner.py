"""AttentionRunner (paged, batched, incremental) against transformers' DeepseekV4Attention in fp32.

Oracle: the HF module run over each request's whole sequence, one request at a time (the HF
chunked-with-cache run equals its full run to ~1e-7 in fp32, see dsv4-system.md). Tolerance
1e-4 relative to the output's max: both sides are fp32 with different reduction orders
(observed ~5e-7 relative); anything structurally wrong (a missed window row, an entry
emitted late, a wrong RoPE position) is O(1).

On CUDA the runner runs on the GPU with impl="auto" (Triton cache writers and metadata
kernels); on CPU it uses the reference ops.
"""

import random

import pytest
import torch

from dsv4attn.config import AttentionConfig
from dsv4attn.kv_cache.allocator import PoolExhaustedError
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.serving.runner import AttentionRunner

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
hf_oracle = pytest.importorskip("dsv4attn.testing.hf_oracle")

KINDS = [(0, "sliding", 1), (1, "csa", 4), (2, "hca", 128)]
HIDDEN = 64


def _hf_config():
    return hf_oracle.small_hf_config(
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})


def _layer(layer_idx, seed=0):
    hf = _hf_config()
    ref = hf_oracle.hf_reference_layer(hf, layer_idx, seed=seed)
    ours = DeepseekV4Attention(AttentionConfig.from_hf(hf), layer_idx)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def _impl(device):
    return "auto" if device.type == "cuda" else "reference"


def _runner(layer, device, **kw):
    kw.setdefault("num_blocks", 96)
    kw.setdefault("max_model_len", 1024)
    return AttentionRunner(layer.to(device), device=device, impl=_impl(device), **kw)


def schedule(T, r, rng):
    """Chunk sizes summing to T: random 1..3r with decode runs; a cut lands on or next to every
    compression boundary (chunk ends at k*r - 1, k*r or k*r + 1)."""
    sizes, s = [], 0
    while s < T:
        n = 1 if rng.random() < 0.3 else rng.randint(1, 3 * r)
        boundary = (s // r + 1) * r
        cut = boundary + rng.choice([-1, 0, 1])
        if s + n > cut > s:
            n = cut - s
        n = min(n, T - s)
        sizes.append(n)
        s += n
    return sizes


def _close(got, want, rel=1e-4, skip=None):
    """Max-abs check relative to want's max; ``skip`` (bool [T]) drops tokens whose indexer top-k
    has a tie at the boundary (any tie-break is right there; the reference's is arbitrary)."""
    got, want = got.float().cpu(), want.float().cpu()
    if skip is not None:
        got, want = got[~skip.cpu()], want[~skip.cpu()]
    err = (got - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), f"max abs err {err} vs scale {want.abs().max().item()}"


@pytest.mark.parametrize("layer_idx,kind,r", KINDS)
def test_chunked_request_equals_full_sequence(layer_idx, kind, r, device):
    ref, ours = _layer(layer_idx, seed=1)
    T = 300 if kind == "hca" else 60
    x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(3))
    want = hf_oracle.hf_forward(ref, x)
    with torch.no_grad():
        dense = ours(x)
    skip = ours.topk_ambiguous(x)
    _close(dense, want, rel=1e-5, skip=skip)
    runner = _runner(ours, device)
    sizes = schedule(T, max(r, 4), random.Random(layer_idx))
    outs, s = [], 0
    for n in sizes:
        outs.append(runner.step({"req": x[s:s + n].to(device)})["req"])
        s += n
    got = torch.cat(outs)
    _close(got, want, skip=skip)
    _close(got, dense.to(got.device), rel=1e-5)  # same tie-break: no token skipped


def _interleave(runner, seqs, rng, r, max_active=3):
    """Drive requests through the runner with random chunking; free each when done, admit new ones."""
    pending = list(seqs)
    active, done, outs = [], {}, {k: [] for k in seqs}
    pos = {k: 0 for k in seqs}
    plans = {k: schedule(seqs[k].shape[0], r, rng) for k in seqs}
    while pending or active:
        while pending and len(active) < max_active:
            active.append(pending.pop(0))
        chosen = [k for k in active if rng.random() < 0.8] or active[:1]
        chunks = {}
        for k in chosen:
            n = plans[k].pop(0)
            chunks[k] = seqs[k][pos[k]:pos[k] + n].to(runner.device)
            pos[k] += n
        rng.shuffle(chosen)
        res = runner.step({k: chunks[k] for k in chosen})
        for k in chosen:
            outs[k].append(res[k])
            if not plans[k]:
                active.remove(k)
                runner.free(k)
                done[k] = torch.cat(outs[k])
    return done


@pytest.mark.parametrize("layer_idx,kind,r", KINDS)
def test_interleaved_requests_equal_reference(layer_idx, kind, r, device):
    ref, ours = _layer(layer_idx, seed=2)
    g = torch.Generator().manual_seed(10 + layer_idx)
    lens = [290, 140, 260, 40, 130] if kind == "hca" else [37, 1, 61, 9, 24, 50]
    seqs = {f"r{i}": torch.randn(n, HIDDEN, generator=g) for i, n in enumerate(lens)}
    runner = _runner(ours, device)
    free0 = {g: p.num_free for g, p in runner.manager.pools.items()}
    got = _interleave(runner, seqs, random.Random(layer_idx), max(r, 4))
    for k, x in seqs.items():
        _close(got[k], hf_oracle.hf_forward(ref, x), skip=ours.topk_ambiguous(x.to(runner.device)))
    assert runner.requests == [] and {g: p.num_free for g, p in runner.manager.pools.items()} == free0


def test_outputs_do_not_depend_on_batch_or_chunking(device):
    _, ours = _layer(1, seed=3)
    g = torch.Generator().manual_seed(5)
    x, y, z = (torch.randn(n, HIDDEN, generator=g).to(device) for n in (33, 20, 45))
    alone = _runner(ours, device).step({"x": x})["x"]
    runner = _runner(ours, device)
    runner.step({"y": y[:7]})
    parts = [runner.step({"z": z[:13], "x": x[:5], "y": y[7:8]})["x"]]
    parts.append(runner.step({"x": x[5:6], "y": y[8:]})["x"])
    parts.append(runner.step({"z": z[13:], "x": x[6:]})["x"])
    torch.testing.assert_close(torch.cat(parts), alone, rtol=0, atol=1e-5 * alone.abs().max().item())


def test_bad_requests_raise_and_leave_others_intact(device):
    ref, ours = _layer(1, seed=4)
    g = torch.Generator().manual_seed(6)
    a = torch.randn(40, HIDDEN, generator=g)
    runner = _runner(ours, device, num_blocks=16, max_model_len=64, max_num_batched_tokens=48)
    out = [runner.step({"a": a[:20].to(device)})["a"]]
    before = (runner.num_free_blocks, runner.seq_len("a"))
    dev = runner.device
    with pytest.raises(KeyError):
        runner.free("nope")
    with pytest.raises(ValueError, match="empty"):
        runner.step({"a": a[20:21].to(dev), "b": a[:0].to(dev)})
    with pytest.raises(ValueError, match="max_model_len"):
        runner.step({"a": a[20:21].to(dev), "b": torch.zeros(65, HIDDEN, device=dev)})
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        runner.step({"a": a[20:21].to(dev), "b": torch.zeros(48, HIDDEN, device=dev)})
    with pytest.raises(ValueError):
        runner.step({"a": a[20:21].to(dev).double()})
    with pytest.raises(ValueError):
        runner.step({"a": torch.zeros(1, HIDDEN + 1, device=dev)})
    with pytest.raises(TypeError):
        runner.step({"a": [1.0]})
    hog = _runner(ours, device, num_blocks=1, max_model_len=64)
    hog.step({"h1": torch.zeros(20, HIDDEN, device=dev)})  # the one compressed block
    with pytest.raises(PoolExhaustedError):
        hog.step({"h1": torch.zeros(1, HIDDEN, device=dev), "h2": torch.zeros(20, HIDDEN, device=dev)})
    assert hog.requests == ["h1"] and hog.seq_len("h1") == 20
    assert (runner.num_free_blocks, runner.seq_len("a")) == before and runner.requests == ["a"]
    out.append(runner.step({"a": a[20:].to(dev)})["a"])
    _close(torch.cat(out), hf_oracle.hf_forward(ref, a), skip=ours.topk_ambiguous(a.to(dev)))
    assert runner.step({}) == {}


@pytest.mark.parametrize("layer_idx,kind,r", KINDS)
def test_nan_poisoned_pages_are_never_read(layer_idx, kind, r, device):
    """Every cache starts as NaN: any read of a slot not written for this request shows up."""
    ref, ours = _layer(layer_idx, seed=7)
    g = torch.Generator().manual_seed(8)
    seqs = {"p": torch.randn(140 if kind == "hca" else 30, HIDDEN, generator=g),
            "q": torch.randn(9, HIDDEN, generator=g)}
    runner = _runner(ours, device)
    for name in ("swa", "compressed", "indexer_k", "state", "indexer_state"):
        t = getattr(runner.caches, name)
        if t is not None:
            t.fill_(float("nan"))
    got = _interleave(runner, seqs, random.Random(3), max(r, 4), max_active=2)
    for k, x in seqs.items():
        _close(got[k], hf_oracle.hf_forward(ref, x), skip=ours.topk_ambiguous(x.to(runner.device)))
