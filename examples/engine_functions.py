"""The engine-compatible functions, called as a serving engine calls them (vLLM's FLASHMLA_SPARSE_DSV4).

Two requests over paged fp8_ds_mla caches: a prefill step that writes the SWA cache and the
C128A compressed cache (slots from ``get_compressed_slot_mapping``), then a decode step whose
attention runs through ``flash_mla_with_kvcache`` with the SWA indices and the C128A rows of
``build_c128a_topk_metadata`` as the extra cache. The decode output is checked against a plain
fp32 softmax-with-sink over the dequantised cache entries; prints PASS/FAIL and exits nonzero on
failure. Runs anywhere (PyTorch reference on CPU, Triton on CUDA sm80+). ``--help`` does no work.
"""

from __future__ import annotations

import argparse
import sys

import torch

import dsv4attn
from dsv4attn.kv_cache.layout import alloc_fp8_ds_mla_cache, dequantize_fp8_ds_mla
from dsv4attn.kv_cache.slots import c128a_max_compressed, entry_slots
from dsv4attn.ops.cache_ops import insert_kv
from dsv4attn.ops.metadata import compute_swa_indices_and_lens

B = dsv4attn.DeepseekV4SparseBackend
HEAD, HEADS, WINDOW, R = 512, 8, 128, 128
SWA_BS, C128_BS = 64, 256 // R  # storage entries per block (engine "kernel block size" per cache)
MAX_MODEL_LEN = 1024
#: bf16 q and fp8 pages vs an fp32 computation over the same dequantised entries: the op rounds
#: q to bf16 and its output to bf16 (2^-8 relative), so 2% of the output scale is a loose bound.
TOLERANCE = 2e-2


def main() -> int:
    argparse.ArgumentParser(description=__doc__).parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    i32 = dict(dtype=torch.int32, device=dev)

    # Caches as the engine allocates them: backend shape, padded page stride, one pool.
    num_blocks = 32
    assert B.get_kv_cache_shape(num_blocks, SWA_BS, 1, HEAD, "fp8_ds_mla") == (num_blocks, SWA_BS, 584)
    swa = alloc_fp8_ds_mla_cache(num_blocks, SWA_BS, device=dev)
    c128 = alloc_fp8_ds_mla_cache(num_blocks, C128_BS, device=dev)
    swa_table = torch.tensor([[3, 7, 1, 9, 12], [5, 0, 2, 4, 6]], **i32)     # [R, blocks] per group
    mla_table = torch.tensor([[8, 2, 11], [4, 10, 1]], **i32)

    # ---- step 1: prefill 300 and 200 tokens ---------------------------------------------------
    qlens, seqs = [300, 200], [300, 200]
    qsl = torch.tensor([0, 300, 500], **i32)
    pos = torch.cat([torch.arange(n) for n in qlens]).to(dev)
    req = torch.repeat_interleave(torch.arange(2), torch.tensor(qlens)).to(dev)
    slot_mapping = entry_slots(swa_table, req, pos, SWA_BS)                  # raw SWA slot per token
    insert_kv(torch.randn(500, HEAD, generator=g).to(dev), slot_mapping, swa, "fp8_ds_mla")
    csm = dsv4attn.get_compressed_slot_mapping(500, qsl, torch.tensor(seqs, **i32), mla_table, C128_BS, R)
    boundary = (csm >= 0).nonzero().squeeze(1)                               # tokens that complete an entry
    entries = torch.randn(boundary.numel(), HEAD, generator=g).to(dev)       # the compressor's output
    insert_kv(entries, csm[boundary], c128, "fp8_ds_mla")

    # ---- step 2: one decode token each -----------------------------------------------------------
    pos = torch.tensor([300, 200], dtype=torch.int64, device=dev)
    t2r = torch.tensor([0, 1], **i32)
    slot_mapping = entry_slots(swa_table, t2r, pos, SWA_BS)
    insert_kv(torch.randn(2, HEAD, generator=g).to(dev), slot_mapping, swa, "fp8_ds_mla")
    swa_idx, swa_lens = compute_swa_indices_and_lens(pos, t2r, swa_table, SWA_BS, slot_mapping, WINDOW)
    width = c128a_max_compressed(MAX_MODEL_LEN)
    gdec = torch.full((2, width), -1, **i32)
    dlens = torch.zeros(2, **i32)
    pref = torch.full((2, width), -1, **i32)
    c_idx, c_lens, _ = dsv4attn.build_c128a_topk_metadata(pos, R, 2, t2r, mla_table, C128_BS, slot_mapping,
                                                          gdec, dlens, pref, width)
    q = torch.randn(2, 1, HEADS, HEAD, generator=g).to(torch.bfloat16).to(dev)
    sink = torch.randn(HEADS, generator=g).to(dev)
    meta, _ = dsv4attn.get_mla_metadata()
    out, lse = dsv4attn.flash_mla_with_kvcache(
        q, swa.unsqueeze(-2), None, None, HEAD, meta, softmax_scale=HEAD ** -0.5, is_fp8_kvcache=True,
        indices=swa_idx.view(2, 1, -1), attn_sink=sink, extra_k_cache=c128.unsqueeze(-2),
        extra_indices_in_kvcache=c_idx.view(2, 1, -1), topk_length=swa_lens, extra_topk_length=c_lens,
    )

    # ---- check: fp32 softmax with sink over the dequantised candidates ----------------------------
    swa_rows = dequantize_fp8_ds_mla(swa).float().reshape(-1, HEAD)
    c_rows = dequantize_fp8_ds_mla(c128).float().reshape(-1, HEAD)
    worst = 0.0
    for t in range(2):
        keys = torch.cat([swa_rows[swa_idx[t, : swa_lens[t]].long()], c_rows[c_idx[t, : c_lens[t]].long()]])
        logits = q[t, 0].float() @ keys.T * HEAD ** -0.5                    # [H, n]
        p = torch.softmax(torch.cat([logits, sink[:, None]], dim=1), dim=1)[:, :-1]
        want = p @ keys
        worst = max(worst, ((out[t, 0].float() - want).abs().max() / want.abs().max()).item())
    ok = worst <= TOLERANCE and list(swa_lens.tolist()) == [128, 128] and list(c_lens.tolist()) == [2, 1]
    print(f"engine functions: max error {worst:.2e} of the output scale (tolerance {TOLERANCE:g}): "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
