"""The decode path with several query tokens per request (speculative verify steps).

A batch of decodes with 1..1+k tokens each (``num_speculative_tokens = k``) plus a prefill:
every decode token's candidate sets, in the decode-row form the engines use (``full``: SWA and
C128A index rows) and in the range form, give the attention of a plain per-token oracle over
raw positions ``max(0, p-W+1) .. p`` and entries ``0 .. (p+1)//128 - 1``; and a token's output
does not change when the rows of the request's later new tokens (positions > p, written in
the same step) are overwritten: the causal mask among a request's own new tokens follows from
the per-token lengths alone.
"""

from __future__ import annotations

import pytest
import torch

from dsv4attn.metadata import BatchMetadata, MetadataConfig, StepMetadataBuilder
from dsv4attn.ops.candidate_set import CandidateSet
from dsv4attn.ops.sparse_attn import sparse_mla_attention

W, D, H = 8, 80, 4
QL = [4, 1, 5, 3, 20]  # k = 4: four decodes of 1..5 tokens, then a prefill chunk
SL = [131, 7, 260, 129, 300]  # positions cross 128 / 256 (C128A entries) inside the step


def _setup(form: str, device):
    g = torch.Generator().manual_seed(0)
    R = len(QL)
    swa = torch.randperm(64, generator=g)[: R * 5].to(torch.int32).view(R, 5)  # 5 x 64 >= 300 positions
    mla = torch.randperm(16, generator=g)[: R * 2].to(torch.int32).view(R, 2)
    tabs = {"swa": swa.to(device), "full_mla": mla.to(device)}
    batch = BatchMetadata.from_requests(QL, SL, tabs, num_speculative_tokens=4)
    cfg = MetadataConfig(max_num_batched_tokens=64, max_num_reqs=8, max_model_len=512,
                         num_blocks={"swa": 64, "full_mla": 16}, window_size=W, compress_ratios=(128,),
                         form=form)
    step = StepMetadataBuilder(cfg, device).build(batch, impl="reference")
    swa_cache = torch.randn(64, 64, D, generator=g).to(device=device, dtype=torch.bfloat16)
    c_cache = torch.randn(16, 2, D, generator=g).to(device=device, dtype=torch.bfloat16)
    return batch, step, swa, mla, swa_cache, c_cache


def _sets(step, swa_cache, c_cache, rows: slice):
    """Candidate sets of tokens ``rows`` (decode tokens: index rows in form full)."""
    sw, cm = step.swa, step.compressed[128]
    if step.form == "range":
        t2r = step.token_to_req[rows]
        return [CandidateSet(swa_cache, sw.lengths[rows], block_table=sw.block_table, token_to_req=t2r,
                             starts=sw.starts[rows]),
                CandidateSet(c_cache, cm.lengths[rows], block_table=cm.block_table, token_to_req=t2r,
                             starts=cm.starts[rows])]
    return [CandidateSet(swa_cache, sw.decode_lens[rows], indices=sw.decode_indices[rows]),
            CandidateSet(c_cache, cm.decode_lens[rows], indices=cm.global_decode[rows])]


def _oracle(q, batch, swa, mla, swa_cache, c_cache, sink, scale):
    """Per token t < len(q): attention over its raw window and complete C128A entries, sink."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    req = batch.token_to_req.tolist()
    for t, p in enumerate(batch.positions_cpu.tolist()[:q.shape[0]]):
        r = req[t]
        ks = [swa_cache[swa[r, e // 64], e % 64] for e in range(max(0, p - W + 1), p + 1)]
        ks += [c_cache[mla[r, e // 2], e % 2] for e in range((p + 1) // 128)]
        k = torch.stack(ks).float().cpu()
        s = scale * q[t].float() @ k.T  # [H, n]
        lse = torch.logsumexp(s, -1)
        o = torch.softmax(s, -1) @ k
        out[t] = o * torch.sigmoid(lse - sink)[:, None]
    return out


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("form", ["full", "range"])
def test_multi_token_decodes_attend_causally(form, impl, device):
    batch, step, swa, mla, swa_cache, c_cache = _setup(form, device)
    assert (batch.num_decodes, batch.num_decode_tokens, batch.decode_threshold) == (4, 13, 5)
    nd = batch.num_decode_tokens
    g = torch.Generator().manual_seed(1)
    q = torch.randn(nd, H, D, generator=g).to(device=device, dtype=torch.bfloat16)
    sink = torch.randn(H, generator=g)
    scale = D ** -0.5
    rows = slice(0, nd)
    out, _ = sparse_mla_attention(q, _sets(step, swa_cache, c_cache, rows), scale, sink.to(device), impl=impl)
    want = _oracle(q.cpu(), batch, swa, mla, swa_cache.cpu(), c_cache.cpu(), sink, scale)
    assert (out.float().cpu() - want).abs().max() <= 2e-2 * want.abs().max()  # bf16 rounding of q / p
    # Causality: overwrite the SWA rows of every request's new tokens after the first; the first
    # new token of each request must not move (it never reads them), later ones must.
    starts = [0]
    for n in QL[:4]:
        starts.append(starts[-1] + n)
    poisoned = swa_cache.clone()
    for r, (n, s) in enumerate(zip(QL[:4], SL[:4])):
        for p in range(s - n + 1, s):
            poisoned[swa[r, p // 64], p % 64] = 100.0
    out2, _ = sparse_mla_attention(q, _sets(step, poisoned, c_cache, rows), scale, sink.to(device), impl=impl)
    for r, n in enumerate(QL[:4]):
        t0 = starts[r]
        assert torch.equal(out2[t0], out[t0]), f"request {r}: its first new token read a later one"
        for t in range(t0 + 1, t0 + n):
            assert not torch.equal(out2[t], out[t])
