"""Prefix caching: prefill of a prompt that starts with a cached prefix, cold vs from a hold.

V4-Flash-shaped attention layers (one of each kind, as in ``bench_model``), fp8_ds_mla caches.
For a prefix of P tokens and a tail of T tokens: the attention of every layer over the whole
prompt (cold: P + T tokens in one step) against a request started from a hold of the P-token
prefix (T tokens in one step), plus the host cost of taking a hold and starting a request from
it, and the bytes a hold keeps beyond what a finished request would (its window blocks).

    python -m benchmarks.bench_prefix            # H200
    python -m benchmarks.bench_prefix --small    # toy sizes on CPU (checks the script runs)
"""

from __future__ import annotations

import time

import torch

from benchmarks.bench_model import flash_config, make_layers
from benchmarks.common import Row, base_parser, median_us, print_table, serving_setup
from dsv4attn.serving.engine import PagedAttentionEngine


def _run_step(eng: PagedAttentionEngine, feed: dict, x: torch.Tensor) -> None:
    plan = eng.begin_step(feed)
    for i in range(len(eng.layers)):
        eng.run_layer(i, x[:plan.num_tokens])
    eng.abort_step()


def prefix_rows(layers, dev, prefix: int, tail: int) -> list[Row]:
    hs = layers[0].config.hidden_size
    total = prefix + tail
    eng = PagedAttentionEngine(layers, "fp8_ds_mla", num_blocks=4 * (-(-total // 256)) + 8, device=dev,
                               max_num_batched_tokens=total, max_model_len=total, max_num_reqs=4,
                               max_cached_prefixes=2)
    x = torch.randn(total, hs, device=dev, dtype=layers[0].sinks.dtype)
    eng.begin_step({"a": prefix})
    for i in range(len(layers)):
        eng.run_layer(i, x[:prefix])
    t0 = time.perf_counter()
    hold = eng.save_prefix("a", prefix)
    save_us = (time.perf_counter() - t0) * 1e6
    eng.end_step()
    eng.free("a")
    cold = median_us(lambda: _run_step(eng, {"cold": total}, x))

    def hot() -> None:
        eng.add_request("hot", hold)
        _run_step(eng, {"hot": tail}, x)
        eng.free("hot")

    warm = median_us(hot)
    t0 = time.perf_counter()
    for _ in range(20):
        eng.add_request("h", hold)
        eng.free("h")
    start_us = (time.perf_counter() - t0) / 20 * 1e6
    per_block = {g.name: g.page_bytes_per_block for g in eng.manager.groups}
    window_bytes = sum(per_block[g.name] for g in eng.manager.groups if g.kind == "sliding"
                       for b in hold.block_ids(g.name) if b >= 0)
    return [
        Row(f"prefill {total} cold (all layers)", cold, extra={"tok/s": f"{total / (cold * 1e-6):.0f}"}),
        Row(f"prefill {tail} after a {prefix}-token hold", warm,
            extra={"speed-up": f"{cold / warm:.1f}x", "save us": f"{save_us:.0f}", "start us": f"{start_us:.0f}",
                   "window KiB held": f"{window_bytes / 1024:.0f}"}),
    ]


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="toy dims and sizes (CPU ok)")
    args = p.parse_args()
    dev, dtype, ceil = serving_setup(args)
    cfg = flash_config(("sliding", "csa", "hca"), args.small)
    layers = make_layers(cfg, dev, dtype)
    cases = [(256, 64)] if args.small else [(8192, 256), (8192, 1024), (32768, 1024)]
    rows: list[Row] = []
    for prefix, tail in cases:
        rows += prefix_rows(layers, dev, prefix, tail)
    print_table("prefix caching: prefill of the tail after a hold vs the whole prompt (fp8_ds_mla, 3 layers)",
                rows, ceil)


if __name__ == "__main__":
    main()
