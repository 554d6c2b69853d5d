"""End-to-end demo: a stack of the three layer kinds serving a workload, checked against transformers.

A stack ``h <- h + layer_l(h)`` of one sliding, one CSA (r=4) and one HCA (r=128) layer with
random weights, each served by an :class:`AttentionRunner`, runs a workload of many requests
with random prompt lengths: each step schedules one decode token for every running request and
fills the rest of the token budget with prefill chunks (chunked prefill), on the default device.
When a request finishes it is freed, and every layer's outputs are compared with the reference
``transformers`` layer run on the same layer input for that whole request (per-kind error; the
reference's own bf16 error is shown for scale on the low-precision path).

Sizes: "small" (hidden 64, 4 heads x 80) always; "production" (64 heads x 512, window 128,
top-k 512, fp8_ds_mla pages, bf16) only on CUDA. CPU runs fp32 with "auto" pages.

    python -m dsv4attn layer-demo [--requests N] [--sizes small,production] [--seed S]
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from dsv4attn.config import AttentionConfig
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.serving.runner import AttentionRunner
from dsv4attn.testing.hf_oracle import hf_forward, hf_reference_layer, small_hf_config

#: Bytes of one fp8_ds_mla entry: a dense MLA cache stores one per token per layer.
DENSE_ENTRY_BYTES = 584


@dataclass
class DemoSize:
    name: str
    hf_overrides: dict
    prompt_lens: tuple[int, int]
    decode_lens: tuple[int, int]
    token_budget: int
    dtype: torch.dtype
    kv_cache_dtype: str


SMALL = DemoSize("small", {}, (1, 300), (1, 24), 256, torch.float32, "auto")
PRODUCTION = DemoSize(
    "production",
    dict(hidden_size=1024, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=256,
         o_groups=8, o_lora_rank=256, sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512,
         max_position_embeddings=65536,
         rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                          "beta_fast": 32, "beta_slow": 1}),
    (64, 3000), (1, 64), 4096, torch.bfloat16, "fp8_ds_mla",
)


@dataclass
class DemoResult:
    size: str
    device: str
    requests: int = 0
    tokens: int = 0
    steps: int = 0
    max_err: dict = field(default_factory=dict)
    ref_bf16_err: dict = field(default_factory=dict)
    tie_tokens: int = 0
    kv_bytes_per_token: float = 0.0
    kv_bytes_per_token_limit: float = 0.0
    dense_bytes_per_token: float = 0.0
    seconds: float = 0.0


def _held_bytes(runner: AttentionRunner) -> int:
    """Bytes of cache pages the runner's live requests hold (blocks x page bytes per group)."""
    total = 0
    for rid in runner.requests:
        for spec in runner.specs.values():
            total += runner.manager.num_held(rid, spec.group) * spec.page_bytes
    return total


def run_demo(size: DemoSize, num_requests: int, device: torch.device, seed: int = 0,
             progress: bool = True) -> DemoResult:
    """Serve ``num_requests`` random requests through the 3-layer stack and verify each one."""
    hf = small_hf_config(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                         **size.hf_overrides)
    cfg = AttentionConfig.from_hf(hf)
    refs = [hf_reference_layer(hf, i, seed=seed + i, device=device) for i in range(cfg.num_layers)]
    runners, dense = [], []
    max_len = size.prompt_lens[1] + size.decode_lens[1]
    for i, ref in enumerate(refs):
        layer = DeepseekV4Attention(cfg, i)
        layer.load_state_dict(ref.state_dict(), strict=True)
        dense.append(copy.deepcopy(layer).to(device))  # fp32: finds tie-ambiguous top-k tokens
        layer = layer.to(device=device, dtype=size.dtype)
        # steady state per request: its compressed blocks + ~3 SWA + <= 17 state blocks; one step's
        # prefill chunks also hold state blocks for every new token (4 or 8 tokens per block)
        num_blocks = num_requests * (-(-max_len // 256) + 24) + size.token_budget // 2 + 64
        runners.append(AttentionRunner(layer, size.kv_cache_dtype, num_blocks=num_blocks, device=device,
                                       max_num_batched_tokens=size.token_budget + num_requests,
                                       max_model_len=max_len, max_num_reqs=num_requests))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    seqs, prompt = {}, {}
    for r in range(num_requests):
        prompt[r] = rng.randint(*size.prompt_lens)
        seqs[r] = torch.randn(prompt[r] + rng.randint(*size.decode_lens), cfg.hidden_size, generator=gen)
    res = DemoResult(size.name, str(device), requests=num_requests, tokens=sum(x.shape[0] for x in seqs.values()))
    done_pos = {r: 0 for r in seqs}
    # per layer: inputs, outputs
    layer_io: dict[int, list[list[torch.Tensor]]] = {r: [[] for _ in range(2 * cfg.num_layers)] for r in seqs}
    waiting, running = list(seqs), list[int]()
    bar = _progress(res.tokens, progress)
    t0 = time.perf_counter()
    peak = (0, 1)
    while waiting or running:
        chunks = {}
        for r in running:  # decode: one token each, after the prompt
            if done_pos[r] >= prompt[r]:
                chunks[r] = 1
        budget = size.token_budget - len(chunks)
        for r in list(running) + list(waiting):  # chunked prefill fills the budget
            if budget <= 0:
                break
            if r in chunks or done_pos[r] >= prompt[r]:
                continue
            n = min(budget, prompt[r] - done_pos[r])
            chunks[r] = n
            budget -= n
            if r in waiting:
                waiting.remove(r)
                running.append(r)
        h: dict[Hashable, torch.Tensor] = {r: seqs[r][done_pos[r]:done_pos[r] + n].to(device=device, dtype=size.dtype)
                                           for r, n in chunks.items()}
        for li, runner in enumerate(runners):
            out = runner.step(h)
            for r in chunks:
                layer_io[r][2 * li].append(h[r].float().cpu())
                layer_io[r][2 * li + 1].append(out[r].float().cpu())
            h = {r: h[r] + out[r] for r in chunks}
        res.steps += 1
        live = sum(done_pos[r] + chunks.get(r, 0) for r in running)
        if live > peak[1]:  # cache bytes per resident token, at the most-resident step
            peak = (sum(_held_bytes(rn) for rn in runners), live)
        for r, n in chunks.items():
            done_pos[r] += n
            bar(n)
            if done_pos[r] == seqs[r].shape[0]:
                running.remove(r)
                for rn in runners:
                    rn.free(r)
                _verify(r, layer_io.pop(r), refs, dense, cfg, size, res)
    res.seconds = time.perf_counter() - t0
    res.kv_bytes_per_token = peak[0] / peak[1]
    res.dense_bytes_per_token = DENSE_ENTRY_BYTES * cfg.num_layers
    # long-context limit: only the full (growing) group's pages scale with the sequence
    res.kv_bytes_per_token_limit = sum(s.page_bytes / s.tokens_per_block for rn in runners
                                       for s in rn.specs.values() if s.group == "full_mla")
    bar(0, close=True)
    return res


def _verify(rid, io, refs, dense, cfg, size, res) -> None:
    """Compare every layer's outputs of one finished request with the reference layer.

    Tokens whose indexer top-k has a tie at the boundary (exact ReLU zeros) are skipped: any
    tie-break is right there and the reference's is arbitrary; they are counted instead.
    """
    for li, ref in enumerate(refs):
        kind = cfg.layer_kinds[li]
        x = torch.cat(io[2 * li])
        got = torch.cat(io[2 * li + 1])
        dev = next(ref.parameters()).device
        gold = hf_forward(ref, x.to(dev)).float().cpu()
        keep = ~dense[li].topk_ambiguous(x.to(dev)).cpu()
        res.tie_tokens += int((~keep).sum())
        err = (got[keep] - gold[keep]).abs().max().item() / max(gold.abs().max().item(), 1e-6)
        res.max_err[kind] = max(res.max_err.get(kind, 0.0), err)
        if size.dtype != torch.float32:
            low = copy.deepcopy(ref).to(size.dtype)
            ref_err = (hf_forward(low, x.to(dev, size.dtype)).float().cpu() - gold).abs().max().item()
            res.ref_bf16_err[kind] = max(res.ref_bf16_err.get(kind, 0.0), ref_err / max(gold.abs().max().item(), 1e-6))
            del low


def _progress(total: int, enabled: bool):
    """A progress callback ``bar(n, close=False)``: tqdm when installed, else a plain line."""
    if not enabled:
        return lambda n, close=False: None
    try:
        from tqdm import tqdm

        t = tqdm(total=total, unit="tok", leave=False)

        def bar(n, close=False):
            t.update(n)
            if close:
                t.close()
        return bar
    except ImportError:
        state = {"done": 0}

        def bar(n, close=False):
            state["done"] += n
            print(f"\r{state['done']}/{total} tokens", end="\n" if close else "", flush=True)
        return bar


def format_table(results: list[DemoResult]) -> str:
    kinds = ("sliding", "csa", "hca")
    head = ["size", "device", "requests", "tokens", "steps",
            *[f"max rel err {k}" for k in kinds], *[f"ref bf16 err {k}" for k in kinds],
            "tie tokens", "KV B/token (peak)", "KV B/token (long ctx)", "dense MLA B/token", "time s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r.size, r.device, str(r.requests), str(r.tokens), str(r.steps),
                 *[f"{r.max_err.get(k, float('nan')):.2e}" for k in kinds],
                 *[f"{r.ref_bf16_err[k]:.2e}" if k in r.ref_bf16_err else "-" for k in kinds],
                 str(r.tie_tokens), f"{r.kv_bytes_per_token:.0f}", f"{r.kv_bytes_per_token_limit:.0f}",
                 f"{r.dense_bytes_per_token:.0f}", f"{r.seconds:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--sizes", default=None, help="comma list of small,production (default: what the device allows)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = args.sizes.split(",") if args.sizes else (["small", "production"] if device.type == "cuda" else ["small"])
    sizes = {"small": SMALL, "production": PRODUCTION}
    results = []
    for name in names:
        results.append(run_demo(sizes[name], args.requests, device, args.seed, progress=not args.no_progress))
        if len(names) > 1:  # a table per size as it finishes, then all together
            print(format_table(results[-1:]), flush=True)
    print("\n" + format_table(results))


if __name__ == "__main__":
    main()
