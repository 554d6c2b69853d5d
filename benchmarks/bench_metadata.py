"""Benchmark: one whole per-step metadata build (all groups) in each form.

Cases: decode batches of 64 / 256 / 1024 tokens (one token per request) and one prefill chunk of
4096 tokens, at contexts 8K, 64K and 1M, with max_model_len = 1M (C128A row width 8192).
Forms: "full" (engine rows, 8192 int32 per token), "real" (rows up to the real context),
"range" (no rows). Columns: median time of ``StepMetadataBuilder.build`` called eagerly (host
launch overhead included), the same build captured once in a CUDA graph and replayed (the
device time an engine that captures its step pays; the persistent buffers make the build
capturable), bytes written (exact, from ``metadata_bytes_written``), GB/s of the eager call.
Block-id validation is off (as inside CUDA-graph capture); Triton and reference paths on GPU.

    python -m benchmarks.bench_metadata            # H200: < 60 s
    python -m benchmarks.bench_metadata --smoke    # tiny sizes, CPU ok (reference path)
"""

from __future__ import annotations

import torch

from benchmarks.common import Ceilings, Row, base_parser, graph_us, median_us, print_table
from dsv4attn.metadata import FORMS, BatchMetadata, MetadataConfig, StepMetadataBuilder


def make_batch(num_reqs: int, query_len: int, context: int, cfg: MetadataConfig, device) -> BatchMetadata:
    """``num_reqs`` requests of ``query_len`` tokens ending at position ``context - 1``."""
    swa_cols = -(-context // cfg.swa_block_size)
    mla_cols = -(-context // cfg.mla_block_size)
    swa = torch.arange(num_reqs * swa_cols, dtype=torch.int32, device=device).view(num_reqs, swa_cols)
    mla = torch.arange(num_reqs * mla_cols, dtype=torch.int32, device=device).view(num_reqs, mla_cols)
    t = num_reqs * query_len
    slot_mapping = torch.arange(t, dtype=torch.int64, device=device)
    return BatchMetadata.from_requests([query_len] * num_reqs, [context] * num_reqs,
                                       {"swa": swa, "full_mla": mla}, slot_mapping)


def graph_replay_us(build) -> float | None:
    """Median replay time of ``build()`` captured in a CUDA graph (None if it cannot be captured)."""
    try:
        return graph_us(build, warmup_ms=10, rep_ms=40)
    except Exception as e:  # report, do not hide: the column then reads "-"
        print(f"graph capture failed: {type(e).__name__}: {e}")
        return None


def _ctx(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K" if n >= 1 << 10 else str(n)


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        max_len, mnbt, contexts = 4096, 256, [512, 4096]
        cases = [("decode", 4, 1), ("decode", 16, 1), ("prefill", 1, 64)]
        impls = ["reference"]
    else:
        max_len, mnbt, contexts = 1 << 20, 8192, [8 << 10, 64 << 10, 1 << 20]
        cases = [("decode", 64, 1), ("decode", 256, 1), ("decode", 1024, 1), ("prefill", 1, 4096)]
        impls = ["triton", "reference"] if cuda else ["reference"]
    ceil = Ceilings() if (args.no_ceilings or not cuda) else Ceilings.measure()
    builders = {
        form: StepMetadataBuilder(MetadataConfig(
            max_num_batched_tokens=mnbt, max_num_reqs=1024, max_model_len=max_len, num_blocks=1 << 24,
            form=form, validate_block_ids=False), device)
        for form in FORMS
    }
    rows: list[Row] = []
    for context in contexts:
        for kind, num_reqs, query_len in cases:
            if query_len > context:
                continue
            batch = make_batch(num_reqs, query_len, context, builders["full"].config, device)
            full_bytes = None
            for form in FORMS:
                b = builders[form]
                for impl in impls:
                    step = b.build(batch, impl=impl)
                    us = median_us(lambda: b.build(batch, impl=impl), warmup_ms=10, rep_ms=40)
                    graph_us = graph_replay_us(lambda: b.build(batch, impl=impl)) if (
                        cuda and impl == "triton") else None
                    nbytes = step.total_bytes_written
                    full_bytes = nbytes if form == "full" else full_bytes
                    rows.append(Row(
                        f"{kind} T={batch.num_tokens} ctx={_ctx(context)} {form} {impl}", us, bytes=nbytes,
                        extra={"graph replay us": "-" if graph_us is None else f"{graph_us:.2f}",
                               "MiB written": f"{nbytes / 2**20:.3f}",
                               "x fewer than full": f"{full_bytes / nbytes:.1f}" if full_bytes else "-"},
                    ))
    print_table(f"metadata build per step (max_model_len {max_len}, max_num_batched_tokens {mnbt})", rows, ceil)


if __name__ == "__main__":
    main()
