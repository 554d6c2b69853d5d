"""Demo part 1: one synthetic mixed step through every metadata builder, in the three forms.

The step holds decodes at very different contexts (1 token to 640K), one padded decode row
(slot -1, as CUDA-graph padding produces), and a chunk of a long prefill. max_model_len is 1M,
the setting where engines' full-width C128A rows cost the most. Printed: what each group's
builder produced for a few tokens, and the bytes each form writes.

    python -m dsv4attn metadata-demo
"""

from __future__ import annotations

import torch

from dsv4attn.metadata.batch import GROUP_C4, GROUP_C128, GROUP_SWA, BatchMetadata
from dsv4attn.metadata.builders import FORMS, MetadataConfig, StepMetadataBuilder

MAX_MODEL_LEN = 1 << 20
NUM_BLOCKS = 1 << 15
#: (query_len, seq_len) per request; decodes first as the split requires.
REQUESTS = [(1, 1), (1, 5), (1, 130), (1, 3000), (1, 70_000), (1, 640_000), (1, 257), (512, 4096 + 512)]
PADDED_REQUEST = 6  # its decode row gets slot -1 (a padding row)


def _tables(num_reqs: int, gen: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """Random permuted block ids per group, wide enough for max_model_len."""
    widths = {GROUP_SWA: MAX_MODEL_LEN // 64, GROUP_C4: MAX_MODEL_LEN // 256, GROUP_C128: MAX_MODEL_LEN // 256}
    return {g: torch.randint(0, NUM_BLOCKS, (num_reqs, w), generator=gen, dtype=torch.int32).to(device)
            for g, w in widths.items()}


def build_demo_batch(device: torch.device) -> BatchMetadata:
    gen = torch.Generator().manual_seed(0)
    tables = _tables(len(REQUESTS), gen, device)
    batch = BatchMetadata.from_requests([q for q, _ in REQUESTS], [s for _, s in REQUESTS], tables, device=device)
    slots = batch.slot_mapping.clone()
    slots[PADDED_REQUEST] = -1
    return BatchMetadata.from_requests([q for q, _ in REQUESTS], [s for _, s in REQUESTS], tables,
                                       slot_mapping=slots, device=device)


def _fmt_row(row: torch.Tensor, n: int) -> str:
    vals = row[: min(n, 6)].tolist()
    more = f" ... ({n} valid)" if n > 6 else ""
    return f"{vals}{more}"


def run(device: torch.device | None = None) -> dict[str, int]:
    """Print the summary; returns total bytes written per form."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch = build_demo_batch(device)
    print(f"step: {batch.num_reqs} requests, {batch.num_tokens} tokens "
          f"({batch.num_decode_tokens} decode, {batch.num_tokens - batch.num_decode_tokens} prefill), "
          f"max_model_len {MAX_MODEL_LEN:,}, device {device}")
    totals = {}
    for form in FORMS:
        cfg = MetadataConfig(max_num_batched_tokens=1024, max_num_reqs=16, max_model_len=MAX_MODEL_LEN,
                             num_blocks=NUM_BLOCKS, form=form)
        step = StepMetadataBuilder(cfg, device).build(batch)
        totals[form] = step.total_bytes_written
        if form == "full":
            swa, c4, c128 = step.swa, step.compressed[4], step.compressed[128]
            # form "full" builds the decode rows and lengths
            assert swa.decode_lens is not None and c128.decode_lens is not None and c128.global_decode is not None
            print("\nper decode token (form 'full', engine-compatible):")
            print(f"  {'seq_len':>8} | {'SWA len':>7} | {'C4 slot':>8} | {'C128 len':>8} | first C128A global slots")
            for t, (_, s) in enumerate(REQUESTS[: batch.num_decode_tokens]):
                n128 = int(c128.decode_lens[t])
                print(f"  {s:>8} | {int(swa.decode_lens[t]):>7} | {int(c4.slot_mapping[t]):>8} | {n128:>8} | "
                      f"{_fmt_row(c128.global_decode[t], n128)}")
            print(f"  C128A row width {c128.global_decode.shape[1]} int32 per token whatever the context")
            pre = torch.nonzero(c4.slot_mapping[batch.num_decode_tokens:] >= 0).flatten()
            print(f"  prefill chunk: {batch.num_tokens - batch.num_decode_tokens} tokens, "
                  f"{len(pre)} of them close a C4A entry, "
                  f"{int((c128.slot_mapping[batch.num_decode_tokens:] >= 0).sum())} close a C128A entry")
    print("\nbytes written by one whole metadata build:")
    for form in FORMS:
        note = {"full": "engine-compatible full-width rows",
                "real": "rows up to each token's own aligned length",
                "range": "no index rows: (start, length) per token through the block table"}[form]
        print(f"  {form:>5}: {totals[form]:>12,} B   {totals['full'] / max(totals[form], 1):6.1f}x less than full   ({note})")
    return totals


if __name__ == "__main__":
    run()
