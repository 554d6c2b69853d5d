"""The cache-free whole-sequence layer against transformers' DeepseekV4Attention (fp32, CPU).

fp32 tolerance: both sides compute the same formulas in fp32 with different summation orders
(pooling, softmax, einsum vs matmul); observed differences are ~1e-6 of outputs of size ~1, so
1e-5 relative to the output's max leaves a 10x margin while any wrong mask/position/rope would
be O(1).
"""

import pytest
import torch

from dsv4attn.config import AttentionConfig
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.layers.indexer import select_topk
from dsv4attn.testing import assert_close_rel

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
hf_oracle = pytest.importorskip("dsv4attn.testing.hf_oracle")


def _pair(layer_idx, seed=0, **overrides):
    hf = hf_oracle.small_hf_config(**overrides)
    ref = hf_oracle.hf_reference_layer(hf, layer_idx, seed=seed)
    ours = DeepseekV4Attention(AttentionConfig.from_hf(hf), layer_idx)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def _close(a, b, rel=1e-5, skip=None):
    assert_close_rel(a, b, rel, skip)


def test_parameter_names_and_shapes_match_reference():
    for layer_idx in range(3):
        ref, ours = _pair(layer_idx)
        want = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
        got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
        assert got == want


@pytest.mark.parametrize("layer_idx,kind", [(0, "sliding"), (1, "csa"), (2, "hca")])
@pytest.mark.parametrize("T", [1, 3, 4, 7, 33, 70])
def test_full_sequence_equals_reference(layer_idx, kind, T):
    ref, ours = _pair(layer_idx, seed=T)
    assert ours.kind == kind
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(100 + T))
    with torch.no_grad():
        _close(ours(x), hf_oracle.hf_forward(ref, x), skip=ours.topk_ambiguous(x))


def test_hca_ratio_128_and_large_topk():
    """The production ratio (two complete entries) and a CSA top-k wider than the entry count."""
    ref, ours = _pair(2, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    x = torch.randn(260, 64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        _close(ours(x), hf_oracle.hf_forward(ref, x))
    ref, ours = _pair(1, index_topk=64)
    x = torch.randn(90, 64, generator=torch.Generator().manual_seed(8))
    assert not ours.topk_ambiguous(x).any()  # top-k wider than every row: never ambiguous
    with torch.no_grad():
        _close(ours(x), hf_oracle.hf_forward(ref, x))


def _naive_topk(scores, n_eligible, k):
    rows = []
    for t in range(scores.shape[0]):
        cand = sorted(range(int(n_eligible[t])), key=lambda j: (-scores[t, j].item(), j))[:k]
        rows.append(cand + [-1] * (min(k, scores.shape[1]) - len(cand)))
    return torch.tensor(rows, dtype=torch.int32).reshape(scores.shape[0], min(k, scores.shape[1]))


@pytest.mark.parametrize("seed", range(5))
def test_select_topk_ties_lower_index_first(seed):
    g = torch.Generator().manual_seed(seed)
    T, N, k = 9, 13, 5
    scores = torch.randint(-2, 3, (T, N), generator=g).float().clamp(min=0)  # many exact ties
    n_eligible = torch.randint(0, N + 1, (T,), generator=g)
    got = select_topk(scores, n_eligible, k)
    assert got.dtype == torch.int32
    torch.testing.assert_close(got, _naive_topk(scores, n_eligible, k))
    assert select_topk(scores[:, :0], n_eligible * 0, k).shape == (T, 0)


def test_reference_chunked_run_equals_its_full_run():
    """The oracle's own premise: HF chunked-with-cache equals its cache-free run in fp32."""
    for layer_idx in range(3):
        ref, _ = _pair(layer_idx, seed=9)
        x = torch.randn(41, 64, generator=torch.Generator().manual_seed(9))
        _close(hf_oracle.hf_forward(ref, x, [3, 1, 12, 1, 1, 16, 7]), hf_oracle.hf_forward(ref, x),
               skip=_pair(layer_idx, seed=9)[1].topk_ambiguous(x))


def test_topk_ambiguity_detects_boundary_ties():
    from dsv4attn.layers.indexer import topk_boundary_ties

    scores = torch.tensor([[3.0, 0.0, 0.0, -1.0], [3.0, 2.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    got = topk_boundary_ties(scores, torch.tensor([4, 4, 2]), 2)
    assert got.tolist() == [True, False, False]
